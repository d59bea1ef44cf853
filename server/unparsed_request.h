// A request whose bytes are not the method's protobuf message: gRPC's callback
// handlers answer it UNIMPLEMENTED with no message, as if the method did not
// exist; lossd answers INTERNAL (what grpc++'s synchronous handlers and the
// other gRPC implementations return) and says which method and message.
#ifndef LOSSD_SERVER_UNPARSED_REQUEST_H_
#define LOSSD_SERVER_UNPARSED_REQUEST_H_

#include <memory>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/impl/codegen/server_callback_handlers.h"

namespace lossd {

// INTERNAL: the request of `method` ("Describe") did not parse as
// `message` (its full name, "lossd.v1.DescribeRequest").
inline absl::Status UnparsedRequestError(absl::string_view method,
                                         absl::string_view message) {
  return absl::InternalError(absl::StrCat(
      "lossd.v1.Lossd/", method, ": the request is not a valid ", message,
      " (its bytes do not parse as that protobuf message)"));
}

// A method handler that serves parsed requests with `serve` and answers
// unparsable ones with `refuse`: both are gRPC's callback handlers of one
// method (Handler: CallbackUnaryHandler or CallbackServerStreamingHandler),
// `serve` parses the request. `refuse` gets the call as if the request had
// parsed; its reactor must not read the request (it may be partly parsed or
// absent) and finishes the RPC with an error.
template <typename Handler>
class RefuseUnparsedHandler final : public grpc::internal::MethodHandler {
 public:
  RefuseUnparsedHandler(std::unique_ptr<Handler> serve,
                        std::unique_ptr<Handler> refuse)
      : serve_(std::move(serve)), refuse_(std::move(refuse)) {}

  void RunHandler(const HandlerParameter& param) override {
    if (param.status.ok()) {
      serve_->RunHandler(param);
      return;
    }
    // The generated handlers run a reactor only for an OK status; the
    // message holder `serve_` allocated (internal_data) is the same type.
    refuse_->RunHandler(HandlerParameter(
        param.call, param.server_context, param.request, grpc::Status::OK,
        param.internal_data, param.call_requester));
  }

  void* Deserialize(grpc_call* call, grpc_byte_buffer* request,
                    grpc::Status* status, void** handler_data) override {
    return serve_->Deserialize(call, request, status, handler_data);
  }

 private:
  const std::unique_ptr<Handler> serve_;
  const std::unique_ptr<Handler> refuse_;
};

// A server-streaming reactor that only finishes its RPC with `status`.
template <typename Response>
class RefusingWriteReactor final : public grpc::ServerWriteReactor<Response> {
 public:
  explicit RefusingWriteReactor(const grpc::Status& status) {
    this->Finish(status);
  }
  void OnDone() override { delete this; }
};

}  // namespace lossd

#endif  // LOSSD_SERVER_UNPARSED_REQUEST_H_
