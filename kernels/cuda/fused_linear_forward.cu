// The linear cross-entropy's forward in the Hopper GEMM's epilogue
// (fused_linear_forward.h): the statistics epilogue, the merge of a row's
// tiles, and the launch between the cross-entropy's prepare and finalize.
#include <cuda.h>
#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <cstdint>

#include "kernels/cuda/dispatch.h"
#include "kernels/cuda/element_traits.cuh"
#include "kernels/cuda/fused_linear_forward.h"
#include "kernels/cuda/gemm_sm90.cuh"
#include "kernels/cuda/gemm_sm90.h"
#include "kernels/cuda/launch_params.h"
#include "kernels/cuda/row_math.cuh"
#include "kernels/cuda/schedules.h"

namespace lossd {
namespace {

using cuda_ce::Stats;

int ColumnTiles(int64_t vocab) {
  return static_cast<int>((vocab + cuda_gemm::kTileCols - 1) /
                          cuda_gemm::kTileCols);
}

// Shape: a consumer thread holds 64 values of each of two rows (8 apart) of
// a 128 x 256 tile of Z (FragmentCoords); the quad of lanes 4q .. 4q + 3
// holds a row's 256 columns. Each row's statistics over the tile (Stats: max
// at its first column, the sum of exp(z - max) over the other columns, sum
// of w_c z_c) are the thread's, then two quad shuffles, written by the quad's
// first lane to partials[row, tile]; the tile holding a row's target writes
// its z to p.row_zy. z = accumulator + bias, softcapped in build kOpts, and
// -inf past the vocabulary (never the max, exp() = 0). The exponentials are
// of (z - max) * log2e: z - max is exact near the max, where the terms count.
template <int kOpts>
struct LossStatsEpilogue {
  static constexpr int kStagingBytes = 0;  // no Z: the ring gets 4 stages
  cuda_ce::Params p;
  const float* bias;  // fp32 [vocab], or null
  int col_tiles;
  Stats* partials;  // [rows, col_tiles]

  __device__ __forceinline__ void operator()(
      float (&acc)[cuda_gemm::kFragmentValues],
      const cuda_gemm::FragmentCoords& at,
      const cuda_gemm::WarpgroupTile& wg) const {
    constexpr int kRowValues = cuda_gemm::kFragmentValues / 2;
    const int tile = wg.col / cuda_gemm::kTileCols;
    const int lane = wg.thread % 32;
    const int cols = p.vocab;
    const cuda_ce::ElementOptions opts = cuda_ce::MakeElementOptions(p);
    // Both rows' targets first, so that one load latency covers both; as
    // columns (-1 for none here: ignored, or past the vocabulary), as a
    // 64-bit compare an element cost registers the accumulator needs.
    int target[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = at.row + 8 * half;
      const long long y = r < p.rows ? cuda_ce::LoadTarget(p, r) : -1;
      target[half] = y >= 0 && y < cols ? static_cast<int>(y) : -1;
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = at.row + 8 * half;
      const bool row_in = r < p.rows;
      const int y = target[half];
      float m = -INFINITY;
      int arg = INT_MAX;
      float wz = 0.0f;
      // The row's values in column order (value i of the fragment is in the
      // row of half (i & 2) / 2): strict > keeps the first maximum.
#pragma unroll
      for (int j = 0; j < kRowValues; ++j) {
        const int i = (j >> 1) * 4 + 2 * half + (j & 1);
        const int c = at.ColOf(i);
        const bool in = c < cols;
        float z = acc[i];
        if (bias != nullptr && in) z += __ldg(bias + c);
        z = cuda_ce::OptionZ<float, kOpts>(opts, z);
        if ((kOpts & cuda_ce::kOptSmoothing) && in) {
          wz = fmaf(cuda_ce::OptionWeight<kOpts>(opts, c), z, wz);
        }
        if (c == y) p.row_zy[r] = z;
        z = in ? z : -INFINITY;
        acc[i] = z;
        if (z > m) {
          m = z;
          arg = c;
        }
      }
      // With no finite z the sum stays NaN if a NaN was seen, else the
      // empty slice's -1 (Stats).
      const float shift = m == -INFINITY ? 0.0f : m;
      float t = 0.0f;
#pragma unroll
      for (int j = 0; j < kRowValues; ++j) {
        const int i = (j >> 1) * 4 + 2 * half + (j & 1);
        if (at.ColOf(i) != arg) {
          t += cuda_ce::Exp2((acc[i] - shift) * cuda_ce::kLog2e);
        }
      }
      Stats s;
      s.m = m;
      s.t = m == -INFINITY && !isnan(t) ? -1.0f : t;
      s.sum_wz = wz;
      s.arg = arg;
      cuda_ce::ShuffleCombine(s, 1);
      cuda_ce::ShuffleCombine(s, 2);
      if (lane % 4 == 0 && row_in) {
        partials[static_cast<int64_t>(r) * col_tiles + tile] = s;
      }
    }
  }
  __device__ __forceinline__ void Finish(
      const cuda_gemm::WarpgroupTile&) const {}
};

constexpr int kMergeThreads = 256;

// One warp a row: each lane folds the tiles lane, lane + 32, ... in column
// order, the warp's butterfly merges the lanes (the same bits every run),
// then the cross-entropy's row math and outputs, as its schedules write
// them.
__global__ void __launch_bounds__(kMergeThreads)
    MergeTilesKernel(cuda_ce::Params p, const Stats* partials, int col_tiles) {
  const long long row =
      static_cast<long long>(blockIdx.x) * (kMergeThreads / 32) +
      threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= p.rows) return;
  const cuda_ce::WorkspaceHeader h = *p.header;
  if (h.error) return;  // a bad target: nothing is written
  Stats st = cuda_ce::EmptyStats();
  for (int k = lane; k < col_tiles; k += 32) {
    cuda_ce::Combine(st, partials[row * col_tiles + k]);
  }
  st = cuda_ce::WarpMergeStats(st);
  const long long y = cuda_ce::LoadTarget(p, row);
  const bool valid = y != p.ignore_index;
  const float zy = valid ? p.row_zy[row] : 0.0f;
  const cuda_ce::RowMath rm = cuda_ce::MakeRowMath(
      p, h, st, valid, zy, cuda_ce::TargetWeight(p, valid, y));
  if (lane == 0) cuda_ce::WriteRowOutputs(p, row, valid, y, rm, st.arg, true);
}

template <int kOpts>
cudaError_t LaunchStatsGemm(const CUtensorMap& x_map, const CUtensorMap& w_map,
                            const cuda_gemm::GemmSm90Args& gemm,
                            const cuda_ce::Params& p, const float* bias,
                            Stats* partials, cudaStream_t stream) {
  LossStatsEpilogue<kOpts> epilogue;
  epilogue.p = p;
  epilogue.bias = bias;
  epilogue.col_tiles = ColumnTiles(p.vocab);
  epilogue.partials = partials;
  return cuda_gemm::LaunchGemmSm90(x_map, w_map, gemm, epilogue, stream);
}

}  // namespace

std::size_t FusedLinearForwardWorkspaceBytes(int64_t rows, int64_t vocab) {
  const std::size_t n = rows > 0 ? static_cast<std::size_t>(rows) : 0;
  return CrossEntropyCudaWorkspaceBytes(rows) +
         cuda_ce::AlignUp(n * ColumnTiles(vocab) * sizeof(Stats));
}

cudaError_t FusedLinearForwardLaunch(const FusedLinearForwardArgs& args,
                                     CrossEntropyCudaResult* device_result,
                                     void* workspace,
                                     std::size_t workspace_bytes,
                                     cudaStream_t stream) {
  const CrossEntropyArgs& loss = args.loss;
  if (device_result == nullptr || loss.vocab <= 0 || loss.vocab > INT_MAX ||
      workspace_bytes <
          FusedLinearForwardWorkspaceBytes(loss.rows, loss.vocab)) {
    return cudaErrorInvalidValue;
  }
  cuda_gemm::GemmSm90Args gemm;
  gemm.x = args.x;
  gemm.w = args.weight;
  gemm.rows = loss.rows;
  gemm.cols = loss.vocab;
  gemm.depth = args.hidden;
  gemm.z_stride = loss.vocab;  // (no Z: its fields only pass the policy)
  gemm.z_type = cuda_gemm::ZType::kFloat32;
  CUtensorMap x_map, w_map;
  cudaError_t e = cuda_gemm::PrepareGemmSm90(&gemm, &x_map, &w_map);
  if (e != cudaSuccess) return e;
  const cuda_ce::Params p = cuda_ce::MakeParams(loss, workspace);
  auto* partials =
      reinterpret_cast<Stats*>(static_cast<char*>(workspace) +
                               CrossEntropyCudaWorkspaceBytes(loss.rows));
  e = cuda_ce::LaunchPrepare(p, stream);
  if (e != cudaSuccess) return e;
  e = cuda_ce::WithOptionBuild(cuda_ce::ElementOptionsOn(p), [&](auto build) {
    return LaunchStatsGemm<decltype(build)::value>(x_map, w_map, gemm, p,
                                                   args.bias, partials, stream);
  });
  if (e != cudaSuccess) return e;
  constexpr int kRowsPerBlock = kMergeThreads / 32;
  MergeTilesKernel<<<static_cast<unsigned>((loss.rows + kRowsPerBlock - 1) /
                                           kRowsPerBlock),
                     kMergeThreads, 0, stream>>>(p, partials,
                                                 ColumnTiles(loss.vocab));
  e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  return cuda_ce::LaunchFinalize(p, device_result, stream);
}

}  // namespace lossd
