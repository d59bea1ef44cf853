// The lossd binary as deployed: --port=0 with --port_file, standard health
// checking, server reflection, a SIGTERM drain that exits 0, and SIGHUP
// reloading the tokens and quota files.
#include <fcntl.h>
#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "grpc/health/v1/health_subset.grpc.pb.h"
#include "grpc/reflection/v1alpha/reflection_subset.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "lossd/v1/lossd.grpc.pb.h"
#include "tests/e2e/scrape.h"

namespace {

namespace pb = ::lossd::v1;
namespace health = ::grpc::health::v1;

// One lossd child process; killed if the test ends early.
class LossdProcess {
 public:
  ~LossdProcess() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    if (stderr_ != nullptr) fclose(stderr_);
  }

  // Starts lossd (with `extra_args` after the usual ones) and waits (by
  // reading its stderr) until it serves.
  void Start(const std::vector<std::string>& extra_args = {}) {
    ASSERT_NO_FATAL_FAILURE(Spawn(extra_args));
    std::string line;
    while (ReadLine(&line)) {
      log_ += line;
      if (line.find("serving on") != std::string::npos) break;
    }
    ASSERT_NE(log_.find("serving on"), std::string::npos) << log_;
    std::ifstream in(port_file_);
    ASSERT_TRUE(in >> port_) << "no port in " << port_file_;
    ASSERT_GT(port_, 0);
    // Written before the gRPC port file.
    std::ifstream metrics_in(metrics_port_file_);
    ASSERT_TRUE(metrics_in >> metrics_port_)
        << "no port in " << metrics_port_file_;
    ASSERT_GT(metrics_port_, 0);
    channel_ = grpc::CreateChannel("127.0.0.1:" + std::to_string(port_),
                                   grpc::InsecureChannelCredentials());
  }

  // Starts lossd as Start does, for flags it must refuse: reads its stderr
  // until it exits and returns its exit status, or kills it and returns -2
  // once it serves.
  int StartExpectingExit(const std::vector<std::string>& extra_args) {
    Spawn(extra_args);
    if (pid_ <= 0) return -1;
    std::string line;
    while (ReadLine(&line)) {
      log_ += line;
      if (line.find("serving on") != std::string::npos) return -2;
    }
    return Wait();
  }

  // Sends SIGTERM and returns the exit status (-1 unless it exited).
  int TerminateAndWait() {
    kill(pid_, SIGTERM);
    std::string line;
    while (ReadLine(&line)) log_ += line;
    int status = 0;
    waitpid(pid_, &status, 0);
    pid_ = -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }

  void SendSigterm() { kill(pid_, SIGTERM); }
  void SendSignal(int signal) { kill(pid_, signal); }

  // Reads the stderr line that reports the signal (the drain has begun).
  bool AwaitLine(const std::string& needle) {
    std::string line;
    while (ReadLine(&line)) {
      log_ += line;
      if (line.find(needle) != std::string::npos) return true;
    }
    return false;
  }

  int Wait() {
    std::string line;
    while (ReadLine(&line)) log_ += line;
    int status = 0;
    waitpid(pid_, &status, 0);
    pid_ = -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }

  std::shared_ptr<grpc::Channel> channel() const { return channel_; }
  int metrics_port() const { return metrics_port_; }
  const std::string& log() const { return log_; }

 private:
  // Forks and execs lossd with its stderr on a pipe (stderr_).
  void Spawn(const std::vector<std::string>& extra_args) {
    char dir_template[] = "/tmp/lossd_binary_test.XXXXXX";
    ASSERT_NE(mkdtemp(dir_template), nullptr);
    port_file_ = std::string(dir_template) + "/port";
    metrics_port_file_ = std::string(dir_template) + "/metrics_port";
    int pipe_fds[2];
    ASSERT_EQ(pipe(pipe_fds), 0);
    pid_ = fork();
    ASSERT_GE(pid_, 0);
    if (pid_ == 0) {
      dup2(pipe_fds[1], STDERR_FILENO);
      close(pipe_fds[0]);
      close(pipe_fds[1]);
      const std::string port_file_flag = "--port_file=" + port_file_;
      const std::string metrics_port_file_flag =
          "--metrics_port_file=" + metrics_port_file_;
      std::vector<std::string> args = {
          LOSSD_BINARY,          "--port=0",
          "--host=127.0.0.1",    "--device=cpu",
          "--memory_budget=64M", "--drain_timeout=20s",
          port_file_flag,        "--metrics_port=0",
          "--data_port=0",       metrics_port_file_flag};
      args.insert(args.end(), extra_args.begin(), extra_args.end());
      std::vector<char*> argv;
      for (std::string& arg : args) argv.push_back(arg.data());
      argv.push_back(nullptr);
      execv(LOSSD_BINARY, argv.data());
      _exit(127);
    }
    close(pipe_fds[1]);
    stderr_ = fdopen(pipe_fds[0], "r");
    ASSERT_NE(stderr_, nullptr);
  }

  bool ReadLine(std::string* line) {
    char buffer[4096];
    if (fgets(buffer, sizeof(buffer), stderr_) == nullptr) return false;
    *line = buffer;
    return true;
  }

  pid_t pid_ = -1;
  FILE* stderr_ = nullptr;
  std::string port_file_;
  int port_ = 0;
  std::string metrics_port_file_;
  int metrics_port_ = 0;
  std::string log_;
  std::shared_ptr<grpc::Channel> channel_;
};

health::HealthCheckResponse::ServingStatus Check(
    const std::shared_ptr<grpc::Channel>& channel, const std::string& service,
    grpc::Status* status) {
  auto stub = health::Health::NewStub(channel);
  grpc::ClientContext context;
  health::HealthCheckRequest request;
  request.set_service(service);
  health::HealthCheckResponse response;
  *status = stub->Check(&context, request, &response);
  return response.status();
}

TEST(BinaryTest, ServesHealthAndReflectionAndExitsZeroOnSigterm) {
  LossdProcess lossd;
  ASSERT_NO_FATAL_FAILURE(lossd.Start());
  EXPECT_NE(lossd.log().find("device cpu"), std::string::npos) << lossd.log();
  EXPECT_NE(lossd.log().find("memory budget 67108864"), std::string::npos)
      << lossd.log();

  grpc::Status status;
  EXPECT_EQ(Check(lossd.channel(), "", &status),
            health::HealthCheckResponse::SERVING);
  EXPECT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(Check(lossd.channel(), "lossd.v1.Lossd", &status),
            health::HealthCheckResponse::SERVING);

  auto reflection =
      grpc::reflection::v1alpha::ServerReflection::NewStub(lossd.channel());
  grpc::ClientContext reflection_context;
  auto stream = reflection->ServerReflectionInfo(&reflection_context);
  grpc::reflection::v1alpha::ServerReflectionRequest request;
  request.set_list_services("*");
  ASSERT_TRUE(stream->Write(request));
  stream->WritesDone();
  grpc::reflection::v1alpha::ServerReflectionResponse response;
  std::vector<std::string> services;
  while (stream->Read(&response)) {
    for (const auto& service : response.list_services_response().service()) {
      services.push_back(service.name());
    }
  }
  EXPECT_TRUE(stream->Finish().ok());
  EXPECT_NE(std::find(services.begin(), services.end(), "lossd.v1.Lossd"),
            services.end());

  auto stub = pb::Lossd::NewStub(lossd.channel());
  grpc::ClientContext info_context;
  pb::ServerInfo info;
  ASSERT_TRUE(
      stub->GetServerInfo(&info_context, pb::GetServerInfoRequest(), &info)
          .ok());
  EXPECT_EQ(info.budget_bytes(), 64 << 20);

  absl::StatusOr<std::vector<lossd::scrape::Sample>> samples =
      lossd::scrape::Scrape(lossd.metrics_port());
  ASSERT_TRUE(samples.ok()) << samples.status();
  EXPECT_EQ(lossd::scrape::FindSample(*samples, "lossd_memory_budget_bytes",
                                      {{"device", "cpu"}}),
            64 << 20);
  EXPECT_EQ(
      lossd::scrape::FindSample(*samples, "lossd_rpc_total",
                                {{"method", "GetServerInfo"}, {"code", "OK"}}),
      1);

  EXPECT_EQ(lossd.TerminateAndWait(), 0) << lossd.log();
}

TEST(BinaryTest, SigtermDrainsAnUploadInFlight) {
  LossdProcess lossd;
  ASSERT_NO_FATAL_FAILURE(lossd.Start());
  auto stub = pb::Lossd::NewStub(lossd.channel());
  grpc::ClientContext upload_context;
  pb::UploadResponse upload_response;
  auto writer = stub->Upload(&upload_context, &upload_response);
  pb::UploadRequest request;
  request.mutable_header()->set_dtype(pb::DTYPE_INT32);
  request.mutable_header()->add_shape(2);
  ASSERT_TRUE(writer->Write(request));
  // Once the server lists 8 used bytes, the upload is in flight for sure.
  for (;;) {
    grpc::ClientContext context;
    pb::ServerInfo info;
    ASSERT_TRUE(
        stub->GetServerInfo(&context, pb::GetServerInfoRequest(), &info).ok());
    if (info.used_bytes() == 8) break;
  }

  lossd.SendSigterm();
  ASSERT_TRUE(lossd.AwaitLine("draining")) << lossd.log();
  // The readiness watch tells when draining has begun (no sleeping).
  auto health_stub = health::Health::NewStub(lossd.channel());
  grpc::ClientContext watch_context;
  health::HealthCheckRequest watch_request;
  watch_request.set_service("lossd.v1.Lossd");
  auto watch = health_stub->Watch(&watch_context, watch_request);
  health::HealthCheckResponse health_status;
  while (watch->Read(&health_status) &&
         health_status.status() != health::HealthCheckResponse::NOT_SERVING) {
  }
  EXPECT_EQ(health_status.status(), health::HealthCheckResponse::NOT_SERVING);
  grpc::Status status;
  EXPECT_EQ(Check(lossd.channel(), "", &status),
            health::HealthCheckResponse::SERVING);  // still alive

  grpc::ClientContext refused_context;
  pb::ServerInfo info;
  EXPECT_EQ(
      stub->GetServerInfo(&refused_context, pb::GetServerInfoRequest(), &info)
          .error_code(),
      grpc::StatusCode::UNAVAILABLE);
  // Metrics stay up during the drain: the refusal is counted, and the
  // upload's reservation is still there.
  absl::StatusOr<std::vector<lossd::scrape::Sample>> samples =
      lossd::scrape::Scrape(lossd.metrics_port());
  ASSERT_TRUE(samples.ok()) << samples.status();
  EXPECT_EQ(lossd::scrape::FindSample(
                *samples, "lossd_rpc_total",
                {{"method", "GetServerInfo"}, {"code", "UNAVAILABLE"}}),
            1);
  EXPECT_EQ(lossd::scrape::FindSample(*samples, "lossd_reserved_bytes",
                                      {{"device", "cpu"}}),
            8);

  request.set_chunk(std::string(8, '\x01'));
  ASSERT_TRUE(writer->Write(request));
  writer->WritesDone();
  const grpc::Status upload_status = writer->Finish();
  EXPECT_TRUE(upload_status.ok()) << upload_status.error_message();
  EXPECT_EQ(upload_response.tensor().bytes(), 8);
  watch_context.TryCancel();
  EXPECT_EQ(lossd.Wait(), 0) << lossd.log();
  EXPECT_NE(lossd.log().find("stopped"), std::string::npos) << lossd.log();
}

grpc::Status ListWithToken(const std::shared_ptr<grpc::Channel>& channel,
                           const std::string& token) {
  auto stub = pb::Lossd::NewStub(channel);
  grpc::ClientContext context;
  context.AddMetadata("authorization", "Bearer " + token);
  pb::ListResponse response;
  return stub->List(&context, pb::ListRequest(), &response);
}

// SIGHUP reloads at once, whatever --reload_interval says (an hour here, so
// that only the signal can be what reloads). The test waits for the log line
// the reload writes.
TEST(BinaryTest, SighupReloadsTokensAndQuotas) {
  char dir_template[] = "/tmp/lossd_sighup_test.XXXXXX";
  ASSERT_NE(mkdtemp(dir_template), nullptr);
  const std::string dir = dir_template;
  std::ofstream(dir + "/tokens") << "tok-a alpha\ntok-b beta\n";
  std::ofstream(dir + "/quotas") << "* max_tensors=4\n";
  LossdProcess lossd;
  ASSERT_NO_FATAL_FAILURE(
      lossd.Start({"--tokens_file=" + dir + "/tokens",
                   "--quota_file=" + dir + "/quotas", "--reload_interval=1h"}));
  ASSERT_TRUE(ListWithToken(lossd.channel(), "tok-b").ok());

  std::ofstream(dir + "/tokens", std::ios::trunc) << "tok-a alpha\n";
  std::ofstream(dir + "/quotas", std::ios::trunc) << "* max_tensors=oops\n";
  lossd.SendSignal(SIGHUP);
  ASSERT_TRUE(lossd.AwaitLine("reloaded tokens")) << lossd.log();
  ASSERT_TRUE(lossd.AwaitLine("reload of quotas failed")) << lossd.log();
  EXPECT_EQ(ListWithToken(lossd.channel(), "tok-b").error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_TRUE(ListWithToken(lossd.channel(), "tok-a").ok());
  absl::StatusOr<std::vector<lossd::scrape::Sample>> samples =
      lossd::scrape::Scrape(lossd.metrics_port());
  ASSERT_TRUE(samples.ok()) << samples.status();
  EXPECT_EQ(
      lossd::scrape::FindSample(*samples, "lossd_config_reloads_total",
                                {{"config", "tokens"}, {"result", "success"}}),
      1.0);
  EXPECT_EQ(
      lossd::scrape::FindSample(*samples, "lossd_config_reloads_total",
                                {{"config", "quotas"}, {"result", "failure"}}),
      1.0);
  EXPECT_EQ(lossd.TerminateAndWait(), 0) << lossd.log();
  std::filesystem::remove_all(dir);
}

// Issue 31: an empty quota file (what a truncated write leaves) is refused at
// start with a message naming it and exit status 1, as an empty tokens file
// is; it used to start with no per-tenant limit at all.
TEST(BinaryTest, RefusesToStartWithAnEmptyQuotaFile) {
  char dir_template[] = "/tmp/lossd_empty_quota_test.XXXXXX";
  ASSERT_NE(mkdtemp(dir_template), nullptr);
  const std::string dir = dir_template;
  for (const std::string text : {"", " \n\t\n"}) {
    std::ofstream(dir + "/quotas", std::ios::trunc) << text;
    LossdProcess lossd;
    EXPECT_EQ(lossd.StartExpectingExit({"--quota_file=" + dir + "/quotas"}), 1)
        << lossd.log();
    EXPECT_NE(lossd.log().find("--quota_file '" + dir +
                               "/quotas': the quota file is empty"),
              std::string::npos)
        << lossd.log();
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
