// The element-wise and reduction kernels of the linear cross-entropy
// (declared in linear_cross_entropy_kernels.h). All memory-bound, one pass
// each; the reductions run in a fixed order so results repeat bit for bit.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "kernels/cuda/linear_cross_entropy_kernels.h"
#include "kernels/cuda/sparse_residual.h"
#include "kernels/cuda/sparse_residual_record.cuh"

namespace lossd {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float LoadAs(const void* p, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kFloat32:
      return static_cast<const float*>(p)[i];
    case DType::kBFloat16:
      return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    default:
      return __half2float(static_cast<const __half*>(p)[i]);
  }
}

__device__ __forceinline__ void StoreAs(void* p, DType dtype, int64_t i,
                                        float v) {
  switch (dtype) {
    case DType::kFloat32:
      static_cast<float*>(p)[i] = v;
      return;
    case DType::kBFloat16:
      static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v);
      return;
    default:
      static_cast<__half*>(p)[i] = __float2half_rn(v);
      return;
  }
}

// One block of 1024 threads; each thread takes rows t, t + 1024, ... and the
// partials are combined by a fixed tree, so the sum's bits never change.
__global__ void __launch_bounds__(1024)
    PrepareKernel(const void* targets, DType targets_dtype, int64_t rows,
                  int64_t vocab, int64_t ignore_index,
                  const float* class_weights, LinearPrepareResult* out) {
  __shared__ double sums[1024];
  __shared__ long long counts[1024];
  __shared__ long long bad[1024];
  double sum = 0.0;
  long long count = 0;
  long long first_bad = rows;
  for (int64_t r = threadIdx.x; r < rows; r += blockDim.x) {
    const int64_t t = targets_dtype == DType::kInt32
                          ? static_cast<const int32_t*>(targets)[r]
                          : static_cast<const int64_t*>(targets)[r];
    if (t == ignore_index) continue;
    if (t < 0 || t >= vocab) {
      if (r < first_bad) first_bad = r;
      continue;
    }
    ++count;
    sum += class_weights == nullptr ? 1.0 : double(class_weights[t]);
  }
  sums[threadIdx.x] = sum;
  counts[threadIdx.x] = count;
  bad[threadIdx.x] = first_bad;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) {
      sums[threadIdx.x] += sums[threadIdx.x + stride];
      counts[threadIdx.x] += counts[threadIdx.x + stride];
      bad[threadIdx.x] = min(bad[threadIdx.x], bad[threadIdx.x + stride]);
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    out->target_weight_sum = sums[0];
    out->valid_tokens = counts[0];
    out->bad_row = bad[0] < rows ? bad[0] : -1;
    out->bad_target = 0;
    if (bad[0] < rows) {
      out->bad_target = targets_dtype == DType::kInt32
                            ? static_cast<const int32_t*>(targets)[bad[0]]
                            : static_cast<const int64_t*>(targets)[bad[0]];
    }
  }
}

// Four elements a thread (16-byte loads when vocab % 4 == 0, which the
// caller's row alignment gives for the sizes that matter).
template <typename T>
__device__ __forceinline__ float Widen(T h) {
  if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    return __bfloat162float(h);
  } else {
    return __half2float(h);
  }
}

template <typename T>
__device__ __forceinline__ T Narrow(float t) {
  if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    return __float2bfloat16_rn(t);
  } else {
    return __float2half_rn(t);
  }
}

template <typename T>
__global__ void SplitKernel(const float* g, const float* row_scale,
                            int64_t rows, int64_t vocab, T* hi, T* lo,
                            SparseResidualSlots sparse) {
  const int64_t total = rows * vocab;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total;
       i += int64_t{gridDim.x} * blockDim.x) {
    const float scale = row_scale != nullptr ? row_scale[i / vocab] : 1.0f;
    const float t = g[i] * scale;
    const T h = Narrow<T>(t);
    const float e = t - Widen(h);
    hi[i] = h;
    if (lo != nullptr) lo[i] = Narrow<T>(e);
    RecordResidual(sparse, i, vocab, t, e, scale);
  }
}

// The same four elements at a time (16-byte loads, 8-byte stores), for
// total % 4 == 0 with aligned buffers: the split is a pure stream over the
// chunk, so its width sets its speed.
template <typename T>
__global__ void SplitKernel4(const float4* g, const float* row_scale,
                             int64_t total4, int64_t vocab, T* hi, T* lo,
                             SparseResidualSlots sparse) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total4;
       i += int64_t{gridDim.x} * blockDim.x) {
    const float4 t = g[i];
    const float raw[4] = {t.x, t.y, t.z, t.w};
    float scale[4] = {1.0f, 1.0f, 1.0f, 1.0f};
    if (row_scale != nullptr) {
#pragma unroll
      for (int k = 0; k < 4; ++k) scale[k] = row_scale[(4 * i + k) / vocab];
    }
    float in[4];
    alignas(8) T h[4];
    alignas(8) T l[4];
    float e[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      in[k] = raw[k] * scale[k];
      h[k] = Narrow<T>(in[k]);
      e[k] = in[k] - Widen(h[k]);
      l[k] = Narrow<T>(e[k]);
    }
#pragma unroll
    for (int k = 0; k < 4; ++k)
      RecordResidual(sparse, 4 * i + k, vocab, in[k], e[k], scale[k]);
    reinterpret_cast<uint2*>(hi)[i] = *reinterpret_cast<const uint2*>(h);
    if (lo != nullptr) {
      reinterpret_cast<uint2*>(lo)[i] = *reinterpret_cast<const uint2*>(l);
    }
  }
}

__global__ void RowScaleKernel(void* g, DType dtype, const float* row_scale,
                               int64_t rows, int64_t vocab) {
  const int64_t total = rows * vocab;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total;
       i += int64_t{gridDim.x} * blockDim.x) {
    StoreAs(g, dtype, i, LoadAs(g, dtype, i) * row_scale[i / vocab]);
  }
}

// Rows a column-sum block adds: a thread per column and segment of rows, so
// that the grid has enough loads in flight (a thread a column alone leaves
// 131072 threads each walking every row), then one pass adds the segments'
// partial sums in segment order.
constexpr int64_t kColumnSumRows = 64;

int64_t ColumnSumSegments(int64_t rows) {
  return (rows + kColumnSumRows - 1) / kColumnSumRows;
}

__global__ void ColumnSumPartKernel(const void* g, DType dtype,
                                    const float* row_scale, int64_t rows,
                                    int64_t vocab, float* partial) {
  const int64_t v = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (v >= vocab) return;
  const int64_t first = blockIdx.y * kColumnSumRows;
  const int64_t last = min(first + kColumnSumRows, rows);
  float sum = 0.0f;
  for (int64_t r = first; r < last; ++r) {
    float x = LoadAs(g, dtype, r * vocab + v);
    if (row_scale != nullptr) x *= row_scale[r];
    sum += x;
  }
  partial[blockIdx.y * vocab + v] = sum;
}

__global__ void ColumnSumKernel(const float* partial, int64_t segments,
                                int64_t vocab, float alpha, bool overwrite,
                                float* out) {
  const int64_t v = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (v >= vocab) return;
  float sum = 0.0f;
  for (int64_t k = 0; k < segments; ++k) sum += partial[k * vocab + v];
  out[v] = (overwrite ? 0.0f : out[v]) + alpha * sum;
}

int GridFor(int64_t total) {
  const int64_t blocks = (total + kThreads - 1) / kThreads;
  return static_cast<int>(blocks < 132 * 32 ? (blocks > 0 ? blocks : 1)
                                            : 132 * 32);
}

}  // namespace

cudaError_t LinearPrepareLaunch(const void* targets, DType targets_dtype,
                                int64_t rows, int64_t vocab,
                                int64_t ignore_index,
                                const float* class_weights,
                                LinearPrepareResult* out, cudaStream_t stream) {
  PrepareKernel<<<1, 1024, 0, stream>>>(targets, targets_dtype, rows, vocab,
                                        ignore_index, class_weights, out);
  return cudaGetLastError();
}

cudaError_t SplitGradientLaunch(const float* g, const float* row_scale,
                                int64_t rows, int64_t vocab, DType dtype,
                                void* hi, void* lo,
                                const SparseResidualSlots* sparse,
                                cudaStream_t stream) {
  if (rows * vocab == 0) return cudaSuccess;
  const SparseResidualSlots s =
      sparse != nullptr ? *sparse : SparseResidualSlots{};
  const int grid = GridFor(rows * vocab);
  const bool aligned = (rows * vocab) % 4 == 0 &&
                       reinterpret_cast<uintptr_t>(g) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(hi) % 8 == 0 &&
                       reinterpret_cast<uintptr_t>(lo) % 8 == 0;
  if (aligned) {
    const int64_t total4 = rows * vocab / 4;
    if (dtype == DType::kBFloat16) {
      SplitKernel4<__nv_bfloat16><<<GridFor(total4), kThreads, 0, stream>>>(
          reinterpret_cast<const float4*>(g), row_scale, total4, vocab,
          static_cast<__nv_bfloat16*>(hi), static_cast<__nv_bfloat16*>(lo), s);
    } else if (dtype == DType::kFloat16) {
      SplitKernel4<__half><<<GridFor(total4), kThreads, 0, stream>>>(
          reinterpret_cast<const float4*>(g), row_scale, total4, vocab,
          static_cast<__half*>(hi), static_cast<__half*>(lo), s);
    } else {
      return cudaErrorInvalidValue;
    }
    return cudaGetLastError();
  }
  if (dtype == DType::kBFloat16) {
    SplitKernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(
        g, row_scale, rows, vocab, static_cast<__nv_bfloat16*>(hi),
        static_cast<__nv_bfloat16*>(lo), s);
  } else if (dtype == DType::kFloat16) {
    SplitKernel<__half><<<grid, kThreads, 0, stream>>>(
        g, row_scale, rows, vocab, static_cast<__half*>(hi),
        static_cast<__half*>(lo), s);
  } else {
    return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

cudaError_t RowScaleLaunch(void* g, DType dtype, const float* row_scale,
                           int64_t rows, int64_t vocab, cudaStream_t stream) {
  if (rows * vocab == 0) return cudaSuccess;
  RowScaleKernel<<<GridFor(rows * vocab), kThreads, 0, stream>>>(
      g, dtype, row_scale, rows, vocab);
  return cudaGetLastError();
}

std::size_t ColumnSumWorkspaceBytes(int64_t rows, int64_t vocab) {
  return static_cast<std::size_t>(ColumnSumSegments(rows)) * vocab *
         sizeof(float);
}

cudaError_t ColumnSumLaunch(const void* g, DType dtype, const float* row_scale,
                            int64_t rows, int64_t vocab, float alpha,
                            bool overwrite, float* out, float* workspace,
                            cudaStream_t stream) {
  if (vocab == 0) return cudaSuccess;
  const unsigned columns =
      static_cast<unsigned>((vocab + kThreads - 1) / kThreads);
  const int64_t segments = ColumnSumSegments(rows);
  if (segments > 0) {
    ColumnSumPartKernel<<<dim3(columns, static_cast<unsigned>(segments)),
                          kThreads, 0, stream>>>(g, dtype, row_scale, rows,
                                                 vocab, workspace);
    const cudaError_t error = cudaGetLastError();
    if (error != cudaSuccess) return error;
  }
  ColumnSumKernel<<<columns, kThreads, 0, stream>>>(workspace, segments, vocab,
                                                    alpha, overwrite, out);
  return cudaGetLastError();
}

}  // namespace lossd
