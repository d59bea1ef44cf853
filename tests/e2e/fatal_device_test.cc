// A device that becomes unusable mid-request (what a sticky CUDA error does to
// CudaDevice): the request fails with the device's error, readiness turns
// NOT_SERVING at once, the server's fatal policy runs, and liveness and
// the other RPCs keep answering until the process policy ends it. The CPU
// device cannot fail like that on demand, so a device over it does (the
// real one's sticky-error report is CudaDevice::Check). That device has no
// post-training losses either: the server does not list them, and answers
// UNIMPLEMENTED to a client that sends one all the same.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "client/client.h"
#include "gtest/gtest.h"
#include "server/cpu_device.h"
#include "server/server.h"
#include "tests/e2e/test_server.h"

namespace lossd {
namespace {

// The CPU device, whose first cross-entropy reports itself unusable: through
// the fatal handler once, and as the call's INTERNAL error (every later one
// too), as CudaDevice does for a sticky error.
class BreakingDevice final : public Device {
 public:
  std::string name() const override { return "breaking"; }
  bool host_accessible() const override { return true; }
  DeviceMemoryInfo memory() const override { return cpu_.memory(); }
  void SetFatalErrorHandler(
      std::function<void(const absl::Status&)> handler) override {
    absl::MutexLock lock(&mu_);
    handler_ = std::move(handler);
  }
  absl::StatusOr<void*> Allocate(size_t bytes) override {
    return cpu_.Allocate(bytes);
  }
  void Free(void* buffer, size_t bytes) override { cpu_.Free(buffer, bytes); }
  absl::Status CopyFromHost(void* buffer, size_t offset, const void* host,
                            size_t bytes) override {
    return cpu_.CopyFromHost(buffer, offset, host, bytes);
  }
  absl::Status CopyWithin(void* dst, const void* src, size_t bytes) override {
    return cpu_.CopyWithin(dst, src, bytes);
  }
  absl::Status ReadConverted(const void* buffer, DType src_dtype, int64_t first,
                             int64_t count, int64_t row_length, float scale,
                             const float* host_row_scale, void* host_dst,
                             DType dst_dtype) override {
    return cpu_.ReadConverted(buffer, src_dtype, first, count, row_length,
                              scale, host_row_scale, host_dst, dst_dtype);
  }
  absl::Status ScaleInPlace(void* buffer, DType dtype, int64_t count,
                            int64_t row_length, float scale,
                            const float* host_row_scale) override {
    return cpu_.ScaleInPlace(buffer, dtype, count, row_length, scale,
                             host_row_scale);
  }
  absl::Status CrossEntropy(const CrossEntropyArgs& /*args*/,
                            CrossEntropyResult* /*result*/) override {
    const absl::Status fatal = absl::InternalError(
        "breaking: kernel: an illegal memory access was encountered (sticky "
        "error: the device is unusable)");
    std::function<void(const absl::Status&)> handler;
    {
      absl::MutexLock lock(&mu_);
      if (!reported_) {
        reported_ = true;
        handler = handler_;
      }
    }
    if (handler) handler(fatal);
    return fatal;
  }

 private:
  CpuDevice cpu_{1};
  absl::Mutex mu_;
  std::function<void(const absl::Status&)> handler_ ABSL_GUARDED_BY(mu_);
  bool reported_ ABSL_GUARDED_BY(mu_) = false;
};

TEST(FatalDeviceTest, UnusableDeviceTurnsReadinessOffAndRunsThePolicy) {
  ServerConfig config =
      e2e_test::LoopbackConfig("cpu", 16 << 20, absl::Seconds(5));
  config.device_factory = []() -> absl::StatusOr<std::unique_ptr<Device>> {
    return std::unique_ptr<Device>(new BreakingDevice());
  };
  e2e_test::FatalRecorder fatal;
  config.on_fatal_device_error = fatal.Policy();
  absl::StatusOr<std::unique_ptr<LossdServer>> server =
      LossdServer::Start(config);
  ASSERT_TRUE(server.ok()) << server.status();
  absl::StatusOr<std::unique_ptr<Client>> client =
      Client::Connect((*server)->address());
  ASSERT_TRUE(client.ok()) << client.status();
  EXPECT_EQ((*client)->Health(kLossdService).value_or(false), true);

  const std::vector<float> logits(4 * 16, 0.5f);
  absl::StatusOr<TensorInfo> stored = (*client)->Upload(
      DType::kFloat32, {4, 16}, logits.data(), logits.size() * 4);
  ASSERT_TRUE(stored.ok()) << stored.status();
  const std::vector<int64_t> targets = {0, 1, 2, 3};
  for (int i = 0; i < 2; ++i) {
    absl::StatusOr<ForwardResult> forward = (*client)->Forward(
        stored->handle,
        Targets::Inline(DType::kInt64, targets.data(), targets.size() * 8));
    EXPECT_EQ(forward.status().code(), absl::StatusCode::kInternal)
        << forward.status();
    EXPECT_NE(forward.status().message().find("sticky"), std::string::npos)
        << forward.status();
  }
  const std::vector<absl::Status> seen = fatal.Seen();
  ASSERT_EQ(seen.size(), 1u);
  EXPECT_EQ(seen[0].code(), absl::StatusCode::kInternal);
  // Readiness is off; liveness ("") and the metadata RPCs still answer, so
  // an orchestrator sees why before the process policy ends it.
  EXPECT_EQ((*client)->Health(kLossdService).value_or(true), false);
  EXPECT_EQ((*client)->Health("").value_or(false), true);
  absl::StatusOr<TensorInfo> described = (*client)->Describe(stored->handle);
  EXPECT_TRUE(described.ok()) << described.status();
  (*server)->Drain();
}

TEST(FatalDeviceTest, DeviceWithoutPostTrainingIsNotListedAndRefusesThem) {
  ServerConfig config =
      e2e_test::LoopbackConfig("cpu", 16 << 20, absl::Seconds(5));
  config.device_factory = []() -> absl::StatusOr<std::unique_ptr<Device>> {
    return std::unique_ptr<Device>(new BreakingDevice());
  };
  absl::StatusOr<std::unique_ptr<LossdServer>> server =
      LossdServer::Start(config);
  ASSERT_TRUE(server.ok()) << server.status();
  const std::vector<float> logits(4 * 16, 0.5f);
  const std::vector<int64_t> targets = {0, 1, 2, 3};
  const std::vector<int32_t> ids = {0, 0, 1, 1};
  ForwardOptions options;
  options.segments = SegmentOptions();
  options.segments->ids = LossInput::Inline(ids);
  options.segments->count = 2;
  for (bool check : {true, false}) {
    ClientOptions client_options;
    client_options.check_server_features = check;
    absl::StatusOr<std::unique_ptr<Client>> client =
        Client::Connect((*server)->address(), client_options);
    ASSERT_TRUE(client.ok()) << client.status();
    absl::StatusOr<ServerInfo> info = (*client)->GetServerInfo();
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(std::count(info->features.begin(), info->features.end(),
                         "post_training"),
              0);
    EXPECT_FALSE(info->features.empty());  // the rest still listed
    absl::StatusOr<TensorInfo> stored = (*client)->Upload(
        DType::kFloat32, {4, 16}, logits.data(), logits.size() * 4);
    ASSERT_TRUE(stored.ok()) << stored.status();
    absl::StatusOr<ForwardResult> forward = (*client)->Forward(
        stored->handle,
        Targets::Inline(DType::kInt64, targets.data(), targets.size() * 8),
        options);
    EXPECT_EQ(forward.status().code(),
              check ? absl::StatusCode::kFailedPrecondition
                    : absl::StatusCode::kUnimplemented)
        << forward.status();
    absl::StatusOr<DownloadedTensor> kept = (*client)->Download(stored->handle);
    ASSERT_TRUE(kept.ok()) << kept.status();
    EXPECT_EQ(kept->data.size(), logits.size() * 4);
    EXPECT_EQ(std::memcmp(kept->data.data(), logits.data(), kept->data.size()),
              0);
  }
}

// Serves on the breaking device with lossd's own fatal policy and sends one
// Forward: the policy ends the process while the request is open. Exit codes
// 10-13 say which step failed or that the process outlived the error.
[[noreturn]] void ForwardOnBreakingDeviceWithTheBinarysPolicy() {
  ServerConfig config =
      e2e_test::LoopbackConfig("cpu", 16 << 20, absl::Seconds(5));
  config.device_factory = []() -> absl::StatusOr<std::unique_ptr<Device>> {
    return std::unique_ptr<Device>(new BreakingDevice());
  };
  config.on_fatal_device_error = ExitAfterFatalDeviceError;
  absl::StatusOr<std::unique_ptr<LossdServer>> server =
      LossdServer::Start(config);
  if (!server.ok()) std::_Exit(10);
  absl::StatusOr<std::unique_ptr<Client>> client =
      Client::Connect((*server)->address());
  if (!client.ok()) std::_Exit(11);
  const std::vector<float> logits(4 * 16, 0.5f);
  absl::StatusOr<TensorInfo> stored = (*client)->Upload(
      DType::kFloat32, {4, 16}, logits.data(), logits.size() * 4);
  if (!stored.ok()) std::_Exit(12);
  const std::vector<int64_t> targets = {0, 1, 2, 3};
  (*client)
      ->Forward(stored->handle, Targets::Inline(DType::kInt64, targets.data(),
                                                targets.size() * 8))
      .IgnoreError();
  std::_Exit(13);
}

// The policy lossd's main installs: the server's FATAL line, then the
// policy's own, and the process ends with status 3 while the request that met
// the error is still open. A death test (its own process: the exit is real).
TEST(FatalDeviceDeathTest, TheBinarysPolicyExitsWithStatus3) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");  // gRPC runs threads
  EXPECT_EXIT(ForwardOnBreakingDeviceWithTheBinarysPolicy(),
              ::testing::ExitedWithCode(kFatalDeviceExitCode),
              "FATAL: device breaking is unusable, readiness is NOT_SERVING"
              "(.|\n)*lossd: exiting \\(status 3\\) after a fatal device "
              "error");
}

}  // namespace
}  // namespace lossd
