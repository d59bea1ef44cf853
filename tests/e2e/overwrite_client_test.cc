// lossd::Client::Overwrite and OverwriteFrom over each transport an upload of
// the size takes (one stream, stripes, data connections) against an
// in-process CPU server: the contents replaced bit for bit under the same
// handle, the refusals that change nothing, and an overwrite that breaks
// part-way.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "lossd/v1/lossd.grpc.pb.h"
#include "server/server.h"
#include "tests/e2e/scrape.h"
#include "tests/e2e/test_server.h"

namespace lossd {
namespace {

constexpr int64_t kBudget = 64 << 20;
constexpr int kStreams = 3;
// [kRows, kCols] fp32: 256000 bytes, several pieces and chunks per
// connection.
constexpr int64_t kRows = 64;
constexpr int64_t kCols = 1000;
constexpr std::size_t kBytes = kRows * kCols * sizeof(float);

enum class Transport { kStream, kStripes, kDataConnections };

const char* Name(Transport transport) {
  switch (transport) {
    case Transport::kStream:
      return "OneStream";
    case Transport::kStripes:
      return "Stripes";
    case Transport::kDataConnections:
      return "DataConnections";
  }
  return "Unknown";
}

std::vector<float> RandomValues(uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> values(kRows * kCols);
  for (float& value : values) value = normal(rng);
  return values;
}

// Over the transport the test's parameter names: a tensor of tenant-a's
// ("head", kBytes of fp32) stored over one stream, and a client of the
// tenant that sends a tensor of that size over the transport.
class OverwriteClientTest : public ::testing::TestWithParam<Transport> {
 protected:
  void SetUp() override {
    ServerConfig config =
        e2e_test::LoopbackConfig("cpu", kBudget, absl::Seconds(10));
    config.data_port = 0;  // a free port
    // Only where a test counts RPCs: the metrics endpoint takes seconds to
    // stop.
    config.metrics_port = CountsRpcs() ? 0 : -1;
    const std::string tokens = absl::StrCat(
        ::testing::TempDir(), "overwrite-tokens-",
        absl::StrReplaceAll(
            ::testing::UnitTest::GetInstance()->current_test_info()->name(),
            {{"/", "-"}}));
    std::ofstream(tokens) << "token-a tenant-a\ntoken-b tenant-b\n";
    config.auth.tokens_file = tokens;
    absl::StatusOr<std::unique_ptr<LossdServer>> server =
        LossdServer::Start(config);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    owner_ = Connect(Transport::kStream, "token-a");
    ASSERT_NE(owner_, nullptr);
    contents_ = RandomValues(1);
    absl::StatusOr<TensorInfo> info = owner_->Upload(
        DType::kFloat32, {kRows, kCols}, contents_.data(), kBytes, "head");
    ASSERT_TRUE(info.ok()) << info.status();
    handle_ = info->handle;
    before_ = server_->store()->Stats();
    client_ = Connect(GetParam(), "token-a");
    ASSERT_NE(client_, nullptr);
  }

  virtual bool CountsRpcs() const { return false; }

  // A client that sends a tensor of kBytes over `transport`.
  std::unique_ptr<Client> Connect(Transport transport,
                                  const std::string& token) {
    ClientOptions options;
    options.bearer_token = token;
    options.chunk_bytes = 16 << 10;
    options.piece_bytes = 64 << 10;
    options.stripe_min_bytes = 1;
    options.upload_streams = transport == Transport::kStream ? 1 : kStreams;
    options.data_connection = transport == Transport::kDataConnections;
    absl::StatusOr<std::unique_ptr<Client>> client =
        Client::Connect(server_->address(), options);
    EXPECT_TRUE(client.ok()) << client.status();
    return client.ok() ? *std::move(client) : nullptr;
  }

  std::vector<float> Get(const std::string& handle) {
    absl::StatusOr<DownloadedTensor> got = owner_->Download(handle);
    EXPECT_TRUE(got.ok()) << got.status();
    if (!got.ok() || got->data.size() != kBytes) return {};
    std::vector<float> values(kRows * kCols);
    std::memcpy(values.data(), got->data.data(), kBytes);
    return values;
  }

  // Upload RPCs that ended with `code`, as the server counts them.
  double Uploads(const std::string& code) {
    absl::StatusOr<std::vector<scrape::Sample>> samples =
        scrape::Scrape(server_->metrics_port());
    EXPECT_TRUE(samples.ok()) << samples.status();
    if (!samples.ok()) return -1.0;
    return scrape::FindSample(*samples, "lossd_rpc_total",
                              {{"method", "Upload"}, {"code", code}})
        .value_or(0.0);
  }

  // The tensor holds `contents` under its handle, label and memory.
  void ExpectStored(const std::vector<float>& contents) {
    absl::StatusOr<TensorInfo> info = owner_->Describe(handle_);
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->label, "head");
    EXPECT_EQ(info->state, TensorState::kLogits);
    EXPECT_TRUE(Get(handle_) == contents) << "contents differ";
    EXPECT_EQ(server_->store()->Stats().used_bytes, before_.used_bytes);
    EXPECT_EQ(server_->store()->Stats().tensors, before_.tensors);
  }

  absl::Status OverwriteWith(Client& client, const std::string& handle,
                             DType dtype, std::vector<int64_t> shape) {
    const std::vector<float> other = RandomValues(99);
    return client.Overwrite(handle, dtype, shape, other.data(), kBytes)
        .status();
  }

  std::unique_ptr<LossdServer> server_;
  std::unique_ptr<Client> owner_;
  std::unique_ptr<Client> client_;  // over GetParam()
  std::vector<float> contents_;     // of handle_ as stored
  std::string handle_;
  StoreStats before_;
};

// With the server's metrics, to count the Upload RPCs.
class OverwriteCountedTest : public OverwriteClientTest {
 protected:
  bool CountsRpcs() const override { return true; }
};

// The contents replaced bit for bit under the same handle, label and memory,
// over as many Upload RPCs (and data connections) as an upload of that size.
TEST_P(OverwriteCountedTest, ReplacesTheContents) {
  const std::vector<float> next = RandomValues(2);
  const double uploads = Uploads("OK");
  const int64_t connections = server_->data_plane()->completed();
  int64_t last_progress = 0;
  absl::StatusOr<TensorInfo> info =
      client_->Overwrite(handle_, DType::kFloat32, {kRows, kCols}, next.data(),
                         kBytes, [&](int64_t done, int64_t total) {
                           EXPECT_EQ(total, static_cast<int64_t>(kBytes));
                           last_progress = std::max(last_progress, done);
                         });
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->handle, handle_);
  EXPECT_EQ(info->label, "head");
  EXPECT_EQ(last_progress, static_cast<int64_t>(kBytes));
  ExpectStored(next);
  EXPECT_EQ(Uploads("OK") - uploads,
            GetParam() == Transport::kStripes ? kStreams : 1);
  EXPECT_EQ(server_->data_plane()->completed() - connections,
            GetParam() == Transport::kDataConnections ? kStreams : 0);

  // From a source, piece by piece, as UploadFrom.
  const std::vector<float> last = RandomValues(3);
  info = client_->OverwriteFrom(
      handle_, DType::kFloat32, {kRows, kCols},
      [&](int64_t offset, std::size_t, void*) -> absl::StatusOr<const void*> {
        return reinterpret_cast<const char*>(last.data()) + offset;
      });
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->handle, handle_);
  ExpectStored(last);
}

// Another dtype or shape, an unknown, released or foreign handle, or a
// tensor a Download is reading: the documented code, and nothing changed.
TEST_P(OverwriteClientTest, RefusalsChangeNothing) {
  absl::StatusOr<TensorInfo> released =
      owner_->Upload(DType::kFloat32, {kRows, kCols}, contents_.data(), kBytes);
  ASSERT_TRUE(released.ok()) << released.status();
  ASSERT_TRUE(owner_->Release(released->handle).ok());
  std::unique_ptr<Client> stranger = Connect(GetParam(), "token-b");
  ASSERT_NE(stranger, nullptr);

  absl::Status status =
      OverwriteWith(*client_, handle_, DType::kFloat32, {kCols, kRows});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_NE(status.message().find("shape"), std::string::npos) << status;
  status = OverwriteWith(*client_, handle_, DType::kInt32, {kRows, kCols});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  status = OverwriteWith(*client_, released->handle, DType::kFloat32,
                         {kRows, kCols});
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound) << status;
  status = OverwriteWith(*stranger, handle_, DType::kFloat32, {kRows, kCols});
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound) << status;
  status = OverwriteWith(*client_, "", DType::kFloat32, {kRows, kCols});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;

  // A Download that has sent its header holds its read of the tensor until
  // it ends (tiny chunks keep it from ending first).
  std::unique_ptr<v1::Lossd::Stub> stub =
      v1::Lossd::NewStub(e2e_test::LargeMessageChannel(server_->address()));
  grpc::ClientContext download_context;
  download_context.AddMetadata("authorization", "Bearer token-a");
  v1::DownloadRequest download;
  download.set_handle(handle_);
  download.set_chunk_bytes(4);
  std::unique_ptr<grpc::ClientReader<v1::DownloadResponse>> reader =
      stub->Download(&download_context, download);
  v1::DownloadResponse response;
  ASSERT_TRUE(reader->Read(&response));
  status = OverwriteWith(*client_, handle_, DType::kFloat32, {kRows, kCols});
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
  download_context.TryCancel();
  while (reader->Read(&response)) {
  }
  reader->Finish().error_code();

  ExpectStored(contents_);
}

// An overwrite whose source fails part-way ends its connections and streams
// unfinished: the caller gets the source's error, the tensor stays under its
// handle, and overwriting it again replaces every byte.
TEST_P(OverwriteClientTest, BrokenPartWayKeepsTheHandle) {
  const std::vector<float> broken = RandomValues(4);
  // The last stripe's (or connection's) range fails at its first piece; the
  // others' complete.
  const int64_t fail_from =
      static_cast<int64_t>(kBytes) * (kStreams - 1) / kStreams;
  absl::StatusOr<TensorInfo> info = client_->OverwriteFrom(
      handle_, DType::kFloat32, {kRows, kCols},
      [&](int64_t offset, std::size_t, void*) -> absl::StatusOr<const void*> {
        if (offset >= fail_from) return absl::DataLossError("disk gone");
        return reinterpret_cast<const char*>(broken.data()) + offset;
      });
  EXPECT_EQ(info.status().code(), absl::StatusCode::kDataLoss) << info.status();
  absl::StatusOr<TensorInfo> described = owner_->Describe(handle_);
  ASSERT_TRUE(described.ok()) << described.status();
  EXPECT_EQ(described->label, "head");

  // The server lets go of the broken write as its RPCs end, which may be
  // just after the client has its status: a new overwrite may meet it.
  const std::vector<float> next = RandomValues(5);
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  do {
    info = client_->Overwrite(handle_, DType::kFloat32, {kRows, kCols},
                              next.data(), kBytes);
  } while (info.status().code() == absl::StatusCode::kFailedPrecondition &&
           absl::Now() < deadline);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->handle, handle_);
  ExpectStored(next);
}

std::string ParamName(const ::testing::TestParamInfo<Transport>& info) {
  return Name(info.param);
}

INSTANTIATE_TEST_SUITE_P(Transports, OverwriteClientTest,
                         ::testing::Values(Transport::kStream,
                                           Transport::kStripes,
                                           Transport::kDataConnections),
                         ParamName);
INSTANTIATE_TEST_SUITE_P(Transports, OverwriteCountedTest,
                         ::testing::Values(Transport::kStream,
                                           Transport::kStripes,
                                           Transport::kDataConnections),
                         ParamName);

}  // namespace
}  // namespace lossd
