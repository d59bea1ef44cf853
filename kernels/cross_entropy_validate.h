// The argument checks of the cross-entropy contract (kernels/cross_entropy.h)
// that every backend runs before it touches memory.
#ifndef LOSSD_KERNELS_CROSS_ENTROPY_VALIDATE_H_
#define LOSSD_KERNELS_CROSS_ENTROPY_VALIDATE_H_

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

}  // namespace lossd

#endif  // LOSSD_KERNELS_CROSS_ENTROPY_VALIDATE_H_
