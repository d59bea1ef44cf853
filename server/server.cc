// LossdServer: wiring of device, store, service and gRPC server; drain.
#include "server/server.h"

#include <openssl/crypto.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/data_wire.h"
#include "common/status_macros.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "server/cpu_device.h"
#ifdef LOSSD_HAVE_CUDA
#include "server/cuda_device.h"
#endif

namespace lossd {
namespace {

// The CPU shares its memory with everything else on the host.
constexpr double kCpuBudgetFraction = 0.5;
// After the drain timeout, running RPCs get this long before cancellation.
constexpr absl::Duration kShutdownGrace = absl::Seconds(1);
constexpr absl::Duration kMaxSweepPeriod = absl::Seconds(10);

absl::Status WritePortFile(const std::string& path, int port) {
  // Written then renamed so that a reader never sees a partial file.
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << port << "\n";
    out.close();
    if (!out) {
      return absl::InternalError(absl::StrCat("cannot write ", tmp));
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::InternalError(
        absl::StrCat("cannot rename ", tmp, " to ", path));
  }
  return absl::OkStatus();
}

// The ports that -1 turns off.
absl::Status CheckOptionalPorts(const ServerConfig& config) {
  if (config.metrics_port < -1 || config.metrics_port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics_port ", config.metrics_port,
                     " is outside [-1, 65535] (-1 = off)"));
  }
  if (config.health_port < -1 || config.health_port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("health_port ", config.health_port,
                     " is outside [-1, 65535] (-1 = off)"));
  }
  if (config.data_port < -1 || config.data_port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(
        "data_port ", config.data_port, " is outside [-1, 65535] (-1 = off)"));
  }
  return absl::OkStatus();
}

absl::Status CheckDataConnectionLimits(const ServerConfig& config) {
  if (config.data_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("data_timeout must be > 0");
  }
  if (config.data_max_connections < 1 || config.data_max_connections > 4096) {
    return absl::InvalidArgumentError(absl::StrCat("data_max_connections ",
                                                   config.data_max_connections,
                                                   " is outside [1, 4096]"));
  }
  if (config.data_auth_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("data_auth_timeout must be > 0");
  }
  if (config.data_max_unauthenticated_per_peer < kMaxDataConnections ||
      config.data_max_unauthenticated_per_peer > 65536) {
    return absl::InvalidArgumentError(
        absl::StrCat("data_max_unauthenticated_per_peer ",
                     config.data_max_unauthenticated_per_peer, " is outside [",
                     kMaxDataConnections, ", 65536]"));
  }
  return absl::OkStatus();
}

// INVALID_ARGUMENT naming the first field of `config` out of its range.
absl::Status CheckConfig(const ServerConfig& config) {
  if (config.port < 0 || config.port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("port ", config.port, " is outside [0, 65535]"));
  }
  if (config.chunk_bytes <= 0 ||
      config.chunk_bytes > config.max_message_bytes / 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk_bytes ", config.chunk_bytes, " is outside [1, ",
                     config.max_message_bytes / 2, "]"));
  }
  if (config.ttl <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("ttl must be > 0");
  }
  if (config.memory_budget < 0) {
    return absl::InvalidArgumentError("memory_budget must be >= 0");
  }
  RETURN_IF_ERROR(CheckOptionalPorts(config));
  RETURN_IF_ERROR(CheckDataConnectionLimits(config));
  const TenantLimits& limits = config.tenant_limits;
  if (limits.max_bytes < 0 || limits.max_tensors < 0 ||
      limits.max_in_flight < 0) {
    return absl::InvalidArgumentError("tenant quotas must be >= 0 (0 = none)");
  }
  if (config.reload_interval <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("reload_interval must be > 0");
  }
  return absl::OkStatus();
}

// "host:port", an IPv6 host in brackets.
std::string HostPort(const std::string& host, int port) {
  return absl::StrCat(
      host.find(':') != std::string::npos ? "[" + host + "]" : host, ":", port);
}

}  // namespace

absl::StatusOr<std::unique_ptr<Device>> CreateDevice(const std::string& name,
                                                     int threads,
                                                     int64_t device_reserve,
                                                     int64_t staging_bytes) {
  if (name == "cpu") return std::unique_ptr<Device>(new CpuDevice(threads));
  const bool cuda = name == "cuda" || absl::StartsWith(name, "cuda:");
  if (name != "auto" && !cuda) {
    return absl::InvalidArgumentError(absl::StrCat(
        "unknown device '", name, "' (auto, cpu, cuda or cuda:N)"));
  }
#ifdef LOSSD_HAVE_CUDA
  CudaDeviceOptions options;
  options.reserve_bytes = device_reserve;
  options.staging_bytes = static_cast<size_t>(staging_bytes);
  if (absl::StartsWith(name, "cuda:") &&
      !absl::SimpleAtoi(name.substr(5), &options.ordinal)) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown device '", name, "' (cuda:N with N a number)"));
  }
  if (cuda || CudaDeviceCount() > 0) {
    absl::StatusOr<std::unique_ptr<CudaDevice>> device =
        CudaDevice::Create(options);
    if (!device.ok()) return device.status();
    return std::unique_ptr<Device>(std::move(*device));
  }
#else
  (void)device_reserve;
  (void)staging_bytes;
  if (cuda) {
    return absl::UnimplementedError(
        "this lossd was built without CUDA (LOSSD_CUDA=OFF); use --device=cpu");
  }
#endif
  return std::unique_ptr<Device>(new CpuDevice(threads));
}

absl::StatusOr<std::unique_ptr<LossdServer>> LossdServer::Start(
    const ServerConfig& config) {
  // gRPC may still be shutting down when the process exits: when its last
  // object goes on one of its own threads (a server's callback completion
  // queue does), a detached thread joins its executor threads, and nothing
  // waits for it. OpenSSL's clean-up at exit deletes its thread-local keys
  // under those threads, so a thread that ran a TLS handshake and exits after
  // it never frees its error queue (LeakSanitizer reports 904 bytes from
  // CRYPTO_zalloc). OpenSSL's state is left to the end of the process
  // instead. Only the process's first OpenSSL initialisation can say so:
  // this comes before any (RAND_bytes below, certificates, handshakes).
  if (OPENSSL_init_crypto(OPENSSL_INIT_NO_ATEXIT, nullptr) != 1) {
    return absl::InternalError("cannot initialise OpenSSL");
  }
  RETURN_IF_ERROR(CheckConfig(config));
  std::unique_ptr<LossdServer> server(new LossdServer());
  server->config_ = config;
  RETURN_IF_ERROR(server->StartAccessControl());
  RETURN_IF_ERROR(server->StartDeviceAndStore());
  ServiceOptions service_options;
  RETURN_IF_ERROR(server->StartService(&service_options));
  const std::string address = HostPort(config.host, config.port);
  RETURN_IF_ERROR(server->StartGrpcServers(address));
  server->SetServing("", true);
  server->SetServing(kReadinessService, true);
  server->WatchDevice();
  server->sweeper_ = std::thread([raw = server.get()] { raw->SweepLoop(); });
  server->WatchConfigFiles();
  RETURN_IF_ERROR(server->WritePortFiles());
  server->ReportStart(address, service_options.version);
  return server;
}

absl::Status LossdServer::StartAccessControl() {
  AuthOptions auth_options = config_.auth;
  auth_options.tls_refresh = config_.reload_interval;
  ASSIGN_OR_RETURN(authenticator_, Authenticator::Create(auth_options));
  const TenantLimits& limits = config_.tenant_limits;
  if (limits.max_bytes > 0 || limits.max_tensors > 0 ||
      limits.max_in_flight > 0 || !config_.quota_file.empty()) {
    quotas_ = std::make_shared<TenantQuotas>(limits);
  }
  if (!config_.quota_file.empty()) RETURN_IF_ERROR(ReloadQuotas());
  return absl::OkStatus();
}

absl::Status LossdServer::StartDeviceAndStore() {
  ASSIGN_OR_RETURN(device_, config_.device_factory
                                ? config_.device_factory()
                                : CreateDevice(config_.device, config_.threads,
                                               config_.device_reserve,
                                               config_.staging_bytes));
  TensorStore::Options store_options;
  store_options.budget_bytes =
      config_.memory_budget > 0
          ? config_.memory_budget
          : static_cast<int64_t>(
                static_cast<double>(device_->memory().total_bytes) *
                kCpuBudgetFraction);
  if (config_.memory_budget == 0 && !device_->host_accessible()) {
    // A GPU: what is free now minus the reserve, not a share of the total.
    store_options.budget_bytes = device_->DefaultBudgetBytes();
    if (store_options.budget_bytes <= 0) {
      return absl::ResourceExhaustedError(absl::StrCat(
          device_->name(), " has no memory left above the reserve of ",
          config_.device_reserve,
          " bytes (--device_reserve); lower it or set --memory_budget"));
    }
  }
  store_options.ttl = config_.ttl;
  store_options.quotas = quotas_;
  store_ = std::make_unique<TensorStore>(device_.get(), store_options);
  return absl::OkStatus();
}

absl::Status LossdServer::StartDataPlane(ServiceOptions* service_options) {
  if (config_.data_port < 0) return absl::OkStatus();
  if (authenticator_->tls()) {
    std::fprintf(stderr,
                 "lossd: data connections are off: the main port uses TLS and "
                 "a data connection has none (uploads stay on gRPC)\n");
    return absl::OkStatus();
  }
  DataPlane::Options data_options;
  data_options.host = config_.host;
  data_options.port = config_.data_port;
  data_options.timeout = config_.data_timeout;
  data_options.max_connections = config_.data_max_connections;
  data_options.auth_timeout = config_.data_auth_timeout;
  data_options.max_unauthenticated_per_peer =
      config_.data_max_unauthenticated_per_peer;
  data_options.metrics = metrics_.get();
  ASSIGN_OR_RETURN(data_plane_, DataPlane::Start(data_options));
  service_options->data_plane = data_plane_.get();
  return absl::OkStatus();
}

absl::Status LossdServer::StartService(ServiceOptions* service_options) {
  service_options->default_chunk_bytes = config_.chunk_bytes;
  service_options->max_chunk_bytes = config_.max_message_bytes / 2;
  service_options->authenticator = authenticator_.get();
  service_options->quotas = quotas_.get();
  service_options->stripe_timeout = config_.stripe_timeout;
  service_options->advertised_features = config_.advertised_features;
  if (config_.metrics_port >= 0) {
    metrics_ = std::make_unique<Metrics>(store_.get());
    UpdateConfigMetrics();
    RETURN_IF_ERROR(metrics_->Serve(config_.host, config_.metrics_port));
  }
  RETURN_IF_ERROR(StartDataPlane(service_options));
  ASSIGN_OR_RETURN(list_tokens_, ListPageTokens::Create(store_->instance_id()));
  service_options->list_tokens = list_tokens_.get();
  service_ = std::make_unique<LossdService>(store_.get(), *service_options,
                                            metrics_.get());
  return absl::OkStatus();
}

absl::Status LossdServer::StartGrpcServers(const std::string& address) {
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(address, authenticator_->ServerCredentials(),
                           &port_);
  builder.SetMaxReceiveMessageSize(static_cast<int>(config_.max_message_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(config_.max_message_bytes));
  builder.RegisterService(service_.get());
  server_ = builder.BuildAndStart();
  if (server_ == nullptr || port_ == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", address));
  }
  if (config_.health_port < 0) return absl::OkStatus();
  // A server of its own, so that the plaintext port offers health and
  // nothing of the lossd API.
  grpc::ServerBuilder health_builder;
  const std::string health_address =
      HostPort(config_.host, config_.health_port);
  health_builder.AddListeningPort(
      health_address, grpc::InsecureServerCredentials(), &health_port_);
  health_server_ = health_builder.BuildAndStart();
  if (health_server_ == nullptr || health_port_ == 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", health_address, " (health)"));
  }
  return absl::OkStatus();
}

void LossdServer::WatchDevice() {
  // Die rather than limp: a device that cannot be trusted any more turns
  // readiness off at once, then main's policy ends the process.
  device_->SetFatalErrorHandler(
      [raw = this, name = device_->name(),
       on_fatal = config_.on_fatal_device_error](const absl::Status& status) {
        raw->SetServing(kReadinessService, false);
        std::fprintf(stderr,
                     "lossd: FATAL: device %s is unusable, readiness is "
                     "NOT_SERVING: %s\n",
                     name.c_str(), status.ToString().c_str());
        std::fflush(stderr);
        if (on_fatal) on_fatal(status);
      });
}

void LossdServer::WatchConfigFiles() {
  std::vector<ReloadSource> sources;
  const AuthOptions& auth = config_.auth;
  if (authenticator_->tls()) {
    std::vector<std::string> paths = {auth.tls_cert_file, auth.tls_key_file};
    if (!auth.tls_client_ca_file.empty()) {
      paths.push_back(auth.tls_client_ca_file);
    }
    sources.push_back({"tls", std::move(paths), [raw = authenticator_.get()] {
                         return raw->ReloadTls();
                       }});
  }
  if (authenticator_->tokens()) {
    sources.push_back(
        {"tokens", {auth.tokens_file}, [raw = authenticator_.get()] {
           return raw->ReloadTokens();
         }});
  }
  if (!config_.quota_file.empty()) {
    sources.push_back({"quotas", {config_.quota_file}, [raw = this] {
                         return raw->ReloadQuotas();
                       }});
  }
  if (metrics_ != nullptr) {
    for (const ReloadSource& source : sources) {
      metrics_->InitReload(source.name);
    }
    metrics_->SetInFlightSource(
        [raw = service_.get()] { return raw->in_flight(); });
  }
  if (!sources.empty()) {
    watcher_ = std::make_unique<ConfigWatcher>(
        std::move(sources), config_.reload_interval,
        [raw = this](const std::string& name, const absl::Status& status) {
          raw->OnReload(name, status);
        });
  }
}

absl::Status LossdServer::WritePortFiles() const {
  // The metrics port file first: whoever waits for the gRPC port file then
  // finds both.
  if (metrics_ != nullptr && !config_.metrics_port_file.empty()) {
    RETURN_IF_ERROR(WritePortFile(config_.metrics_port_file, metrics_->port()));
  }
  if (health_server_ != nullptr && !config_.health_port_file.empty()) {
    RETURN_IF_ERROR(WritePortFile(config_.health_port_file, health_port_));
  }
  if (!config_.port_file.empty()) {
    RETURN_IF_ERROR(WritePortFile(config_.port_file, port_));
  }
  return absl::OkStatus();
}

void LossdServer::ReportStart(const std::string& address,
                              const std::string& version) const {
  if (health_server_ != nullptr) {
    std::fprintf(stderr, "lossd: plaintext health on %s:%d\n",
                 config_.host.c_str(), health_port_);
  }
  std::fprintf(
      stderr, "lossd: %s%s%s\n",
      authenticator_->mutual_tls()
          ? "mutual TLS"
          : (authenticator_->tls() ? "TLS" : "plaintext"),
      authenticator_->tokens() ? ", bearer tokens" : "",
      authenticator_->anonymous() ? ", one tenant (no authentication)" : "");
  if (metrics_ != nullptr) {
    std::fprintf(stderr, "lossd: metrics on http://%s:%d/metrics\n",
                 config_.host.c_str(), metrics_->port());
  }
  if (data_plane_ != nullptr) {
    std::fprintf(stderr, "lossd: data connections on %s:%d\n",
                 config_.host.c_str(), data_plane_->port());
  }
  std::fprintf(stderr,
               "lossd %s: serving on %s (port %d), device %s, memory budget "
               "%lld bytes, ttl %s, instance %s\n",
               version.c_str(), address.c_str(), port_, device_->name().c_str(),
               static_cast<long long>(store_->Stats().budget_bytes),
               absl::FormatDuration(config_.ttl).c_str(),
               store_->instance_id().c_str());
  std::fflush(stderr);
}

void LossdServer::SetServing(const char* service, bool serving) {
  server_->GetHealthCheckService()->SetServingStatus(service, serving);
  if (health_server_ != nullptr) {
    health_server_->GetHealthCheckService()->SetServingStatus(service, serving);
  }
}

absl::Status LossdServer::ReloadQuotas() {
  std::ifstream in(config_.quota_file, std::ios::binary);
  if (!in) {
    return absl::InvalidArgumentError(
        absl::StrCat("--quota_file: cannot read '", config_.quota_file, "'"));
  }
  std::ostringstream text;
  text << in.rdbuf();
  absl::StatusOr<QuotaConfig> parsed =
      ParseQuotaFile(text.str(), config_.tenant_limits);
  if (!parsed.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--quota_file '", config_.quota_file,
                     "': ", parsed.status().message()));
  }
  quotas_->SetLimits(parsed->defaults, std::move(parsed->overrides));
  return absl::OkStatus();
}

absl::Status LossdServer::Reload() {
  if (watcher_ == nullptr) return absl::OkStatus();
  return watcher_->Reload();
}

void LossdServer::OnReload(const std::string& name,
                           const absl::Status& status) {
  if (status.ok()) {
    std::fprintf(stderr, "lossd: reloaded %s\n", name.c_str());
  } else {
    std::fprintf(stderr,
                 "lossd: reload of %s failed, the configuration in force "
                 "stays: %s\n",
                 name.c_str(), status.ToString().c_str());
  }
  std::fflush(stderr);
  if (metrics_ == nullptr) return;
  // Labels and expiry first: whoever sees the reload counted sees them.
  if (status.ok()) UpdateConfigMetrics();
  metrics_->ObserveReload(name, status.ok());
}

void LossdServer::UpdateConfigMetrics() {
  if (metrics_ == nullptr) return;
  std::vector<std::string> tenants = authenticator_->TokenTenants();
  if (quotas_ != nullptr) {
    for (std::string& tenant : quotas_->ConfiguredTenants()) {
      tenants.push_back(std::move(tenant));
    }
  }
  metrics_->SetTenants(std::move(tenants));
  if (authenticator_->tls()) {
    metrics_->SetCertificateExpiry("server", authenticator_->cert_not_after());
  }
  if (authenticator_->mutual_tls()) {
    metrics_->SetCertificateExpiry("client_ca",
                                   authenticator_->client_ca_not_after());
  }
}

std::string LossdServer::address() const {
  return absl::StrCat("127.0.0.1:", port_);
}

void LossdServer::SweepLoop() {
  const absl::Duration period = std::min(kMaxSweepPeriod, config_.ttl / 4);
  while (!stop_sweeper_.WaitForNotificationWithTimeout(period)) {
    store_->ExpireIdle();
  }
}

int LossdServer::data_port() const {
  return data_plane_ == nullptr ? 0 : data_plane_->port();
}

bool LossdServer::Drain() {
  absl::MutexLock lock(&drain_mu_);
  if (drained_) return drain_result_;
  drained_ = true;
  // Draining starts before readiness drops, so that whoever sees NOT_SERVING
  // also sees new RPCs refused.
  service_->StartDraining();
  SetServing(kReadinessService, false);
  drain_result_ = service_->WaitForIdle(config_.drain_timeout);
  server_->GetHealthCheckService()->Shutdown();
  if (health_server_ != nullptr) {
    health_server_->GetHealthCheckService()->Shutdown();
  }
  server_->Shutdown(absl::ToChronoTime(absl::Now() + kShutdownGrace));
  server_->Wait();
  // Every Upload has ended, so no transfer is running: stop listening.
  if (data_plane_ != nullptr) data_plane_->Stop();
  if (health_server_ != nullptr) {
    health_server_->Shutdown(absl::ToChronoTime(absl::Now()));
    health_server_->Wait();
  }
  stop_sweeper_.Notify();
  if (sweeper_.joinable()) sweeper_.join();
  return drain_result_;
}

LossdServer::~LossdServer() {
  // Scrapes may run until metrics_ goes, after the service.
  if (metrics_ != nullptr) metrics_->SetInFlightSource(nullptr);
  // The handler refers to the health service, which goes before the device.
  if (device_ != nullptr) device_->SetFatalErrorHandler(nullptr);
  if (server_ != nullptr) Drain();
  if (!stop_sweeper_.HasBeenNotified()) stop_sweeper_.Notify();
  if (sweeper_.joinable()) sweeper_.join();
}

void ExitAfterFatalDeviceError(const absl::Status& status) {
  std::fprintf(stderr,
               "lossd: exiting (status %d) after a fatal device error: %s\n",
               kFatalDeviceExitCode, std::string(status.message()).c_str());
  std::fflush(stderr);
  std::_Exit(kFatalDeviceExitCode);
}

}  // namespace lossd
