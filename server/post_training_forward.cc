// Forward with a post-training loss: checks, host copies of the small inputs,
// leases and the device call (see post_training_forward.h).
#include "server/post_training_forward.h"

#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/checked_math.h"
#include "common/dtype.h"
#include "common/handle.h"
#include "common/status_macros.h"
#include "common/tensor_math.h"
#include "kernels/post_training.h"
#include "kernels/post_training_validate.h"
#include "server/forward.h"
#include "server/staged.h"
#include "server/validation.h"

namespace lossd {
namespace {

namespace pb = ::lossd::v1;

constexpr DType kFloat32Only[] = {DType::kFloat32};
constexpr DType kInt32Only[] = {DType::kInt32};

// One handle-or-inline field of the request.
struct InputField {
  const char* name;      // "policy.advantages", for messages
  bool set = false;      // either form present
  bool inline_ = false;  // inline bytes (else a handle)
  const std::string* handle = nullptr;
  const pb::InlineTensor* inline_tensor = nullptr;
};

InputField Field(const char* name, bool has_handle, const std::string& handle,
                 bool has_inline, const pb::InlineTensor& inline_tensor) {
  InputField field;
  field.name = name;
  field.set = has_handle || has_inline;
  field.inline_ = has_inline;
  field.handle = &handle;
  field.inline_tensor = &inline_tensor;
  return field;
}

// Request-only checks of a field: a well-formed handle, or an inline dtype
// among `allowed`.
absl::Status CheckField(const InputField& field,
                        absl::Span<const DType> allowed) {
  if (!field.set) return absl::OkStatus();
  if (field.inline_) {
    return ParseDType(field.inline_tensor->dtype(),
                      absl::StrCat(field.name, "_inline.dtype"), false, allowed)
        .status();
  }
  return CheckHandle(*field.handle, absl::StrCat(field.name, "_handle"));
}

// Reads `field` as `rows` x `width` elements of one of `allowed` onto the host
// into `*out`: a [rows, width] tensor, or a [rows] one when width is 0.
absl::Status ReadInput(TensorStore* store, const std::string& tenant,
                       const InputField& field, int64_t rows, int64_t width,
                       absl::Span<const DType> allowed,
                       PostTrainingHostInput* out) {
  const bool vector = width == 0;
  if (vector) width = 1;
  const std::string shape = vector ? absl::StrCat("[", rows, "]")
                                   : absl::StrCat("[", rows, ", ", width, "]");
  std::string allowed_names;
  for (DType dtype : allowed) {
    if (!allowed_names.empty()) absl::StrAppend(&allowed_names, " or ");
    absl::StrAppend(&allowed_names, DTypeName(dtype));
  }
  const std::optional<int64_t> count = CheckedMul(rows, width);
  if (!count.has_value()) {
    return absl::InvalidArgumentError(
        absl::StrCat(field.name, ": ", shape, " is too large"));
  }
  if (field.inline_) {
    ASSIGN_OR_RETURN(
        out->dtype,
        ParseDType(field.inline_tensor->dtype(),
                   absl::StrCat(field.name, "_inline.dtype"), false, allowed));
    const std::string& data = field.inline_tensor->data();
    const int64_t need = *count * static_cast<int64_t>(DTypeSize(out->dtype));
    if (static_cast<int64_t>(data.size()) != need) {
      return absl::InvalidArgumentError(
          absl::StrCat(field.name, "_inline has ", data.size(), " bytes; ",
                       shape, " of ", DTypeName(out->dtype), " needs ", need));
    }
    out->bytes.assign(data.begin(), data.end());
    return absl::OkStatus();
  }
  ASSIGN_OR_RETURN(std::shared_ptr<Tensor> tensor,
                   store->Get(tenant, *field.handle));
  bool dtype_ok = false;
  for (DType dtype : allowed) dtype_ok |= tensor->dtype() == dtype;
  const std::vector<int64_t>& dims = tensor->shape();
  const bool shape_ok =
      vector ? (dims.size() == 1 && dims[0] == rows)
             : (dims.size() == 2 && dims[0] == rows && dims[1] == width);
  if (!dtype_ok || !shape_ok) {
    return absl::InvalidArgumentError(absl::StrCat(
        field.name, "_handle must be ", allowed_names, " ", shape, ", got ",
        DTypeName(tensor->dtype()), " ", ShapeString(dims)));
  }
  out->dtype = tensor->dtype();
  out->bytes.resize(static_cast<size_t>(*count) * DTypeSize(out->dtype));
  ReadLease lease = store->BeginRead(std::move(tensor));
  const Tensor& held = *lease.tensor();
  return held.device()->ReadConverted(held.data(), held.dtype(), 0, *count,
                                      std::max<int64_t>(width, 1), 1.0f,
                                      nullptr, out->bytes.data(), out->dtype);
}

// The top-k k of a request: the field, or a handle's width.
absl::StatusOr<int64_t> TopKWidth(TensorStore* store, const std::string& tenant,
                                  const pb::TopKTeacher& top_k) {
  if (top_k.k() < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "distillation.teacher_top_k.k = ", top_k.k(), " must be >= 1"));
  }
  if (top_k.k() > 0) return top_k.k();
  const std::string* handle = nullptr;
  if (top_k.indices_case() == pb::TopKTeacher::kIndicesHandle) {
    handle = &top_k.indices_handle();
  } else if (top_k.logprobs_case() == pb::TopKTeacher::kLogprobsHandle) {
    handle = &top_k.logprobs_handle();
  } else {
    return absl::InvalidArgumentError(
        "distillation.teacher_top_k.k is required with inline tensors");
  }
  ASSIGN_OR_RETURN(std::shared_ptr<Tensor> tensor, store->Get(tenant, *handle));
  if (tensor->shape().size() != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("distillation.teacher_top_k tensors must be [N, k], got ",
                     ShapeString(tensor->shape())));
  }
  return tensor->shape()[1];
}

// The fields of the request's distillation, policy and segments.
struct Fields {
  InputField indices, logprobs, advantages, sampling, reference, segment_ids;
};

Fields FieldsOf(const pb::ForwardRequest& request) {
  const pb::TopKTeacher& top_k = request.distillation().teacher_top_k();
  const pb::PolicyGradient& policy = request.policy();
  const pb::Segments& segments = request.segments();
  Fields fields;
  fields.indices =
      Field("distillation.teacher_top_k.indices",
            top_k.indices_case() == pb::TopKTeacher::kIndicesHandle,
            top_k.indices_handle(),
            top_k.indices_case() == pb::TopKTeacher::kIndicesInline,
            top_k.indices_inline());
  fields.logprobs =
      Field("distillation.teacher_top_k.logprobs",
            top_k.logprobs_case() == pb::TopKTeacher::kLogprobsHandle,
            top_k.logprobs_handle(),
            top_k.logprobs_case() == pb::TopKTeacher::kLogprobsInline,
            top_k.logprobs_inline());
  fields.advantages =
      Field("policy.advantages",
            policy.advantages_case() == pb::PolicyGradient::kAdvantagesHandle,
            policy.advantages_handle(),
            policy.advantages_case() == pb::PolicyGradient::kAdvantagesInline,
            policy.advantages_inline());
  fields.sampling = Field("policy.sampling_logprobs",
                          policy.sampling_logprobs_case() ==
                              pb::PolicyGradient::kSamplingLogprobsHandle,
                          policy.sampling_logprobs_handle(),
                          policy.sampling_logprobs_case() ==
                              pb::PolicyGradient::kSamplingLogprobsInline,
                          policy.sampling_logprobs_inline());
  fields.reference = Field("policy.reference_logprobs",
                           policy.reference_logprobs_case() ==
                               pb::PolicyGradient::kReferenceLogprobsHandle,
                           policy.reference_logprobs_handle(),
                           policy.reference_logprobs_case() ==
                               pb::PolicyGradient::kReferenceLogprobsInline,
                           policy.reference_logprobs_inline());
  fields.segment_ids = Field(
      "segments.ids", segments.ids_case() == pb::Segments::kIdsHandle,
      segments.ids_handle(), segments.ids_case() == pb::Segments::kIdsInline,
      segments.ids_inline());
  return fields;
}

}  // namespace

absl::StatusOr<PolicyArgs> ParsePolicyScalars(
    const pb::PolicyGradient& policy) {
  if (!pb::PolicyLoss_IsValid(policy.loss()) ||
      policy.loss() == pb::POLICY_LOSS_UNSPECIFIED) {
    return absl::InvalidArgumentError(absl::StrCat(
        "policy.loss must be IMPORTANCE_SAMPLING, PPO_CLIP or CISPO, got ",
        policy.loss()));
  }
  if (!pb::KlEstimator_IsValid(policy.kl_estimator())) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown policy.kl_estimator ", policy.kl_estimator()));
  }
  PolicyArgs pg;
  pg.loss = static_cast<PolicyLossKind>(policy.loss());
  pg.epsilon_low = policy.has_epsilon_low() ? policy.epsilon_low() : 0.2f;
  pg.epsilon_high =
      policy.has_epsilon_high() ? policy.epsilon_high() : pg.epsilon_low;
  pg.kl_coef = policy.kl_coef();
  pg.kl_estimator = policy.kl_estimator() == pb::KL_ESTIMATOR_UNSPECIFIED
                        ? KlEstimator::kK3
                        : static_cast<KlEstimator>(policy.kl_estimator());
  return pg;
}

absl::Status CheckPostTrainingRequest(const pb::ForwardRequest& request) {
  const Fields fields = FieldsOf(request);
  if (request.has_distillation() && request.has_policy()) {
    return absl::InvalidArgumentError(
        "distillation and policy cannot be combined in one Forward");
  }
  if (!request.options().class_weights().empty()) {
    return absl::InvalidArgumentError(
        "options.class_weights does not compose with distillation, policy "
        "or segments");
  }
  if (request.has_distillation()) {
    const pb::Distillation& kd = request.distillation();
    if (kd.teacher_case() == pb::Distillation::TEACHER_NOT_SET) {
      return absl::InvalidArgumentError(
          "distillation needs a teacher: teacher_logits or teacher_top_k");
    }
    if (kd.teacher_case() == pb::Distillation::kTeacherLogits) {
      RETURN_IF_ERROR(
          CheckHandle(kd.teacher_logits(), "distillation.teacher_logits"));
    } else {
      if (!fields.indices.set || !fields.logprobs.set) {
        return absl::InvalidArgumentError(
            "distillation.teacher_top_k needs indices and logprobs");
      }
      RETURN_IF_ERROR(CheckField(fields.indices, kTargetsDTypes));
      RETURN_IF_ERROR(CheckField(fields.logprobs, kFloat32Only));
      if (!pb::TopKTail_IsValid(kd.teacher_top_k().tail())) {
        return absl::InvalidArgumentError(
            absl::StrCat("unknown distillation.teacher_top_k.tail ",
                         kd.teacher_top_k().tail()));
      }
    }
    if (!pb::Divergence_IsValid(kd.divergence())) {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown distillation.divergence ", kd.divergence()));
    }
  }
  if (request.has_policy()) {
    RETURN_IF_ERROR(ParsePolicyScalars(request.policy()).status());
    if (!fields.advantages.set || !fields.sampling.set) {
      return absl::InvalidArgumentError(
          "policy needs advantages and sampling_logprobs");
    }
    RETURN_IF_ERROR(CheckField(fields.advantages, kFloat32Only));
    RETURN_IF_ERROR(CheckField(fields.sampling, kFloat32Only));
    RETURN_IF_ERROR(CheckField(fields.reference, kFloat32Only));
  }
  if (request.has_segments()) {
    if (!fields.segment_ids.set) {
      return absl::InvalidArgumentError("segments needs ids");
    }
    RETURN_IF_ERROR(CheckField(fields.segment_ids, kInt32Only));
    if (!pb::SegmentReduction_IsValid(request.segments().reduction())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "unknown segments.reduction ", request.segments().reduction()));
    }
  }
  return absl::OkStatus();
}

bool IsPostTrainingForward(const pb::ForwardRequest& request) {
  return request.has_distillation() || request.has_policy() ||
         request.has_segments();
}

namespace {

// The distillation's teacher (leased, or read to the host) into in->kd.
absl::Status ReadDistillation(TensorStore* store, const std::string& tenant,
                              const pb::ForwardRequest& request,
                              const Fields& fields,
                              const std::vector<int64_t>& shape,
                              PostTrainingInputs* in) {
  const int64_t rows = shape[0];
  const int64_t vocab = shape[1];
  const pb::Distillation& message = request.distillation();
  in->kd.temperature = message.has_temperature() ? message.temperature() : 1.0f;
  in->kd.alpha = message.alpha();
  in->kd.divergence = message.divergence() == pb::DIVERGENCE_UNSPECIFIED
                          ? Divergence::kForwardKl
                          : static_cast<Divergence>(message.divergence());
  in->kd.beta = message.beta();
  if (message.teacher_case() == pb::Distillation::kTeacherLogits) {
    if (message.teacher_logits() == request.logits()) {
      return absl::InvalidArgumentError(
          "distillation.teacher_logits names the student's logits");
    }
    ASSIGN_OR_RETURN(std::shared_ptr<Tensor> teacher,
                     store->Get(tenant, message.teacher_logits()));
    if (!IsLogitsDType(teacher->dtype()) || teacher->shape() != shape) {
      return absl::InvalidArgumentError(absl::StrCat(
          "distillation.teacher_logits must be a float tensor of the "
          "logits' shape ",
          ShapeString(shape), ", got ", DTypeName(teacher->dtype()), " ",
          ShapeString(teacher->shape())));
    }
    if (teacher->state() != TensorState::kLogits) {
      return absl::FailedPreconditionError(
          "distillation.teacher_logits holds a gradient");
    }
    in->teacher = store->BeginRead(std::move(teacher));
    in->kd.teacher_logits = in->teacher.tensor()->data();
    in->kd.teacher_dtype = in->teacher.tensor()->dtype();
    in->kd.teacher_row_stride = vocab;
  } else {
    const pb::TopKTeacher& top_k = message.teacher_top_k();
    ASSIGN_OR_RETURN(in->kd.top_k, TopKWidth(store, tenant, top_k));
    if (in->kd.top_k < 1 || in->kd.top_k > std::min<int64_t>(vocab, 512)) {
      return absl::InvalidArgumentError(
          absl::StrCat("distillation.teacher_top_k.k = ", in->kd.top_k,
                       " must be in [1, min(V, 512)] = [1, ",
                       std::min<int64_t>(vocab, 512), "]"));
    }
    RETURN_IF_ERROR(ReadInput(store, tenant, fields.indices, rows, in->kd.top_k,
                              kTargetsDTypes, &in->indices));
    RETURN_IF_ERROR(ReadInput(store, tenant, fields.logprobs, rows,
                              in->kd.top_k, kFloat32Only, &in->logprobs));
    in->kd.top_k_indices = in->indices.host();
    in->kd.top_k_indices_dtype = in->indices.dtype;
    in->kd.top_k_logprobs = reinterpret_cast<const float*>(in->logprobs.host());
    in->kd.tail = top_k.tail() == pb::TOP_K_TAIL_UNSPECIFIED
                      ? TopKTail::kRenormalize
                      : static_cast<TopKTail>(top_k.tail());
  }

  in->args.distillation = &in->kd;
  return absl::OkStatus();
}

// The policy's inputs, read to the host, into in->policy.
absl::Status ReadPolicy(TensorStore* store, const std::string& tenant,
                        const pb::ForwardRequest& request, const Fields& fields,
                        int64_t rows, PostTrainingInputs* in) {
  ASSIGN_OR_RETURN(in->policy, ParsePolicyScalars(request.policy()));
  RETURN_IF_ERROR(ReadInput(store, tenant, fields.advantages, rows, 0,
                            kFloat32Only, &in->advantages));
  RETURN_IF_ERROR(ReadInput(store, tenant, fields.sampling, rows, 0,
                            kFloat32Only, &in->sampling));
  in->policy.advantages = reinterpret_cast<const float*>(in->advantages.host());
  in->policy.sampling_logprobs =
      reinterpret_cast<const float*>(in->sampling.host());
  if (fields.reference.set) {
    RETURN_IF_ERROR(ReadInput(store, tenant, fields.reference, rows, 0,
                              kFloat32Only, &in->reference));
    in->policy.reference_logprobs =
        reinterpret_cast<const float*>(in->reference.host());
  }
  in->args.policy = &in->policy;
  return absl::OkStatus();
}

// The segment ids, read to the host, into in->segments.
absl::Status ReadSegments(TensorStore* store, const std::string& tenant,
                          const pb::ForwardRequest& request,
                          const Fields& fields, int64_t rows,
                          PostTrainingInputs* in) {
  RETURN_IF_ERROR(ReadInput(store, tenant, fields.segment_ids, rows, 0,
                            kInt32Only, &in->ids));
  in->segments.ids = reinterpret_cast<const int32_t*>(in->ids.host());
  in->segments.count = request.segments().count();
  if (in->segments.count < 1 || in->segments.count > rows) {
    return absl::InvalidArgumentError(
        absl::StrCat("in->segments.count = ", in->segments.count,
                     " must be in [1, N = ", rows, "]"));
  }
  in->segments.reduction =
      static_cast<SegmentReduction>(request.segments().reduction());

  in->args.segments = &in->segments;
  return absl::OkStatus();
}

}  // namespace

absl::Status StagePostTrainingInputs(Device* device, PostTrainingInputs* in) {
  auto stage =
      [device](PostTrainingHostInput* input) -> absl::StatusOr<const void*> {
    RETURN_IF_ERROR(
        input->staged.Stage(device, input->bytes.data(), input->bytes.size()));
    return input->staged.get();
  };
  if (in->args.base.targets != nullptr) {
    ASSIGN_OR_RETURN(in->args.base.targets, stage(&in->targets));
  }
  if (in->kd.top_k_indices != nullptr) {
    ASSIGN_OR_RETURN(in->kd.top_k_indices, stage(&in->indices));
    ASSIGN_OR_RETURN(const void* staged, stage(&in->logprobs));
    in->kd.top_k_logprobs = static_cast<const float*>(staged);
  }
  if (in->args.policy != nullptr) {
    ASSIGN_OR_RETURN(const void* a, stage(&in->advantages));
    ASSIGN_OR_RETURN(const void* s, stage(&in->sampling));
    in->policy.advantages = static_cast<const float*>(a);
    in->policy.sampling_logprobs = static_cast<const float*>(s);
    if (in->policy.reference_logprobs != nullptr) {
      ASSIGN_OR_RETURN(const void* r, stage(&in->reference));
      in->policy.reference_logprobs = static_cast<const float*>(r);
    }
  }
  if (in->args.segments != nullptr) {
    ASSIGN_OR_RETURN(const void* staged, stage(&in->ids));
    in->segments.ids = static_cast<const int32_t*>(staged);
  }
  return absl::OkStatus();
}

absl::Status ReadPostTrainingInputs(TensorStore* store,
                                    const std::string& tenant,
                                    const pb::ForwardRequest& request,
                                    const std::vector<int64_t>& shape,
                                    PostTrainingInputs* in) {
  const Fields fields = FieldsOf(request);
  const int64_t rows = shape[0];
  const InputField targets_field = Field(
      "targets", request.targets_case() == pb::ForwardRequest::kTargetsHandle,
      request.targets_handle(),
      request.targets_case() == pb::ForwardRequest::kTargetsInline,
      request.targets_inline());
  RETURN_IF_ERROR(CheckField(targets_field, kTargetsDTypes));
  if (targets_field.set) {
    RETURN_IF_ERROR(ReadInput(store, tenant, targets_field, rows, 0,
                              kTargetsDTypes, &in->targets));
    in->args.base.targets = in->targets.host();
    in->args.base.targets_dtype = in->targets.dtype;
  }
  if (request.has_distillation()) {
    RETURN_IF_ERROR(
        ReadDistillation(store, tenant, request, fields, shape, in));
  }
  if (request.has_policy()) {
    RETURN_IF_ERROR(ReadPolicy(store, tenant, request, fields, rows, in));
  }
  if (request.has_segments()) {
    RETURN_IF_ERROR(ReadSegments(store, tenant, request, fields, rows, in));
  }
  // The gradient buffer comes later (after the leases); the mode itself is
  // checked by ParseMode.
  PostTrainingArgs checked = in->args;
  checked.base.mode = GradientMode::kNone;
  RETURN_IF_ERROR(ValidatePostTrainingArgs(checked));
  return CheckPostTrainingData(checked);
}

PostTrainingTokens::PostTrainingTokens(const pb::Outputs& asked, int64_t rows) {
  const auto size = [rows](bool wanted) {
    return static_cast<size_t>(wanted ? rows : 0);
  };
  loss.resize(size(asked.token_loss()));
  lse.resize(size(asked.token_lse()));
  argmax.resize(size(asked.token_argmax()));
  logprob.resize(size(asked.token_logprob()));
  entropy.resize(size(asked.token_entropy()));
  ratio.resize(size(asked.token_ratio()));
  clipped.resize(size(asked.token_clipped()));
}

void PostTrainingTokens::Point(PostTrainingArgs* args) {
  const auto data = [](auto& values) {
    return values.empty() ? nullptr : values.data();
  };
  args->base.token_loss = data(loss);
  args->base.token_lse = data(lse);
  args->base.token_argmax = data(argmax);
  args->token_logprob = data(logprob);
  args->token_entropy = data(entropy);
  args->token_ratio = data(ratio);
  args->token_clipped = data(clipped);
}

void FillPolicyStats(const PolicyStatsResult& sums, pb::PolicyStats* stats) {
  stats->set_clipped_tokens(sums.clipped_tokens);
  stats->set_ratio_sum(sums.ratio_sum);
  stats->set_approx_kl_sum(sums.approx_kl_sum);
  stats->set_kl_sum(sums.kl_sum);
  stats->set_entropy_sum(sums.entropy_sum);
}

void FillPostTrainingResponse(const PostTrainingResult& result, bool policy,
                              double elapsed, const PostTrainingTokens& tokens,
                              pb::ForwardResponse* response) {
  response->set_loss(result.base.loss);
  response->set_z_loss(result.base.z_loss);
  response->set_valid_tokens(result.base.valid_tokens);
  response->set_correct_tokens(result.base.correct_tokens);
  response->set_nonfinite_rows(result.base.nonfinite_rows);
  response->set_denominator(result.base.denominator);
  response->set_kernel_seconds(
      result.base.kernel_seconds > 0 ? result.base.kernel_seconds : elapsed);
  response->set_distillation_loss(result.distillation_loss);
  if (policy) {
    FillPolicyStats(result.policy, response->mutable_policy_stats());
  }
  response->mutable_segment_loss()->Add(result.segment_loss.begin(),
                                        result.segment_loss.end());
  response->mutable_segment_tokens()->Add(result.segment_tokens.begin(),
                                          result.segment_tokens.end());
  response->mutable_token_loss()->Add(tokens.loss.begin(), tokens.loss.end());
  response->mutable_token_lse()->Add(tokens.lse.begin(), tokens.lse.end());
  response->mutable_token_argmax()->Add(tokens.argmax.begin(),
                                        tokens.argmax.end());
  response->mutable_token_logprob()->Add(tokens.logprob.begin(),
                                         tokens.logprob.end());
  response->mutable_token_entropy()->Add(tokens.entropy.begin(),
                                         tokens.entropy.end());
  response->mutable_token_ratio()->Add(tokens.ratio.begin(),
                                       tokens.ratio.end());
  for (uint8_t clipped : tokens.clipped) {
    response->add_token_clipped(clipped != 0);
  }
}

absl::Status RunPostTrainingForward(RpcSupport* rpc, const std::string& tenant,
                                    const pb::ForwardRequest& request,
                                    pb::ForwardResponse* response,
                                    const std::function<bool()>& cancelled) {
  TensorStore* store = rpc->store();
  Device* device = store->device();
  // Request-only checks first: nothing is looked up for a malformed request.
  RETURN_IF_ERROR(CheckHandle(request.logits(), "logits"));
  ASSIGN_OR_RETURN(const CrossEntropyOptions options,
                   ParseLossOptions(request.options()));
  ASSIGN_OR_RETURN(const GradientMode mode, ParseMode(request.mode()));
  RETURN_IF_ERROR(CheckLabel(request.gradient_label(), "gradient_label"));
  RETURN_IF_ERROR(CheckPostTrainingRequest(request));

  ASSIGN_OR_RETURN(std::shared_ptr<Tensor> logits,
                   LookupLogits(store, tenant, request.logits()));
  const int64_t rows = logits->shape()[0];
  PostTrainingInputs in;
  PostTrainingArgs& args = in.args;
  args.base.rows = rows;
  args.base.vocab = logits->shape()[1];
  args.base.row_stride = args.base.vocab;
  args.base.logits_dtype = logits->dtype();
  args.base.logits = logits->data();
  args.base.options = options;
  args.base.mode = mode;
  RETURN_IF_ERROR(
      ReadPostTrainingInputs(store, tenant, request, logits->shape(), &in));
  RETURN_IF_ERROR(StagePostTrainingInputs(device, &in));

  ASSIGN_OR_RETURN(ForwardLease lease,
                   store->BeginForward(logits, mode == GradientMode::kInPlace));
  std::unique_ptr<PendingTensor> gradient;
  if (mode == GradientMode::kOutOfPlace) {
    ASSIGN_OR_RETURN(
        gradient,
        store->Create(tenant, logits->dtype(), logits->shape(),
                      request.gradient_label(), TensorState::kGradient));
  }
  const pb::Outputs& outputs = request.outputs();
  PostTrainingTokens tokens(outputs, rows);
  tokens.Point(&args);
  args.base.gradient = mode == GradientMode::kInPlace      ? logits->data()
                       : mode == GradientMode::kOutOfPlace ? gradient->data()
                                                           : nullptr;

  if (cancelled()) return absl::CancelledError("Forward cancelled");
  PostTrainingResult result;
  const auto start = std::chrono::steady_clock::now();
  RETURN_IF_ERROR(device->PostTraining(args, &result));
  const std::chrono::duration<double> elapsed =
      std::chrono::steady_clock::now() - start;
  if (rpc->metrics() != nullptr) {
    rpc->metrics()->ObserveKernel(device->name(), "post_training",
                                  elapsed.count());
  }
  if (mode != GradientMode::kInPlace && cancelled()) {
    return absl::CancelledError("Forward cancelled");
  }
  // A segment reduction is a mean (over segments) for Backward's checks.
  const Reduction reduction = options.reduction;
  switch (mode) {
    case GradientMode::kInPlace:
      lease.FinishInPlace(reduction);
      response->set_gradient(logits->handle());
      break;
    case GradientMode::kOutOfPlace: {
      gradient->MarkFilled();
      ASSIGN_OR_RETURN(std::shared_ptr<Tensor> out,
                       gradient->Commit(reduction));
      response->set_gradient(out->handle());
      break;
    }
    case GradientMode::kNone:
      break;
  }
  FillPostTrainingResponse(result, args.policy != nullptr, elapsed.count(),
                           tokens, response);
  return absl::OkStatus();
}

}  // namespace lossd
