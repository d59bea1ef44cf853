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
#include "kernels/cpu/post_training_cpu.h"
#include "lossd/v1/lossd.pb.h"
#include "server/evaluation.h"
#include "server/staged.h"
#include "server/validation.h"

namespace lossd {

namespace pb = ::lossd::v1;

bool IsPostTrainingEvaluation(const pb::EvaluateHeader& header) {
  return header.has_distillation() || header.has_segments();
}

absl::StatusOr<PostTrainingEvaluation> ParsePostTrainingEvaluation(
    const pb::EvaluateHeader& header, int64_t vocab,
    const CrossEntropyOptions& options) {
  if (!header.data_token().empty() || !header.weight().empty()) {
    return absl::InvalidArgumentError(
        "distillation and segments in Evaluate are offered on the stream "
        "over logits only: not over data connections or hidden states");
  }
  if (!header.options().class_weights().empty()) {
    return absl::InvalidArgumentError(
        "options.class_weights does not compose with distillation or "
        "segments");
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
  if (header.has_segments()) {
    const pb::Segments& segments = header.segments();
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
    post.segmented = true;
    post.segment_count = segments.count();
    post.segment_reduction =
        static_cast<SegmentReduction>(segments.reduction());
    if (post.segment_reduction != SegmentReduction::kNone &&
        options.reduction != Reduction::kMean) {
      return absl::InvalidArgumentError(
          "a segment reduction needs the options' reduction to be MEAN");
    }
  }
  if (!post.distill) RETURN_IF_ERROR(ValidatePostTrainingArgs(args));
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
    return bad(absl::StrCat(logits_bytes,
                            " logits bytes are not a whole number of rows of ",
                            row_bytes, " bytes"));
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

}  // namespace

absl::Status EvaluationLane::EvaluatePostTraining(
    const PostTrainingBlock& block) {
  const PostTrainingEvaluation& post = config_->post;
  block_ = EvaluationSums();
  const int64_t number = blocks_++;
  ASSIGN_OR_RETURN(const int64_t rows,
                   PostTrainingBlockRows(*config_, block, number));
  if (rows == 0) return absl::OkStatus();
  const int64_t k = post.distillation.top_k;
  if (metrics_ != nullptr) {
    metrics_->AddTransferBytes(
        TransferDirection::kEvaluate,
        static_cast<int64_t>(
            block.logits.size() + block.targets.size() +
            block.teacher_logits.size() + block.teacher_indices.size() +
            block.teacher_logprobs.size() + block.segment_ids.size()),
        config_->tenant);
  }

  // The small inputs stay on the host for the checks (aligned copies).
  std::string targets(block.targets);
  const std::vector<float> logprobs =
      AlignedCopy<float>(block.teacher_logprobs);
  std::string indices(block.teacher_indices);
  const std::vector<int32_t> ids = AlignedCopy<int32_t>(block.segment_ids);

  PostTrainingArgs args;
  args.base.rows = rows;
  args.base.vocab = config_->vocab;
  args.base.row_stride = config_->vocab;
  args.base.logits_dtype = config_->logits_dtype;
  args.base.targets_dtype = config_->targets_dtype;
  args.base.targets = targets.empty() ? nullptr : targets.data();
  args.base.options = config_->options;
  // Each block's sums; the reactor reduces them.
  args.base.options.reduction = Reduction::kSum;
  args.base.mode = GradientMode::kNone;
  DistillationArgs kd = post.distillation;
  if (post.distill) {
    if (k == 0) {
      kd.teacher_dtype = post.teacher_dtype;
      kd.teacher_row_stride = config_->vocab;
    } else {
      kd.top_k_indices = indices.data();
      kd.top_k_indices_dtype = post.teacher_indices_dtype;
      kd.top_k_logprobs = logprobs.data();
    }
    args.distillation = &kd;
  }
  SegmentArgs segments;
  if (post.segmented) {
    segments.ids = ids.data();
    segments.count = post.segment_count;
    segments.reduction = SegmentReduction::kNone;
    args.segments = &segments;
  }
  {
    PostTrainingArgs checked = args;
    checked.base.logits = block.logits.data();
    if (post.distill && k == 0) kd.teacher_logits = block.teacher_logits.data();
    RETURN_IF_ERROR(ValidatePostTrainingArgs(checked));
    RETURN_IF_ERROR(CheckPostTrainingData(checked));
    kd.teacher_logits = nullptr;
  }

  Device* device = store_->device();
  const absl::Time copy_start = absl::Now();
  RETURN_IF_ERROR(Reserve(&logits_buffer_, block.logits.size()));
  RETURN_IF_ERROR(device->CopyFromHost(
      logits_buffer_.data(), 0, block.logits.data(), block.logits.size()));
  args.base.logits = logits_buffer_.data();
  if (post.distill && k == 0) {
    RETURN_IF_ERROR(Reserve(&teacher_buffer_, block.teacher_logits.size()));
    RETURN_IF_ERROR(device->CopyFromHost(teacher_buffer_.data(), 0,
                                         block.teacher_logits.data(),
                                         block.teacher_logits.size()));
    kd.teacher_logits = teacher_buffer_.data();
  }
  Staged staged_targets, staged_indices, staged_logprobs, staged_ids;
  if (args.base.targets != nullptr) {
    RETURN_IF_ERROR(
        staged_targets.Stage(device, targets.data(), targets.size()));
    args.base.targets = staged_targets.get();
  }
  if (post.distill && k > 0) {
    RETURN_IF_ERROR(
        staged_indices.Stage(device, indices.data(), indices.size()));
    RETURN_IF_ERROR(staged_logprobs.Stage(device, logprobs.data(),
                                          logprobs.size() * sizeof(float)));
    kd.top_k_indices = staged_indices.get();
    kd.top_k_logprobs = static_cast<const float*>(staged_logprobs.get());
  }
  if (post.segmented) {
    RETURN_IF_ERROR(
        staged_ids.Stage(device, ids.data(), ids.size() * sizeof(int32_t)));
    segments.ids = static_cast<const int32_t*>(staged_ids.get());
  }
  block_.copy_seconds += absl::ToDoubleSeconds(absl::Now() - copy_start);

  PostTrainingResult result;
  const absl::Time start = absl::Now();
  RETURN_IF_ERROR(device->PostTraining(args, &result));
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  block_.kernel_seconds += seconds;
  if (metrics_ != nullptr) {
    metrics_->ObserveKernel(device->name(), "post_training", seconds);
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
  return order_->Add(index_, frames_++, block_);
}

}  // namespace lossd
