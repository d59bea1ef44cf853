// LinearForward: the LM head and the cross-entropy in one call on stored
// hidden states and a stored weight (kernels/linear_cross_entropy.h), with
// the weight gradient accumulated into tensors of the caller's. Kept apart
// from service.cc, which only admits the call and hands it here.
#ifndef LOSSD_SERVER_LINEAR_EVALUATION_H_
#define LOSSD_SERVER_LINEAR_EVALUATION_H_

#include <string>

#include "absl/status/status.h"
#include "lossd/v1/lossd.pb.h"
#include "server/rpc_support.h"

namespace lossd {

// Serves one LinearForward of `tenant` (admitted by the caller): checks the
// request, resolves and leases its tensors, creates the out-of-place dX and
// missing accumulators, runs the device's LinearCrossEntropy and commits the
// results into `response`. Codes as the LinearForward RPC documents
// (proto/lossd/v1/lossd.proto); on any error nothing is changed. Thread-safe.
absl::Status RunLinearForward(RpcSupport* rpc, const std::string& tenant,
                              const lossd::v1::LinearForwardRequest& request,
                              lossd::v1::LinearForwardResponse* response);

}  // namespace lossd

#endif  // LOSSD_SERVER_LINEAR_EVALUATION_H_
