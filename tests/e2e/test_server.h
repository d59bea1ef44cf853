// The in-process lossd that e2e tests start on 127.0.0.1:0, and a channel to it
// with the server's 64 MiB message limits: one copy for every test file.
#ifndef LOSSD_TESTS_E2E_TEST_SERVER_H_
#define LOSSD_TESTS_E2E_TEST_SERVER_H_

#include <cstdint>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "server/server.h"

namespace lossd {
namespace e2e_test {

// A loopback server config on a free port with `device` and `budget` bytes.
inline ServerConfig LoopbackConfig(const std::string& device, int64_t budget,
                                   absl::Duration drain_timeout) {
  ServerConfig config;
  config.host = "127.0.0.1";
  config.port = 0;
  config.device = device;
  config.memory_budget = budget;
  config.threads = 2;
  config.drain_timeout = drain_timeout;
  return config;
}

// Turns on bearer-token authentication in `config` with `tokens` ("token
// tenant" lines), written to a file named after the running test.
inline void UseTokens(const std::string& tokens, ServerConfig* config) {
  const std::string path = absl::StrCat(
      ::testing::TempDir(), "/tokens-",
      ::testing::UnitTest::GetInstance()->current_test_info()->name());
  std::ofstream(path) << tokens;
  config->auth.tokens_file = path;
}

// OK when a lossd with the CUDA device starts here; otherwise why not (a
// test without a GPU skips with it).
inline absl::Status CudaServerAvailable() {
  absl::StatusOr<std::unique_ptr<LossdServer>> server = LossdServer::Start(
      LoopbackConfig("cuda", int64_t{64} << 20, absl::Seconds(10)));
  return server.status();
}

// An insecure channel to `address` that sends and receives 64 MiB messages.
inline std::shared_ptr<grpc::Channel> LargeMessageChannel(
    const std::string& address) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  args.SetMaxSendMessageSize(64 << 20);
  return grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(),
                                   args);
}

// What a server's fatal-device policy (ServerConfig::on_fatal_device_error)
// was called with, in order; outlives the server it is installed in.
class FatalRecorder {
 public:
  std::function<void(const absl::Status&)> Policy() {
    return [this](const absl::Status& status) {
      absl::MutexLock lock(&mu_);
      seen_.push_back(status);
    };
  }
  std::vector<absl::Status> Seen() const {
    absl::MutexLock lock(&mu_);
    return seen_;
  }

 private:
  mutable absl::Mutex mu_;
  std::vector<absl::Status> seen_ ABSL_GUARDED_BY(mu_);
};

}  // namespace e2e_test
}  // namespace lossd

#endif  // LOSSD_TESTS_E2E_TEST_SERVER_H_
