// What every handler of the RPC edge shares, and what the streaming reactors
// receive instead of the service (RpcSupport): the admission of each call
// (the drain count, authentication, the tenant's in-flight quota), the
// store, the striped uploads, metrics and options.
#ifndef LOSSD_SERVER_ADMISSION_H_
#define LOSSD_SERVER_ADMISSION_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "server/auth.h"
#include "server/data_plane.h"
#include "server/metrics.h"
#include "server/page_token.h"
#include "server/quota.h"
#include "server/tensor_store.h"

namespace lossd {

// UNAVAILABLE: the service drains.
absl::Status DrainingError();

struct ServiceOptions {
  int64_t default_chunk_bytes = 1 << 20;  // Download chunk when not asked
  int64_t max_chunk_bytes = 16 << 20;     // largest Download chunk allowed
  std::string version = "0.1.0";
  // The names ServerInfo.features lists; unset = every feature this build
  // serves (common/server_features.h). Set only to look like an older server
  // to clients (tests): the server still serves everything.
  std::optional<std::vector<std::string>> advertised_features;
  // Decides each call's tenant; null = every caller is kDefaultTenant. Must
  // outlive the service.
  const Authenticator* authenticator = nullptr;
  // Per-tenant in-flight RPC limits; null = none. Must outlive the service.
  TenantQuotas* quotas = nullptr;
  // A striped upload whose stripes have not all arrived this long after the
  // first is abandoned (every stripe fails ABORTED, nothing is kept).
  absl::Duration stripe_timeout = absl::Seconds(60);
  // Receives the bytes of uploads whose header has a data_token; null = the
  // server offers no data connections. Must outlive the service's RPCs.
  DataPlane* data_plane = nullptr;
  // Makes and opens List's page tokens; List fails INTERNAL without it. Must
  // outlive the service.
  const ListPageTokens* list_tokens = nullptr;
};

// The striped uploads in progress (striped_uploads.h).
class StripedUploads;

// The RPC edge's shared state: the drain count and admission, and what the
// handlers work on. Owned by the service; every reactor borrows it (it
// outlives every RPC). Thread-safe.
class RpcSupport {
 public:
  // `store` must outlive this; so must `metrics` (nullable: nothing is
  // recorded) until every RPC has finished.
  RpcSupport(TensorStore* store, ServiceOptions options, Metrics* metrics);
  RpcSupport(const RpcSupport&) = delete;
  RpcSupport& operator=(const RpcSupport&) = delete;
  ~RpcSupport();

  // From now on new RPCs fail with UNAVAILABLE; running ones continue.
  void StartDraining() ABSL_LOCKS_EXCLUDED(mu_);
  // Waits until no RPC runs or `timeout` passes; returns whether none runs.
  bool WaitForIdle(absl::Duration timeout) ABSL_LOCKS_EXCLUDED(mu_);
  int64_t in_flight() const ABSL_LOCKS_EXCLUDED(mu_);

  // Admits one RPC: counts it as running for the drain, then authenticates it
  // (its tenant goes to `*tenant`) and takes one of the tenant's in-flight
  // slots (into `*slot`, to be reset before Leave). UNAVAILABLE when
  // draining, UNAUTHENTICATED / PERMISSION_DENIED from the authenticator,
  // RESOURCE_EXHAUSTED over the tenant's in-flight quota; on error nothing is
  // counted (no Leave due). With `draining` given, a draining service admits
  // the RPC too and sets `*draining` (Upload: a stripe may join an upload
  // already started).
  absl::Status Admit(const grpc::ServerContextBase& context,
                     std::string* tenant, InFlightSlot* slot,
                     bool* draining = nullptr) ABSL_LOCKS_EXCLUDED(mu_);
  // The admitted RPC has finished.
  void Leave() ABSL_LOCKS_EXCLUDED(mu_);

  TensorStore* store() const { return store_; }
  StripedUploads* stripes() const { return stripes_.get(); }
  // Nullable.
  Metrics* metrics() const { return metrics_; }
  // Nullable: the server offers no data connections.
  DataPlane* data_plane() const { return options_.data_plane; }
  const ServiceOptions& options() const { return options_; }
  // Reports one finished RPC of `tenant` (empty: not admitted) to the metrics
  // (if any). Called before its status is sent (a client that has the status
  // sees it counted) and before Leave (a drained server has no report in
  // flight).
  void RecordRpc(const char* method, grpc::StatusCode code, absl::Time start,
                 const std::string& tenant = {}) const;

 private:
  // Counts one RPC as running for the drain; false (and nothing counted) when
  // draining, unless `draining` is given: then it is always counted and
  // `*draining` says whether the service drains.
  bool Enter(bool* draining) ABSL_LOCKS_EXCLUDED(mu_);

  TensorStore* const store_;
  const ServiceOptions options_;
  Metrics* const metrics_;
  const std::unique_ptr<StripedUploads> stripes_;

  mutable absl::Mutex mu_;
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  int64_t in_flight_ ABSL_GUARDED_BY(mu_) = 0;
};

// The admission of a streaming RPC (RpcSupport::Admit) and its undoing,
// which every reactor needs alike: admitted while the reactor is built,
// released in its OnDone. Reactor threads only; one reaction at a time.
class Admission {
 public:
  // Admits the RPC of `context` (`rpc` is borrowed; it outlives the RPC).
  // With `allow_draining`, a draining service admits it too and draining()
  // says so (an Upload stripe may still join an upload already started).
  Admission(RpcSupport* rpc, const grpc::ServerContextBase& context,
            bool allow_draining = false)
      : rpc_(rpc),
        status_(rpc->Admit(context, &tenant_, &slot_,
                           allow_draining ? &draining_ : nullptr)) {}
  Admission(const Admission&) = delete;
  Admission& operator=(const Admission&) = delete;

  // OK when admitted; otherwise Admit's error, to finish the RPC with.
  const absl::Status& status() const { return status_; }
  // The caller's tenant; empty when not admitted.
  const std::string& tenant() const { return tenant_; }
  // Admitted although the service drains (allow_draining only).
  bool draining() const { return draining_; }

  // Returns the tenant's in-flight slot, then leaves the drain count, if the
  // RPC was admitted. Call once, from OnDone, after what must go before the
  // drain completes (pending tensors, leases) is gone.
  void Release() {
    slot_ = InFlightSlot();
    if (status_.ok()) rpc_->Leave();
  }

 private:
  RpcSupport* const rpc_;
  std::string tenant_;
  InFlightSlot slot_;
  bool draining_ = false;
  const absl::Status status_;
};

}  // namespace lossd

#endif  // LOSSD_SERVER_ADMISSION_H_
