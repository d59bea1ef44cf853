// RpcSupport: the drain count and the admission of calls (admission.h).
#include "server/admission.h"

#include <utility>

#include "server/striped_uploads.h"

namespace lossd {

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

}  // namespace lossd
