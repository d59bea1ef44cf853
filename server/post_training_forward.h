// Forward with a post-training loss (distillation, policy, segments): checks,
// small inputs read to the host and checked before any lease, the device call;
// apart from the cross-entropy Forward so that each stays readable.
#ifndef LOSSD_SERVER_POST_TRAINING_FORWARD_H_
#define LOSSD_SERVER_POST_TRAINING_FORWARD_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/dtype.h"
#include "kernels/post_training.h"
#include "lossd/v1/lossd.pb.h"
#include "server/admission.h"
#include "server/device.h"
#include "server/staged.h"
#include "server/tensor_store.h"

namespace lossd {

// True when `request` asks for a post-training loss (distillation, policy or
// segments set); such a request is run by RunPostTrainingForward.
bool IsPostTrainingForward(const lossd::v1::ForwardRequest& request);

// Runs one post-training Forward for `tenant` and fills `response`. Codes as
// the Forward RPC documents (proto/lossd/v1/lossd.proto); every input is
// checked before the logits are leased, so on INVALID_ARGUMENT, NOT_FOUND
// and FAILED_PRECONDITION nothing changes. `cancelled` is asked before the
// device call and (unless in place) after it. Thread-safe.
absl::Status RunPostTrainingForward(RpcSupport* rpc, const std::string& tenant,
                                    const lossd::v1::ForwardRequest& request,
                                    lossd::v1::ForwardResponse* response,
                                    const std::function<bool()>& cancelled);

// The pieces below are shared with LinearForward, whose post-training loss
// reads the same inputs (a ForwardRequest view of it names them).

// A small input ([rows] or [rows, k]) of a handle or inline bytes, read onto
// the host: the server checks its values there before any write, whatever
// the device.
struct PostTrainingHostInput {
  DType dtype = DType::kInvalid;
  std::vector<char> bytes;
  Staged staged;  // the bytes on the device for the kernel
  const void* host() const { return bytes.data(); }
};

// Everything a post-training loss reads besides the student's rows: the small
// inputs on the host (then staged), the teacher's lease, the kernel's
// arguments pointing at them. Not thread-safe: one call.
struct PostTrainingInputs {
  PostTrainingHostInput targets, indices, logprobs, advantages, sampling,
      reference, ids;
  ReadLease teacher;
  DistillationArgs kd;
  PolicyArgs policy;
  SegmentArgs segments;
  PostTrainingArgs args;
};

// A policy's loss, epsilons, kl_coef and estimator (defaults applied), its
// input pointers null. INVALID_ARGUMENT: an unspecified or unknown loss, an
// unknown estimator. Pure; shared with Evaluate, whose inputs come in blocks.
absl::StatusOr<PolicyArgs> ParsePolicyScalars(
    const lossd::v1::PolicyGradient& policy);

// Request-only checks of the distillation, policy and segments of `request`
// (and that class weights are absent), before any lookup: INVALID_ARGUMENT
// naming the field.
absl::Status CheckPostTrainingRequest(const lossd::v1::ForwardRequest& request);

// Reads the targets, teacher, policy inputs and segment ids `request` names
// for a student of `shape` [N, V] into `*in` (in->args.base must already hold
// the rows, vocab, options and a logits pointer, which is not read), and
// checks them all (ValidatePostTrainingArgs, CheckPostTrainingData). Holds a
// read lease on a dense teacher. NOT_FOUND, INVALID_ARGUMENT and
// FAILED_PRECONDITION name the field; nothing is written.
absl::Status ReadPostTrainingInputs(TensorStore* store,
                                    const std::string& tenant,
                                    const lossd::v1::ForwardRequest& request,
                                    const std::vector<int64_t>& shape,
                                    PostTrainingInputs* in);

// The checked small inputs onto `device` (no copy on a host-accessible one);
// in->args then points there. Errors from the device.
absl::Status StagePostTrainingInputs(Device* device, PostTrainingInputs* in);

// The per-token outputs a request asked for (lossd::v1::Outputs), held on the
// host while the kernel writes them; those not asked for are empty.
struct PostTrainingTokens {
  PostTrainingTokens(const lossd::v1::Outputs& asked, int64_t rows);
  // Points the per-token outputs of `args` here (null where not asked for).
  void Point(PostTrainingArgs* args);

  std::vector<float> loss, lse, logprob, entropy, ratio;
  std::vector<int32_t> argmax;
  std::vector<uint8_t> clipped;
};

// A policy's statistics into their message (Forward's and Evaluate's).
void FillPolicyStats(const PolicyStatsResult& sums,
                     lossd::v1::PolicyStats* stats);

// The response's loss, counts, statistics, segment sums and per-token
// outputs.
void FillPostTrainingResponse(const PostTrainingResult& result, bool policy,
                              double elapsed, const PostTrainingTokens& tokens,
                              lossd::v1::ForwardResponse* response);

}  // namespace lossd

#endif  // LOSSD_SERVER_POST_TRAINING_FORWARD_H_
