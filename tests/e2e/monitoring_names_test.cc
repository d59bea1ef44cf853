// Issue 21: every lossd metric that deploy/'s alerts and dashboard query is
// one that lossd exports. A server with every feature that has metrics of its
// own (mutual TLS, tokens, a quota file) serves a few real RPCs, then its
// /metrics is scraped and each lossd_* name found in the PrometheusRule and
// the dashboard JSON must name a sample there. (Names of other exporters, such
// as kube-state-metrics' kube_*, are not lossd's and are not checked.)
#include <fstream>
#include <iterator>
#include <memory>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "lossd/v1/lossd.grpc.pb.h"
#include "server/server.h"
#include "tests/e2e/scrape.h"
#include "tests/e2e/test_pki.h"

namespace lossd {
namespace {

namespace pb = ::lossd::v1;

std::string ReadText(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in),
                     std::istreambuf_iterator<char>());
}

// Every lossd_* identifier in `text` (metric names; the files use no other
// identifiers with that prefix).
std::set<std::string> LossdNames(const std::string& text) {
  static const std::regex kName("\\blossd_[a-z0-9_]+");
  std::set<std::string> names;
  for (auto it = std::sregex_iterator(text.begin(), text.end(), kName);
       it != std::sregex_iterator(); ++it) {
    names.insert(it->str());
  }
  return names;
}

class MonitoringNamesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    Pki* pki = Pki::Get();
    ASSERT_TRUE(pki->ok()) << pki->error();
    ServerConfig config;
    config.host = "127.0.0.1";
    config.port = 0;
    config.metrics_port = 0;
    config.device = "cpu";
    config.memory_budget = 1 << 20;
    config.threads = 1;
    config.auth.tls_cert_file = pki->Path("server.pem");
    config.auth.tls_key_file = pki->Path("server.key");
    config.auth.tls_client_ca_file = pki->Path("ca.pem");
    config.auth.tokens_file = pki->Path("names-tokens");
    std::ofstream(config.auth.tokens_file) << "tok-alpha alpha\n";
    config.quota_file = pki->Path("names-quotas");
    std::ofstream(config.quota_file) << "* max_tensors=8\n";
    auto server = LossdServer::Start(config);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);

    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = pki->Read("ca.pem");
    ssl.pem_cert_chain = pki->Read("alpha.pem");
    ssl.pem_private_key = pki->Read("alpha.key");
    stub_ = pb::Lossd::NewStub(
        grpc::CreateChannel(absl::StrCat("127.0.0.1:", server_->port()),
                            grpc::SslCredentials(ssl)));
  }

  void Prepare(grpc::ClientContext* context) {
    context->set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(20)));
    context->AddMetadata("authorization", "Bearer tok-alpha");
  }

  // Uploads `bytes` as a tensor of `dtype` and `shape`; its handle.
  std::string Upload(pb::DType dtype, std::vector<int64_t> shape,
                     const std::string& bytes) {
    grpc::ClientContext context;
    Prepare(&context);
    pb::UploadResponse response;
    auto writer = stub_->Upload(&context, &response);
    pb::UploadRequest request;
    request.mutable_header()->set_dtype(dtype);
    for (int64_t dim : shape) request.mutable_header()->add_shape(dim);
    writer->Write(request);
    request.Clear();
    request.set_chunk(bytes);
    writer->Write(request);
    writer->WritesDone();
    const grpc::Status status = writer->Finish();
    EXPECT_TRUE(status.ok()) << status.error_message();
    return response.tensor().handle();
  }

  std::unique_ptr<LossdServer> server_;
  std::unique_ptr<pb::Lossd::Stub> stub_;
};

TEST_F(MonitoringNamesTest, EveryLossdMetricQueriedInDeployIsExported) {
  // Traffic that creates the per-RPC, per-kernel and per-transfer series.
  const std::vector<float> logits(4 * 8, 0.5f);
  const std::vector<int64_t> targets = {0, 1, 2, 3};
  const std::string logits_handle = Upload(
      pb::DTYPE_FLOAT32, {4, 8},
      std::string(reinterpret_cast<const char*>(logits.data()), 4 * 8 * 4));
  const std::string targets_handle =
      Upload(pb::DTYPE_INT64, {4},
             std::string(reinterpret_cast<const char*>(targets.data()), 4 * 8));
  {
    grpc::ClientContext context;
    Prepare(&context);
    pb::ForwardRequest request;
    request.set_logits(logits_handle);
    request.set_targets_handle(targets_handle);
    pb::ForwardResponse response;
    const grpc::Status status = stub_->Forward(&context, request, &response);
    ASSERT_TRUE(status.ok()) << status.error_message();
  }
  {
    grpc::ClientContext context;
    Prepare(&context);
    pb::DownloadRequest request;
    request.set_handle(logits_handle);
    auto reader = stub_->Download(&context, request);
    pb::DownloadResponse response;
    while (reader->Read(&response)) {
    }
    ASSERT_TRUE(reader->Finish().ok());
  }

  absl::StatusOr<std::vector<scrape::Sample>> samples =
      scrape::Scrape(server_->metrics_port());
  ASSERT_TRUE(samples.ok()) << samples.status();
  std::set<std::string> exported;
  for (const scrape::Sample& sample : *samples) exported.insert(sample.name);

  for (const char* path : {LOSSD_PROMETHEUS_RULE, LOSSD_GRAFANA_DASHBOARD}) {
    const std::string text = ReadText(path);
    ASSERT_FALSE(text.empty()) << "cannot read " << path;
    const std::set<std::string> names = LossdNames(text);
    EXPECT_GE(names.size(), 5u) << path;
    for (const std::string& name : names) {
      EXPECT_TRUE(exported.count(name) > 0)
          << path << " queries " << name << ", which lossd does not export";
    }
  }
}

}  // namespace
}  // namespace lossd
