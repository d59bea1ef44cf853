// The Evaluate RPC's reactor: the header's checks, then the row blocks from
// the stream, or frames over data connections (data_plane.h), into the lanes
// of the evaluation engine (evaluation.h); the response is their sum in block
// order.
#ifndef LOSSD_SERVER_EVALUATE_REACTOR_H_
#define LOSSD_SERVER_EVALUATE_REACTOR_H_

#include "grpcpp/grpcpp.h"
#include "server/admission.h"

namespace lossd {

// Evaluate is served on raw ByteBuffers too (the service installs the handler
// by the method's name): a block's logits go from gRPC's receive slices to
// the device in one copy (pinned staging on CUDA), where parsing would first
// copy the whole block into a std::string. `rpc` outlives the RPC; gRPC owns
// the reactor.
grpc::ServerReadReactor<grpc::ByteBuffer>* NewEvaluateReactor(
    RpcSupport* rpc, grpc::CallbackServerContext* context,
    grpc::ByteBuffer* response);

}  // namespace lossd

#endif  // LOSSD_SERVER_EVALUATE_REACTOR_H_
