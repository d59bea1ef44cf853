// lossctl's post-training flags: the distillation, policy-gradient and
// segment options of forward and eval (lossctl_post_training.h).
#include "client/lossctl_post_training.h"

#include <cstdint>
#include <cstdio>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "common/status_macros.h"

// The post-training losses of forward (docs/api.md, "Post-training losses").
// Each tensor flag takes a handle or a tensor file sent inline.
ABSL_FLAG(std::string, teacher, "",
          "distillation: handle of the dense teacher logits [N, V]");
ABSL_FLAG(std::string, teacher_indices, "",
          "distillation: top-k teacher indices [N, k] (int32/int64)");
ABSL_FLAG(std::string, teacher_logprobs, "",
          "distillation: top-k teacher logprobs [N, k] (float32)");
ABSL_FLAG(int, top_k, 0, "k of the top-k teacher (0 = from its shape)");
ABSL_FLAG(std::string, top_k_tail, "renormalize", "renormalize or bucket");
ABSL_FLAG(double, temperature, 1.0, "distillation temperature (> 0)");
ABSL_FLAG(double, alpha, 0.0,
          "weight of the cross entropy against TARGETS in a distillation");
ABSL_FLAG(std::string, divergence, "forward_kl",
          "forward_kl, reverse_kl or jsd");
ABSL_FLAG(double, beta, 0.5, "jsd: the teacher's weight in the mixture");
ABSL_FLAG(std::string, policy_loss, "",
          "importance_sampling, ppo or cispo (on the sampled TARGETS)");
ABSL_FLAG(std::string, advantages, "", "policy: advantages [N] (float32)");
ABSL_FLAG(std::string, old_logprobs, "",
          "policy: the sampling policy's logprobs [N] (float32)");
ABSL_FLAG(std::string, ref_logprobs, "",
          "policy: a reference model's logprobs [N] (float32), for --kl_coef");
ABSL_FLAG(double, epsilon_low, 0.2, "policy: clip range below 1");
ABSL_FLAG(double, epsilon_high, -1.0,
          "policy: clip range above 1 (< 0 = --epsilon_low)");
ABSL_FLAG(double, kl_coef, 0.0, "policy: weight of the reference KL");
ABSL_FLAG(std::string, kl_estimator, "k3", "k1, k2 or k3");
ABSL_FLAG(std::string, segments, "",
          "segment ids [N] (int32) of packed sequences");
ABSL_FLAG(int, num_segments, 0, "number of segments (required with them)");
ABSL_FLAG(std::string, segment_reduction, "",
          "empty, seq_mean_token_mean or seq_mean_token_sum");
ABSL_FLAG(bool, token_logprob, false, "forward: print log p(target) per row");
ABSL_FLAG(bool, token_entropy, false, "forward: print the entropy per row");
ABSL_FLAG(bool, token_ratio, false,
          "forward: print the policy's ratio and clipped flag per row");

namespace lossd {
namespace {

absl::Status UsageError(absl::string_view message) {
  return absl::InvalidArgumentError(absl::StrCat("usage: ", message));
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// A tensor flag of the post-training losses: unset, a handle, or a tensor
// file sent inline (opened into `files`, which must outlive the call).
absl::StatusOr<LossInput> LossInputFlag(
    const std::string& value,
    std::vector<std::unique_ptr<InputTensor>>* files) {
  if (value.empty()) return LossInput();
  if (!LooksLikeTensorFile(value)) return LossInput::Handle(value);
  ASSIGN_OR_RETURN(std::unique_ptr<InputTensor> file, InputTensor::Open(value));
  files->push_back(std::move(file));
  const InputTensor& opened = *files->back();
  return LossInput::Inline(opened.dtype(), opened.data(), opened.bytes());
}

// `value` as one of `names`, whose index i maps to the enum value i + 1.
template <typename Enum>
absl::StatusOr<Enum> EnumFlag(const char* flag, const std::string& value,
                              std::initializer_list<const char*> names) {
  int i = 1;
  for (const char* name : names) {
    if (value == name) return static_cast<Enum>(i);
    ++i;
  }
  return UsageError(absl::StrCat("--", flag, "=", value, ": one of ",
                                 absl::StrJoin(names, ", ")));
}

// A distillation's options other than its teacher tensors, from the flags.
absl::Status DistillationScalarsFromFlags(DistillationOptions* distillation) {
  distillation->top_k = absl::GetFlag(FLAGS_top_k);
  ASSIGN_OR_RETURN(
      distillation->tail,
      EnumFlag<TopKTail>("top_k_tail", absl::GetFlag(FLAGS_top_k_tail),
                         {"renormalize", "bucket"}));
  ASSIGN_OR_RETURN(
      distillation->divergence,
      EnumFlag<Divergence>("divergence", absl::GetFlag(FLAGS_divergence),
                           {"forward_kl", "reverse_kl", "jsd"}));
  distillation->temperature =
      static_cast<float>(absl::GetFlag(FLAGS_temperature));
  distillation->alpha = static_cast<float>(absl::GetFlag(FLAGS_alpha));
  distillation->beta = static_cast<float>(absl::GetFlag(FLAGS_beta));
  return absl::OkStatus();
}

// Segment options other than the ids, from the flags.
absl::Status SegmentScalarsFromFlags(SegmentOptions* segments) {
  segments->count = absl::GetFlag(FLAGS_num_segments);
  const std::string reduction = absl::GetFlag(FLAGS_segment_reduction);
  if (!reduction.empty()) {
    ASSIGN_OR_RETURN(segments->reduction,
                     EnumFlag<SegmentReduction>(
                         "segment_reduction", reduction,
                         {"seq_mean_token_mean", "seq_mean_token_sum"}));
  }
  return absl::OkStatus();
}

// The policy's loss (`policy_loss`, the flag's value), epsilons, kl_coef and
// estimator from the flags; its per-token inputs untouched.
absl::Status PolicyScalarsFromFlags(const std::string& policy_loss,
                                    PolicyGradientOptions* policy) {
  ASSIGN_OR_RETURN(policy->loss, EnumFlag<PolicyLossKind>(
                                     "policy_loss", policy_loss,
                                     {"importance_sampling", "ppo", "cispo"}));
  policy->epsilon_low = static_cast<float>(absl::GetFlag(FLAGS_epsilon_low));
  if (absl::GetFlag(FLAGS_epsilon_high) >= 0) {
    policy->epsilon_high =
        static_cast<float>(absl::GetFlag(FLAGS_epsilon_high));
  }
  policy->kl_coef = static_cast<float>(absl::GetFlag(FLAGS_kl_coef));
  ASSIGN_OR_RETURN(
      policy->kl_estimator,
      EnumFlag<KlEstimator>("kl_estimator", absl::GetFlag(FLAGS_kl_estimator),
                            {"k1", "k2", "k3"}));
  return absl::OkStatus();
}

}  // namespace

template <typename Options>
absl::Status PostTrainingFlagsInto(
    Options* options, std::vector<std::unique_ptr<InputTensor>>* files) {
  const std::string teacher = absl::GetFlag(FLAGS_teacher);
  const std::string indices = absl::GetFlag(FLAGS_teacher_indices);
  const std::string logprobs = absl::GetFlag(FLAGS_teacher_logprobs);
  if (!teacher.empty() || !indices.empty() || !logprobs.empty()) {
    DistillationOptions distillation;
    distillation.teacher_logits = teacher;
    ASSIGN_OR_RETURN(distillation.top_k_indices, LossInputFlag(indices, files));
    ASSIGN_OR_RETURN(distillation.top_k_logprobs,
                     LossInputFlag(logprobs, files));
    RETURN_IF_ERROR(DistillationScalarsFromFlags(&distillation));
    if (distillation.top_k == 0 && !files->empty()) {
      // k from an inline top-k file's shape ([N, k]).
      const std::vector<int64_t>& shape = files->back()->shape();
      if (shape.size() == 2) distillation.top_k = static_cast<int>(shape[1]);
    }
    options->distillation = distillation;
  }
  const std::string policy_loss = absl::GetFlag(FLAGS_policy_loss);
  if (!policy_loss.empty()) {
    PolicyGradientOptions policy;
    RETURN_IF_ERROR(PolicyScalarsFromFlags(policy_loss, &policy));
    ASSIGN_OR_RETURN(policy.advantages,
                     LossInputFlag(absl::GetFlag(FLAGS_advantages), files));
    ASSIGN_OR_RETURN(policy.sampling_logprobs,
                     LossInputFlag(absl::GetFlag(FLAGS_old_logprobs), files));
    ASSIGN_OR_RETURN(policy.reference_logprobs,
                     LossInputFlag(absl::GetFlag(FLAGS_ref_logprobs), files));
    options->policy = policy;
  }
  const std::string segments = absl::GetFlag(FLAGS_segments);
  const std::string segment_reduction = absl::GetFlag(FLAGS_segment_reduction);
  if (!segments.empty()) {
    SegmentOptions segment_options;
    ASSIGN_OR_RETURN(segment_options.ids, LossInputFlag(segments, files));
    RETURN_IF_ERROR(SegmentScalarsFromFlags(&segment_options));
    options->segments = segment_options;
  } else if (!segment_reduction.empty()) {
    return UsageError("--segment_reduction needs --segments");
  }
  options->token_logprob = absl::GetFlag(FLAGS_token_logprob);
  options->token_entropy = absl::GetFlag(FLAGS_token_entropy);
  options->token_ratio = absl::GetFlag(FLAGS_token_ratio);
  options->token_clipped = options->token_ratio;
  return absl::OkStatus();
}

namespace {

// The lines forward, linear and eval share: the divergence, the policy's
// statistics (each when asked for) and one line a segment.
void PrintPostTrainingSums(bool distillation, bool policy,
                           double distillation_loss, const PolicyStats& stats,
                           const std::vector<double>& segment_loss,
                           const std::vector<int64_t>& segment_tokens) {
  if (distillation) {
    std::printf("distillation_loss %.17g\n", distillation_loss);
  }
  if (policy) {
    std::printf(
        "clipped_tokens %lld ratio_sum %.17g approx_kl_sum %.17g kl_sum %.17g "
        "entropy_sum %.17g\n",
        static_cast<long long>(stats.clipped_tokens), stats.ratio_sum,
        stats.approx_kl_sum, stats.kl_sum, stats.entropy_sum);
  }
  for (std::size_t s = 0; s < segment_loss.size(); ++s) {
    std::printf("segment %zu loss %.17g tokens %lld\n", s, segment_loss[s],
                static_cast<long long>(segment_tokens[s]));
  }
}

}  // namespace

template <typename Options>
void PrintPostTrainingResult(const Options& options,
                             const ForwardResult& result) {
  PrintPostTrainingSums(options.distillation.has_value(),
                        options.policy.has_value(), result.distillation_loss,
                        result.policy_stats, result.segment_loss,
                        result.segment_tokens);
  for (std::size_t r = 0; r < result.token_logprob.size(); ++r) {
    std::printf("row %zu logprob %.9g\n", r, result.token_logprob[r]);
  }
  for (std::size_t r = 0; r < result.token_entropy.size(); ++r) {
    std::printf("row %zu entropy %.9g\n", r, result.token_entropy[r]);
  }
  for (std::size_t r = 0; r < result.token_ratio.size(); ++r) {
    std::printf(
        "row %zu ratio %.9g clipped %d\n", r, result.token_ratio[r],
        r < result.token_clipped.size() && result.token_clipped[r] ? 1 : 0);
  }
}

absl::Status EvalPostTrainingFromFlags(int64_t rows, EvaluateOptions* options,
                                       std::vector<EvalColumn>* columns) {
  const auto open_column = [&](const std::string& path, const char* flag,
                               std::string RowBlock::*field) -> absl::Status {
    if (!LooksLikeTensorFile(path)) {
      return UsageError(absl::StrCat("eval --", flag, "=", path,
                                     ": expected a .npy or .safetensors file"));
    }
    ASSIGN_OR_RETURN(std::unique_ptr<InputTensor> file,
                     InputTensor::Open(path));
    if (file->shape().empty() || file->shape()[0] != rows) {
      return absl::InvalidArgumentError(
          absl::StrCat(file->description(), ": expected ", rows, " rows, got ",
                       ShapeString(file->shape())));
    }
    columns->push_back({std::move(file), field});
    return absl::OkStatus();
  };
  const std::string teacher = absl::GetFlag(FLAGS_teacher);
  const std::string teacher_indices = absl::GetFlag(FLAGS_teacher_indices);
  const std::string segment_ids = absl::GetFlag(FLAGS_segments);
  const std::string policy_loss = absl::GetFlag(FLAGS_policy_loss);
  if (!policy_loss.empty()) {
    PolicyGradientOptions policy;
    RETURN_IF_ERROR(PolicyScalarsFromFlags(policy_loss, &policy));
    RETURN_IF_ERROR(open_column(absl::GetFlag(FLAGS_advantages), "advantages",
                                &RowBlock::advantages));
    RETURN_IF_ERROR(open_column(absl::GetFlag(FLAGS_old_logprobs),
                                "old_logprobs", &RowBlock::sampling_logprobs));
    const std::string reference = absl::GetFlag(FLAGS_ref_logprobs);
    if (!reference.empty()) {
      RETURN_IF_ERROR(open_column(reference, "ref_logprobs",
                                  &RowBlock::reference_logprobs));
      policy.evaluate_reference_logprobs = true;
    }
    options->policy = policy;
  } else if (!absl::GetFlag(FLAGS_advantages).empty() ||
             !absl::GetFlag(FLAGS_old_logprobs).empty() ||
             !absl::GetFlag(FLAGS_ref_logprobs).empty()) {
    return UsageError(
        "eval: --advantages, --old_logprobs and --ref_logprobs need "
        "--policy_loss");
  }
  if (!teacher.empty() || !teacher_indices.empty()) {
    DistillationOptions distillation;
    RETURN_IF_ERROR(DistillationScalarsFromFlags(&distillation));
    if (!teacher.empty()) {
      RETURN_IF_ERROR(
          open_column(teacher, "teacher", &RowBlock::teacher_logits));
      distillation.evaluate_teacher_dtype = columns->back().file->dtype();
    } else {
      RETURN_IF_ERROR(open_column(teacher_indices, "teacher_indices",
                                  &RowBlock::teacher_indices));
      const InputTensor& indices = *columns->back().file;
      distillation.top_k_indices_dtype = indices.dtype();
      if (indices.shape().size() == 2) {
        distillation.top_k = static_cast<int>(indices.shape()[1]);
      }
      RETURN_IF_ERROR(open_column(absl::GetFlag(FLAGS_teacher_logprobs),
                                  "teacher_logprobs",
                                  &RowBlock::teacher_logprobs));
    }
    options->distillation = distillation;
  }
  if (!segment_ids.empty()) {
    RETURN_IF_ERROR(
        open_column(segment_ids, "segments", &RowBlock::segment_ids));
    SegmentOptions segments;
    RETURN_IF_ERROR(SegmentScalarsFromFlags(&segments));
    options->segments = segments;
  }
  return absl::OkStatus();
}

void CopyEvalColumns(const std::vector<EvalColumn>& columns, int64_t rows,
                     int64_t first_row, int64_t count, RowBlock* block) {
  for (const EvalColumn& column : columns) {
    const std::size_t row_bytes = column.file->bytes() / rows;
    (block->*column.field)
        .assign(reinterpret_cast<const char*>(column.file->data()) +
                    first_row * row_bytes,
                count * row_bytes);
  }
}

void PrintEvalPostTrainingResult(const EvaluateOptions& options,
                                 const EvaluateResult& result) {
  PrintPostTrainingSums(options.distillation.has_value(),
                        options.policy.has_value(), result.distillation_loss,
                        result.policy_stats, result.segment_loss,
                        result.segment_tokens);
}

template absl::Status PostTrainingFlagsInto(
    ForwardOptions*, std::vector<std::unique_ptr<InputTensor>>*);
template absl::Status PostTrainingFlagsInto(
    LinearForwardOptions*, std::vector<std::unique_ptr<InputTensor>>*);
template void PrintPostTrainingResult(const ForwardOptions&,
                                      const ForwardResult&);
template void PrintPostTrainingResult(const LinearForwardOptions&,
                                      const ForwardResult&);

}  // namespace lossd
