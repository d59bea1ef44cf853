// Data connections (issue 4): an Upload whose bytes come over a plain TCP
// connection to the data port instead of gRPC chunks, through lossd::Client
// and driven by hand over loopback, with every way the connection or the
// stream can go wrong leaving the store as it was.
#include "client/data_connection.h"

#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/time.h"
#include "client/client.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "lossd/v1/lossd.grpc.pb.h"
#include "server/server.h"
#include "tests/e2e/data_connection_fixture.h"
#include "tests/e2e/test_server.h"

namespace lossd {
namespace data_connection_test {
namespace {

TEST_F(DataConnectionTest, ClientRoundTripsOverTheDataConnection) {
  Start();
  ASSERT_GT(server_->data_port(), 0);
  std::unique_ptr<Client> client = MakeClient();
  ASSERT_NE(client, nullptr);
  absl::StatusOr<ServerInfo> info = client->GetServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->data_port, server_->data_port());
  int64_t expected_completed = 0;
  for (int64_t elements :
       {int64_t{1}, int64_t{12345}, int64_t{1} << 20, (int64_t{5} << 20) + 3}) {
    SCOPED_TRACE(absl::StrCat(elements, " elements"));
    const std::string bytes =
        RandomBytes(static_cast<size_t>(elements) * 4, 7 + elements);
    int64_t last_progress = 0;
    absl::StatusOr<TensorInfo> uploaded =
        client->Upload(DType::kFloat32, {elements}, bytes.data(), bytes.size(),
                       "dc", [&](int64_t done, int64_t total) {
                         EXPECT_EQ(total, static_cast<int64_t>(bytes.size()));
                         EXPECT_GT(done, last_progress);
                         last_progress = done;
                       });
    ASSERT_TRUE(uploaded.ok()) << uploaded.status();
    EXPECT_EQ(last_progress, static_cast<int64_t>(bytes.size()));
    EXPECT_EQ(uploaded->bytes, static_cast<int64_t>(bytes.size()));
    EXPECT_EQ(uploaded->label, "dc");
    expected_completed += kStreams;
    EXPECT_EQ(Completed(), expected_completed);
    // The download comes back over data connections too.
    absl::StatusOr<DownloadedTensor> got = client->Download(uploaded->handle);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_TRUE(std::string(got->data.begin(), got->data.end()) == bytes);
    EXPECT_EQ(got->info.bytes, static_cast<int64_t>(bytes.size()));
    // (A single element comes as one gRPC stream.)
    if (elements > 1) expected_completed += kStreams;
    EXPECT_EQ(AwaitCompleted(expected_completed), expected_completed);
    ASSERT_TRUE(client->Release(uploaded->handle).ok());
  }
  // Off in the options: gRPC chunks, the data plane sees nothing.
  std::unique_ptr<Client> grpc_only = MakeClient(false);
  const std::string bytes = RandomBytes(4096, 3);
  absl::StatusOr<TensorInfo> uploaded =
      grpc_only->Upload(DType::kInt32, {1024}, bytes.data(), bytes.size());
  ASSERT_TRUE(uploaded.ok()) << uploaded.status();
  EXPECT_EQ(Completed(), expected_completed);
}

// A download over data connections gives the same bytes as over gRPC: with
// a conversion (fp32 sent as bf16), a pending grad_output factor, into the
// caller's buffer; one connection and several.
TEST_F(DataConnectionTest, DownloadsMatchGrpc) {
  Start();
  const int64_t rows = 37, vocab = 4099;  // uneven splits
  std::mt19937 random(5);
  RandomRows data = MakeRandomRows(rows, vocab, 0, random);
  std::vector<float>& logits = data.logits;
  std::unique_ptr<Client> grpc_only = MakeClient(false);
  absl::StatusOr<TensorInfo> uploaded =
      grpc_only->Upload(DType::kFloat32, {rows, vocab}, logits.data(),
                        logits.size() * sizeof(float));
  ASSERT_TRUE(uploaded.ok()) << uploaded.status();
  for (DType as : {DType::kInvalid, DType::kBFloat16}) {
    SCOPED_TRACE(as == DType::kInvalid ? "as stored" : "as bf16");
    absl::StatusOr<DownloadedTensor> reference =
        grpc_only->Download(uploaded->handle, as);
    ASSERT_TRUE(reference.ok()) << reference.status();
    for (int streams : {1, 3}) {
      SCOPED_TRACE(absl::StrCat(streams, " connections"));
      std::unique_ptr<Client> client = MakeClient(true, streams);
      const int64_t before = Completed();
      absl::StatusOr<DownloadedTensor> got =
          client->Download(uploaded->handle, as);
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_EQ(AwaitCompleted(before + streams), before + streams);
      EXPECT_TRUE(got->data == reference->data);
      EXPECT_EQ(got->info.dtype, reference->info.dtype);
      std::vector<uint8_t> buffer(reference->data.size());
      absl::StatusOr<TensorInfo> into = client->DownloadInto(
          uploaded->handle, as, buffer.data(), buffer.size());
      ASSERT_TRUE(into.ok()) << into.status();
      EXPECT_TRUE(buffer == reference->data);
    }
  }
}

// A Download with a token: the same checks as an upload's, nothing changes;
// a missing connection ends it DEADLINE_EXCEEDED and a client that goes away
// mid-download ends it without harming the tensor.
TEST_F(DataConnectionTest, DownloadErrors) {
  Start(0, absl::Seconds(1));
  std::unique_ptr<Client> client = MakeClient(false);
  // More than the socket buffers of one connection hold (a few MiB on
  // loopback), so that a client going away fails the server's sends.
  const std::string bytes = RandomBytes(32 << 20, 21);
  absl::StatusOr<TensorInfo> uploaded =
      client->Upload(DType::kFloat32, {8 << 20}, bytes.data(), bytes.size());
  ASSERT_TRUE(uploaded.ok()) << uploaded.status();
  auto download = [&](const std::string& token, int connections,
                      bool read_header) {
    grpc::ClientContext context;
    pb::DownloadRequest request;
    request.set_handle(uploaded->handle);
    request.set_data_token(token);
    request.set_data_connections(connections);
    std::unique_ptr<grpc::ClientReader<pb::DownloadResponse>> reader =
        stub_->Download(&context, request);
    pb::DownloadResponse response;
    if (read_header) {
      EXPECT_TRUE(reader->Read(&response));
      EXPECT_TRUE(response.has_header());
    }
    while (reader->Read(&response)) {
    }
    return reader->Finish();
  };
  EXPECT_EQ(download(std::string(15, 't'), 0, false).error_code(),
            StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(download("", 2, false).error_code(), StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(download(Token('t'), 65, false).error_code(),
            StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(download(Token('u'), 1, true).error_code(),
            StatusCode::DEADLINE_EXCEEDED);
  {
    SCOPED_TRACE("the client goes away mid-download");
    const int fd = ConnectData();
    ASSERT_TRUE(SendAll(fd, Preamble(Token('v'), 0)));
    std::thread drop([fd] {
      char some[1000];
      recv(fd, some, sizeof(some), MSG_WAITALL);
      shutdown(fd, SHUT_RDWR);
      close(fd);
    });
    const grpc::Status status = download(Token('v'), 1, true);
    drop.join();
    EXPECT_FALSE(status.ok());
  }
  absl::StatusOr<DownloadedTensor> intact = client->Download(uploaded->handle);
  ASSERT_TRUE(intact.ok()) << intact.status();
  EXPECT_TRUE(std::string(intact->data.begin(), intact->data.end()) == bytes);
}

// Several uploads at once, each over its own data connection.
TEST_F(DataConnectionTest, ConcurrentUploads) {
  Start();
  constexpr int kUploads = 6;
  std::vector<std::string> payloads;
  for (int i = 0; i < kUploads; ++i) {
    payloads.push_back(RandomBytes((size_t{3} << 20) + 4 * i, 100 + i));
  }
  std::vector<absl::StatusOr<TensorInfo>> results(
      kUploads, absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (int i = 0; i < kUploads; ++i) {
    threads.emplace_back([&, i] {
      std::unique_ptr<Client> client = MakeClient();
      const int64_t elements = static_cast<int64_t>(payloads[i].size() / 4);
      results[i] = client->Upload(DType::kFloat32, {elements},
                                  payloads[i].data(), payloads[i].size());
    });
  }
  for (std::thread& thread : threads) thread.join();
  std::unique_ptr<Client> client = MakeClient();
  for (int i = 0; i < kUploads; ++i) {
    ASSERT_TRUE(results[i].ok()) << results[i].status();
    absl::StatusOr<DownloadedTensor> got = client->Download(results[i]->handle);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_TRUE(std::string(got->data.begin(), got->data.end()) == payloads[i]);
  }
  // Uploads and downloads.
  EXPECT_EQ(AwaitCompleted(2 * kUploads * kStreams), 2 * kUploads * kStreams);
}

// A server without data connections: the client uploads over gRPC, and a
// header with a token is FAILED_PRECONDITION.
TEST_F(DataConnectionTest, ServerWithoutDataPort) {
  Start(/*data_port=*/-1);
  EXPECT_EQ(server_->data_port(), 0);
  std::unique_ptr<Client> client = MakeClient();
  const std::string bytes = RandomBytes(1 << 20, 5);
  absl::StatusOr<TensorInfo> uploaded =
      client->Upload(DType::kFloat32, {1 << 18}, bytes.data(), bytes.size());
  ASSERT_TRUE(uploaded.ok()) << uploaded.status();

  absl::StatusOr<DownloadedTensor> got = client->Download(uploaded->handle);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(std::string(got->data.begin(), got->data.end()) == bytes);
  ASSERT_TRUE(client->Release(uploaded->handle).ok());

  RawDataUpload upload(stub_.get(), Token('a'), {4});
  upload.SendHeader();
  const grpc::Status status = upload.Finish();
  EXPECT_EQ(status.error_code(), StatusCode::FAILED_PRECONDITION)
      << status.error_message();
  ExpectEmptyStore();
}

// The bytes of a hand-driven upload arrive; the RPC returns the tensor.
TEST_F(DataConnectionTest, RawUploadCompletes) {
  Start();
  const std::string bytes = RandomBytes(4 * 1000, 11);
  RawDataUpload upload(stub_.get(), Token('b'), {10, 100});
  ASSERT_TRUE(upload.SendHeader());
  const int fd = ConnectData();
  ASSERT_GE(fd, 0);
  ASSERT_TRUE(SendAll(fd, Preamble(Token('b')) + bytes));
  shutdown(fd, SHUT_WR);  // the end of the part's bytes
  const grpc::Status status = upload.Finish();
  close(fd);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(upload.response().tensor().bytes(), 4000);
  EXPECT_EQ(server_->store()->Stats().tensors, 1);
}

// Three connections carry the stripes of one tensor (uneven splits), sent
// interleaved; one connection alone also works. The bytes land in order.
TEST_F(DataConnectionTest, RawUploadOverSeveralConnections) {
  Start();
  for (int count : {1, 3}) {
    SCOPED_TRACE(absl::StrCat(count, " connections"));
    const int64_t elements = 1001;
    const std::string bytes = RandomBytes(elements * 4, 13 + count);
    const std::string token = Token(static_cast<char>('0' + count));
    RawDataUpload upload(stub_.get(), token, {elements});
    upload.header()->mutable_header()->set_data_connections(count);
    ASSERT_TRUE(upload.SendHeader());
    std::vector<int> fds;
    std::vector<std::string> parts;
    for (int i = 0; i < count; ++i) {
      fds.push_back(ConnectData());
      const int64_t first = i * elements / count;
      const int64_t end = (i + 1) * elements / count;
      parts.push_back(bytes.substr(first * 4, (end - first) * 4));
      ASSERT_TRUE(SendAll(fds[i], Preamble(token, i)));
    }
    for (size_t at = 0; at < parts[0].size() + 100; at += 100) {
      for (int i = count - 1; i >= 0; --i) {
        if (at < parts[i].size()) {
          ASSERT_TRUE(SendAll(fds[i], parts[i].substr(at, 100)));
        }
      }
    }
    for (int fd : fds) shutdown(fd, SHUT_WR);
    const grpc::Status status = upload.Finish();
    for (int fd : fds) close(fd);
    ASSERT_TRUE(status.ok()) << status.error_message();
    std::unique_ptr<Client> client = MakeClient();
    absl::StatusOr<DownloadedTensor> got =
        client->Download(upload.response().tensor().handle());
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_TRUE(std::string(got->data.begin(), got->data.end()) == bytes);
  }
}

// One connection of several fails: the upload fails with its reason, the
// server closes the others, nothing is kept. A part claimed twice: the second
// connection is closed unread and the upload goes on.
TEST_F(DataConnectionTest, OneOfSeveralConnectionsFails) {
  Start();
  {
    SCOPED_TRACE("one connection ends early");
    RawDataUpload upload(stub_.get(), Token('p'), {4096});
    upload.header()->mutable_header()->set_data_connections(2);
    ASSERT_TRUE(upload.SendHeader());
    const int good = ConnectData();
    const int bad = ConnectData();
    ASSERT_TRUE(SendAll(good, Preamble(Token('p'), 0) + RandomBytes(100, 1)));
    ASSERT_TRUE(SendAll(bad, Preamble(Token('p'), 1) + RandomBytes(10, 2)));
    shutdown(bad, SHUT_WR);
    const grpc::Status status = upload.Finish();
    EXPECT_EQ(status.error_code(), StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(status.error_message().find("data connection 1 ended after 10"),
              std::string::npos)
        << status.error_message();
    EXPECT_TRUE(ClosedByServer(good, absl::Seconds(10)));
    close(good);
    close(bad);
    ExpectEmptyStore();
  }
  {
    SCOPED_TRACE("a part claimed twice");
    RawDataUpload upload(stub_.get(), Token('q'), {64});
    upload.header()->mutable_header()->set_data_connections(2);
    ASSERT_TRUE(upload.SendHeader());
    const int first = ConnectData();
    ASSERT_TRUE(SendAll(first, Preamble(Token('q'), 0)));
    absl::SleepFor(absl::Milliseconds(100));
    const int twice = ConnectData();
    ASSERT_TRUE(SendAll(twice, Preamble(Token('q'), 0)));
    EXPECT_TRUE(ClosedByServer(twice, absl::Seconds(10)));
    close(twice);
    const int second = ConnectData();
    ASSERT_TRUE(SendAll(first, RandomBytes(128, 3)));
    ASSERT_TRUE(SendAll(second, Preamble(Token('q'), 1) + RandomBytes(128, 4)));
    shutdown(first, SHUT_WR);
    shutdown(second, SHUT_WR);
    const grpc::Status status = upload.Finish();
    close(first);
    close(second);
    EXPECT_TRUE(status.ok()) << status.error_message();
  }
}

// The connection may come before the header that registers its token.
TEST_F(DataConnectionTest, ConnectionBeforeHeader) {
  Start();
  const std::string bytes = RandomBytes(4 * 64, 12);
  const int fd = ConnectData();
  ASSERT_GE(fd, 0);
  ASSERT_TRUE(SendAll(fd, Preamble(Token('c')) + bytes));
  shutdown(fd, SHUT_WR);
  absl::SleepFor(absl::Milliseconds(200));
  RawDataUpload upload(stub_.get(), Token('c'), {64});
  ASSERT_TRUE(upload.SendHeader());
  const grpc::Status status = upload.Finish();
  close(fd);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(server_->store()->Stats().tensors, 1);
}

// Every malformed header or stream: the right code, nothing stored.
TEST_F(DataConnectionTest, BadHeadersAndStreams) {
  Start();
  {
    SCOPED_TRACE("a token of 15 bytes");
    RawDataUpload upload(stub_.get(), std::string(15, 'd'), {4});
    upload.SendHeader();
    const grpc::Status status = upload.Finish();
    EXPECT_EQ(status.error_code(), StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(status.error_message().find("16 bytes"), std::string::npos)
        << status.error_message();
  }
  {
    SCOPED_TRACE("a token with a stripe");
    RawDataUpload upload(stub_.get(), Token('e'), {4});
    upload.header()->mutable_header()->mutable_stripe()->set_upload_id("u1");
    upload.header()->mutable_header()->mutable_stripe()->set_count(2);
    upload.SendHeader();
    const grpc::Status status = upload.Finish();
    EXPECT_EQ(status.error_code(), StatusCode::INVALID_ARGUMENT);
  }
  {
    SCOPED_TRACE("a chunk on the stream");
    RawDataUpload upload(stub_.get(), Token('f'), {4});
    upload.SendHeader(/*writes_done=*/false);
    upload.SendChunk(std::string(16, 'x'));
    const grpc::Status status = upload.Finish();
    EXPECT_EQ(status.error_code(), StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(status.error_message().find("chunk"), std::string::npos)
        << status.error_message();
  }
  {
    SCOPED_TRACE("65 data connections");
    RawDataUpload upload(stub_.get(), Token('r'), {4});
    upload.header()->mutable_header()->set_data_connections(65);
    upload.SendHeader();
    EXPECT_EQ(upload.Finish().error_code(), StatusCode::INVALID_ARGUMENT);
  }
  {
    SCOPED_TRACE("data connections without a token");
    RawDataUpload upload(stub_.get(), "", {4});
    upload.header()->mutable_header()->set_data_connections(2);
    upload.SendHeader();
    EXPECT_EQ(upload.Finish().error_code(), StatusCode::INVALID_ARGUMENT);
  }
  {
    SCOPED_TRACE("a bad shape with a token");
    RawDataUpload upload(stub_.get(), Token('g'), {0});
    upload.SendHeader();
    EXPECT_EQ(upload.Finish().error_code(), StatusCode::INVALID_ARGUMENT);
  }
  ExpectEmptyStore();
}

// A token registered twice: the second upload fails, the first completes.
TEST_F(DataConnectionTest, DuplicateToken) {
  Start();
  RawDataUpload first(stub_.get(), Token('h'), {8});
  ASSERT_TRUE(first.SendHeader());
  // The first header is registered once the server reserved its bytes.
  ASSERT_TRUE(server_->store()->AwaitUsedBytes(32, absl::Seconds(10)));
  RawDataUpload second(stub_.get(), Token('h'), {8});
  second.SendHeader();
  const grpc::Status refused = second.Finish();
  EXPECT_EQ(refused.error_code(), StatusCode::INVALID_ARGUMENT)
      << refused.error_message();
  const int fd = ConnectData();
  ASSERT_TRUE(SendAll(fd, Preamble(Token('h')) + RandomBytes(32, 1)));
  shutdown(fd, SHUT_WR);
  const grpc::Status status = first.Finish();
  close(fd);
  EXPECT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(server_->store()->Stats().tensors, 1);
}

// The connection ends before all bytes: INVALID_ARGUMENT naming the count.
TEST_F(DataConnectionTest, ShortConnection) {
  Start();
  RawDataUpload upload(stub_.get(), Token('i'), {1 << 20});
  ASSERT_TRUE(upload.SendHeader());
  const int fd = ConnectData();
  ASSERT_TRUE(SendAll(fd, Preamble(Token('i')) + RandomBytes(1000, 2)));
  shutdown(fd, SHUT_WR);
  const grpc::Status status = upload.Finish();
  close(fd);
  EXPECT_EQ(status.error_code(), StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(status.error_message().find("after 1000 of"), std::string::npos)
      << status.error_message();
  ExpectEmptyStore();
}

// No connection comes, or it stalls: DEADLINE_EXCEEDED after data_timeout.
TEST_F(DataConnectionTest, MissingOrStalledConnection) {
  Start(0, absl::Seconds(1));
  {
    SCOPED_TRACE("no connection");
    RawDataUpload upload(stub_.get(), Token('j'), {4});
    ASSERT_TRUE(upload.SendHeader());
    const absl::Time start = absl::Now();
    const grpc::Status status = upload.Finish();
    EXPECT_EQ(status.error_code(), StatusCode::DEADLINE_EXCEEDED)
        << status.error_message();
    EXPECT_LT(absl::Now() - start, absl::Seconds(20));
  }
  {
    SCOPED_TRACE("one of two connections never comes");
    RawDataUpload upload(stub_.get(), Token('s'), {64});
    upload.header()->mutable_header()->set_data_connections(2);
    ASSERT_TRUE(upload.SendHeader());
    const int fd = ConnectData();
    ASSERT_TRUE(SendAll(fd, Preamble(Token('s'), 0) + RandomBytes(128, 3)));
    const grpc::Status status = upload.Finish();
    EXPECT_EQ(status.error_code(), StatusCode::DEADLINE_EXCEEDED)
        << status.error_message();
    close(fd);
  }
  {
    SCOPED_TRACE("a stalled connection");
    RawDataUpload upload(stub_.get(), Token('k'), {1024});
    ASSERT_TRUE(upload.SendHeader());
    const int fd = ConnectData();
    ASSERT_TRUE(SendAll(fd, Preamble(Token('k')) + RandomBytes(100, 3)));
    const grpc::Status status = upload.Finish();
    EXPECT_EQ(status.error_code(), StatusCode::DEADLINE_EXCEEDED)
        << status.error_message();
    EXPECT_TRUE(ClosedByServer(fd, absl::Seconds(10)));
    close(fd);
  }
  ExpectEmptyStore();
}

// Connections that name no registered token, or do not start with the
// magic, are closed unread; real uploads go on.
TEST_F(DataConnectionTest, StrangersAreClosed) {
  Start(0, absl::Seconds(1));
  const int unknown = ConnectData();
  ASSERT_TRUE(SendAll(unknown, Preamble(Token('l')) + "bytes"));
  const int garbage = ConnectData();
  ASSERT_TRUE(SendAll(garbage, std::string(24, 'z')));
  EXPECT_TRUE(ClosedByServer(garbage, absl::Seconds(10)));
  EXPECT_TRUE(ClosedByServer(unknown, absl::Seconds(20)));
  close(unknown);
  close(garbage);
  std::unique_ptr<Client> client = MakeClient();
  const std::string bytes = RandomBytes(4096, 4);
  absl::StatusOr<TensorInfo> uploaded =
      client->Upload(DType::kFloat32, {1024}, bytes.data(), bytes.size());
  ASSERT_TRUE(uploaded.ok()) << uploaded.status();
  EXPECT_EQ(Completed(), kStreams);
}

// The client cancels while its bytes are in flight: the server closes the
// connection, the RPC ends CANCELLED and nothing is kept.
TEST_F(DataConnectionTest, CancelledMidTransfer) {
  Start();
  RawDataUpload upload(stub_.get(), Token('m'), {16 << 20});
  ASSERT_TRUE(upload.SendHeader());
  const int fd = ConnectData();
  ASSERT_TRUE(SendAll(fd, Preamble(Token('m')) + RandomBytes(1 << 20, 5)));
  upload.context()->TryCancel();
  const grpc::Status status = upload.Finish();
  EXPECT_EQ(status.error_code(), StatusCode::CANCELLED);
  EXPECT_TRUE(ClosedByServer(fd, absl::Seconds(10)));
  close(fd);
  ExpectEmptyStore();
}

// An upload cancelled before its connection came leaves the data plane's
// registry at the next sweep (not at its data_timeout), and a connection that
// comes for it later is closed unread.
TEST_F(DataConnectionTest, CancelledBeforeConnectionIsForgotten) {
  Start(0, /*data_timeout=*/absl::Seconds(4));
  RawDataUpload upload(stub_.get(), Token('q'), {1024});
  ASSERT_TRUE(upload.SendHeader(/*writes_done=*/false));
  ASSERT_TRUE(AwaitRegistered(1, absl::Seconds(10)));
  upload.context()->TryCancel();
  EXPECT_EQ(upload.Finish().error_code(), StatusCode::CANCELLED);
  // Well before the data timeout (the sweep runs every 250 ms).
  EXPECT_TRUE(AwaitRegistered(0, absl::Seconds(2.5)));
  const int late = ConnectData();
  ASSERT_TRUE(SendAll(late, Preamble(Token('q')) + RandomBytes(4096, 6)));
  EXPECT_TRUE(ClosedByServer(late, absl::Seconds(10)));
  close(late);
  ExpectEmptyStore();
  EXPECT_EQ(Completed(), 0);
}

// A request the server refuses closes the data connections that come with
// its token at once, rather than holding them for the registration wait
// (10 s): a client blocked sending learns of the refusal without that delay.
TEST_F(DataConnectionTest, RefusedRequestsCloseTheirConnectionsAtOnce) {
  Start();
  {
    SCOPED_TRACE("an upload over the memory budget");
    RawDataUpload upload(stub_.get(), Token('r'), {kBudget});
    ASSERT_TRUE(upload.SendHeader());
    EXPECT_EQ(upload.Finish().error_code(), StatusCode::RESOURCE_EXHAUSTED);
    const int fd = ConnectData();
    ASSERT_TRUE(SendAll(fd, Preamble(Token('r')) + RandomBytes(4096, 9)));
    EXPECT_TRUE(ClosedByServer(fd, absl::Seconds(3)));
    close(fd);
  }
  {
    SCOPED_TRACE("an evaluation naming class weights that do not exist");
    std::unique_ptr<Client> client = MakeClient();
    // 64 MiB, more than the connections' socket buffers hold: the client's
    // sends wait until the server reads or closes.
    const int64_t rows = 256, vocab = 65536;
    const std::vector<float> logits(static_cast<size_t>(rows * vocab), 0.0f);
    const std::vector<int64_t> targets(static_cast<size_t>(rows), 0);
    EvaluateOptions options;
    options.class_weights = "00000000-0123456789abcdef0123456789abcdef";
    const absl::Time start = absl::Now();
    absl::StatusOr<EvaluateResult> result =
        client->Evaluate(rows, vocab, DType::kFloat32, logits.data(),
                         DType::kInt64, targets.data(), options);
    EXPECT_EQ(result.status().code(), absl::StatusCode::kNotFound)
        << result.status();
    EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  }
  ExpectEmptyStore();
  EXPECT_EQ(server_->data_plane()->registered(), 0);
}

// A server that stops (drains) while an upload waits for its connection ends
// that RPC and stops listening.
TEST_F(DataConnectionTest, DrainEndsWaitingUploads) {
  Start(0, absl::Seconds(30), /*drain_timeout=*/absl::Milliseconds(500));
  RawDataUpload upload(stub_.get(), Token('n'), {1024});
  ASSERT_TRUE(upload.SendHeader());
  ASSERT_TRUE(server_->store()->AwaitUsedBytes(4096, absl::Seconds(10)));
  std::thread drain([this] { server_->Drain(); });
  const grpc::Status status = upload.Finish();
  drain.join();
  EXPECT_FALSE(status.ok());
  ExpectEmptyStore();
  // Nothing listens on the data port any more.
  EXPECT_FALSE(
      ConnectDataPort("127.0.0.1", server_->data_port(), absl::Seconds(2))
          .ok());
}

// The CUDA device receives into its pinned staging windows (4 MiB by
// default), one pipeline per upload: uploads of several windows and odd
// sizes, at once, land intact, and a cancelled one leaves nothing. Skipped
// without a GPU.
TEST_F(DataConnectionTest, CudaUploadsLandIntact) {
  if (const absl::Status cuda = e2e_test::CudaServerAvailable(); !cuda.ok()) {
    GTEST_SKIP() << "no CUDA device: " << cuda;
  }
  Start(0, absl::Seconds(30), absl::Seconds(10), "cuda");
  std::vector<std::string> payloads;
  for (int64_t bytes : {int64_t{2}, (int64_t{13} << 20) + 6, int64_t{8} << 20,
                        (int64_t{4} << 20) - 2}) {
    payloads.push_back(RandomBytes(static_cast<size_t>(bytes), 80 + bytes));
  }
  std::vector<absl::StatusOr<TensorInfo>> results(
      payloads.size(), absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (size_t i = 0; i < payloads.size(); ++i) {
    threads.emplace_back([&, i] {
      std::unique_ptr<Client> client = MakeClient();
      const int64_t elements = static_cast<int64_t>(payloads[i].size() / 2);
      results[i] = client->Upload(DType::kBFloat16, {elements},
                                  payloads[i].data(), payloads[i].size());
    });
  }
  for (std::thread& thread : threads) thread.join();
  std::unique_ptr<Client> client = MakeClient();
  for (size_t i = 0; i < payloads.size(); ++i) {
    ASSERT_TRUE(results[i].ok()) << results[i].status();
    absl::StatusOr<DownloadedTensor> got = client->Download(results[i]->handle);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_TRUE(std::string(got->data.begin(), got->data.end()) == payloads[i])
        << "upload " << i;
    ASSERT_TRUE(client->Release(results[i]->handle).ok());
  }
  // Every upload and download over kStreams connections, but the download
  // of the single element (one gRPC stream).
  const int64_t both_ways =
      (2 * static_cast<int64_t>(payloads.size()) - 1) * kStreams;
  EXPECT_EQ(AwaitCompleted(both_ways), both_ways);

  RawDataUpload upload(stub_.get(), Token('o'), {16 << 20});
  ASSERT_TRUE(upload.SendHeader());
  const int fd = ConnectData();
  ASSERT_TRUE(SendAll(fd, Preamble(Token('o')) + RandomBytes(9 << 20, 6)));
  upload.context()->TryCancel();
  EXPECT_EQ(upload.Finish().error_code(), StatusCode::CANCELLED);
  EXPECT_TRUE(ClosedByServer(fd, absl::Seconds(10)));
  close(fd);
  ExpectEmptyStore();
}

// The CUDA device behind every data path: Evaluate over one connection gives
// the stream's bits and over three the same bits twice; a gradient (grad
// output 0.5 pending) comes back over data connections, converted to bf16 on
// the device, byte for byte as over gRPC. Skipped without a GPU.
TEST_F(DataConnectionTest, CudaDataPathsMatchTheStream) {
  if (const absl::Status cuda = e2e_test::CudaServerAvailable(); !cuda.ok()) {
    GTEST_SKIP() << "no CUDA device: " << cuda;
  }
  Start(0, absl::Seconds(30), absl::Seconds(10), "cuda");
  const int64_t rows = 67, vocab = 32003;  // uneven splits and blocks
  std::mt19937 random(13);
  RandomRows data = MakeRandomRows(rows, vocab, 9, random);
  std::vector<float>& logits = data.logits;
  std::vector<int64_t>& targets = data.targets;
  EvaluateOptions options;
  options.loss.label_smoothing = 0.05;
  auto evaluate = [&](Client* client) {
    absl::StatusOr<EvaluateResult> result = client->Evaluate(
        rows, vocab, DType::kFloat32, logits.data(), DType::kInt64,
        targets.data(), options, /*block_rows=*/8);
    EXPECT_TRUE(result.ok()) << result.status();
    return result.ok() ? *result : EvaluateResult{};
  };
  std::unique_ptr<Client> grpc_only = MakeClient(false);
  const EvaluateResult streamed = evaluate(grpc_only.get());
  EXPECT_EQ(streamed.rows, rows);
  EXPECT_EQ(evaluate(MakeClient(true, 1).get()).loss, streamed.loss);
  std::unique_ptr<Client> three = MakeClient(true, 3);
  const EvaluateResult first = evaluate(three.get());
  EXPECT_EQ(evaluate(three.get()).loss, first.loss);
  EXPECT_EQ(first.loss, streamed.loss);  // blocks added in block order

  std::unique_ptr<Client> client = MakeClient();
  absl::StatusOr<TensorInfo> uploaded =
      client->Upload(DType::kFloat32, {rows, vocab}, logits.data(),
                     logits.size() * sizeof(float));
  ASSERT_TRUE(uploaded.ok()) << uploaded.status();
  absl::StatusOr<ForwardResult> forward = client->Forward(
      uploaded->handle,
      Targets::Inline(DType::kInt64, targets.data(), targets.size() * 8));
  ASSERT_TRUE(forward.ok()) << forward.status();
  ASSERT_TRUE(client->Backward(forward->gradient, 0.5).ok());
  const int64_t before = Completed();
  absl::StatusOr<DownloadedTensor> over_data =
      client->Download(forward->gradient, DType::kBFloat16);
  ASSERT_TRUE(over_data.ok()) << over_data.status();
  EXPECT_EQ(AwaitCompleted(before + kStreams), before + kStreams);
  absl::StatusOr<DownloadedTensor> over_grpc =
      grpc_only->Download(forward->gradient, DType::kBFloat16);
  ASSERT_TRUE(over_grpc.ok()) << over_grpc.status();
  EXPECT_TRUE(over_data->data == over_grpc->data);
  EXPECT_EQ(over_data->info.pending_scale, 0.5);
  ASSERT_TRUE(client->Release(forward->gradient).ok());
  ExpectEmptyStore();
}

// Evaluate over data connections gives the stream's bits for the same
// blocks, over one connection or three (the blocks' sums are added in block

}  // namespace
}  // namespace data_connection_test
}  // namespace lossd
