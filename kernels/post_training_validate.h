// The checks of the post-training contract (kernels/post_training.h) that
// every backend and the server run before a problem touches memory.
#ifndef LOSSD_KERNELS_POST_TRAINING_VALIDATE_H_
#define LOSSD_KERNELS_POST_TRAINING_VALIDATE_H_

#include "absl/status/status.h"
#include "kernels/post_training.h"

namespace lossd {

// Checks everything about `args` that needs no tensor data: the base
// arguments as ValidateCrossEntropyArgs (targets may be nullptr only for a
// distillation with alpha 0); class_weights off, label_smoothing off with a
// policy; at most one of distillation and policy; the fields of each (ranges,
// enum values, exactly one teacher, top_k in [1, min(vocab, 512)], non-null
// pointers); segments' count in [1, 2^31) and a segment reduction only with
// Reduction::kMean.
//
// Returns OK or INVALID_ARGUMENT naming the field. Reads no memory behind any
// pointer. Thread safety: pure function.
absl::Status ValidatePostTrainingArgs(const PostTrainingArgs& args);

// Checks the data of the small inputs, which must be HOST pointers here (a GPU
// backend copies them to the host first): targets in [0, vocab) or
// ignore_index; top-k indices in [0, vocab) and distinct within a row, top-k
// logprobs not NaN and <= 0; advantages, sampling and reference logprobs
// finite; segment ids in [0, count). Call after ValidatePostTrainingArgs.
//
// Returns OK or INVALID_ARGUMENT naming the first bad element. Reads only.
absl::Status CheckPostTrainingData(const PostTrainingArgs& args);

}  // namespace lossd

#endif  // LOSSD_KERNELS_POST_TRAINING_VALIDATE_H_
