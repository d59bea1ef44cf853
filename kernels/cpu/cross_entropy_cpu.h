// The CPU backend of the cross-entropy contract in kernels/cross_entropy.h: a
// multithreaded fast path for GPU-less deployments and CI, and an fp64
// reference that is the oracle for every other backend's tests.
#ifndef LOSSD_KERNELS_CPU_CROSS_ENTROPY_CPU_H_
#define LOSSD_KERNELS_CPU_CROSS_ENTROPY_CPU_H_

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cross_entropy.h"
#include "kernels/cross_entropy_validate.h"

namespace lossd {

// The fast backend: computes the loss and, as `args.mode` says, the gradient
// (kInPlace overwrites args.logits; kOutOfPlace writes args.gradient; kNone
// writes no tensor), plus the requested per-token outputs and `*result`.
// Rows are split across `num_threads` threads (0 = hardware concurrency; a
// small problem uses fewer). Row math is fp32 with fp64 row accumulators and
// one rounding per gradient element; the totals are reduced in fp64 in a fixed
// order, so every output is bitwise identical for any num_threads.
//
// Returns OK on success. INVALID_ARGUMENT when ValidateCrossEntropyArgs or
// CheckTargets fails or result == nullptr; then nothing at all is written.
// Non-finite logits are not an error: the affected rows' loss is NaN/Inf as in
// torch and they are counted in result->nonfinite_rows. A kMean whose
// denominator is 0 with valid rows (class weights summing to 0) gives NaN like
// torch. Ownership: borrows every buffer for the duration of the call; the
// caller must not touch them concurrently. Thread safety: reentrant.
absl::Status CrossEntropyCpu(const CrossEntropyArgs& args,
                             CrossEntropyResult* result, int num_threads = 0);

// The reference: single-threaded, straightforward code that mirrors the
// formulas of kernels/cross_entropy.h with every quantity in fp64 and one
// rounding per written element. Same contract, validation and outputs as
// CrossEntropyCpu; slow, meant as the oracle for the other backends' tests.
absl::Status CrossEntropyReference(const CrossEntropyArgs& args,
                                   CrossEntropyResult* result);

}  // namespace lossd

#endif  // LOSSD_KERNELS_CPU_CROSS_ENTROPY_CPU_H_
