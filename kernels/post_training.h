// The post-training losses' contract beside cross entropy (distillation, policy
// losses, segment sums) for every backend. Standard headers only, so that .cu
// files include it; nothing here knows about handles, gRPC or absl.
#ifndef LOSSD_KERNELS_POST_TRAINING_H_
#define LOSSD_KERNELS_POST_TRAINING_H_

#include <cstdint>
#include <limits>
#include <vector>

#include "common/dtype.h"
#include "common/post_training_options.h"
#include "kernels/cross_entropy.h"

namespace lossd {

// Distillation of the student logits z against a teacher (docs/api.md,
// "Distillation"). With u = z / temperature, p = softmax(u) and the teacher's
// q, each valid row's loss is
//   alpha * (lse(z) - z_y) + (1 - alpha) * D(q, p)
// where D is taken over buckets b: every class for a dense teacher; the k
// indices for kRenormalize (both sides renormalised over them); the k indices
// and one tail bucket for kBucket (k < vocab). With P_b, Q_b the bucket masses:
//   forward KL  D = sum_b Q_b (log Q_b - log P_b)
//   reverse KL  D = sum_b P_b (log P_b - log Q_b)
//   JSD(beta)   D = beta KL(Q || M) + (1 - beta) KL(P || M),
//               M = beta Q + (1 - beta) P   (beta 0 / 1: forward / reverse KL)
// and with g_b = dD/dP_b, gbar = sum_b P_b g_b the gradient is
//   dD/du_c = w_c (g_{b(c)} - gbar),  dD/dz_c = dD/du_c / temperature,
// w_c = p_c, or P_c on the support and 0 off it for kRenormalize.
struct DistillationArgs {
  float temperature = 1.0f;  // > 0
  float alpha = 0.0f;        // in [0, 1]
  Divergence divergence = Divergence::kForwardKl;
  float beta = 0.5f;  // kJsd only, in [0, 1]

  // Dense teacher: [rows, vocab] logits of teacher_dtype, teacher_row_stride
  // elements between rows; nullptr when the teacher is top-k.
  const void* teacher_logits = nullptr;
  DType teacher_dtype = DType::kFloat32;
  int64_t teacher_row_stride = 0;

  // Top-k teacher: [rows, top_k] indices (int32/int64, distinct in a row, in
  // [0, vocab)) and fp32 log q (<= 0, not NaN; -inf is mass 0).
  int64_t top_k = 0;
  const void* top_k_indices = nullptr;
  DType top_k_indices_dtype = DType::kInt32;
  const float* top_k_logprobs = nullptr;
  TopKTail tail = TopKTail::kRenormalize;
};

// A row whose gradient is NaN over the whole row, from its divergence term D
// (docs/api.md, "Edge rows"): D is NaN where a side has no distribution (the
// student's row, or its renormalised support, or a dense teacher's row all
// -inf), and reverse KL's D is +inf where the teacher has no mass and the
// student has: torch's gradient there is NaN too (inf - inf). Forward KL's
// +inf (a student of mass 0 where the teacher has mass) keeps its finite
// gradient (p - q) / tau, as torch's kl_div. `reverse_kl`: the divergence
// computed is reverse KL (JSD at beta 1 included). Every backend applies it.
constexpr bool DistillationGradientIsNan(bool reverse_kl, double divergence) {
  return divergence != divergence ||
         (reverse_kl && divergence == std::numeric_limits<double>::infinity());
}

// A per-token policy-gradient loss on the sampled tokens (the targets). With
// logp = z_y - lse(z), r = exp(logp - sampling_logprobs_i), A = advantages_i,
// clip(r) = min(max(r, 1 - epsilon_low), 1 + epsilon_high):
//   kImportanceSampling  l = -r A
//   kPpoClip             l = max(-r A, -clip(r) A)
//   kCispo               l = -clip(r) A logp, clip(r) held constant
// plus kl_coef * KL with d = reference_logprobs_i - logp and KL = -d (k1),
// d^2 / 2 (k2), exp(d) - d - 1 (k3). The gradient is
//   dl/dz_c = (dl/dlogp) ([c == y] - softmax(z)_c),
// where PPO's dl/dlogp is 0 when its clipped branch is strictly larger (at
// exactly 1 + epsilon_high or 1 - epsilon_low the gradient flows, as torch's
// max and clamp give it).
struct PolicyArgs {
  PolicyLossKind loss = PolicyLossKind::kPpoClip;
  const float* advantages = nullptr;          // [rows], finite
  const float* sampling_logprobs = nullptr;   // [rows], finite
  float epsilon_low = 0.2f;                   // in [0, 1)
  float epsilon_high = 0.2f;                  // >= 0
  const float* reference_logprobs = nullptr;  // [rows] or nullptr
  float kl_coef = 0.0f;                       // >= 0
  KlEstimator kl_estimator = KlEstimator::kK3;
};

// Packed sequences: ids [rows] int32 in [0, count).
struct SegmentArgs {
  const int32_t* ids = nullptr;
  int64_t count = 0;
  // kNone: base.options.reduction over tokens. Otherwise the mean over
  // segments with a valid token (or / normalizer when > 0) of each segment's
  // token mean or token sum; base.options.reduction must be kMean.
  SegmentReduction reduction = SegmentReduction::kNone;
};

// One post-training problem. `base` carries the student logits, the targets
// (may be nullptr only for a distillation with alpha 0: then every row is
// valid), the options (class_weights must be off; label_smoothing applies to
// the cross-entropy terms, so not with a policy; z_loss_scale adds
// z_loss_scale lse(z)^2 to every valid row), the gradient mode and buffer, and
// the per-token outputs, as for cross entropy; token_loss is the row's full
// loss. Exactly one of distillation and
// policy may be set; with neither the loss is plain cross entropy (useful with
// segments). Pointers are host pointers for the CPU backend and device pointers
// for a GPU backend, except the per-token outputs, which are host pointers.
struct PostTrainingArgs {
  CrossEntropyArgs base;
  const DistillationArgs* distillation = nullptr;
  const PolicyArgs* policy = nullptr;
  const SegmentArgs* segments = nullptr;
  // [rows] log softmax(z)_y (0 for ignored rows); [rows] entropy of softmax(z).
  float* token_logprob = nullptr;
  float* token_entropy = nullptr;
  // [rows] the policy's ratio r and whether the row counts in
  // clipped_tokens (0 / 1); 0 for ignored rows and without a policy.
  float* token_ratio = nullptr;
  uint8_t* token_clipped = nullptr;
};

struct PolicyStatsResult {
  int64_t clipped_tokens = 0;
  double ratio_sum = 0.0;
  double approx_kl_sum = 0.0;  // sum of sampling_logprob - logp
  double kl_sum = 0.0;         // sum of the reference KL estimate
  double entropy_sum = 0.0;
};

struct PostTrainingResult {
  // loss reduced as the options (and segments) say; z_loss the z-loss terms
  // reduced with the same row factors; denominator is the segment count used
  // with a segment reduction.
  CrossEntropyResult base;
  double distillation_loss = 0.0;  // the divergence term alone, reduced
  PolicyStatsResult policy;
  std::vector<double> segment_loss;  // [segments->count] unreduced sums
  // [segments->count] unreduced sums of the divergence term alone.
  std::vector<double> segment_distillation;
  std::vector<int64_t> segment_tokens;  // [segments->count] valid tokens
};

}  // namespace lossd

#endif  // LOSSD_KERNELS_POST_TRAINING_H_
