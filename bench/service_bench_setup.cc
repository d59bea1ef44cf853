// service_bench's setup (see service_bench_setup.h).
#include "bench/service_bench_setup.h"

#include <cuda_runtime_api.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"

namespace service_bench {

double Seconds(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}

double Median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

void Die(const std::string& what) {
  std::fprintf(stderr, "service_bench: %s\n", what.c_str());
  std::exit(1);
}

void Check(const grpc::Status& status, const char* what) {
  if (!status.ok())
    Die(absl::StrFormat("%s: %s", what, status.error_message()));
}

std::vector<std::pair<std::string, int>> ExtraGrpcArgs() {
  std::vector<std::pair<std::string, int>> args;
  for (absl::string_view pair :
       absl::StrSplit(absl::GetFlag(FLAGS_grpc_args), ',', absl::SkipEmpty())) {
    const std::vector<std::string> parts = absl::StrSplit(pair, '=');
    int value = 0;
    if (parts.size() != 2 || !absl::SimpleAtoi(parts[1], &value)) {
      std::fprintf(stderr, "bad --grpc_args entry: %s\n",
                   std::string(pair).c_str());
      std::exit(2);
    }
    args.emplace_back(parts[0], value);
  }
  return args;
}

std::shared_ptr<grpc::Channel> Connect(const std::string& address,
                                       int connection) {
  grpc::ChannelArguments channel_args;
  channel_args.SetMaxReceiveMessageSize(64 << 20);
  channel_args.SetMaxSendMessageSize(64 << 20);
  channel_args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  channel_args.SetInt("lossd.upload_stripe", connection);
  for (const auto& [name, value] : ExtraGrpcArgs())
    channel_args.SetInt(name, value);
  return grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(),
                                   channel_args);
}

std::vector<std::shared_ptr<grpc::Channel>> ConnectStripes(
    const std::string& address, int count) {
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  for (int i = 0; i < count; ++i) channels.push_back(Connect(address, i + 1));
  return channels;
}

pid_t StartPython(std::string* address) {
  const std::string port_file =
      absl::StrFormat("/tmp/service_bench_python_%d.port", getpid());
  unlink(port_file.c_str());
  std::vector<std::string> args = {
      absl::GetFlag(FLAGS_python), absl::GetFlag(FLAGS_python_server),
      "--stubs=" + absl::GetFlag(FLAGS_stubs), "--port_file=" + port_file,
      "--device=" + absl::GetFlag(FLAGS_device)};
  std::vector<char*> argv;
  for (std::string& arg : args) argv.push_back(arg.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  if (posix_spawnp(&pid, argv[0], nullptr, nullptr, argv.data(), environ) !=
      0) {
    return 0;
  }
  // Torch takes seconds to import; poll for the port file.
  for (int i = 0; i < 1200; ++i) {
    std::ifstream in(port_file);
    int port = 0;
    if (in >> port && port > 0) {
      *address = absl::StrFormat("127.0.0.1:%d", port);
      unlink(port_file.c_str());
      return pid;
    }
    int status = 0;
    if (waitpid(pid, &status, WNOHANG) == pid) return 0;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
  return 0;
}

int64_t PoolHighWater() {
  cudaMemPool_t pool;
  cudaDeviceGetDefaultMemPool(&pool, 0);
  uint64_t high = 0;
  cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &high);
  return static_cast<int64_t>(high);
}

void ResetPoolHighWater() {
  cudaMemPool_t pool;
  cudaDeviceGetDefaultMemPool(&pool, 0);
  uint64_t zero = 0;
  cudaMemPoolSetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &zero);
}

}  // namespace service_bench
