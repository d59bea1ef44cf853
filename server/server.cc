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
  const TenantLimits& limits = config.tenant_limits;
  if (limits.max_bytes < 0 || limits.max_tensors < 0 ||
      limits.max_in_flight < 0) {
    return absl::InvalidArgumentError("tenant quotas must be >= 0 (0 = none)");
  }
  if (config.reload_interval <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("reload_interval must be > 0");
  }
  std::unique_ptr<LossdServer> server(new LossdServer());
  server->config_ = config;
  AuthOptions auth_options = config.auth;
  auth_options.tls_refresh = config.reload_interval;
  absl::StatusOr<std::unique_ptr<Authenticator>> authenticator =
      Authenticator::Create(auth_options);
  if (!authenticator.ok()) return authenticator.status();
  server->authenticator_ = std::move(*authenticator);
  if (limits.max_bytes > 0 || limits.max_tensors > 0 ||
      limits.max_in_flight > 0 || !config.quota_file.empty()) {
    server->quotas_ = std::make_shared<TenantQuotas>(limits);
  }
  if (!config.quota_file.empty()) {
    const absl::Status status = server->ReloadQuotas();
    if (!status.ok()) return status;
  }
  auto device = config.device_factory
                    ? config.device_factory()
                    : CreateDevice(config.device, config.threads,
                                   config.device_reserve, config.staging_bytes);
  if (!device.ok()) return device.status();
  server->device_ = std::move(*device);

  TensorStore::Options store_options;
  store_options.budget_bytes =
      config.memory_budget > 0
          ? config.memory_budget
          : static_cast<int64_t>(
                static_cast<double>(server->device_->memory().total_bytes) *
                kCpuBudgetFraction);
  if (config.memory_budget == 0 && !server->device_->host_accessible()) {
    // A GPU: what is free now minus the reserve, not a share of the total.
    store_options.budget_bytes = server->device_->DefaultBudgetBytes();
    if (store_options.budget_bytes <= 0) {
      return absl::ResourceExhaustedError(absl::StrCat(
          server->device_->name(), " has no memory left above the reserve of ",
          config.device_reserve,
          " bytes (--device_reserve); lower it or set --memory_budget"));
    }
  }
  store_options.ttl = config.ttl;
  store_options.quotas = server->quotas_;
  server->store_ =
      std::make_unique<TensorStore>(server->device_.get(), store_options);

  ServiceOptions service_options;
  service_options.default_chunk_bytes = config.chunk_bytes;
  service_options.max_chunk_bytes = config.max_message_bytes / 2;
  service_options.authenticator = server->authenticator_.get();
  service_options.quotas = server->quotas_.get();
  service_options.stripe_timeout = config.stripe_timeout;
  if (config.metrics_port >= 0) {
    server->metrics_ = std::make_unique<Metrics>(server->store_.get());
    server->UpdateConfigMetrics();
    const absl::Status status =
        server->metrics_->Serve(config.host, config.metrics_port);
    if (!status.ok()) return status;
  }
  if (config.data_port >= 0 && server->authenticator_->tls()) {
    std::fprintf(stderr,
                 "lossd: data connections are off: the main port uses TLS and "
                 "a data connection has none (uploads stay on gRPC)\n");
  } else if (config.data_port >= 0) {
    DataPlane::Options data_options;
    data_options.host = config.host;
    data_options.port = config.data_port;
    data_options.timeout = config.data_timeout;
    data_options.max_connections = config.data_max_connections;
    data_options.auth_timeout = config.data_auth_timeout;
    data_options.max_unauthenticated_per_peer =
        config.data_max_unauthenticated_per_peer;
    data_options.metrics = server->metrics_.get();
    absl::StatusOr<std::unique_ptr<DataPlane>> plane =
        DataPlane::Start(data_options);
    if (!plane.ok()) return plane.status();
    server->data_plane_ = std::move(*plane);
    service_options.data_plane = server->data_plane_.get();
  }
  absl::StatusOr<std::unique_ptr<ListPageTokens>> list_tokens =
      ListPageTokens::Create(server->store_->instance_id());
  if (!list_tokens.ok()) return list_tokens.status();
  server->list_tokens_ = std::move(*list_tokens);
  service_options.list_tokens = server->list_tokens_.get();
  server->service_ = std::make_unique<LossdService>(
      server->store_.get(), service_options, server->metrics_.get());

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  const std::string address = absl::StrCat(
      config.host.find(':') != std::string::npos ? "[" + config.host + "]"
                                                 : config.host,
      ":", config.port);
  builder.AddListeningPort(address, server->authenticator_->ServerCredentials(),
                           &server->port_);
  builder.SetMaxReceiveMessageSize(static_cast<int>(config.max_message_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(config.max_message_bytes));
  builder.RegisterService(server->service_.get());
  server->server_ = builder.BuildAndStart();
  if (server->server_ == nullptr || server->port_ == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", address));
  }
  if (config.health_port >= 0) {
    // A server of its own, so that the plaintext port offers health and
    // nothing of the lossd API.
    grpc::ServerBuilder health_builder;
    const std::string health_address = absl::StrCat(
        config.host.find(':') != std::string::npos ? "[" + config.host + "]"
                                                   : config.host,
        ":", config.health_port);
    health_builder.AddListeningPort(health_address,
                                    grpc::InsecureServerCredentials(),
                                    &server->health_port_);
    server->health_server_ = health_builder.BuildAndStart();
    if (server->health_server_ == nullptr || server->health_port_ == 0) {
      return absl::UnavailableError(
          absl::StrCat("cannot listen on ", health_address, " (health)"));
    }
  }
  server->SetServing("", true);
  server->SetServing(kReadinessService, true);
  // Die rather than limp: a device that cannot be trusted any more turns
  // readiness off at once, then main's policy ends the process.
  server->device_->SetFatalErrorHandler(
      [raw = server.get(), name = server->device_->name(),
       on_fatal = config.on_fatal_device_error](const absl::Status& status) {
        raw->SetServing(kReadinessService, false);
        std::fprintf(stderr,
                     "lossd: FATAL: device %s is unusable, readiness is "
                     "NOT_SERVING: %s\n",
                     name.c_str(), status.ToString().c_str());
        std::fflush(stderr);
        if (on_fatal) on_fatal(status);
      });

  server->sweeper_ = std::thread([raw = server.get()] { raw->SweepLoop(); });

  std::vector<ReloadSource> sources;
  const AuthOptions& auth = config.auth;
  if (server->authenticator_->tls()) {
    std::vector<std::string> paths = {auth.tls_cert_file, auth.tls_key_file};
    if (!auth.tls_client_ca_file.empty()) {
      paths.push_back(auth.tls_client_ca_file);
    }
    sources.push_back(
        {"tls", std::move(paths),
         [raw = server->authenticator_.get()] { return raw->ReloadTls(); }});
  }
  if (server->authenticator_->tokens()) {
    sources.push_back(
        {"tokens", {auth.tokens_file}, [raw = server->authenticator_.get()] {
           return raw->ReloadTokens();
         }});
  }
  if (!config.quota_file.empty()) {
    sources.push_back({"quotas", {config.quota_file}, [raw = server.get()] {
                         return raw->ReloadQuotas();
                       }});
  }
  if (server->metrics_ != nullptr) {
    for (const ReloadSource& source : sources) {
      server->metrics_->InitReload(source.name);
    }
    server->metrics_->SetInFlightSource(
        [raw = server->service_.get()] { return raw->in_flight(); });
  }
  if (!sources.empty()) {
    server->watcher_ = std::make_unique<ConfigWatcher>(
        std::move(sources), config.reload_interval,
        [raw = server.get()](const std::string& name,
                             const absl::Status& status) {
          raw->OnReload(name, status);
        });
  }

  // The metrics port file first: whoever waits for the gRPC port file then
  // finds both.
  if (server->metrics_ != nullptr && !config.metrics_port_file.empty()) {
    const absl::Status status =
        WritePortFile(config.metrics_port_file, server->metrics_->port());
    if (!status.ok()) return status;
  }
  if (server->health_server_ != nullptr && !config.health_port_file.empty()) {
    const absl::Status status =
        WritePortFile(config.health_port_file, server->health_port_);
    if (!status.ok()) return status;
  }
  if (!config.port_file.empty()) {
    const absl::Status status = WritePortFile(config.port_file, server->port_);
    if (!status.ok()) return status;
  }
  if (server->health_server_ != nullptr) {
    std::fprintf(stderr, "lossd: plaintext health on %s:%d\n",
                 config.host.c_str(), server->health_port_);
  }
  std::fprintf(stderr, "lossd: %s%s%s\n",
               server->authenticator_->mutual_tls()
                   ? "mutual TLS"
                   : (server->authenticator_->tls() ? "TLS" : "plaintext"),
               server->authenticator_->tokens() ? ", bearer tokens" : "",
               server->authenticator_->anonymous()
                   ? ", one tenant (no authentication)"
                   : "");
  if (server->metrics_ != nullptr) {
    std::fprintf(stderr, "lossd: metrics on http://%s:%d/metrics\n",
                 config.host.c_str(), server->metrics_->port());
  }
  if (server->data_plane_ != nullptr) {
    std::fprintf(stderr, "lossd: data connections on %s:%d\n",
                 config.host.c_str(), server->data_plane_->port());
  }
  std::fprintf(stderr,
               "lossd %s: serving on %s (port %d), device %s, memory budget "
               "%lld bytes, ttl %s, instance %s\n",
               service_options.version.c_str(), address.c_str(), server->port_,
               server->device_->name().c_str(),
               static_cast<long long>(store_options.budget_bytes),
               absl::FormatDuration(config.ttl).c_str(),
               server->store_->instance_id().c_str());
  std::fflush(stderr);
  return server;
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
