// lossd's Hopper GEMM (kernels/cuda/gemm_sm90.h) against cuBLASLt (through
// the project's loader) for Z = X W^T at the linear cross-entropy's shapes,
// in one process with CUDA events: the first stage of issue 30.
//
// Usage: gemm_bench [--reps=N] [--quick] (small shapes, for a smoke run)
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

#include "bench/cuda_check.h"
#include "kernels/cuda/gemm_sm90.h"

namespace lossd {
namespace {

// Deterministic pseudo-random values in [-1, 1) (a hash of the index).
__global__ void FillBf16(__nv_bfloat16* out, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    uint64_t x = i * 0x9E3779B97F4A7C15ull + seed * 0xBF58476D1CE4E5B9ull;
    x ^= x >> 31;
    x *= 0x94D049BB133111EBull;
    x ^= x >> 29;
    out[i] = __float2bfloat16_rn(
        static_cast<float>(x >> 40) * (2.0f / 16777216.0f) - 1.0f);
  }
}

template <typename T>
__device__ float AsFloat(T v);
template <>
__device__ float AsFloat(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <>
__device__ float AsFloat(float v) {
  return v;
}

// out[0] = max |a - b|, out[1] = max |b| (non-negative floats order as
// their bits do).
template <typename T>
__global__ void MaxDiff(const T* a, const T* b, int64_t n, unsigned* out) {
  float diff = 0, mag = 0;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const float x = AsFloat(a[i]), y = AsFloat(b[i]);
    diff = fmaxf(diff, fabsf(x - y));
    mag = fmaxf(mag, fabsf(y));
  }
  atomicMax(&out[0], __float_as_uint(diff));
  atomicMax(&out[1], __float_as_uint(mag));
}

struct Shape {
  int64_t rows, depth, cols;
};

// cuBLASLt's Z [rows, cols] row-major, as the column-major Z^T = W X^T.
class LtProduct {
 public:
  LtProduct(cublasLtHandle_t handle, const Shape& s, cudaDataType_t z_type,
            size_t workspace_bytes)
      : handle_(handle), workspace_bytes_(workspace_bytes) {
    CHECK_CUBLAS(
        cublasLtMatmulDescCreate(&op_, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t t = CUBLAS_OP_T, n = CUBLAS_OP_N;
    CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(
        op_, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof(t)));
    CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(
        op_, CUBLASLT_MATMUL_DESC_TRANSB, &n, sizeof(n)));
    CHECK_CUBLAS(
        cublasLtMatrixLayoutCreate(&a_, CUDA_R_16BF, s.depth, s.cols, s.depth));
    CHECK_CUBLAS(
        cublasLtMatrixLayoutCreate(&b_, CUDA_R_16BF, s.depth, s.rows, s.depth));
    CHECK_CUBLAS(
        cublasLtMatrixLayoutCreate(&d_, z_type, s.cols, s.rows, s.cols));
    cublasLtMatmulPreference_t pref;
    CHECK_CUBLAS(cublasLtMatmulPreferenceCreate(&pref));
    CHECK_CUBLAS(cublasLtMatmulPreferenceSetAttribute(
        pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes,
        sizeof(workspace_bytes)));
    int found = 0;
    CHECK_CUBLAS(cublasLtMatmulAlgoGetHeuristic(handle, op_, a_, b_, d_, d_,
                                                pref, 1, &heuristic_, &found));
    cublasLtMatmulPreferenceDestroy(pref);
    if (found == 0) {
      std::fprintf(stderr, "no cuBLASLt algorithm\n");
      std::abort();
    }
  }
  ~LtProduct() {
    cublasLtMatrixLayoutDestroy(a_);
    cublasLtMatrixLayoutDestroy(b_);
    cublasLtMatrixLayoutDestroy(d_);
    cublasLtMatmulDescDestroy(op_);
  }
  void Run(const void* x, const void* w, void* z, void* workspace) const {
    const float one = 1, zero = 0;
    CHECK_CUBLAS(cublasLtMatmul(handle_, op_, &one, w, a_, x, b_, &zero, z, d_,
                                z, d_, &heuristic_.algo, workspace,
                                workspace_bytes_, nullptr));
  }

 private:
  cublasLtHandle_t handle_;
  size_t workspace_bytes_;
  cublasLtMatmulDesc_t op_ = nullptr;
  cublasLtMatrixLayout_t a_ = nullptr, b_ = nullptr, d_ = nullptr;
  cublasLtMatmulHeuristicResult_t heuristic_ = {};
};

// Median milliseconds of `reps` runs of each of `fs`, each run between its
// own events, after two warm-up runs each. The functions take turns within a
// repetition, so that all of them see the same clocks and temperature.
std::vector<float> MedianMs(int reps,
                            const std::vector<std::function<void()>>& fs) {
  const size_t n = fs.size();
  for (const auto& f : fs) {
    f();
    f();
  }
  std::vector<cudaEvent_t> ev(2 * reps * n);
  for (auto& e : ev) CHECK_CUDA(cudaEventCreate(&e));
  for (int i = 0; i < reps; ++i) {
    for (size_t j = 0; j < n; ++j) {
      CHECK_CUDA(cudaEventRecord(ev[2 * (i * n + j)]));
      fs[j]();
      CHECK_CUDA(cudaEventRecord(ev[2 * (i * n + j) + 1]));
    }
  }
  CHECK_CUDA(cudaEventSynchronize(ev.back()));
  std::vector<float> medians(n);
  for (size_t j = 0; j < n; ++j) {
    std::vector<float> ms(reps);
    for (int i = 0; i < reps; ++i) {
      CHECK_CUDA(cudaEventElapsedTime(&ms[i], ev[2 * (i * n + j)],
                                      ev[2 * (i * n + j) + 1]));
    }
    std::sort(ms.begin(), ms.end());
    medians[j] = ms[reps / 2];
  }
  for (auto& e : ev) cudaEventDestroy(e);
  return medians;
}

void Bench(const Shape& s, cuda_gemm::ZType z_type, int reps,
           cublasLtHandle_t handle) {
  const bool bf16 = z_type == cuda_gemm::ZType::kBFloat16;
  const size_t es = bf16 ? 2 : 4;
  void *x, *w, *z, *z_ref, *workspace;
  unsigned* diff;
  const size_t workspace_bytes = size_t{32} << 20;
  CHECK_CUDA(cudaMalloc(&x, s.rows * s.depth * 2));
  CHECK_CUDA(cudaMalloc(&w, s.cols * s.depth * 2));
  CHECK_CUDA(cudaMalloc(&z, s.rows * s.cols * es));
  CHECK_CUDA(cudaMalloc(&z_ref, s.rows * s.cols * es));
  CHECK_CUDA(cudaMalloc(&workspace, workspace_bytes));
  CHECK_CUDA(cudaMalloc(&diff, 2 * sizeof(unsigned)));
  FillBf16<<<1024, 256>>>(static_cast<__nv_bfloat16*>(x), s.rows * s.depth, 1);
  FillBf16<<<1024, 256>>>(static_cast<__nv_bfloat16*>(w), s.cols * s.depth, 2);
  CHECK_CUDA(cudaGetLastError());

  const LtProduct lt(handle, s, bf16 ? CUDA_R_16BF : CUDA_R_32F,
                     workspace_bytes);
  const double flop = 2.0 * s.rows * s.depth * s.cols;
  cuda_gemm::GemmSm90Args args;
  args.x = x;
  args.w = w;
  args.z = z;
  args.rows = s.rows;
  args.cols = s.cols;
  args.depth = s.depth;
  args.z_stride = s.cols;
  args.z_type = z_type;
  // Each way: its cluster size and schedule.
  struct Way {
    int cluster;
    cuda_gemm::GemmSm90Schedule schedule;
    const char* name;
  };
  const Way ways[3] = {
      {1, cuda_gemm::GemmSm90Schedule::kCooperative, "cooperative"},
      {2, cuda_gemm::GemmSm90Schedule::kCooperative, "cooperative"},
      {2, cuda_gemm::GemmSm90Schedule::kPingPong, "ping-pong"}};
  std::vector<std::function<void()>> runs = {
      [&] { lt.Run(x, w, z_ref, workspace); }};
  for (const Way& way : ways) {
    runs.push_back([&args, &z, way] {
      cuda_gemm::GemmSm90Args a = args;
      a.cluster = way.cluster;
      a.schedule = way.schedule;
      a.z = z;
      CHECK_CUDA(cuda_gemm::GemmSm90(a, nullptr));
    });
  }
  const std::vector<float> ms = MedianMs(reps, runs);
  const int chosen = cuda_gemm::GemmSm90Cluster(cuda_gemm::ShapeOf(args));
  const cuda_gemm::GemmSm90Schedule chosen_schedule =
      cuda_gemm::GemmSm90ScheduleFor(cuda_gemm::ShapeOf(args), chosen);
  std::printf("%lld x %lld x %lld %s: cuBLASLt %.3f ms (%.0f TFLOP/s)\n",
              static_cast<long long>(s.rows), static_cast<long long>(s.depth),
              static_cast<long long>(s.cols), bf16 ? "bf16 Z" : "fp32 Z", ms[0],
              flop / ms[0] * 1e-9);
  for (int c = 0; c < 3; ++c) {
    // Each variant's own Z against cuBLASLt's.
    CHECK_CUDA(cudaMemset(z, 0, s.rows * s.cols * es));
    runs[1 + c]();
    CHECK_CUDA(cudaMemset(diff, 0, 2 * sizeof(unsigned)));
    if (bf16) {
      MaxDiff<<<1024, 256>>>(static_cast<const __nv_bfloat16*>(z),
                             static_cast<const __nv_bfloat16*>(z_ref),
                             s.rows * s.cols, diff);
    } else {
      MaxDiff<<<1024, 256>>>(static_cast<const float*>(z),
                             static_cast<const float*>(z_ref), s.rows * s.cols,
                             diff);
    }
    unsigned host[2];
    CHECK_CUDA(cudaMemcpy(host, diff, sizeof(host), cudaMemcpyDeviceToHost));
    float d, m;
    std::memcpy(&d, &host[0], 4);
    std::memcpy(&m, &host[1], 4);
    std::printf(
        "  lossd sm90 cluster %d %s%s: %.3f ms (%.0f TFLOP/s), %.3fx "
        "cuBLASLt; max |Z - cuBLASLt's| %.3g of max |Z| %.3g\n",
        ways[c].cluster, ways[c].name,
        ways[c].cluster == chosen && ways[c].schedule == chosen_schedule
            ? " (policy)"
            : "",
        ms[1 + c], flop / ms[1 + c] * 1e-9, ms[1 + c] / ms[0], d, m);
  }
  cudaFree(x);
  cudaFree(w);
  cudaFree(z);
  cudaFree(z_ref);
  cudaFree(workspace);
  cudaFree(diff);
}

}  // namespace
}  // namespace lossd

int main(int argc, char** argv) {
  int reps = 10;
  bool quick = false;
  bool bf16_only = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--reps=", 7) == 0) reps = std::atoi(argv[i] + 7);
    if (std::strcmp(argv[i], "--quick") == 0) quick = true;
    if (std::strcmp(argv[i], "--bf16") == 0) bf16_only = true;
  }
  reps = std::max(reps, 1);
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("%s, %d SMs\n", prop.name, prop.multiProcessorCount);
  cublasLtHandle_t handle;
  CHECK_CUBLAS(cublasLtCreate(&handle));
  std::vector<lossd::Shape> shapes = {{16384, 4096, 131072},
                                      {8192, 4096, 128256}};
  if (quick) shapes = {{1024, 1024, 4096}, {1000, 512, 5000}};
  for (const auto& s : shapes) {
    for (auto t : {lossd::cuda_gemm::ZType::kBFloat16,
                   lossd::cuda_gemm::ZType::kFloat32}) {
      if (bf16_only && t != lossd::cuda_gemm::ZType::kBFloat16) continue;
      lossd::Bench(s, t, reps, handle);
    }
  }
  return 0;
}
