// The Upload RPC's reactor: one tensor's bytes as chunks on the stream, as
// one stripe of a striped upload (striped_uploads.h), or over data
// connections (data_plane.h), into a pending tensor of the store.
#ifndef LOSSD_SERVER_UPLOAD_REACTOR_H_
#define LOSSD_SERVER_UPLOAD_REACTOR_H_

#include "grpcpp/grpcpp.h"
#include "server/admission.h"

namespace lossd {

// Upload is served on raw ByteBuffers rather than parsed UploadRequests (the
// service installs the handler by the method's name): a chunk's bytes then go
// from gRPC's receive slices straight to the device, one copy, where the
// generated handler would first copy each chunk into a std::string. `rpc`
// outlives the RPC; gRPC owns the reactor.
grpc::ServerReadReactor<grpc::ByteBuffer>* NewUploadReactor(
    RpcSupport* rpc, grpc::CallbackServerContext* context,
    grpc::ByteBuffer* response);

}  // namespace lossd

#endif  // LOSSD_SERVER_UPLOAD_REACTOR_H_
