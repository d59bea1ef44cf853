// The argument checks of the cross-entropy contract (kernels/cross_entropy.h)
// that every backend runs before it touches memory, and the check of host
// targets with the read it uses, which the CPU backend and the post-training
// checks share.
#ifndef LOSSD_KERNELS_CROSS_ENTROPY_VALIDATE_H_
#define LOSSD_KERNELS_CROSS_ENTROPY_VALIDATE_H_

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cross_entropy.h"

namespace lossd {

// Checks everything about `args` that can be checked without reading tensor
// data: rows >= 0; vocab >= 1 and <= INT32_MAX (argmax is int32); row_stride
// >= vocab; rows * row_stride fits in int64; logits and targets dtypes; logits
// and targets not nullptr when rows > 0; the gradient pointer consistent with
// mode (kInPlace: == logits; kOutOfPlace: not nullptr and not overlapping the
// logits when rows > 0; kNone: nullptr); options (label_smoothing in [0, 1],
// z_loss_scale >= 0, softcap >= 0, normalizer >= 0, grad_scale finite, all
// finite; reduction and mode valid enum values).
//
// Returns OK, or INVALID_ARGUMENT whose message names the field and its value.
// Reads no memory behind any pointer. Thread safety: pure function.
absl::Status ValidateCrossEntropyArgs(const CrossEntropyArgs& args);

// Checks host `targets` ([rows] of int32 or int64): every value is in
// [0, vocab) or equals ignore_index.
//
// Returns OK, or INVALID_ARGUMENT naming the first bad row and its value (also
// for a bad dtype, or targets == nullptr with rows > 0). Reads targets only.
// Thread safety: pure function.
absl::Status CheckTargets(const void* targets, DType targets_dtype,
                          int64_t rows, int64_t vocab, int64_t ignore_index);

// Element `row` of host `targets` (or of any int32 / int64 index array); the
// dtype has been validated.
inline int64_t LoadTarget(const void* targets, DType dtype, int64_t row) {
  if (dtype == DType::kInt32) return static_cast<const int32_t*>(targets)[row];
  return static_cast<const int64_t*>(targets)[row];
}

}  // namespace lossd

#endif  // LOSSD_KERNELS_CROSS_ENTROPY_VALIDATE_H_
