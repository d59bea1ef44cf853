// The shared harness of the data-connection tests: an in-process server with
// a data port, lossd::Client over it, and the raw wire pieces (preambles,
// tokens, hand-driven Upload streams) for the cases a client would not send.
#ifndef LOSSD_TESTS_E2E_DATA_CONNECTION_FIXTURE_H_
#define LOSSD_TESTS_E2E_DATA_CONNECTION_FIXTURE_H_

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "client/data_connection.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "lossd/v1/lossd.grpc.pb.h"
#include "server/data_plane.h"
#include "server/server.h"
#include "tests/e2e/bytes.h"
#include "tests/e2e/test_server.h"

namespace lossd {
namespace data_connection_test {

namespace pb = ::lossd::v1;
using e2e_test::RandomBytes;
using ::grpc::StatusCode;

constexpr int64_t kBudget = 256 << 20;
constexpr char kMagic[] = "LOSSDDC1";
constexpr int kStreams = 4;  // lossd::Client's default upload_streams

// Rows for a loss drawn from `random`: logits ~ N(0, 3^2), then targets in
// [0, vocab), one in about `ignore_every` ignored (-100; 0: none). The caller
// may go on drawing from `random`.
struct RandomRows {
  std::vector<float> logits;
  std::vector<int64_t> targets;
};
inline RandomRows MakeRandomRows(int64_t rows, int64_t vocab, int ignore_every,
                                 std::mt19937& random) {
  RandomRows r;
  r.logits.resize(static_cast<size_t>(rows * vocab));
  std::normal_distribution<float> normal(0.0f, 3.0f);
  for (float& v : r.logits) v = normal(random);
  r.targets.resize(static_cast<size_t>(rows));
  for (int64_t& t : r.targets) {
    t = ignore_every > 0 && random() % ignore_every == 0
            ? -100
            : static_cast<int64_t>(random() % vocab);
  }
  return r;
}

class DataConnectionTest : public ::testing::Test {
 protected:
  void Start(int data_port = 0, absl::Duration data_timeout = absl::Seconds(30),
             absl::Duration drain_timeout = absl::Seconds(10),
             const std::string& device = "cpu", int64_t budget = kBudget) {
    ServerConfig config =
        e2e_test::LoopbackConfig(device, budget, drain_timeout);
    config.data_port = data_port;
    config.data_timeout = data_timeout;
    config.tenant_limits = tenant_limits_;
    absl::StatusOr<std::unique_ptr<LossdServer>> server =
        LossdServer::Start(config);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    stub_ =
        pb::Lossd::NewStub(e2e_test::LargeMessageChannel(server_->address()));
  }

  // lossd::Client with `streams` data connections (or stripes) an upload.
  std::unique_ptr<Client> MakeClient(bool data_connection = true,
                                     int streams = kStreams) {
    ClientOptions options;
    options.data_connection = data_connection;
    options.upload_streams = streams;
    options.stripe_min_bytes = 1;
    absl::StatusOr<std::unique_ptr<Client>> client =
        Client::Connect(server_->address(), options);
    EXPECT_TRUE(client.ok()) << client.status();
    return client.ok() ? *std::move(client) : nullptr;
  }

  // A socket connected to the data port.
  int ConnectData() {
    absl::StatusOr<int> fd =
        ConnectDataPort("127.0.0.1", server_->data_port(), absl::Seconds(5));
    EXPECT_TRUE(fd.ok()) << fd.status();
    return fd.ok() ? *fd : -1;
  }

  void ExpectEmptyStore() {
    EXPECT_TRUE(server_->store()->AwaitUsedBytes(0, absl::Seconds(10)))
        << "the store still holds bytes";
    EXPECT_EQ(server_->store()->Stats().tensors, 0);
  }

  int64_t Completed() const { return server_->data_plane()->completed(); }

  // Completed() once it reaches `count`, or after 10 s. A download's
  // connections count once the server has sent their last bytes, which may
  // be a moment after the client has them all.
  int64_t AwaitCompleted(int64_t count) const {
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (Completed() < count && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(5));
    }
    return Completed();
  }

  // Whether the data plane holds `count` registered transfers within
  // `timeout`.
  bool AwaitRegistered(int count, absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    while (server_->data_plane()->registered() != count) {
      if (absl::Now() >= deadline) return false;
      absl::SleepFor(absl::Milliseconds(10));
    }
    return true;
  }

  std::unique_ptr<LossdServer> server_;
  std::unique_ptr<pb::Lossd::Stub> stub_;
  TenantLimits tenant_limits_;  // every tenant's, set before Start
};

// An Upload stream driven by hand: a header with a data token, then Finish.
class RawDataUpload {
 public:
  RawDataUpload(pb::Lossd::Stub* stub, const std::string& token,
                std::vector<int64_t> shape,
                pb::DType dtype = pb::DTYPE_FLOAT32) {
    writer_ = stub->Upload(&context_, &response_);
    pb::UploadRequest request;
    pb::TensorHeader* header = request.mutable_header();
    header->set_dtype(dtype);
    for (int64_t dim : shape) header->add_shape(dim);
    header->set_data_token(token);
    header_ = request;
  }
  grpc::ClientContext* context() { return &context_; }
  pb::UploadRequest* header() { return &header_; }
  bool SendHeader(bool writes_done = true) {
    return writer_->Write(header_) && (!writes_done || writer_->WritesDone());
  }
  bool SendChunk(const std::string& bytes) {
    pb::UploadRequest request;
    request.set_chunk(bytes);
    return writer_->Write(request);
  }
  grpc::Status Finish() { return writer_->Finish(); }
  const pb::UploadResponse& response() const { return response_; }

 private:
  grpc::ClientContext context_;
  pb::UploadResponse response_;
  pb::UploadRequest header_;
  std::unique_ptr<grpc::ClientWriter<pb::UploadRequest>> writer_;
};

inline std::string Token(char fill) { return std::string(16, fill); }

// The first 28 bytes of data connection `index` of an upload.
inline std::string Preamble(const std::string& token, uint32_t index = 0) {
  std::string preamble = std::string(kMagic, 8) + token;
  for (int shift = 0; shift < 32; shift += 8) {
    preamble.push_back(static_cast<char>((index >> shift) & 0xff));
  }
  return preamble;
}

inline bool SendAll(int fd, const std::string& bytes) {
  size_t sent = 0;
  while (sent < bytes.size()) {
    const ssize_t n =
        send(fd, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) return false;
    sent += static_cast<size_t>(n);
  }
  return true;
}

// Whether the server closed `fd` (recv sees the end) within `timeout`.
inline bool ClosedByServer(int fd, absl::Duration timeout) {
  const timeval limit = absl::ToTimeval(timeout);
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &limit, sizeof(limit));
  char byte = 0;
  const ssize_t n = recv(fd, &byte, 1, 0);
  return n == 0 || (n < 0 && errno == ECONNRESET);
}

// lossd::Client takes the data connection for large tensors when the server
// offers it; the bytes come back unchanged, for sizes around the staging and

}  // namespace data_connection_test
}  // namespace lossd

#endif  // LOSSD_TESTS_E2E_DATA_CONNECTION_FIXTURE_H_
