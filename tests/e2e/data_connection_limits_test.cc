// The edges of data connections: an upload connection carries exactly its
// part's bytes and then ends (a byte more fails the upload like a byte less),
// and connections that present no registered token get a short time, a cap
// per peer address and no slot of those that serve transfers.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "client/data_connection.h"
#include "common/data_wire.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "lossd/v1/lossd.grpc.pb.h"
#include "server/data_plane.h"
#include "server/metrics.h"
#include "server/server.h"
#include "tests/e2e/bytes.h"
#include "tests/e2e/test_server.h"

namespace lossd {
namespace {

namespace pb = ::lossd::v1;
using e2e_test::RandomBytes;
using ::grpc::StatusCode;
using ::testing::HasSubstr;

std::string Token(char fill) { return std::string(kDataTokenBytes, fill); }

bool SendAll(int fd, const std::string& bytes) {
  return SendDataBytes(fd, bytes.data(), bytes.size()).ok();
}

// Whether the server closed `fd` (recv sees the end) within `timeout`.
bool ClosedByServer(int fd, absl::Duration timeout) {
  const timeval limit = absl::ToTimeval(timeout);
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &limit, sizeof(limit));
  char byte = 0;
  const ssize_t n = recv(fd, &byte, 1, 0);
  return n == 0 || (n < 0 && errno == ECONNRESET);
}

// A TCP connection from `source` (a loopback address other than 127.0.0.1
// stands for another peer) to 127.0.0.1:`port`; -1 when it cannot be made.
int ConnectFrom(const char* source, int port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in from = {};
  from.sin_family = AF_INET;
  inet_pton(AF_INET, source, &from.sin_addr);
  sockaddr_in to = {};
  to.sin_family = AF_INET;
  to.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, "127.0.0.1", &to.sin_addr);
  if (bind(fd, reinterpret_cast<sockaddr*>(&from), sizeof(from)) != 0 ||
      connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof(to)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

// Whether `plane` counts `count` unauthenticated connections within 10 s.
bool AwaitUnauthenticated(const DataPlane& plane, int count) {
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (plane.unauthenticated() != count) {
    if (absl::Now() >= deadline) return false;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return true;
}

class DataConnectionLimitsTest : public ::testing::Test {
 protected:
  void Start(absl::Duration data_timeout = absl::Seconds(30)) {
    ServerConfig config =
        e2e_test::LoopbackConfig("cpu", int64_t{64} << 20, absl::Seconds(10));
    config.data_port = 0;
    config.data_timeout = data_timeout;
    absl::StatusOr<std::unique_ptr<LossdServer>> server =
        LossdServer::Start(config);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    stub_ =
        pb::Lossd::NewStub(e2e_test::LargeMessageChannel(server_->address()));
  }

  int ConnectData() {
    absl::StatusOr<int> fd =
        ConnectDataPort("127.0.0.1", server_->data_port(), absl::Seconds(5));
    EXPECT_TRUE(fd.ok()) << fd.status();
    return fd.ok() ? *fd : -1;
  }

  void ExpectNothingKept() {
    EXPECT_TRUE(server_->store()->AwaitUsedBytes(0, absl::Seconds(10)))
        << "the store still holds bytes";
    EXPECT_EQ(server_->store()->Stats().tensors, 0);
    // A failed transfer whose other parts never came leaves the registry at
    // the listener's next sweep (every 250 ms).
    const absl::Time deadline = absl::Now() + absl::Seconds(5);
    while (server_->data_plane()->registered() != 0 && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(10));
    }
    EXPECT_EQ(server_->data_plane()->registered(), 0);
  }

  // An Upload stream of a float32 tensor of `shape` whose bytes come over
  // `connections` data connections with `token`: the header, then Finish.
  struct RawUpload {
    grpc::ClientContext context;
    pb::UploadResponse response;
    std::unique_ptr<grpc::ClientWriter<pb::UploadRequest>> writer;
  };
  std::unique_ptr<RawUpload> SendHeader(const std::string& token,
                                        std::vector<int64_t> shape,
                                        int connections = 1) {
    auto upload = std::make_unique<RawUpload>();
    upload->writer = stub_->Upload(&upload->context, &upload->response);
    pb::UploadRequest request;
    pb::TensorHeader* header = request.mutable_header();
    header->set_dtype(pb::DTYPE_FLOAT32);
    for (int64_t dim : shape) header->add_shape(dim);
    header->set_data_token(token);
    header->set_data_connections(connections);
    EXPECT_TRUE(upload->writer->Write(request));
    EXPECT_TRUE(upload->writer->WritesDone());
    return upload;
  }

  std::unique_ptr<LossdServer> server_;
  std::unique_ptr<pb::Lossd::Stub> stub_;
};

// 64 bytes more than the header's 400 fail the upload as chunks would:
// INVALID_ARGUMENT with both counts, nothing stored or reserved. Whether the
// extra bytes come with the part's or after them.
TEST_F(DataConnectionLimitsTest, ExtraBytesFailTheUpload) {
  Start();
  for (bool later : {false, true}) {
    SCOPED_TRACE(later ? "extra bytes after a pause" : "extra bytes at once");
    const std::string token = Token(later ? 'b' : 'a');
    std::unique_ptr<RawUpload> upload = SendHeader(token, {100});
    const int fd = ConnectData();
    ASSERT_TRUE(SendAll(
        fd, EncodeDataPreamble(token, 0) + RandomBytes(later ? 400 : 464, 1)));
    if (later) {
      // Usually after the server has all 400: the outcome is the same.
      absl::SleepFor(absl::Milliseconds(100));
      ASSERT_TRUE(SendAll(fd, RandomBytes(64, 2)));
    }
    // The server may have reset the connection already, having read more
    // than its part: then there is no sending side left to close.
    EndDataSending(fd).IgnoreError();
    const grpc::Status status = upload->writer->Finish();
    close(fd);
    EXPECT_EQ(status.error_code(), StatusCode::INVALID_ARGUMENT)
        << status.error_message();
    EXPECT_THAT(status.error_message(),
                HasSubstr("data connection 0 carries 400 bytes, but more "
                          "arrived (at least 4"));
    ExpectNothingKept();
  }
}

// Extra bytes on one connection of three, or on a part without elements
// (one element over two connections: part 0 is empty), fail the whole upload
// and name that connection.
TEST_F(DataConnectionLimitsTest, ExtraBytesOnOneOfSeveralConnections) {
  Start();
  {
    SCOPED_TRACE("the last of three");
    const std::string token = Token('c');
    std::unique_ptr<RawUpload> upload = SendHeader(token, {300}, 3);
    std::vector<int> fds;
    for (int i = 0; i < 3; ++i) {
      fds.push_back(ConnectData());
      ASSERT_TRUE(SendAll(fds[i], EncodeDataPreamble(token, i) +
                                      RandomBytes(i == 2 ? 401 : 400, i)));
      // The server may have reset the connection with the extra byte already.
      const absl::Status ended = EndDataSending(fds[i]);
      if (i != 2) {
        EXPECT_TRUE(ended.ok()) << ended;
      }
    }
    const grpc::Status status = upload->writer->Finish();
    for (int fd : fds) close(fd);
    EXPECT_EQ(status.error_code(), StatusCode::INVALID_ARGUMENT)
        << status.error_message();
    EXPECT_THAT(status.error_message(),
                HasSubstr("data connection 2 carries 400 bytes, but more "
                          "arrived (at least 401)"));
    ExpectNothingKept();
  }
  {
    SCOPED_TRACE("an empty part");
    const std::string token = Token('d');
    std::unique_ptr<RawUpload> upload = SendHeader(token, {1}, 2);
    // Connection 1 (the element) goes first: the server may fail the upload
    // and close every connection as soon as connection 0's byte arrives.
    std::vector<int> fds(2, -1);
    for (int i : {1, 0}) {
      fds[i] = ConnectData();
      ASSERT_TRUE(
          SendAll(fds[i], EncodeDataPreamble(token, i) + RandomBytes(4, i)));
      // The server may have reset connection 0 (the extra bytes) already.
      const absl::Status ended = EndDataSending(fds[i]);
      if (i != 0) {
        EXPECT_TRUE(ended.ok()) << ended;
      }
    }
    const grpc::Status status = upload->writer->Finish();
    for (int fd : fds) close(fd);
    EXPECT_EQ(status.error_code(), StatusCode::INVALID_ARGUMENT)
        << status.error_message();
    EXPECT_THAT(status.error_message(),
                HasSubstr("data connection 0 carries 0 bytes, but more "
                          "arrived (at least 4)"));
    ExpectNothingKept();
  }
  {
    SCOPED_TRACE("exact parts still upload");
    const std::string token = Token('e');
    const std::string bytes = RandomBytes(8, 9);
    std::unique_ptr<RawUpload> upload = SendHeader(token, {2}, 2);
    std::vector<int> fds;
    for (int i = 0; i < 2; ++i) {
      fds.push_back(ConnectData());
      ASSERT_TRUE(SendAll(
          fds[i], EncodeDataPreamble(token, i) + bytes.substr(4 * i, 4)));
      EXPECT_TRUE(EndDataSending(fds[i]).ok());
    }
    const grpc::Status status = upload->writer->Finish();
    for (int fd : fds) close(fd);
    EXPECT_TRUE(status.ok()) << status.error_message();
    EXPECT_EQ(upload->response.tensor().bytes(), 8);
  }
}

// A connection that sends its part but never closes its sending side leaves
// the server unable to tell whether more follows: the upload fails once
// data_timeout passes, and nothing is kept.
TEST_F(DataConnectionLimitsTest, SendingSideLeftOpenTimesOut) {
  Start(/*data_timeout=*/absl::Seconds(1));
  const std::string token = Token('f');
  std::unique_ptr<RawUpload> upload = SendHeader(token, {100});
  const int fd = ConnectData();
  ASSERT_TRUE(SendAll(fd, EncodeDataPreamble(token, 0) + RandomBytes(400, 3)));
  const grpc::Status status = upload->writer->Finish();
  close(fd);
  EXPECT_EQ(status.error_code(), StatusCode::DEADLINE_EXCEEDED)
      << status.error_message();
  EXPECT_THAT(status.error_message(),
              HasSubstr("data connection 0 sent its 400 bytes but did not "
                        "close its sending side"));
  ExpectNothingKept();
}

// With the default flags, 80 connections that never send a preamble (more
// than the 64 slots that serve transfers) do not delay an upload, and the
// server closes each of them once the auth timeout (1 s) has passed.
TEST_F(DataConnectionLimitsTest, IdleConnectionsDoNotDelayUploads) {
  Start();
  constexpr int kIdle = 80;
  const absl::Time opened = absl::Now();
  std::vector<int> idle;
  for (int i = 0; i < kIdle; ++i) {
    idle.push_back(ConnectData());
    ASSERT_GE(idle.back(), 0);
  }
  ASSERT_TRUE(AwaitUnauthenticated(*server_->data_plane(), kIdle));

  ClientOptions options;
  options.stripe_min_bytes = 1;
  absl::StatusOr<std::unique_ptr<Client>> client =
      Client::Connect(server_->address(), options);
  ASSERT_TRUE(client.ok()) << client.status();
  const std::string bytes = RandomBytes(1 << 20, 4);
  const absl::Time start = absl::Now();
  absl::StatusOr<TensorInfo> uploaded =
      (*client)->Upload(DType::kFloat32, {1 << 18}, bytes.data(), bytes.size());
  const absl::Duration took = absl::Now() - start;
  ASSERT_TRUE(uploaded.ok()) << uploaded.status();
  EXPECT_EQ(server_->data_plane()->completed(), 4);  // over data connections
  // Promptly: the idle connections hold no slot it needs (5 s leaves room
  // for a loaded machine; UnauthenticatedConnectionsCountApart shows that a
  // transfer does not wait for them to be closed).
  EXPECT_LT(took, absl::Seconds(5)) << took;

  for (int fd : idle) {
    EXPECT_TRUE(ClosedByServer(fd, absl::Seconds(10)));
    close(fd);
  }
  EXPECT_GE(absl::Now() - opened, absl::Milliseconds(900));
  EXPECT_TRUE(AwaitUnauthenticated(*server_->data_plane(), 0));
}

// An Evaluate whose rows are INT64_MAX - 3 bytes of fp32 logits (vocab
// INT64_MAX / 4, a valid header) and 8 of target: a frame over a data
// connection cannot hold one row, and the message gives the two sizes as they
// are, not their wrapped sum.
TEST_F(DataConnectionLimitsTest, EvaluateRowsAtTheInt64Limit) {
  Start();
  const std::string token = Token('v');
  grpc::ClientContext context;
  pb::EvaluateResponse response;
  std::unique_ptr<grpc::ClientWriter<pb::EvaluateRequest>> writer =
      stub_->Evaluate(&context, &response);
  pb::EvaluateRequest request;
  pb::EvaluateHeader* header = request.mutable_header();
  header->set_vocab(std::numeric_limits<int64_t>::max() / 4);
  header->set_logits_dtype(pb::DTYPE_FLOAT32);
  header->set_targets_dtype(pb::DTYPE_INT64);
  header->set_data_token(token);
  header->set_data_connections(1);
  ASSERT_TRUE(writer->Write(request));
  ASSERT_TRUE(writer->WritesDone());
  const int fd = ConnectData();
  char rows[kFrameHeaderBytes];
  EncodeFrameRows(1, rows);
  ASSERT_TRUE(SendAll(
      fd, EncodeDataPreamble(token, 0) + std::string(rows, sizeof(rows))));
  EXPECT_TRUE(EndDataSending(fd).ok());
  const grpc::Status status = writer->Finish();
  close(fd);
  EXPECT_EQ(status.error_code(), StatusCode::INVALID_ARGUMENT)
      << status.error_message();
  EXPECT_THAT(status.error_message(),
              HasSubstr("a row of 9223372036854775804 bytes of logits and 8 "
                        "of target is more than a frame may hold"));
  ExpectNothingKept();
}

// More idle connections than the per-peer cap (from another loopback
// address) and than the slots that serve transfers (from the transfer's own
// address): those over the cap are closed at once, the others after the
// auth timeout, each counted in lossd_data_connections_refused_total; a
// transfer meanwhile completes at once.
TEST(DataPlaneAuthTest, UnauthenticatedConnectionsCountApart) {
  Metrics metrics(nullptr);
  DataPlane::Options options;
  options.host = "127.0.0.1";
  options.timeout = absl::Seconds(20);
  options.max_connections = 2;
  options.auth_timeout = absl::Seconds(5);
  options.max_unauthenticated_per_peer = kMaxDataConnections;
  options.metrics = &metrics;
  absl::StatusOr<std::unique_ptr<DataPlane>> plane = DataPlane::Start(options);
  ASSERT_TRUE(plane.ok()) << plane.status();
  const int port = (*plane)->port();

  constexpr int kOtherPeer = 100;  // 36 over the cap of 64
  constexpr int kSamePeer = 10;    // more than the 2 slots
  std::vector<int> idle;
  for (int i = 0; i < kOtherPeer; ++i) {
    idle.push_back(ConnectFrom("127.0.0.2", port));
    ASSERT_GE(idle.back(), 0) << "cannot connect from 127.0.0.2";
  }
  for (int i = 0; i < kSamePeer; ++i) {
    idle.push_back(ConnectFrom("127.0.0.1", port));
    ASSERT_GE(idle.back(), 0);
  }
  const int held = kMaxDataConnections + kSamePeer;
  ASSERT_TRUE(AwaitUnauthenticated(**plane, held));
  int closed_at_once = 0;
  for (int i = 0; i < kOtherPeer; ++i) {
    pollfd ready = {idle[i], POLLIN, 0};
    if (poll(&ready, 1, 0) == 1 && ClosedByServer(idle[i], absl::Seconds(1))) {
      ++closed_at_once;
    }
  }
  EXPECT_EQ(closed_at_once, kOtherPeer - kMaxDataConnections);

  // Three parts over two slots, from the idle connections' own address.
  constexpr int kParts = 3;
  constexpr int64_t kPartBytes = 1 << 20;
  const std::string bytes = RandomBytes(kParts * kPartBytes, 5);
  std::string into(bytes.size(), '\0');
  std::vector<DataTransfer::Range> ranges;
  for (int i = 0; i < kParts; ++i) {
    ranges.push_back({i * kPartBytes, kPartBytes});
  }
  absl::Notification done;
  absl::Status outcome;
  const absl::Time start = absl::Now();
  absl::StatusOr<std::shared_ptr<DataTransfer>> transfer = (*plane)->Expect(
      Token('g'), ranges,
      [&into](int, int fd, const DataTransfer::Range& range) {
        return ReceiveOverDataConnection(fd, into.data() + range.offset,
                                         static_cast<size_t>(range.bytes),
                                         nullptr);
      },
      [&](const absl::Status& status) {
        outcome = status;
        done.Notify();
      });
  ASSERT_TRUE(transfer.ok()) << transfer.status();
  std::vector<std::thread> senders;
  for (int i = 0; i < kParts; ++i) {
    senders.emplace_back([&, i] {
      absl::StatusOr<int> fd =
          ConnectDataPort("127.0.0.1", port, absl::Seconds(5));
      ASSERT_TRUE(fd.ok()) << fd.status();
      EXPECT_TRUE(SendOverDataConnection(*fd, Token('g'), i,
                                         bytes.data() + i * kPartBytes,
                                         kPartBytes, nullptr)
                      .ok());
      EXPECT_TRUE(ClosedByServer(*fd, absl::Seconds(15)));
      close(*fd);
    });
  }
  for (std::thread& sender : senders) sender.join();
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(15)));
  const absl::Duration took = absl::Now() - start;
  EXPECT_TRUE(outcome.ok()) << outcome;
  EXPECT_TRUE(into == bytes);
  EXPECT_LT(took, absl::Seconds(3)) << took;
  // The idle ones were there all along.
  EXPECT_EQ((*plane)->unauthenticated(), held);

  for (int fd : idle) {
    EXPECT_TRUE(ClosedByServer(fd, absl::Seconds(10)));
    close(fd);
  }
  EXPECT_TRUE(AwaitUnauthenticated(**plane, 0));
  const std::string text = metrics.Render();
  EXPECT_THAT(text, HasSubstr(absl::StrCat(
                        "lossd_data_connections_refused_total{reason=\""
                        "peer_limit\"} ",
                        kOtherPeer - kMaxDataConnections)));
  EXPECT_THAT(text, HasSubstr(absl::StrCat(
                        "lossd_data_connections_refused_total{reason=\""
                        "auth_timeout\"} ",
                        held)));
}

// A preamble trickled in a byte at a time still has to be whole within the
// auth timeout; a wrong one is closed at once and counted as invalid.
TEST(DataPlaneAuthTest, SlowOrWrongPreamblesAreClosed) {
  Metrics metrics(nullptr);
  DataPlane::Options options;
  options.host = "127.0.0.1";
  options.auth_timeout = absl::Milliseconds(500);
  options.metrics = &metrics;
  absl::StatusOr<std::unique_ptr<DataPlane>> plane = DataPlane::Start(options);
  ASSERT_TRUE(plane.ok()) << plane.status();
  const int slow = ConnectFrom("127.0.0.1", (*plane)->port());
  ASSERT_GE(slow, 0);
  const std::string preamble = EncodeDataPreamble(Token('h'), 0);
  const absl::Time start = absl::Now();
  bool closed = false;
  for (size_t i = 0; i < preamble.size() && !closed; ++i) {
    if (send(slow, preamble.data() + i, 1, MSG_NOSIGNAL) != 1) break;
    pollfd ready = {slow, POLLIN, 0};
    closed = poll(&ready, 1, 100) == 1;
  }
  EXPECT_TRUE(ClosedByServer(slow, absl::Seconds(5)));
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
  close(slow);

  const int wrong = ConnectFrom("127.0.0.1", (*plane)->port());
  ASSERT_GE(wrong, 0);
  ASSERT_TRUE(SendAll(wrong, std::string(kDataPreambleBytes, 'z')));
  EXPECT_TRUE(ClosedByServer(wrong, absl::Seconds(5)));
  close(wrong);
  EXPECT_TRUE(AwaitUnauthenticated(**plane, 0));
  const std::string text = metrics.Render();
  EXPECT_THAT(
      text,
      HasSubstr(
          "lossd_data_connections_refused_total{reason=\"auth_timeout\"} 1"));
  EXPECT_THAT(
      text,
      HasSubstr("lossd_data_connections_refused_total{reason=\"invalid\"} 1"));
}

}  // namespace
}  // namespace lossd
