// lossd's Prometheus metrics as a scraper sees them: an in-process server on
// 127.0.0.1:0 with metrics on a free port, /metrics fetched over loopback
// before and after real RPCs, counters and gauges checked to have moved.
#include "server/metrics.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "lossd/v1/lossd.grpc.pb.h"
#include "server/server.h"
#include "tests/e2e/bytes.h"
#include "tests/e2e/scrape.h"

namespace lossd {
namespace {

namespace pb = ::lossd::v1;
using ::lossd::e2e_test::Bytes;
using scrape::FindSample;
using scrape::Sample;
using Labels = std::map<std::string, std::string>;

constexpr int64_t kBudget = 64 << 20;
constexpr int64_t kRows = 16;
constexpr int64_t kVocab = 50;

// A sample's value, 0 when absent (counters and gauges not yet created).
double ValueOr0(const std::vector<Sample>& samples, const std::string& name,
                const Labels& labels = {}) {
  return FindSample(samples, name, labels).value_or(0.0);
}

class MetricsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    seed_ = std::random_device()();
    ServerConfig config;
    config.host = "127.0.0.1";
    config.port = 0;
    config.metrics_port = 0;
    config.device = "cpu";
    config.memory_budget = kBudget;
    config.threads = 2;
    auto server = LossdServer::Start(config);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    ASSERT_GT(server_->metrics_port(), 0);
    stub_ = pb::Lossd::NewStub(grpc::CreateChannel(
        server_->address(), grpc::InsecureChannelCredentials()));
  }

  std::vector<Sample> Scrape() {
    absl::StatusOr<std::vector<Sample>> samples =
        scrape::Scrape(server_->metrics_port());
    EXPECT_TRUE(samples.ok()) << samples.status();
    return samples.ok() ? *samples : std::vector<Sample>();
  }

  std::vector<float> RandomLogits() {
    std::mt19937 rng(seed_);
    std::normal_distribution<float> normal(0.0f, 2.0f);
    std::vector<float> logits(kRows * kVocab);
    for (float& value : logits) value = normal(rng);
    return logits;
  }

  std::vector<int64_t> RandomTargets() {
    std::mt19937 rng(seed_ + 1);
    std::uniform_int_distribution<int64_t> pick(0, kVocab - 1);
    std::vector<int64_t> targets(kRows);
    for (int64_t& target : targets) target = pick(rng);
    return targets;
  }

  // Uploads [kRows, kVocab] fp32 logits in chunks of `chunk` bytes.
  std::string Upload(const std::string& bytes, size_t chunk) {
    grpc::ClientContext context;
    pb::UploadResponse response;
    auto writer = stub_->Upload(&context, &response);
    pb::UploadRequest request;
    request.mutable_header()->set_dtype(pb::DTYPE_FLOAT32);
    request.mutable_header()->add_shape(kRows);
    request.mutable_header()->add_shape(kVocab);
    EXPECT_TRUE(writer->Write(request));
    for (size_t offset = 0; offset < bytes.size(); offset += chunk) {
      request.set_chunk(bytes.substr(offset, chunk));
      EXPECT_TRUE(writer->Write(request));
    }
    writer->WritesDone();
    const grpc::Status status = writer->Finish();
    EXPECT_TRUE(status.ok()) << status.error_message();
    return response.tensor().handle();
  }

  uint32_t seed_ = 0;
  std::unique_ptr<LossdServer> server_;
  std::unique_ptr<pb::Lossd::Stub> stub_;
};

TEST_F(MetricsTest, CountersAndGaugesMoveWithRpcs) {
  SCOPED_TRACE(::testing::Message() << "seed " << seed_);
  const Labels cpu = {{"device", "cpu"}};
  const Labels cpu_default = {{"device", "cpu"}, {"tenant", "default"}};
  const Labels cross_entropy = {{"device", "cpu"}, {"kernel", "cross_entropy"}};
  const int64_t logits_bytes = kRows * kVocab * 4;

  const std::vector<Sample> before = Scrape();
  EXPECT_EQ(FindSample(before, "lossd_memory_budget_bytes", cpu), kBudget);
  EXPECT_EQ(FindSample(before, "lossd_reserved_bytes", cpu), 0);
  EXPECT_EQ(ValueOr0(before, "lossd_tensor_bytes", cpu_default), 0);
  EXPECT_EQ(FindSample(before, "lossd_transfer_bytes_total",
                       {{"direction", "upload"}}),
            0);
  EXPECT_EQ(ValueOr0(before, "lossd_rpc_total",
                     {{"method", "Upload"}, {"code", "OK"}}),
            0);

  const std::string handle = Upload(Bytes(RandomLogits()), 1000);
  ASSERT_FALSE(handle.empty());
  const std::vector<Sample> uploaded = Scrape();
  EXPECT_EQ(FindSample(uploaded, "lossd_rpc_total",
                       {{"method", "Upload"}, {"code", "OK"}}),
            1);
  EXPECT_EQ(FindSample(uploaded, "lossd_transfer_bytes_total",
                       {{"direction", "upload"}}),
            logits_bytes);
  EXPECT_EQ(FindSample(uploaded, "lossd_tensor_bytes", cpu_default),
            logits_bytes);
  EXPECT_EQ(FindSample(uploaded, "lossd_tensors", cpu_default), 1);
  EXPECT_EQ(FindSample(uploaded, "lossd_reserved_bytes", cpu), logits_bytes);

  grpc::ClientContext forward_context;
  pb::ForwardRequest forward;
  forward.set_logits(handle);
  forward.mutable_targets_inline()->set_dtype(pb::DTYPE_INT64);
  forward.mutable_targets_inline()->set_data(Bytes(RandomTargets()));
  pb::ForwardResponse forward_response;
  const grpc::Status forward_status =
      stub_->Forward(&forward_context, forward, &forward_response);
  ASSERT_TRUE(forward_status.ok()) << forward_status.error_message();

  grpc::ClientContext download_context;
  pb::DownloadRequest download;
  download.set_handle(handle);
  download.set_chunk_bytes(512);
  auto reader = stub_->Download(&download_context, download);
  pb::DownloadResponse chunk;
  int64_t downloaded = 0;
  while (reader->Read(&chunk)) downloaded += chunk.chunk().size();
  ASSERT_TRUE(reader->Finish().ok());
  EXPECT_EQ(downloaded, logits_bytes);

  grpc::ClientContext release_context;
  pb::ReleaseRequest release;
  release.set_handle(handle);
  pb::ReleaseResponse release_response;
  ASSERT_TRUE(
      stub_->Release(&release_context, release, &release_response).ok());
  // A released handle: NOT_FOUND, counted under its own code.
  grpc::ClientContext describe_context;
  pb::DescribeRequest describe;
  describe.set_handle(handle);
  pb::TensorInfo info;
  EXPECT_EQ(stub_->Describe(&describe_context, describe, &info).error_code(),
            grpc::StatusCode::NOT_FOUND);

  const std::vector<Sample> after = Scrape();
  for (const char* method : {"Upload", "Forward", "Download", "Release"}) {
    SCOPED_TRACE(method);
    const Labels ok = {{"method", method}, {"code", "OK"}};
    EXPECT_EQ(FindSample(after, "lossd_rpc_total", ok), 1);
    EXPECT_EQ(FindSample(after, "lossd_rpc_duration_seconds_count", ok), 1);
    Labels inf = ok;
    inf["le"] = "+Inf";
    EXPECT_EQ(FindSample(after, "lossd_rpc_duration_seconds_bucket", inf), 1);
    Labels minute = ok;
    minute["le"] = "60";
    // Nothing here takes a minute: the top finite bucket has the RPC too.
    EXPECT_EQ(FindSample(after, "lossd_rpc_duration_seconds_bucket", minute),
              1);
    EXPECT_GT(
        FindSample(after, "lossd_rpc_duration_seconds_sum", ok).value_or(-1.0),
        0.0);
  }
  EXPECT_EQ(FindSample(after, "lossd_rpc_total",
                       {{"method", "Describe"}, {"code", "NOT_FOUND"}}),
            1);
  EXPECT_EQ(FindSample(after, "lossd_kernel_runs_total", cross_entropy), 1);
  EXPECT_GE(FindSample(after, "lossd_kernel_seconds_total", cross_entropy)
                .value_or(-1.0),
            0.0);
  EXPECT_EQ(FindSample(after, "lossd_transfer_bytes_total",
                       {{"direction", "download"}}),
            logits_bytes);
  // Released: the tenant holds nothing and nothing is charged to the budget.
  EXPECT_EQ(ValueOr0(after, "lossd_tensor_bytes", cpu_default), 0);
  EXPECT_EQ(ValueOr0(after, "lossd_tensors", cpu_default), 0);
  EXPECT_EQ(FindSample(after, "lossd_reserved_bytes", cpu), 0);
}

TEST_F(MetricsTest, EvaluateCountsBytesAndKernelRuns) {
  SCOPED_TRACE(::testing::Message() << "seed " << seed_);
  const std::vector<float> logits = RandomLogits();
  const std::vector<int64_t> targets = RandomTargets();
  grpc::ClientContext context;
  pb::EvaluateResponse response;
  auto writer = stub_->Evaluate(&context, &response);
  pb::EvaluateRequest request;
  request.mutable_header()->set_vocab(kVocab);
  request.mutable_header()->set_logits_dtype(pb::DTYPE_FLOAT32);
  request.mutable_header()->set_targets_dtype(pb::DTYPE_INT64);
  ASSERT_TRUE(writer->Write(request));
  // Two blocks of half the rows each.
  const int64_t half = kRows / 2;
  int64_t sent = 0;
  for (int64_t block = 0; block < 2; ++block) {
    request.mutable_block()->set_logits(Bytes(
        std::vector<float>(logits.begin() + block * half * kVocab,
                           logits.begin() + (block + 1) * half * kVocab)));
    request.mutable_block()->set_targets(Bytes(std::vector<int64_t>(
        targets.begin() + block * half, targets.begin() + (block + 1) * half)));
    sent += request.block().logits().size() + request.block().targets().size();
    ASSERT_TRUE(writer->Write(request));
  }
  writer->WritesDone();
  const grpc::Status status = writer->Finish();
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(response.rows(), kRows);

  const std::vector<Sample> after = Scrape();
  EXPECT_EQ(FindSample(after, "lossd_transfer_bytes_total",
                       {{"direction", "evaluate"}}),
            sent);
  EXPECT_EQ(FindSample(after, "lossd_kernel_runs_total",
                       {{"device", "cpu"}, {"kernel", "cross_entropy"}}),
            2);
  EXPECT_EQ(FindSample(after, "lossd_rpc_total",
                       {{"method", "Evaluate"}, {"code", "OK"}}),
            1);
  // Evaluate keeps no tensor.
  EXPECT_EQ(FindSample(after, "lossd_reserved_bytes", {{"device", "cpu"}}), 0);
}

TEST(MetricsConfigTest, OffByDefaultInProcess) {
  ServerConfig config;
  config.host = "127.0.0.1";
  config.port = 0;
  config.device = "cpu";
  config.memory_budget = kBudget;
  auto server = LossdServer::Start(config);
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_EQ((*server)->metrics(), nullptr);
  EXPECT_EQ((*server)->metrics_port(), 0);
}

TEST(MetricsConfigTest, RejectsBadPortsAndTakenAddresses) {
  ServerConfig config;
  config.host = "127.0.0.1";
  config.port = 0;
  config.device = "cpu";
  config.memory_budget = kBudget;
  config.metrics_port = 70000;
  EXPECT_EQ(LossdServer::Start(config).status().code(),
            absl::StatusCode::kInvalidArgument);
  config.metrics_port = -2;
  EXPECT_EQ(LossdServer::Start(config).status().code(),
            absl::StatusCode::kInvalidArgument);

  // A port someone else listens on.
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)),
            0);
  ASSERT_EQ(listen(fd, 1), 0);
  socklen_t length = sizeof(address);
  ASSERT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length), 0);
  config.metrics_port = ntohs(address.sin_port);
  const absl::Status status = LossdServer::Start(config).status();
  close(fd);
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
}

// The histogram's buckets, without a server: 100 us .. 60 s.
TEST(MetricsRenderTest, HistogramBucketsSpanMicrosecondsToAMinute) {
  Metrics metrics(nullptr);
  metrics.ObserveRpc("Describe", absl::StatusCode::kOk,
                     absl::Microseconds(150));
  metrics.ObserveRpc("Describe", absl::StatusCode::kOk, absl::Seconds(30));
  metrics.ObserveRpc("Describe", absl::StatusCode::kOk, absl::Seconds(90));
  metrics.ObserveKernel("cpu", "scale", 0.25);
  metrics.AddTransferBytes(TransferDirection::kDownload, 1000);
  absl::StatusOr<std::vector<Sample>> samples =
      scrape::ParseTextFormat(metrics.Render());
  ASSERT_TRUE(samples.ok()) << samples.status();
  auto bucket = [&](const std::string& le) {
    return FindSample(*samples, "lossd_rpc_duration_seconds_bucket",
                      {{"method", "Describe"}, {"code", "OK"}, {"le", le}});
  };
  EXPECT_EQ(bucket("0.0001"), 0);
  EXPECT_EQ(bucket("0.00025"), 1);
  EXPECT_EQ(bucket("20"), 1);
  EXPECT_EQ(bucket("40"), 2);
  EXPECT_EQ(bucket("60"), 2);
  EXPECT_EQ(bucket("+Inf"), 3);
  EXPECT_EQ(FindSample(*samples, "lossd_kernel_seconds_total",
                       {{"device", "cpu"}, {"kernel", "scale"}}),
            0.25);
  EXPECT_EQ(FindSample(*samples, "lossd_transfer_bytes_total",
                       {{"direction", "download"}}),
            1000);
  // No store: no memory gauges at all.
  EXPECT_FALSE(
      FindSample(*samples, "lossd_memory_budget_bytes", {{"device", "cpu"}})
          .has_value());
}

}  // namespace
}  // namespace lossd
