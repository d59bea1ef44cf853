// Device-side dtype conversion with scaling: what the CUDA device needs for
// Download (pending grad_output and fp32 -> bf16 applied on the GPU before the
// copy to the host) and for Backward(materialize) in place. CUDA headers only.
#ifndef LOSSD_KERNELS_CUDA_CONVERT_CUDA_H_
#define LOSSD_KERNELS_CUDA_CONVERT_CUDA_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/cross_entropy.h"

namespace lossd {

// Enqueues on `stream` the device twin of lossd::ConvertAndScale
// (kernels/cpu/convert.h), with the same math and bits: element `first + i`
// of a [rows, row_length] tensor, read from src[i] (src_dtype), is written to
// dst[i] (dst_dtype) as value * (scale * row_scale[(first + i) / row_length])
// computed in fp32 and rounded once (round to nearest even). `row_scale` is a
// DEVICE array of [rows] floats, or nullptr for none. src == dst with the same
// dtype (in place) is allowed; other overlaps are not.
//
// Returns cudaSuccess once the work is enqueued (count == 0 enqueues nothing);
// cudaErrorInvalidValue, with nothing enqueued, for an unknown dtype, an
// integer dtype that would change (converted, scaled or row-scaled), first or
// count < 0, row_scale with row_length < 1, or null pointers with count > 0;
// otherwise the launch error. Borrows every pointer until the stream reaches
// the work. Thread-safe.
cudaError_t ConvertScaleCudaLaunch(const void* src, DType src_dtype, void* dst,
                                   DType dst_dtype, int64_t first,
                                   int64_t count, int64_t row_length,
                                   float scale, const float* row_scale,
                                   cudaStream_t stream);

}  // namespace lossd

#endif  // LOSSD_KERNELS_CUDA_CONVERT_CUDA_H_
