// Evaluate with a post-training loss: the header's checks, one block's device
// call with its teacher rows and segment ids, and the reduction of the sums
// (post_training_evaluation.h, evaluation.h).
#include "server/post_training_evaluation.h"

#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"
#include "kernels/post_training_validate.h"
#include "lossd/v1/lossd.pb.h"
#include "server/evaluation.h"
#include "server/post_training_forward.h"
#include "server/staged.h"
#include "server/validation.h"

namespace lossd {

namespace pb = ::lossd::v1;

bool IsPostTrainingEvaluation(const pb::EvaluateHeader& header) {
  return header.has_distillation() || header.has_policy() ||
         header.policy_reference_logprobs() || header.has_segments();
}

namespace {

// The header's policy (its scalars; the per-token inputs come in the blocks)
// into post->policy_args, checked as ValidatePostTrainingArgs checks `args`
// (a stand-in problem of one row) with it. INVALID_ARGUMENT: no policy beside
// policy_reference_logprobs, an input in the header, ParsePolicyScalars'.
absl::Status ParseEvaluatePolicy(const pb::EvaluateHeader& header,
                                 PostTrainingArgs args,
                                 PostTrainingEvaluation* post) {
  static const float stand_in[1] = {0.0f};
  if (!header.has_policy()) {
    return absl::InvalidArgumentError(
        "header.policy_reference_logprobs is set without a header.policy");
  }
  const pb::PolicyGradient& policy = header.policy();
  if (policy.advantages_case() != pb::PolicyGradient::ADVANTAGES_NOT_SET ||
      policy.sampling_logprobs_case() !=
          pb::PolicyGradient::SAMPLING_LOGPROBS_NOT_SET ||
      policy.reference_logprobs_case() !=
          pb::PolicyGradient::REFERENCE_LOGPROBS_NOT_SET) {
    return absl::InvalidArgumentError(
        "header.policy's advantages, sampling_logprobs and "
        "reference_logprobs must be unset in Evaluate: they come in the "
        "blocks (reference logprobs with header.policy_reference_logprobs)");
  }
  ASSIGN_OR_RETURN(post->policy_args, ParsePolicyScalars(policy));
  post->policy = true;
  post->policy_reference = header.policy_reference_logprobs();
  // Stand-ins (finite) for the blocks' inputs: the header's numbers are
  // checked now, the blocks' values as they come.
  PolicyArgs checked = post->policy_args;
  checked.advantages = stand_in;
  checked.sampling_logprobs = stand_in;
  if (post->policy_reference) checked.reference_logprobs = stand_in;
  args.policy = &checked;
  return ValidatePostTrainingArgs(args);
}

// The header's segments (count and reduction; the ids come in the blocks)
// into *post. INVALID_ARGUMENT: ids in the header, an unknown reduction, a
// count outside [1, kMaxEvaluateSegments], a segment reduction without MEAN.
absl::Status ParseEvaluateSegments(const pb::Segments& segments,
                                   const CrossEntropyOptions& options,
                                   PostTrainingEvaluation* post) {
  if (segments.ids_case() != pb::Segments::IDS_NOT_SET) {
    return absl::InvalidArgumentError(
        "header.segments.ids must be unset in Evaluate: the ids come in "
        "the blocks");
  }
  if (!pb::SegmentReduction_IsValid(segments.reduction())) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown segments.reduction ", segments.reduction()));
  }
  // Ids are global over the stream, so the count is not bounded by a
  // block's rows; the response carries count entries.
  if (segments.count() < 1 || segments.count() > kMaxEvaluateSegments) {
    return absl::InvalidArgumentError(
        absl::StrCat("header.segments.count = ", segments.count(),
                     " must be in [1, ", kMaxEvaluateSegments, "]"));
  }
  post->segmented = true;
  post->segment_count = segments.count();
  post->segment_reduction = static_cast<SegmentReduction>(segments.reduction());
  if (post->segment_reduction != SegmentReduction::kNone &&
      options.reduction != Reduction::kMean) {
    return absl::InvalidArgumentError(
        "a segment reduction needs the options' reduction to be MEAN");
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<PostTrainingEvaluation> ParsePostTrainingEvaluation(
    const pb::EvaluateHeader& header, int64_t vocab,
    const CrossEntropyOptions& options) {
  if (!header.options().class_weights().empty()) {
    return absl::InvalidArgumentError(
        "options.class_weights does not compose with distillation, policy "
        "losses or segments");
  }
  if (header.has_distillation() && header.has_policy()) {
    return absl::InvalidArgumentError(
        "distillation and policy cannot be combined in one Evaluate");
  }
  PostTrainingEvaluation post;
  // A stand-in problem of one row, to run the kernels' argument checks on
  // the header's numbers now rather than at the first block.
  const char stand_in[16] = {};
  PostTrainingArgs args;
  args.base.rows = 1;
  args.base.vocab = vocab;
  args.base.row_stride = vocab;
  args.base.logits = stand_in;
  args.base.targets = stand_in;
  args.base.targets_dtype = DType::kInt32;
  args.base.options = options;
  args.base.mode = GradientMode::kNone;
  if (header.has_distillation()) {
    const pb::Distillation& kd = header.distillation();
    if (kd.teacher_case() != pb::Distillation::TEACHER_NOT_SET) {
      return absl::InvalidArgumentError(
          "header.distillation.teacher must be unset in Evaluate: the "
          "teacher's rows come in the blocks (teacher_logits_dtype or "
          "teacher_top_k)");
    }
    if (!pb::Divergence_IsValid(kd.divergence())) {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown distillation.divergence ", kd.divergence()));
    }
    if (!pb::TopKTail_IsValid(header.teacher_top_k_tail())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "unknown header.teacher_top_k_tail ", header.teacher_top_k_tail()));
    }
    post.distill = true;
    DistillationArgs& d = post.distillation;
    d.temperature = kd.has_temperature() ? kd.temperature() : 1.0f;
    d.alpha = kd.alpha();
    d.divergence = kd.divergence() == pb::DIVERGENCE_UNSPECIFIED
                       ? Divergence::kForwardKl
                       : static_cast<Divergence>(kd.divergence());
    d.beta = kd.beta();
    const bool dense = header.teacher_logits_dtype() != pb::DTYPE_UNSPECIFIED;
    const bool sparse = header.teacher_top_k() != 0;
    if (dense == sparse) {
      return absl::InvalidArgumentError(
          "a distillation in Evaluate needs exactly one of "
          "header.teacher_logits_dtype and header.teacher_top_k");
    }
    DistillationArgs checked = d;
    if (dense) {
      ASSIGN_OR_RETURN(
          post.teacher_dtype,
          ParseDType(header.teacher_logits_dtype(),
                     "header.teacher_logits_dtype", false, kLogitsDTypes));
      checked.teacher_logits = stand_in;
      checked.teacher_dtype = post.teacher_dtype;
      checked.teacher_row_stride = vocab;
    } else {
      ASSIGN_OR_RETURN(
          post.teacher_indices_dtype,
          ParseDType(header.teacher_indices_dtype(),
                     "header.teacher_indices_dtype", false, kTargetsDTypes));
      d.top_k = header.teacher_top_k();
      d.tail = header.teacher_top_k_tail() == pb::TOP_K_TAIL_UNSPECIFIED
                   ? TopKTail::kRenormalize
                   : static_cast<TopKTail>(header.teacher_top_k_tail());
      checked = d;
      checked.top_k_indices = stand_in;
      checked.top_k_indices_dtype = post.teacher_indices_dtype;
      checked.top_k_logprobs = reinterpret_cast<const float*>(stand_in);
    }
    args.distillation = &checked;
    RETURN_IF_ERROR(ValidatePostTrainingArgs(args));
    args.distillation = nullptr;
  }
  if (header.has_policy() || header.policy_reference_logprobs()) {
    RETURN_IF_ERROR(ParseEvaluatePolicy(header, args, &post));
  }
  if (header.has_segments()) {
    RETURN_IF_ERROR(ParseEvaluateSegments(header.segments(), options, &post));
  }
  if (!post.distill && !post.policy) {
    RETURN_IF_ERROR(ValidatePostTrainingArgs(args));
  }
  return post;
}

EvaluationLoss ReducePostTrainingEvaluation(
    const EvaluationSums& total, const CrossEntropyOptions& options,
    const PostTrainingEvaluation& post) {
  EvaluationLoss result;
  if (post.segment_reduction == SegmentReduction::kNone) {
    EvaluationSums tokens = total;
    tokens.weight = static_cast<double>(total.valid_tokens);
    result = ReduceEvaluation(tokens, options);
    result.distillation = total.distillation;
    if (options.reduction == Reduction::kMean) {
      result.distillation = result.denominator != 0.0
                                ? total.distillation / result.denominator
                                : 0.0;
    }
    return result;
  }
  double loss = 0.0, distillation = 0.0;
  int64_t nonempty = 0;
  for (size_t s = 0; s < total.segment_tokens.size(); ++s) {
    const int64_t tokens = total.segment_tokens[s];
    if (tokens == 0) continue;
    ++nonempty;
    const double per =
        post.segment_reduction == SegmentReduction::kSeqMeanTokenMean
            ? static_cast<double>(tokens)
            : 1.0;
    loss += total.segment_loss[s] / per;
    distillation += total.segment_distillation[s] / per;
  }
  const double denominator = options.normalizer > 0.0
                                 ? options.normalizer
                                 : static_cast<double>(nonempty);
  if (nonempty > 0) {
    result.loss = loss / denominator;
    result.distillation = distillation / denominator;
  }
  if (nonempty > 0 || options.normalizer > 0.0) {
    result.denominator = denominator;
  }
  return result;
}

namespace {

// The rows of a post-training block `number`, each input checked to hold one
// entry a row (INVALID_ARGUMENT naming the block otherwise); 0 for no rows.
absl::StatusOr<int64_t> PostTrainingBlockRows(
    const EvaluationConfig& config,
    const EvaluationLane::PostTrainingBlock& block, int64_t number) {
  const PostTrainingEvaluation& post = config.post;
  const int64_t row_bytes = config.spec.row_bytes;
  auto bad = [number](const std::string& what) {
    return absl::InvalidArgumentError(
        absl::StrCat("block ", number, ": ", what));
  };
  const int64_t logits_bytes = static_cast<int64_t>(block.logits.size());
  if (logits_bytes % row_bytes != 0) {
    return bad(absl::StrCat(
        logits_bytes,
        config.weight != nullptr ? " hidden-state bytes" : " logits bytes",
        " are not a whole number of rows of ", row_bytes, " bytes"));
  }
  const int64_t rows = logits_bytes / row_bytes;
  if (rows == 0) return 0;
  // Each input: one entry of `bytes` per row (`width` of them), or absent.
  auto expect = [&](absl::string_view data, int64_t per_row, const char* what,
                    bool optional) -> absl::Status {
    if (optional && data.empty()) return absl::OkStatus();
    if (static_cast<int64_t>(data.size()) != rows * per_row) {
      return bad(absl::StrCat(what, " has ", data.size(), " bytes; ", rows,
                              " rows need ", rows * per_row));
    }
    return absl::OkStatus();
  };
  if (!config.spec.has_targets && !block.targets.empty()) {
    return bad(absl::StrCat(
        "targets has ", block.targets.size(),
        " bytes, but header.targets_dtype is DTYPE_UNSPECIFIED (no targets)"));
  }
  const bool targets_optional = post.distill && post.distillation.alpha == 0.0f;
  RETURN_IF_ERROR(expect(block.targets,
                         static_cast<int64_t>(DTypeSize(config.targets_dtype)),
                         "targets", targets_optional));
  const int64_t k = post.distillation.top_k;
  if (post.distill && post.distillation.top_k == 0) {
    RETURN_IF_ERROR(expect(
        block.teacher_logits,
        config.vocab * static_cast<int64_t>(DTypeSize(post.teacher_dtype)),
        "teacher_logits", false));
  } else if (post.distill) {
    RETURN_IF_ERROR(
        expect(block.teacher_indices,
               k * static_cast<int64_t>(DTypeSize(post.teacher_indices_dtype)),
               "teacher_indices", false));
    RETURN_IF_ERROR(
        expect(block.teacher_logprobs, k * 4, "teacher_logprobs", false));
  }
  if (post.policy) {
    RETURN_IF_ERROR(expect(block.advantages, 4, "advantages", false));
    RETURN_IF_ERROR(
        expect(block.sampling_logprobs, 4, "sampling_logprobs", false));
    if (post.policy_reference) {
      RETURN_IF_ERROR(
          expect(block.reference_logprobs, 4, "reference_logprobs", false));
    }
  }
  if (!post.policy_reference && !block.reference_logprobs.empty()) {
    return bad("reference_logprobs without header.policy_reference_logprobs");
  }
  if (post.segmented) {
    RETURN_IF_ERROR(expect(block.segment_ids, 4, "segment_ids", false));
  }
  return rows;
}

// The values of T in `bytes` (whole values), copied to aligned memory; none
// for no bytes (memcpy may not be given an empty vector's null pointer).
template <typename T>
std::vector<T> AlignedCopy(absl::string_view bytes) {
  std::vector<T> values(bytes.size() / sizeof(T));
  if (!values.empty()) {
    std::memcpy(values.data(), bytes.data(), values.size() * sizeof(T));
  }
  return values;
}

// A block's small per-row inputs: aligned host copies (the checks read them
// there), their copies on the device, and the kernel's arguments for them.
struct BlockInputs {
  std::string targets, indices;
  std::vector<float> logprobs, advantages, sampling, reference;
  std::vector<int32_t> ids;
  Staged staged_targets, staged_indices, staged_logprobs, staged_ids,
      staged_advantages, staged_sampling, staged_reference;
  DistillationArgs kd;
  PolicyArgs pg;
  SegmentArgs segments;
};

// Host copies of the inputs of `block` into `in`; `args` (its base already
// set) points at them.
void ReadBlockInputs(const PostTrainingEvaluation& post, int64_t vocab,
                     const EvaluationLane::PostTrainingBlock& block,
                     BlockInputs* in, PostTrainingArgs* args) {
  in->targets.assign(block.targets.data(), block.targets.size());
  in->indices.assign(block.teacher_indices.data(),
                     block.teacher_indices.size());
  in->logprobs = AlignedCopy<float>(block.teacher_logprobs);
  in->ids = AlignedCopy<int32_t>(block.segment_ids);
  in->advantages = AlignedCopy<float>(block.advantages);
  in->sampling = AlignedCopy<float>(block.sampling_logprobs);
  in->reference = AlignedCopy<float>(block.reference_logprobs);
  args->base.targets = in->targets.empty() ? nullptr : in->targets.data();
  in->kd = post.distillation;
  if (post.distill) {
    if (in->kd.top_k == 0) {
      in->kd.teacher_dtype = post.teacher_dtype;
      in->kd.teacher_row_stride = vocab;
    } else {
      in->kd.top_k_indices = in->indices.data();
      in->kd.top_k_indices_dtype = post.teacher_indices_dtype;
      in->kd.top_k_logprobs = in->logprobs.data();
    }
    args->distillation = &in->kd;
  }
  in->pg = post.policy_args;
  if (post.policy) {
    in->pg.advantages = in->advantages.data();
    in->pg.sampling_logprobs = in->sampling.data();
    if (post.policy_reference) in->pg.reference_logprobs = in->reference.data();
    args->policy = &in->pg;
  }
  if (post.segmented) {
    in->segments.ids = in->ids.data();
    in->segments.count = post.segment_count;
    in->segments.reduction = SegmentReduction::kNone;
    args->segments = &in->segments;
  }
}

// `bytes` at `data` onto `device` through `staged`; *into points there.
template <typename T>
absl::Status StageInto(Device* device, const void* data, size_t bytes,
                       Staged* staged, const T** into) {
  RETURN_IF_ERROR(staged->Stage(device, data, bytes));
  *into = static_cast<const T*>(staged->get());
  return absl::OkStatus();
}

// The host copies in `in` onto `device` (no copy on a host-accessible one);
// `args` then points there.
absl::Status StageBlockInputs(Device* device, BlockInputs* in,
                              PostTrainingArgs* args) {
  if (args->base.targets != nullptr) {
    RETURN_IF_ERROR(StageInto(device, in->targets.data(), in->targets.size(),
                              &in->staged_targets, &args->base.targets));
  }
  if (args->distillation != nullptr && in->kd.top_k > 0) {
    RETURN_IF_ERROR(StageInto(device, in->indices.data(), in->indices.size(),
                              &in->staged_indices, &in->kd.top_k_indices));
    RETURN_IF_ERROR(StageInto(device, in->logprobs.data(),
                              in->logprobs.size() * sizeof(float),
                              &in->staged_logprobs, &in->kd.top_k_logprobs));
  }
  if (args->policy != nullptr) {
    RETURN_IF_ERROR(StageInto(device, in->advantages.data(),
                              in->advantages.size() * sizeof(float),
                              &in->staged_advantages, &in->pg.advantages));
    RETURN_IF_ERROR(StageInto(device, in->sampling.data(),
                              in->sampling.size() * sizeof(float),
                              &in->staged_sampling, &in->pg.sampling_logprobs));
    if (in->pg.reference_logprobs != nullptr) {
      RETURN_IF_ERROR(StageInto(
          device, in->reference.data(), in->reference.size() * sizeof(float),
          &in->staged_reference, &in->pg.reference_logprobs));
    }
  }
  if (args->segments != nullptr) {
    RETURN_IF_ERROR(StageInto(device, in->ids.data(),
                              in->ids.size() * sizeof(int32_t), &in->staged_ids,
                              &in->segments.ids));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status EvaluationLane::EvaluatePostTraining(
    const PostTrainingBlock& block) {
  const PostTrainingEvaluation& post = config_->post;
  block_ = EvaluationSums();
  const int64_t number = blocks_++;
  ASSIGN_OR_RETURN(const int64_t rows,
                   PostTrainingBlockRows(*config_, block, number));
  if (rows == 0) return absl::OkStatus();
  const bool dense_teacher = post.distill && post.distillation.top_k == 0;
  if (metrics_ != nullptr) {
    metrics_->AddTransferBytes(
        TransferDirection::kEvaluate,
        static_cast<int64_t>(
            block.logits.size() + block.targets.size() +
            block.teacher_logits.size() + block.teacher_indices.size() +
            block.teacher_logprobs.size() + block.segment_ids.size() +
            block.advantages.size() + block.sampling_logprobs.size() +
            block.reference_logprobs.size()),
        config_->tenant);
  }

  PostTrainingArgs args;
  args.base.rows = rows;
  args.base.vocab = config_->vocab;
  args.base.row_stride = config_->vocab;
  args.base.logits_dtype = config_->logits_dtype;
  args.base.targets_dtype = config_->targets_dtype;
  args.base.options = config_->options;
  // Each block's sums; the reactor reduces them.
  args.base.options.reduction = Reduction::kSum;
  args.base.mode = GradientMode::kNone;
  // The small inputs stay on the host for the checks.
  BlockInputs in;
  ReadBlockInputs(post, config_->vocab, block, &in, &args);
  {
    PostTrainingArgs checked = args;
    checked.base.logits = block.logits.data();
    if (dense_teacher) in.kd.teacher_logits = block.teacher_logits.data();
    RETURN_IF_ERROR(ValidatePostTrainingArgs(checked));
    RETURN_IF_ERROR(CheckPostTrainingData(checked));
    in.kd.teacher_logits = nullptr;
  }

  Device* device = store_->device();
  const absl::Time copy_start = absl::Now();
  RETURN_IF_ERROR(Reserve(&logits_buffer_, block.logits.size()));
  RETURN_IF_ERROR(device->CopyFromHost(
      logits_buffer_.data(), 0, block.logits.data(), block.logits.size()));
  args.base.logits = logits_buffer_.data();
  if (dense_teacher) {
    RETURN_IF_ERROR(Reserve(&teacher_buffer_, block.teacher_logits.size()));
    RETURN_IF_ERROR(device->CopyFromHost(teacher_buffer_.data(), 0,
                                         block.teacher_logits.data(),
                                         block.teacher_logits.size()));
    in.kd.teacher_logits = teacher_buffer_.data();
  }
  RETURN_IF_ERROR(StageBlockInputs(device, &in, &args));
  block_.copy_seconds += absl::ToDoubleSeconds(absl::Now() - copy_start);

  PostTrainingResult result;
  const bool hidden_states = config_->weight != nullptr;
  const absl::Time start = absl::Now();
  RETURN_IF_ERROR(hidden_states ? RunLinearPostTraining(args, &result)
                                : device->PostTraining(args, &result));
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  block_.kernel_seconds += seconds;
  if (metrics_ != nullptr) {
    metrics_->ObserveKernel(
        device->name(),
        hidden_states ? "linear_post_training" : "post_training", seconds);
  }
  block_.loss = result.base.loss;
  block_.z_loss = result.base.z_loss;
  block_.rows = rows;
  block_.valid_tokens = result.base.valid_tokens;
  block_.correct_tokens = result.base.correct_tokens;
  block_.nonfinite_rows = result.base.nonfinite_rows;
  block_.weight = static_cast<double>(result.base.valid_tokens);
  block_.distillation = result.distillation_loss;
  block_.segment_loss = result.segment_loss;
  block_.segment_distillation = result.segment_distillation;
  block_.segment_tokens = result.segment_tokens;
  block_.policy = result.policy;
  return order_->Add(index_, frames_++, block_);
}

absl::Status EvaluationLane::RunLinearPostTraining(const PostTrainingArgs& args,
                                                   PostTrainingResult* result) {
  LinearPostTrainingArgs linear;
  linear.linear = LinearArgs(args.base.rows, args.base.targets);
  // A distillation with alpha 0 may come without targets; the linear
  // checks want a targets dtype all the same (as LinearForward gives).
  if (args.base.targets == nullptr) linear.linear.targets_dtype = DType::kInt32;
  linear.distillation = args.distillation;
  linear.policy = args.policy;
  linear.segments = args.segments;
  ASSIGN_OR_RETURN(const ScratchBuffer workspace,
                   LinearWorkspace(linear.linear));
  return store_->device()->LinearPostTraining(linear, result);
}

}  // namespace lossd
