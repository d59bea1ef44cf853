// Element-type conversion with scaling on the host: what the server needs for
// Download (fp32 gradient to bf16 for transport, pending grad_output applied on
// the fly) and for Backward(materialize) on the CPU device.
#ifndef LOSSD_KERNELS_CPU_CONVERT_H_
#define LOSSD_KERNELS_CPU_CONVERT_H_

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cross_entropy.h"

namespace lossd {

// Converts `count` elements starting at flat element index `first` of a
// [rows, row_length] tensor from `src` (of `src_dtype`) to `dst` (of
// `dst_dtype`). `src` points at element `first` and `dst` receives element
// `first` at dst[0]. Floating-point values are multiplied by `scale` and, when
// `row_scale` is not nullptr, by row_scale[element_index / row_length]; the
// math is fp32 ((value * (scale * row_scale)) rounded once to dst_dtype).
//
// Returns OK after writing all `count` elements of dst. INVALID_ARGUMENT, with
// nothing written, when: a dtype is kInvalid or unknown; integer data would
// change (an integer dtype converted to another dtype, or with scale != 1 or a
// row_scale); first < 0 or count < 0; row_scale is given and row_length < 1;
// count > 0 and src or dst is nullptr; src and dst overlap without being the
// same pointer with the same dtype (the in-place case, which is allowed).
//
// Ownership: borrows every pointer for the duration of the call. Thread safety:
// reentrant; concurrent calls must not write overlapping dst ranges.
absl::Status ConvertAndScale(const void* src, DType src_dtype, void* dst,
                             DType dst_dtype, int64_t first, int64_t count,
                             int64_t row_length, float scale,
                             const float* row_scale);

}  // namespace lossd

#endif  // LOSSD_KERNELS_CPU_CONVERT_H_
