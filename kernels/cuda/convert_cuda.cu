// ConvertScaleCudaLaunch: one grid-stride kernel per (source, destination)
// float format pair. A memory-bound elementwise pass; rounding is done with
// the CUDA intrinsics, which round to nearest even like common/float16.h.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/cuda/convert_cuda.h"

namespace lossd {
namespace {

struct Float32Format {
  using Storage = float;
  static __device__ __forceinline__ float Load(float v) { return v; }
  static __device__ __forceinline__ float Store(float v) { return v; }
};
struct BFloat16Format {
  using Storage = __nv_bfloat16;
  static __device__ __forceinline__ float Load(__nv_bfloat16 v) {
    return __bfloat162float(v);
  }
  static __device__ __forceinline__ __nv_bfloat16 Store(float v) {
    return __float2bfloat16_rn(v);
  }
};
struct Float16Format {
  using Storage = __half;
  static __device__ __forceinline__ float Load(__half v) {
    return __half2float(v);
  }
  static __device__ __forceinline__ __half Store(float v) {
    return __float2half_rn(v);
  }
};

constexpr int kThreads = 256;
// Enough blocks to fill an H200 several times over; the grid-stride loop
// covers the rest.
constexpr int64_t kMaxBlocks = 132 * 32;

// count elements; element i belongs to row (first + i) / row_length. Each
// element is read before its own slot is written, so src == dst is safe.
template <typename Src, typename Dst>
__global__ void ConvertScaleKernel(const typename Src::Storage* src,
                                   typename Dst::Storage* dst, int64_t first,
                                   int64_t count, int64_t row_length,
                                   float scale, const float* row_scale) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < count; i += stride) {
    // __fmul_rn keeps the factor a separate rounding, as on the host.
    const float factor =
        row_scale == nullptr
            ? scale
            : __fmul_rn(scale, row_scale[(first + i) / row_length]);
    dst[i] = Dst::Store(__fmul_rn(Src::Load(src[i]), factor));
  }
}

template <typename Src, typename Dst>
cudaError_t Launch(const void* src, void* dst, int64_t first, int64_t count,
                   int64_t row_length, float scale, const float* row_scale,
                   cudaStream_t stream) {
  int64_t blocks = (count + kThreads - 1) / kThreads;
  if (blocks > kMaxBlocks) blocks = kMaxBlocks;
  ConvertScaleKernel<Src, Dst>
      <<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
          static_cast<const typename Src::Storage*>(src),
          static_cast<typename Dst::Storage*>(dst), first, count, row_length,
          scale, row_scale);
  return cudaGetLastError();
}

template <typename Src>
cudaError_t LaunchFrom(const void* src, void* dst, DType dst_dtype,
                       int64_t first, int64_t count, int64_t row_length,
                       float scale, const float* row_scale,
                       cudaStream_t stream) {
  switch (dst_dtype) {
    case DType::kFloat32:
      return Launch<Src, Float32Format>(src, dst, first, count, row_length,
                                        scale, row_scale, stream);
    case DType::kBFloat16:
      return Launch<Src, BFloat16Format>(src, dst, first, count, row_length,
                                         scale, row_scale, stream);
    default:
      return Launch<Src, Float16Format>(src, dst, first, count, row_length,
                                        scale, row_scale, stream);
  }
}

}  // namespace

cudaError_t ConvertScaleCudaLaunch(const void* src, DType src_dtype, void* dst,
                                   DType dst_dtype, int64_t first,
                                   int64_t count, int64_t row_length,
                                   float scale, const float* row_scale,
                                   cudaStream_t stream) {
  if (DTypeSize(src_dtype) == 0 || DTypeSize(dst_dtype) == 0 || first < 0 ||
      count < 0 || (row_scale != nullptr && row_length < 1)) {
    return cudaErrorInvalidValue;
  }
  const bool floats = IsLogitsDType(src_dtype) && IsLogitsDType(dst_dtype);
  if (!floats &&
      (src_dtype != dst_dtype || scale != 1.0f || row_scale != nullptr)) {
    return cudaErrorInvalidValue;
  }
  if (count == 0) return cudaSuccess;
  if (src == nullptr || dst == nullptr) return cudaErrorInvalidValue;
  if (src_dtype == dst_dtype && scale == 1.0f && row_scale == nullptr) {
    if (src == dst) return cudaSuccess;
    return cudaMemcpyAsync(dst, src,
                           static_cast<size_t>(count) * DTypeSize(src_dtype),
                           cudaMemcpyDeviceToDevice, stream);
  }
  switch (src_dtype) {
    case DType::kFloat32:
      return LaunchFrom<Float32Format>(src, dst, dst_dtype, first, count,
                                       row_length, scale, row_scale, stream);
    case DType::kBFloat16:
      return LaunchFrom<BFloat16Format>(src, dst, dst_dtype, first, count,
                                        row_length, scale, row_scale, stream);
    default:
      return LaunchFrom<Float16Format>(src, dst, dst_dtype, first, count,
                                       row_length, scale, row_scale, stream);
  }
}

}  // namespace lossd
