// The reduction of a post-training problem that every backend shares: the
// plan from the targets and segment ids, the rows' totals summed in row order,
// and the slicing of a problem's rows for a caller that runs it in chunks.
#include "kernels/post_training_plan.h"

#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels/cross_entropy_validate.h"

namespace lossd {

bool PostTrainingRowIsValid(const PostTrainingArgs& args, int64_t row) {
  if (args.base.targets == nullptr) return true;
  return LoadTarget(args.base.targets, args.base.targets_dtype, row) !=
         args.base.options.ignore_index;
}

namespace {

// The denominator of `plan`, whose counts are set, as `options` say.
void SetDenominator(const CrossEntropyOptions& options,
                    PostTrainingPlan* plan) {
  if (plan->segment_reduction != SegmentReduction::kNone) {
    plan->denominator = options.normalizer > 0.0
                            ? options.normalizer
                            : static_cast<double>(plan->nonempty_segments);
    plan->have_denominator =
        plan->nonempty_segments > 0 || options.normalizer > 0.0;
  } else if (options.reduction == Reduction::kMean) {
    plan->denominator = options.normalizer > 0.0
                            ? options.normalizer
                            : static_cast<double>(plan->valid_tokens);
    plan->have_denominator = plan->valid_tokens > 0 || options.normalizer > 0.0;
  }
}

// The reduced loss and divergence of `out` from their sums `loss` and
// `distillation` (over rows, or over segments' means).
void FinishLoss(const CrossEntropyOptions& options,
                const PostTrainingPlan& plan, double loss, double distillation,
                PostTrainingResult* out) {
  const SegmentReduction segment_reduction = plan.segment_reduction;
  const bool reduce_mean = options.reduction == Reduction::kMean ||
                           segment_reduction != SegmentReduction::kNone;
  if (reduce_mean) {
    const bool any = segment_reduction != SegmentReduction::kNone
                         ? plan.nonempty_segments > 0
                         : plan.valid_tokens > 0;
    out->base.loss = any ? loss / plan.denominator : 0.0;
    out->distillation_loss = any ? distillation / plan.denominator : 0.0;
    if (plan.have_denominator) out->base.denominator = plan.denominator;
  } else {
    out->base.loss = loss;
    out->distillation_loss = distillation;
  }
}

}  // namespace

PostTrainingPlan PlanPostTraining(const PostTrainingArgs& args) {
  const CrossEntropyOptions& options = args.base.options;
  const int64_t rows = args.base.rows;
  const SegmentArgs* segments = args.segments;
  PostTrainingPlan plan;
  plan.segment_reduction =
      segments == nullptr ? SegmentReduction::kNone : segments->reduction;
  plan.segment_tokens.assign(segments == nullptr ? 0 : segments->count, 0);
  for (int64_t row = 0; row < rows; ++row) {
    if (!PostTrainingRowIsValid(args, row)) continue;
    ++plan.valid_tokens;
    if (segments != nullptr) ++plan.segment_tokens[segments->ids[row]];
  }
  for (int64_t tokens : plan.segment_tokens) {
    plan.nonempty_segments += tokens > 0;
  }
  const bool mean = options.reduction == Reduction::kMean;
  SetDenominator(options, &plan);
  plan.row_scale.assign(rows, 0.0);
  for (int64_t row = 0; row < rows; ++row) {
    if (!PostTrainingRowIsValid(args, row)) continue;
    double factor = 1.0;
    switch (plan.segment_reduction) {
      case SegmentReduction::kNone:
        if (mean) factor = 1.0 / plan.denominator;
        break;
      case SegmentReduction::kSeqMeanTokenMean:
        factor = 1.0 /
                 (plan.denominator *
                  static_cast<double>(plan.segment_tokens[segments->ids[row]]));
        break;
      case SegmentReduction::kSeqMeanTokenSum:
        factor = 1.0 / plan.denominator;
        break;
    }
    plan.row_scale[row] = factor;
  }
  return plan;
}

PostTrainingResult ReducePostTrainingRows(
    const PostTrainingArgs& args, const PostTrainingPlan& plan,
    const std::vector<PostTrainingRowTotals>& totals) {
  const CrossEntropyOptions& options = args.base.options;
  const SegmentArgs* segments = args.segments;
  const SegmentReduction segment_reduction = plan.segment_reduction;
  PostTrainingResult out;
  out.base.valid_tokens = plan.valid_tokens;
  out.segment_loss.assign(plan.segment_tokens.size(), 0.0);
  out.segment_tokens = plan.segment_tokens;
  out.segment_distillation.assign(plan.segment_tokens.size(), 0.0);
  double loss = 0.0, distillation = 0.0;
  for (size_t row = 0; row < totals.size(); ++row) {
    const PostTrainingRowTotals& t = totals[row];
    if (!t.valid) continue;
    if (!std::isfinite(t.loss)) ++out.base.nonfinite_rows;
    out.base.correct_tokens += t.correct;
    out.policy.clipped_tokens += t.clipped;
    out.policy.ratio_sum += t.ratio;
    out.policy.approx_kl_sum += t.approx_kl;
    out.policy.kl_sum += t.kl;
    out.policy.entropy_sum += t.entropy;
    out.base.z_loss += plan.row_scale[row] * t.z_loss;
    if (segments != nullptr) {
      out.segment_loss[segments->ids[row]] += t.loss;
      out.segment_distillation[segments->ids[row]] += t.distillation;
    }
    if (segment_reduction == SegmentReduction::kNone) {
      loss += t.loss;
      distillation += t.distillation;
    }
  }
  if (segment_reduction != SegmentReduction::kNone) {
    for (size_t s = 0; s < plan.segment_tokens.size(); ++s) {
      if (plan.segment_tokens[s] == 0) continue;
      const double per =
          segment_reduction == SegmentReduction::kSeqMeanTokenMean
              ? static_cast<double>(plan.segment_tokens[s])
              : 1.0;
      loss += out.segment_loss[s] / per;
      distillation += out.segment_distillation[s] / per;
    }
  }
  FinishLoss(options, plan, loss, distillation, &out);
  return out;
}

PostTrainingResult FinishUnsegmentedPostTraining(
    const CrossEntropyOptions& options, const PostTrainingSums& sums) {
  PostTrainingPlan plan;
  plan.valid_tokens = sums.valid_tokens;
  SetDenominator(options, &plan);
  PostTrainingResult out;
  out.base.valid_tokens = sums.valid_tokens;
  out.base.nonfinite_rows = sums.nonfinite_rows;
  out.base.correct_tokens = sums.correct_tokens;
  out.policy.clipped_tokens = sums.clipped_tokens;
  out.policy.ratio_sum = sums.ratio;
  out.policy.approx_kl_sum = sums.approx_kl;
  out.policy.kl_sum = sums.kl;
  out.policy.entropy_sum = sums.entropy;
  // (PlanPostTraining's row factor without segments)
  const double factor =
      options.reduction == Reduction::kMean ? 1.0 / plan.denominator : 1.0;
  out.base.z_loss = sums.z_loss == 0.0 ? 0.0 : factor * sums.z_loss;
  FinishLoss(options, plan, sums.loss, sums.distillation, &out);
  return out;
}

void SlicePostTrainingRows(const PostTrainingArgs& whole, int64_t row0,
                           int64_t count, void* logits, DType logits_dtype,
                           bool gradient, PostTrainingChunk* holder) {
  const auto offset = [row0](const void* pointer, size_t row_bytes) {
    return pointer == nullptr ? nullptr
                              : static_cast<const char*>(pointer) +
                                    row0 * static_cast<int64_t>(row_bytes);
  };
  const auto shift = [row0](auto* pointer) {
    return pointer == nullptr ? nullptr : pointer + row0;
  };
  PostTrainingArgs& args = holder->args;
  args = whole;
  CrossEntropyArgs& base = args.base;
  base.rows = count;
  base.row_stride = whole.base.vocab;
  base.logits = logits;
  base.logits_dtype = logits_dtype;
  base.mode = gradient ? GradientMode::kInPlace : GradientMode::kNone;
  base.gradient = gradient ? logits : nullptr;
  base.targets =
      offset(whole.base.targets, DTypeSize(whole.base.targets_dtype));
  base.token_loss = shift(whole.base.token_loss);
  base.token_lse = shift(whole.base.token_lse);
  base.token_argmax = shift(whole.base.token_argmax);
  args.token_logprob = shift(whole.token_logprob);
  args.token_entropy = shift(whole.token_entropy);
  args.token_ratio = shift(whole.token_ratio);
  args.token_clipped = shift(whole.token_clipped);
  if (whole.distillation != nullptr) {
    DistillationArgs& kd = holder->distillation;
    kd = *whole.distillation;
    kd.teacher_logits = offset(
        kd.teacher_logits, kd.teacher_row_stride * DTypeSize(kd.teacher_dtype));
    kd.top_k_indices =
        offset(kd.top_k_indices, kd.top_k * DTypeSize(kd.top_k_indices_dtype));
    kd.top_k_logprobs = kd.top_k_logprobs == nullptr
                            ? nullptr
                            : kd.top_k_logprobs + row0 * kd.top_k;
    args.distillation = &kd;
  }
  if (whole.policy != nullptr) {
    PolicyArgs& pg = holder->policy;
    pg = *whole.policy;
    pg.advantages = shift(pg.advantages);
    pg.sampling_logprobs = shift(pg.sampling_logprobs);
    pg.reference_logprobs = shift(pg.reference_logprobs);
    args.policy = &pg;
  }
  if (whole.segments != nullptr) {
    holder->segments = *whole.segments;
    holder->segments.ids = shift(holder->segments.ids);
    args.segments = &holder->segments;
  }
}

}  // namespace lossd
