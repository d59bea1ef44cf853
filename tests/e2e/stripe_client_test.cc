// lossd::Client's striped Upload (issue 4) against an in-process server:
// uneven splits, empty stripes, progress, the budget, concurrent uploads.
#include <atomic>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "lossd/v1/lossd.grpc.pb.h"
#include "server/server.h"
#include "tests/e2e/bytes.h"
#include "tests/e2e/scrape.h"
#include "tests/e2e/test_server.h"

namespace lossd {
namespace {

constexpr int64_t kBudget = 64 << 20;

using e2e_test::RandomBytes;

class StripeTest : public ::testing::Test {
 protected:
  void Start(absl::Duration stripe_timeout = absl::Seconds(30),
             int64_t budget = kBudget, bool metrics = false) {
    ServerConfig config =
        e2e_test::LoopbackConfig("cpu", budget, absl::Seconds(10));
    config.stripe_timeout = stripe_timeout;
    if (metrics) config.metrics_port = 0;  // a free port
    absl::StatusOr<std::unique_ptr<LossdServer>> server =
        LossdServer::Start(config);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
  }

  std::unique_ptr<Client> MakeClient(int streams, const std::string& token) {
    ClientOptions options;
    options.upload_streams = streams;
    options.stripe_min_bytes = 1;
    options.chunk_bytes = 64 << 10;
    options.bearer_token = token;
    absl::StatusOr<std::unique_ptr<Client>> client =
        Client::Connect(server_->address(), options);
    EXPECT_TRUE(client.ok()) << client.status();
    return client.ok() ? *std::move(client) : nullptr;
  }

  std::string Download(const std::string& handle) {
    std::unique_ptr<Client> client = MakeClient(1, "");
    absl::StatusOr<DownloadedTensor> got = client->Download(handle);
    EXPECT_TRUE(got.ok()) << got.status();
    if (!got.ok()) return "";
    return std::string(got->data.begin(), got->data.end());
  }

  void ExpectStore(int64_t tensors, int64_t bytes) {
    EXPECT_TRUE(server_->store()->AwaitUsedBytes(bytes, absl::Seconds(10)))
        << "expected " << bytes << " bytes used";
    EXPECT_EQ(server_->store()->Stats().tensors, tensors);
  }

  std::unique_ptr<LossdServer> server_;
};

// K stripes of bf16 logits (odd shapes, so splits are uneven) and of int64
// targets through the client's striped path; the bytes come back unchanged.
TEST_F(StripeTest, ClientRoundTripsUnevenSplits) {
  Start();
  for (int streams : {1, 2, 3, 7}) {
    SCOPED_TRACE(absl::StrCat("streams ", streams));
    std::unique_ptr<Client> client = MakeClient(streams, "");
    ASSERT_NE(client, nullptr);
    const uint32_t seed = 1000 + streams;
    const std::vector<int64_t> logits_shape = {37, 1001};
    const std::string logits = RandomBytes(37 * 1001 * 2, seed);
    int64_t last_progress = 0;
    absl::StatusOr<TensorInfo> stored =
        client->Upload(DType::kBFloat16, logits_shape, logits.data(),
                       logits.size(), "lg", [&](int64_t done, int64_t total) {
                         EXPECT_GE(done, last_progress);
                         EXPECT_EQ(total, static_cast<int64_t>(logits.size()));
                         last_progress = done;
                       });
    ASSERT_TRUE(stored.ok()) << stored.status() << " seed " << seed;
    EXPECT_EQ(last_progress, static_cast<int64_t>(logits.size()));
    EXPECT_EQ(stored->shape, logits_shape);
    EXPECT_EQ(stored->label, "lg");
    EXPECT_EQ(Download(stored->handle), logits) << "seed " << seed;

    // Fewer elements than stripes leaves some stripes empty.
    for (int64_t rows : {int64_t{5}, int64_t{1}, int64_t{4099}}) {
      const std::string targets = RandomBytes(rows * 8, seed + rows);
      absl::StatusOr<TensorInfo> t =
          client->Upload(DType::kInt64, {rows}, targets.data(), targets.size());
      ASSERT_TRUE(t.ok()) << t.status() << " rows " << rows;
      EXPECT_EQ(Download(t->handle), targets) << "rows " << rows;
      ASSERT_TRUE(client->Release(t->handle).ok());
    }
    ASSERT_TRUE(client->Release(stored->handle).ok());
  }
  ExpectStore(0, 0);
}

// Over the budget: RESOURCE_EXHAUSTED for the whole tensor, nothing reserved.
TEST_F(StripeTest, OverBudgetIsResourceExhausted) {
  Start(absl::Seconds(30), /*budget=*/1 << 20);
  std::unique_ptr<Client> client = MakeClient(4, "");
  const std::string data = RandomBytes(2 << 20, 11);
  absl::StatusOr<TensorInfo> stored =
      client->Upload(DType::kFloat32, {512, 1024}, data.data(), data.size());
  EXPECT_EQ(stored.status().code(), absl::StatusCode::kResourceExhausted)
      << stored.status();
  ExpectStore(0, 0);
  // A fitting striped upload still works afterwards.
  const std::string small = RandomBytes(256 << 10, 12);
  stored =
      client->Upload(DType::kFloat32, {64, 1024}, small.data(), small.size());
  ASSERT_TRUE(stored.ok()) << stored.status();
  EXPECT_EQ(Download(stored->handle), small);
}

// Two striped uploads at once, each on its own thread, do not mix.
TEST_F(StripeTest, ConcurrentUploadsStaySeparate) {
  Start();
  std::unique_ptr<Client> client = MakeClient(3, "");
  std::vector<std::string> data = {RandomBytes(3 << 20, 21),
                                   RandomBytes(3 << 20, 22)};
  std::vector<absl::StatusOr<TensorInfo>> results(
      2, absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (int i = 0; i < 2; ++i) {
    threads.emplace_back([&, i] {
      results[i] = client->Upload(DType::kFloat16, {3, 1 << 19}, data[i].data(),
                                  data[i].size());
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(results[i].ok()) << results[i].status();
    EXPECT_EQ(Download(results[i]->handle), data[i]);
  }
  EXPECT_NE(results[0]->handle, results[1]->handle);
  ExpectStore(2, int64_t{6} << 20);
}

// A ranged Download takes the tensor's size from what the client already knows
// (its Upload or an earlier Describe), so only a handle it has never seen
// costs a Describe first; a released handle is forgotten.
TEST_F(StripeTest, RangedDownloadsDescribeOnlyUnknownHandles) {
  Start(absl::Seconds(30), kBudget, /*metrics=*/true);
  const auto describes = [&](const std::string& code) {
    absl::StatusOr<std::vector<scrape::Sample>> samples =
        scrape::Scrape(server_->metrics_port());
    EXPECT_TRUE(samples.ok()) << samples.status();
    if (!samples.ok()) return -1.0;
    return scrape::FindSample(*samples, "lossd_rpc_total",
                              {{"method", "Describe"}, {"code", code}})
        .value_or(0.0);
  };
  std::unique_ptr<Client> uploader = MakeClient(4, "");
  const std::string logits = RandomBytes(9 * 2001 * 2, 71);
  absl::StatusOr<TensorInfo> stored = uploader->Upload(
      DType::kBFloat16, {9, 2001}, logits.data(), logits.size());
  ASSERT_TRUE(stored.ok()) << stored.status();
  absl::StatusOr<DownloadedTensor> got = uploader->Download(stored->handle);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(std::string(got->data.begin(), got->data.end()), logits);
  EXPECT_EQ(describes("OK"), 0);

  // Another client has never seen the handle: one Describe, then none.
  std::unique_ptr<Client> other = MakeClient(3, "");
  for (int i = 0; i < 2; ++i) {
    got = other->Download(stored->handle, DType::kFloat32);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->data.size(), logits.size() * 2);
    EXPECT_EQ(describes("OK"), 1);
  }

  ASSERT_TRUE(uploader->Release(stored->handle).ok());
  EXPECT_EQ(uploader->Download(stored->handle).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(describes("NOT_FOUND"), 1);
  // A client that still remembers the shape gets NOT_FOUND from the ranges.
  EXPECT_EQ(other->Download(stored->handle).status().code(),
            absl::StatusCode::kNotFound);
  ExpectStore(0, 0);
}

// A lossd from before ranged Download: it ignores offset and length and sends
// the whole tensor (as Describe says it is) on every Download.
class OldDownloadService final : public v1::Lossd::Service {
 public:
  explicit OldDownloadService(std::string bytes) : bytes_(std::move(bytes)) {}
  grpc::Status Describe(grpc::ServerContext* /*context*/,
                        const v1::DescribeRequest* request,
                        v1::TensorInfo* response) override {
    *response = Info(request->handle());
    return grpc::Status::OK;
  }
  grpc::Status Download(
      grpc::ServerContext* /*context*/, const v1::DownloadRequest* request,
      grpc::ServerWriter<v1::DownloadResponse>* writer) override {
    ++downloads_;
    v1::DownloadResponse header;
    *header.mutable_header() = Info(request->handle());
    if (!writer->Write(header)) return grpc::Status::CANCELLED;
    for (std::size_t at = 0; at < bytes_.size(); at += 4096) {
      v1::DownloadResponse chunk;
      chunk.set_chunk(bytes_.substr(at, 4096));
      if (!writer->Write(chunk)) return grpc::Status::CANCELLED;
    }
    return grpc::Status::OK;
  }
  int downloads() const { return downloads_; }

 private:
  v1::TensorInfo Info(const std::string& handle) const {
    v1::TensorInfo info;
    info.set_handle(handle);
    info.set_dtype(v1::DTYPE_BFLOAT16);
    info.add_shape(static_cast<int64_t>(bytes_.size() / 2));
    info.set_bytes(static_cast<int64_t>(bytes_.size()));
    return info;
  }
  const std::string bytes_;
  std::atomic<int> downloads_{0};
};

// Against such a server the client falls back to one stream and gets the
// tensor right (a newer client during a rolling upgrade).
TEST(StripeCompatTest, RangedDownloadFallsBackOnAnOldServer) {
  const std::string bytes = RandomBytes(3 * 50000 * 2, 81);
  OldDownloadService service(bytes);
  int port = 0;
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(),
                           &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  ClientOptions options;
  options.upload_streams = 3;
  options.stripe_min_bytes = 1;
  absl::StatusOr<std::unique_ptr<Client>> client =
      Client::Connect(absl::StrCat("127.0.0.1:", port), options);
  ASSERT_TRUE(client.ok()) << client.status();
  absl::StatusOr<DownloadedTensor> got = (*client)->Download("old");
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(std::string(got->data.begin(), got->data.end()), bytes);
  EXPECT_EQ(got->info.bytes, static_cast<int64_t>(bytes.size()));
  std::vector<uint8_t> buffer(bytes.size());
  absl::StatusOr<TensorInfo> into = (*client)->DownloadInto(
      "old", DType::kInvalid, buffer.data(), buffer.size());
  ASSERT_TRUE(into.ok()) << into.status();
  EXPECT_EQ(std::string(buffer.begin(), buffer.end()), bytes);
  // Each attempt: up to 3 ranged tries (cancelled), then one whole stream.
  EXPECT_GE(service.downloads(), 4);
  server->Shutdown();
}

// Large downloads come as parallel ranges; converted or not, into a vector or
// a caller's buffer, they equal the one-stream download.
TEST_F(StripeTest, ClientDownloadsInRanges) {
  Start();
  std::unique_ptr<Client> single = MakeClient(1, "");
  const uint32_t seed = 61;
  std::mt19937 random(seed);
  std::vector<float> values(7 * 1003);
  for (float& v : values) v = static_cast<float>(random() % 2001) / 7.0f - 100;
  absl::StatusOr<TensorInfo> stored = single->Upload(
      DType::kFloat32, {7, 1003}, values.data(), values.size() * 4);
  ASSERT_TRUE(stored.ok()) << stored.status();
  for (int streams : {2, 3, 7}) {
    std::unique_ptr<Client> client = MakeClient(streams, "");
    for (DType as : {DType::kInvalid, DType::kBFloat16, DType::kFloat16}) {
      SCOPED_TRACE(absl::StrCat("streams ", streams, " dtype ", DTypeString(as),
                                " seed ", seed));
      absl::StatusOr<DownloadedTensor> expected =
          single->Download(stored->handle, as);
      ASSERT_TRUE(expected.ok()) << expected.status();
      int64_t last = 0;
      absl::StatusOr<DownloadedTensor> got = client->Download(
          stored->handle, as, [&](int64_t done, int64_t total) {
            EXPECT_GE(done, last);
            EXPECT_EQ(total, expected->info.bytes);
            last = done;
          });
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_EQ(last, expected->info.bytes);
      EXPECT_EQ(got->data, expected->data);
      EXPECT_EQ(got->info.bytes, expected->info.bytes);
      EXPECT_EQ(got->info.dtype, expected->info.dtype);
      EXPECT_EQ(got->info.handle, stored->handle);
      std::vector<uint8_t> buffer(expected->data.size());
      absl::StatusOr<TensorInfo> into = client->DownloadInto(
          stored->handle, as, buffer.data(), buffer.size());
      ASSERT_TRUE(into.ok()) << into.status();
      EXPECT_EQ(buffer, expected->data);
      EXPECT_EQ(client
                    ->DownloadInto(stored->handle, as, buffer.data(),
                                   buffer.size() - 1)
                    .status()
                    .code(),
                absl::StatusCode::kOutOfRange);
    }
    EXPECT_EQ(client->Download("00000000-nope").status().code(),
              absl::StatusCode::kInvalidArgument);
  }
}

// upload_streams outside [1, 64] is refused before any RPC.
TEST(StripeOptionsTest, UploadStreamsOutOfRange) {
  for (int streams : {0, -1, 65}) {
    ClientOptions options;
    options.upload_streams = streams;
    EXPECT_EQ(Client::Connect("127.0.0.1:1", options).status().code(),
              absl::StatusCode::kInvalidArgument)
        << streams;
  }
}

}  // namespace
}  // namespace lossd
