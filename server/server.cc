// LossdServer: wiring of device, store, service and gRPC server; drain.
#include "server/server.h"

#include <cstdio>
#include <fstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "server/cpu_device.h"

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
                                                     int threads) {
  if (name == "cpu" || name == "auto") {
    // auto: the CUDA device does not exist yet, so the CPU is what there is.
    return std::unique_ptr<Device>(new CpuDevice(threads));
  }
  if (name == "cuda") {
    return absl::UnimplementedError("CUDA device not built yet");
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown device '", name, "' (auto, cpu or cuda)"));
}

absl::StatusOr<std::unique_ptr<LossdServer>> LossdServer::Start(
    const ServerConfig& config) {
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
  std::unique_ptr<LossdServer> server(new LossdServer());
  server->config_ = config;
  auto device = CreateDevice(config.device, config.threads);
  if (!device.ok()) return device.status();
  server->device_ = std::move(*device);

  TensorStore::Options store_options;
  store_options.budget_bytes =
      config.memory_budget > 0
          ? config.memory_budget
          : static_cast<int64_t>(
                static_cast<double>(server->device_->memory().total_bytes) *
                kCpuBudgetFraction);
  store_options.ttl = config.ttl;
  server->store_ =
      std::make_unique<TensorStore>(server->device_.get(), store_options);

  ServiceOptions service_options;
  service_options.default_chunk_bytes = config.chunk_bytes;
  service_options.max_chunk_bytes = config.max_message_bytes / 2;
  server->service_ =
      std::make_unique<LossdService>(server->store_.get(), service_options);

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  const std::string address = absl::StrCat(
      config.host.find(':') != std::string::npos ? "[" + config.host + "]"
                                                 : config.host,
      ":", config.port);
  builder.AddListeningPort(address, grpc::InsecureServerCredentials(),
                           &server->port_);
  builder.SetMaxReceiveMessageSize(static_cast<int>(config.max_message_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(config.max_message_bytes));
  builder.RegisterService(server->service_.get());
  server->server_ = builder.BuildAndStart();
  if (server->server_ == nullptr || server->port_ == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", address));
  }
  grpc::HealthCheckServiceInterface* health =
      server->server_->GetHealthCheckService();
  health->SetServingStatus("", true);
  health->SetServingStatus(kReadinessService, true);

  server->sweeper_ = std::thread([raw = server.get()] { raw->SweepLoop(); });

  if (!config.port_file.empty()) {
    const absl::Status status = WritePortFile(config.port_file, server->port_);
    if (!status.ok()) return status;
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

std::string LossdServer::address() const {
  return absl::StrCat("127.0.0.1:", port_);
}

void LossdServer::SweepLoop() {
  const absl::Duration period = std::min(kMaxSweepPeriod, config_.ttl / 4);
  while (!stop_sweeper_.WaitForNotificationWithTimeout(period)) {
    store_->ExpireIdle();
  }
}

bool LossdServer::Drain() {
  absl::MutexLock lock(&drain_mu_);
  if (drained_) return drain_result_;
  drained_ = true;
  // Draining starts before readiness drops, so that whoever sees NOT_SERVING
  // also sees new RPCs refused.
  service_->StartDraining();
  server_->GetHealthCheckService()->SetServingStatus(kReadinessService, false);
  drain_result_ = service_->WaitForIdle(config_.drain_timeout);
  server_->GetHealthCheckService()->Shutdown();
  server_->Shutdown(absl::ToChronoTime(absl::Now() + kShutdownGrace));
  server_->Wait();
  stop_sweeper_.Notify();
  if (sweeper_.joinable()) sweeper_.join();
  return drain_result_;
}

LossdServer::~LossdServer() {
  if (server_ != nullptr) Drain();
  if (!stop_sweeper_.HasBeenNotified()) stop_sweeper_.Notify();
  if (sweeper_.joinable()) sweeper_.join();
}

}  // namespace lossd
