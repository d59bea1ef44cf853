// Issue 6, authentication part: TLS, mutual TLS (a client without a
// certificate is refused; the certificate names the tenant), bearer tokens,
// isolation between two tenants, per-tenant quotas and the plaintext health
// port, against an in-process server on 127.0.0.1:0 through raw stubs
// (auth_binary_test covers the lossd binary's flags and the client's TLS
// options).
// Certificates are made at test time with the openssl CLI.
#include "server/auth.h"

#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "grpc/health/v1/health_subset.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "lossd/v1/lossd.grpc.pb.h"
#include "server/server.h"
#include "tests/e2e/test_pki.h"

namespace lossd {
namespace {

namespace pb = ::lossd::v1;
using ::grpc::StatusCode;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr int64_t kRows = 4;
constexpr int64_t kVocab = 8;
constexpr int64_t kLogitsBytes = kRows * kVocab * 4;
constexpr int64_t kTargetsBytes = kRows * 8;
// What each charges a tenant's byte quota (no label).
constexpr int64_t kLogitsCharge = kLogitsBytes + kTensorBookkeepingBytes;
constexpr int64_t kTargetsCharge = kTargetsBytes + kTensorBookkeepingBytes;

// Where a connection goes and what it presents: TLS files and a token.
struct Identity {
  std::string token;
  bool tls = false;
  std::string cert;  // client certificate name in the Pki ("" = none)
  std::string ca = "ca.pem";
};

// One client of the lossd API over raw stubs.
class Caller {
 public:
  Caller(const std::string& address, const Identity& identity)
      : token_(identity.token) {
    grpc::ChannelArguments args;
    // Its own connection: one test's callers never share a TLS session.
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    std::shared_ptr<grpc::ChannelCredentials> credentials =
        grpc::InsecureChannelCredentials();
    if (identity.tls) {
      grpc::SslCredentialsOptions ssl;
      ssl.pem_root_certs = Read(identity.ca);
      if (!identity.cert.empty()) {
        ssl.pem_cert_chain = Read(identity.cert + ".pem");
        ssl.pem_private_key = Read(identity.cert + ".key");
      }
      credentials = grpc::SslCredentials(ssl);
    }
    channel_ = grpc::CreateCustomChannel(address, credentials, args);
    stub_ = pb::Lossd::NewStub(channel_);
    health_ = grpc::health::v1::Health::NewStub(channel_);
  }

  void Prepare(grpc::ClientContext* context) const {
    context->set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(20)));
    if (!token_.empty()) {
      context->AddMetadata("authorization", "Bearer " + token_);
    }
  }

  grpc::Status Upload(pb::DType dtype, std::vector<int64_t> shape,
                      const std::string& bytes, pb::TensorInfo* info) {
    grpc::ClientContext context;
    Prepare(&context);
    pb::UploadResponse response;
    auto writer = stub_->Upload(&context, &response);
    pb::UploadRequest request;
    request.mutable_header()->set_dtype(dtype);
    for (int64_t dim : shape) request.mutable_header()->add_shape(dim);
    if (writer->Write(request)) {
      request.Clear();
      request.mutable_chunk()->assign(bytes);
      writer->Write(request);
    }
    writer->WritesDone();
    const grpc::Status status = writer->Finish();
    if (info != nullptr) *info = response.tensor();
    return status;
  }

  grpc::Status Describe(const std::string& handle,
                        pb::TensorInfo* info = nullptr) {
    grpc::ClientContext context;
    Prepare(&context);
    pb::DescribeRequest request;
    request.set_handle(handle);
    pb::TensorInfo response;
    const grpc::Status status = stub_->Describe(&context, request, &response);
    if (info != nullptr) *info = response;
    return status;
  }

  grpc::Status List(pb::ListResponse* response) {
    grpc::ClientContext context;
    Prepare(&context);
    return stub_->List(&context, pb::ListRequest(), response);
  }

  grpc::Status Release(const std::string& handle) {
    grpc::ClientContext context;
    Prepare(&context);
    pb::ReleaseRequest request;
    request.set_handle(handle);
    pb::ReleaseResponse response;
    return stub_->Release(&context, request, &response);
  }

  grpc::Status Download(const std::string& handle) {
    grpc::ClientContext context;
    Prepare(&context);
    pb::DownloadRequest request;
    request.set_handle(handle);
    auto reader = stub_->Download(&context, request);
    pb::DownloadResponse response;
    while (reader->Read(&response)) {
    }
    return reader->Finish();
  }

  grpc::Status Forward(const std::string& logits, const std::string& targets,
                       pb::GradientMode mode = pb::GRADIENT_MODE_IN_PLACE,
                       const std::string& class_weights = "") {
    grpc::ClientContext context;
    Prepare(&context);
    pb::ForwardRequest request;
    request.set_logits(logits);
    request.set_targets_handle(targets);
    request.set_mode(mode);
    request.mutable_options()->set_class_weights(class_weights);
    pb::ForwardResponse response;
    return stub_->Forward(&context, request, &response);
  }

  grpc::Status Backward(const std::string& gradient, double grad_output) {
    grpc::ClientContext context;
    Prepare(&context);
    pb::BackwardRequest request;
    request.set_gradient(gradient);
    request.set_scalar(grad_output);
    pb::BackwardResponse response;
    return stub_->Backward(&context, request, &response);
  }

  // True when `service` is SERVING; false on any error.
  bool Serving(const std::string& service) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(20)));
    grpc::health::v1::HealthCheckRequest request;
    request.set_service(service);
    grpc::health::v1::HealthCheckResponse response;
    return health_->Check(&context, request, &response).ok() &&
           response.status() == grpc::health::v1::HealthCheckResponse::SERVING;
  }

  pb::Lossd::Stub* stub() { return stub_.get(); }

 private:
  static std::string Read(const std::string& name) {
    std::ifstream in(Pki::Get()->Path(name));
    return std::string(std::istreambuf_iterator<char>(in),
                       std::istreambuf_iterator<char>());
  }

  const std::string token_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<pb::Lossd::Stub> stub_;
  std::unique_ptr<grpc::health::v1::Health::Stub> health_;
};

Identity Token(const std::string& token) {
  Identity identity;
  identity.token = token;
  return identity;
}

Identity Certificate(const std::string& name) {
  Identity identity;
  identity.tls = true;
  identity.cert = name;
  return identity;
}

class AuthTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(Pki::Get()->ok()) << Pki::Get()->error();
    const unsigned seed = std::random_device()();
    rng_.seed(seed);
    seed_note_ = absl::StrCat("seed ", seed);
  }

  std::string WriteTokens(const std::string& text) {
    const std::string path = Pki::Get()->Path(absl::StrCat(
        "tokens-",
        ::testing::UnitTest::GetInstance()->current_test_info()->name()));
    std::ofstream(path) << text;
    return path;
  }

  static ServerConfig BaseConfig() {
    ServerConfig config;
    config.host = "127.0.0.1";
    config.port = 0;
    config.device = "cpu";
    config.memory_budget = 1 << 20;
    config.threads = 1;
    config.drain_timeout = absl::Seconds(10);
    return config;
  }

  static ServerConfig MtlsConfig() {
    ServerConfig config = BaseConfig();
    config.auth.tls_cert_file = Pki::Get()->Path("server.pem");
    config.auth.tls_key_file = Pki::Get()->Path("server.key");
    config.auth.tls_client_ca_file = Pki::Get()->Path("ca.pem");
    config.health_port = 0;
    return config;
  }

  void Start(const ServerConfig& config) {
    server_.reset();
    auto server = LossdServer::Start(config);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
  }

  std::unique_ptr<Caller> Connect(const Identity& identity, int port = 0) {
    return std::make_unique<Caller>(
        absl::StrCat("127.0.0.1:", port == 0 ? server_->port() : port),
        identity);
  }

  std::string RandomLogits() {
    std::normal_distribution<float> normal(0.0f, 2.0f);
    std::vector<float> logits(kRows * kVocab);
    for (float& value : logits) value = normal(rng_);
    return std::string(reinterpret_cast<const char*>(logits.data()),
                       logits.size() * sizeof(float));
  }

  grpc::Status UploadLogits(Caller& caller, pb::TensorInfo* info = nullptr) {
    return caller.Upload(pb::DTYPE_FLOAT32, {kRows, kVocab}, RandomLogits(),
                         info);
  }

  grpc::Status UploadTargets(Caller& caller, pb::TensorInfo* info = nullptr) {
    std::uniform_int_distribution<int64_t> pick(0, kVocab - 1);
    std::vector<int64_t> targets(kRows);
    for (int64_t& target : targets) target = pick(rng_);
    return caller.Upload(
        pb::DTYPE_INT64, {kRows},
        std::string(reinterpret_cast<const char*>(targets.data()),
                    kTargetsBytes),
        info);
  }

  // The tenant's in-flight RPCs reach `count`. The server admits a stream on
  // its own threads: this waits for that, up to a bound, without sleeping.
  bool AwaitInFlight(const std::string& tenant, int64_t count) {
    const absl::Time deadline = absl::Now() + absl::Seconds(20);
    while (server_->quotas()->UsageOf(tenant).in_flight != count) {
      if (absl::Now() > deadline) return false;
      std::this_thread::yield();
    }
    return true;
  }

  std::mt19937 rng_;
  std::string seed_note_;
  std::unique_ptr<LossdServer> server_;
};

// ---------------------------------------------------------------- tokens

TEST_F(AuthTest, TokensMapToTenantsAndRefuseMissingOrWrongOnes) {
  ServerConfig config = BaseConfig();
  config.auth.tokens_file =
      WriteTokens("# test tokens\nsecret-a alpha\n\nsecret-b beta  # two\n");
  Start(config);

  for (const std::string token : {"", "secret-c", "secret", "secret-ab"}) {
    std::unique_ptr<Caller> caller = Connect(Token(token));
    pb::ListResponse list;
    const grpc::Status status = caller->List(&list);
    EXPECT_EQ(status.error_code(), StatusCode::UNAUTHENTICATED)
        << "token '" << token << "': " << status.error_message();
    EXPECT_THAT(status.error_message(), Not(HasSubstr("secret")));
    EXPECT_EQ(UploadLogits(*caller).error_code(), StatusCode::UNAUTHENTICATED);
    EXPECT_EQ(caller->Download("x-y").error_code(),
              StatusCode::UNAUTHENTICATED);
  }
  EXPECT_EQ(server_->store()->Stats().used_bytes, 0);
  EXPECT_EQ(server_->store()->Stats().tensors, 0);

  std::unique_ptr<Caller> alpha = Connect(Token("secret-a"));
  pb::TensorInfo info;
  ASSERT_TRUE(UploadLogits(*alpha, &info).ok()) << seed_note_;
  EXPECT_EQ(info.tenant(), "alpha");
  // Health needs no token (probes have none).
  EXPECT_TRUE(Connect(Identity())->Serving(kReadinessService));
}

TEST_F(AuthTest, MalformedAuthorizationHeaderIsUnauthenticated) {
  ServerConfig config = BaseConfig();
  config.auth.tokens_file = WriteTokens("secret-a alpha\n");
  Start(config);
  std::unique_ptr<Caller> caller = Connect(Identity());
  for (const std::string header :
       {"secret-a", "Basic secret-a", "bearer secret-a", "Bearer "}) {
    grpc::ClientContext context;
    context.AddMetadata("authorization", header);
    pb::ListResponse response;
    EXPECT_EQ(caller->stub()
                  ->List(&context, pb::ListRequest(), &response)
                  .error_code(),
              StatusCode::UNAUTHENTICATED)
        << header;
  }
  grpc::ClientContext twice;
  twice.AddMetadata("authorization", "Bearer secret-a");
  twice.AddMetadata("authorization", "Bearer secret-a");
  pb::ListResponse response;
  EXPECT_EQ(
      caller->stub()->List(&twice, pb::ListRequest(), &response).error_code(),
      StatusCode::UNAUTHENTICATED);
}

TEST(ParseTokensTest, RejectsMalformedFiles) {
  EXPECT_EQ(ParseTokens("").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseTokens("# only a comment\n").status().code(),
            absl::StatusCode::kInvalidArgument);
  const absl::Status three = ParseTokens("a b\nsecret t extra\n").status();
  EXPECT_EQ(three.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(three.message()), HasSubstr("line 2"));
  EXPECT_THAT(std::string(three.message()), Not(HasSubstr("secret")));
  EXPECT_EQ(ParseTokens("t a\nt b\n").status().code(),
            absl::StatusCode::kInvalidArgument);
  const auto tokens = ParseTokens("t1 a\r\n\tt2\tb # c\n");
  ASSERT_TRUE(tokens.ok()) << tokens.status();
  ASSERT_EQ(tokens->size(), 2u);
  EXPECT_EQ((*tokens)[1].first, "t2");
  EXPECT_EQ((*tokens)[1].second, "b");
}

TEST_F(AuthTest, InconsistentConfigurationsAreRefused) {
  ServerConfig config = BaseConfig();
  config.auth.tls_client_ca_file = Pki::Get()->Path("ca.pem");
  EXPECT_EQ(LossdServer::Start(config).status().code(),
            absl::StatusCode::kInvalidArgument);
  config = BaseConfig();
  config.auth.tls_cert_file = Pki::Get()->Path("server.pem");
  EXPECT_EQ(LossdServer::Start(config).status().code(),
            absl::StatusCode::kInvalidArgument);
  config.auth.tls_key_file = Pki::Get()->Path("server.key");
  config.auth.cert_tenant = "ou";
  EXPECT_EQ(LossdServer::Start(config).status().code(),
            absl::StatusCode::kInvalidArgument);
  config = BaseConfig();
  config.auth.tokens_file = Pki::Get()->Path("no-such-file");
  EXPECT_EQ(LossdServer::Start(config).status().code(),
            absl::StatusCode::kInvalidArgument);
  config = BaseConfig();
  config.tenant_limits.max_tensors = -1;
  EXPECT_EQ(LossdServer::Start(config).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// ---------------------------------------------------------------- isolation

TEST_F(AuthTest, TenantsCannotSeeOrTouchEachOthersTensors) {
  ServerConfig config = BaseConfig();
  config.auth.tokens_file = WriteTokens("secret-a alpha\nsecret-b beta\n");
  Start(config);
  std::unique_ptr<Caller> alpha = Connect(Token("secret-a"));
  std::unique_ptr<Caller> beta = Connect(Token("secret-b"));

  pb::TensorInfo logits, targets, kept, weights, own, own_targets;
  ASSERT_TRUE(UploadLogits(*alpha, &logits).ok()) << seed_note_;
  ASSERT_TRUE(UploadTargets(*alpha, &targets).ok());
  ASSERT_TRUE(UploadLogits(*alpha, &kept).ok());
  const std::vector<float> ones(kVocab, 1.0f);
  ASSERT_TRUE(
      alpha
          ->Upload(pb::DTYPE_FLOAT32, {kVocab},
                   std::string(reinterpret_cast<const char*>(ones.data()),
                               kVocab * sizeof(float)),
                   &weights)
          .ok());
  ASSERT_TRUE(UploadLogits(*beta, &own).ok());
  ASSERT_TRUE(UploadTargets(*beta, &own_targets).ok());
  // alpha's logits become a gradient, so that Backward has a target.
  ASSERT_TRUE(alpha->Forward(logits.handle(), targets.handle()).ok());
  const std::string gradient = logits.handle();
  const StoreStats before = server_->store()->Stats();

  const auto expect_not_found = [](const grpc::Status& status,
                                   const std::string& what) {
    EXPECT_EQ(status.error_code(), StatusCode::NOT_FOUND)
        << what << ": " << status.error_message();
    // Indistinguishable from a handle that never existed.
    EXPECT_THAT(status.error_message(), HasSubstr("unknown handle")) << what;
  };
  for (const std::string& handle :
       {gradient, targets.handle(), kept.handle(), weights.handle()}) {
    expect_not_found(beta->Describe(handle), "Describe");
    expect_not_found(beta->Download(handle), "Download");
    expect_not_found(beta->Release(handle), "Release");
    expect_not_found(beta->Backward(handle, 2.0), "Backward");
    expect_not_found(beta->Forward(handle, own_targets.handle()),
                     "Forward on foreign logits");
    expect_not_found(
        beta->Forward(own.handle(), handle, pb::GRADIENT_MODE_NONE),
        "Forward with foreign targets");
  }
  expect_not_found(beta->Forward(own.handle(), own_targets.handle(),
                                 pb::GRADIENT_MODE_NONE, weights.handle()),
                   "Forward with foreign class weights");
  // The same weights serve their owner.
  EXPECT_TRUE(alpha
                  ->Forward(kept.handle(), targets.handle(),
                            pb::GRADIENT_MODE_NONE, weights.handle())
                  .ok());

  // Nothing changed: beta's logits are still logits, alpha's gradient has no
  // factor recorded, no tensor or byte came or went.
  const StoreStats after = server_->store()->Stats();
  EXPECT_EQ(after.tensors, before.tensors);
  EXPECT_EQ(after.used_bytes, before.used_bytes);
  pb::TensorInfo info;
  ASSERT_TRUE(beta->Describe(own.handle(), &info).ok());
  EXPECT_EQ(info.state(), pb::TENSOR_STATE_LOGITS);
  ASSERT_TRUE(alpha->Describe(gradient, &info).ok());
  EXPECT_EQ(info.state(), pb::TENSOR_STATE_GRADIENT);
  EXPECT_EQ(info.pending_scale(), 1.0);

  pb::ListResponse alpha_list, beta_list;
  ASSERT_TRUE(alpha->List(&alpha_list).ok());
  ASSERT_TRUE(beta->List(&beta_list).ok());
  ASSERT_EQ(alpha_list.tensors_size(), 4);
  for (const pb::TensorInfo& tensor : alpha_list.tensors()) {
    EXPECT_EQ(tensor.tenant(), "alpha");
  }
  ASSERT_EQ(beta_list.tensors_size(), 2);
  for (const pb::TensorInfo& tensor : beta_list.tensors()) {
    EXPECT_EQ(tensor.tenant(), "beta");
  }
  // Released by its owner, a handle stays NOT_FOUND to everyone.
  ASSERT_TRUE(alpha->Release(kept.handle()).ok());
  EXPECT_EQ(alpha->Describe(kept.handle()).error_code(), StatusCode::NOT_FOUND);
  EXPECT_EQ(beta->Describe(kept.handle()).error_code(), StatusCode::NOT_FOUND);
  EXPECT_EQ(server_->store()->Stats().tensors, before.tensors - 1);
}

// ---------------------------------------------------------------- quotas

TEST_F(AuthTest, ByteQuotaOfOneTenantLeavesTheOtherUnaffected) {
  ServerConfig config = BaseConfig();
  config.auth.tokens_file = WriteTokens("secret-a alpha\nsecret-b beta\n");
  // Two logits and one targets tensor, not three logits.
  config.tenant_limits.max_bytes = 2 * kLogitsCharge + kTargetsCharge;
  Start(config);
  std::unique_ptr<Caller> alpha = Connect(Token("secret-a"));
  std::unique_ptr<Caller> beta = Connect(Token("secret-b"));
  pb::TensorInfo first;
  ASSERT_TRUE(UploadLogits(*alpha, &first).ok());
  ASSERT_TRUE(UploadLogits(*alpha).ok());
  const StoreStats before = server_->store()->Stats();
  const grpc::Status over = UploadLogits(*alpha);
  EXPECT_EQ(over.error_code(), StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(over.error_message(), HasSubstr("tenant 'alpha'"));
  EXPECT_THAT(over.error_message(),
              HasSubstr(absl::StrCat("requested ", kLogitsCharge)));
  EXPECT_THAT(over.error_message(),
              HasSubstr(absl::StrCat(2 * kLogitsCharge, " of ",
                                     config.tenant_limits.max_bytes)));
  EXPECT_EQ(server_->quotas()->UsageOf("alpha").bytes, 2 * kLogitsCharge);
  EXPECT_TRUE(
      server_->store()->AwaitUsedBytes(before.used_bytes, absl::Seconds(20)));

  EXPECT_TRUE(UploadLogits(*beta).ok());
  EXPECT_TRUE(UploadLogits(*beta).ok());
  // An out-of-place gradient counts against its tenant like an upload.
  pb::TensorInfo targets;
  ASSERT_TRUE(UploadTargets(*alpha, &targets).ok());
  EXPECT_EQ(alpha
                ->Forward(first.handle(), targets.handle(),
                          pb::GRADIENT_MODE_OUT_OF_PLACE)
                .error_code(),
            StatusCode::RESOURCE_EXHAUSTED);
  ASSERT_TRUE(alpha->Release(first.handle()).ok());
  EXPECT_TRUE(UploadLogits(*alpha).ok());
}

TEST_F(AuthTest, TensorQuotaOfOneTenantLeavesTheOtherUnaffected) {
  ServerConfig config = BaseConfig();
  config.auth.tokens_file = WriteTokens("secret-a alpha\nsecret-b beta\n");
  config.tenant_limits.max_tensors = 2;
  Start(config);
  std::unique_ptr<Caller> alpha = Connect(Token("secret-a"));
  std::unique_ptr<Caller> beta = Connect(Token("secret-b"));
  pb::TensorInfo first;
  ASSERT_TRUE(UploadTargets(*alpha, &first).ok());
  ASSERT_TRUE(UploadTargets(*alpha).ok());
  const grpc::Status over = UploadTargets(*alpha);
  EXPECT_EQ(over.error_code(), StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(over.error_message(), HasSubstr("2 of 2 tensors"));
  EXPECT_TRUE(UploadTargets(*beta).ok());
  EXPECT_TRUE(UploadTargets(*beta).ok());
  ASSERT_TRUE(alpha->Release(first.handle()).ok());
  EXPECT_TRUE(UploadTargets(*alpha).ok());
  EXPECT_EQ(server_->store()->Stats().tensors, 4);
}

TEST_F(AuthTest, InFlightQuotaOfOneTenantLeavesTheOtherUnaffected) {
  ServerConfig config = BaseConfig();
  config.auth.tokens_file = WriteTokens("secret-a alpha\nsecret-b beta\n");
  config.tenant_limits.max_in_flight = 2;
  Start(config);
  std::unique_ptr<Caller> alpha = Connect(Token("secret-a"));
  std::unique_ptr<Caller> beta = Connect(Token("secret-b"));
  // Two uploads of alpha stay open.
  grpc::ClientContext contexts[2];
  pb::UploadResponse responses[2];
  std::unique_ptr<grpc::ClientWriter<pb::UploadRequest>> writers[2];
  for (int i = 0; i < 2; ++i) {
    alpha->Prepare(&contexts[i]);
    writers[i] = alpha->stub()->Upload(&contexts[i], &responses[i]);
  }
  ASSERT_TRUE(AwaitInFlight("alpha", 2));

  pb::ListResponse list;
  const grpc::Status over = alpha->List(&list);
  EXPECT_EQ(over.error_code(), StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(over.error_message(), HasSubstr("2 of 2 RPCs"));
  EXPECT_TRUE(beta->List(&list).ok());
  EXPECT_TRUE(UploadLogits(*beta).ok());

  for (int i = 0; i < 2; ++i) {
    contexts[i].TryCancel();
    EXPECT_EQ(writers[i]->Finish().error_code(), StatusCode::CANCELLED);
  }
  ASSERT_TRUE(AwaitInFlight("alpha", 0));
  EXPECT_TRUE(alpha->List(&list).ok());
}

// ---------------------------------------------------------------- TLS

TEST_F(AuthTest, TlsServesTlsClientsAndRefusesPlaintext) {
  ServerConfig config = BaseConfig();
  config.auth.tls_cert_file = Pki::Get()->Path("server.pem");
  config.auth.tls_key_file = Pki::Get()->Path("server.key");
  Start(config);
  pb::TensorInfo info;
  ASSERT_TRUE(UploadLogits(*Connect(Certificate("")), &info).ok());
  EXPECT_EQ(info.tenant(), kDefaultTenant);  // TLS alone identifies no one

  pb::ListResponse list;
  EXPECT_EQ(Connect(Identity())->List(&list).error_code(),
            StatusCode::UNAVAILABLE);
  // A server certificate from an unknown CA is refused by the client.
  Identity rogue_ca = Certificate("");
  rogue_ca.ca = "rogue-ca.pem";
  EXPECT_EQ(Connect(rogue_ca)->List(&list).error_code(),
            StatusCode::UNAVAILABLE);
}

TEST_F(AuthTest, MtlsClientCertificateNamesTheTenant) {
  Start(MtlsConfig());
  std::unique_ptr<Caller> alpha = Connect(Certificate("alpha"));
  std::unique_ptr<Caller> beta = Connect(Certificate("beta"));
  pb::TensorInfo info;
  ASSERT_TRUE(UploadLogits(*alpha, &info).ok());
  EXPECT_EQ(info.tenant(), "alpha");
  EXPECT_EQ(beta->Describe(info.handle()).error_code(), StatusCode::NOT_FOUND);
  pb::ListResponse list;
  ASSERT_TRUE(beta->List(&list).ok());
  EXPECT_EQ(list.tensors_size(), 0);
}

TEST_F(AuthTest, MtlsRefusesClientsWithoutTrustedCertificate) {
  Start(MtlsConfig());
  for (const std::string name : {"", "rogue"}) {
    std::unique_ptr<Caller> caller = Connect(Certificate(name));
    pb::ListResponse list;
    EXPECT_EQ(caller->List(&list).error_code(), StatusCode::UNAVAILABLE)
        << "client certificate '" << name << "'";
    EXPECT_EQ(UploadLogits(*caller).error_code(), StatusCode::UNAVAILABLE);
  }
  EXPECT_EQ(server_->store()->Stats().tensors, 0);
  EXPECT_EQ(server_->store()->Stats().used_bytes, 0);
}

TEST_F(AuthTest, MtlsSubjectAlternativeNameWithPrefixNamesTheTenant) {
  ServerConfig config = MtlsConfig();
  config.auth.cert_tenant = "san:spiffe://lossd.test/tenant/";
  Start(config);
  pb::TensorInfo info;
  ASSERT_TRUE(UploadLogits(*Connect(Certificate("beta")), &info).ok());
  EXPECT_EQ(info.tenant(), "beta");

  config.auth.cert_tenant = "san:spiffe://other.test/";
  Start(config);
  pb::ListResponse list;
  const grpc::Status none = Connect(Certificate("beta"))->List(&list);
  EXPECT_EQ(none.error_code(), StatusCode::UNAUTHENTICATED);
  EXPECT_THAT(none.error_message(), HasSubstr("spiffe://other.test/"));
}

TEST_F(AuthTest, MtlsTokenAndCertificateMustNameTheSameTenant) {
  ServerConfig config = MtlsConfig();
  config.auth.tokens_file = WriteTokens("secret-a alpha\nsecret-b beta\n");
  Start(config);
  Identity identity = Certificate("alpha");
  pb::ListResponse list;
  EXPECT_EQ(Connect(identity)->List(&list).error_code(),
            StatusCode::UNAUTHENTICATED);
  identity.token = "secret-b";
  EXPECT_EQ(Connect(identity)->List(&list).error_code(),
            StatusCode::PERMISSION_DENIED);
  identity.token = "secret-a";
  EXPECT_TRUE(Connect(identity)->List(&list).ok());
}

TEST_F(AuthTest, PlaintextHealthPortAnswersProbesAndNothingElse) {
  Start(MtlsConfig());
  ASSERT_GT(server_->health_port(), 0);
  ASSERT_NE(server_->health_port(), server_->port());
  std::unique_ptr<Caller> probe = Connect(Identity(), server_->health_port());
  EXPECT_TRUE(probe->Serving(""));
  EXPECT_TRUE(probe->Serving(kReadinessService));
  pb::ListResponse list;
  EXPECT_EQ(probe->List(&list).error_code(), StatusCode::UNIMPLEMENTED);
  EXPECT_EQ(UploadLogits(*probe).error_code(), StatusCode::UNIMPLEMENTED);
  // The main port refuses the probe's plaintext.
  EXPECT_FALSE(Connect(Identity())->Serving(""));
  // Readiness follows the main port's through a drain.
  server_->Drain();
  EXPECT_FALSE(probe->Serving(kReadinessService));
}

}  // namespace
}  // namespace lossd
