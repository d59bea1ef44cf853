// The fp64 CPU backend of kernels/post_training.h and the checks, plan and
// reduction every backend shares; being fp64, it is the other backends' oracle.
#ifndef LOSSD_KERNELS_CPU_POST_TRAINING_CPU_H_
#define LOSSD_KERNELS_CPU_POST_TRAINING_CPU_H_

#include <cstdint>
#include <vector>

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

// What one row contributes to the totals (every backend's rows report this).
struct PostTrainingRowTotals {
  bool valid = false;  // its target is not ignore_index (or there are none)
  double loss = 0.0;
  double distillation = 0.0;
  bool correct = false;
  bool clipped = false;
  double ratio = 0.0;
  double approx_kl = 0.0;
  double kl = 0.0;
  double entropy = 0.0;
  double z_loss = 0.0;  // z_loss_scale * lse^2, included in `loss`
};

// The reduction of a problem, known from its targets and segment ids alone:
// each row's factor in the reduced loss (0 for ignored rows; without
// grad_scale), the counts and the denominator.
struct PostTrainingPlan {
  std::vector<double> row_scale;
  int64_t valid_tokens = 0;
  std::vector<int64_t> segment_tokens;
  int64_t nonempty_segments = 0;
  SegmentReduction segment_reduction = SegmentReduction::kNone;
  double denominator = 0.0;
  bool have_denominator = false;
};

// The plan of `args`, whose targets and segment ids are HOST pointers, valid
// (CheckPostTrainingData). Pure.
PostTrainingPlan PlanPostTraining(const PostTrainingArgs& args);

// The result from the rows' totals, summed in row order (so every backend
// that reports the same rows gets the same bits). `args` as for the plan.
// Pure.
PostTrainingResult ReducePostTrainingRows(
    const PostTrainingArgs& args, const PostTrainingPlan& plan,
    const std::vector<PostTrainingRowTotals>& totals);

// Computes the loss, the gradient (as args.base.mode says), the per-token
// outputs and `*result` with fp64 row math and one rounding per gradient
// element. Rows are split over `num_threads` threads (0 = hardware
// concurrency); totals are summed in row order, so the result does not depend
// on the thread count.
//
// Returns OK, or INVALID_ARGUMENT (as the two checks above, or result ==
// nullptr) having written nothing. Non-finite logits give non-finite rows,
// counted in result->base.nonfinite_rows, not an error. Ownership: borrows
// every buffer for the call. Thread safety: reentrant.
absl::Status PostTrainingCpu(const PostTrainingArgs& args,
                             PostTrainingResult* result, int num_threads = 0);

// The rows of `args` alone, for a caller that plans and reduces a larger
// problem itself (LinearForward's chunks of rows): row r's gradient is scaled
// by row_scale[r] (the plan's factor times grad_scale) and its totals go to
// totals[r]; the per-token outputs are written. `args` must have passed the
// checks above (on the whole problem); its inputs are host pointers. Threads
// as PostTrainingCpu; writes nothing but the gradient, the per-token outputs
// and `totals`.
void PostTrainingCpuRows(const PostTrainingArgs& args, const double* row_scale,
                         PostTrainingRowTotals* totals, int num_threads = 0);

// The rows [row0, row0 + count) of `whole` as a problem of their own, their
// logits at `logits` ([count, vocab] of `logits_dtype`, the gradient written
// over them when `gradient` is true): every row-indexed input and per-token
// output offset by row0. `segments` keeps its ids (offset) for the caller's
// bookkeeping. The sliced arguments are holder->args, pointing into
// `holder`, which must outlive them.
struct PostTrainingChunk {
  DistillationArgs distillation;
  PolicyArgs policy;
  SegmentArgs segments;
  PostTrainingArgs args;
};
void SlicePostTrainingRows(const PostTrainingArgs& whole, int64_t row0,
                           int64_t count, void* logits, DType logits_dtype,
                           bool gradient, PostTrainingChunk* holder);

}  // namespace lossd

#endif  // LOSSD_KERNELS_CPU_POST_TRAINING_CPU_H_
