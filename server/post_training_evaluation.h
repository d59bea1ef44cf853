// Evaluate with distillation, a policy loss or segments: what the header
// fixes for every block (the teacher's rows, the policy's inputs and segment
// ids come in the blocks or frames), and how their sums become the response.
#ifndef LOSSD_SERVER_POST_TRAINING_EVALUATION_H_
#define LOSSD_SERVER_POST_TRAINING_EVALUATION_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "common/dtype.h"
#include "common/loss_options.h"
#include "kernels/post_training.h"

namespace lossd {
namespace v1 {
class EvaluateHeader;
}  // namespace v1

// What the header says about every block: the distillation (its pointers
// unset) and the teacher's form, the policy loss (its inputs unset) and
// whether reference logprobs come, and the segments (ids unset).
struct PostTrainingEvaluation {
  bool distill = false;
  DistillationArgs distillation;  // teacher pointers null; top_k, tail set
  DType teacher_dtype = DType::kInvalid;          // dense teacher rows
  DType teacher_indices_dtype = DType::kInvalid;  // top-k teacher rows
  bool policy = false;
  PolicyArgs policy_args;         // input pointers null
  bool policy_reference = false;  // the blocks carry reference logprobs
  bool segmented = false;
  int64_t segment_count = 0;
  SegmentReduction segment_reduction = SegmentReduction::kNone;
};

// The most segments an Evaluate may name (its response carries three
// numbers per segment).
inline constexpr int64_t kMaxEvaluateSegments = int64_t{1} << 20;

// True when the header asks for a post-training evaluation.
bool IsPostTrainingEvaluation(const lossd::v1::EvaluateHeader& header);

// The header's post-training part, checked against `vocab` and `options`
// (ValidateEvaluateHeader's; over hidden states, V is the weight's, known
// once the head is leased). INVALID_ARGUMENT: a teacher, policy input or
// ids in the header itself; a distillation without exactly one of
// teacher_logits_dtype (a float dtype) and teacher_top_k (with
// teacher_indices_dtype int32/int64); distillation and policy together;
// policy_reference_logprobs without a policy; class_weights with any of
// them; anything ValidatePostTrainingArgs
// refuses (the options, the distillation's and the policy's numbers, k,
// segments' count and reduction). Thread-safe.
absl::StatusOr<PostTrainingEvaluation> ParsePostTrainingEvaluation(
    const lossd::v1::EvaluateHeader& header, int64_t vocab,
    const CrossEntropyOptions& options);

}  // namespace lossd

#endif  // LOSSD_SERVER_POST_TRAINING_EVALUATION_H_
