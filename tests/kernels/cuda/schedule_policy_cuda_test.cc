// The schedule policy's device arithmetic against this GPU: the limits the
// dispatch queries, and SmemPiecesFit (pure) against SmemRowPiecesFit (the
// occupancy API on the kernel itself) over piece sizes and row pieces, every
// build. Skipped without a GPU.
#include <cuda_runtime_api.h>

#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/device_limits.h"
#include "kernels/cuda/launch_params.h"
#include "kernels/cuda/schedule_policy.h"
#include "kernels/cuda/schedules.h"
#include "tests/kernels/cuda/cross_entropy_cuda_test_util.h"

namespace lossd {
namespace cuda_ce_test {
namespace {

TEST_F(CudaCrossEntropyTest, PolicyDeviceLimits) {
  cuda_ce::DeviceLimits limits;
  ASSERT_EQ(cuda_ce::CurrentDeviceLimits(&limits), cudaSuccess);
  int device = 0, sms = 0;
  ASSERT_EQ(cudaGetDevice(&device), cudaSuccess);
  ASSERT_EQ(
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device),
      cudaSuccess);
  EXPECT_EQ(limits.sms, sms);
  EXPECT_GT(limits.smem_per_block_optin, 0);
  EXPECT_GE(limits.smem_per_sm, limits.smem_per_block_optin);
  cuda_ce::DeviceLimits again;
  ASSERT_EQ(cuda_ce::CurrentDeviceLimits(&again), cudaSuccess);
  EXPECT_EQ(again.smem_per_sm, limits.smem_per_sm);
}

TEST_F(CudaCrossEntropyTest, PolicySmemPiecesFitMatchesOccupancy) {
  cuda_ce::DeviceLimits limits;
  ASSERT_EQ(cuda_ce::CurrentDeviceLimits(&limits), cudaSuccess);
  struct Build {
    DType dtype;
    bool bulk;
    bool edges;
  };
  const std::vector<Build> builds = {
      {DType::kFloat32, true, false},   {DType::kFloat32, true, true},
      {DType::kBFloat16, true, false},  {DType::kBFloat16, true, true},
      {DType::kBFloat16, false, false}, {DType::kFloat16, false, false},
  };
  const std::vector<int> pieces = {1,
                                   4,
                                   cuda_ce::kMaxPieces,
                                   limits.sms,
                                   limits.sms * 3,
                                   limits.sms * 3 + 1,
                                   limits.sms * 4,
                                   limits.sms * 4 + 1};
  for (const Build& b : builds) {
    const int esize = b.dtype == DType::kFloat32 ? 4 : 2;
    // Piece sizes in 16-byte steps around each blocks-a-SM boundary would be
    // many launches of the query; 1 KiB steps, then 16-byte steps near the
    // top of a block's shared memory.
    std::vector<long long> sizes;
    for (long long s = 16; s <= limits.smem_per_block_optin + 1024; s += 1024) {
      sizes.push_back(s);
    }
    for (long long s = limits.smem_per_block_optin - 512;
         s <= limits.smem_per_block_optin; s += 16) {
      sizes.push_back(s);
    }
    for (long long bytes : sizes) {
      cuda_ce::Params p = {};
      p.chunk = static_cast<int>(bytes / esize);
      for (int n : pieces) {
        bool fits = false;
        ASSERT_EQ(
            cuda_ce::SmemRowPiecesFit(p, b.dtype, b.bulk, b.edges, n, &fits),
            cudaSuccess)
            << bytes;
        EXPECT_EQ(cuda_ce::SmemPiecesFit(bytes, n, b.bulk, limits), fits)
            << "dtype " << static_cast<int>(b.dtype) << " bulk " << b.bulk
            << " edges " << b.edges << " piece bytes " << bytes << " pieces "
            << n;
      }
    }
  }
}

}  // namespace
}  // namespace cuda_ce_test
}  // namespace lossd
