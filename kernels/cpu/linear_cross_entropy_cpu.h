// The CPU backend of the linear cross-entropy contract
// (kernels/linear_cross_entropy.h) on OpenBLAS, plus the pieces both backends
// share: validation, the whole-call denominator and the per-chunk options.
#ifndef LOSSD_KERNELS_CPU_LINEAR_CROSS_ENTROPY_CPU_H_
#define LOSSD_KERNELS_CPU_LINEAR_CROSS_ENTROPY_CPU_H_

#include <cstdint>

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

// Computes the loss, dX, dW and dbias as kernels/linear_cross_entropy.h says,
// in chunks of rows: per chunk, Z = X W^T (+ b) in fp32 (cblas_sgemm, with
// 16-bit X and W converted to fp32 per block), the fast CPU cross-entropy in
// place on Z (CrossEntropyCpu), then dW (+)= G^T X, dbias (+)= column sums
// of G and dX = G W in fp32, dX rounded once to `dtype`.
//
// Returns OK; INVALID_ARGUMENT when ValidateLinearCrossEntropyArgs fails,
// result is nullptr, or a target is out of range (checked for every row
// before anything is written: then nothing is written); RESOURCE_EXHAUSTED
// when the scratch (one chunk of fp32 logits, a block of W) cannot be
// allocated; CANCELLED when args.cancelled said so before a chunk (the
// outputs then hold the chunks done). Deterministic for a given OpenBLAS thread
// count. Borrows every buffer for the call. Thread safety: reentrant for
// distinct outputs.
absl::Status LinearCrossEntropyCpu(const LinearCrossEntropyArgs& args,
                                   CrossEntropyResult* result);

// The host memory LinearCrossEntropyCpu allocates for `args` beyond its
// inputs and outputs (the chunk of fp32 logits, dX's fp32 chunk, 16-bit rows
// converted to fp32, the bias and its column sums), so that a caller can
// charge it to a budget before the call. Pure.
int64_t LinearCrossEntropyCpuWorkspaceBytes(const LinearCrossEntropyArgs& args);

}  // namespace lossd

#endif  // LOSSD_KERNELS_CPU_LINEAR_CROSS_ENTROPY_CPU_H_
