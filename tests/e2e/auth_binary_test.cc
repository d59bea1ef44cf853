// The lossd binary's security flags (--tls_*, --tokens_file, --health_port,
// --tenant_max_*) with lossd::Client's TLS and token options: what an
// operator and a client library user actually configure.
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/client/lossd_process.h"
#include "tests/e2e/test_pki.h"

namespace lossd {
namespace {

using client_test::LossdProcess;
using client_test::TempDir;
using ::testing::HasSubstr;

class AuthBinaryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(Pki::Get()->ok()) << Pki::Get()->error();
  }

  static ClientOptions Options(const std::string& cert,
                               const std::string& token) {
    ClientOptions options;
    options.deadline = absl::Seconds(20);
    options.tls_ca_file = Pki::Get()->Path("ca.pem");
    options.tls_server_name = "localhost";
    if (!cert.empty()) {
      options.tls_cert_file = Pki::Get()->Path(cert + ".pem");
      options.tls_key_file = Pki::Get()->Path(cert + ".key");
    }
    options.bearer_token = token;
    return options;
  }

  std::unique_ptr<Client> Connect(const std::string& address,
                                  const ClientOptions& options) {
    auto client = Client::Connect(address, options);
    EXPECT_TRUE(client.ok()) << client.status();
    return client.ok() ? std::move(*client) : nullptr;
  }
};

TEST_F(AuthBinaryTest, MutualTlsTokensAndQuotasFromFlags) {
  TempDir dir;
  {
    std::ofstream tokens(dir.File("tokens"));
    tokens << "token-alpha alpha\ntoken-beta beta\n";
  }
  auto server = LossdProcess::Start(
      LOSSD_BINARY,
      {absl::StrCat("--tls_cert=", Pki::Get()->Path("server.pem")),
       absl::StrCat("--tls_key=", Pki::Get()->Path("server.key")),
       absl::StrCat("--tls_client_ca=", Pki::Get()->Path("ca.pem")),
       absl::StrCat("--tokens_file=", dir.File("tokens")), "--health_port=0",
       absl::StrCat("--health_port_file=", dir.File("hp")),
       "--tenant_max_tensors=1", "--memory_budget=1M", "--threads=1"});
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string address = (*server)->address();

  std::unique_ptr<Client> alpha =
      Connect(address, Options("alpha", "token-alpha"));
  const std::vector<float> logits(2 * 3, 0.5f);
  const absl::StatusOr<TensorInfo> info = alpha->Upload(
      DType::kFloat32, {2, 3}, logits.data(), logits.size() * sizeof(float));
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->tenant, "alpha");
  const absl::Status over = alpha
                                ->Upload(DType::kFloat32, {2, 3}, logits.data(),
                                         logits.size() * sizeof(float))
                                .status();
  EXPECT_EQ(over.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(over.message()), HasSubstr("1 of 1 tensors"));

  std::unique_ptr<Client> beta =
      Connect(address, Options("beta", "token-beta"));
  EXPECT_EQ(beta->Describe(info->handle).status().code(),
            absl::StatusCode::kNotFound);
  const absl::StatusOr<ListResult> list = beta->List();
  ASSERT_TRUE(list.ok()) << list.status();
  EXPECT_TRUE(list->tensors.empty());

  EXPECT_EQ(
      Connect(address, Options("beta", "token-alpha"))->List().status().code(),
      absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(Connect(address, Options("alpha", "wrong"))->List().status().code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(
      Connect(address, Options("", "token-alpha"))->List().status().code(),
      absl::StatusCode::kUnavailable);

  // Probes: plaintext, no credentials, on the health port only.
  std::string health_port;
  {
    std::ifstream in(dir.File("hp"));
    in >> health_port;
  }
  ClientOptions plaintext;
  plaintext.deadline = absl::Seconds(20);
  std::unique_ptr<Client> probe =
      Connect(absl::StrCat("127.0.0.1:", health_port), plaintext);
  const absl::StatusOr<bool> ready = probe->Health(kLossdService);
  ASSERT_TRUE(ready.ok()) << ready.status();
  EXPECT_TRUE(*ready);
  EXPECT_FALSE(Connect(address, plaintext)->Health().ok());

  const absl::StatusOr<int> code = (*server)->Stop();
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0);
}

TEST_F(AuthBinaryTest, ClientRefusesACertificateWithoutItsKey) {
  ClientOptions options = Options("alpha", "");
  options.tls_key_file.clear();
  EXPECT_EQ(Client::Connect("127.0.0.1:1", options).status().code(),
            absl::StatusCode::kInvalidArgument);
  options = Options("", "");
  options.tls_ca_file = Pki::Get()->Path("no-such.pem");
  EXPECT_EQ(Client::Connect("127.0.0.1:1", options).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace lossd
