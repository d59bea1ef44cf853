// The user's training step through lossd::Client, timed per step, for
// bench/user_step.py: upload bf16 logits [rows, vocab] and int64 targets from
// memory, Forward in place, Backward 1.0, download the bf16 gradient into a
// buffer kept from step to step (the first step allocates it). The same
// binary times raw TCP over loopback with the same bytes, the ceiling of any
// transport, and (--single_stream) drives the Python server, which speaks
// only one gRPC stream each way. Prints one JSON object a line.
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "bench/loopback_tcp.h"
#include "bench/step_bench.h"
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

using step_bench::Clock;
using step_bench::Die;
using step_bench::Must;
using step_bench::Seconds;

// Raw TCP: `bytes` bytes over `connections` loopback connections at once,
// each carrying its share from its own thread into a receiver that drops it.
double RawTcpSeconds(const std::vector<uint16_t>& data, int connections) {
  absl::StatusOr<loopback_tcp::Connections> connected =
      loopback_tcp::Connect(connections);
  Must(connected.status(), "raw TCP");
  const std::vector<int>& senders = connected->senders;
  const std::vector<int>& receivers = connected->receivers;
  const char* bytes = reinterpret_cast<const char*>(data.data());
  const size_t total = data.size() * sizeof(uint16_t);
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
  return seconds;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const int64_t rows = absl::GetFlag(FLAGS_rows);
  const int64_t vocab = absl::GetFlag(FLAGS_vocab);
  // Random bf16 logits in about [-8, 8) (exponents 0x7e..0x81), made
  // untimed.
  const std::vector<uint16_t> logits =
      step_bench::RandomBf16(static_cast<size_t>(rows * vocab), 1, 0x7e, 4);
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
    const step_bench::LogitsStep timed = step_bench::TimeLogitsStep(
        client, logits, targets, rows, vocab, &gradient);
    std::printf(
        "{\"step\": %d, \"seconds\": %.4f, \"upload\": %.4f, \"forward\": "
        "%.4f, \"backward\": %.4f, \"download\": %.4f, \"loss\": %.6f}\n",
        step, timed.seconds, timed.upload, timed.forward, timed.backward,
        timed.download, timed.forward_result.loss);
    std::fflush(stdout);
  }
  return 0;
}
