// Issue 21, live reload: the certificate, the tokens and the quota file are
// replaced while a client is connected, the way Kubernetes updates a mounted
// Secret or ConfigMap (a new timestamped directory, then one rename of the
// ..data symlink that the file names go through). An in-process server on
// 127.0.0.1:0 checks the files every 20 ms; each test waits for the reload to
// show in /metrics (a condition, polled with a deadline), then checks its
// effect once.
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "lossd/v1/lossd.grpc.pb.h"
#include "server/auth.h"
#include "server/metrics.h"
#include "server/server.h"
#include "tests/e2e/scrape.h"
#include "tests/e2e/test_pki.h"

namespace lossd {
namespace {

namespace pb = ::lossd::v1;
using ::grpc::StatusCode;
using Labels = std::map<std::string, std::string>;

constexpr absl::Duration kReloadInterval = absl::Milliseconds(20);
constexpr absl::Duration kWait = absl::Seconds(20);

// A directory laid out as the kubelet lays out a Secret or ConfigMap volume:
// NAME -> ..data/NAME, ..data -> ..<version>, each version a directory of
// regular files. Update() swaps every file at once, as the kubelet does.
class MountedVolume {
 public:
  MountedVolume(const std::string& dir,
                const std::map<std::string, std::string>& files)
      : dir_(dir) {
    std::filesystem::create_directories(dir_);
    Update(files);
    for (const auto& [name, text] : files) {
      std::filesystem::create_symlink("..data/" + name, dir_ + "/" + name);
    }
  }

  void Update(const std::map<std::string, std::string>& files) {
    const std::string version = absl::StrCat("..2026_12_02_", ++version_);
    std::filesystem::create_directory(dir_ + "/" + version);
    for (const auto& [name, text] : files) {
      std::ofstream(dir_ + "/" + version + "/" + name) << text;
    }
    const std::string staged = dir_ + "/..data_tmp";
    std::filesystem::create_symlink(version, staged);
    std::filesystem::rename(staged, dir_ + "/..data");
    if (!previous_.empty()) std::filesystem::remove_all(dir_ + "/" + previous_);
    previous_ = version;
  }

  std::string Path(const std::string& name) const { return dir_ + "/" + name; }

 private:
  const std::string dir_;
  int version_ = 0;
  std::string previous_;
};

// A client with its own connection (one channel, no shared subchannels).
class Caller {
 public:
  Caller(int port, const std::string& token, const std::string& root_ca = "")
      : token_(token) {
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    std::shared_ptr<grpc::ChannelCredentials> credentials =
        grpc::InsecureChannelCredentials();
    if (!root_ca.empty()) {
      grpc::SslCredentialsOptions ssl;
      ssl.pem_root_certs = Pki::Get()->Read(root_ca);
      credentials = grpc::SslCredentials(ssl);
    }
    channel_ = grpc::CreateCustomChannel(absl::StrCat("127.0.0.1:", port),
                                         credentials, args);
    stub_ = pb::Lossd::NewStub(channel_);
  }

  grpc::Status List() {
    grpc::ClientContext context;
    Prepare(&context);
    pb::ListResponse response;
    return stub_->List(&context, pb::ListRequest(), &response);
  }

  // A float32 tensor of `rows` x 4 zeros.
  grpc::Status Upload(int64_t rows) {
    grpc::ClientContext context;
    Prepare(&context);
    pb::UploadResponse response;
    auto writer = stub_->Upload(&context, &response);
    pb::UploadRequest request;
    request.mutable_header()->set_dtype(pb::DTYPE_FLOAT32);
    request.mutable_header()->add_shape(rows);
    request.mutable_header()->add_shape(4);
    if (writer->Write(request)) {
      request.Clear();
      request.mutable_chunk()->assign(static_cast<size_t>(rows * 16), '\0');
      writer->Write(request);
    }
    writer->WritesDone();
    return writer->Finish();
  }

  grpc_connectivity_state state() { return channel_->GetState(false); }

 private:
  void Prepare(grpc::ClientContext* context) const {
    context->set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    if (!token_.empty()) {
      context->AddMetadata("authorization", "Bearer " + token_);
    }
  }

  const std::string token_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<pb::Lossd::Stub> stub_;
};

class ReloadTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(Pki::Get()->ok()) << Pki::Get()->error();
    dir_ = Pki::Get()->Path(
        ::testing::UnitTest::GetInstance()->current_test_info()->name());
  }

  static ServerConfig BaseConfig() {
    ServerConfig config;
    config.host = "127.0.0.1";
    config.port = 0;
    config.metrics_port = 0;
    config.device = "cpu";
    config.memory_budget = 1 << 20;
    config.threads = 1;
    config.drain_timeout = absl::Seconds(10);
    config.reload_interval = kReloadInterval;
    return config;
  }

  void Start(const ServerConfig& config) {
    auto server = LossdServer::Start(config);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
  }

  double Metric(const std::string& name, const Labels& labels) {
    absl::StatusOr<std::vector<scrape::Sample>> samples =
        scrape::Scrape(server_->metrics_port());
    EXPECT_TRUE(samples.ok()) << samples.status();
    if (!samples.ok()) return -1;
    return scrape::FindSample(*samples, name, labels).value_or(0.0);
  }

  double Reloads(const std::string& config, const std::string& result) {
    return Metric("lossd_config_reloads_total",
                  {{"config", config}, {"result", result}});
  }

  // Waits until `config` has been reloaded with `result` `count` times.
  bool AwaitReloads(const std::string& config, const std::string& result,
                    double count) {
    const absl::Time deadline = absl::Now() + kWait;
    while (Reloads(config, result) < count) {
      if (absl::Now() > deadline) return false;
      absl::SleepFor(kReloadInterval / 4);
    }
    return true;
  }

  std::string dir_;
  std::unique_ptr<LossdServer> server_;
};

TEST_F(ReloadTest, TokensSwappedLikeASecretTakeEffectOnTheNextRequest) {
  MountedVolume secret(dir_, {{"tokens", "tok-a alpha\ntok-b beta\n"}});
  ServerConfig config = BaseConfig();
  config.auth.tokens_file = secret.Path("tokens");
  Start(config);
  Caller alpha(server_->port(), "tok-a");
  Caller beta(server_->port(), "tok-b");
  ASSERT_TRUE(alpha.List().ok());
  ASSERT_TRUE(beta.List().ok());
  EXPECT_EQ(Caller(server_->port(), "tok-c").List().error_code(),
            StatusCode::UNAUTHENTICATED);

  // beta's token goes, gamma's comes; both callers stay connected.
  secret.Update({{"tokens", "tok-a alpha\ntok-c gamma\n"}});
  ASSERT_TRUE(AwaitReloads("tokens", "success", 1));
  EXPECT_EQ(beta.List().error_code(), StatusCode::UNAUTHENTICATED);
  EXPECT_TRUE(alpha.List().ok());
  EXPECT_TRUE(Caller(server_->port(), "tok-c").List().ok());
  EXPECT_EQ(
      Metric("lossd_config_last_reload_successful", {{"config", "tokens"}}), 1);
  // The new tenant is a configured one: its own label value.
  EXPECT_EQ(
      Metric("lossd_tenant_rpc_total", {{"tenant", "gamma"}, {"code", "OK"}}),
      1);
  EXPECT_EQ(Metric("lossd_tenant_rpc_total",
                   {{"tenant", kNoTenantLabel}, {"code", "UNAUTHENTICATED"}}),
            2);
}

TEST_F(ReloadTest, MalformedTokensFileKeepsTheTokensInForce) {
  MountedVolume secret(dir_, {{"tokens", "tok-a alpha\n"}});
  ServerConfig config = BaseConfig();
  config.auth.tokens_file = secret.Path("tokens");
  Start(config);
  Caller alpha(server_->port(), "tok-a");
  ASSERT_TRUE(alpha.List().ok());

  secret.Update({{"tokens", "tok-a alpha extra-field\ntok-b beta\n"}});
  ASSERT_TRUE(AwaitReloads("tokens", "failure", 1));
  EXPECT_EQ(
      Metric("lossd_config_last_reload_successful", {{"config", "tokens"}}), 0);
  EXPECT_TRUE(alpha.List().ok());
  EXPECT_EQ(Caller(server_->port(), "tok-b").List().error_code(),
            StatusCode::UNAUTHENTICATED);
  // An empty file is refused too (a half-written Secret must not lock
  // everyone out).
  secret.Update({{"tokens", ""}});
  ASSERT_TRUE(AwaitReloads("tokens", "failure", 2));
  EXPECT_TRUE(alpha.List().ok());
  EXPECT_EQ(Reloads("tokens", "success"), 0);

  // Reload() (what SIGHUP calls) re-reads even an unchanged file.
  EXPECT_FALSE(server_->Reload().ok());
  EXPECT_EQ(Reloads("tokens", "failure"), 3);
}

TEST_F(ReloadTest, NewQuotaAppliesToTheNextRequest) {
  MountedVolume config_map(dir_, {{"quotas", "* max_tensors=1\n"}});
  ServerConfig config = BaseConfig();
  config.auth.tokens_file = Pki::Get()->Path("reload-tokens");
  std::ofstream(config.auth.tokens_file) << "tok-a alpha\ntok-b beta\n";
  config.quota_file = config_map.Path("quotas");
  Start(config);
  Caller alpha(server_->port(), "tok-a");
  Caller beta(server_->port(), "tok-b");
  ASSERT_TRUE(alpha.Upload(2).ok());
  EXPECT_EQ(alpha.Upload(2).error_code(), StatusCode::RESOURCE_EXHAUSTED);

  // alpha gets three tensors and 4 KiB, the rest keep one tensor of 64
  // bytes at most (each tensor also counts kTensorBookkeepingBytes, 1024).
  config_map.Update({{"quotas",
                      "# tenant  limits\n"
                      "*      max_tensors=1 max_bytes=1088\n"
                      "alpha  max_tensors=3 max_bytes=4K\n"}});
  ASSERT_TRUE(AwaitReloads("quotas", "success", 1));
  EXPECT_EQ(server_->quotas()->LimitsOf("alpha").max_tensors, 3);
  EXPECT_TRUE(alpha.Upload(2).ok());
  EXPECT_TRUE(alpha.Upload(2).ok());
  EXPECT_EQ(alpha.Upload(2).error_code(), StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(beta.Upload(8).error_code(), StatusCode::RESOURCE_EXHAUSTED)
      << "128 bytes over beta's 64";
  EXPECT_TRUE(beta.Upload(4).ok());

  // A malformed file leaves those limits in force.
  config_map.Update({{"quotas", "alpha max_tensors=lots\n"}});
  ASSERT_TRUE(AwaitReloads("quotas", "failure", 1));
  EXPECT_EQ(server_->quotas()->LimitsOf("alpha").max_tensors, 3);
  EXPECT_EQ(server_->quotas()->LimitsOf("beta").max_bytes, 1088);
  EXPECT_EQ(
      Metric("lossd_config_last_reload_successful", {{"config", "quotas"}}), 0);
  // Per-tenant gauges: configured tenants by name.
  EXPECT_EQ(Metric("lossd_tensors", {{"device", "cpu"}, {"tenant", "alpha"}}),
            3);
  EXPECT_EQ(Metric("lossd_tenant_transfer_bytes_total",
                   {{"tenant", "beta"}, {"direction", "upload"}}),
            64);
}

// Issue 31: an emptied quota file (a ConfigMap caught empty, a shell's '>')
// is a failed reload, by the period and by SIGHUP alike, and every limit in
// force stays; it used to count as a success that dropped them all. A file
// of comments only is a deliberate "no per-tenant limit".
TEST_F(ReloadTest, EmptyQuotaFileKeepsTheQuotasInForce) {
  MountedVolume config_map(dir_, {{"quotas", "alpha max_tensors=1\n"}});
  ServerConfig config = BaseConfig();
  config.auth.tokens_file = Pki::Get()->Path("empty-quota-tokens");
  std::ofstream(config.auth.tokens_file) << "tok-a alpha\n";
  config.quota_file = config_map.Path("quotas");
  Start(config);
  Caller alpha(server_->port(), "tok-a");
  ASSERT_TRUE(alpha.Upload(2).ok());
  ASSERT_EQ(alpha.Upload(2).error_code(), StatusCode::RESOURCE_EXHAUSTED);

  config_map.Update({{"quotas", ""}});
  ASSERT_TRUE(AwaitReloads("quotas", "failure", 1));
  EXPECT_EQ(
      Metric("lossd_config_last_reload_successful", {{"config", "quotas"}}), 0);
  EXPECT_EQ(server_->quotas()->LimitsOf("alpha").max_tensors, 1);
  EXPECT_EQ(alpha.Upload(2).error_code(), StatusCode::RESOURCE_EXHAUSTED);

  config_map.Update({{"quotas", " \n\t\r\n"}});
  ASSERT_TRUE(AwaitReloads("quotas", "failure", 2));
  const absl::Status sighup = server_->Reload();
  EXPECT_EQ(sighup.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(sighup.message().find("the quota file is empty"), std::string::npos)
      << sighup;
  EXPECT_EQ(Reloads("quotas", "failure"), 3);
  EXPECT_EQ(Reloads("quotas", "success"), 0);
  EXPECT_EQ(server_->quotas()->LimitsOf("alpha").max_tensors, 1);
  EXPECT_EQ(alpha.Upload(2).error_code(), StatusCode::RESOURCE_EXHAUSTED);

  config_map.Update({{"quotas", "# no per-tenant limits\n"}});
  ASSERT_TRUE(AwaitReloads("quotas", "success", 1));
  EXPECT_EQ(
      Metric("lossd_config_last_reload_successful", {{"config", "quotas"}}), 1);
  EXPECT_EQ(server_->quotas()->LimitsOf("alpha").max_tensors, 0);
  EXPECT_TRUE(alpha.Upload(2).ok());
}

TEST_F(ReloadTest, CertificateRotationReachesNewConnectionsOnly) {
  Pki* pki = Pki::Get();
  MountedVolume secret(dir_, {{"tls.crt", pki->Read("server.pem")},
                              {"tls.key", pki->Read("server.key")}});
  ServerConfig config = BaseConfig();
  config.auth.tls_cert_file = secret.Path("tls.crt");
  config.auth.tls_key_file = secret.Path("tls.key");
  config.reload_interval = absl::Seconds(1);  // the TLS library's minimum
  Start(config);
  const double first_expiry =
      Metric("lossd_tls_certificate_expiry_timestamp_seconds",
             {{"certificate", "server"}});
  EXPECT_GT(first_expiry, absl::ToUnixSeconds(absl::Now()));
  Caller connected(server_->port(), "", "ca.pem");
  ASSERT_TRUE(connected.List().ok());

  // A malformed certificate: refused, the old one stays.
  secret.Update({{"tls.crt",
                  "-----BEGIN CERTIFICATE-----\nnot base64\n"
                  "-----END CERTIFICATE-----\n"},
                 {"tls.key", pki->Read("server.key")}});
  ASSERT_TRUE(AwaitReloads("tls", "failure", 1));
  // A key that does not match its certificate: refused too.
  secret.Update({{"tls.crt", pki->Read("server2.pem")},
                 {"tls.key", pki->Read("server.key")}});
  ASSERT_TRUE(AwaitReloads("tls", "failure", 2));
  EXPECT_TRUE(Caller(server_->port(), "", "ca.pem").List().ok());

  // The rotation: another key and certificate, from another CA.
  secret.Update({{"tls.crt", pki->Read("server2.pem")},
                 {"tls.key", pki->Read("server2.key")}});
  ASSERT_TRUE(AwaitReloads("tls", "success", 1));
  EXPECT_GT(Metric("lossd_tls_certificate_expiry_timestamp_seconds",
                   {{"certificate", "server"}}),
            first_expiry + 2 * 86400);
  // The TLS library re-reads the checked files on its own period: new
  // connections get the new certificate within about a second.
  const absl::Time deadline = absl::Now() + kWait;
  while (!Caller(server_->port(), "", "rogue-ca.pem").List().ok()) {
    ASSERT_LT(absl::Now(), deadline) << "the new certificate never served";
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_EQ(Caller(server_->port(), "", "ca.pem").List().error_code(),
            StatusCode::UNAVAILABLE)
      << "a new connection trusting only the old CA";
  // The connection made before the rotation keeps working.
  EXPECT_EQ(connected.state(), GRPC_CHANNEL_READY);
  EXPECT_TRUE(connected.List().ok());
}

// gRPC's certificate provider opens the staged key and certificate one after
// the other and reads again only when a file's modification time (whole
// seconds) changed across its reads: two versions staged in the same second
// could hand it the key of one and the certificate of the other. Each
// version is dated at least a second after the previous one.
TEST_F(ReloadTest, StagedCertificateVersionsAreDatedAtLeastASecondApart) {
  Pki* pki = Pki::Get();
  const std::string tmpdir = dir_ + "-tmp";
  std::filesystem::create_directories(tmpdir);
  const char* saved = std::getenv("TMPDIR");
  const std::string saved_tmpdir = saved != nullptr ? saved : "";
  ::setenv("TMPDIR", tmpdir.c_str(), 1);
  AuthOptions options;
  options.tls_cert_file = pki->Path("server.pem");
  options.tls_key_file = pki->Path("server.key");
  absl::StatusOr<std::unique_ptr<Authenticator>> auth =
      Authenticator::Create(options);
  if (saved != nullptr) {
    ::setenv("TMPDIR", saved_tmpdir.c_str(), 1);
  } else {
    ::unsetenv("TMPDIR");
  }
  ASSERT_TRUE(auth.ok()) << auth.status();
  std::string current;
  for (const auto& entry : std::filesystem::directory_iterator(tmpdir)) {
    current = entry.path().string() + "/current/";
  }
  ASSERT_FALSE(current.empty());
  auto mtime = [&current](const char* name) {
    struct stat info {};
    EXPECT_EQ(::stat((current + name).c_str(), &info), 0) << name;
    return static_cast<int64_t>(info.st_mtime);
  };
  int64_t previous = mtime("cert.pem");
  EXPECT_EQ(mtime("key.pem"), previous);
  for (int reload = 0; reload < 3; ++reload) {
    ASSERT_TRUE((*auth)->ReloadTls().ok());
    EXPECT_GE(mtime("cert.pem"), previous + 1) << "reload " << reload;
    EXPECT_EQ(mtime("key.pem"), mtime("cert.pem"));
    previous = mtime("cert.pem");
  }
}

TEST_F(ReloadTest, ClientCaRotationForMutualTls) {
  Pki* pki = Pki::Get();
  MountedVolume secret(dir_, {{"tls.crt", pki->Read("server.pem")},
                              {"tls.key", pki->Read("server.key")},
                              {"ca.crt", pki->Read("ca.pem")}});
  ServerConfig config = BaseConfig();
  config.auth.tls_cert_file = secret.Path("tls.crt");
  config.auth.tls_key_file = secret.Path("tls.key");
  config.auth.tls_client_ca_file = secret.Path("ca.crt");
  config.reload_interval = absl::Seconds(1);
  Start(config);
  auto client = [&](const std::string& name) {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = pki->Read("ca.pem");
    ssl.pem_cert_chain = pki->Read(name + ".pem");
    ssl.pem_private_key = pki->Read(name + ".key");
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    return pb::Lossd::NewStub(
        grpc::CreateCustomChannel(absl::StrCat("127.0.0.1:", server_->port()),
                                  grpc::SslCredentials(ssl), args));
  };
  auto list = [](pb::Lossd::Stub* stub) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    pb::ListResponse response;
    return stub->List(&context, pb::ListRequest(), &response);
  };
  std::unique_ptr<pb::Lossd::Stub> alpha = client("alpha");
  ASSERT_TRUE(list(alpha.get()).ok());
  EXPECT_FALSE(list(client("rogue").get()).ok());

  // The client CA becomes the rogue CA: its clients get in, the old CA's
  // new connections do not, alpha's open connection stays.
  secret.Update({{"tls.crt", pki->Read("server.pem")},
                 {"tls.key", pki->Read("server.key")},
                 {"ca.crt", pki->Read("rogue-ca.pem")}});
  ASSERT_TRUE(AwaitReloads("tls", "success", 1));
  const absl::Time deadline = absl::Now() + kWait;
  while (!list(client("rogue").get()).ok()) {
    ASSERT_LT(absl::Now(), deadline) << "the new client CA never applied";
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_FALSE(list(client("beta").get()).ok());
  EXPECT_TRUE(list(alpha.get()).ok());
  EXPECT_GT(Metric("lossd_tls_certificate_expiry_timestamp_seconds",
                   {{"certificate", "client_ca"}}),
            0);
}

TEST_F(ReloadTest, StartRefusesAMalformedQuotaFile) {
  const std::string path = Pki::Get()->Path("bad-quotas");
  std::ofstream(path) << "alpha max_tensors=1\nalpha max_tensors=2\n";
  ServerConfig config = BaseConfig();
  config.quota_file = path;
  auto server = LossdServer::Start(config);
  ASSERT_FALSE(server.ok());
  EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(server.status().message().find("line 2"), std::string::npos)
      << server.status();
}

TEST_F(ReloadTest, StartRefusesAnEmptyQuotaFile) {
  const std::string path = Pki::Get()->Path("empty-quotas");
  for (const std::string text : {"", "\n\n  \t\n"}) {
    std::ofstream(path, std::ios::trunc) << text;
    ServerConfig config = BaseConfig();
    config.quota_file = path;
    auto server = LossdServer::Start(config);
    ASSERT_FALSE(server.ok());
    EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(server.status().message().find("--quota_file '" + path +
                                             "': the quota file is empty"),
              std::string::npos)
        << server.status();
  }
}

}  // namespace
}  // namespace lossd
