// LinearForward (linear_forward.h): request checks, leases on every tensor
// the call reads or writes, the accumulators' creation, the device call; the
// loss inputs, per-row outputs and result are Forward's (forward.h).
#include "server/linear_forward.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <iterator>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/handle.h"
#include "common/status_macros.h"
#include "common/tensor_math.h"
#include "server/forward.h"
#include "server/post_training_forward.h"
#include "server/tensor_lookup.h"
#include "server/validation.h"

namespace lossd {

namespace pb = ::lossd::v1;

namespace {

// The request-only part: everything checkable before handles are resolved.
struct LinearSpec {
  ForwardSpec forward;  // options, dX mode, inline targets' dtype
  AccumulateMode accumulate = AccumulateMode::kNone;
  bool fast_products = false;
  // A post-training loss (distillation, policy or segments) on Z: it reads
  // its targets itself (PostTrainingInputs).
  bool post_training = false;
};

// The request as a Forward of its hidden states: the options, mode, outputs,
// targets and (with `loss_inputs`) the post-training fields and the inline
// targets' bytes. Forward's rules check it; the post-training reads take it.
pb::ForwardRequest ForwardView(const pb::LinearForwardRequest& request,
                               bool loss_inputs) {
  pb::ForwardRequest forward;
  forward.set_logits(request.hidden());
  forward.set_gradient_label(request.gradient_label());
  *forward.mutable_options() = request.options();
  forward.set_mode(request.mode());
  *forward.mutable_outputs() = request.outputs();
  if (request.targets_case() == pb::LinearForwardRequest::kTargetsHandle) {
    forward.set_targets_handle(request.targets_handle());
  } else if (request.targets_case() ==
             pb::LinearForwardRequest::kTargetsInline) {
    forward.mutable_targets_inline()->set_dtype(
        request.targets_inline().dtype());
    if (loss_inputs) {
      forward.mutable_targets_inline()->set_data(
          request.targets_inline().data());
    }
  }
  if (!loss_inputs) return forward;
  if (request.has_distillation()) {
    *forward.mutable_distillation() = request.distillation();
  }
  if (request.has_policy()) *forward.mutable_policy() = request.policy();
  if (request.has_segments()) *forward.mutable_segments() = request.segments();
  return forward;
}

absl::StatusOr<AccumulateMode> ParseAccumulate(int value, GradientMode mode) {
  switch (value) {
    case pb::ACCUMULATE_MODE_UNSPECIFIED:
      return mode == GradientMode::kNone ? AccumulateMode::kNone
                                         : AccumulateMode::kAdd;
    case pb::ACCUMULATE_MODE_ADD:
      return AccumulateMode::kAdd;
    case pb::ACCUMULATE_MODE_OVERWRITE:
      return AccumulateMode::kOverwrite;
    case pb::ACCUMULATE_MODE_NONE:
      return AccumulateMode::kNone;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("accumulate: unknown value ", value,
                       " (allowed: UNSPECIFIED, ADD, OVERWRITE, NONE)"));
  }
}

// Whether the products may run in the inputs' 16-bit dtype.
absl::StatusOr<bool> ParsePrecision(int value) {
  switch (value) {
    case pb::LINEAR_PRECISION_UNSPECIFIED:
      return false;
    case pb::LINEAR_PRECISION_FAST:
      return true;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "precision: unknown value ", value, " (allowed: UNSPECIFIED, FAST)"));
  }
}

absl::StatusOr<LinearSpec> ValidateLinearForwardRequest(
    const pb::LinearForwardRequest& request) {
  // Every handle's shape, before any lookup; empty optional ones are absent.
  RETURN_IF_ERROR(CheckHandle(request.hidden(), "hidden"));
  RETURN_IF_ERROR(CheckHandle(request.weight(), "weight"));
  const std::pair<absl::string_view, const std::string*> optional_handles[] = {
      {"bias", &request.bias()},
      {"weight_grad", &request.weight_grad()},
      {"bias_grad", &request.bias_grad()},
  };
  for (const auto& [field, handle] : optional_handles) {
    if (!handle->empty()) RETURN_IF_ERROR(CheckHandle(*handle, field));
  }
  RETURN_IF_ERROR(CheckLabel(request.weight_grad_label(), "weight_grad_label"));
  RETURN_IF_ERROR(CheckLabel(request.bias_grad_label(), "bias_grad_label"));
  // The options, mode, targets and gradient label are Forward's: checked by
  // Forward's rules, with the hidden states in the logits' place.
  pb::ForwardRequest forward = ForwardView(request, false);
  const bool post_training = request.has_distillation() ||
                             request.has_policy() || request.has_segments();
  if (post_training) {
    RETURN_IF_ERROR(CheckPostTrainingRequest(ForwardView(request, true)));
    // A distillation with alpha 0 may go without targets: its own checks
    // decide (ReadPostTrainingInputs); Forward's rules see a stand-in dtype.
    if (request.targets_case() == pb::LinearForwardRequest::TARGETS_NOT_SET) {
      forward.mutable_targets_inline()->set_dtype(pb::DTYPE_INT32);
    }
  }
  LinearSpec spec;
  spec.post_training = post_training;
  ASSIGN_OR_RETURN(spec.forward, ValidateForwardRequest(forward));
  ASSIGN_OR_RETURN(spec.accumulate,
                   ParseAccumulate(request.accumulate(), spec.forward.mode));
  ASSIGN_OR_RETURN(spec.fast_products, ParsePrecision(request.precision()));

  // One tensor in two roles would be read and written at once (hidden ==
  // weight turned into its own gradient, an accumulator that is the weight).
  const std::pair<absl::string_view, const std::string*> roles[] = {
      {"hidden", &request.hidden()},
      {"weight", &request.weight()},
      {"bias", &request.bias()},
      {"targets_handle", &request.targets_handle()},
      {"options.class_weights", &request.options().class_weights()},
      {"weight_grad", &request.weight_grad()},
      {"bias_grad", &request.bias_grad()},
  };
  for (size_t i = 0; i < std::size(roles); ++i) {
    for (size_t j = i + 1; j < std::size(roles); ++j) {
      if (!roles[i].second->empty() && *roles[i].second == *roles[j].second) {
        return absl::InvalidArgumentError(absl::StrCat(
            roles[i].first, " and ", roles[j].first, " name the same tensor ",
            *roles[i].second, "; each role needs its own tensor"));
      }
    }
  }
  if (!request.bias_grad().empty() && request.bias().empty()) {
    return absl::InvalidArgumentError(
        "bias_grad is set but bias is not: a bias gradient needs a bias");
  }
  const bool gradient = spec.forward.mode != GradientMode::kNone ||
                        spec.accumulate != AccumulateMode::kNone;
  const bool per_row = spec.forward.options.reduction == Reduction::kNone;
  if (per_row && gradient && request.token_grad_output().empty()) {
    return absl::InvalidArgumentError(
        "reduction NONE with a gradient (mode or accumulate not NONE) needs "
        "token_grad_output, the per-row grad_output [N]");
  }
  if (!(per_row && gradient) && !request.token_grad_output().empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("token_grad_output (", request.token_grad_output().size(),
                     " values) is only for reduction NONE with a gradient"));
  }
  // A non-finite factor would turn its row's dX and every row of dW into
  // NaN; it is a bad request, as a non-finite Backward factor is.
  const auto& factors = request.token_grad_output();
  for (int i = 0; i < factors.size(); ++i) {
    if (!std::isfinite(factors[i])) {
      return absl::InvalidArgumentError(absl::StrCat(
          "token_grad_output[", i, "] = ", factors[i], " is not finite"));
    }
  }
  return spec;
}

// INVALID_ARGUMENT unless `tensor` is `dtype` of `shape`.
absl::Status Expect(const Tensor& tensor, absl::string_view field, DType dtype,
                    const std::vector<int64_t>& shape) {
  if (tensor.dtype() == dtype && tensor.shape() == shape) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      field, " must be ", DTypeName(dtype), " ", ShapeString(shape), ", got ",
      DTypeName(tensor.dtype()), " ", ShapeString(tensor.shape())));
}

// An accumulator the caller named, or one made here.
struct Accumulator {
  ForwardLease lease;                    // an existing one, written
  std::unique_ptr<PendingTensor> fresh;  // a new one, committed at the end
  void* data() const {
    return fresh != nullptr ? fresh->data() : lease.tensor()->data();
  }
};

// Fills `bytes` of device memory with zeros, in host-sized pieces (only for
// an accumulator made while its sibling already holds a sum).
absl::Status Zero(Device* device, void* buffer, int64_t bytes) {
  const std::vector<char> zeros(
      static_cast<size_t>(std::min<int64_t>(bytes, int64_t{4} << 20)));
  for (int64_t done = 0; done < bytes;) {
    const int64_t piece =
        std::min<int64_t>(bytes - done, static_cast<int64_t>(zeros.size()));
    RETURN_IF_ERROR(device->CopyFromHost(buffer, static_cast<size_t>(done),
                                         zeros.data(),
                                         static_cast<size_t>(piece)));
    done += piece;
  }
  return absl::OkStatus();
}

// The tensors a LinearForward names, looked up and checked against each
// other, before any lease.
struct LinearTensors {
  std::shared_ptr<Tensor> hidden;   // X [rows, width]
  std::shared_ptr<Tensor> weight;   // W [vocab, width]
  std::shared_ptr<Tensor> bias;     // [vocab], or null
  std::shared_ptr<Tensor> targets;  // [rows], or null for inline targets
  // The caller's accumulators, or null (made by the call when it forms them).
  std::shared_ptr<Tensor> weight_grad;
  std::shared_ptr<Tensor> bias_grad;
  DType dtype = DType::kInvalid;
  int64_t rows = 0;
  int64_t width = 0;
  int64_t vocab = 0;
};

// The hidden states and the weight: every other tensor is checked against
// their dtype and sizes.
absl::Status ResolveHiddenAndWeight(TensorStore* store,
                                    const std::string& tenant,
                                    const pb::LinearForwardRequest& request,
                                    LinearTensors* tensors) {
  ASSIGN_OR_RETURN(tensors->hidden,
                   LookupField(store, tenant, "hidden", request.hidden()));
  const Tensor& hidden = *tensors->hidden;
  if (!IsLogitsDType(hidden.dtype()) || hidden.shape().size() != 2) {
    return absl::InvalidArgumentError(absl::StrCat(
        "hidden must be a 2-D float tensor [N, H], got ",
        DTypeName(hidden.dtype()), " ", ShapeString(hidden.shape())));
  }
  tensors->dtype = hidden.dtype();
  tensors->rows = hidden.shape()[0];
  tensors->width = hidden.shape()[1];
  ASSIGN_OR_RETURN(tensors->weight,
                   LookupField(store, tenant, "weight", request.weight()));
  const Tensor& weight = *tensors->weight;
  if (weight.shape().size() != 2 || weight.dtype() != tensors->dtype ||
      weight.shape()[1] != tensors->width) {
    return absl::InvalidArgumentError(absl::StrCat(
        "weight must be ", DTypeName(tensors->dtype), " [V, ", tensors->width,
        "] (the hidden states' dtype and H), got ", DTypeName(weight.dtype()),
        " ", ShapeString(weight.shape())));
  }
  if (weight.state() != TensorState::kLogits) {
    return absl::InvalidArgumentError(
        absl::StrCat("weight ", weight.handle(), " holds a gradient"));
  }
  tensors->vocab = weight.shape()[0];
  return absl::OkStatus();
}

// The caller's accumulators, when the call forms a weight gradient.
absl::Status ResolveAccumulators(TensorStore* store, const std::string& tenant,
                                 const pb::LinearForwardRequest& request,
                                 bool accumulate, LinearTensors* tensors) {
  const int64_t vocab = tensors->vocab;
  if (accumulate && !request.weight_grad().empty()) {
    ASSIGN_OR_RETURN(
        tensors->weight_grad,
        LookupField(store, tenant, "weight_grad", request.weight_grad()));
    RETURN_IF_ERROR(Expect(*tensors->weight_grad, "weight_grad",
                           DType::kFloat32, {vocab, tensors->width}));
  }
  if (accumulate && !request.bias_grad().empty()) {
    ASSIGN_OR_RETURN(tensors->bias_grad, LookupField(store, tenant, "bias_grad",
                                                     request.bias_grad()));
    RETURN_IF_ERROR(
        Expect(*tensors->bias_grad, "bias_grad", DType::kFloat32, {vocab}));
  }
  if (!accumulate &&
      (!request.weight_grad().empty() || !request.bias_grad().empty())) {
    return absl::InvalidArgumentError(
        "weight_grad or bias_grad set with accumulate NONE (or mode NONE "
        "and accumulate UNSPECIFIED): no weight gradient is formed");
  }
  return absl::OkStatus();
}

// Every tensor of the request, resolved and checked before any lease.
absl::StatusOr<LinearTensors> ResolveLinearTensors(
    TensorStore* store, const std::string& tenant,
    const pb::LinearForwardRequest& request, const LinearSpec& spec) {
  LinearTensors tensors;
  RETURN_IF_ERROR(ResolveHiddenAndWeight(store, tenant, request, &tensors));
  if (!request.bias().empty()) {
    ASSIGN_OR_RETURN(tensors.bias,
                     LookupField(store, tenant, "bias", request.bias()));
    RETURN_IF_ERROR(
        Expect(*tensors.bias, "bias", tensors.dtype, {tensors.vocab}));
  }
  if (spec.post_training) {
    // The loss's own reads resolve and check them.
  } else if (request.targets_case() ==
             pb::LinearForwardRequest::kTargetsHandle) {
    ASSIGN_OR_RETURN(
        tensors.targets,
        LookupField(store, tenant, "targets_handle", request.targets_handle()));
    RETURN_IF_ERROR(CheckStoredTargets(*tensors.targets, tensors.rows));
  } else {
    RETURN_IF_ERROR(CheckInlineTargets(request.targets_inline(),
                                       spec.forward.inline_targets_dtype,
                                       tensors.rows));
  }
  RETURN_IF_ERROR(ResolveAccumulators(store, tenant, request,
                                      spec.accumulate != AccumulateMode::kNone,
                                      &tensors));
  if (!request.token_grad_output().empty() &&
      request.token_grad_output().size() != tensors.rows) {
    return absl::InvalidArgumentError(absl::StrCat(
        "token_grad_output has ", request.token_grad_output().size(),
        " values, the hidden states have ", tensors.rows, " rows"));
  }
  return tensors;
}

// What a running LinearForward holds: its leases and the tensors it makes.
// Dropping it before the commit changes nothing.
struct LinearCall {
  explicit LinearCall(const CrossEntropyOptions& options)
      : loss_inputs(options) {}

  ReadLease weight_lease;
  ReadLease bias_lease;
  LossInputs loss_inputs;
  Accumulator grad_weight;
  Accumulator grad_bias;
  ForwardLease hidden_lease;
  std::unique_ptr<PendingTensor> dx;  // an out-of-place dX
  bool accumulate = false;            // a weight gradient is formed
  bool with_bias_grad = false;        // and a bias gradient
  AccumulateMode accumulate_mode = AccumulateMode::kNone;
};

// Leases every tensor the call reads or writes: reads fail rather than wait
// on an overwrite in progress; writes are exclusive. Any failure drops the
// leases taken so far (with `call`).
absl::Status LeaseLinearTensors(TensorStore* store, const std::string& tenant,
                                const pb::LinearForwardRequest& request,
                                const LinearSpec& spec,
                                const LinearTensors& tensors,
                                LinearCall* call) {
  ASSIGN_OR_RETURN(call->weight_lease, store->TryBeginRead(tensors.weight));
  if (tensors.bias != nullptr) {
    ASSIGN_OR_RETURN(call->bias_lease, store->TryBeginRead(tensors.bias));
  }
  if (tensors.targets != nullptr) {
    ASSIGN_OR_RETURN(ReadLease targets_lease,
                     store->TryBeginRead(tensors.targets));
    call->loss_inputs.UseStoredTargets(std::move(targets_lease));
  } else if (!spec.post_training) {
    RETURN_IF_ERROR(call->loss_inputs.StageInlineTargets(
        store->device(), request.targets_inline(),
        spec.forward.inline_targets_dtype));
  }
  RETURN_IF_ERROR(call->loss_inputs.UseClassWeights(
      store, tenant, request.options().class_weights(), tensors.vocab));
  if (tensors.weight_grad != nullptr) {
    ASSIGN_OR_RETURN(call->grad_weight.lease,
                     store->BeginWrite(tensors.weight_grad));
  }
  if (tensors.bias_grad != nullptr) {
    ASSIGN_OR_RETURN(call->grad_bias.lease,
                     store->BeginWrite(tensors.bias_grad));
  }
  ASSIGN_OR_RETURN(
      call->hidden_lease,
      store->BeginForward(tensors.hidden,
                          spec.forward.mode == GradientMode::kInPlace));
  return absl::OkStatus();
}

// New memory, after the leases: an out-of-place dX and the accumulators the
// caller did not name; then the accumulate mode those allow.
absl::Status CreateLinearOutputs(TensorStore* store, const std::string& tenant,
                                 const pb::LinearForwardRequest& request,
                                 const LinearSpec& spec,
                                 const LinearTensors& tensors,
                                 LinearCall* call) {
  call->accumulate = spec.accumulate != AccumulateMode::kNone;
  if (spec.forward.mode == GradientMode::kOutOfPlace) {
    ASSIGN_OR_RETURN(
        call->dx,
        store->Create(tenant, tensors.dtype, tensors.hidden->shape(),
                      request.gradient_label(), TensorState::kGradient));
  }
  if (call->accumulate && tensors.weight_grad == nullptr) {
    ASSIGN_OR_RETURN(
        call->grad_weight.fresh,
        store->Create(tenant, DType::kFloat32, {tensors.vocab, tensors.width},
                      request.weight_grad_label()));
  }
  call->with_bias_grad = call->accumulate && tensors.bias != nullptr;
  if (call->with_bias_grad && tensors.bias_grad == nullptr) {
    ASSIGN_OR_RETURN(call->grad_bias.fresh,
                     store->Create(tenant, DType::kFloat32, {tensors.vocab},
                                   request.bias_grad_label()));
  }
  // A new accumulator starts at zero: when every accumulator of the call is
  // new, ADD is OVERWRITE (no pass to clear them); otherwise the new one is
  // cleared first.
  call->accumulate_mode = spec.accumulate;
  if (call->accumulate_mode != AccumulateMode::kAdd) return absl::OkStatus();
  const PendingTensor* weight_new = call->grad_weight.fresh.get();
  const PendingTensor* bias_new = call->grad_bias.fresh.get();
  if (weight_new != nullptr && (!call->with_bias_grad || bias_new != nullptr)) {
    call->accumulate_mode = AccumulateMode::kOverwrite;
  } else if (weight_new != nullptr) {
    RETURN_IF_ERROR(
        Zero(store->device(), weight_new->data(), weight_new->bytes()));
  } else if (bias_new != nullptr) {
    RETURN_IF_ERROR(Zero(store->device(), bias_new->data(), bias_new->bytes()));
  }
  return absl::OkStatus();
}

// The kernel's arguments for `call`, dX going to `dx` (in place: a buffer
// beside the hidden states, copied over them at the commit).
LinearCrossEntropyArgs LinearArgs(const pb::LinearForwardRequest& request,
                                  const LinearSpec& spec,
                                  const LinearTensors& tensors,
                                  const LinearCall& call, void* dx,
                                  TokenOutputs* outputs) {
  LinearCrossEntropyArgs args;
  args.rows = tensors.rows;
  args.hidden = tensors.width;
  args.vocab = tensors.vocab;
  args.dtype = tensors.dtype;
  args.x = tensors.hidden->data();
  args.weight = tensors.weight->data();
  args.bias = tensors.bias != nullptr ? tensors.bias->data() : nullptr;
  call.loss_inputs.FillArgs(&args);
  args.token_grad_output = request.token_grad_output().empty()
                               ? nullptr
                               : request.token_grad_output().data();
  args.dx_mode = spec.forward.mode == GradientMode::kInPlace
                     ? GradientMode::kOutOfPlace
                     : spec.forward.mode;
  args.dx = dx;
  args.accumulate = call.accumulate_mode;
  args.fast_products = spec.fast_products;
  if (call.accumulate) {
    args.grad_weight = static_cast<float*>(call.grad_weight.data());
    args.grad_weight_rows = tensors.vocab;
    args.grad_weight_cols = tensors.width;
  }
  if (call.with_bias_grad) {
    args.grad_bias = static_cast<float*>(call.grad_bias.data());
    args.grad_bias_size = tensors.vocab;
  }
  args.weight_hidden = tensors.weight->shape()[1];
  args.weight_dtype = tensors.weight->dtype();
  if (tensors.bias != nullptr) args.bias_dtype = tensors.bias->dtype();
  outputs->FillArgs(&args);
  return args;
}

// Makes the call's results visible: new tensors get their handles, the
// hidden states become dX.
absl::Status CommitLinear(const LinearSpec& spec, const LinearTensors& tensors,
                          LinearCall* call,
                          pb::LinearForwardResponse* response) {
  for (Accumulator* one : {&call->grad_weight, &call->grad_bias}) {
    if (one->fresh == nullptr) continue;
    one->fresh->MarkFilled();
    ASSIGN_OR_RETURN(std::shared_ptr<Tensor> made, one->fresh->Commit());
    (one == &call->grad_weight ? response->mutable_weight_grad()
                               : response->mutable_bias_grad())
        ->assign(made->handle());
  }
  if (tensors.weight_grad != nullptr) {
    response->set_weight_grad(tensors.weight_grad->handle());
  }
  if (tensors.bias_grad != nullptr) {
    response->set_bias_grad(tensors.bias_grad->handle());
  }
  return CommitGradient(spec.forward.mode, spec.forward.options.reduction,
                        *tensors.hidden, &call->hidden_lease, call->dx.get(),
                        response->mutable_result());
}

// The post-training loss of a LinearForward: its inputs (read and checked
// before any lease), per-token outputs and result.
struct LinearPostTrainingLoss {
  LinearPostTrainingLoss(const pb::Outputs& asked, int64_t rows)
      : tokens(asked, rows) {}

  PostTrainingInputs inputs;
  PostTrainingTokens tokens;
  PostTrainingResult result;

  // Reads the loss's inputs for `tensors` (Z is [rows, vocab]) and stages
  // them on the device.
  absl::Status Read(TensorStore* store, const std::string& tenant,
                    const pb::LinearForwardRequest& request,
                    const LinearSpec& spec, const LinearTensors& tensors) {
    CrossEntropyArgs& base = inputs.args.base;
    base.rows = tensors.rows;
    base.vocab = tensors.vocab;
    base.row_stride = tensors.vocab;
    base.logits_dtype = tensors.dtype;
    base.logits = tensors.hidden->data();  // a stand-in, never read
    base.options = spec.forward.options;
    RETURN_IF_ERROR(
        ReadPostTrainingInputs(store, tenant, ForwardView(request, true),
                               {tensors.rows, tensors.vocab}, &inputs));
    return StagePostTrainingInputs(store->device(), &inputs);
  }

  // The kernel's arguments: `linear` with the loss's targets, inputs and
  // per-token outputs.
  LinearPostTrainingArgs KernelArgs(const LinearCrossEntropyArgs& linear) {
    PostTrainingArgs outputs;
    tokens.Point(&outputs);
    LinearPostTrainingArgs args;
    args.linear = linear;
    args.linear.targets = inputs.args.base.targets;
    args.linear.targets_dtype = inputs.args.base.targets != nullptr
                                    ? inputs.args.base.targets_dtype
                                    : DType::kInt32;
    args.linear.token_loss = outputs.base.token_loss;
    args.linear.token_lse = outputs.base.token_lse;
    args.linear.token_argmax = outputs.base.token_argmax;
    args.distillation = inputs.args.distillation;
    args.policy = inputs.args.policy;
    args.segments = inputs.args.segments;
    args.token_logprob = outputs.token_logprob;
    args.token_entropy = outputs.token_entropy;
    args.token_ratio = outputs.token_ratio;
    args.token_clipped = outputs.token_clipped;
    return args;
  }

  void Fill(double seconds, pb::ForwardResponse* response) const {
    FillPostTrainingResponse(result, inputs.args.policy != nullptr, seconds,
                             tokens, response);
  }
};

}  // namespace

absl::Status RunLinearForward(RpcSupport* rpc, const std::string& tenant,
                              const pb::LinearForwardRequest& request,
                              pb::LinearForwardResponse* response,
                              const std::function<bool()>& cancelled) {
  ASSIGN_OR_RETURN(const LinearSpec spec,
                   ValidateLinearForwardRequest(request));
  const GradientMode mode = spec.forward.mode;
  TensorStore* store = rpc->store();
  Device* device = store->device();
  ASSIGN_OR_RETURN(const LinearTensors tensors,
                   ResolveLinearTensors(store, tenant, request, spec));
  const Tensor& hidden = *tensors.hidden;
  std::unique_ptr<LinearPostTrainingLoss> post_training;
  if (spec.post_training) {
    post_training = std::make_unique<LinearPostTrainingLoss>(request.outputs(),
                                                             tensors.rows);
    RETURN_IF_ERROR(post_training->Read(store, tenant, request, spec, tensors));
  }
  LinearCall call(spec.forward.options);
  RETURN_IF_ERROR(
      LeaseLinearTensors(store, tenant, request, spec, tensors, &call));
  RETURN_IF_ERROR(
      CreateLinearOutputs(store, tenant, request, spec, tensors, &call));

  TokenOutputs outputs(request.outputs(), tensors.rows);
  // In place, dX goes beside the hidden states until the commit, so that a
  // call that fails or stops part-way leaves them as they were.
  ScratchBuffer staged_dx;
  if (mode == GradientMode::kInPlace) {
    ASSIGN_OR_RETURN(staged_dx, store->AllocateScratch(tenant, hidden.bytes()));
  }
  void* dx = mode == GradientMode::kInPlace      ? staged_dx.data()
             : mode == GradientMode::kOutOfPlace ? call.dx->data()
                                                 : nullptr;
  LinearCrossEntropyArgs args =
      LinearArgs(request, spec, tensors, call, dx, &outputs);
  ASSIGN_OR_RETURN(const ScratchBuffer workspace,
                   store->ChargeWorkspace(
                       tenant, device->LinearCrossEntropyWorkspaceBytes(args),
                       "LinearForward's working memory"));

  const bool adds_to_given =
      tensors.weight_grad != nullptr || tensors.bias_grad != nullptr;
  const auto stopped = [&cancelled] { return cancelled && cancelled(); };
  if (stopped()) {
    return absl::CancelledError("LinearForward cancelled before it started");
  }
  if (!adds_to_given) args.cancelled = cancelled;
  CrossEntropyResult result;
  const std::function<absl::Status()> kernel = [&] {
    return post_training != nullptr
               ? device->LinearPostTraining(post_training->KernelArgs(args),
                                            &post_training->result)
               : device->LinearCrossEntropy(args, &result);
  };
  ASSIGN_OR_RETURN(const double seconds,
                   TimeKernel(rpc->metrics(), *device,
                              post_training != nullptr ? "linear_post_training"
                                                       : "linear_cross_entropy",
                              kernel));
  // Nobody would receive the new handles: they go, and the hidden states
  // keep their values.
  if (!adds_to_given && stopped()) {
    return absl::CancelledError("LinearForward cancelled before its commit");
  }
  if (mode == GradientMode::kInPlace) {
    RETURN_IF_ERROR(device->CopyWithin(hidden.data(), staged_dx.data(),
                                       static_cast<size_t>(hidden.bytes())));
  }
  RETURN_IF_ERROR(CommitLinear(spec, tensors, &call, response));
  if (post_training != nullptr) {
    post_training->Fill(seconds, response->mutable_result());
  } else {
    SetResult(result, seconds, outputs, response->mutable_result());
  }
  return absl::OkStatus();
}

}  // namespace lossd
