// Assembles a running lossd instance (device, tensor store, service, gRPC
// server with health checking and reflection) and drains it on shutdown.
// main.cc and the in-process tests both use it.
#ifndef LOSSD_SERVER_SERVER_H_
#define LOSSD_SERVER_SERVER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "server/auth.h"
#include "server/data_plane.h"
#include "server/device.h"
#include "server/metrics.h"
#include "server/page_token.h"
#include "server/quota.h"
#include "server/reload.h"
#include "server/service.h"
#include "server/tensor_store.h"

namespace lossd {

// The gRPC service name whose health status is readiness.
inline constexpr char kReadinessService[] = "lossd.v1.Lossd";

struct ServerConfig {
  std::string host = "0.0.0.0";
  int port = 50051;             // 0 = pick a free one
  std::string device = "auto";  // auto | cpu | cuda
  int64_t memory_budget = 0;    // bytes; 0 = a fraction of device memory
  absl::Duration ttl = absl::Hours(1);
  int64_t chunk_bytes = 1 << 20;
  int threads = 0;  // compute threads of the CPU device; 0 = all cores
  absl::Duration drain_timeout = absl::Seconds(30);
  std::string port_file;  // written with the bound port once serving
  int64_t max_message_bytes = 64 << 20;
  // CUDA: device memory kept out of the automatic budget (free memory at
  // start minus this); ignored when memory_budget is set.
  int64_t device_reserve = int64_t{2} << 30;
  // CUDA: bytes of one pinned staging buffer; uploads, Evaluate blocks and
  // downloads move through two of them in pieces of this size.
  int64_t staging_bytes = int64_t{4} << 20;
  // Called after readiness went NOT_SERVING because the device became
  // unusable (a sticky CUDA error); main installs ExitAfterFatalDeviceError.
  // Unset, the server only logs and stays NOT_SERVING (tests).
  std::function<void(const absl::Status&)> on_fatal_device_error;
  // Builds the device instead of `device` when set (tests: a device that
  // fails in ways the real ones cannot be made to on demand).
  std::function<absl::StatusOr<std::unique_ptr<Device>>()> device_factory;
  // Plain-HTTP /metrics on host:metrics_port; 0 = pick a free one, -1 = off
  // (the default here, so that in-process servers do not collide; the
  // binary's --metrics_port defaults to 9090).
  int metrics_port = -1;
  std::string metrics_port_file;  // written with the bound metrics port
  // TLS, mutual TLS and bearer tokens of the main port (docs/operations.md,
  // Security). All empty: plaintext, every caller is kDefaultTenant.
  AuthOptions auth;
  // Every tenant's quota (0 = unlimited), on top of the device budget.
  TenantLimits tenant_limits;
  // Per-tenant quotas (docs/operations.md, Quotas; ParseQuotaFile), on top
  // of tenant_limits, reloaded when the file changes. Empty: none.
  std::string quota_file;
  // How often the certificate, key, client CA, tokens and quota files are
  // checked for changes (and the TLS library re-reads the checked
  // certificates, in whole seconds). LossdServer::Reload also reloads them.
  absl::Duration reload_interval = absl::Seconds(10);
  // Plaintext grpc.health.v1 only (no lossd API) on host:health_port, for
  // probes that cannot present a client certificate; 0 = pick a free one,
  // -1 = off.
  int health_port = -1;
  std::string health_port_file;  // written with the bound health port
  // A striped upload whose stripes do not all arrive within this is
  // abandoned (ServiceOptions::stripe_timeout).
  absl::Duration stripe_timeout = absl::Seconds(60);
  // Data connections (an Upload whose header carries a data_token sends its
  // bytes over plain TCP to host:data_port, into pinned staging with no gRPC
  // in between; docs/design.md): 0 = pick a free one, -1 = off (the default
  // here; the binary's --data_port defaults to 50052). Off, whatever is set,
  // when the main port uses TLS: the data connection has no TLS of its own.
  int data_port = -1;
  // A registered data transfer whose connection does not come, or sends
  // nothing, for this long fails DEADLINE_EXCEEDED.
  absl::Duration data_timeout = absl::Seconds(60);
  // Authenticated data connections served at once; further ones wait.
  int data_max_connections = 64;
  // A data connection must name a registered token within this long of
  // being accepted, or it is closed.
  absl::Duration data_auth_timeout = absl::Seconds(1);
  // Data connections of one peer address (an IPv6 one by its /64) not yet
  // authenticated; further ones are closed at once. In [64, 65536]: one
  // transfer's connections (at most 64) may all come before its header.
  int data_max_unauthenticated_per_peer = 128;
  // ServiceOptions::advertised_features: unset = every feature served; a
  // list (empty: as a server from before ServerInfo.features) makes the
  // server look older to clients while it still serves everything.
  std::optional<std::vector<std::string>> advertised_features;
};

// Makes the device `name`: "cpu"; "cuda" or "cuda:N" (FAILED_PRECONDITION
// when no such GPU is visible, UNIMPLEMENTED in a build without CUDA); "auto"
// (CUDA device 0 when built with CUDA and a GPU is visible, else the CPU).
// INVALID_ARGUMENT for an unknown name. `threads` is for the CPU device,
// `device_reserve` for the CUDA device's default budget, `staging_bytes` its
// pinned staging buffers.
absl::StatusOr<std::unique_ptr<Device>> CreateDevice(
    const std::string& name, int threads,
    int64_t device_reserve = int64_t{2} << 30,
    int64_t staging_bytes = int64_t{4} << 20);

// One serving lossd instance. Thread-safe.
class LossdServer {
 public:
  // Builds everything and starts serving on host:port (and metrics on
  // host:metrics_port), then writes the port files (atomically, metrics
  // first). INVALID_ARGUMENT / UNIMPLEMENTED for a bad config, UNAVAILABLE
  // when an address cannot be bound, INTERNAL when a port file cannot be
  // written. For the whole process, turns off OpenSSL's clean-up at exit
  // (OPENSSL_INIT_NO_ATEXIT) when no OpenSSL call came before: gRPC's threads
  // may still use OpenSSL then.
  static absl::StatusOr<std::unique_ptr<LossdServer>> Start(
      const ServerConfig& config);

  LossdServer(const LossdServer&) = delete;
  LossdServer& operator=(const LossdServer&) = delete;
  // Drains (if not yet done) and stops.
  ~LossdServer();

  int port() const { return port_; }
  // The bound data-connection port; 0 when off.
  int data_port() const;
  // Null when data connections are off.
  const DataPlane* data_plane() const { return data_plane_.get(); }
  // The bound plaintext health port; 0 when off.
  int health_port() const { return health_port_; }
  // Null when no quota is set.
  TenantQuotas* quotas() const { return quotas_.get(); }
  // The bound metrics port; 0 when metrics are off.
  int metrics_port() const {
    return metrics_ == nullptr ? 0 : metrics_->port();
  }
  // Null when metrics are off.
  Metrics* metrics() const { return metrics_.get(); }
  std::string address() const;
  Device* device() const { return device_.get(); }
  TensorStore* store() const { return store_.get(); }
  LossdService* service() const { return service_.get(); }

  // Reloads the certificate, key, client CA, tokens and quota files now
  // (SIGHUP), whether they changed or not. Each failed file is logged,
  // counted (lossd_config_reloads_total{result="failure"}) and leaves its
  // configuration in force; returns the first error.
  absl::Status Reload();
  // Null without TLS.
  const Authenticator* authenticator() const { return authenticator_.get(); }

  // Readiness -> NOT_SERVING, new RPCs -> UNAVAILABLE, waits up to the drain
  // timeout for running RPCs, then shuts the gRPC server down (cancelling
  // what still runs after a short grace period). Returns whether every RPC
  // finished on its own. Idempotent.
  bool Drain();

 private:
  LossdServer() = default;
  // The steps of Start, in its order; each error is Start's.
  // The authenticator and the tenant quotas.
  absl::Status StartAccessControl();
  // The device and the store on it, with its memory budget.
  absl::Status StartDeviceAndStore();
  // The metrics endpoint, the data plane and the service, their options
  // gathered in `*service_options`.
  absl::Status StartService(ServiceOptions* service_options);
  // The data connections' listener, unless off or beside a TLS port.
  absl::Status StartDataPlane(ServiceOptions* service_options);
  // The gRPC server on `address` and the plaintext health server.
  absl::Status StartGrpcServers(const std::string& address);
  // Readiness goes off, and the process's policy runs, on a fatal device
  // error.
  void WatchDevice();
  // Reloads the certificates, tokens and quota file as they change.
  void WatchConfigFiles();
  absl::Status WritePortFiles() const;
  // The start-up lines on stderr.
  void ReportStart(const std::string& address,
                   const std::string& version) const;
  void SweepLoop();
  // Sets `service`'s health status on the main and the health server.
  void SetServing(const char* service, bool serving);
  // Reads --quota_file into quotas_ (nothing changes on error).
  absl::Status ReloadQuotas();
  // Logs and counts a reload of `name`, and refreshes the metrics that
  // depend on configuration (tenant labels, certificate expiry).
  void OnReload(const std::string& name, const absl::Status& status);
  // The tenant label set and the certificate expiry gauges, from the
  // configuration in force.
  void UpdateConfigMetrics();

  ServerConfig config_;
  int port_ = 0;
  int health_port_ = 0;
  // Used by service_ (and quotas_ by the store's tensors, which share it):
  // declared before both.
  std::unique_ptr<Authenticator> authenticator_;
  std::shared_ptr<TenantQuotas> quotas_;
  std::unique_ptr<Device> device_;
  std::unique_ptr<TensorStore> store_;
  // Reads store_ when scraped and is used by service_: declared between them
  // so that it goes after the service and before the store.
  std::unique_ptr<Metrics> metrics_;
  // Used by service_'s uploads; stopped by Drain once no RPC runs (and
  // destroyed after service_).
  std::unique_ptr<DataPlane> data_plane_;
  // The key of List's page tokens; used by service_.
  std::unique_ptr<ListPageTokens> list_tokens_;
  std::unique_ptr<LossdService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<grpc::Server> health_server_;
  absl::Notification stop_sweeper_;
  std::thread sweeper_;
  absl::Mutex drain_mu_;
  bool drained_ ABSL_GUARDED_BY(drain_mu_) = false;
  bool drain_result_ ABSL_GUARDED_BY(drain_mu_) = false;
  // Last: it calls into authenticator_, quotas_ and metrics_, so it stops
  // before they go. Null when nothing is reloadable.
  std::unique_ptr<ConfigWatcher> watcher_;
};

// The process policy lossd's main installs as on_fatal_device_error: logs
// that the process exits, then ends it at once with kFatalDeviceExitCode
// (_Exit: no destructors, which would touch the broken CUDA context). The
// server has already logged the error and turned readiness off.
constexpr int kFatalDeviceExitCode = 3;
[[noreturn]] void ExitAfterFatalDeviceError(const absl::Status& status);

}  // namespace lossd

#endif  // LOSSD_SERVER_SERVER_H_
