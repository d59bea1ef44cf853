// The user's training step through lossd::Client, timed per step, for
// bench/user_step.py: upload bf16 logits [rows, vocab] and int64 targets from
// memory, Forward in place, Backward 1.0, download the bf16 gradient into a
// buffer kept from step to step (the first step allocates it). The same
// binary times raw TCP over loopback with the same bytes, the ceiling of any
// transport, and (--single_stream) drives the Python server, which speaks
// only one gRPC stream each way. Prints one JSON object a line.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_format.h"
#include "client/client.h"

ABSL_FLAG(std::string, target, "", "lossd (or Python server) address");
ABSL_FLAG(int64_t, rows, 16384, "rows of the logits");
ABSL_FLAG(int64_t, vocab, 131072, "vocabulary");
ABSL_FLAG(int, steps, 3, "steps to time");
ABSL_FLAG(bool, single_stream, false,
          "one gRPC stream each way, no data connections (the Python server)");
ABSL_FLAG(int, tcp_connections, 0,
          "instead of steps: send the logits' bytes over this many loopback "
          "TCP connections, each its share, and report the time");

namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}

[[noreturn]] void Die(const std::string& what) {
  std::fprintf(stderr, "user_step_bench: %s\n", what.c_str());
  std::exit(1);
}

void Must(const absl::Status& status, const char* what) {
  if (!status.ok()) Die(absl::StrFormat("%s: %s", what, status.ToString()));
}

// Raw TCP: `bytes` bytes over `connections` loopback connections at once,
// each carrying its share from its own thread into a receiver that drops it.
double RawTcpSeconds(const std::vector<uint16_t>& data, int connections) {
  const int listener = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(address);
  if (bind(listener, reinterpret_cast<sockaddr*>(&address), length) != 0 ||
      listen(listener, connections) != 0 ||
      getsockname(listener, reinterpret_cast<sockaddr*>(&address), &length) !=
          0) {
    Die("raw TCP listener");
  }
  const char* bytes = reinterpret_cast<const char*>(data.data());
  const size_t total = data.size() * sizeof(uint16_t);
  std::vector<int> senders(connections);
  std::vector<int> receivers(connections);
  for (int i = 0; i < connections; ++i) {
    senders[i] = socket(AF_INET, SOCK_STREAM, 0);
    if (connect(senders[i], reinterpret_cast<sockaddr*>(&address), length) !=
        0) {
      Die("raw TCP connect");
    }
    receivers[i] = accept(listener, nullptr, nullptr);
  }
  const auto start = Clock::now();
  std::vector<std::thread> threads;
  for (int i = 0; i < connections; ++i) {
    const size_t begin = total * i / connections;
    const size_t end = total * (i + 1) / connections;
    threads.emplace_back([&, i, begin, end] {
      for (size_t at = begin; at < end;) {
        const ssize_t n =
            send(senders[i], bytes + at, std::min<size_t>(4 << 20, end - at),
                 MSG_NOSIGNAL);
        if (n <= 0) Die("raw TCP send");
        at += static_cast<size_t>(n);
      }
    });
    threads.emplace_back([&, i, begin, end] {
      std::vector<char> sink(4 << 20);
      for (size_t got = begin; got < end;) {
        const ssize_t n = recv(receivers[i], sink.data(), sink.size(), 0);
        if (n <= 0) Die("raw TCP receive");
        got += static_cast<size_t>(n);
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  const double seconds = Seconds(start);
  for (int i = 0; i < connections; ++i) {
    close(senders[i]);
    close(receivers[i]);
  }
  close(listener);
  return seconds;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const int64_t rows = absl::GetFlag(FLAGS_rows);
  const int64_t vocab = absl::GetFlag(FLAGS_vocab);
  // Random bf16 logits in about [-8, 8), made untimed: a 64 MiB random block
  // repeated (drawing billions of values would take longer than the step).
  std::vector<uint16_t> logits(static_cast<size_t>(rows * vocab));
  {
    std::mt19937 rng(1);
    const size_t block = std::min<size_t>(logits.size(), size_t{32} << 20);
    for (size_t i = 0; i < block; ++i) {
      // Sign, exponent 0x7e..0x81 (0.5 .. 8), random mantissa.
      const uint32_t r = rng();
      logits[i] = static_cast<uint16_t>(
          ((r & 1) << 15) | ((0x7e + (r >> 1) % 4) << 7) | ((r >> 8) & 0x7f));
    }
    for (size_t at = block; at < logits.size(); at += block) {
      std::memcpy(logits.data() + at, logits.data(),
                  std::min(block, logits.size() - at) * sizeof(uint16_t));
    }
  }
  const int connections = absl::GetFlag(FLAGS_tcp_connections);
  if (connections > 0) {
    const double seconds = RawTcpSeconds(logits, connections);
    std::printf(
        "{\"tcp_connections\": %d, \"bytes\": %zu, \"seconds\": %.4f}\n",
        connections, logits.size() * 2, seconds);
    return 0;
  }
  std::vector<int64_t> targets(static_cast<size_t>(rows));
  {
    std::mt19937 rng(2);
    for (int64_t& target : targets) target = rng() % vocab;
  }
  lossd::ClientOptions options;
  if (absl::GetFlag(FLAGS_single_stream)) {
    options.data_connection = false;
    options.upload_streams = 1;
    options.chunk_bytes = 4 << 20;
  }
  absl::StatusOr<std::unique_ptr<lossd::Client>> connected =
      lossd::Client::Connect(absl::GetFlag(FLAGS_target), options);
  Must(connected.status(), "connect");
  lossd::Client& client = **connected;

  std::vector<uint16_t> gradient;  // kept from step to step
  for (int step = 0; step < absl::GetFlag(FLAGS_steps); ++step) {
    const auto start = Clock::now();
    absl::StatusOr<lossd::TensorInfo> uploaded =
        client.Upload(lossd::DType::kBFloat16, {rows, vocab}, logits.data(),
                      logits.size() * sizeof(uint16_t));
    Must(uploaded.status(), "upload");
    absl::StatusOr<lossd::TensorInfo> uploaded_targets =
        client.Upload(lossd::DType::kInt64, {rows}, targets.data(),
                      targets.size() * sizeof(int64_t));
    Must(uploaded_targets.status(), "upload targets");
    const double upload = Seconds(start);
    auto at = Clock::now();
    absl::StatusOr<lossd::ForwardResult> forward = client.Forward(
        uploaded->handle, lossd::Targets::Handle(uploaded_targets->handle));
    Must(forward.status(), "forward");
    const double forward_seconds = Seconds(at);
    at = Clock::now();
    Must(client.Backward(forward->gradient, 1.0).status(), "backward");
    const double backward = Seconds(at);
    at = Clock::now();
    // A training loop keeps this buffer: only the first step allocates it.
    gradient.resize(logits.size());
    Must(client
             .DownloadInto(forward->gradient, lossd::DType::kBFloat16,
                           gradient.data(), gradient.size() * sizeof(uint16_t))
             .status(),
         "download");
    const double download = Seconds(at);
    const double total = Seconds(start);
    client.Release(forward->gradient).IgnoreError();
    client.Release(uploaded_targets->handle).IgnoreError();
    std::printf(
        "{\"step\": %d, \"seconds\": %.4f, \"upload\": %.4f, \"forward\": "
        "%.4f, \"backward\": %.4f, \"download\": %.4f, \"loss\": %.6f}\n",
        step, total, upload, forward_seconds, backward, download,
        forward->loss);
    std::fflush(stdout);
  }
  return 0;
}
