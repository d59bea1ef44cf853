// The parts of the linear cross-entropy contract
// (kernels/linear_cross_entropy.h) that both backends share: the argument
// checks, and the bookkeeping of a call run in chunks of rows (the whole call's
// denominator, the chunk results' sum).
#ifndef LOSSD_KERNELS_LINEAR_CROSS_ENTROPY_VALIDATE_H_
#define LOSSD_KERNELS_LINEAR_CROSS_ENTROPY_VALIDATE_H_

#include "absl/status/status.h"
#include "kernels/cross_entropy.h"
#include "kernels/linear_cross_entropy.h"

namespace lossd {

// Checks everything about `args` that can be checked without reading tensor
// data: rows >= 0, 1 <= hidden < 2^31, 1 <= vocab < 2^31, rows * hidden and
// vocab * hidden fit in int64; dtype float32/bfloat16/float16 and targets
// int32/int64; x, weight and targets not null when needed; dx consistent with
// dx_mode (kInPlace: == x; kOutOfPlace: not null, not overlapping x; kNone:
// null); accumulate a valid mode, grad_weight null iff it is kNone, grad_bias
// only with a bias and a weight gradient; token_grad_output required exactly
// for kNone reduction with a gradient; the options as ValidateCrossEntropyArgs
// checks them.
//
// Returns OK, or INVALID_ARGUMENT whose message ("linear_cross_entropy: ...")
// names the field and its value. Reads no memory behind any pointer. Pure.
absl::Status ValidateLinearCrossEntropyArgs(const LinearCrossEntropyArgs& args);

// True when the call forms any gradient (dX or dW).
inline bool LinearCrossEntropyWantsGradient(const LinearCrossEntropyArgs& a) {
  return a.dx_mode != GradientMode::kNone ||
         a.accumulate != AccumulateMode::kNone;
}

// The options each chunk of rows runs the cross-entropy with, given the
// whole call's target-weight sum (`target_weight_sum`, sum of w_{y_n} over
// valid rows, in fp64): for kMean without an explicit normalizer, the
// normalizer becomes that sum (when > 0), so that every chunk divides by the
// whole call's D, not by its own. Pure.
CrossEntropyOptions LinearChunkOptions(const CrossEntropyOptions& options,
                                       double target_weight_sum);

// Adds a chunk's result to the call's running total (fixed chunk order gives
// fixed bits). `denominator` is taken from the chunk when it is set. Pure.
void AddChunkResult(const CrossEntropyResult& chunk, CrossEntropyResult* total);

}  // namespace lossd

#endif  // LOSSD_KERNELS_LINEAR_CROSS_ENTROPY_VALIDATE_H_
