// LinearForward: the LM head and the cross-entropy in one call on stored
// hidden states and a stored weight (kernels/linear_cross_entropy.h), with
// the weight gradient accumulated into tensors of the caller's. Kept apart
// from service.cc, which only admits the call and hands it here.
#ifndef LOSSD_SERVER_LINEAR_FORWARD_H_
#define LOSSD_SERVER_LINEAR_FORWARD_H_

#include <functional>
#include <string>

#include "absl/status/status.h"
#include "lossd/v1/lossd.pb.h"
#include "server/admission.h"

namespace lossd {

// Serves one LinearForward of `tenant` (admitted by the caller): checks the
// request, resolves and leases its tensors, creates the out-of-place dX and
// missing accumulators, runs the device's LinearCrossEntropy and commits the
// results into `response`. Codes as the LinearForward RPC documents
// (proto/lossd/v1/lossd.proto); on any error nothing is changed.
//
// `cancelled` (the RPC's cancellation or passed deadline) is asked before
// the device call, between its chunks of rows and before the commit; once it
// is true the call returns CANCELLED having changed nothing: in-place dX is
// written beside the hidden states (working memory charged to the budget)
// and copied over them only at the commit, new tensors are dropped. A call
// writing an accumulator the request named cannot take back what it added,
// so it is asked only before the device call and then runs to the end (the
// accumulator gets all of the call's gradient or none). Thread-safe.
absl::Status RunLinearForward(RpcSupport* rpc, const std::string& tenant,
                              const lossd::v1::LinearForwardRequest& request,
                              lossd::v1::LinearForwardResponse* response,
                              const std::function<bool()>& cancelled);

}  // namespace lossd

#endif  // LOSSD_SERVER_LINEAR_FORWARD_H_
