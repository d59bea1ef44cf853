// Upload idempotency keys through lossd::Client (one stream, stripes, data
// connections) and lossctl --idempotency_key, against a real lossd process
// with two tenants (bearer tokens): a retry returns the first upload's tensor.
#include <cstdint>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "client/client.h"
#include "client/npy.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/client/lossd_process.h"

namespace lossd {
namespace {

using ::lossd::client_test::CommandResult;
using ::lossd::client_test::LossdProcess;
using ::lossd::client_test::RunCommand;
using ::lossd::client_test::TempDir;
using ::testing::HasSubstr;

class UploadKeyClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    tokens_ = dir_.File("tokens");
    std::ofstream(tokens_) << "token-alpha alpha\ntoken-beta beta\n";
    absl::StatusOr<std::unique_ptr<LossdProcess>> server = LossdProcess::Start(
        LOSSD_BINARY_PATH, {absl::StrCat("--tokens_file=", tokens_)});
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
  }

  // A client of `tenant`'s token whose uploads of at least `min_bytes` go
  // over data connections or stripes as asked.
  std::unique_ptr<Client> Connect(const std::string& token, bool data,
                                  int streams, std::size_t min_bytes = 1) {
    ClientOptions options;
    options.bearer_token = token;
    options.data_connection = data;
    options.upload_streams = streams;
    options.stripe_min_bytes = min_bytes;
    absl::StatusOr<std::unique_ptr<Client>> client =
        Client::Connect(server_->address(), options);
    EXPECT_TRUE(client.ok()) << client.status();
    return client.ok() ? *std::move(client) : nullptr;
  }

  int64_t Used(Client& client) {
    absl::StatusOr<ServerInfo> info = client.GetServerInfo();
    EXPECT_TRUE(info.ok()) << info.status();
    return info.ok() ? info->used_bytes : -1;
  }

  TempDir dir_;
  std::string tokens_;
  std::unique_ptr<LossdProcess> server_;
  const std::vector<float> values_ = std::vector<float>(4096, 0.25f);
  const std::vector<int64_t> shape_ = {64, 64};
};

TEST_F(UploadKeyClientTest, EveryTransportReturnsTheFirstTensorOnARetry) {
  struct Transport {
    const char* name;
    bool data;
    int streams;
  };
  for (const Transport transport :
       {Transport{"one stream", false, 1}, Transport{"stripes", false, 3},
        Transport{"data connections", true, 2}}) {
    SCOPED_TRACE(transport.name);
    std::unique_ptr<Client> client =
        Connect("token-alpha", transport.data, transport.streams);
    ASSERT_NE(client, nullptr);
    const std::string key =
        absl::StrCat("key-", transport.streams, transport.data ? "-data" : "");
    absl::StatusOr<TensorInfo> first =
        client->Upload(DType::kFloat32, shape_, values_.data(),
                       values_.size() * sizeof(float), "l", nullptr, key);
    ASSERT_TRUE(first.ok()) << first.status();
    const int64_t used = Used(*client);
    absl::StatusOr<TensorInfo> again =
        client->Upload(DType::kFloat32, shape_, values_.data(),
                       values_.size() * sizeof(float), "l", nullptr, key);
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_EQ(again->handle, first->handle);
    EXPECT_EQ(Used(*client), used);
    absl::StatusOr<TensorInfo> other =
        client->Upload(DType::kFloat32, {4096}, values_.data(),
                       values_.size() * sizeof(float), "l", nullptr, key);
    EXPECT_EQ(other.status().code(), absl::StatusCode::kAlreadyExists);
    EXPECT_THAT(other.status().message(), HasSubstr(first->handle));
  }
}

TEST_F(UploadKeyClientTest, TwoTenantsWithOneKeyGetTheirOwnTensors) {
  std::unique_ptr<Client> alpha = Connect("token-alpha", false, 1);
  std::unique_ptr<Client> beta = Connect("token-beta", false, 1);
  ASSERT_NE(alpha, nullptr);
  ASSERT_NE(beta, nullptr);
  const std::size_t bytes = values_.size() * sizeof(float);
  absl::StatusOr<TensorInfo> mine = alpha->Upload(
      DType::kFloat32, shape_, values_.data(), bytes, "", nullptr, "shared");
  absl::StatusOr<TensorInfo> theirs = beta->Upload(
      DType::kFloat32, shape_, values_.data(), bytes, "", nullptr, "shared");
  ASSERT_TRUE(mine.ok()) << mine.status();
  ASSERT_TRUE(theirs.ok()) << theirs.status();
  EXPECT_NE(mine->handle, theirs->handle);
  EXPECT_EQ(mine->tenant, "alpha");
  EXPECT_EQ(theirs->tenant, "beta");
}

TEST_F(UploadKeyClientTest, LossctlUploadTakesTheKey) {
  const std::string path = dir_.File("logits.npy");
  ASSERT_TRUE(WriteNpy(path, DType::kFloat32, shape_, values_.data(),
                       values_.size() * sizeof(float))
                  .ok());
  auto upload = [&](const std::string& token, const std::string& key) {
    absl::StatusOr<CommandResult> run =
        RunCommand({LOSSCTL_BINARY_PATH, "upload", path,
                    absl::StrCat("--server=", server_->address()),
                    absl::StrCat("--token=", token),
                    absl::StrCat("--idempotency_key=", key)});
    EXPECT_TRUE(run.ok()) << run.status();
    EXPECT_EQ(run->exit_code, 0) << run->err;
    return std::string(absl::StripAsciiWhitespace(run->out));
  };
  const std::string first = upload("token-alpha", "from-lossctl");
  ASSERT_FALSE(first.empty());
  EXPECT_EQ(upload("token-alpha", "from-lossctl"), first);
  EXPECT_NE(upload("token-alpha", "another-key"), first);
  EXPECT_NE(upload("token-beta", "from-lossctl"), first);
}

}  // namespace
}  // namespace lossd
