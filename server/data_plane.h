// Data connections: the bytes of an Upload, a Download or an Evaluate over
// plain TCP, with no gRPC in between: an upload's received straight into the
// device's host windows (pinned staging on CUDA), a download's sent from the
// device, an evaluation's frames read into its lanes (evaluation.h). The RPC
// carries the header with a 16-byte token and ends with the transfer's
// status; each of its K connections opens with the 28-byte preamble
// (common/data_wire.h: "LOSSDDC1", the token, its index), then carries its
// part (lossd.v1; docs/design.md §3). The token is the connections' only
// credential: it comes from an authenticated RPC, is random, and is good for
// one transfer. A connection that has not presented a registered token is
// unauthenticated: it gets a short time to do so and is counted apart (per
// peer address too), so that such connections cannot hold the slots that
// serve transfers.
#ifndef LOSSD_SERVER_DATA_PLANE_H_
#define LOSSD_SERVER_DATA_PLANE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/data_wire.h"
#include "server/device.h"

namespace lossd {

class Metrics;

// One expected transfer over `ranges.size()` connections, connection i
// carrying the byte range `ranges[i]` (the elements of stripe i, as in a
// striped upload): an upload's bytes into the device (ReceiveIntoDevice), or
// a download's out of it. Shared by the RPC that registered it and the
// connections that serve it.
class DataTransfer {
 public:
  struct Range {
    int64_t offset = 0;
    int64_t bytes = 0;
  };
  // Moves part `index`'s bytes over the connected socket `fd`; runs on the
  // connection's thread, the parts of one transfer at once.
  using Work =
      std::function<absl::Status(int index, int fd, const Range& range)>;
  using Done = std::function<void(const absl::Status&)>;
  DataTransfer(std::vector<Range> ranges, Work work, Done done);
  DataTransfer(const DataTransfer&) = delete;
  DataTransfer& operator=(const DataTransfer&) = delete;

  // Stops the transfer: shuts its connections and returns once no part's
  // work runs any more. `done` is not called after this
  // returns unless it had already started (the caller must tell that call
  // apart itself, e.g. by who ends the RPC). Any thread; may hold a lock
  // that `done` takes (`done` runs after the writes).
  void Cancel() ABSL_LOCKS_EXCLUDED(mu_);
  // Whether Cancel was called.
  bool cancelled() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  friend class DataPlane;

  struct Part {
    Range range;
    bool claimed = false;
    bool writing = false;
    int fd = -1;
  };

  int parts() const { return static_cast<int>(parts_.size()); }
  // A connection claims part `index` (false: out of range, cancelled,
  // failed, or already claimed).
  bool Claim(int index, int fd) ABSL_LOCKS_EXCLUDED(mu_);
  // Whether every part has its connection.
  bool AllClaimed() const ABSL_LOCKS_EXCLUDED(mu_);
  // Runs the work of the claimed part `index` on `fd`.
  absl::Status Run(int index, int fd) ABSL_LOCKS_EXCLUDED(mu_);
  // Part `index` ended with `status` after its writes; the first error fails
  // the transfer and stops the other parts.
  void PartDone(int index, const absl::Status& status) ABSL_LOCKS_EXCLUDED(mu_);
  // Fails the transfer (a timeout) unless it is decided already.
  void Fail(const absl::Status& status) ABSL_LOCKS_EXCLUDED(mu_);
  // Calls `done` once the outcome is known and no part writes any more
  // (unless cancelled). Releases the lock first.
  void DeliverAndUnlock() ABSL_UNLOCK_FUNCTION(mu_);

  const Work work_;
  const Done done_;
  mutable absl::Mutex mu_;
  std::vector<Part> parts_ ABSL_GUARDED_BY(mu_);
  int writing_ ABSL_GUARDED_BY(mu_) = 0;    // parts receiving now
  int remaining_ ABSL_GUARDED_BY(mu_) = 0;  // parts not yet received
  absl::Status failure_ ABSL_GUARDED_BY(mu_);
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  bool delivered_ ABSL_GUARDED_BY(mu_) = false;
};

// The work of an upload's transfer: part `index`'s bytes from the socket into
// `buffer + range.offset` on `device`, through the device's host windows
// (pinned staging on CUDA; no copy of its own), counted in `metrics` (may be
// null) for `tenant`, then the end of the client's sending
// (AwaitEndOfSending). All of them on the device when it returns OK.
DataTransfer::Work ReceiveIntoDevice(Device* device, void* buffer,
                                     Metrics* metrics,
                                     const std::string& tenant = {});

// Receives `bytes` bytes from socket `fd` into `base` on `device` through its
// host windows, so that the device's copy of one window overlaps receiving
// the next (and a host-accessible device receives in place). A recv that
// returns n <= 0 after `received` bytes ends it with error(received, n).
// `on_received(n)` (may be null) follows each window's n bytes. Adds the time
// spent waiting for the device's windows to `*device_seconds` (may be null).
// Does not wait for the last copies: FinishWrites(base) does.
absl::Status ReceiveThroughWindows(
    Device* device, char* base, int64_t bytes, int fd,
    const std::function<absl::Status(int64_t received, ssize_t n)>& error,
    const std::function<void(int64_t)>& on_received,
    double* device_seconds = nullptr);

// After the `bytes` bytes of upload connection `index`: waits for the client
// to close its sending side (common/data_wire.h), the only way to know that
// no more bytes follow. OK at the end; INVALID_ARGUMENT when more bytes
// arrive (the message gives `bytes` and how many came at least);
// DEADLINE_EXCEEDED when the sending side stays open for the socket's
// receive timeout; UNAVAILABLE when the connection fails.
absl::Status AwaitEndOfSending(int fd, int index, int64_t bytes);

// The status of data connection `index` whose recv or send returned `result`
// (0: the peer closed; -1: errno says why) after `done` of its `bytes` bytes:
// INVALID_ARGUMENT (ended early), DEADLINE_EXCEEDED (stalled), UNAVAILABLE.
absl::Status DataConnectionError(int index, int64_t done, int64_t bytes,
                                 ssize_t result);

// Sends `bytes` bytes at `data` on data connection `index` whose `done` of
// `total` bytes are already out: DataConnectionError's statuses on failure.
absl::Status SendOnDataConnection(int fd, int index, const char* data,
                                  size_t bytes, int64_t done, int64_t total);

// The listener of data connections and the registry of expected transfers.
class DataPlane {
 public:
  struct Options {
    std::string host = "0.0.0.0";
    int port = 0;  // 0 = pick a free one
    // A registered transfer without a connection, or a connection that
    // sends nothing, fails after this long.
    absl::Duration timeout = absl::Seconds(60);
    // Authenticated connections served at once; more wait, connected, until
    // one ends. Each upload connection holds two pinned staging buffers on
    // CUDA (8 MiB at the default staging size).
    int max_connections = 64;
    // A connection must send its preamble, naming a registered token, within
    // this long of being accepted (capped at `timeout`), or it is closed.
    absl::Duration auth_timeout = absl::Seconds(1);
    // Connections of one peer address (an IPv6 one by its /64) that have not
    // presented a registered token yet; more from it are closed at once.
    // At least kMaxDataConnections, so that one transfer whose connections
    // come before its header never meets it.
    int max_unauthenticated_per_peer = 128;
    // Such connections of all peers; more wait in the listen backlog (128)
    // until one is authenticated or closed.
    int max_unauthenticated = 1024;
    // Counts the connections refused before authentication (may be null;
    // must outlive the plane).
    Metrics* metrics = nullptr;
  };

  // Listens on host:port. UNAVAILABLE when the address cannot be bound.
  static absl::StatusOr<std::unique_ptr<DataPlane>> Start(Options options);
  DataPlane(const DataPlane&) = delete;
  DataPlane& operator=(const DataPlane&) = delete;
  ~DataPlane() { Stop(); }

  // Stops listening, fails what is registered (UNAVAILABLE), ends every
  // connection and waits for them; later Expects fail. Idempotent.
  void Stop() ABSL_LOCKS_EXCLUDED(mu_);

  int port() const { return port_; }
  // Connections that have not presented a registered token yet.
  int unauthenticated() const ABSL_LOCKS_EXCLUDED(mu_);
  // Data connections whose bytes all arrived, since the start.
  int64_t completed() const { return completed_.load(); }
  // Transfers registered and still waiting for a connection. A cancelled
  // one (its RPC ended) leaves at the next sweep.
  int registered() const ABSL_LOCKS_EXCLUDED(mu_);

  // Expects `ranges.size()` connections with `token` (connection i runs
  // `work` for ranges[i]); `done` gets the transfer's
  // outcome (from a connection's thread or the sweeper), once, unless the
  // transfer is cancelled first. INVALID_ARGUMENT for a token that is not
  // kDataTokenBytes long or is already registered, or a count of ranges
  // outside [1, kMaxDataConnections].
  absl::StatusOr<std::shared_ptr<DataTransfer>> Expect(
      const std::string& token, std::vector<DataTransfer::Range> ranges,
      DataTransfer::Work work, DataTransfer::Done done)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Connections that come with `token` (unregistered: its RPC was refused)
  // are closed at once for the next kRegistrationWait, instead of waiting
  // the auth timeout for a registration that will not come, so the client
  // learns of the refusal at once. Remembers up to kMaxRefusedTokens at a
  // time.
  void Refuse(const std::string& token) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Expected {
    std::shared_ptr<DataTransfer> transfer;
    absl::Time deadline;
  };

  explicit DataPlane(Options options) : options_(std::move(options)) {}
  void AcceptLoop();
  // Serves accepted connection `fd` from peer address `peer` (counted as
  // unauthenticated until it presents a registered token).
  void Serve(int fd, std::string peer);
  // Reads the preamble and waits up to `deadline` for its token to be
  // registered (the header may arrive after the connection): the index of a
  // part of a registered transfer that no connection has claimed yet, or
  // why not.
  absl::StatusOr<DataPreamble> Authenticate(int fd, absl::Time deadline)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Connection `fd` of `peer` stops counting as unauthenticated.
  void EndUnauthenticated(const std::string& peer) ABSL_LOCKS_EXCLUDED(mu_);
  // Claims part `index` of the transfer of `token` for `fd`; the transfer
  // leaves the registry once every part has its connection. Null when there
  // is no such transfer or part to claim.
  std::shared_ptr<DataTransfer> Claim(const std::string& token, int index,
                                      int fd)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Fails the registered transfers whose connection is overdue (all of them
  // with `all`).
  void Expire(bool all) ABSL_LOCKS_EXCLUDED(mu_);

  const Options options_;
  absl::Mutex stop_mu_;  // Stop runs once at a time
  int listen_fd_ = -1;
  // An eventfd that wakes AcceptLoop: to stop, or to accept again once an
  // unauthenticated connection ended at the cap.
  int wake_fd_ = -1;
  int port_ = 0;
  std::thread acceptor_;
  std::atomic<int64_t> completed_{0};
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, Expected> expected_ ABSL_GUARDED_BY(mu_);
  // Refused tokens and until when.
  absl::flat_hash_map<std::string, absl::Time> refused_ ABSL_GUARDED_BY(mu_);
  // Connections being served (authenticated, holding a slot), connections
  // not yet authenticated (all, and by peer address), and Serve threads.
  int connections_ ABSL_GUARDED_BY(mu_) = 0;
  int unauthenticated_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<std::string, int> unauthenticated_by_peer_
      ABSL_GUARDED_BY(mu_);
  int threads_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<int, bool> open_fds_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace lossd

#endif  // LOSSD_SERVER_DATA_PLANE_H_
