// Issue 6 soak: several clients drive a real in-process server on loopback
// with a random mix of Upload, Forward, Backward, Download, Evaluate and
// Release, cancelling streams midway and setting tight deadlines. Afterwards
// there must have been no unexpected status, no tensor and no reserved byte
// left, and bounded resident-memory growth.
//
// LOSSD_SOAK_CLIENTS (default 8), LOSSD_SOAK_SECONDS (default 10; 60 for the
// long run), LOSSD_TEST_SEED (default fixed) tune it.
#include <dirent.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/data_connection.h"
#include "common/float16.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "lossd/v1/lossd.grpc.pb.h"
#include "server/server.h"
#include "tests/e2e/soak_client.h"

namespace lossd {
namespace soak_test {
namespace {

int64_t EnvInt(const char* name, int64_t fallback) {
  const char* text = std::getenv(name);
  return text != nullptr ? std::strtoll(text, nullptr, 0) : fallback;
}

// Open file descriptors of this process (sockets included).
int OpenDescriptors() {
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return -1;
  int count = 0;
  while (readdir(dir) != nullptr) ++count;
  closedir(dir);
  return count - 3;  // ".", ".." and the directory's own descriptor
}

// What the open descriptors are, e.g. "socket x3, anon_inode:[eventfd] x2"
// (for a failure's message).
std::string DescriptorKinds() {
  std::map<std::string, int> kinds;
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return "?";
  while (const dirent* entry = readdir(dir)) {
    if (entry->d_name[0] == '.') continue;
    char target[256] = {};
    const std::string path = absl::StrCat("/proc/self/fd/", entry->d_name);
    if (readlink(path.c_str(), target, sizeof(target) - 1) < 0) continue;
    std::string kind = target;
    kind = kind.substr(0, kind.find(":["));  // socket:[123] -> socket
    ++kinds[kind];
  }
  closedir(dir);
  std::string out;
  for (const auto& [kind, count] : kinds) {
    absl::StrAppend(&out, out.empty() ? "" : ", ", kind, " x", count);
  }
  return out;
}

// Resident memory of this process (the server runs in it), in bytes.
int64_t ResidentBytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) == 0) {
      return std::strtoll(line.c_str() + 6, nullptr, 10) * 1024;
    }
  }
  return -1;
}

#if defined(__SANITIZE_ADDRESS__)
constexpr bool kSanitized = true;  // ASan's quarantine holds freed memory
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif
#else
constexpr bool kSanitized = false;
#endif

TEST(SoakTest, MixedTrafficWithCancellationsLeavesNothingBehind) {
  const int clients = static_cast<int>(EnvInt("LOSSD_SOAK_CLIENTS", 8));
  const absl::Duration duration =
      absl::Seconds(EnvInt("LOSSD_SOAK_SECONDS", 10));
  const unsigned seed =
      static_cast<unsigned>(EnvInt("LOSSD_TEST_SEED", 20240601));
  SCOPED_TRACE(::testing::Message() << "seed " << seed);

  ServerConfig config;
  config.host = "127.0.0.1";
  config.port = 0;
  config.device = "cpu";
  config.memory_budget = int64_t{512} << 20;  // never the limit here
  config.threads = 2;
  config.drain_timeout = absl::Seconds(20);
  // A striped upload whose cancelled stripe never attached waits this long.
  config.stripe_timeout = absl::Seconds(2);
  // Data connections on a free port. A connection whose RPC ended before
  // the server registered its token (a tight deadline) waits for it up to
  // min(data_timeout, 10 s): 5 s here.
  config.data_port = 0;
  config.data_timeout = absl::Seconds(5);
  auto server = LossdServer::Start(config);
  ASSERT_TRUE(server.ok()) << server.status();
  const int fds_start = OpenDescriptors();

  const int64_t rss_start = ResidentBytes();
  const absl::Time start = absl::Now();
  const absl::Time end = start + duration;
  std::vector<std::unique_ptr<SoakClient>> soak_clients;
  for (int id = 0; id < clients; ++id) {
    soak_clients.push_back(std::make_unique<SoakClient>(
        (*server)->address(), (*server)->data_port(), id,
        seed + static_cast<unsigned>(id)));
  }
  std::vector<std::thread> threads;
  for (auto& client : soak_clients) {
    threads.emplace_back([&client, end] { client->Run(end); });
  }
  // Resident memory once warm (a quarter in) and at its highest after.
  absl::SleepFor(duration / 4);
  const int64_t rss_warm = ResidentBytes();
  int64_t rss_peak = rss_warm;
  while (absl::Now() < end) {
    absl::SleepFor(std::min(absl::Milliseconds(250), end - absl::Now()));
    rss_peak = std::max(rss_peak, ResidentBytes());
  }
  for (std::thread& thread : threads) thread.join();
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);

  Figures total;
  for (auto& client : soak_clients) total.Add(client->figures());
  // Every socket of the clients' channels and of the data connections gets
  // closed (the server closes its ends as it sees them end), and cancelled
  // transfers leave the data plane's registry at its next sweep.
  soak_clients.clear();
  int fds_end = OpenDescriptors();
  int registered = (*server)->data_plane()->registered();
  const absl::Time give_up = absl::Now() + absl::Seconds(20);
  while ((fds_end > fds_start || registered > 0) && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(50));
    fds_end = OpenDescriptors();
    registered = (*server)->data_plane()->registered();
  }
  // An Upload whose deadline expired just as the server committed it is a
  // tensor the client never got the handle of (the reply raced the client's
  // timer; the server saw no cancellation). Only those may remain: they are
  // counted and released here. Anything else left over is a leak.
  int64_t orphans = 0;
  for (const TensorRecord& info : (*server)->store()->List(kDefaultTenant)) {
    if (info.label.find(" deadline") != std::string::npos) {
      ++orphans;
      EXPECT_TRUE(
          (*server)->store()->Release(kDefaultTenant, info.handle).ok());
    } else {
      ADD_FAILURE() << "left behind: " << info.handle << " '" << info.label
                    << "' state " << static_cast<int>(info.state) << " "
                    << info.bytes << " bytes";
    }
  }
  // Uploads and Evaluates are torn down when the server sees their end.
  const bool drained = (*server)->store()->AwaitUsedBytes(0, absl::Seconds(30));
  const StoreStats stats = (*server)->store()->Stats();
  const int64_t rss_end = ResidentBytes();

  constexpr double kMiB = 1 << 20;
  const std::string summary = absl::StrFormat(
      "soak: %d clients x %.1f s: %d requests (%.0f/s), %d ok, %d expected "
      "errors, %d cancellations, %d deadlines, %d not sent (no connection), "
      "%d unexpected; %.1f MiB up, "
      "%.1f MiB down, %.1f MiB evaluated; %d upload-deadline orphans; left: "
      "%d tensors, %d bytes; %d data connections completed, %d transfers "
      "registered; descriptors start %d, end %d; RSS "
      "start %.1f MiB, warm %.1f MiB, peak %.1f MiB, end %.1f MiB%s",
      clients, seconds, total.requests, total.requests / seconds, total.ok,
      total.expected_errors, total.cancellations, total.deadlines,
      total.connect_failures, total.unexpected.size(),
      total.bytes_uploaded / kMiB, total.bytes_downloaded / kMiB,
      total.bytes_evaluated / kMiB, orphans, stats.tensors, stats.used_bytes,
      (*server)->data_plane()->completed(), registered, fds_start, fds_end,
      rss_start / kMiB, rss_warm / kMiB, rss_peak / kMiB, rss_end / kMiB,
      kSanitized ? " (ASan)" : "");
  std::printf("%s\n", summary.c_str());
  if (!total.first_connect_failure.empty()) {
    std::printf("soak: first RPC not sent: %s\n",
                total.first_connect_failure.c_str());
  }
  ::testing::Test::RecordProperty("summary", summary);

  for (size_t i = 0; i < std::min<size_t>(total.unexpected.size(), 20); ++i) {
    ADD_FAILURE() << total.unexpected[i];
  }
  EXPECT_TRUE(total.unexpected.empty());
  EXPECT_GT(total.ok, 0);
  EXPECT_GT(total.cancellations, 0);
  EXPECT_TRUE(drained);
  EXPECT_GT((*server)->data_plane()->completed(), 0);
  EXPECT_EQ(registered, 0);
  EXPECT_LE(fds_end, fds_start) << DescriptorKinds();
  EXPECT_EQ(stats.tensors, 0);
  EXPECT_EQ(stats.used_bytes, 0);
  // Growth from warm to the end: a leak of anything per request would show
  // up here; steady-state buffers (gRPC, allocator arenas) do not grow.
  if (!kSanitized) {
    EXPECT_LT(rss_peak - rss_warm, int64_t{96} << 20) << summary;
    EXPECT_LT(rss_end - rss_warm, int64_t{96} << 20) << summary;
  }
}

}  // namespace
}  // namespace soak_test
}  // namespace lossd
