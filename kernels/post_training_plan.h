// The reduction of the post-training losses (kernels/post_training.h) that
// every backend shares, so that the same rows give the same bits everywhere:
// the plan, the rows' totals summed in row order, and the slicing into chunks.
#ifndef LOSSD_KERNELS_POST_TRAINING_PLAN_H_
#define LOSSD_KERNELS_POST_TRAINING_PLAN_H_

#include <cstdint>
#include <vector>

#include "kernels/post_training.h"

namespace lossd {

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

// Whether `row` counts: its target is not ignore_index, or there are no
// targets. `args`' targets are a HOST pointer of a checked dtype. Pure.
bool PostTrainingRowIsValid(const PostTrainingArgs& args, int64_t row);

// The plan of `args`, whose targets and segment ids are HOST pointers, valid
// (CheckPostTrainingData). Pure.
PostTrainingPlan PlanPostTraining(const PostTrainingArgs& args);

// The result from the rows' totals, summed in row order (so every backend
// that reports the same rows gets the same bits). `args` as for the plan.
// Pure.
PostTrainingResult ReducePostTrainingRows(
    const PostTrainingArgs& args, const PostTrainingPlan& plan,
    const std::vector<PostTrainingRowTotals>& totals);

// The totals of an unsegmented problem's valid rows, however summed
// (ReducePostTrainingRows sums them in row order; the CUDA backend's device
// reduction in its own fixed order): what its result needs besides the
// options.
struct PostTrainingSums {
  int64_t valid_tokens = 0;
  int64_t nonfinite_rows = 0;  // valid rows whose loss is NaN or infinite
  int64_t correct_tokens = 0;
  int64_t clipped_tokens = 0;
  double loss = 0.0;
  double distillation = 0.0;
  double ratio = 0.0;
  double approx_kl = 0.0;
  double kl = 0.0;
  double entropy = 0.0;  // of a policy's valid rows only
  double z_loss = 0.0;   // unscaled: z_loss_scale * lse^2 summed
};

// The result of a problem without segments from its valid rows' `sums` and
// `options`: the denominator and row factor as PlanPostTraining makes them,
// the z-loss scaled by that factor after its sum (ReducePostTrainingRows
// scales each row's before: the same value to rounding). Pure.
PostTrainingResult FinishUnsegmentedPostTraining(
    const CrossEntropyOptions& options, const PostTrainingSums& sums);

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

#endif  // LOSSD_KERNELS_POST_TRAINING_PLAN_H_
