// Forward with a post-training loss (distillation, policy, segments): checks,
// small inputs read to the host and checked before any lease, the device call;
// apart from the cross-entropy Forward so that each stays readable.
#ifndef LOSSD_SERVER_POST_TRAINING_FORWARD_H_
#define LOSSD_SERVER_POST_TRAINING_FORWARD_H_

#include <functional>
#include <string>

#include "absl/status/status.h"
#include "lossd/v1/lossd.pb.h"
#include "server/admission.h"

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

}  // namespace lossd

#endif  // LOSSD_SERVER_POST_TRAINING_FORWARD_H_
