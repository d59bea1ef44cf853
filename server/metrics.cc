// Metrics: prometheus-cpp families, the store collector that reads memory
// gauges at scrape time, and the civetweb-based exposer (which reports
// failures by exception; they are caught here and become absl::Status).
#include "server/metrics.h"

#include <exception>
#include <map>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "prometheus/client_metric.h"
#include "prometheus/collectable.h"
#include "prometheus/counter.h"
#include "prometheus/exposer.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/metric_family.h"
#include "prometheus/registry.h"
#include "prometheus/text_serializer.h"
#include "server/device.h"
#include "server/tensor_store.h"

namespace lossd {
namespace {

// RPCs last from ~100 us (Describe) to a minute (a large upload or Evaluate):
// roughly 1-2.5-5 per decade over that range.
const std::vector<double>& RpcBuckets() {
  static const std::vector<double>* const kBuckets = new std::vector<double>{
      0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
      0.25,   0.5,     1.0,    2.5,   5.0,    10.0,  20.0, 40.0,  60.0};
  return *kBuckets;
}

prometheus::ClientMetric GaugeSample(
    std::vector<prometheus::ClientMetric::Label> labels, double value) {
  prometheus::ClientMetric sample;
  sample.label = std::move(labels);
  sample.gauge.value = value;
  return sample;
}

prometheus::MetricFamily GaugeFamily(std::string name, std::string help) {
  prometheus::MetricFamily family;
  family.name = std::move(name);
  family.help = std::move(help);
  family.type = prometheus::MetricType::Gauge;
  return family;
}

const char* DirectionName(TransferDirection direction) {
  switch (direction) {
    case TransferDirection::kUpload:
      return "upload";
    case TransferDirection::kDownload:
      return "download";
    case TransferDirection::kEvaluate:
      return "evaluate";
  }
  return "unknown";
}

}  // namespace

// Reads the store's memory figures when scraped: tenants come and go, and
// computing the gauges on demand keeps the store's hot paths free of metrics.
// Tenants that are not configured are summed under one label value.
class Metrics::StoreCollector final : public prometheus::Collectable {
 public:
  StoreCollector(const TensorStore* store, const Metrics* metrics)
      : store_(store), metrics_(metrics) {}

  std::vector<prometheus::MetricFamily> Collect() const override {
    std::vector<prometheus::MetricFamily> families;
    if (store_ == nullptr) return families;
    const std::string device = store_->device()->name();
    const StoreStats stats = store_->Stats();
    prometheus::MetricFamily tensor_bytes =
        GaugeFamily("lossd_tensor_bytes", "Bytes of tensors held");
    prometheus::MetricFamily tensors =
        GaugeFamily("lossd_tensors", "Tensors held");
    std::map<std::string, TenantUsage> by_label;
    for (const TenantUsage& usage : store_->UsageByTenant()) {
      TenantUsage& sum = by_label[metrics_->TenantLabel(usage.tenant)];
      sum.bytes += usage.bytes;
      sum.tensors += usage.tensors;
    }
    for (const auto& [label, usage] : by_label) {
      tensor_bytes.metric.push_back(
          GaugeSample({{"device", device}, {"tenant", label}},
                      static_cast<double>(usage.bytes)));
      tensors.metric.push_back(
          GaugeSample({{"device", device}, {"tenant", label}},
                      static_cast<double>(usage.tensors)));
    }
    prometheus::MetricFamily reserved = GaugeFamily(
        "lossd_reserved_bytes",
        "Bytes charged to the memory budget: tensors held, uploads in "
        "progress and Forward outputs being computed");
    reserved.metric.push_back(GaugeSample(
        {{"device", device}}, static_cast<double>(stats.used_bytes)));
    prometheus::MetricFamily budget =
        GaugeFamily("lossd_memory_budget_bytes",
                    "Bytes the tensors may use (--memory_budget)");
    budget.metric.push_back(GaugeSample(
        {{"device", device}}, static_cast<double>(stats.budget_bytes)));
    {
      absl::MutexLock lock(&metrics_->in_flight_mu_);
      if (metrics_->in_flight_source_) {
        prometheus::MetricFamily in_flight =
            GaugeFamily("lossd_rpcs_in_flight",
                        "lossd.v1.Lossd RPCs admitted and not yet finished "
                        "(running or waiting for the device)");
        in_flight.metric.push_back(GaugeSample(
            {}, static_cast<double>(metrics_->in_flight_source_())));
        families.push_back(std::move(in_flight));
      }
    }
    families.push_back(std::move(tensor_bytes));
    families.push_back(std::move(tensors));
    families.push_back(std::move(reserved));
    families.push_back(std::move(budget));
    return families;
  }

 private:
  const TensorStore* const store_;
  const Metrics* const metrics_;
};

Metrics::Metrics(const TensorStore* store)
    : registry_(std::make_shared<prometheus::Registry>()),
      store_collector_(std::make_shared<StoreCollector>(store, this)) {
  rpc_total_ = &prometheus::BuildCounter()
                    .Name("lossd_rpc_total")
                    .Help("Finished lossd.v1.Lossd RPCs by method and status")
                    .Register(*registry_);
  rpc_duration_ =
      &prometheus::BuildHistogram()
           .Name("lossd_rpc_duration_seconds")
           .Help("Time from the start of an RPC to its final status")
           .Register(*registry_);
  kernel_seconds_ = &prometheus::BuildCounter()
                         .Name("lossd_kernel_seconds_total")
                         .Help("Time spent in device kernels")
                         .Register(*registry_);
  kernel_runs_ = &prometheus::BuildCounter()
                      .Name("lossd_kernel_runs_total")
                      .Help("Device kernel runs")
                      .Register(*registry_);
  auto& transfer = prometheus::BuildCounter()
                       .Name("lossd_transfer_bytes_total")
                       .Help(
                           "Tensor bytes received (upload, evaluate) or "
                           "sent (download) over gRPC")
                       .Register(*registry_);
  for (TransferDirection direction :
       {TransferDirection::kUpload, TransferDirection::kDownload,
        TransferDirection::kEvaluate}) {
    transfer_bytes_[static_cast<int>(direction)] =
        &transfer.Add({{"direction", DirectionName(direction)}});
  }
  auto& refused =
      prometheus::BuildCounter()
          .Name("lossd_data_connections_refused_total")
          .Help(
              "Data connections closed before they presented a registered "
              "token")
          .Register(*registry_);
  data_refused_[static_cast<int>(DataConnectionRefusal::kPeerLimit)] =
      &refused.Add({{"reason", "peer_limit"}});
  data_refused_[static_cast<int>(DataConnectionRefusal::kAuthTimeout)] =
      &refused.Add({{"reason", "auth_timeout"}});
  data_refused_[static_cast<int>(DataConnectionRefusal::kInvalid)] =
      &refused.Add({{"reason", "invalid"}});
  tenant_rpc_total_ =
      &prometheus::BuildCounter()
           .Name("lossd_tenant_rpc_total")
           .Help("Finished lossd.v1.Lossd RPCs by tenant and status")
           .Register(*registry_);
  tenant_transfer_bytes_ = &prometheus::BuildCounter()
                                .Name("lossd_tenant_transfer_bytes_total")
                                .Help("Tensor bytes moved, by tenant")
                                .Register(*registry_);
  reloads_total_ = &prometheus::BuildCounter()
                        .Name("lossd_config_reloads_total")
                        .Help(
                            "Reloads of a configuration file by result "
                            "(a failed one leaves the old configuration)")
                        .Register(*registry_);
  reload_successful_ = &prometheus::BuildGauge()
                            .Name("lossd_config_last_reload_successful")
                            .Help(
                                "1 when the last reload of the "
                                "configuration succeeded, 0 when it failed")
                            .Register(*registry_);
  reload_success_time_ =
      &prometheus::BuildGauge()
           .Name("lossd_config_last_reload_success_timestamp_seconds")
           .Help("When the configuration in force was loaded")
           .Register(*registry_);
  certificate_expiry_ =
      &prometheus::BuildGauge()
           .Name("lossd_tls_certificate_expiry_timestamp_seconds")
           .Help("notAfter of the certificate in force, seconds since epoch")
           .Register(*registry_);
  SetTenants({});
}

Metrics::~Metrics() { exposer_.reset(); }

absl::Status Metrics::Serve(const std::string& host, int port) {
  if (port < 0 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics port ", port, " is outside [0, 65535]"));
  }
  if (exposer_ != nullptr) {
    return absl::FailedPreconditionError("metrics are already served");
  }
  const std::string address = absl::StrCat(
      host.find(':') != std::string::npos ? "[" + host + "]" : host, ":", port);
  std::unique_ptr<prometheus::Exposer> exposer;
  try {
    // One thread: scrapes are rare and cheap; more would only hold memory.
    exposer = std::make_unique<prometheus::Exposer>(address, 1);
  } catch (const std::exception& error) {
    return absl::UnavailableError(
        absl::StrCat("cannot serve metrics on ", address, ": ", error.what()));
  }
  const std::vector<int> ports = exposer->GetListeningPorts();
  if (ports.empty() || ports[0] <= 0) {
    return absl::UnavailableError(
        absl::StrCat("metrics on ", address, ": no listening port"));
  }
  exposer->RegisterCollectable(registry_);
  exposer->RegisterCollectable(store_collector_);
  port_ = ports[0];
  exposer_ = std::move(exposer);
  return absl::OkStatus();
}

std::string Metrics::Render() const {
  std::vector<prometheus::MetricFamily> families = registry_->Collect();
  for (prometheus::MetricFamily& family : store_collector_->Collect()) {
    families.push_back(std::move(family));
  }
  return prometheus::TextSerializer().Serialize(families);
}

Metrics::RpcSeries Metrics::SeriesFor(absl::string_view method,
                                      absl::StatusCode code) {
  const int index = static_cast<int>(code);
  const bool canonical =
      index >= 0 && index < static_cast<int>(RpcSeriesByCode().size());
  if (canonical) {
    absl::ReaderMutexLock lock(&series_mu_);
    auto it = rpc_series_.find(method);
    if (it != rpc_series_.end() && (*it->second)[index].total != nullptr) {
      return (*it->second)[index];
    }
  }
  const prometheus::Labels labels = {{"method", std::string(method)},
                                     {"code", absl::StatusCodeToString(code)}};
  RpcSeries series;
  series.total = &rpc_total_->Add(labels);
  series.duration = &rpc_duration_->Add(labels, RpcBuckets());
  if (canonical) {
    absl::MutexLock lock(&series_mu_);
    std::unique_ptr<RpcSeriesByCode>& codes = rpc_series_[std::string(method)];
    if (codes == nullptr) codes = std::make_unique<RpcSeriesByCode>();
    (*codes)[index] = series;
  }
  return series;
}

void Metrics::ObserveRpc(absl::string_view method, absl::StatusCode code,
                         absl::Duration elapsed, absl::string_view tenant) {
  const RpcSeries series = SeriesFor(method, code);
  series.total->Increment();
  series.duration->Observe(absl::ToDoubleSeconds(elapsed));
  tenant_rpc_total_
      ->Add({{"tenant", TenantLabel(tenant)},
             {"code", absl::StatusCodeToString(code)}})
      .Increment();
}

void Metrics::SetTenants(std::vector<std::string> tenants) {
  absl::flat_hash_set<std::string> set(tenants.begin(), tenants.end());
  // Anonymous callers are this tenant: always a label of its own.
  set.insert(kDefaultTenant);
  absl::MutexLock lock(&tenants_mu_);
  tenants_ = std::move(set);
}

std::string Metrics::TenantLabel(absl::string_view tenant) const {
  if (tenant.empty()) return kNoTenantLabel;
  absl::ReaderMutexLock lock(&tenants_mu_);
  return tenants_.contains(tenant) ? std::string(tenant) : kOtherTenantLabel;
}

void Metrics::InitReload(absl::string_view config) {
  const std::string name(config);
  reloads_total_->Add({{"config", name}, {"result", "success"}});
  reloads_total_->Add({{"config", name}, {"result", "failure"}});
  reload_successful_->Add({{"config", name}}).Set(1.0);
  reload_success_time_->Add({{"config", name}})
      .Set(absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch()));
}

void Metrics::SetInFlightSource(std::function<int64_t()> source) {
  absl::MutexLock lock(&in_flight_mu_);
  in_flight_source_ = std::move(source);
}

void Metrics::ObserveReload(absl::string_view config, bool ok) {
  const std::string name(config);
  reloads_total_
      ->Add({{"config", name}, {"result", ok ? "success" : "failure"}})
      .Increment();
  reload_successful_->Add({{"config", name}}).Set(ok ? 1.0 : 0.0);
  if (ok) {
    reload_success_time_->Add({{"config", name}})
        .Set(absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch()));
  }
}

void Metrics::SetCertificateExpiry(absl::string_view certificate,
                                   int64_t not_after_seconds) {
  certificate_expiry_->Add({{"certificate", std::string(certificate)}})
      .Set(static_cast<double>(not_after_seconds));
}

void Metrics::ObserveKernel(absl::string_view device, absl::string_view kernel,
                            double seconds) {
  const prometheus::Labels labels = {{"device", std::string(device)},
                                     {"kernel", std::string(kernel)}};
  kernel_seconds_->Add(labels).Increment(seconds);
  kernel_runs_->Add(labels).Increment();
}

void Metrics::AddTransferBytes(TransferDirection direction, int64_t bytes,
                               absl::string_view tenant) {
  transfer_bytes_[static_cast<int>(direction)]->Increment(
      static_cast<double>(bytes));
  if (tenant.empty()) return;
  tenant_transfer_bytes_
      ->Add({{"tenant", TenantLabel(tenant)},
             {"direction", DirectionName(direction)}})
      .Increment(static_cast<double>(bytes));
}

void Metrics::CountRefusedDataConnection(DataConnectionRefusal reason) {
  data_refused_[static_cast<int>(reason)]->Increment();
}

}  // namespace lossd
