// The RPC edge: lossd.v1.Lossd on gRPC's callback API. The unary RPCs are
// served here; the streaming ones by their reactors (upload_reactor.h,
// download_reactor.h, evaluate_reactor.h), which share the service's
// RpcSupport (admission.h: admission, the store, metrics).
#ifndef LOSSD_SERVER_SERVICE_H_
#define LOSSD_SERVER_SERVICE_H_

#include <cstdint>
#include <functional>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "lossd/v1/lossd.grpc.pb.h"
#include "server/admission.h"
#include "server/grpc_status.h"
#include "server/metrics.h"
#include "server/tensor_store.h"

namespace lossd {

// The lossd.v1.Lossd service. Thread-safe: gRPC calls it from many threads.
// `store` must outlive the service; so must `metrics` (nullable: nothing is
// recorded) until every RPC has finished.
class LossdService final : public lossd::v1::Lossd::CallbackService {
 public:
  LossdService(TensorStore* store, ServiceOptions options,
               Metrics* metrics = nullptr);
  LossdService(const LossdService&) = delete;
  LossdService& operator=(const LossdService&) = delete;
  ~LossdService() override;

  // From now on new RPCs fail with UNAVAILABLE; running ones continue.
  void StartDraining();
  // Waits until no RPC runs or `timeout` passes; returns whether none runs.
  bool WaitForIdle(absl::Duration timeout);
  int64_t in_flight() const;

  // The index of lossd.v1.Lossd's method `name` among the service's methods
  // (what gRPC's raw handlers are installed by); -1 for no such method.
  static int MethodIndex(absl::string_view name);

  grpc::ServerReadReactor<lossd::v1::UploadRequest>* Upload(
      grpc::CallbackServerContext* context,
      lossd::v1::UploadResponse* response) override;
  grpc::ServerWriteReactor<lossd::v1::DownloadResponse>* Download(
      grpc::CallbackServerContext* context,
      const lossd::v1::DownloadRequest* request) override;
  grpc::ServerUnaryReactor* Describe(grpc::CallbackServerContext* context,
                                     const lossd::v1::DescribeRequest* request,
                                     lossd::v1::TensorInfo* response) override;
  grpc::ServerUnaryReactor* List(grpc::CallbackServerContext* context,
                                 const lossd::v1::ListRequest* request,
                                 lossd::v1::ListResponse* response) override;
  grpc::ServerUnaryReactor* Release(
      grpc::CallbackServerContext* context,
      const lossd::v1::ReleaseRequest* request,
      lossd::v1::ReleaseResponse* response) override;
  grpc::ServerUnaryReactor* Forward(
      grpc::CallbackServerContext* context,
      const lossd::v1::ForwardRequest* request,
      lossd::v1::ForwardResponse* response) override;
  grpc::ServerUnaryReactor* Backward(
      grpc::CallbackServerContext* context,
      const lossd::v1::BackwardRequest* request,
      lossd::v1::BackwardResponse* response) override;
  grpc::ServerUnaryReactor* LinearForward(
      grpc::CallbackServerContext* context,
      const lossd::v1::LinearForwardRequest* request,
      lossd::v1::LinearForwardResponse* response) override;
  grpc::ServerReadReactor<lossd::v1::EvaluateRequest>* Evaluate(
      grpc::CallbackServerContext* context,
      lossd::v1::EvaluateResponse* response) override;
  grpc::ServerUnaryReactor* GetServerInfo(
      grpc::CallbackServerContext* context,
      const lossd::v1::GetServerInfoRequest* request,
      lossd::v1::ServerInfo* response) override;

 private:
  using RawReactorFactory = grpc::ServerReadReactor<
      grpc::ByteBuffer>* (*)(RpcSupport* rpc,
                             grpc::CallbackServerContext* context,
                             grpc::ByteBuffer* response);
  // Serves the client-streaming method `method` on raw ByteBuffers with the
  // reactors `factory` makes, in place of the generated (parsing) handler.
  void InstallRawClientStreaming(const char* method, RawReactorFactory factory);
  // Serves the unary (server-streaming) method `method` with `serve`, and
  // answers a request that does not parse with UnparsedRequestError
  // (unparsed_request.h) instead of gRPC's bare UNIMPLEMENTED. Every method
  // with a parsed request is installed through one of these.
  template <typename Request, typename Response>
  void InstallUnary(const char* method,
                    grpc::ServerUnaryReactor* (LossdService::*serve)(
                        grpc::CallbackServerContext*, const Request*,
                        Response*));
  template <typename Request, typename Response>
  void InstallServerStreaming(
      const char* method,
      grpc::ServerWriteReactor<Response>* (LossdService::*serve)(
          grpc::CallbackServerContext*, const Request*));

  // Serves one unary RPC `method`: admits it (drain, authentication, tenant
  // quota), runs `body(tenant)` -> absl::Status for the caller's tenant,
  // records it in the metrics and finishes it with body's status, or with
  // admission's error without running `body`.
  template <typename Body>
  grpc::ServerUnaryReactor* ServeUnary(const char* method,
                                       grpc::CallbackServerContext* context,
                                       const Body& body);

  void FillServerInfo(lossd::v1::ServerInfo* info) const;
  absl::Status DoDescribe(const std::string& tenant,
                          const lossd::v1::DescribeRequest& request,
                          lossd::v1::TensorInfo* response);
  absl::Status DoList(const std::string& tenant,
                      const lossd::v1::ListRequest& request,
                      lossd::v1::ListResponse* response);
  absl::Status DoRelease(const std::string& tenant,
                         const lossd::v1::ReleaseRequest& request,
                         lossd::v1::ReleaseResponse* response);
  // `cancelled`: the RPC's cancellation (or passed deadline), asked before
  // a materializing pass.
  absl::Status DoBackward(const std::string& tenant,
                          const lossd::v1::BackwardRequest& request,
                          lossd::v1::BackwardResponse* response,
                          const std::function<bool()>& cancelled);

  RpcSupport rpc_;
};

}  // namespace lossd

#endif  // LOSSD_SERVER_SERVICE_H_
