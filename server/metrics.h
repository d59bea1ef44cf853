// Prometheus metrics of one lossd instance, served on their own plain-HTTP
// port so that scrapes never compete with gRPC traffic. The service records
// into it once per RPC (or per chunk); memory gauges are read from the store
// when scraped, so no hot path updates them.
#ifndef LOSSD_SERVER_METRICS_H_
#define LOSSD_SERVER_METRICS_H_

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace prometheus {
class Counter;
class Exposer;
class Gauge;
class Registry;
template <typename T>
class Family;
class Histogram;
}  // namespace prometheus

namespace lossd {

class TensorStore;

// What crossed the network, by RPC kind (label `direction` of
// lossd_transfer_bytes_total).
enum class TransferDirection { kUpload, kDownload, kEvaluate };

// Why a data connection was closed before it presented a registered token
// (label `reason` of lossd_data_connections_refused_total): its peer address
// already held the most such connections, it sent no valid preamble and
// token within the auth timeout, or what it sent was not one.
enum class DataConnectionRefusal { kPeerLimit, kAuthTimeout, kInvalid };

// The label value of calls whose tenant is not among the configured ones
// (SetTenants), and of calls refused before they had a tenant.
inline constexpr char kOtherTenantLabel[] = "_other";
inline constexpr char kNoTenantLabel[] = "_none";

// The metrics of one instance:
//   lossd_tensor_bytes{device,tenant}, lossd_tensors{device,tenant} (gauges),
//   lossd_reserved_bytes{device}, lossd_memory_budget_bytes{device} (gauges),
//   lossd_rpcs_in_flight (gauge: admitted and not finished; see
//   SetInFlightSource),
//   lossd_rpc_total{method,code}, lossd_rpc_duration_seconds{method,code},
//   lossd_kernel_seconds_total{device,kernel},
//   lossd_kernel_runs_total{device,kernel},
//   lossd_transfer_bytes_total{direction},
//   lossd_data_connections_refused_total{reason} (peer_limit, auth_timeout,
//   invalid),
//   lossd_tenant_rpc_total{tenant,code},
//   lossd_tenant_transfer_bytes_total{tenant,direction},
//   lossd_config_reloads_total{config,result},
//   lossd_config_last_reload_successful{config} (gauge, 1 or 0),
//   lossd_config_last_reload_success_timestamp_seconds{config} (gauge),
//   lossd_tls_certificate_expiry_timestamp_seconds{certificate} (gauge).
// The `tenant` label is bounded: a configured tenant (SetTenants) is its own
// value, every other tenant is kOtherTenantLabel.
// Thread-safe: every method may be called from any thread.
class Metrics {
 public:
  // `store` (nullable: then no memory gauges) must outlive this object; it is
  // read only while a scrape or Render runs.
  explicit Metrics(const TensorStore* store);
  Metrics(const Metrics&) = delete;
  Metrics& operator=(const Metrics&) = delete;
  // Stops the HTTP endpoint (waits for a scrape in progress) first.
  ~Metrics();

  // Serves GET /metrics over plain HTTP on host:port (port 0 picks a free
  // one; see port()). INVALID_ARGUMENT for a port outside [0, 65535],
  // FAILED_PRECONDITION when already serving, UNAVAILABLE when the address
  // cannot be bound.
  absl::Status Serve(const std::string& host, int port);

  // The bound port once Serve succeeded, else 0.
  int port() const { return port_; }

  // The text exposition format, as a scrape of /metrics returns it.
  std::string Render() const;

  // One finished RPC: `method` is the lossd.v1.Lossd method name ("Upload"),
  // `code` its final status, `elapsed` from its start to its end, `tenant`
  // its caller's (empty when refused before authentication).
  void ObserveRpc(absl::string_view method, absl::StatusCode code,
                  absl::Duration elapsed, absl::string_view tenant = {});

  // One kernel run of `seconds` on `device` ("cpu", "cuda:0"); `kernel` is
  // "cross_entropy" or "scale".
  void ObserveKernel(absl::string_view device, absl::string_view kernel,
                     double seconds);

  // `bytes` of tensor data received (upload, evaluate) or sent (download),
  // for `tenant` when given.
  void AddTransferBytes(TransferDirection direction, int64_t bytes,
                        absl::string_view tenant = {});

  // One data connection closed before it presented a registered token.
  void CountRefusedDataConnection(DataConnectionRefusal reason);

  // The tenants that get a label value of their own (from configuration:
  // tokens and quota files; never from requests). Replaces the previous set;
  // series of tenants no longer configured stay until the process ends.
  void SetTenants(std::vector<std::string> tenants)
      ABSL_LOCKS_EXCLUDED(tenants_mu_);
  // The label value of `tenant`: itself when configured, kNoTenantLabel when
  // empty, else kOtherTenantLabel.
  std::string TenantLabel(absl::string_view tenant) const
      ABSL_LOCKS_EXCLUDED(tenants_mu_);

  // Configuration `config` ("tls", "tokens", "quotas") was loaded at start:
  // its reload series exist from now on (counters at 0, last reload
  // successful).
  void InitReload(absl::string_view config);
  // One reload of configuration `config`.
  void ObserveReload(absl::string_view config, bool ok);

  // What lossd_rpcs_in_flight reads when scraped (null: no such series).
  // Set it to null before what it reads goes away.
  void SetInFlightSource(std::function<int64_t()> source)
      ABSL_LOCKS_EXCLUDED(in_flight_mu_);

  // The notAfter of `certificate` ("server", "client_ca"), seconds since the
  // epoch.
  void SetCertificateExpiry(absl::string_view certificate,
                            int64_t not_after_seconds);

 private:
  class StoreCollector;

  // The two series of one (method, code); null until first observed.
  struct RpcSeries {
    prometheus::Counter* total = nullptr;
    prometheus::Histogram* duration = nullptr;
  };
  // Canonical codes 0..16.
  using RpcSeriesByCode = std::array<RpcSeries, 17>;

  // The series of (method, code), created on first use. Building the label
  // set and looking it up in the families costs more than the observation, so
  // the series pointers (stable for the registry's life) are cached.
  RpcSeries SeriesFor(absl::string_view method, absl::StatusCode code)
      ABSL_LOCKS_EXCLUDED(series_mu_);

  std::shared_ptr<prometheus::Registry> registry_;
  std::shared_ptr<StoreCollector> store_collector_;
  prometheus::Family<prometheus::Counter>* rpc_total_;
  prometheus::Family<prometheus::Histogram>* rpc_duration_;
  prometheus::Family<prometheus::Counter>* kernel_seconds_;
  prometheus::Family<prometheus::Counter>* kernel_runs_;
  prometheus::Counter* transfer_bytes_[3];
  prometheus::Counter* data_refused_[3];
  prometheus::Family<prometheus::Counter>* tenant_rpc_total_;
  prometheus::Family<prometheus::Counter>* tenant_transfer_bytes_;
  prometheus::Family<prometheus::Counter>* reloads_total_;
  prometheus::Family<prometheus::Gauge>* reload_successful_;
  prometheus::Family<prometheus::Gauge>* reload_success_time_;
  prometheus::Family<prometheus::Gauge>* certificate_expiry_;
  mutable absl::Mutex in_flight_mu_;
  std::function<int64_t()> in_flight_source_ ABSL_GUARDED_BY(in_flight_mu_);
  mutable absl::Mutex tenants_mu_;
  absl::flat_hash_set<std::string> tenants_ ABSL_GUARDED_BY(tenants_mu_);
  absl::Mutex series_mu_;
  absl::flat_hash_map<std::string, std::unique_ptr<RpcSeriesByCode>> rpc_series_
      ABSL_GUARDED_BY(series_mu_);
  int port_ = 0;
  // Last member: destroyed first, so no scrape runs while the rest goes.
  std::unique_ptr<prometheus::Exposer> exposer_;
};

}  // namespace lossd

#endif  // LOSSD_SERVER_METRICS_H_
