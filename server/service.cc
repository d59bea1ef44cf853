// LossdService: the unary RPCs (request validation, protobuf <-> store and
// device types) and the installation of the streaming RPCs' reactors.
#include "server/service.h"

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/server_features.h"
#include "common/status_macros.h"
#include "server/cancellation.h"
#include "server/download_reactor.h"
#include "server/evaluate_reactor.h"
#include "server/forward.h"
#include "server/linear_forward.h"
#include "server/page_token.h"
#include "server/tensor_info_proto.h"
#include "server/unparsed_request.h"
#include "server/upload_reactor.h"
#include "server/validation.h"

namespace lossd {

namespace pb = ::lossd::v1;

namespace {

// Finishes a unary RPC with `status` (the caller left the drain count).
grpc::ServerUnaryReactor* FinishUnary(grpc::CallbackServerContext* context,
                                      const absl::Status& status) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

// The generated (parsing) Upload and Evaluate handlers are replaced by raw
// ones; this reactor only answers if that ever stops being so.
template <typename Request>
class UnreachableReadReactor final : public grpc::ServerReadReactor<Request> {
 public:
  UnreachableReadReactor() {
    this->Finish(
        grpc::Status(grpc::StatusCode::INTERNAL, "served by the raw handler"));
  }
  void OnDone() override { delete this; }
};

}  // namespace

LossdService::LossdService(TensorStore* store, ServiceOptions options,
                           Metrics* metrics)
    : rpc_(store, std::move(options), metrics) {
  // Upload and Evaluate are served on raw ByteBuffers: the chunks' and
  // blocks' bytes go from gRPC's receive slices to the device without a parse
  // (upload_reactor.h, evaluate_reactor.h).
  InstallRawClientStreaming("Upload", &NewUploadReactor);
  InstallRawClientStreaming("Evaluate", &NewEvaluateReactor);
  InstallServerStreaming("Download", &LossdService::Download);
  InstallUnary("Describe", &LossdService::Describe);
  InstallUnary("List", &LossdService::List);
  InstallUnary("Release", &LossdService::Release);
  InstallUnary("Forward", &LossdService::Forward);
  InstallUnary("Backward", &LossdService::Backward);
  InstallUnary("GetServerInfo", &LossdService::GetServerInfo);
  InstallUnary("LinearForward", &LossdService::LinearForward);
}

LossdService::~LossdService() = default;

void LossdService::StartDraining() { rpc_.StartDraining(); }

bool LossdService::WaitForIdle(absl::Duration timeout) {
  return rpc_.WaitForIdle(timeout);
}

int64_t LossdService::in_flight() const { return rpc_.in_flight(); }

int LossdService::MethodIndex(absl::string_view name) {
  // The generated service adds its methods in the proto's order, so a
  // method's index among them is its index in the service's descriptor.
  const google::protobuf::ServiceDescriptor* service =
      pb::DescribeRequest::descriptor()->file()->FindServiceByName("Lossd");
  if (service == nullptr) return -1;
  const google::protobuf::MethodDescriptor* method =
      service->FindMethodByName(std::string(name));
  return method == nullptr ? -1 : method->index();
}

void LossdService::InstallRawClientStreaming(const char* method,
                                             RawReactorFactory factory) {
  const int index = MethodIndex(method);
  // Unknown (never: the names are the proto's): the generated handler stays,
  // and answers INTERNAL (UnreachableReadReactor).
  if (index < 0) return;
  MarkMethodRawCallback(
      index,
      new grpc::internal::CallbackClientStreamingHandler<grpc::ByteBuffer,
                                                         grpc::ByteBuffer>(
          [this, factory](grpc::CallbackServerContext* context,
                          grpc::ByteBuffer* response) {
            return factory(&rpc_, context, response);
          }));
}

template <typename Request, typename Response>
void LossdService::InstallUnary(
    const char* method,
    grpc::ServerUnaryReactor* (LossdService::*serve)(
        grpc::CallbackServerContext*, const Request*, Response*)) {
  const int index = MethodIndex(method);
  if (index < 0) return;  // never: the names are the proto's
  using Handler = grpc::internal::CallbackUnaryHandler<Request, Response>;
  MarkMethodCallback(
      index,
      new RefuseUnparsedHandler<Handler>(
          std::make_unique<Handler>(
              [this, serve](grpc::CallbackServerContext* context,
                            const Request* request, Response* response) {
                return (this->*serve)(context, request, response);
              }),
          std::make_unique<Handler>(
              [this, method](grpc::CallbackServerContext* context,
                             const Request* /*unparsed*/,
                             Response* /*response*/) {
                rpc_.RecordRpc(method, grpc::StatusCode::INTERNAL, absl::Now());
                return FinishUnary(
                    context, UnparsedRequestError(
                                 method, Request::descriptor()->full_name()));
              })));
}

template <typename Request, typename Response>
void LossdService::InstallServerStreaming(
    const char* method,
    grpc::ServerWriteReactor<Response>* (LossdService::*serve)(
        grpc::CallbackServerContext*, const Request*)) {
  const int index = MethodIndex(method);
  if (index < 0) return;  // never: the names are the proto's
  using Handler =
      grpc::internal::CallbackServerStreamingHandler<Request, Response>;
  MarkMethodCallback(
      index, new RefuseUnparsedHandler<Handler>(
                 std::make_unique<Handler>(
                     [this, serve](grpc::CallbackServerContext* context,
                                   const Request* request) {
                       return (this->*serve)(context, request);
                     }),
                 std::make_unique<Handler>(
                     [this, method](grpc::CallbackServerContext* /*context*/,
                                    const Request* /*unparsed*/)
                         -> grpc::ServerWriteReactor<Response>* {
                       rpc_.RecordRpc(method, grpc::StatusCode::INTERNAL,
                                      absl::Now());
                       return new RefusingWriteReactor<Response>(
                           ToGrpcStatus(UnparsedRequestError(
                               method, Request::descriptor()->full_name())));
                     })));
}

void LossdService::FillServerInfo(pb::ServerInfo* info) const {
  const StoreStats stats = rpc_.store()->Stats();
  info->set_instance_id(rpc_.store()->instance_id());
  info->set_device(rpc_.store()->device()->name());
  info->set_budget_bytes(stats.budget_bytes);
  info->set_used_bytes(stats.used_bytes);
  info->set_free_bytes(stats.budget_bytes - stats.used_bytes);
  info->set_tensors(stats.tensors);
  info->set_version(rpc_.options().version);
  if (rpc_.options().advertised_features.has_value()) {
    for (const std::string& feature : *rpc_.options().advertised_features) {
      info->add_features(feature);
    }
  } else {
    const bool post_training = rpc_.store()->device()->serves_post_training();
    for (const char* feature : kServedFeatures) {
      if (feature != kFeaturePostTraining || post_training) {
        info->add_features(feature);
      }
    }
  }
  if (rpc_.data_plane() != nullptr) {
    info->set_data_port(rpc_.data_plane()->port());
  }
}

template <typename Body>
grpc::ServerUnaryReactor* LossdService::ServeUnary(
    const char* method, grpc::CallbackServerContext* context,
    const Body& body) {
  const absl::Time start = absl::Now();
  std::string tenant;
  absl::Status status;
  {
    // The tenant's in-flight slot goes back before the drain count does.
    InFlightSlot slot;
    status = rpc_.Admit(*context, &tenant, &slot);
    if (!status.ok()) {
      rpc_.RecordRpc(method, static_cast<grpc::StatusCode>(status.code()),
                     start, tenant);
      return FinishUnary(context, status);
    }
    status = body(tenant);
  }
  rpc_.RecordRpc(method, static_cast<grpc::StatusCode>(status.code()), start,
                 tenant);
  rpc_.Leave();
  return FinishUnary(context, status);
}

grpc::ServerReadReactor<pb::UploadRequest>* LossdService::Upload(
    grpc::CallbackServerContext* /*context*/,
    pb::UploadResponse* /*response*/) {
  return new UnreachableReadReactor<pb::UploadRequest>();
}

grpc::ServerWriteReactor<pb::DownloadResponse>* LossdService::Download(
    grpc::CallbackServerContext* context, const pb::DownloadRequest* request) {
  return NewDownloadReactor(&rpc_, context, *request);
}

grpc::ServerReadReactor<pb::EvaluateRequest>* LossdService::Evaluate(
    grpc::CallbackServerContext* /*context*/,
    pb::EvaluateResponse* /*response*/) {
  return new UnreachableReadReactor<pb::EvaluateRequest>();
}

grpc::ServerUnaryReactor* LossdService::Describe(
    grpc::CallbackServerContext* context, const pb::DescribeRequest* request,
    pb::TensorInfo* response) {
  return ServeUnary("Describe", context, [&](const std::string& tenant) {
    return DoDescribe(tenant, *request, response);
  });
}

grpc::ServerUnaryReactor* LossdService::List(
    grpc::CallbackServerContext* context, const pb::ListRequest* request,
    pb::ListResponse* response) {
  return ServeUnary("List", context, [&](const std::string& tenant) {
    return DoList(tenant, *request, response);
  });
}

grpc::ServerUnaryReactor* LossdService::Release(
    grpc::CallbackServerContext* context, const pb::ReleaseRequest* request,
    pb::ReleaseResponse* response) {
  return ServeUnary("Release", context, [&](const std::string& tenant) {
    return DoRelease(tenant, *request, response);
  });
}

grpc::ServerUnaryReactor* LossdService::Forward(
    grpc::CallbackServerContext* context, const pb::ForwardRequest* request,
    pb::ForwardResponse* response) {
  const std::function<bool()> cancelled = CancellationOf(context);
  return ServeUnary("Forward", context, [&](const std::string& tenant) {
    return RunForward(&rpc_, tenant, *request, response, cancelled);
  });
}

grpc::ServerUnaryReactor* LossdService::Backward(
    grpc::CallbackServerContext* context, const pb::BackwardRequest* request,
    pb::BackwardResponse* response) {
  const std::function<bool()> cancelled = CancellationOf(context);
  return ServeUnary("Backward", context, [&](const std::string& tenant) {
    return DoBackward(tenant, *request, response, cancelled);
  });
}

grpc::ServerUnaryReactor* LossdService::LinearForward(
    grpc::CallbackServerContext* context,
    const pb::LinearForwardRequest* request,
    pb::LinearForwardResponse* response) {
  // Asked between the call's chunks of rows: a passed deadline or a
  // cancellation stops the work.
  const std::function<bool()> cancelled = CancellationOf(context);
  return ServeUnary("LinearForward", context, [&](const std::string& tenant) {
    return RunLinearForward(&rpc_, tenant, *request, response, cancelled);
  });
}

grpc::ServerUnaryReactor* LossdService::GetServerInfo(
    grpc::CallbackServerContext* context,
    const pb::GetServerInfoRequest* /*request*/, pb::ServerInfo* response) {
  return ServeUnary("GetServerInfo", context,
                    [&](const std::string& /*tenant*/) {
                      FillServerInfo(response);
                      return absl::OkStatus();
                    });
}

absl::Status LossdService::DoDescribe(const std::string& tenant,
                                      const pb::DescribeRequest& request,
                                      pb::TensorInfo* response) {
  ASSIGN_OR_RETURN(std::shared_ptr<Tensor> tensor,
                   rpc_.store()->Get(tenant, request.handle()));
  ToProto(tensor->Info(), response);
  return absl::OkStatus();
}

absl::Status LossdService::DoList(const std::string& tenant,
                                  const pb::ListRequest& request,
                                  pb::ListResponse* response) {
  ASSIGN_OR_RETURN(const ListSpec spec, ValidateListRequest(request));
  const ListPageTokens* tokens = rpc_.options().list_tokens;
  if (tokens == nullptr) return absl::InternalError("no page-token key");
  const ListTokenScope scope{tenant, request.page_size()};
  ListPosition after;
  if (!request.page_token().empty()) {
    ASSIGN_OR_RETURN(after, tokens->Open(request.page_token(), scope));
  }
  bool more = false;
  const std::vector<TensorRecord> page = rpc_.store()->List(
      tenant, after, static_cast<size_t>(spec.page_size), &more);
  for (const TensorRecord& info : page) {
    ToProto(info, response->add_tensors());
  }
  if (more && !page.empty()) {
    ListPosition last;
    last.created_unix_nanos = absl::ToUnixNanos(page.back().created);
    last.handle = page.back().handle;
    response->set_next_page_token(tokens->Make(scope, last));
  }
  FillServerInfo(response->mutable_server());
  return absl::OkStatus();
}

absl::Status LossdService::DoRelease(const std::string& tenant,
                                     const pb::ReleaseRequest& request,
                                     pb::ReleaseResponse* response) {
  ASSIGN_OR_RETURN(const int64_t bytes,
                   rpc_.store()->Release(tenant, request.handle()));
  response->set_released_bytes(bytes);
  return absl::OkStatus();
}

absl::Status LossdService::DoBackward(const std::string& tenant,
                                      const pb::BackwardRequest& request,
                                      pb::BackwardResponse* response,
                                      const std::function<bool()>& cancelled) {
  ASSIGN_OR_RETURN(GradOutput grad_output, ValidateBackwardRequest(request));
  const double scale = grad_output.scale;
  std::vector<float> token_scale = std::move(grad_output.token_scale);
  ASSIGN_OR_RETURN(std::shared_ptr<Tensor> tensor,
                   rpc_.store()->Get(tenant, request.gradient()));
  // A materializing pass scales the gradient in place and is not
  // interrupted (half a pass could not be told from a whole one); it is not
  // started for a call already cancelled.
  if (request.materialize() && cancelled()) {
    return absl::CancelledError("Backward cancelled");
  }
  bool kernel_launched = false;
  const auto start = std::chrono::steady_clock::now();
  RETURN_IF_ERROR(
      rpc_.store()->RecordGradOutput(tensor, scale, std::move(token_scale),
                                     request.materialize(), &kernel_launched));
  if (kernel_launched && rpc_.metrics() != nullptr) {
    // Includes the store's bookkeeping around the pass, which is tiny next to
    // a pass over N·V elements.
    const std::chrono::duration<double> elapsed =
        std::chrono::steady_clock::now() - start;
    rpc_.metrics()->ObserveKernel(tensor->device()->name(), "scale",
                                  elapsed.count());
  }
  ToProto(tensor->Info(), response->mutable_tensor());
  response->set_kernel_launched(kernel_launched);
  return absl::OkStatus();
}

}  // namespace lossd
