// The Download RPC's reactor: a stored tensor's elements (a range of them,
// converted, the pending factor applied) as chunks on the stream, or its
// bytes over data connections (data_plane.h) with only the header on the
// stream.
#ifndef LOSSD_SERVER_DOWNLOAD_REACTOR_H_
#define LOSSD_SERVER_DOWNLOAD_REACTOR_H_

#include "grpcpp/grpcpp.h"
#include "lossd/v1/lossd.pb.h"
#include "server/admission.h"

namespace lossd {

// A reactor for `request` (read during the call only). `rpc` outlives the
// RPC; gRPC owns the reactor.
grpc::ServerWriteReactor<lossd::v1::DownloadResponse>* NewDownloadReactor(
    RpcSupport* rpc, grpc::CallbackServerContext* context,
    const lossd::v1::DownloadRequest& request);

}  // namespace lossd

#endif  // LOSSD_SERVER_DOWNLOAD_REACTOR_H_
