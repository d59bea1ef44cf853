// The CPU backend of the linear cross-entropy contract
// (kernels/linear_cross_entropy.h) on OpenBLAS; the checks and chunk
// bookkeeping it shares with the CUDA backend are in
// kernels/linear_cross_entropy_validate.h.
#ifndef LOSSD_KERNELS_CPU_LINEAR_CROSS_ENTROPY_CPU_H_
#define LOSSD_KERNELS_CPU_LINEAR_CROSS_ENTROPY_CPU_H_

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cross_entropy.h"
#include "kernels/linear_cross_entropy.h"
#include "kernels/linear_cross_entropy_validate.h"
#include "kernels/linear_post_training.h"
#include "kernels/post_training.h"

namespace lossd {

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

// LinearForward with a post-training loss (kernels/linear_post_training.h):
// the same chunks, products and precision as LinearCrossEntropyCpu (Z, G and
// the products in fp32), the loss of each chunk's rows by the fp64 rows of
// PostTrainingCpuRows on the fp32 Z, G rounded once to fp32. The plan (row
// factors, segment counts) and the reduction are the whole call's, so the
// result is the same as a Forward's on Z. The scratch is LinearCrossEntropy-
// CpuWorkspaceBytes(args.linear) plus one PostTrainingRowTotals a row.
//
// Returns OK; INVALID_ARGUMENT as ValidateLinearCrossEntropyArgs (targets may
// be nullptr for a distillation with alpha 0), ValidatePostTrainingArgs or
// CheckPostTrainingData (checked before anything is written), or result ==
// nullptr; RESOURCE_EXHAUSTED and CANCELLED as LinearCrossEntropyCpu.
// `num_threads` as PostTrainingCpu's. Borrows every buffer for the call.
// Thread safety: reentrant for distinct outputs.
absl::Status LinearPostTrainingCpu(const LinearPostTrainingArgs& args,
                                   PostTrainingResult* result,
                                   int num_threads = 0);

}  // namespace lossd

#endif  // LOSSD_KERNELS_CPU_LINEAR_CROSS_ENTROPY_CPU_H_
