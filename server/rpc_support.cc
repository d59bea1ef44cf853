// The RPC edge's shared state and helpers (rpc_support.h).
#include "server/rpc_support.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include "absl/strings/str_format.h"
#include "common/data_wire.h"
#include "common/status_macros.h"
#include "common/tensor_math.h"
#include "server/striped_uploads.h"

namespace lossd {

namespace pb = ::lossd::v1;

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  // absl and gRPC share the canonical code numbering.
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()),
                      std::string(status.message()));
}

absl::Status DrainingError() {
  return absl::UnavailableError("lossd is draining; retry on another instance");
}

RpcSupport::RpcSupport(TensorStore* store, ServiceOptions options,
                       Metrics* metrics)
    : store_(store),
      options_(std::move(options)),
      metrics_(metrics),
      stripes_(
          std::make_unique<StripedUploads>(store_, options_.stripe_timeout)) {}

RpcSupport::~RpcSupport() = default;

void RpcSupport::StartDraining() {
  absl::MutexLock lock(&mu_);
  draining_ = true;
}

bool RpcSupport::WaitForIdle(absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto idle = [this]()
                  ABSL_SHARED_LOCKS_REQUIRED(mu_) { return in_flight_ == 0; };
  return mu_.AwaitWithTimeout(absl::Condition(&idle), timeout);
}

int64_t RpcSupport::in_flight() const {
  absl::MutexLock lock(&mu_);
  return in_flight_;
}

bool RpcSupport::Enter(bool* draining) {
  absl::MutexLock lock(&mu_);
  if (draining_ && draining == nullptr) return false;
  if (draining != nullptr) *draining = draining_;
  ++in_flight_;
  return true;
}

void RpcSupport::Leave() {
  absl::MutexLock lock(&mu_);
  --in_flight_;
}

absl::Status RpcSupport::Admit(const grpc::ServerContextBase& context,
                               std::string* tenant, InFlightSlot* slot,
                               bool* draining) {
  if (!Enter(draining)) return DrainingError();
  absl::StatusOr<std::string> caller =
      options_.authenticator == nullptr
          ? std::string(kDefaultTenant)
          : options_.authenticator->Authenticate(context);
  if (!caller.ok()) {
    Leave();
    return caller.status();
  }
  if (options_.quotas != nullptr) {
    absl::StatusOr<InFlightSlot> taken = options_.quotas->EnterRpc(*caller);
    if (!taken.ok()) {
      Leave();
      return taken.status();
    }
    *slot = std::move(*taken);
  }
  *tenant = *std::move(caller);
  return absl::OkStatus();
}

void RpcSupport::RecordRpc(const char* method, grpc::StatusCode code,
                           absl::Time start, const std::string& tenant) const {
  if (metrics_ == nullptr) return;
  metrics_->ObserveRpc(method, static_cast<absl::StatusCode>(code),
                       absl::Now() - start, tenant);
}

namespace {

void ToProtoTime(absl::Time time, google::protobuf::Timestamp* out) {
  const int64_t nanos = absl::ToUnixNanos(time);
  int64_t seconds = nanos / 1000000000;
  int64_t rest = nanos % 1000000000;
  if (rest < 0) {
    rest += 1000000000;
    --seconds;
  }
  out->set_seconds(seconds);
  out->set_nanos(static_cast<int32_t>(rest));
}

}  // namespace

void ToProto(const TensorRecord& info, pb::TensorInfo* out) {
  out->set_handle(info.handle);
  out->set_dtype(static_cast<pb::DType>(info.dtype));
  for (int64_t dim : info.shape) out->add_shape(dim);
  out->set_bytes(info.bytes);
  out->set_device(info.device);
  out->set_state(static_cast<pb::TensorState>(info.state));
  out->set_tenant(info.tenant);
  out->set_label(info.label);
  ToProtoTime(info.created, out->mutable_created());
  ToProtoTime(info.last_used, out->mutable_last_used());
  out->set_pending_scale(info.pending_scale);
  out->set_pending_token_scale(info.pending_token_scale);
}

absl::Status DumpBytes(grpc::ByteBuffer* buffer, const char* message,
                       ReceivedBytes* out) {
  out->slices.clear();
  out->pieces.clear();
  if (!buffer->Dump(&out->slices).ok()) {
    return absl::InternalError(
        absl::StrCat("cannot read an ", message, "'s bytes"));
  }
  for (const grpc::Slice& slice : out->slices) {
    out->pieces.emplace_back(reinterpret_cast<const char*>(slice.begin()),
                             slice.size());
  }
  return absl::OkStatus();
}

void RefuseDataToken(const RpcSupport& rpc, const std::string& token) {
  if (!token.empty() && rpc.data_plane() != nullptr) {
    rpc.data_plane()->Refuse(token);
  }
}

absl::Status CheckDataConnections(const RpcSupport& rpc,
                                  const std::string& token, int connections,
                                  const char* otherwise) {
  if (token.empty()) {
    if (connections != 0) {
      return absl::InvalidArgumentError(
          "data_connections without a data_token");
    }
    return absl::OkStatus();
  }
  if (rpc.data_plane() == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("this server offers no data connections "
                     "(ServerInfo.data_port is 0); ",
                     otherwise));
  }
  if (token.size() != kDataTokenBytes) {
    return absl::InvalidArgumentError(
        absl::StrFormat("a data_token must be %d bytes, got %d",
                        kDataTokenBytes, token.size()));
  }
  if (connections < 0 || connections > kMaxDataConnections) {
    return absl::InvalidArgumentError(
        absl::StrFormat("data_connections must be in [0, %d], got %d",
                        kMaxDataConnections, connections));
  }
  return absl::OkStatus();
}

std::vector<DataTransfer::Range> DataRanges(int64_t elements,
                                            int64_t element_bytes,
                                            int connections) {
  std::vector<DataTransfer::Range> ranges;
  for (int i = 0; i < connections; ++i) {
    const ElementRange range = StripeElements(elements, i, connections);
    ranges.push_back({range.first * element_bytes,
                      (range.end - range.first) * element_bytes});
  }
  return ranges;
}

absl::StatusOr<std::shared_ptr<Tensor>> LookupField(TensorStore* store,
                                                    const std::string& tenant,
                                                    absl::string_view field,
                                                    const std::string& handle) {
  absl::StatusOr<std::shared_ptr<Tensor>> tensor = store->Get(tenant, handle);
  if (!tensor.ok()) {
    return absl::Status(tensor.status().code(),
                        absl::StrCat(field, ": ", tensor.status().message()));
  }
  return tensor;
}

absl::StatusOr<ReadLease> LeaseClassWeights(TensorStore* store,
                                            const std::string& tenant,
                                            const std::string& handle,
                                            int64_t vocab) {
  ASSIGN_OR_RETURN(std::shared_ptr<Tensor> weights, store->Get(tenant, handle));
  if (weights->dtype() != DType::kFloat32 || weights->shape().size() != 1 ||
      weights->shape()[0] != vocab) {
    return absl::InvalidArgumentError(absl::StrCat(
        "class_weights must be float32 [", vocab, "], got ",
        DTypeName(weights->dtype()), " ", ShapeString(weights->shape())));
  }
  if (weights->state() != TensorState::kLogits) {
    return absl::InvalidArgumentError("class_weights holds a gradient");
  }
  return store->BeginRead(std::move(weights));
}

std::function<bool()> CancellationOf(grpc::CallbackServerContext* context) {
  return [context] {
    return context->IsCancelled() ||
           std::chrono::system_clock::now() > context->deadline();
  };
}

}  // namespace lossd
