// Data connections (issue 4): an Upload whose bytes come over a plain TCP
// connection to the data port instead of gRPC chunks, through lossd::Client
// and driven by hand over loopback, with every way the connection or the
// stream can go wrong leaving the store as it was.
#include "client/data_connection.h"

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
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "lossd/v1/lossd.grpc.pb.h"
#include "server/data_plane.h"
#include "server/server.h"
#include "tests/e2e/bytes.h"
#include "tests/e2e/test_server.h"

namespace lossd {
namespace {

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
RandomRows MakeRandomRows(int64_t rows, int64_t vocab, int ignore_every,
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

std::string Token(char fill) { return std::string(16, fill); }

// The first 28 bytes of data connection `index` of an upload.
std::string Preamble(const std::string& token, uint32_t index = 0) {
  std::string preamble = std::string(kMagic, 8) + token;
  for (int shift = 0; shift < 32; shift += 8) {
    preamble.push_back(static_cast<char>((index >> shift) & 0xff));
  }
  return preamble;
}

bool SendAll(int fd, const std::string& bytes) {
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
bool ClosedByServer(int fd, absl::Duration timeout) {
  const timeval limit = absl::ToTimeval(timeout);
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &limit, sizeof(limit));
  char byte = 0;
  const ssize_t n = recv(fd, &byte, 1, 0);
  return n == 0 || (n < 0 && errno == ECONNRESET);
}

// lossd::Client takes the data connection for large tensors when the server
// offers it; the bytes come back unchanged, for sizes around the staging and
// window boundaries and odd element counts.
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
  std::vector<int64_t>& targets = data.targets;
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
// order however many connections carried them), with class weights.
TEST_F(DataConnectionTest, EvaluateMatchesTheStream) {
  Start();
  const int64_t rows = 53, vocab = 2053;
  std::mt19937 random(11);
  RandomRows data = MakeRandomRows(rows, vocab, 7, random);
  std::vector<float>& logits = data.logits;
  std::vector<int64_t>& targets = data.targets;
  std::vector<float> weights(static_cast<size_t>(vocab));
  std::uniform_real_distribution<float> uniform(0.3f, 3.0f);
  for (float& w : weights) w = uniform(random);
  absl::StatusOr<TensorInfo> weights_handle = MakeClient(false)->Upload(
      DType::kFloat32, {vocab}, weights.data(), weights.size() * sizeof(float));
  ASSERT_TRUE(weights_handle.ok()) << weights_handle.status();
  EvaluateOptions options;
  options.loss.label_smoothing = 0.1;
  options.loss.z_loss_scale = 1e-4;
  options.class_weights = weights_handle->handle;
  auto evaluate = [&](Client* client) {
    absl::StatusOr<EvaluateResult> result = client->Evaluate(
        rows, vocab, DType::kFloat32, logits.data(), DType::kInt64,
        targets.data(), options, /*block_rows=*/5);
    EXPECT_TRUE(result.ok()) << result.status();
    return result.ok() ? *result : EvaluateResult{};
  };
  const EvaluateResult streamed = evaluate(MakeClient(false).get());
  EXPECT_EQ(streamed.rows, rows);
  {
    SCOPED_TRACE("1 connection");
    const int64_t before = Completed();
    const EvaluateResult one = evaluate(MakeClient(true, 1).get());
    EXPECT_EQ(Completed(), before + 1);
    EXPECT_EQ(one.loss, streamed.loss);
    EXPECT_EQ(one.z_loss, streamed.z_loss);
    EXPECT_EQ(one.valid_tokens, streamed.valid_tokens);
    EXPECT_EQ(one.correct_tokens, streamed.correct_tokens);
    EXPECT_EQ(one.denominator, streamed.denominator);
  }
  {
    SCOPED_TRACE("3 connections");
    std::unique_ptr<Client> client = MakeClient(true, 3);
    const int64_t before = Completed();
    const EvaluateResult first = evaluate(client.get());
    const EvaluateResult second = evaluate(client.get());
    EXPECT_EQ(Completed(), before + 6);
    EXPECT_EQ(first.loss, second.loss);
    EXPECT_EQ(first.z_loss, second.z_loss);
    EXPECT_EQ(first.loss, streamed.loss);
    EXPECT_EQ(first.z_loss, streamed.z_loss);
    EXPECT_EQ(first.rows, rows);
    EXPECT_EQ(first.valid_tokens, streamed.valid_tokens);
    EXPECT_EQ(first.correct_tokens, streamed.correct_tokens);
    EXPECT_EQ(first.denominator, streamed.denominator);
  }
  ASSERT_TRUE(MakeClient(false)->Release(weights_handle->handle).ok());
  ExpectEmptyStore();
}

// lossd::Client frames only whole rows: an empty block is skipped (as the
// stream would evaluate nothing for it), a block of partial rows is refused
// before it is sent.
TEST_F(DataConnectionTest, EvaluateClientChecksBlocks) {
  Start();
  std::unique_ptr<Client> client = MakeClient(true, 2);
  const int64_t vocab = 8;
  // Rows the producer keeps and points its blocks at.
  const std::string kept_logits(3 * vocab * 4, '\0');
  const std::string kept_targets(3 * 8, '\0');
  int produced = 0;
  auto blocks = [&](bool partial) {
    produced = 0;
    return [&, partial](RowBlock* block) -> absl::StatusOr<bool> {
      switch (produced++) {
        case 0:  // empty
          return true;
        case 1:
          block->logits.assign(3 * vocab * 4, '\0');
          block->targets.assign(3 * 8, '\0');
          return true;
        case 2:  // views of the kept rows
          block->logits_view = kept_logits;
          block->targets_view = kept_targets;
          return true;
        case 3:
          if (!partial) return false;
          block->logits_view =
              absl::string_view(kept_logits.data(), vocab * 4 + 1);
          block->targets_view = absl::string_view(kept_targets.data(), 8);
          return true;
        default:
          return false;
      }
    };
  };
  // A known size: the blocks go over the data connections.
  EvaluateOptions known;
  known.total_rows = 6;
  const int64_t before = Completed();
  absl::StatusOr<EvaluateResult> whole = client->Evaluate(
      vocab, DType::kFloat32, DType::kInt64, known, blocks(false));
  ASSERT_TRUE(whole.ok()) << whole.status();
  EXPECT_EQ(Completed(), before + 2);
  EXPECT_EQ(whole->rows, 6);
  EXPECT_NEAR(whole->loss, std::log(8.0), 1e-6);
  known.total_rows = 7;
  absl::StatusOr<EvaluateResult> partial = client->Evaluate(
      vocab, DType::kFloat32, DType::kInt64, known, blocks(true));
  EXPECT_EQ(partial.status().code(), absl::StatusCode::kInvalidArgument)
      << partial.status();
  EXPECT_NE(partial.status().message().find("block 3"), std::string::npos)
      << partial.status();
  // An unknown size: the same blocks on the stream.
  absl::StatusOr<EvaluateResult> streamed = client->Evaluate(
      vocab, DType::kFloat32, DType::kInt64, EvaluateOptions(), blocks(false));
  ASSERT_TRUE(streamed.ok()) << streamed.status();
  EXPECT_EQ(streamed->rows, 6);
  EXPECT_EQ(streamed->loss, whole->loss);
}

// An Evaluate stream driven by hand: a header with a data token.
class RawDataEvaluate {
 public:
  RawDataEvaluate(pb::Lossd::Stub* stub, const std::string& token,
                  int connections, int64_t vocab) {
    writer_ = stub->Evaluate(&context_, &response_);
    pb::EvaluateHeader* header = request_.mutable_header();
    header->set_vocab(vocab);
    header->set_logits_dtype(pb::DTYPE_FLOAT32);
    header->set_targets_dtype(pb::DTYPE_INT64);
    header->set_data_token(token);
    header->set_data_connections(connections);
  }
  grpc::ClientContext* context() { return &context_; }
  bool SendHeader(bool writes_done = true) {
    return writer_->Write(request_) && (!writes_done || writer_->WritesDone());
  }
  bool SendBlock() {
    pb::EvaluateRequest block;
    block.mutable_block()->set_logits(std::string(8, '\0'));
    block.mutable_block()->set_targets(std::string(8, '\0'));
    return writer_->Write(block);
  }
  grpc::Status Finish() { return writer_->Finish(); }

 private:
  grpc::ClientContext context_;
  pb::EvaluateResponse response_;
  pb::EvaluateRequest request_;
  std::unique_ptr<grpc::ClientWriter<pb::EvaluateRequest>> writer_;
};

// A frame of `rows` rows of `vocab` fp32 zeros and int64 targets 0, cut to
// `keep` bytes (all when negative).
std::string Frame(int64_t rows, int64_t vocab, int64_t keep = -1) {
  std::string frame(8, '\0');
  for (int i = 0; i < 8; ++i) {
    frame[static_cast<size_t>(i)] =
        static_cast<char>((static_cast<uint64_t>(rows) >> (8 * i)) & 0xff);
  }
  int64_t payload = std::max<int64_t>(0, rows) * (vocab * 4 + 8);
  if (keep >= 0) payload = std::min(payload, std::max<int64_t>(0, keep - 8));
  frame.append(static_cast<size_t>(payload), '\0');
  if (keep >= 0 && keep < 8) frame.resize(static_cast<size_t>(keep));
  return frame;
}

// What can go wrong with an Evaluate over data connections, each a clear
// error that leaves nothing behind.
TEST_F(DataConnectionTest, EvaluateErrors) {
  Start(0, absl::Seconds(2));
  constexpr int64_t kVocab = 16;
  struct Case {
    const char* what;
    std::string sent;  // after the preamble
    StatusCode code;
    const char* says;
  };
  const Case cases[] = {
      {"a frame of 0 rows", Frame(0, kVocab), StatusCode::INVALID_ARGUMENT,
       "0 rows"},
      {"an absurd row count", Frame(int64_t{1} << 40, kVocab, 8),
       StatusCode::INVALID_ARGUMENT, "a frame holds"},
      {"a connection ending inside a frame", Frame(2, kVocab, 20),
       StatusCode::INVALID_ARGUMENT, "ended after 12 of the"},
      {"a connection ending inside a row count", Frame(2, kVocab, 3),
       StatusCode::INVALID_ARGUMENT, "row count"},
      {"no frames at all", "", StatusCode::INVALID_ARGUMENT, "no rows"},
  };
  char fill = 'A';
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    const std::string token = Token(fill++);
    RawDataEvaluate evaluate(stub_.get(), token, 1, kVocab);
    ASSERT_TRUE(evaluate.SendHeader());
    const int fd = ConnectData();
    ASSERT_TRUE(SendAll(fd, Preamble(token) + c.sent));
    shutdown(fd, SHUT_WR);
    const grpc::Status status = evaluate.Finish();
    close(fd);
    EXPECT_EQ(status.error_code(), c.code) << status.error_message();
    EXPECT_NE(status.error_message().find(c.says), std::string::npos)
        << status.error_message();
  }
  {
    SCOPED_TRACE("a block on the stream too");
    RawDataEvaluate evaluate(stub_.get(), Token('x'), 1, 1);
    ASSERT_TRUE(evaluate.SendHeader(/*writes_done=*/false));
    evaluate.SendBlock();
    const grpc::Status status = evaluate.Finish();
    EXPECT_EQ(status.error_code(), StatusCode::INVALID_ARGUMENT)
        << status.error_message();
  }
  {
    SCOPED_TRACE("cancelled while the connections run");
    RawDataEvaluate evaluate(stub_.get(), Token('y'), 2, kVocab);
    ASSERT_TRUE(evaluate.SendHeader());
    const int fd = ConnectData();
    ASSERT_TRUE(SendAll(fd, Preamble(Token('y')) + Frame(3, kVocab)));
    evaluate.context()->TryCancel();
    EXPECT_EQ(evaluate.Finish().error_code(), StatusCode::CANCELLED);
    close(fd);
  }
  {
    SCOPED_TRACE("a connection that never comes");
    RawDataEvaluate evaluate(stub_.get(), Token('z'), 2, kVocab);
    ASSERT_TRUE(evaluate.SendHeader());
    const int fd = ConnectData();
    ASSERT_TRUE(SendAll(fd, Preamble(Token('z')) + Frame(3, kVocab)));
    shutdown(fd, SHUT_WR);
    EXPECT_EQ(evaluate.Finish().error_code(), StatusCode::DEADLINE_EXCEEDED);
    close(fd);
  }
  ExpectEmptyStore();
  EXPECT_TRUE(AwaitRegistered(0, absl::Seconds(5)));
}

// An Evaluate's block buffers on the device count against the memory budget
// while it runs: blocks larger than the budget leaves are RESOURCE_EXHAUSTED,
// over data connections and on the stream, and leave nothing behind.
TEST_F(DataConnectionTest, EvaluateBlocksCountAgainstTheBudget) {
  Start(0, absl::Seconds(30), absl::Seconds(10), "cpu", /*budget=*/1 << 20);
  const int64_t rows = 8, vocab = 65536;  // 2 MiB of fp32 logits a block
  const std::vector<float> logits(static_cast<size_t>(rows * vocab), 0.0f);
  const std::vector<int64_t> targets(static_cast<size_t>(rows), 0);
  for (bool data_connection : {true, false}) {
    SCOPED_TRACE(data_connection ? "over data connections" : "on the stream");
    absl::StatusOr<EvaluateResult> result =
        MakeClient(data_connection)
            ->Evaluate(rows, vocab, DType::kFloat32, logits.data(),
                       DType::kInt64, targets.data(), EvaluateOptions(),
                       /*block_rows=*/8);
    EXPECT_EQ(result.status().code(), absl::StatusCode::kResourceExhausted)
        << result.status();
    EXPECT_NE(result.status().message().find("memory budget"),
              std::string::npos)
        << result.status();
  }
  // Blocks that fit it are evaluated.
  absl::StatusOr<EvaluateResult> small = MakeClient()->Evaluate(
      rows, vocab, DType::kFloat32, logits.data(), DType::kInt64,
      targets.data(), EvaluateOptions(), /*block_rows=*/1);
  ASSERT_TRUE(small.ok()) << small.status();
  EXPECT_EQ(small->rows, rows);
  ExpectEmptyStore();
}

// Frames that come ahead of their turn wait for the blocks before them, up
// to 65536 of them: a connection that runs that far ahead of another fails
// the evaluation.
TEST_F(DataConnectionTest, EvaluateConnectionsKeepInStep) {
  Start();
  constexpr int64_t kVocab = 16;
  RawDataEvaluate evaluate(stub_.get(), Token('w'), 2, kVocab);
  ASSERT_TRUE(evaluate.SendHeader());
  const int idle = ConnectData();
  ASSERT_TRUE(SendAll(idle, Preamble(Token('w'), 0)));
  const int ahead = ConnectData();
  std::string frames = Preamble(Token('w'), 1);
  const std::string frame = Frame(1, kVocab);
  for (int i = 0; i <= 65536; ++i) frames += frame;
  SendAll(ahead, frames);  // the server may close it before the end
  const grpc::Status status = evaluate.Finish();
  EXPECT_EQ(status.error_code(), StatusCode::INVALID_ARGUMENT)
      << status.error_message();
  EXPECT_NE(status.error_message().find("65536 frames ahead"),
            std::string::npos)
      << status.error_message();
  close(idle);
  close(ahead);
  ExpectEmptyStore();
}

// At the cap of connections served at once, further connections wait in the
// listen backlog until a served one ends, instead of being turned away: a
// transfer with more parts than the cap still completes.
TEST(DataPlaneTest, ConnectionsBeyondTheCapWait) {
  DataPlane::Options options;
  options.host = "127.0.0.1";
  options.timeout = absl::Seconds(20);
  options.max_connections = 1;
  absl::StatusOr<std::unique_ptr<DataPlane>> plane = DataPlane::Start(options);
  ASSERT_TRUE(plane.ok()) << plane.status();
  constexpr int kParts = 3;
  constexpr int64_t kPartBytes = 2 << 20;  // more than the socket buffers
  const std::string bytes = RandomBytes(kParts * kPartBytes, 7);
  std::string into(bytes.size(), '\0');
  std::vector<DataTransfer::Range> ranges;
  for (int i = 0; i < kParts; ++i)
    ranges.push_back({i * kPartBytes, kPartBytes});
  absl::Notification done;
  absl::Status outcome;
  absl::StatusOr<std::shared_ptr<DataTransfer>> transfer = (*plane)->Expect(
      Token('w'), ranges,
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
          ConnectDataPort("127.0.0.1", (*plane)->port(), absl::Seconds(5));
      ASSERT_TRUE(fd.ok()) << fd.status();
      EXPECT_TRUE(SendOverDataConnection(*fd, Token('w'), i,
                                         bytes.data() + i * kPartBytes,
                                         kPartBytes, nullptr)
                      .ok());
      // Until the server closes it: the part was received.
      EXPECT_TRUE(ClosedByServer(*fd, absl::Seconds(15)));
      close(*fd);
    });
  }
  for (std::thread& sender : senders) sender.join();
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(15)));
  EXPECT_TRUE(outcome.ok()) << outcome;
  EXPECT_TRUE(into == bytes);
  EXPECT_EQ((*plane)->completed(), kParts);
}

// A data connection on which nothing arrives (or nothing is taken) for its
// io_timeout fails DEADLINE_EXCEEDED, not as a broken connection.
TEST(DataConnectionTimeoutTest, NoProgressIsDeadlineExceeded) {
  const int listener = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(listener, 0);
  sockaddr_in address = {};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(
      bind(listener, reinterpret_cast<sockaddr*>(&address), sizeof(address)),
      0);
  ASSERT_EQ(listen(listener, 4), 0);
  socklen_t length = sizeof(address);
  ASSERT_EQ(
      getsockname(listener, reinterpret_cast<sockaddr*>(&address), &length), 0);
  // The kernel completes the connection; nobody ever reads or writes it.
  absl::StatusOr<int> fd =
      ConnectDataPort("127.0.0.1", ntohs(address.sin_port), absl::Seconds(5),
                      absl::Milliseconds(200));
  ASSERT_TRUE(fd.ok()) << fd.status();
  std::string into(16, '\0');
  const absl::Status received =
      ReceiveOverDataConnection(*fd, into.data(), into.size(), nullptr);
  EXPECT_EQ(received.code(), absl::StatusCode::kDeadlineExceeded) << received;
  // Sends stall once the socket buffers are full.
  const std::string big(64 << 20, 'x');
  const absl::Status sent = SendOverDataConnection(
      *fd, std::string(16, 't'), 0, big.data(), big.size(), nullptr);
  EXPECT_EQ(sent.code(), absl::StatusCode::kDeadlineExceeded) << sent;
  close(*fd);
  close(listener);
}

TEST(TargetHostTest, ParsesTargets) {
  EXPECT_EQ(TargetHost("127.0.0.1:50051"), "127.0.0.1");
  EXPECT_EQ(TargetHost("lossd-0.lossd:50051"), "lossd-0.lossd");
  EXPECT_EQ(TargetHost("dns:///lossd.svc:50051"), "lossd.svc");
  EXPECT_EQ(TargetHost("dns://8.8.8.8/lossd.svc:50051"), "lossd.svc");
  EXPECT_EQ(TargetHost("ipv4:10.0.0.1:50051"), "10.0.0.1");
  EXPECT_EQ(TargetHost("[::1]:50051"), "::1");
  EXPECT_EQ(TargetHost("ipv6:[::1]:50051"), "::1");
  EXPECT_EQ(TargetHost("localhost"), "localhost");
  EXPECT_EQ(TargetHost("unix:/tmp/lossd.sock"), std::nullopt);
  EXPECT_EQ(TargetHost("ipv4:10.0.0.1:1,10.0.0.2:1"), std::nullopt);
  EXPECT_EQ(TargetHost("xds:///lossd"), std::nullopt);
  EXPECT_EQ(TargetHost(""), std::nullopt);
}

}  // namespace
}  // namespace lossd
