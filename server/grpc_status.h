// The one absl::Status -> grpc::Status mapping of the RPC edge: below it,
// everything returns absl::Status.
#ifndef LOSSD_SERVER_GRPC_STATUS_H_
#define LOSSD_SERVER_GRPC_STATUS_H_

#include "absl/status/status.h"
#include "grpcpp/grpcpp.h"

namespace lossd {

// The single absl::Status -> grpc::Status mapping (the codes are the same
// canonical codes).
grpc::Status ToGrpcStatus(const absl::Status& status);

}  // namespace lossd

#endif  // LOSSD_SERVER_GRPC_STATUS_H_
