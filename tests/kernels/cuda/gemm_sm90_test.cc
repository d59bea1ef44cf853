// lossd's Hopper GEMM (kernels/cuda/gemm_sm90.h) against a float64 host
// product on small, ragged and multi-wave shapes, with bf16 and fp32 Z, with
// and without the two-block cluster. Skips without an sm_90 GPU.
#include "kernels/cuda/gemm_sm90.h"

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace lossd {
namespace cuda_gemm {
namespace {

uint16_t ToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fff + ((u >> 16) & 1);  // round to nearest even (finite inputs)
  return static_cast<uint16_t>(u >> 16);
}
float FromBf16(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// The reason to skip, or "" when the current device runs the kernel.
std::string SkipReason() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();
    return "no CUDA GPU visible";
  }
  int major = 0, minor = 0;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0);
  if (major != 9 || minor != 0) return "the GEMM needs an sm_90 GPU";
  return "";
}

struct Case {
  int64_t rows, cols, depth, z_stride;
  ZType z_type;
  int cluster;
  GemmSm90Schedule schedule = GemmSm90Schedule::kPolicy;
};

std::string Name(const Case& c) {
  return std::to_string(c.rows) + "x" + std::to_string(c.depth) + "x" +
         std::to_string(c.cols) + " stride " + std::to_string(c.z_stride) +
         (c.z_type == ZType::kBFloat16 ? " bf16" : " fp32") + " cluster " +
         std::to_string(c.cluster) + " schedule " +
         std::to_string(static_cast<int>(c.schedule));
}

// Runs one case and checks every element of Z against float64, and that the
// columns of Z's stride past `cols` keep their sentinel.
void Check(const Case& c, uint32_t seed) {
  SCOPED_TRACE(Name(c));
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  std::vector<uint16_t> x(c.rows * c.depth), w(c.cols * c.depth);
  for (auto& v : x) v = ToBf16(u(gen));
  for (auto& v : w) v = ToBf16(u(gen));
  const size_t es = c.z_type == ZType::kBFloat16 ? 2 : 4;
  const size_t z_bytes = c.rows * c.z_stride * es;
  void *dx = nullptr, *dw = nullptr, *dz = nullptr;
  ASSERT_EQ(cudaMalloc(&dx, x.size() * 2), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dw, w.size() * 2), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dz, z_bytes), cudaSuccess);
  cudaMemcpy(dx, x.data(), x.size() * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(dw, w.data(), w.size() * 2, cudaMemcpyHostToDevice);
  cudaMemset(dz, 0x7f, z_bytes);  // sentinel: 0x7f7f... in either type

  GemmSm90Args args;
  args.x = dx;
  args.w = dw;
  args.z = dz;
  args.rows = c.rows;
  args.cols = c.cols;
  args.depth = c.depth;
  args.z_stride = c.z_stride;
  args.z_type = c.z_type;
  args.cluster = c.cluster;
  args.schedule = c.schedule;
  EXPECT_EQ(GemmSm90(args, nullptr), cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<unsigned char> z(z_bytes);
  cudaMemcpy(z.data(), dz, z_bytes, cudaMemcpyDeviceToHost);
  cudaFree(dx);
  cudaFree(dw);
  cudaFree(dz);

  std::vector<float> xf(x.size()), wf(w.size());
  for (size_t i = 0; i < x.size(); ++i) xf[i] = FromBf16(x[i]);
  for (size_t i = 0; i < w.size(); ++i) wf[i] = FromBf16(w[i]);
  int64_t bad = 0;
  for (int64_t r = 0; r < c.rows; ++r) {
    for (int64_t col = 0; col < c.z_stride; ++col) {
      const int64_t at = r * c.z_stride + col;
      float got;
      uint32_t bits;
      if (c.z_type == ZType::kBFloat16) {
        uint16_t h;
        std::memcpy(&h, &z[at * 2], 2);
        got = FromBf16(h);
        bits = h;
      } else {
        std::memcpy(&got, &z[at * 4], 4);
        std::memcpy(&bits, &z[at * 4], 4);
      }
      if (col >= c.cols) {
        const uint32_t sentinel =
            c.z_type == ZType::kBFloat16 ? 0x7f7fu : 0x7f7f7f7fu;
        if (bits != sentinel && ++bad <= 5) {
          ADD_FAILURE() << "wrote past the row at " << r << ", " << col;
        }
        continue;
      }
      double ref = 0, mag = 0;
      const float* xr = &xf[r * c.depth];
      const float* wr = &wf[col * c.depth];
      for (int64_t k = 0; k < c.depth; ++k) {
        ref += static_cast<double>(xr[k]) * wr[k];
        mag += std::fabs(static_cast<double>(xr[k]) * wr[k]);
      }
      // fp32 accumulation, then (bf16 Z) one rounding to 8 bits.
      double tol = 1e-5 * mag + 1e-30;
      if (c.z_type == ZType::kBFloat16) tol += std::fabs(ref) / 256;
      if (!(std::fabs(got - ref) <= tol) && ++bad <= 5) {
        ADD_FAILURE() << "Z[" << r << ", " << col << "] = " << got
                      << ", float64 " << ref;
      }
    }
  }
  EXPECT_EQ(bad, 0);
}

class GemmSm90Test : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string why = SkipReason();
    if (!why.empty()) GTEST_SKIP() << why;
  }
};

// Z rows of whole 16-byte pieces (stride and row) go out by TMA
// (ZByTensorStore), others from the registers; the cases cover both with
// each Z type, and the columns between a row's end and its stride.
TEST_F(GemmSm90Test, OneRowAndAFewColumns) {
  for (int cluster : {1, 2}) {
    Check({1, 7, 64, 7, ZType::kBFloat16, cluster}, 1);    // registers
    Check({1, 7, 64, 8, ZType::kFloat32, cluster}, 2);     // registers
    Check({1, 8, 64, 16, ZType::kBFloat16, cluster}, 11);  // TMA
    Check({1, 4, 64, 8, ZType::kFloat32, cluster}, 12);    // TMA
  }
}

TEST_F(GemmSm90Test, RaggedTilesAndDepth) {
  // 72 is a whole number of 16-byte rows but not of 64-wide depth blocks.
  for (int cluster : {1, 2}) {
    Check({200, 300, 72, 304, ZType::kBFloat16, cluster}, 3);   // registers
    Check({200, 296, 72, 304, ZType::kBFloat16, cluster}, 13);  // TMA
    Check({200, 300, 72, 304, ZType::kFloat32, cluster}, 4);    // TMA
  }
}

TEST_F(GemmSm90Test, OddColumnsAndStrideStoreSingly) {
  for (int cluster : {1, 2}) {
    Check({130, 257, 128, 259, ZType::kBFloat16, cluster}, 5);
    Check({130, 257, 128, 257, ZType::kFloat32, cluster}, 6);
  }
}

TEST_F(GemmSm90Test, MoreTilesThanBlocksWithAnOddRowTileCount) {
  // 11 x 18 tiles: each block takes several, and the second block of the
  // last cluster unit has no rows.
  for (int cluster : {1, 2}) {
    Check({1300, 4496, 32, 4504, ZType::kBFloat16, cluster}, 7);  // TMA
    Check({1300, 4500, 32, 4500, ZType::kFloat32, cluster}, 9);   // TMA
  }
  Check({1300, 4500, 32, 4504, ZType::kBFloat16, 2}, 10);  // registers
}

TEST_F(GemmSm90Test, PolicyClusterSize) {
  Check({300, 600, 64, 600, ZType::kBFloat16, 0}, 14);
  Check({300, 600, 64, 600, ZType::kFloat32, 0}, 15);
}

// Both schedules explicitly (the cases above take the policy's): ragged
// tiles, a single row (the second warpgroup's half empty), odd columns from
// the registers, more tiles than blocks, a deep product.
TEST_F(GemmSm90Test, BothSchedules) {
  for (GemmSm90Schedule schedule :
       {GemmSm90Schedule::kCooperative, GemmSm90Schedule::kPingPong}) {
    Check({1, 8, 64, 16, ZType::kBFloat16, 2, schedule}, 21);
    Check({70, 300, 72, 304, ZType::kFloat32, 2, schedule}, 22);
    Check({200, 296, 72, 304, ZType::kBFloat16, 2, schedule}, 23);
    Check({130, 257, 128, 259, ZType::kBFloat16, 2, schedule}, 24);
    Check({1300, 4496, 32, 4504, ZType::kBFloat16, 2, schedule}, 25);
    Check({256, 512, 1024, 512, ZType::kFloat32, 2, schedule}, 26);
  }
}

TEST_F(GemmSm90Test, DeepProduct) {
  Check({256, 512, 1024, 512, ZType::kFloat32, 2}, 8);
}

TEST_F(GemmSm90Test, RefusesWhatThePolicyRefuses) {
  GemmSm90Args args;
  args.x = args.w = args.z = reinterpret_cast<void*>(uintptr_t{256});
  args.rows = 4;
  args.cols = 4;
  args.depth = 12;  // rows of 24 bytes: no tensor map
  args.z_stride = 4;
  EXPECT_EQ(GemmSm90(args, nullptr), cudaErrorNotSupported);
  args.depth = 16;
  args.cluster = 3;  // neither 0 (the policy's), 1 nor 2
  EXPECT_EQ(GemmSm90(args, nullptr), cudaErrorInvalidValue);
  args.cluster = 1;  // ping-pong runs two blocks a cluster only
  args.schedule = GemmSm90Schedule::kPingPong;
  EXPECT_EQ(GemmSm90(args, nullptr), cudaErrorInvalidValue);
}

}  // namespace
}  // namespace cuda_gemm
}  // namespace lossd
