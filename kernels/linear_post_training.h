// LinearForward with a post-training loss: the hidden states against the
// resident head (kernels/linear_cross_entropy.h) with each chunk's logits
// taking the loss of kernels/post_training.h instead of cross entropy.
#ifndef LOSSD_KERNELS_LINEAR_POST_TRAINING_H_
#define LOSSD_KERNELS_LINEAR_POST_TRAINING_H_

#include "kernels/linear_cross_entropy.h"
#include "kernels/post_training.h"

namespace lossd {

// One problem. Z = X W^T + b as kernels/linear_cross_entropy.h computes it
// (in chunks of rows), the loss of PostTrainingArgs on Z with `linear`'s
// targets, options and per-row outputs, and, with G = dL/dZ (grad_scale and
// the reduction's row factors folded in, times token_grad_output for
// Reduction::kNone), dX = G W, dW (+)= G^T X and dbias (+)= sum_n G[n, :].
//
// `linear` is read as for LinearCrossEntropy, except that its targets may be
// nullptr for a distillation with alpha 0 (every row then counts) and its
// class_weights must be nullptr (options as PostTrainingArgs allows them).
// The row-indexed inputs of distillation, policy and segments cover all
// `linear.rows` rows (a dense teacher [rows, vocab] with its row stride).
// Pointers as `linear`'s (host for the CPU backend, device for CUDA), the
// per-token outputs host pointers.
struct LinearPostTrainingArgs {
  LinearCrossEntropyArgs linear;
  const DistillationArgs* distillation = nullptr;
  const PolicyArgs* policy = nullptr;
  const SegmentArgs* segments = nullptr;
  float* token_logprob = nullptr;    // [rows]
  float* token_entropy = nullptr;    // [rows]
  float* token_ratio = nullptr;      // [rows]
  uint8_t* token_clipped = nullptr;  // [rows]
};

// The whole call as a PostTrainingArgs without logits (its `base.logits` a
// stand-in that is never read, mode kNone): what the post-training checks,
// plan and reduction (kernels/post_training_{validate,plan}.h) take.
inline PostTrainingArgs WholePostTrainingView(
    const LinearPostTrainingArgs& args) {
  const LinearCrossEntropyArgs& linear = args.linear;
  PostTrainingArgs view;
  CrossEntropyArgs& base = view.base;
  base.rows = linear.rows;
  base.vocab = linear.vocab;
  base.row_stride = linear.vocab;
  base.logits_dtype = DType::kFloat32;
  base.logits = linear.rows > 0 ? linear.x : nullptr;
  base.targets_dtype = linear.targets_dtype;
  base.targets = linear.targets;
  base.class_weights = linear.class_weights;
  base.options = linear.options;
  base.mode = GradientMode::kNone;
  base.token_loss = linear.token_loss;
  base.token_lse = linear.token_lse;
  base.token_argmax = linear.token_argmax;
  view.distillation = args.distillation;
  view.policy = args.policy;
  view.segments = args.segments;
  view.token_logprob = args.token_logprob;
  view.token_entropy = args.token_entropy;
  view.token_ratio = args.token_ratio;
  view.token_clipped = args.token_clipped;
  return view;
}

}  // namespace lossd

#endif  // LOSSD_KERNELS_LINEAR_POST_TRAINING_H_
