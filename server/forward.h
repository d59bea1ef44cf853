// The Forward logic that Forward and LinearForward share: a request's loss
// inputs (options, targets, class weights) turned into a kernel's arguments,
// the per-row outputs, the gradient's commit and the response's result.
// Below the RPC edge: service.cc admits a call and hands it here.
#ifndef LOSSD_SERVER_FORWARD_H_
#define LOSSD_SERVER_FORWARD_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/dtype.h"
#include "common/loss_options.h"
#include "kernels/cross_entropy.h"
#include "lossd/v1/lossd.pb.h"
#include "server/admission.h"
#include "server/device.h"
#include "server/staged.h"
#include "server/tensor_store.h"

namespace lossd {

// Serves one Forward of `tenant` (admitted by the caller): checks the
// request, resolves and leases its tensors, runs the device's CrossEntropy
// and commits the gradient into `response`. Codes as the Forward RPC
// documents (proto/lossd/v1/lossd.proto); on any error nothing is changed.
//
// `cancelled` (the RPC's cancellation or passed deadline) is asked before
// the device call and, unless the gradient is written in place, after it: a
// call cancelled then keeps no new gradient. Thread-safe.
absl::Status RunForward(RpcSupport* rpc, const std::string& tenant,
                        const lossd::v1::ForwardRequest& request,
                        lossd::v1::ForwardResponse* response,
                        const std::function<bool()>& cancelled);

// INVALID_ARGUMENT unless the stored `targets` are int32 or int64 [rows].
absl::Status CheckStoredTargets(const Tensor& targets, int64_t rows);

// The tenant's stored logits `handle`: the store's lookup errors, or
// INVALID_ARGUMENT unless they are a 2-D float tensor [N, V].
absl::StatusOr<std::shared_ptr<Tensor>> LookupLogits(TensorStore* store,
                                                     const std::string& tenant,
                                                     const std::string& handle);

// What a kernel reads of a request besides its rows: the loss options, the
// targets (a stored tensor's, leased, or the request's inline ones, staged on
// the device) and the class weights (leased, or none). Holds the leases and
// the staged copy for one call; the single place where a request's loss
// inputs become kernel arguments (FillArgs). Not thread-safe: one call.
class LossInputs {
 public:
  explicit LossInputs(const CrossEntropyOptions& options) : options_(options) {}
  LossInputs(const LossInputs&) = delete;
  LossInputs& operator=(const LossInputs&) = delete;

  // The targets of a stored tensor (checked by CheckStoredTargets) that
  // `lease` reads.
  void UseStoredTargets(ReadLease lease);
  // The request's inline targets of `dtype` (checked by CheckInlineTargets),
  // staged on `device`. INTERNAL or RESOURCE_EXHAUSTED from the device.
  absl::Status StageInlineTargets(Device* device,
                                  const lossd::v1::InlineTensor& targets,
                                  DType dtype);
  // The stored fp32 [vocab] class weights `handle` of `tenant` names,
  // leased; none when `handle` is empty. Errors as LeaseClassWeights.
  absl::Status UseClassWeights(TensorStore* store, const std::string& tenant,
                               const std::string& handle, int64_t vocab);

  // Points `args` (CrossEntropyArgs or LinearCrossEntropyArgs) at the
  // options, targets and class weights.
  template <typename Args>
  void FillArgs(Args* args) const {
    args->options = options_;
    args->targets_dtype = targets_dtype_;
    args->targets = targets_;
    args->class_weights = class_weights_;
  }

 private:
  const CrossEntropyOptions options_;
  DType targets_dtype_ = DType::kInvalid;
  const void* targets_ = nullptr;
  const float* class_weights_ = nullptr;
  // What keeps the pointers above valid.
  ReadLease targets_lease_;
  Staged inline_targets_;
  ReadLease class_weights_lease_;
};

// The per-row outputs a request asked for (token loss, lse, argmax), held on
// the host while the kernel writes them.
class TokenOutputs {
 public:
  TokenOutputs(const lossd::v1::Outputs& asked, int64_t rows);

  // Points the per-row outputs of `args` (CrossEntropyArgs or
  // LinearCrossEntropyArgs) here; those not asked for stay null.
  template <typename Args>
  void FillArgs(Args* args) {
    args->token_loss = loss_.empty() ? nullptr : loss_.data();
    args->token_lse = lse_.empty() ? nullptr : lse_.data();
    args->token_argmax = argmax_.empty() ? nullptr : argmax_.data();
  }
  // Appends the values to `response`.
  void AddTo(lossd::v1::ForwardResponse* response) const;

 private:
  std::vector<float> loss_;
  std::vector<float> lse_;
  std::vector<int32_t> argmax_;
};

// Makes the gradient of a finished pass over `inputs` visible and names it in
// `response`: in place, `inputs` (whose `lease` then holds a gradient
// reduced by `reduction`); out of place, `fresh` committed; for kNone,
// nothing. Errors from the commit.
absl::Status CommitGradient(GradientMode mode, Reduction reduction,
                            const Tensor& inputs, ForwardLease* lease,
                            PendingTensor* fresh,
                            lossd::v1::ForwardResponse* response);

// Times `kernel` (named `kernel_name` in the metrics, which may be null) on
// `device`; the seconds it took on the caller's clock, or its error (not
// reported to the metrics).
absl::StatusOr<double> TimeKernel(Metrics* metrics, const Device& device,
                                  const char* kernel_name,
                                  const std::function<absl::Status()>& kernel);

// The loss, counts and per-row outputs of a pass into `response`.
void SetResult(const CrossEntropyResult& result, double kernel_seconds,
               const TokenOutputs& outputs,
               lossd::v1::ForwardResponse* response);

}  // namespace lossd

#endif  // LOSSD_SERVER_FORWARD_H_
