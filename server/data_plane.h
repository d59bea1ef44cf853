// Data connections: the bytes of an Upload over plain TCP, received straight
// into the device's host windows (pinned staging on CUDA), with no gRPC in
// between. One gRPC stream carries the header with a 16-byte token and ends
// with the upload's status; the connection carries "LOSSDDC1", the token and
// exactly the tensor's bytes (lossd.v1 Upload; docs/design.md). The token is
// the connection's only credential: it comes from an authenticated RPC, is
// random, and is good for one connection.
#ifndef LOSSD_SERVER_DATA_PLANE_H_
#define LOSSD_SERVER_DATA_PLANE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/device.h"

namespace lossd {

class Metrics;

// The 8 bytes a data connection starts with, before its token.
inline constexpr char kDataConnectionMagic[] = "LOSSDDC1";
inline constexpr size_t kDataTokenBytes = 16;

// One expected transfer: `bytes` bytes into the device buffer `buffer`.
// Shared by the RPC that registered it and the connection that serves it.
class DataTransfer {
 public:
  using Done = std::function<void(const absl::Status&)>;
  DataTransfer(Device* device, void* buffer, int64_t bytes, Done done)
      : device_(device),
        buffer_(buffer),
        bytes_(bytes),
        done_(std::move(done)) {}
  DataTransfer(const DataTransfer&) = delete;
  DataTransfer& operator=(const DataTransfer&) = delete;

  // Stops the transfer: shuts its connection, if any, and returns once no
  // byte is written into the buffer any more. `done` is not called after
  // this returns unless it had already started (the caller must tell that
  // call apart itself, e.g. by who ends the RPC). Any thread; may hold a
  // lock that `done` takes (`done` runs after the writes).
  void Cancel() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  friend class DataPlane;

  // A connection claims the transfer (false: cancelled, claimed or failed).
  bool Claim(int fd) ABSL_LOCKS_EXCLUDED(mu_);
  // The claimed connection's bytes, into the device.
  absl::Status Receive(int fd, Metrics* metrics);
  // Ends the transfer with `status` and calls `done` unless cancelled. For
  // a claimed transfer, after its writes; otherwise (a timeout) it claims.
  void Finish(const absl::Status& status, bool claimed)
      ABSL_LOCKS_EXCLUDED(mu_);

  Device* const device_;
  void* const buffer_;
  const int64_t bytes_;
  const Done done_;
  absl::Mutex mu_;
  bool claimed_ ABSL_GUARDED_BY(mu_) = false;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  int fd_ ABSL_GUARDED_BY(mu_) = -1;
};

// The listener of data connections and the registry of expected transfers.
class DataPlane {
 public:
  struct Options {
    std::string host = "0.0.0.0";
    int port = 0;  // 0 = pick a free one
    // A registered transfer without a connection, a connection without its
    // preamble, or one that sends nothing, fails after this long.
    absl::Duration timeout = absl::Seconds(60);
    // Connections served at once; more are closed at once.
    int max_connections = 64;
  };

  // Listens on host:port. UNAVAILABLE when the address cannot be bound.
  // `device` and `metrics` (may be null) must outlive it.
  static absl::StatusOr<std::unique_ptr<DataPlane>> Start(Device* device,
                                                          Metrics* metrics,
                                                          Options options);
  DataPlane(const DataPlane&) = delete;
  DataPlane& operator=(const DataPlane&) = delete;
  ~DataPlane() { Stop(); }

  // Stops listening, fails what is registered (UNAVAILABLE), ends every
  // connection and waits for them; later Expects fail. Idempotent.
  void Stop() ABSL_LOCKS_EXCLUDED(mu_);

  int port() const { return port_; }
  // Transfers whose bytes all arrived, since the start.
  int64_t completed() const { return completed_.load(); }

  // Expects a connection with `token` for `bytes` (> 0) bytes into the device
  // buffer `buffer`; `done` gets the transfer's outcome (from a connection's
  // thread or the sweeper), once, unless the transfer is cancelled first.
  // INVALID_ARGUMENT for a token that is not kDataTokenBytes long or is
  // already registered.
  absl::StatusOr<std::shared_ptr<DataTransfer>> Expect(const std::string& token,
                                                       void* buffer,
                                                       int64_t bytes,
                                                       DataTransfer::Done done)
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Expected {
    std::shared_ptr<DataTransfer> transfer;
    absl::Time deadline;
  };

  DataPlane(Device* device, Metrics* metrics, Options options)
      : device_(device), metrics_(metrics), options_(std::move(options)) {}
  void AcceptLoop();
  void Serve(int fd);
  // Removes and returns the transfer of `token`, waiting up to `deadline`
  // for it to be registered (the header may arrive after the connection).
  std::shared_ptr<DataTransfer> Take(const std::string& token,
                                     absl::Time deadline)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Fails the registered transfers whose connection is overdue (all of them
  // with `all`).
  void Expire(bool all) ABSL_LOCKS_EXCLUDED(mu_);

  Device* const device_;
  Metrics* const metrics_;
  const Options options_;
  absl::Mutex stop_mu_;  // Stop runs once at a time
  int listen_fd_ = -1;
  int wake_fd_ = -1;  // an eventfd that ends AcceptLoop
  int port_ = 0;
  std::thread acceptor_;
  std::atomic<int64_t> completed_{0};
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, Expected> expected_ ABSL_GUARDED_BY(mu_);
  int connections_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<int, bool> open_fds_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace lossd

#endif  // LOSSD_SERVER_DATA_PLANE_H_
