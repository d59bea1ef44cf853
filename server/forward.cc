// Forward and the pieces LinearForward shares with it (forward.h): the loss
// inputs, the per-row outputs, the gradient's commit, the result.
#include "server/forward.h"

#include <chrono>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "common/tensor_math.h"
#include "server/post_training_forward.h"
#include "server/tensor_lookup.h"
#include "server/validation.h"

namespace lossd {

namespace pb = ::lossd::v1;

absl::StatusOr<std::shared_ptr<Tensor>> LookupLogits(
    TensorStore* store, const std::string& tenant, const std::string& handle) {
  ASSIGN_OR_RETURN(std::shared_ptr<Tensor> logits, store->Get(tenant, handle));
  if (!IsLogitsDType(logits->dtype()) || logits->shape().size() != 2) {
    return absl::InvalidArgumentError(absl::StrCat(
        "logits must be a 2-D float tensor, got ", DTypeName(logits->dtype()),
        " ", ShapeString(logits->shape())));
  }
  return logits;
}

absl::Status CheckStoredTargets(const Tensor& targets, int64_t rows) {
  if (IsTargetsDType(targets.dtype()) &&
      targets.shape() == std::vector<int64_t>{rows}) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "targets must be int32 or int64 [", rows, "], got ",
      DTypeName(targets.dtype()), " ", ShapeString(targets.shape())));
}

void LossInputs::UseStoredTargets(ReadLease lease) {
  targets_dtype_ = lease.tensor()->dtype();
  targets_ = lease.tensor()->data();
  targets_lease_ = std::move(lease);
}

absl::Status LossInputs::StageInlineTargets(Device* device,
                                            const pb::InlineTensor& targets,
                                            DType dtype) {
  const std::string& data = targets.data();
  RETURN_IF_ERROR(inline_targets_.Stage(device, data.data(), data.size()));
  targets_dtype_ = dtype;
  targets_ = inline_targets_.get();
  return absl::OkStatus();
}

absl::Status LossInputs::UseClassWeights(TensorStore* store,
                                         const std::string& tenant,
                                         const std::string& handle,
                                         int64_t vocab) {
  if (handle.empty()) return absl::OkStatus();
  ASSIGN_OR_RETURN(class_weights_lease_,
                   LeaseClassWeights(store, tenant, handle, vocab));
  class_weights_ =
      static_cast<const float*>(class_weights_lease_.tensor()->data());
  return absl::OkStatus();
}

TokenOutputs::TokenOutputs(const pb::Outputs& asked, int64_t rows)
    : loss_(asked.token_loss() ? rows : 0),
      lse_(asked.token_lse() ? rows : 0),
      argmax_(asked.token_argmax() ? rows : 0) {}

void TokenOutputs::AddTo(pb::ForwardResponse* response) const {
  response->mutable_token_loss()->Add(loss_.begin(), loss_.end());
  response->mutable_token_lse()->Add(lse_.begin(), lse_.end());
  response->mutable_token_argmax()->Add(argmax_.begin(), argmax_.end());
}

absl::Status CommitGradient(GradientMode mode, Reduction reduction,
                            const Tensor& inputs, ForwardLease* lease,
                            PendingTensor* fresh,
                            pb::ForwardResponse* response) {
  switch (mode) {
    case GradientMode::kInPlace:
      lease->FinishInPlace(reduction);
      response->set_gradient(inputs.handle());
      break;
    case GradientMode::kOutOfPlace: {
      fresh->MarkFilled();
      ASSIGN_OR_RETURN(std::shared_ptr<Tensor> made, fresh->Commit(reduction));
      response->set_gradient(made->handle());
      break;
    }
    case GradientMode::kNone:
      break;
  }
  return absl::OkStatus();
}

absl::StatusOr<double> TimeKernel(Metrics* metrics, const Device& device,
                                  const char* kernel_name,
                                  const std::function<absl::Status()>& kernel) {
  const auto start = std::chrono::steady_clock::now();
  RETURN_IF_ERROR(kernel());
  const std::chrono::duration<double> elapsed =
      std::chrono::steady_clock::now() - start;
  if (metrics != nullptr) {
    metrics->ObserveKernel(device.name(), kernel_name, elapsed.count());
  }
  return elapsed.count();
}

void SetResult(const CrossEntropyResult& result, double kernel_seconds,
               const TokenOutputs& outputs, pb::ForwardResponse* response) {
  response->set_loss(result.loss);
  response->set_z_loss(result.z_loss);
  response->set_valid_tokens(result.valid_tokens);
  response->set_correct_tokens(result.correct_tokens);
  response->set_nonfinite_rows(result.nonfinite_rows);
  response->set_denominator(result.denominator);
  response->set_kernel_seconds(kernel_seconds);
  outputs.AddTo(response);
}

absl::Status RunForward(RpcSupport* rpc, const std::string& tenant,
                        const pb::ForwardRequest& request,
                        pb::ForwardResponse* response,
                        const std::function<bool()>& cancelled) {
  if (IsPostTrainingForward(request)) {
    return RunPostTrainingForward(rpc, tenant, request, response, cancelled);
  }
  // Request-only checks first: nothing is looked up for a malformed request.
  ASSIGN_OR_RETURN(const ForwardSpec spec, ValidateForwardRequest(request));
  const GradientMode mode = spec.mode;
  TensorStore* store = rpc->store();
  Device* device = store->device();

  ASSIGN_OR_RETURN(std::shared_ptr<Tensor> logits,
                   LookupLogits(store, tenant, request.logits()));
  const int64_t rows = logits->shape()[0];
  const int64_t vocab = logits->shape()[1];

  LossInputs loss_inputs(spec.options);
  if (request.targets_case() == pb::ForwardRequest::kTargetsHandle) {
    ASSIGN_OR_RETURN(std::shared_ptr<Tensor> tensor,
                     store->Get(tenant, request.targets_handle()));
    RETURN_IF_ERROR(CheckStoredTargets(*tensor, rows));
    loss_inputs.UseStoredTargets(store->BeginRead(std::move(tensor)));
  } else {
    RETURN_IF_ERROR(CheckInlineTargets(request.targets_inline(),
                                       spec.inline_targets_dtype, rows));
    RETURN_IF_ERROR(loss_inputs.StageInlineTargets(
        device, request.targets_inline(), spec.inline_targets_dtype));
  }
  RETURN_IF_ERROR(loss_inputs.UseClassWeights(
      store, tenant, request.options().class_weights(), vocab));

  ASSIGN_OR_RETURN(ForwardLease lease,
                   store->BeginForward(logits, mode == GradientMode::kInPlace));
  std::unique_ptr<PendingTensor> gradient;
  if (mode == GradientMode::kOutOfPlace) {
    ASSIGN_OR_RETURN(
        gradient,
        store->Create(tenant, logits->dtype(), logits->shape(),
                      request.gradient_label(), TensorState::kGradient));
  }

  TokenOutputs outputs(request.outputs(), rows);
  CrossEntropyArgs args;
  args.rows = rows;
  args.vocab = vocab;
  args.row_stride = vocab;
  args.logits_dtype = logits->dtype();
  args.logits = logits->data();
  loss_inputs.FillArgs(&args);
  args.mode = mode;
  switch (mode) {
    case GradientMode::kInPlace:
      args.gradient = logits->data();
      break;
    case GradientMode::kOutOfPlace:
      args.gradient = gradient->data();
      break;
    case GradientMode::kNone:
      args.gradient = nullptr;
      break;
  }
  outputs.FillArgs(&args);

  // The pass is one sweep over the logits and is not interrupted; a call
  // cancelled before it starts does not run it, and one cancelled while it
  // ran keeps no new gradient. In place, the logits are already the
  // gradient by then: that call finishes as if it had not been cancelled.
  if (cancelled()) return absl::CancelledError("Forward cancelled");
  CrossEntropyResult result;
  ASSIGN_OR_RETURN(const double seconds,
                   TimeKernel(rpc->metrics(), *device, "cross_entropy", [&] {
                     return device->CrossEntropy(args, &result);
                   }));
  if (mode != GradientMode::kInPlace && cancelled()) {
    return absl::CancelledError("Forward cancelled");
  }

  RETURN_IF_ERROR(CommitGradient(mode, spec.options.reduction, *logits, &lease,
                                 gradient.get(), response));
  // The device's own time where it measures it (CUDA events around the
  // kernels), else the call's.
  SetResult(result, result.kernel_seconds > 0 ? result.kernel_seconds : seconds,
            outputs, response);
  return absl::OkStatus();
}

}  // namespace lossd
