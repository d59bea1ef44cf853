// Assembles a running lossd instance (device, tensor store, service, gRPC
// server with health checking and reflection) and drains it on shutdown.
// main.cc and the in-process tests both use it.
#ifndef LOSSD_SERVER_SERVER_H_
#define LOSSD_SERVER_SERVER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "server/device.h"
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
};

// Makes the device `name` ("auto", "cpu", "cuda"). UNIMPLEMENTED for "cuda"
// until the CUDA device exists; INVALID_ARGUMENT for an unknown name.
absl::StatusOr<std::unique_ptr<Device>> CreateDevice(const std::string& name,
                                                     int threads);

// One serving lossd instance. Thread-safe.
class LossdServer {
 public:
  // Builds everything and starts serving on host:port, then writes the port
  // file (atomically). INVALID_ARGUMENT / UNIMPLEMENTED for a bad config,
  // UNAVAILABLE when the address cannot be bound, INTERNAL when the port file
  // cannot be written.
  static absl::StatusOr<std::unique_ptr<LossdServer>> Start(
      const ServerConfig& config);

  LossdServer(const LossdServer&) = delete;
  LossdServer& operator=(const LossdServer&) = delete;
  // Drains (if not yet done) and stops.
  ~LossdServer();

  int port() const { return port_; }
  std::string address() const;
  Device* device() const { return device_.get(); }
  TensorStore* store() const { return store_.get(); }
  LossdService* service() const { return service_.get(); }

  // Readiness -> NOT_SERVING, new RPCs -> UNAVAILABLE, waits up to the drain
  // timeout for running RPCs, then shuts the gRPC server down (cancelling
  // what still runs after a short grace period). Returns whether every RPC
  // finished on its own. Idempotent.
  bool Drain();

 private:
  LossdServer() = default;
  void SweepLoop();

  ServerConfig config_;
  int port_ = 0;
  std::unique_ptr<Device> device_;
  std::unique_ptr<TensorStore> store_;
  std::unique_ptr<LossdService> service_;
  std::unique_ptr<grpc::Server> server_;
  absl::Notification stop_sweeper_;
  std::thread sweeper_;
  absl::Mutex drain_mu_;
  bool drained_ ABSL_GUARDED_BY(drain_mu_) = false;
  bool drain_result_ ABSL_GUARDED_BY(drain_mu_) = false;
};

}  // namespace lossd

#endif  // LOSSD_SERVER_SERVER_H_
