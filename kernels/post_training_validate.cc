// ValidatePostTrainingArgs and CheckPostTrainingData: the checks of the
// post-training contract that every backend and the server run, in a library
// of their own so that the CUDA backend does not link the CPU one for them.
#include "kernels/post_training_validate.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cross_entropy_validate.h"

namespace lossd {
namespace {

constexpr int64_t kMaxTopK = 512;

absl::Status Invalid(const std::string& message) {
  return absl::InvalidArgumentError(absl::StrCat("post_training: ", message));
}

bool FiniteIn(double value, double low, double high) {
  return std::isfinite(value) && value >= low && value <= high;
}

// The distillation's fields (ValidatePostTrainingArgs).
absl::Status ValidateDistillation(const DistillationArgs& kd, int64_t vocab) {
  if (!(std::isfinite(kd.temperature) && kd.temperature > 0.0f)) {
    return Invalid(absl::StrCat("distillation.temperature must be > 0, got ",
                                kd.temperature));
  }
  if (!FiniteIn(kd.alpha, 0.0, 1.0)) {
    return Invalid(
        absl::StrCat("distillation.alpha must be in [0, 1], got ", kd.alpha));
  }
  const int divergence = static_cast<int>(kd.divergence);
  if (divergence < 1 || divergence > 3) {
    return Invalid(
        absl::StrCat("unknown distillation.divergence ", divergence));
  }
  if (kd.divergence == Divergence::kJsd && !FiniteIn(kd.beta, 0.0, 1.0)) {
    return Invalid(
        absl::StrCat("distillation.beta must be in [0, 1], got ", kd.beta));
  }
  const bool dense = kd.teacher_logits != nullptr;
  const bool sparse =
      kd.top_k_indices != nullptr || kd.top_k_logprobs != nullptr;
  if (dense == sparse) {
    return Invalid(
        "distillation needs exactly one teacher: dense logits or top-k");
  }
  if (dense) {
    if (!IsLogitsDType(kd.teacher_dtype)) {
      return Invalid("the teacher logits must be fp32, bf16 or fp16");
    }
    if (kd.teacher_row_stride < vocab) {
      return Invalid("teacher_row_stride must be >= vocab");
    }
  } else {
    const int64_t limit = std::min(vocab, kMaxTopK);
    if (kd.top_k < 1 || kd.top_k > limit) {
      return Invalid(absl::StrCat("top-k k = ", kd.top_k,
                                  " must be in [1, min(V, 512)] = [1, ", limit,
                                  "]"));
    }
    if (kd.top_k_indices == nullptr || kd.top_k_logprobs == nullptr) {
      return Invalid("a top-k teacher needs both indices and logprobs");
    }
    if (!IsTargetsDType(kd.top_k_indices_dtype)) {
      return Invalid("top-k indices must be int32 or int64");
    }
    const int tail = static_cast<int>(kd.tail);
    if (tail < 1 || tail > 2) {
      return Invalid(absl::StrCat("unknown top-k tail ", tail));
    }
  }
  return absl::OkStatus();
}

// The policy's fields (ValidatePostTrainingArgs).
absl::Status ValidatePolicy(const PolicyArgs& pg) {
  const int loss = static_cast<int>(pg.loss);
  if (loss < 1 || loss > 3) {
    return Invalid(absl::StrCat("unknown policy.loss ", loss));
  }
  const int estimator = static_cast<int>(pg.kl_estimator);
  if (estimator < 1 || estimator > 3) {
    return Invalid(absl::StrCat("unknown policy.kl_estimator ", estimator));
  }
  if (pg.advantages == nullptr || pg.sampling_logprobs == nullptr) {
    return Invalid("policy needs advantages and sampling logprobs");
  }
  if (!(std::isfinite(pg.epsilon_low) && pg.epsilon_low >= 0.0f &&
        pg.epsilon_low < 1.0f)) {
    return Invalid(absl::StrCat("policy.epsilon_low must be in [0, 1), got ",
                                pg.epsilon_low));
  }
  if (!(std::isfinite(pg.epsilon_high) && pg.epsilon_high >= 0.0f)) {
    return Invalid(absl::StrCat("policy.epsilon_high must be >= 0, got ",
                                pg.epsilon_high));
  }
  if (!(std::isfinite(pg.kl_coef) && pg.kl_coef >= 0.0f)) {
    return Invalid(
        absl::StrCat("policy.kl_coef must be >= 0, got ", pg.kl_coef));
  }
  if (pg.kl_coef > 0.0f && pg.reference_logprobs == nullptr) {
    return Invalid("policy.kl_coef > 0 needs reference logprobs");
  }
  return absl::OkStatus();
}

// The segments' fields (ValidatePostTrainingArgs).
absl::Status ValidateSegments(const SegmentArgs& segments,
                              Reduction options_reduction) {
  if (segments.ids == nullptr) return Invalid("segment ids are missing");
  if (segments.count < 1 || segments.count > INT32_MAX) {
    return Invalid(absl::StrCat("segments.count = ", segments.count,
                                " must be in [1, 2^31)"));
  }
  const int reduction = static_cast<int>(segments.reduction);
  if (reduction < 0 || reduction > 2) {
    return Invalid(absl::StrCat("unknown segments.reduction ", reduction));
  }
  if (segments.reduction != SegmentReduction::kNone &&
      options_reduction != Reduction::kMean) {
    return Invalid(
        "a segment reduction needs the options' reduction to be MEAN");
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidatePostTrainingArgs(const PostTrainingArgs& args) {
  const CrossEntropyArgs& base = args.base;
  const DistillationArgs* kd = args.distillation;
  const PolicyArgs* pg = args.policy;
  const bool targets_optional = kd != nullptr && kd->alpha == 0.0f;
  if (base.targets == nullptr && !targets_optional) {
    return Invalid(
        "targets are required (only a distillation with alpha 0 goes "
        "without)");
  }
  CrossEntropyArgs checked = base;
  if (checked.targets == nullptr) {
    // Validated as if present; the rows then all count.
    checked.targets = base.logits;
    checked.targets_dtype = DType::kInt32;
  }
  absl::Status status = ValidateCrossEntropyArgs(checked);
  if (!status.ok()) return status;
  const CrossEntropyOptions& options = base.options;
  // A class weight would weigh a row by its target's class, which the
  // divergence and the policy terms do not have; label smoothing changes the
  // target distribution, which a policy loss does not have (docs/api.md).
  if (base.class_weights != nullptr) {
    return Invalid(
        "class_weights do not compose with distillation, policy losses or "
        "segments");
  }
  if (options.label_smoothing != 0.0f && pg != nullptr) {
    return Invalid("label_smoothing does not compose with policy losses");
  }
  if (kd != nullptr && pg != nullptr) {
    return Invalid("distillation and policy cannot be combined");
  }
  if (kd != nullptr) {
    status = ValidateDistillation(*kd, base.vocab);
    if (!status.ok()) return status;
  }
  if (pg != nullptr) {
    status = ValidatePolicy(*pg);
    if (!status.ok()) return status;
  }
  if (args.segments != nullptr) {
    status = ValidateSegments(*args.segments, options.reduction);
    if (!status.ok()) return status;
  }
  return absl::OkStatus();
}

absl::Status CheckPostTrainingData(const PostTrainingArgs& args) {
  const CrossEntropyArgs& base = args.base;
  const int64_t rows = base.rows;
  if (base.targets != nullptr) {
    absl::Status status = CheckTargets(base.targets, base.targets_dtype, rows,
                                       base.vocab, base.options.ignore_index);
    if (!status.ok()) return status;
  }
  if (args.distillation != nullptr &&
      args.distillation->teacher_logits == nullptr) {
    const DistillationArgs& kd = *args.distillation;
    const int64_t k = kd.top_k;
    std::vector<int64_t> stamp(base.vocab, 0);
    for (int64_t row = 0; row < rows; ++row) {
      bool row_has_mass = false;
      for (int64_t j = 0; j < k; ++j) {
        const int64_t index =
            LoadTarget(kd.top_k_indices, kd.top_k_indices_dtype, row * k + j);
        if (index < 0 || index >= base.vocab) {
          return Invalid(absl::StrCat("top-k index [", row, ", ", j,
                                      "] = ", index, " is outside [0, ",
                                      base.vocab, ")"));
        }
        if (stamp[index] == row + 1) {
          return Invalid(absl::StrCat("top-k index ", index,
                                      " appears twice in row ", row));
        }
        stamp[index] = row + 1;
        const float logprob = kd.top_k_logprobs[row * k + j];
        if (std::isnan(logprob) || logprob > 0.0f) {
          return Invalid(absl::StrCat("top-k logprob [", row, ", ", j,
                                      "] = ", logprob, " must be <= 0"));
        }
        row_has_mass = row_has_mass || logprob > -INFINITY;
      }
      if (kd.tail == TopKTail::kRenormalize && !row_has_mass) {
        return Invalid(absl::StrCat(
            "top-k logprobs of row ", row,
            " are all -inf: the renormalised support has no mass"));
      }
    }
  }
  if (args.policy != nullptr) {
    const PolicyArgs& pg = *args.policy;
    const struct {
      const char* name;
      const float* values;
    } inputs[] = {{"advantages", pg.advantages},
                  {"sampling_logprobs", pg.sampling_logprobs},
                  {"reference_logprobs", pg.reference_logprobs}};
    for (const auto& input : inputs) {
      if (input.values == nullptr) continue;
      for (int64_t row = 0; row < rows; ++row) {
        if (!std::isfinite(input.values[row])) {
          return Invalid(absl::StrCat("policy ", input.name, "[", row, "] = ",
                                      input.values[row], " is not finite"));
        }
      }
    }
  }
  if (args.segments != nullptr) {
    const SegmentArgs& segments = *args.segments;
    for (int64_t row = 0; row < rows; ++row) {
      const int32_t id = segments.ids[row];
      if (id < 0 || id >= segments.count) {
        return Invalid(absl::StrCat("segment id [", row, "] = ", id,
                                    " is outside [0, ", segments.count, ")"));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace lossd
