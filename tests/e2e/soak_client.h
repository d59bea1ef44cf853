// The soak's client: one channel, random generator and set of tensors, the
// traffic mix it sends (each RPC in its normal, cancelled, short or
// tight-deadline variant) and the figures it keeps of what came back.
#ifndef LOSSD_TESTS_E2E_SOAK_CLIENT_H_
#define LOSSD_TESTS_E2E_SOAK_CLIENT_H_

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "lossd/v1/lossd.grpc.pb.h"

namespace lossd {
namespace soak_test {

namespace pb = ::lossd::v1;
using Code = grpc::StatusCode;

// What all clients did, summed.
struct Figures {
  int64_t requests = 0;
  int64_t ok = 0;
  int64_t expected_errors = 0;  // bad requests sent on purpose
  int64_t cancellations = 0;    // streams the client cancelled midway
  int64_t deadlines = 0;        // RPCs that ran into their deadline
  // RPCs that never left the client because its channel could not connect
  // at that moment (seen once in CI: a fresh loopback connection failed and
  // the default one-second-and-growing backoff failed every RPC for seconds
  // after). They reach no server, so they change nothing there; the client
  // then waits for its channel to reconnect, which must happen.
  int64_t connect_failures = 0;
  std::string first_connect_failure;
  int64_t bytes_uploaded = 0;
  int64_t bytes_downloaded = 0;
  int64_t bytes_evaluated = 0;
  std::vector<std::string> unexpected;

  void Add(const Figures& other) {
    requests += other.requests;
    ok += other.ok;
    expected_errors += other.expected_errors;
    cancellations += other.cancellations;
    deadlines += other.deadlines;
    connect_failures += other.connect_failures;
    if (first_connect_failure.empty()) {
      first_connect_failure = other.first_connect_failure;
    }
    bytes_uploaded += other.bytes_uploaded;
    bytes_downloaded += other.bytes_downloaded;
    bytes_evaluated += other.bytes_evaluated;
    unexpected.insert(unexpected.end(), other.unexpected.begin(),
                      other.unexpected.end());
  }
};

// A tensor one client owns.
struct Owned {
  std::string handle;
  pb::DType dtype = pb::DTYPE_FLOAT32;
  int64_t rows = 0;
  int64_t vocab = 0;  // 0 for targets
  bool gradient = false;
  pb::Reduction reduction = pb::REDUCTION_MEAN;
  bool materialized = false;
  double factor = 1.0;
  std::string bytes;  // what was uploaded, while it holds logits
  // A Download of it failed. A failure of the client's own making (it
  // cancelled, or its deadline passed) returns before the server learns of it
  // (asynchronously), so the server may still hold the read lease and an
  // in-place write may find the tensor busy, until one such write succeeds.
  // A status the server sent, OK or not, comes after its lease ended; any
  // failure counts here, as the client cannot always tell whose it was.
  bool maybe_read = false;
};

// One client: its own channel, random generator and tensors.
class SoakClient {
 public:
  SoakClient(const std::string& address, int data_port, int id, unsigned seed)
      : id_(id), data_port_(data_port), rng_(seed) {
    grpc::ChannelArguments args;
    // A distinct argument gives each client its own connection.
    args.SetInt("lossd.soak_client", id);
    // A failed connection attempt is retried after 100 ms, not gRPC's
    // default second (growing to two minutes).
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
    args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
    channel_ = grpc::CreateCustomChannel(
        address, grpc::InsecureChannelCredentials(), args);
    stub_ = pb::Lossd::NewStub(channel_);
  }

  void Run(absl::Time end);

  const Figures& figures() const { return figures_; }

 private:
  static constexpr size_t kMaxOwned = 8;

  int Uniform(int low, int high) {
    return std::uniform_int_distribution<int>(low, high)(rng_);
  }
  bool Chance(int percent) { return Uniform(0, 99) < percent; }

  // The channel's connection could not be made when the RPC started: it was
  // never sent.
  static bool NotConnected(const grpc::Status& status) {
    return status.error_code() == Code::UNAVAILABLE &&
           status.error_message().rfind("failed to connect", 0) == 0;
  }

  // Waits until the channel is connected; false (and an unexpected failure)
  // if that takes longer than 10 s.
  bool Reconnect();

  // Counts one RPC whose status must be one of `allowed`.
  void Check(const char* what, const grpc::Status& status,
             std::initializer_list<Code> allowed);

  void MaybeDeadline(grpc::ClientContext* context, bool* with_deadline);

  std::string RandomLogits(pb::DType dtype, int64_t count);

  std::string RandomTargets(int64_t rows, int64_t vocab, pb::DType dtype);

  Owned* Pick(bool (*want)(const Owned&));

  // Logits of a random float dtype and shape (not uploaded yet).
  Owned RandomTensor();

  void Upload();

  // Owns an uploaded tensor, which the server must describe as its size.
  void Keep(Owned tensor, const pb::TensorInfo& uploaded, const char* what);

  // The bytes of a Download that ended OK: as many as its header said, and
  // the uploaded ones when they were asked for unconverted.
  void CheckDownloaded(const char* what, const Owned& tensor, pb::DType dtype,
                       const std::string& bytes, int64_t announced);

  // One tensor as 2-4 stripes, each its own stream on its own thread (the
  // server joins them by upload_id). Sometimes one stripe is cancelled
  // midway: that stripe ends CANCELLED and every other ABORTED (at once, or
  // after the server's stripe timeout when the cancelled stream never got to
  // attach), and nothing is stored.
  void StripedUpload();

  // The first element of part `i` of `count` over `elements` elements (the
  // split of stripes and data connections).
  static int64_t PartStart(int64_t elements, int i, int count);

  // `count` sockets connected to the data port and a fresh token for them;
  // empty (and an unexpected failure) when that cannot be had.
  std::vector<int> ConnectData(int count, std::string* token);

  // Sends parts[i] over data connection i (after its preamble), each on its
  // own thread; when `cancel`, the last connection sends nothing and the RPC
  // is cancelled afterwards (so it cannot complete first). Then `finish`
  // ends the RPC and the connections are closed.
  grpc::Status SendParts(const std::vector<int>& fds, const std::string& token,
                         const std::vector<std::string>& parts, bool cancel,
                         grpc::ClientContext* context,
                         const std::function<grpc::Status()>& finish);

  // Counts the status of a transfer over data connections in the mode it
  // ran in: cancelled, with a short part (`broken`), with a tight deadline or
  // plain. True when it ended OK.
  bool CheckData(const std::string& what, const grpc::Status& status,
                 bool cancel, bool broken, bool with_deadline);

  // An Upload whose bytes go over 1-3 data connections. Sometimes one
  // connection ends short (INVALID_ARGUMENT), sometimes the last one never
  // sends and the RPC is cancelled (CANCELLED), sometimes the deadline is
  // tight; nothing is stored unless it ends OK.
  void DataUpload();

  // A Download whose bytes come over 1-3 data connections. Sometimes the RPC
  // is cancelled once the header came, sometimes the client closes its
  // connections unread (the server's sends may fail: UNAVAILABLE, or the
  // bytes fit the socket buffers: OK), sometimes the deadline is tight.
  void DataDownload();

  void Forward();

  void Backward();

  void Download();

  void Evaluate();

  // An Evaluate whose blocks go over 1-3 data connections (block b over
  // connection b mod K, each one's frames in order). Sometimes a frame is cut
  // short (INVALID_ARGUMENT), sometimes the RPC is cancelled while the last
  // connection has not sent its frames (CANCELLED), sometimes the deadline is
  // tight.
  void DataEvaluate();

  void Release(bool any);

  // Requests that must fail, mixed in with the rest.
  void BadRequest();

  void Inspect();

  const int id_;
  const int data_port_;
  std::mt19937 rng_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<pb::Lossd::Stub> stub_;
  int64_t stripe_uploads_ = 0;
  std::vector<Owned> owned_;
  Figures figures_;
};

}  // namespace soak_test
}  // namespace lossd

#endif  // LOSSD_TESTS_E2E_SOAK_CLIENT_H_
