// The one switch from a logits dtype to its element type, for the launchers
// of the schedules that take fp32, bf16 and fp16 (host code in .cu files).
#ifndef LOSSD_KERNELS_CUDA_DTYPE_DISPATCH_CUH_
#define LOSSD_KERNELS_CUDA_DTYPE_DISPATCH_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "common/dtype.h"

namespace lossd {
namespace cuda_ce {

// f(T{}) with T the element type of `dtype` (float, __nv_bfloat16, __half);
// cudaErrorInvalidValue for any other dtype.
template <typename F>
cudaError_t WithElementType(DType dtype, F f) {
  switch (dtype) {
    case DType::kFloat32:
      return f(float{});
    case DType::kBFloat16:
      return f(__nv_bfloat16{});
    case DType::kFloat16:
      return f(__half{});
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace cuda_ce
}  // namespace lossd

#endif  // LOSSD_KERNELS_CUDA_DTYPE_DISPATCH_CUH_
