// LinearForward (linear_forward.h): request checks, leases on every tensor
// the call reads or writes, the accumulators' creation, the device call; the
// loss inputs, per-row outputs and result are Forward's (forward.h).
#include "server/linear_forward.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
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
#include "server/validation.h"

namespace lossd {

namespace pb = ::lossd::v1;

namespace {

// The request-only part: everything checkable before handles are resolved.
struct LinearSpec {
  ForwardSpec forward;  // options, dX mode, inline targets' dtype
  AccumulateMode accumulate = AccumulateMode::kNone;
  bool fast_products = false;
};

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
  pb::ForwardRequest forward;
  forward.set_logits(request.hidden());
  forward.set_gradient_label(request.gradient_label());
  *forward.mutable_options() = request.options();
  forward.set_mode(request.mode());
  if (request.targets_case() == pb::LinearForwardRequest::kTargetsHandle) {
    forward.set_targets_handle(request.targets_handle());
  } else if (request.targets_case() ==
             pb::LinearForwardRequest::kTargetsInline) {
    forward.mutable_targets_inline()->set_dtype(
        request.targets_inline().dtype());
  }
  LinearSpec spec;
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

}  // namespace

absl::Status RunLinearForward(RpcSupport* rpc, const std::string& tenant,
                              const pb::LinearForwardRequest& request,
                              pb::LinearForwardResponse* response,
                              const std::function<bool()>& cancelled) {
  ASSIGN_OR_RETURN(const LinearSpec spec,
                   ValidateLinearForwardRequest(request));
  const CrossEntropyOptions& options = spec.forward.options;
  const GradientMode mode = spec.forward.mode;
  TensorStore* store = rpc->store();
  Device* device = store->device();

  // Resolve and check every tensor before taking any lease.
  ASSIGN_OR_RETURN(std::shared_ptr<Tensor> hidden,
                   LookupField(store, tenant, "hidden", request.hidden()));
  if (!IsLogitsDType(hidden->dtype()) || hidden->shape().size() != 2) {
    return absl::InvalidArgumentError(absl::StrCat(
        "hidden must be a 2-D float tensor [N, H], got ",
        DTypeName(hidden->dtype()), " ", ShapeString(hidden->shape())));
  }
  const DType dtype = hidden->dtype();
  const int64_t rows = hidden->shape()[0];
  const int64_t width = hidden->shape()[1];
  ASSIGN_OR_RETURN(std::shared_ptr<Tensor> weight,
                   LookupField(store, tenant, "weight", request.weight()));
  if (weight->shape().size() != 2 || weight->dtype() != dtype ||
      weight->shape()[1] != width) {
    return absl::InvalidArgumentError(absl::StrCat(
        "weight must be ", DTypeName(dtype), " [V, ", width,
        "] (the hidden states' dtype and H), got ", DTypeName(weight->dtype()),
        " ", ShapeString(weight->shape())));
  }
  if (weight->state() != TensorState::kLogits) {
    return absl::InvalidArgumentError(
        absl::StrCat("weight ", weight->handle(), " holds a gradient"));
  }
  const int64_t vocab = weight->shape()[0];
  std::shared_ptr<Tensor> bias;
  if (!request.bias().empty()) {
    ASSIGN_OR_RETURN(bias, LookupField(store, tenant, "bias", request.bias()));
    RETURN_IF_ERROR(Expect(*bias, "bias", dtype, {vocab}));
  }
  std::shared_ptr<Tensor> targets_tensor;
  if (request.targets_case() == pb::LinearForwardRequest::kTargetsHandle) {
    ASSIGN_OR_RETURN(
        targets_tensor,
        LookupField(store, tenant, "targets_handle", request.targets_handle()));
    RETURN_IF_ERROR(CheckStoredTargets(*targets_tensor, rows));
  } else {
    RETURN_IF_ERROR(CheckInlineTargets(
        request.targets_inline(), spec.forward.inline_targets_dtype, rows));
  }
  const bool accumulate = spec.accumulate != AccumulateMode::kNone;
  std::shared_ptr<Tensor> weight_grad;
  std::shared_ptr<Tensor> bias_grad;
  if (accumulate && !request.weight_grad().empty()) {
    ASSIGN_OR_RETURN(weight_grad, LookupField(store, tenant, "weight_grad",
                                              request.weight_grad()));
    RETURN_IF_ERROR(
        Expect(*weight_grad, "weight_grad", DType::kFloat32, {vocab, width}));
  }
  if (accumulate && !request.bias_grad().empty()) {
    ASSIGN_OR_RETURN(bias_grad, LookupField(store, tenant, "bias_grad",
                                            request.bias_grad()));
    RETURN_IF_ERROR(Expect(*bias_grad, "bias_grad", DType::kFloat32, {vocab}));
  }
  if (!accumulate &&
      (!request.weight_grad().empty() || !request.bias_grad().empty())) {
    return absl::InvalidArgumentError(
        "weight_grad or bias_grad set with accumulate NONE (or mode NONE "
        "and accumulate UNSPECIFIED): no weight gradient is formed");
  }
  if (!request.token_grad_output().empty() &&
      request.token_grad_output().size() != rows) {
    return absl::InvalidArgumentError(absl::StrCat(
        "token_grad_output has ", request.token_grad_output().size(),
        " values, the hidden states have ", rows, " rows"));
  }

  // Leases: reads fail rather than wait on an overwrite in progress; writes
  // are exclusive. Any failure drops the leases taken so far.
  ASSIGN_OR_RETURN(ReadLease weight_lease, store->TryBeginRead(weight));
  ReadLease bias_lease;
  if (bias != nullptr) {
    ASSIGN_OR_RETURN(bias_lease, store->TryBeginRead(bias));
  }
  LossInputs loss_inputs(options);
  if (targets_tensor != nullptr) {
    ASSIGN_OR_RETURN(ReadLease targets_lease,
                     store->TryBeginRead(targets_tensor));
    loss_inputs.UseStoredTargets(std::move(targets_lease));
  } else {
    RETURN_IF_ERROR(loss_inputs.StageInlineTargets(
        device, request.targets_inline(), spec.forward.inline_targets_dtype));
  }
  RETURN_IF_ERROR(loss_inputs.UseClassWeights(
      store, tenant, request.options().class_weights(), vocab));
  Accumulator grad_weight;
  Accumulator grad_bias;
  if (weight_grad != nullptr) {
    ASSIGN_OR_RETURN(grad_weight.lease, store->BeginWrite(weight_grad));
  }
  if (bias_grad != nullptr) {
    ASSIGN_OR_RETURN(grad_bias.lease, store->BeginWrite(bias_grad));
  }
  ASSIGN_OR_RETURN(ForwardLease hidden_lease,
                   store->BeginForward(hidden, mode == GradientMode::kInPlace));

  // New memory last: an out-of-place dX and the accumulators made here.
  std::unique_ptr<PendingTensor> dx;
  if (mode == GradientMode::kOutOfPlace) {
    ASSIGN_OR_RETURN(
        dx, store->Create(tenant, dtype, hidden->shape(),
                          request.gradient_label(), TensorState::kGradient));
  }
  if (accumulate && weight_grad == nullptr) {
    ASSIGN_OR_RETURN(grad_weight.fresh,
                     store->Create(tenant, DType::kFloat32, {vocab, width},
                                   request.weight_grad_label()));
  }
  const bool with_bias_grad = accumulate && bias != nullptr;
  if (with_bias_grad && bias_grad == nullptr) {
    ASSIGN_OR_RETURN(grad_bias.fresh,
                     store->Create(tenant, DType::kFloat32, {vocab},
                                   request.bias_grad_label()));
  }
  // A new accumulator starts at zero: when every accumulator of the call is
  // new, ADD is OVERWRITE (no pass to clear them); otherwise the new one is
  // cleared first.
  AccumulateMode accumulate_mode = spec.accumulate;
  if (accumulate_mode == AccumulateMode::kAdd) {
    const bool weight_new = grad_weight.fresh != nullptr;
    const bool bias_new = grad_bias.fresh != nullptr;
    if (weight_new && (!with_bias_grad || bias_new)) {
      accumulate_mode = AccumulateMode::kOverwrite;
    } else if (weight_new) {
      RETURN_IF_ERROR(
          Zero(device, grad_weight.fresh->data(), grad_weight.fresh->bytes()));
    } else if (bias_new) {
      RETURN_IF_ERROR(
          Zero(device, grad_bias.fresh->data(), grad_bias.fresh->bytes()));
    }
  }

  TokenOutputs outputs(request.outputs(), rows);
  LinearCrossEntropyArgs args;
  args.rows = rows;
  args.hidden = width;
  args.vocab = vocab;
  args.dtype = dtype;
  args.x = hidden->data();
  args.weight = weight->data();
  args.bias = bias != nullptr ? bias->data() : nullptr;
  loss_inputs.FillArgs(&args);
  args.token_grad_output = request.token_grad_output().empty()
                               ? nullptr
                               : request.token_grad_output().data();
  args.dx_mode = mode;
  // In place, dX goes beside the hidden states until the commit, so that a
  // call that fails or stops part-way leaves them as they were.
  ScratchBuffer staged_dx;
  switch (mode) {
    case GradientMode::kInPlace: {
      ASSIGN_OR_RETURN(staged_dx, store->AllocateScratch(hidden->bytes()));
      args.dx_mode = GradientMode::kOutOfPlace;
      args.dx = staged_dx.data();
      break;
    }
    case GradientMode::kOutOfPlace:
      args.dx = dx->data();
      break;
    case GradientMode::kNone:
      args.dx = nullptr;
      break;
  }
  args.accumulate = accumulate_mode;
  args.fast_products = spec.fast_products;
  if (accumulate) {
    args.grad_weight = static_cast<float*>(grad_weight.data());
    args.grad_weight_rows = vocab;
    args.grad_weight_cols = width;
  }
  if (with_bias_grad) {
    args.grad_bias = static_cast<float*>(grad_bias.data());
    args.grad_bias_size = vocab;
  }
  args.weight_hidden = weight->shape()[1];
  args.weight_dtype = weight->dtype();
  if (bias != nullptr) args.bias_dtype = bias->dtype();
  outputs.FillArgs(&args);

  ASSIGN_OR_RETURN(
      const ScratchBuffer workspace,
      store->ChargeWorkspace(device->LinearCrossEntropyWorkspaceBytes(args),
                             "LinearForward's working memory"));

  const bool adds_to_given = weight_grad != nullptr || bias_grad != nullptr;
  const auto stopped = [&cancelled] { return cancelled && cancelled(); };
  if (stopped()) {
    return absl::CancelledError("LinearForward cancelled before it started");
  }
  if (!adds_to_given) args.cancelled = cancelled;
  CrossEntropyResult result;
  ASSIGN_OR_RETURN(
      const double seconds,
      TimeKernel(rpc->metrics(), *device, "linear_cross_entropy",
                 [&] { return device->LinearCrossEntropy(args, &result); }));
  // Nobody would receive the new handles: they go, and the hidden states
  // keep their values.
  if (!adds_to_given && stopped()) {
    return absl::CancelledError("LinearForward cancelled before its commit");
  }
  if (mode == GradientMode::kInPlace) {
    RETURN_IF_ERROR(device->CopyWithin(hidden->data(), staged_dx.data(),
                                       static_cast<size_t>(hidden->bytes())));
  }

  // Commit: new tensors get their handles, the hidden states become dX.
  for (Accumulator* one : {&grad_weight, &grad_bias}) {
    if (one->fresh == nullptr) continue;
    one->fresh->MarkFilled();
    ASSIGN_OR_RETURN(std::shared_ptr<Tensor> made, one->fresh->Commit());
    (one == &grad_weight ? response->mutable_weight_grad()
                         : response->mutable_bias_grad())
        ->assign(made->handle());
  }
  if (weight_grad != nullptr) response->set_weight_grad(weight_grad->handle());
  if (bias_grad != nullptr) response->set_bias_grad(bias_grad->handle());
  RETURN_IF_ERROR(CommitGradient(mode, options.reduction, *hidden,
                                 &hidden_lease, dx.get(),
                                 response->mutable_result()));
  SetResult(result, seconds, outputs, response->mutable_result());
  return absl::OkStatus();
}

}  // namespace lossd
