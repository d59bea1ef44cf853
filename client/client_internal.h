// What the files of lossd::Client share and its callers never see: the
// Channel behind a Client (stubs, stripe connections, known shapes, the
// scratch pool) and the helpers of calls and transfers. Included only by
// client.cc, client_evaluate.cc, client_transfers.cc, client_uploads.cc and
// client_downloads.cc.
#ifndef LOSSD_CLIENT_CLIENT_INTERNAL_H_
#define LOSSD_CLIENT_CLIENT_INTERNAL_H_

#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "lossd/v1/lossd.grpc.pb.h"

namespace lossd {

namespace v1 = ::lossd::v1;
namespace health = ::grpc::health::v1;

struct Client::Channel {
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Lossd::Stub> lossd;
  std::unique_ptr<health::Health::Stub> health;
  // What made `channel`, for the extra connections of striped uploads.
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  bool tls = false;
  grpc::ChannelArguments args;

  // Connection `index` (>= 1) of a striped upload to `target`, made on first
  // use and kept; connection 0 is `channel`. Thread-safe.
  std::shared_ptr<grpc::Channel> StripeChannel(const std::string& target,
                                               int index)
      ABSL_LOCKS_EXCLUDED(mu) {
    absl::MutexLock lock(&mu);
    while (static_cast<int>(stripe_channels.size()) < index) {
      grpc::ChannelArguments stripe_args = args;
      // Each channel has its own subchannel pool (the arguments say so), so
      // each is its own TCP connection; the distinct argument keeps that
      // true should the pool ever be shared again.
      stripe_args.SetInt("lossd.upload_stripe",
                         static_cast<int>(stripe_channels.size()) + 1);
      stripe_channels.push_back(
          grpc::CreateCustomChannel(target, credentials, stripe_args));
    }
    return stripe_channels[static_cast<std::size_t>(index - 1)];
  }

  absl::Mutex mu;
  std::vector<std::shared_ptr<grpc::Channel>> stripe_channels
      ABSL_GUARDED_BY(mu);
  // The server's data port as learnt from GetServerInfo; 0 = none, or not
  // reachable from here. Unset until the first large upload asks.
  std::optional<int> data_port ABSL_GUARDED_BY(mu);
  // ServerInfo.features as the last successful GetServerInfo answered;
  // unset until one did.
  std::optional<std::vector<std::string>> features ABSL_GUARDED_BY(mu);

  // The dtype and shape of handles this client uploaded or described (they
  // never change on the server), so that a ranged Download needs no Describe
  // first. At most kKnownShapes, the oldest forgotten first. Thread-safe.
  struct Shape {
    DType dtype = DType::kInvalid;
    std::vector<int64_t> dims;
  };
  static constexpr std::size_t kKnownShapes = 4096;
  void Remember(const TensorInfo& info) ABSL_LOCKS_EXCLUDED(mu) {
    if (info.handle.empty()) return;
    absl::MutexLock lock(&mu);
    auto [it, added] = known.try_emplace(info.handle);
    it->second = Shape{info.dtype, info.shape};
    if (!added) return;
    known_order.push_back(info.handle);
    if (known_order.size() > kKnownShapes) {
      known.erase(known_order.front());
      known_order.pop_front();
    }
  }
  std::optional<Shape> Known(const std::string& handle)
      ABSL_LOCKS_EXCLUDED(mu) {
    absl::MutexLock lock(&mu);
    auto it = known.find(handle);
    if (it == known.end()) return std::nullopt;
    return it->second;
  }
  void Forget(const std::string& handle) ABSL_LOCKS_EXCLUDED(mu) {
    absl::MutexLock lock(&mu);
    known.erase(handle);  // its place in known_order goes with eviction
  }
  absl::flat_hash_map<std::string, Shape> known ABSL_GUARDED_BY(mu);
  std::deque<std::string> known_order ABSL_GUARDED_BY(mu);

  // The scratch buffers of piece-wise transfers (piece_bytes each): a
  // transfer takes what it needs and gives it back, so a Client reuses the
  // same few buffers for its life (callers may register them, e.g. pin
  // them). Pages are touched only by a source or a receive that fills them.
  struct FreeDeleter {
    void operator()(char* p) const { std::free(p); }
  };
  using Scratch = std::unique_ptr<char, FreeDeleter>;
  std::vector<Scratch> TakeScratch(int count, std::size_t bytes)
      ABSL_LOCKS_EXCLUDED(mu) {
    std::vector<Scratch> taken;
    {
      absl::MutexLock lock(&mu);
      while (static_cast<int>(taken.size()) < count && !free_scratch.empty()) {
        taken.push_back(std::move(free_scratch.back()));
        free_scratch.pop_back();
      }
    }
    // Page-aligned, so device copies and registration cover whole pages.
    const std::size_t rounded = (bytes + 4095) / 4096 * 4096;
    while (static_cast<int>(taken.size()) < count) {
      taken.emplace_back(static_cast<char*>(std::aligned_alloc(4096, rounded)));
      if (taken.back() == nullptr) std::abort();  // as operator new would
    }
    return taken;
  }
  void GiveScratch(std::vector<Scratch> buffers) ABSL_LOCKS_EXCLUDED(mu) {
    absl::MutexLock lock(&mu);
    for (Scratch& buffer : buffers) free_scratch.push_back(std::move(buffer));
  }
  std::vector<Scratch> free_scratch ABSL_GUARDED_BY(mu);

  // The scratch buffers one transfer holds, given back when it ends.
  class Lease {
   public:
    Lease(Channel* channel, int count, std::size_t bytes)
        : channel_(channel), buffers_(channel->TakeScratch(count, bytes)) {}
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    ~Lease() { channel_->GiveScratch(std::move(buffers_)); }
    char* operator[](int i) const {
      return buffers_[static_cast<std::size_t>(i)].get();
    }

   private:
    Channel* const channel_;
    std::vector<Scratch> buffers_;
  };
};

namespace client_internal {

// Room left in a message for everything but the payload bytes.
constexpr std::size_t kMessageOverheadBytes = 4096;
// How long a data connection may take to connect before the upload goes over
// gRPC instead.
constexpr absl::Duration kDataConnectTimeout = absl::Seconds(5);
// A data connection that moves nothing for this long fails its transfer.
constexpr absl::Duration kDataIoTimeout = absl::Seconds(60);
// How long a failed data connection waits for the RPC to say why.
constexpr absl::Duration kDataFailureGrace = absl::Seconds(5);

// The single grpc::Status -> absl::Status conversion. Both use the canonical
// code numbering (google.rpc.Code), so the value carries over unchanged.
absl::Status ToAbsl(const grpc::Status& status);

// Prepares `context` for a call on `channel` with `options`' deadline and
// credentials. When `channel` (nullptr = the caller waits itself) is not
// connected, first waits up to options.connect_wait, within the deadline, for
// it to connect: a first connection attempt that fails must not fail the call
// while a reconnect 100 ms later would succeed. The call then runs either way
// and fails fast (UNAVAILABLE) if the channel is still down.
void PrepareContext(const ClientOptions& options, grpc::Channel* channel,
                    grpc::ClientContext* context);

// The wire messages as the client's plain structs.
TensorInfo FromProto(const v1::TensorInfo& proto);
PolicyStats PolicyStatsFromProto(const v1::PolicyStats& proto);
EvaluateResult FromProto(const v1::EvaluateResponse& proto);
ServerInfo FromProto(const v1::ServerInfo& proto);

// A server that skipped a request's post-training fields answers plain cross
// entropy. Where the answer tells (this server always answers a policy with
// its statistics and segments with one sum each), UNIMPLEMENTED naming
// `target` instead of that answer: `policy` asked, `segments` the count
// asked (0 = none), and what the response holds.
absl::Status CheckPostTrainingAnswered(const std::string& target, bool policy,
                                       int32_t segments, bool has_policy_stats,
                                       int segment_sums);
// The same for the answer to a Forward, LinearForward or Evaluate with
// `options`.
template <typename Options, typename Response>
absl::Status CheckPostTrainingAnswered(const std::string& target,
                                       const Options& options,
                                       const Response& response) {
  return CheckPostTrainingAnswered(
      target, options.policy.has_value(),
      options.segments.has_value() ? options.segments->count : 0,
      response.has_policy_stats(), response.segment_loss_size());
}

// The header of an Evaluate of rows `vocab` wide (H with options.weight:
// then sent as vocab 0, V being the weight's) with `options`; targets_dtype
// kInvalid sends DTYPE_UNSPECIFIED (rows without targets). No data token.
v1::EvaluateHeader EvaluateHeaderFor(int64_t vocab, DType logits_dtype,
                                     DType targets_dtype,
                                     const EvaluateOptions& options);

// Runs produce(k, scratch) for pieces k = 0 .. count - 1 on a helper thread,
// one piece ahead of consume(k, data) on the calling thread, alternating
// between the scratch buffers `a` and `b`: producing piece k + 1 (a dtype
// conversion, a device copy, a receive) overlaps consuming piece k (a send,
// a write). Returns the first error of either side; after one, neither is
// called again.
absl::Status PipelinePieces(
    int64_t count, char* a, char* b,
    const std::function<absl::StatusOr<const void*>(int64_t, char*)>& produce,
    const std::function<absl::Status(int64_t, const void*)>& consume);

// Bytes of the pieces of a transfer of `element_bytes`-byte elements: whole
// elements, at most options.piece_bytes (at least one element).
int64_t PieceBytes(const ClientOptions& options, int64_t element_bytes);

// A stripe's extra connection may fail its first attempt (seen on loopback
// under load), and an RPC on a fresh channel fails at once rather than wait:
// wait for it to connect, through gRPC's reconnect backoff, for up to 20 s.
absl::Status AwaitConnected(grpc::Channel* channel, int index);

// Runs work(i, context, count) for i in [0, n) on n threads, each with its
// own ClientContext prepared from `options`. When one fails, the others'
// contexts are cancelled: a stripe that failed may never have reached the
// server, so the others must not wait for it. `count(bytes)` adds to the
// progress this (the calling) thread reports as progress(done, total).
// Returns each worker's status, in order.
std::vector<absl::Status> RunParallel(
    int n, const ClientOptions& options, int64_t total,
    const ProgressCallback& progress,
    const std::function<absl::Status(
        int, grpc::ClientContext*, const std::function<void(int64_t)>&)>& work);

// Data connections of one transfer: as many as a striped transfer takes (one
// TCP stream is capped below what loopback and fast networks carry).
int DataConnectionCount(const ClientOptions& options);

// Closes a transfer's data connections when it goes, or at Close.
class ConnectionCloser {
 public:
  explicit ConnectionCloser(std::vector<int>* fds) : fds_(fds) {}
  ConnectionCloser(const ConnectionCloser&) = delete;
  ConnectionCloser& operator=(const ConnectionCloser&) = delete;
  ~ConnectionCloser() { Close(); }
  void Close() {
    for (int fd : *fds_) close(fd);
    fds_->clear();
  }

 private:
  std::vector<int>* const fds_;
};

// Ends the RPC of a transfer over data connections with `finish`. The RPC's
// status says why a transfer failed: the server ends the RPC before it closes
// the connections. When a connection failed without that (one the server
// never took), the RPC gets a short grace and is then cancelled rather than
// left to the server's --data_timeout.
grpc::Status FinishAfterData(grpc::ClientContext* context, bool failed,
                             const std::function<grpc::Status()>& finish);

}  // namespace client_internal
}  // namespace lossd

#endif  // LOSSD_CLIENT_CLIENT_INTERNAL_H_
