// Benchmark of the linear cross-entropy (issue 19) on the GPU: the three
// cuBLAS products alone (the floor the issue compares with) against lossd's
// forward + dX + dW, with the dW/dX error against an fp32 GPU reference.
//
// Usage: linear_cross_entropy_bench [--out=FILE.md] [--reps=N] [--quick]
//        [--few]  (default chunking of each precision only)
//        [--forward]  (forward-only: the fused forward against cuBLASLt and
//                      the fused cross-entropy, and the Z product alone)
//        [--gradient]  (the fused gradient path against the cuBLASLt path of
//                       the same precision; with --few the issue's two
//                       shapes only)
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <string>
#include <vector>

#include "bench/cuda_check.h"
#include "kernels/cpu/linear_cross_entropy_cpu.h"
#include "kernels/cuda/cross_entropy_cuda.h"
#include "kernels/cuda/gemm_sm90.h"
#include "kernels/cuda/linear_cross_entropy_lab.h"

namespace lossd {
namespace {

// Deterministic pseudo-random values (a hash of the index): never zeros.
__device__ float Uniform(uint64_t i, uint32_t seed) {
  uint64_t x = i * 0x9E3779B97F4A7C15ull + seed * 0xBF58476D1CE4E5B9ull;
  x ^= x >> 31;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 29;
  return static_cast<float>(x >> 40) * (1.0f / 16777216.0f) * 2.0f - 1.0f;
}

__global__ void FillBf16(__nv_bfloat16* out, int64_t n, float scale,
                         uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x)
    out[i] = __float2bfloat16_rn(Uniform(i, seed) * scale);
}

__global__ void Bf16ToFloat(const __nv_bfloat16* in, float* out, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x)
    out[i] = __bfloat162float(in[i]);
}

// Every ignore_every-th row (0: none) gets the default ignore_index, so that
// the mean's D is not a power of two.
__global__ void FillTargets(int64_t* out, int64_t n, int64_t vocab,
                            int ignore_every) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const float u = (Uniform(i, 77) + 1.0f) * 0.5f;
    const int64_t t = static_cast<int64_t>(u * vocab);
    out[i] = t < vocab ? t : vocab - 1;
    if (ignore_every > 0 && i % ignore_every == 0) out[i] = -100;
  }
}

// Partial sums of (a - b)^2 and b^2 per block, in double; a is bf16 or fp32.
template <typename T>
__global__ void ErrorSums(const T* a, const float* b, int64_t n,
                          double* partial) {
  __shared__ double num[256], den[256];
  double sn = 0.0, sd = 0.0;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const double x = static_cast<double>(static_cast<float>(a[i]));
    const double y = b[i];
    sn += (x - y) * (x - y);
    sd += y * y;
  }
  num[threadIdx.x] = sn;
  den[threadIdx.x] = sd;
  __syncthreads();
  for (int s = 128; s > 0; s /= 2) {
    if (threadIdx.x < s) {
      num[threadIdx.x] += num[threadIdx.x + s];
      den[threadIdx.x] += den[threadIdx.x + s];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    partial[2 * blockIdx.x] = num[0];
    partial[2 * blockIdx.x + 1] = den[0];
  }
}

__global__ void CountDifferences(const uint32_t* a, const uint32_t* b,
                                 int64_t n, unsigned long long* count) {
  unsigned long long c = 0;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x)
    c += a[i] != b[i];
  if (c) atomicAdd(count, c);
}

template <typename T>
double RelativeError(const T* a, const float* b, int64_t n) {
  constexpr int kBlocks = 1024;
  double* partial = nullptr;
  CHECK_CUDA(cudaMalloc(&partial, 2 * kBlocks * sizeof(double)));
  ErrorSums<T><<<kBlocks, 256>>>(a, b, n, partial);
  CHECK_CUDA(cudaGetLastError());
  std::vector<double> host(2 * kBlocks);
  CHECK_CUDA(cudaMemcpy(host.data(), partial, host.size() * sizeof(double),
                        cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaFree(partial));
  double num = 0.0, den = 0.0;
  for (int i = 0; i < kBlocks; ++i) {
    num += host[2 * i];
    den += host[2 * i + 1];
  }
  return std::sqrt(num / den);
}

void* Alloc(size_t bytes) {
  void* p = nullptr;
  CHECK_CUDA(cudaMalloc(&p, bytes));
  return p;
}

// Median of `reps` timed runs of fn (after `warmup` untimed), in ms.
template <typename F>
double MedianMs(int warmup, int reps, F fn) {
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  for (int i = 0; i < warmup; ++i) fn();
  std::vector<float> times;
  for (int i = 0; i < reps; ++i) {
    CHECK_CUDA(cudaEventRecord(start));
    fn();
    CHECK_CUDA(cudaEventRecord(stop));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float ms = 0.0f;
    CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
    times.push_back(ms);
  }
  std::sort(times.begin(), times.end());
  CHECK_CUDA(cudaEventDestroy(start));
  CHECK_CUDA(cudaEventDestroy(stop));
  return times[times.size() / 2];
}

struct Shape {
  int64_t n, h, v;
  float logit_std;       // spread of the logits: 2 is the issue's, 8 a peaked
                         // softmax (large G entries away from the target, where
                         // rounding G to bf16 shows)
  int ignore_every = 0;  // rows ignored (FillTargets)
};

struct Variant {
  const char* name;
  LinearPrecision precision;
  int64_t chunk_rows;
  float sparse_threshold = 0.0f;  // kSparseResidual's (0: its default)
  int sparse_slots = 0;
  // With a bias [V] and its gradient: timed only (the fp32 reference has
  // no bias, so the error columns do not apply).
  bool bias = false;
  // With loss options (timed only, as the bias): label smoothing, softcap,
  // z-loss.
  float label_smoothing = 0.0f;
  float softcap = 0.0f;
  float z_loss_scale = 0.0f;
  // The gradient's path: the policy's, cuBLASLt's, or the fused one.
  LinearFusedForward fused_gradient = LinearFusedForward::kAuto;
  // The Hopper GEMM's schedule on the fused paths.
  cuda_gemm::GemmSm90Schedule gemm_schedule =
      cuda_gemm::GemmSm90Schedule::kPolicy;
  bool options() const {
    return label_smoothing > 0 || softcap > 0 || z_loss_scale > 0;
  }
};

// The bench's problem: bf16 X [n, h] and W [v, h], int64 targets.
LinearCrossEntropyArgs BenchArgs(const Shape& s, const void* x, const void* w,
                                 const int64_t* targets) {
  LinearCrossEntropyArgs a;
  a.rows = s.n;
  a.hidden = s.h;
  a.vocab = s.v;
  a.dtype = DType::kBFloat16;
  a.x = x;
  a.weight = w;
  a.targets_dtype = DType::kInt64;
  a.targets = targets;
  return a;
}

// --gradient's rows: the default precision by each path, and the options
// (timed only).
const Variant kGradientVariants[] = {
    {"sparse residual, cuBLASLt Z + fused cross-entropy (before)",
     LinearPrecision::kSparseResidual, 0, 0.0f, 0, false, 0.0f, 0.0f, 0.0f,
     LinearFusedForward::kOff},
    {"fused gradient, cooperative GEMM", LinearPrecision::kSparseResidual, 0,
     0.0f, 0, false, 0.0f, 0.0f, 0.0f, LinearFusedForward::kRequire,
     cuda_gemm::GemmSm90Schedule::kCooperative},
    {"fused gradient, ping-pong GEMM", LinearPrecision::kSparseResidual, 0,
     0.0f, 0, false, 0.0f, 0.0f, 0.0f, LinearFusedForward::kRequire,
     cuda_gemm::GemmSm90Schedule::kPingPong},
    {"the policy's choice", LinearPrecision::kSparseResidual, 0, 0.0f, 0, false,
     0.0f, 0.0f, 0.0f, LinearFusedForward::kAuto},
    {"before, label smoothing 0.1 (time only)",
     LinearPrecision::kSparseResidual, 0, 0.0f, 0, false, 0.1f, 0.0f, 0.0f,
     LinearFusedForward::kOff},
    {"fused, label smoothing 0.1 (time only)", LinearPrecision::kSparseResidual,
     0, 0.0f, 0, false, 0.1f, 0.0f, 0.0f, LinearFusedForward::kRequire},
    {"fused, z-loss 1e-4 (time only)", LinearPrecision::kSparseResidual, 0,
     0.0f, 0, false, 0.0f, 0.0f, 1e-4f, LinearFusedForward::kRequire},
    {"before, 4096-row chunks", LinearPrecision::kSparseResidual, 4096, 0.0f, 0,
     false, 0.0f, 0.0f, 0.0f, LinearFusedForward::kOff},
    {"fused, 4096-row chunks", LinearPrecision::kSparseResidual, 4096, 0.0f, 0,
     false, 0.0f, 0.0f, 0.0f, LinearFusedForward::kRequire},
    {"before, 8192-row chunks", LinearPrecision::kSparseResidual, 8192, 0.0f, 0,
     false, 0.0f, 0.0f, 0.0f, LinearFusedForward::kOff},
    {"fused, 8192-row chunks", LinearPrecision::kSparseResidual, 8192, 0.0f, 0,
     false, 0.0f, 0.0f, 0.0f, LinearFusedForward::kRequire},
    // Second samples in the same process: the noise between runs.
    {"before, again", LinearPrecision::kSparseResidual, 0, 0.0f, 0, false, 0.0f,
     0.0f, 0.0f, LinearFusedForward::kOff},
    {"fused gradient, ping-pong GEMM, again", LinearPrecision::kSparseResidual,
     0, 0.0f, 0, false, 0.0f, 0.0f, 0.0f, LinearFusedForward::kRequire,
     cuda_gemm::GemmSm90Schedule::kPingPong},
    {"fused gradient, cooperative GEMM, again",
     LinearPrecision::kSparseResidual, 0, 0.0f, 0, false, 0.0f, 0.0f, 0.0f,
     LinearFusedForward::kRequire, cuda_gemm::GemmSm90Schedule::kCooperative},
};

void RunShape(const Shape& s, int reps, bool few, bool gradient,
              cublasHandle_t blas, std::string* md) {
  const int64_t N = s.n, H = s.h, V = s.v;
  const double flops = 6.0 * N * H * V;  // three products
  auto* x = static_cast<__nv_bfloat16*>(Alloc(N * H * 2));
  auto* w = static_cast<__nv_bfloat16*>(Alloc(V * H * 2));
  auto* targets = static_cast<int64_t*>(Alloc(N * 8));
  FillBf16<<<4096, 256>>>(x, N * H, 1.7f, 1);
  // Logits of standard deviation about 2.
  FillBf16<<<4096, 256>>>(w, V * H, s.logit_std * 1.7f / std::sqrt(float(H)),
                          2);
  FillTargets<<<64, 256>>>(targets, N, V, s.ignore_every);
  CHECK_CUDA(cudaGetLastError());

  // The three products alone, over the whole batch (the issue's anchor).
  auto* z = static_cast<__nv_bfloat16*>(Alloc(N * V * 2));
  auto* dx = static_cast<__nv_bfloat16*>(Alloc(N * H * 2));
  auto* dw = static_cast<float*>(Alloc(V * H * 4));
  FillBf16<<<4096, 256>>>(z, N * V, 1e-4f, 3);
  const float one = 1.0f, zero = 0.0f;
  const auto gemm_z = [&] {
    CHECK_CUBLAS(cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, V, N, H, &one, w,
                              CUDA_R_16BF, H, x, CUDA_R_16BF, H, &zero, z,
                              CUDA_R_16BF, V, CUBLAS_COMPUTE_32F,
                              CUBLAS_GEMM_DEFAULT));
  };
  const auto gemm_dx = [&] {
    CHECK_CUBLAS(cublasGemmEx(blas, CUBLAS_OP_N, CUBLAS_OP_N, H, N, V, &one, w,
                              CUDA_R_16BF, H, z, CUDA_R_16BF, V, &zero, dx,
                              CUDA_R_16BF, H, CUBLAS_COMPUTE_32F,
                              CUBLAS_GEMM_DEFAULT));
  };
  const auto gemm_dw = [&] {
    CHECK_CUBLAS(cublasGemmEx(blas, CUBLAS_OP_N, CUBLAS_OP_T, H, V, N, &one, x,
                              CUDA_R_16BF, H, z, CUDA_R_16BF, V, &one, dw,
                              CUDA_R_32F, H, CUBLAS_COMPUTE_32F,
                              CUBLAS_GEMM_DEFAULT));
  };
  const double t_z = MedianMs(2, reps, gemm_z);
  const double t_dx = MedianMs(2, reps, gemm_dx);
  const double t_dw = MedianMs(2, reps, gemm_dw);
  const double t_three = MedianMs(2, reps, [&] {
    gemm_z();
    gemm_dx();
    gemm_dw();
  });
  CHECK_CUDA(cudaFree(z));

  // The fp32 reference: X, W upcast, fp32 products (no TF32), the fused
  // cross-entropy on fp32 logits.
  auto* x32 = static_cast<float*>(Alloc(N * H * 4));
  auto* w32 = static_cast<float*>(Alloc(V * H * 4));
  Bf16ToFloat<<<4096, 256>>>(x, x32, N * H);
  Bf16ToFloat<<<4096, 256>>>(w, w32, V * H);
  auto* z32 = static_cast<float*>(Alloc(N * V * 4));
  auto* dx32 = static_cast<float*>(Alloc(N * H * 4));
  auto* dw32 = static_cast<float*>(Alloc(V * H * 4));
  CHECK_CUBLAS(cublasSetMathMode(blas, CUBLAS_PEDANTIC_MATH));
  CHECK_CUBLAS(cublasSgemm(blas, CUBLAS_OP_T, CUBLAS_OP_N, V, N, H, &one, w32,
                           H, x32, H, &zero, z32, V));
  {
    CrossEntropyArgs ce;
    ce.rows = N;
    ce.vocab = V;
    ce.row_stride = V;
    ce.logits_dtype = DType::kFloat32;
    ce.logits = z32;
    ce.targets_dtype = DType::kInt64;
    ce.targets = targets;
    ce.mode = GradientMode::kInPlace;
    ce.gradient = z32;
    const size_t ws = CrossEntropyCudaWorkspaceBytes(N);
    void* workspace = Alloc(ws);
    auto* result = static_cast<CrossEntropyCudaResult*>(
        Alloc(sizeof(CrossEntropyCudaResult)));
    CHECK_CUDA(CrossEntropyCudaLaunch(ce, result, workspace, ws, nullptr));
    CHECK_CUDA(cudaDeviceSynchronize());
    CHECK_CUDA(cudaFree(workspace));
    CHECK_CUDA(cudaFree(result));
  }
  CHECK_CUBLAS(cublasSgemm(blas, CUBLAS_OP_N, CUBLAS_OP_N, H, N, V, &one, w32,
                           H, z32, V, &zero, dx32, H));
  CHECK_CUBLAS(cublasSgemm(blas, CUBLAS_OP_N, CUBLAS_OP_T, H, V, N, &one, x32,
                           H, z32, V, &zero, dw32, H));
  CHECK_CUBLAS(cublasSetMathMode(blas, CUBLAS_DEFAULT_MATH));
  CHECK_CUDA(cudaDeviceSynchronize());
  CHECK_CUDA(cudaFree(z32));
  CHECK_CUDA(cudaFree(x32));
  CHECK_CUDA(cudaFree(w32));

  char line[512];
  std::snprintf(
      line, sizeof(line),
      "\n### %lldx%lldx%lld bf16, logits of std %.0f%s\n\nthree cuBLAS "
      "products alone "
      "(Z=XW^T bf16 %.2f ms, dX=GW %.2f ms, dW=G^TX fp32 %.2f ms): "
      "**%.2f ms** back to back (%.0f TFLOP/s)\n\n",
      (long long)N, (long long)H, (long long)V, s.logit_std,
      s.ignore_every > 0
          ? (", 1 row in " + std::to_string(s.ignore_every) + " ignored")
                .c_str()
          : "",
      t_z, t_dx, t_dw, t_three, flops / t_three * 1e-9);
  *md += line;
  std::printf("%s", line);
  *md +=
      "| lossd variant | chunk rows | ms | ratio to the three | TFLOP/s | "
      "extra "
      "device memory (workspace + fp32 dW) | dW rel. err | dX rel. err | "
      "repeat bits |\n|---|---|---|---|---|---|---|---|---|\n";

  auto* dx_out = static_cast<__nv_bfloat16*>(Alloc(N * H * 2));
  const Variant variants[] = {
      {"split-dW (default below V = 50000)", LinearPrecision::kSplitWeight, 0},
      {"split-dW", LinearPrecision::kSplitWeight, 2048},
      {"split-dW", LinearPrecision::kSplitWeight, 1024},
      {"split-dW+dX", kLinearSplitBoth, 0},
      {"fp32 logits, bf16 G", kLinearFp32Logits, 0},
      {"sparse residual (default from V = 50000: 2^-6, 128 slots)",
       LinearPrecision::kSparseResidual, 0},
      {"sparse residual (2^-9, 1024 slots)", LinearPrecision::kSparseResidual,
       0, 1.0f / 512, 1024},
      {"fast (bf16 Z and G)", LinearPrecision::kFast, 0},
      {"default, with a bias and dbias (time only)", LinearPrecision::kAuto, 0,
       0.0f, 0, true},
      {"default, label smoothing 0.1 (time only)", LinearPrecision::kAuto, 0,
       0.0f, 0, false, 0.1f},
      {"default, softcap 30 (time only)", LinearPrecision::kAuto, 0, 0.0f, 0,
       false, 0.0f, 30.0f},
      {"default, z-loss 1e-4 (time only)", LinearPrecision::kAuto, 0, 0.0f, 0,
       false, 0.0f, 0.0f, 1e-4f},
      {"default, all three (time only)", LinearPrecision::kAuto, 0, 0.0f, 0,
       false, 0.1f, 30.0f, 1e-4f},
      {"fast (bf16 Z and G)", LinearPrecision::kFast, 2048},
      {"fast (bf16 Z and G)", LinearPrecision::kFast, 4096},
      {"fast (bf16 Z and G)", LinearPrecision::kFast, 8192},
  };
  auto* dw_again = static_cast<float*>(Alloc(V * H * 4));
  auto* bias = static_cast<__nv_bfloat16*>(Alloc(V * 2));
  auto* dbias = static_cast<float*>(Alloc(V * 4));
  FillBf16<<<64, 256>>>(bias, V, 0.5f, 4);
  std::vector<Variant> chosen(std::begin(variants), std::end(variants));
  if (gradient) {
    chosen.assign(std::begin(kGradientVariants), std::end(kGradientVariants));
  }
  for (const Variant& variant : chosen) {
    // --few: the default, the fp32-logits middle and the fast path only.
    if (few && !gradient &&
        (variant.chunk_rows != 0 || variant.precision == kLinearSplitBoth))
      continue;
    LinearCrossEntropyLabConfig config;
    config.precision = variant.precision;
    config.chunk_rows = variant.chunk_rows;
    config.sparse_threshold = variant.sparse_threshold;
    config.sparse_slots = variant.sparse_slots;
    config.fused_gradient = variant.fused_gradient;
    config.gemm_schedule = variant.gemm_schedule;
    LinearCrossEntropyArgs a = BenchArgs(s, x, w, targets);
    a.dx_mode = GradientMode::kOutOfPlace;
    a.dx = dx_out;
    a.accumulate = AccumulateMode::kOverwrite;
    a.grad_weight = dw;
    if (variant.bias) {
      a.bias = bias;
      a.grad_bias = dbias;
    }
    a.options.label_smoothing = variant.label_smoothing;
    a.options.softcap = variant.softcap;
    a.options.z_loss_scale = variant.z_loss_scale;
    const LinearCrossEntropyCudaPlan plan =
        PlanLinearCrossEntropyCudaLab(a, config);
    CrossEntropyResult result;
    bool ok = true;
    const auto run = [&] {
      const absl::Status status =
          LinearCrossEntropyCudaLab(a, &result, nullptr, config);
      if (!status.ok()) {
        std::fprintf(stderr, "lossd: %s\n",
                     std::string(status.message()).c_str());
        ok = false;
      }
    };
    const double t = MedianMs(2, reps, run);
    if (!ok) continue;
    const bool timed_only = variant.bias || variant.options();
    const double err_dw =
        timed_only ? std::nan("") : RelativeError(dw, dw32, V * H);
    const double err_dx =
        timed_only ? std::nan("") : RelativeError(dx_out, dx32, N * H);
    // Bits: one more run into another accumulator, compared with the last.
    a.grad_weight = dw_again;
    run();
    unsigned long long* count =
        static_cast<unsigned long long*>(Alloc(sizeof(unsigned long long)));
    CHECK_CUDA(cudaMemset(count, 0, sizeof(*count)));
    CountDifferences<<<1024, 256>>>(reinterpret_cast<const uint32_t*>(dw),
                                    reinterpret_cast<const uint32_t*>(dw_again),
                                    V * H, count);
    unsigned long long differ = 0;
    CHECK_CUDA(
        cudaMemcpy(&differ, count, sizeof(differ), cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaFree(count));
    const double extra_gb = (plan.workspace_bytes + V * H * 4.0) * 1e-9;
    std::snprintf(line, sizeof(line),
                  "| %s | %lld | %.2f | %.3fx | %.0f | %.2f GB (%.2f + %.2f) | "
                  "%.2e | %.2e | %s (loss %.6f) |\n",
                  variant.name, (long long)plan.chunk_rows, t, t / t_three,
                  flops / t * 1e-9, extra_gb, plan.workspace_bytes * 1e-9,
                  V * H * 4e-9, err_dw, err_dx, differ == 0 ? "same" : "DIFFER",
                  result.loss);
    *md += line;
    std::printf("%s", line);
    std::fflush(stdout);
  }
  for (void* p : {static_cast<void*>(x), static_cast<void*>(w),
                  static_cast<void*>(targets), static_cast<void*>(dx),
                  static_cast<void*>(dw), static_cast<void*>(dx32),
                  static_cast<void*>(dw32), static_cast<void*>(dx_out),
                  static_cast<void*>(dw_again), static_cast<void*>(bias),
                  static_cast<void*>(dbias)})
    CHECK_CUDA(cudaFree(p));
}

// Forward-only (no dX, no dW): the loss in the Hopper GEMM's epilogue against
// today's cuBLASLt Z (fp32) and the fused cross-entropy, in one process, with
// cuBLAS's Z = X W^T (bf16 out) alone as the floor; each option with the
// fused forward.
void RunForward(const Shape& s, int reps, cublasHandle_t blas,
                std::string* md) {
  const int64_t N = s.n, H = s.h, V = s.v;
  auto* x = static_cast<__nv_bfloat16*>(Alloc(N * H * 2));
  auto* w = static_cast<__nv_bfloat16*>(Alloc(V * H * 2));
  auto* targets = static_cast<int64_t*>(Alloc(N * 8));
  auto* z = static_cast<__nv_bfloat16*>(Alloc(N * V * 2));
  FillBf16<<<4096, 256>>>(x, N * H, 1.7f, 1);
  FillBf16<<<4096, 256>>>(w, V * H, s.logit_std * 1.7f / std::sqrt(float(H)),
                          2);
  FillTargets<<<64, 256>>>(targets, N, V, s.ignore_every);
  CHECK_CUDA(cudaGetLastError());
  const float one = 1.0f, zero = 0.0f;
  const double t_z = MedianMs(2, reps, [&] {
    CHECK_CUBLAS(cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, V, N, H, &one, w,
                              CUDA_R_16BF, H, x, CUDA_R_16BF, H, &zero, z,
                              CUDA_R_16BF, V, CUBLAS_COMPUTE_32F,
                              CUBLAS_GEMM_DEFAULT));
  });
  cuda_gemm::GemmSm90Args gemm;
  gemm.x = x;
  gemm.w = w;
  gemm.z = z;
  gemm.rows = N;
  gemm.cols = V;
  gemm.depth = H;
  gemm.z_stride = V;
  const double t_own = MedianMs(
      2, reps, [&] { CHECK_CUDA(cuda_gemm::GemmSm90(gemm, nullptr)); });
  CHECK_CUDA(cudaFree(z));
  char line[512];
  std::snprintf(line, sizeof(line),
                "\n### forward only, %lldx%lldx%lld bf16, logits of std %.0f\n"
                "\ncuBLAS Z = XW^T (bf16 out) alone: **%.2f ms**; lossd's "
                "Hopper GEMM, the same Z: %.2f ms\n\n| lossd "
                "forward | ms | ratio to Z alone | loss | repeat bits |\n"
                "|---|---|---|---|---|\n",
                (long long)N, (long long)H, (long long)V, s.logit_std, t_z,
                t_own);
  *md += line;
  std::printf("%s", line);
  struct Way {
    const char* name;
    LinearFusedForward fused;
    float smoothing, softcap, z_loss;
  };
  const Way ways[] = {
      {"cuBLASLt fp32 Z + fused cross-entropy (before)",
       LinearFusedForward::kOff, 0, 0, 0},
      {"fused: statistics in the GEMM's epilogue", LinearFusedForward::kRequire,
       0, 0, 0},
      {"fused, label smoothing 0.1", LinearFusedForward::kRequire, 0.1f, 0, 0},
      {"fused, softcap 30", LinearFusedForward::kRequire, 0, 30.0f, 0},
      {"fused, z-loss 1e-4", LinearFusedForward::kRequire, 0, 0, 1e-4f},
      {"fused, all three", LinearFusedForward::kRequire, 0.1f, 30.0f, 1e-4f},
      {"cuBLASLt, all three (before)", LinearFusedForward::kOff, 0.1f, 30.0f,
       1e-4f},
  };
  for (const Way& way : ways) {
    LinearCrossEntropyLabConfig config;
    config.fused_forward = way.fused;
    LinearCrossEntropyArgs a = BenchArgs(s, x, w, targets);
    a.dx_mode = GradientMode::kNone;
    a.dx = nullptr;
    a.accumulate = AccumulateMode::kNone;
    a.options.label_smoothing = way.smoothing;
    a.options.softcap = way.softcap;
    a.options.z_loss_scale = way.z_loss;
    CrossEntropyResult result, again;
    bool ok = true;
    const auto run = [&](CrossEntropyResult* r) {
      const absl::Status status =
          LinearCrossEntropyCudaLab(a, r, nullptr, config);
      if (!status.ok()) {
        std::fprintf(stderr, "lossd: %s\n",
                     std::string(status.message()).c_str());
        ok = false;
      }
    };
    const double t = MedianMs(2, reps, [&] { run(&result); });
    if (!ok) continue;
    run(&again);
    std::snprintf(line, sizeof(line), "| %s | %.2f | %.3fx | %.9f | %s |\n",
                  way.name, t, t / t_z, result.loss,
                  std::memcmp(&result.loss, &again.loss, sizeof(double)) == 0
                      ? "same"
                      : "DIFFER");
    *md += line;
    std::printf("%s", line);
    std::fflush(stdout);
  }
  for (void* p : {static_cast<void*>(x), static_cast<void*>(w),
                  static_cast<void*>(targets)})
    CHECK_CUDA(cudaFree(p));
}

}  // namespace
}  // namespace lossd

int main(int argc, char** argv) {
  std::string out;
  int reps = 10;
  bool quick = false;
  bool few = false;
  bool forward = false;
  bool gradient = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg.rfind("--out=", 0) == 0) out = arg.substr(6);
    if (arg.rfind("--reps=", 0) == 0) reps = std::stoi(arg.substr(7));
    if (arg == "--quick") quick = true;
    if (arg == "--few") few = true;
    if (arg == "--forward") forward = true;
    if (arg == "--gradient") gradient = true;
  }
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  cublasHandle_t blas;
  CHECK_CUBLAS(cublasCreate(&blas));
  std::string md = std::string("## linear cross-entropy on ") + prop.name +
                   " (median of " + std::to_string(reps) + ", CUDA events)\n";
  std::vector<lossd::Shape> shapes = {
      {8192, 4096, 128256, 2.0f},   {16384, 4096, 131072, 2.0f},
      {8192, 4096, 128256, 8.0f},   {8192, 4096, 128256, 2.0f, 7},
      {8192, 4096, 50257, 2.0f, 7}, {8192, 4096, 32000, 2.0f, 7}};
  if (quick) shapes = {{2048, 1024, 32000, 2.0f}};
  if (gradient) {
    shapes = {{16384, 4096, 131072, 2.0f},
              {8192, 4096, 128256, 2.0f},
              {8192, 4096, 128256, 8.0f},
              {8192, 4096, 128256, 2.0f, 7}};
    if (few) shapes.resize(2);  // the issue's two shapes
  }
  if (forward) {
    for (const lossd::Shape& s : {lossd::Shape{16384, 4096, 131072, 2.0f},
                                  lossd::Shape{8192, 4096, 128256, 2.0f}}) {
      lossd::RunForward(s, reps, blas, &md);
    }
  } else {
    for (const lossd::Shape& s : shapes) {
      lossd::RunShape(s, reps, few, gradient, blas, &md);
    }
  }
  if (!out.empty()) {
    FILE* f = std::fopen(out.c_str(), "w");
    if (f != nullptr) {
      std::fputs(md.c_str(), f);
      std::fclose(f);
    }
  }
  cublasDestroy(blas);
  return 0;
}
