// lossd::RoutingClient against three real lossd processes on 127.0.0.1:0 with
// different memory budgets: uploads follow the free memory, each handle's
// RPCs reach its owner, a restarted instance's handles are NOT_FOUND.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "client/npy.h"
#include "client/router.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/client/lossd_process.h"

namespace lossd {
namespace {

using ::lossd::client_test::CommandResult;
using ::lossd::client_test::LossdProcess;
using ::lossd::client_test::RunCommand;
using ::lossd::client_test::TempDir;
using ::testing::HasSubstr;

constexpr uint32_t kSeed = 20240605;
// 8 MiB of fp32 logits per tensor; budgets are whole multiples of it, so the
// free-memory figures tie exactly where the placement rule says they do.
constexpr int64_t kRows = 512;
constexpr int64_t kVocab = 4096;
constexpr int64_t kTensorBytes = kRows * kVocab * 4;
constexpr int64_t kMiB = 1 << 20;
const char* const kBudgets[] = {"40M", "24M", "16M"};

struct Reference {
  double loss = 0.0;
  std::vector<float> gradient;  // d(mean loss)/d(logits)
};

// Mean cross entropy over the rows whose target is not ignore_index, in
// double precision, and its gradient.
Reference CrossEntropy(const std::vector<float>& logits,
                       const std::vector<int64_t>& targets) {
  Reference ref;
  ref.gradient.assign(logits.size(), 0.0f);
  int64_t valid = 0;
  for (int64_t t : targets) valid += t >= 0 ? 1 : 0;
  for (int64_t r = 0; r < kRows; ++r) {
    if (targets[r] < 0) continue;
    const float* row = &logits[r * kVocab];
    const double max = *std::max_element(row, row + kVocab);
    double sum = 0.0;
    for (int64_t v = 0; v < kVocab; ++v) sum += std::exp(row[v] - max);
    const double lse = max + std::log(sum);
    ref.loss += (lse - row[targets[r]]) / valid;
    for (int64_t v = 0; v < kVocab; ++v) {
      const double p = std::exp(row[v] - lse);
      ref.gradient[r * kVocab + v] =
          static_cast<float>((p - (v == targets[r] ? 1.0 : 0.0)) / valid);
    }
  }
  return ref;
}

class RoutingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    rng_.seed(kSeed);
    for (int i = 0; i < 3; ++i) {
      absl::StatusOr<std::unique_ptr<LossdProcess>> server =
          LossdProcess::Start(
              LOSSD_BINARY_PATH,
              {absl::StrCat("--memory_budget=", kBudgets[i]), "--threads=1"});
      ASSERT_TRUE(server.ok()) << server.status();
      servers_.push_back(*std::move(server));
      absl::StatusOr<std::unique_ptr<Client>> direct =
          Client::Connect(servers_.back()->address());
      ASSERT_TRUE(direct.ok()) << direct.status();
      direct_.push_back(*std::move(direct));
    }
    absl::StatusOr<std::unique_ptr<RoutingClient>> router =
        RoutingClient::Connect({servers_[0]->address(), servers_[1]->address(),
                                servers_[2]->address()});
    ASSERT_TRUE(router.ok()) << router.status();
    router_ = *std::move(router);
    RefreshIds();
  }

  void TearDown() override {
    if (HasFailure()) std::fprintf(stderr, "random seed: %u\n", kSeed);
  }

  // Instance id of each server, asked directly.
  void RefreshIds() {
    ids_.clear();
    for (const auto& direct : direct_) {
      absl::StatusOr<ServerInfo> info = direct->GetServerInfo();
      ASSERT_TRUE(info.ok()) << info.status();
      ids_.push_back(info->instance_id);
    }
  }

  // Index of the server owning `handle`, -1 when none does.
  int Owner(const std::string& handle) {
    absl::StatusOr<std::string> instance = RoutingClient::InstanceOf(handle);
    if (!instance.ok()) return -1;
    for (int i = 0; i < static_cast<int>(ids_.size()); ++i) {
      if (ids_[i] == *instance) return i;
    }
    return -1;
  }

  std::vector<float> RandomLogits() {
    std::uniform_real_distribution<float> dist(-4.0f, 4.0f);
    std::vector<float> values(kRows * kVocab);
    for (float& v : values) v = dist(rng_);
    return values;
  }

  // Targets with every 7th row ignored.
  std::vector<int64_t> RandomTargets() {
    std::uniform_int_distribution<int64_t> dist(0, kVocab - 1);
    std::vector<int64_t> targets(kRows);
    for (int64_t r = 0; r < kRows; ++r) {
      targets[r] = r % 7 == 3 ? -100 : dist(rng_);
    }
    return targets;
  }

  // Uploads logits through the router and checks that they landed on an
  // instance with the most free memory just before.
  std::string UploadPlaced(const std::vector<float>& logits) {
    int64_t most_free = -1;
    std::vector<int64_t> free(direct_.size(), -1);
    for (size_t i = 0; i < direct_.size(); ++i) {
      absl::StatusOr<ServerInfo> info = direct_[i]->GetServerInfo();
      if (info.ok()) free[i] = info->free_bytes;
      most_free = std::max(most_free, free[i]);
    }
    const int64_t shape[] = {kRows, kVocab};
    absl::StatusOr<TensorInfo> info = router_->Upload(
        DType::kFloat32, shape, logits.data(), logits.size() * 4, "logits");
    EXPECT_TRUE(info.ok()) << info.status();
    if (!info.ok()) return "";
    const int owner = Owner(info->handle);
    EXPECT_GE(owner, 0) << info->handle;
    if (owner >= 0) {
      EXPECT_EQ(free[owner], most_free)
          << "placed on server " << owner << " with " << free[owner]
          << " free bytes; the most free was " << most_free;
    }
    return info->handle;
  }

  std::mt19937 rng_;
  std::vector<std::unique_ptr<LossdProcess>> servers_;
  std::vector<std::unique_ptr<Client>> direct_;
  std::vector<std::string> ids_;
  std::unique_ptr<RoutingClient> router_;
};

TEST_F(RoutingTest, UploadsFollowFreeMemoryAndRpcsReachTheirOwner) {
  ASSERT_EQ(ids_.size(), 3u);
  EXPECT_NE(ids_[0], ids_[1]);
  EXPECT_NE(ids_[1], ids_[2]);
  std::vector<InstanceStatus> instances = router_->Instances();
  ASSERT_EQ(instances.size(), 3u);
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(instances[i].status.ok()) << instances[i].status;
    EXPECT_EQ(instances[i].endpoint, servers_[i]->address());
    EXPECT_EQ(instances[i].info.instance_id, ids_[i]);
  }

  // Free memory 40/24/16 MiB and 8 MiB tensors: the greedy placement gives
  // the first server three, then spreads the rest (7 tensors: 4, 2, 1).
  struct Case {
    std::string handle;
    std::vector<float> logits;
    std::vector<int64_t> targets;
  };
  std::vector<Case> cases(7);
  std::vector<int> per_server(3, 0);
  for (Case& c : cases) {
    c.logits = RandomLogits();
    c.targets = RandomTargets();
    c.handle = UploadPlaced(c.logits);
    ASSERT_FALSE(c.handle.empty());
    ++per_server[Owner(c.handle)];
  }
  EXPECT_EQ(per_server, (std::vector<int>{4, 2, 1}));

  absl::StatusOr<RoutedListResult> list = router_->List();
  ASSERT_TRUE(list.ok()) << list.status();
  EXPECT_EQ(list->tensors.size(), cases.size());
  ASSERT_EQ(list->instances.size(), 3u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_TRUE(list->instances[i].status.ok());
    EXPECT_EQ(list->instances[i].info.tensors, per_server[i]);
  }

  // Every handle's RPCs reach the owner and compute on its data: targets
  // beside the logits, Forward in place, Backward, Download.
  for (size_t k = 0; k < cases.size(); ++k) {
    SCOPED_TRACE(absl::StrCat("tensor ", k, " ", cases[k].handle));
    const Case& c = cases[k];
    const int64_t target_shape[] = {kRows};
    absl::StatusOr<TensorInfo> targets = router_->UploadColocated(
        c.handle, DType::kInt64, target_shape, c.targets.data(),
        c.targets.size() * 8, "targets");
    ASSERT_TRUE(targets.ok()) << targets.status();
    EXPECT_EQ(Owner(targets->handle), Owner(c.handle));

    absl::StatusOr<TensorInfo> described = router_->Describe(c.handle);
    ASSERT_TRUE(described.ok()) << described.status();
    EXPECT_EQ(described->state, TensorState::kLogits);

    absl::StatusOr<ForwardResult> forward =
        router_->Forward(c.handle, Targets::Handle(targets->handle));
    ASSERT_TRUE(forward.ok()) << forward.status();
    const Reference ref = CrossEntropy(c.logits, c.targets);
    EXPECT_NEAR(forward->loss, ref.loss, 1e-5 * ref.loss);
    EXPECT_EQ(forward->gradient, c.handle);

    absl::StatusOr<BackwardResult> backward =
        router_->Backward(c.handle, /*grad_output=*/0.5);
    ASSERT_TRUE(backward.ok()) << backward.status();
    EXPECT_EQ(backward->tensor.pending_scale, 0.5);

    absl::StatusOr<DownloadedTensor> gradient = router_->Download(c.handle);
    ASSERT_TRUE(gradient.ok()) << gradient.status();
    ASSERT_EQ(gradient->data.size(), c.logits.size() * 4);
    const float* got = reinterpret_cast<const float*>(gradient->data.data());
    for (size_t i = 0; i < ref.gradient.size(); ++i) {
      const double want = 0.5 * ref.gradient[i];
      ASSERT_NEAR(got[i], want, 1e-5 * std::abs(want) + 1e-12)
          << "element " << i;
    }

    absl::StatusOr<int64_t> released = router_->Release(targets->handle);
    ASSERT_TRUE(released.ok()) << released.status();
    EXPECT_EQ(*released, kRows * 8);
  }

  // Targets on another instance: refused before sending (the logits are a
  // gradient now, so a sent Forward would be FAILED_PRECONDITION).
  const Case& a = cases.front();
  const Case* elsewhere = nullptr;
  for (const Case& c : cases) {
    if (Owner(c.handle) != Owner(a.handle)) elsewhere = &c;
  }
  ASSERT_NE(elsewhere, nullptr);
  absl::StatusOr<ForwardResult> mixed =
      router_->Forward(a.handle, Targets::Handle(elsewhere->handle));
  EXPECT_EQ(mixed.status().code(), absl::StatusCode::kInvalidArgument)
      << mixed.status();
  EXPECT_THAT(mixed.status().message(), HasSubstr("share one instance"));
  ForwardOptions weighted;
  weighted.class_weights = elsewhere->handle;
  mixed = router_->Forward(
      a.handle,
      Targets::Inline(DType::kInt64, a.targets.data(), a.targets.size() * 8),
      weighted);
  EXPECT_EQ(mixed.status().code(), absl::StatusCode::kInvalidArgument)
      << mixed.status();
  // So are a teacher, policy inputs or segment ids on another instance.
  ForwardOptions distilled;
  distilled.distillation = DistillationOptions();
  distilled.distillation->teacher_logits = elsewhere->handle;
  ForwardOptions policy;
  policy.policy = PolicyGradientOptions();
  policy.policy->advantages = LossInput::Handle(elsewhere->handle);
  ForwardOptions segmented;
  segmented.segments = SegmentOptions();
  segmented.segments->ids = LossInput::Handle(elsewhere->handle);
  for (const ForwardOptions& options : {distilled, policy, segmented}) {
    mixed = router_->Forward(
        a.handle,
        Targets::Inline(DType::kInt64, a.targets.data(), a.targets.size() * 8),
        options);
    EXPECT_EQ(mixed.status().code(), absl::StatusCode::kInvalidArgument)
        << mixed.status();
    EXPECT_THAT(mixed.status().message(), HasSubstr("share one instance"));
  }

  // A handle of an instance nobody serves.
  absl::StatusOr<TensorInfo> stranger =
      router_->Describe("0badcafe-0123456789abcdef0123456789abcdef");
  EXPECT_EQ(stranger.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(stranger.status().message(), HasSubstr("none of the 3"));
  EXPECT_EQ(router_->Describe("no-such-handle").status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(RoutingTest, RestartedInstanceHandlesAreNotFoundAndItTakesNewUploads) {
  std::vector<std::string> handles;
  std::map<int, std::vector<std::string>> by_server;
  const std::vector<float> logits = RandomLogits();
  for (int k = 0; k < 7; ++k) {
    handles.push_back(UploadPlaced(logits));
    ASSERT_FALSE(handles.back().empty());
    by_server[Owner(handles.back())].push_back(handles.back());
  }
  ASSERT_GE(by_server[1].size(), 2u);
  ASSERT_GE(by_server[0].size(), 1u);
  ASSERT_GE(by_server[2].size(), 1u);

  // Kill server 1 and start a new process on the same port.
  const int port = servers_[1]->port();
  absl::StatusOr<int> exit_code = servers_[1]->Stop();
  ASSERT_TRUE(exit_code.ok()) << exit_code.status();
  EXPECT_EQ(*exit_code, 0);
  absl::StatusOr<std::unique_ptr<LossdProcess>> restarted = LossdProcess::Start(
      LOSSD_BINARY_PATH, {absl::StrCat("--memory_budget=", kBudgets[1]),
                          "--threads=1", absl::StrCat("--port=", port)});
  ASSERT_TRUE(restarted.ok()) << restarted.status();
  servers_[1] = *std::move(restarted);
  ASSERT_EQ(servers_[1]->port(), port);
  const std::string old_id = ids_[1];
  RefreshIds();
  ASSERT_NE(ids_[1], old_id);

  // First use: the router still thinks the port serves the old instance, so
  // the server itself answers, with its "restarted" message.
  const std::vector<int64_t> targets(kRows, 1);
  absl::StatusOr<ForwardResult> forward = router_->Forward(
      by_server[1][0],
      Targets::Inline(DType::kInt64, targets.data(), targets.size() * 8));
  EXPECT_EQ(forward.status().code(), absl::StatusCode::kNotFound)
      << forward.status();
  EXPECT_THAT(forward.status().message(), HasSubstr("restarted"));
  EXPECT_THAT(forward.status().message(), HasSubstr(ids_[1]));
  // Later uses are answered by the router, which has learnt the new id.
  for (const std::string& handle : by_server[1]) {
    absl::StatusOr<TensorInfo> describe = router_->Describe(handle);
    EXPECT_EQ(describe.status().code(), absl::StatusCode::kNotFound);
    EXPECT_THAT(describe.status().message(), HasSubstr("restarted"));
    absl::StatusOr<DownloadedTensor> download = router_->Download(handle);
    EXPECT_EQ(download.status().code(), absl::StatusCode::kNotFound);
    EXPECT_THAT(download.status().message(),
                HasSubstr("restarted as instance " + ids_[1]));
    EXPECT_EQ(router_->Backward(handle, 1.0).status().code(),
              absl::StatusCode::kNotFound);
  }
  // The other instances' handles are untouched.
  for (int server : {0, 2}) {
    for (const std::string& handle : by_server[server]) {
      absl::StatusOr<TensorInfo> describe = router_->Describe(handle);
      EXPECT_TRUE(describe.ok()) << describe.status();
    }
  }

  // The restarted instance is empty, hence the most free: new uploads land
  // there, and read back bit-exact.
  const std::string fresh = UploadPlaced(logits);
  ASSERT_FALSE(fresh.empty());
  EXPECT_EQ(Owner(fresh), 1);
  absl::StatusOr<DownloadedTensor> back = router_->Download(fresh);
  ASSERT_TRUE(back.ok()) << back.status();
  ASSERT_EQ(back->data.size(), logits.size() * 4);
  EXPECT_EQ(std::memcmp(back->data.data(), logits.data(), back->data.size()),
            0);

  // An instance that is down (not restarted): placement skips it, and its
  // handles are UNAVAILABLE (a static endpoint may come back).
  ASSERT_TRUE(servers_[0]->Stop().ok());
  const std::string placed = UploadPlaced(logits);
  EXPECT_NE(Owner(placed), 0);
  EXPECT_EQ(router_->Describe(by_server[0][0]).status().code(),
            absl::StatusCode::kUnavailable);
}

// An overwrite goes to the instance holding the handle, not to the one with
// the most free memory, and replaces the contents there in place.
TEST_F(RoutingTest, OverwriteReachesTheOwner) {
  const std::vector<float> first = RandomLogits();
  const int64_t shape[] = {kRows, kVocab};
  // Server 2 has the least free memory: an Upload would not go there.
  absl::StatusOr<TensorInfo> stored =
      direct_[2]->Upload(DType::kFloat32, shape, first.data(), kTensorBytes);
  ASSERT_TRUE(stored.ok()) << stored.status();
  const std::vector<float> next = RandomLogits();
  absl::StatusOr<TensorInfo> info = router_->Overwrite(
      stored->handle, DType::kFloat32, shape, next.data(), kTensorBytes);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->handle, stored->handle);
  absl::StatusOr<DownloadedTensor> got = direct_[2]->Download(stored->handle);
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->data.size(), static_cast<size_t>(kTensorBytes));
  EXPECT_EQ(std::memcmp(got->data.data(), next.data(), kTensorBytes), 0);

  info = router_->OverwriteFrom(
      stored->handle, DType::kFloat32, shape,
      [&](int64_t offset, std::size_t, void*) -> absl::StatusOr<const void*> {
        return reinterpret_cast<const char*>(first.data()) + offset;
      });
  ASSERT_TRUE(info.ok()) << info.status();
  got = direct_[2]->Download(stored->handle);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(std::memcmp(got->data.data(), first.data(), kTensorBytes), 0);
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<ServerInfo> server = direct_[i]->GetServerInfo();
    ASSERT_TRUE(server.ok()) << server.status();
    EXPECT_EQ(server->tensors, i == 2 ? 1 : 0) << "server " << i;
  }
  // A handle of no instance here: NOT_FOUND, before any upload.
  EXPECT_EQ(router_
                ->Overwrite("00000000-0123456789abcdef0123456789abcdef",
                            DType::kFloat32, shape, next.data(), kTensorBytes)
                .status()
                .code(),
            absl::StatusCode::kNotFound);
}

TEST_F(RoutingTest, LossctlTakesSeveralServers) {
  TempDir dir;
  const std::string server_flag =
      absl::StrCat("--server=", servers_[0]->address(), ",",
                   servers_[1]->address(), ",", servers_[2]->address());
  const auto lossctl = [&](std::vector<std::string> args) {
    args.insert(args.begin(), {LOSSCTL_BINARY_PATH, server_flag});
    absl::StatusOr<CommandResult> result = RunCommand(args);
    EXPECT_TRUE(result.ok()) << result.status();
    return result.ok() ? *result : CommandResult();
  };
  CommandResult info = lossctl({"info"});
  ASSERT_EQ(info.exit_code, 0) << info.err;
  for (int i = 0; i < 3; ++i) {
    EXPECT_THAT(info.out, HasSubstr("endpoint " + servers_[i]->address() +
                                    "\ninstance " + ids_[i]));
  }

  const std::vector<float> logits = RandomLogits();
  const std::vector<int64_t> targets = RandomTargets();
  const std::string logits_path = dir.File("logits.npy");
  const std::string targets_path = dir.File("targets.npy");
  ASSERT_TRUE(WriteNpy(logits_path, DType::kFloat32, {kRows, kVocab},
                       logits.data(), logits.size() * 4)
                  .ok());
  ASSERT_TRUE(WriteNpy(targets_path, DType::kInt64, {kRows}, targets.data(),
                       targets.size() * 8)
                  .ok());
  // Free 40/24/16 MiB: after three 8 MiB tensors on server 0, server 1 has
  // the most free memory.
  std::string filler;
  for (int k = 0; k < 3; ++k) {
    filler = UploadPlaced(logits);
    ASSERT_EQ(Owner(filler), 0);
  }
  CommandResult up = lossctl({"upload", logits_path});
  ASSERT_EQ(up.exit_code, 0) << up.err;
  const std::string handle(absl::StripAsciiWhitespace(up.out));
  EXPECT_EQ(Owner(handle), 1);
  CommandResult up_targets =
      lossctl({"upload", targets_path, "--near=" + handle});
  ASSERT_EQ(up_targets.exit_code, 0) << up_targets.err;
  const std::string targets_handle(absl::StripAsciiWhitespace(up_targets.out));
  EXPECT_EQ(Owner(targets_handle), 1);

  CommandResult forward = lossctl({"forward", handle, targets_handle});
  ASSERT_EQ(forward.exit_code, 0) << forward.err;
  const Reference ref = CrossEntropy(logits, targets);
  const std::vector<std::string> words =
      absl::StrSplit(forward.out, ' ', absl::SkipEmpty());
  double loss = 0.0;
  ASSERT_GE(words.size(), 2u);
  ASSERT_EQ(words[0], "loss");
  ASSERT_TRUE(absl::SimpleAtod(words[1], &loss)) << forward.out;
  EXPECT_NEAR(loss, ref.loss, 1e-5 * ref.loss);

  CommandResult ls = lossctl({"ls"});
  ASSERT_EQ(ls.exit_code, 0) << ls.err;
  EXPECT_THAT(ls.out, HasSubstr(handle));
  EXPECT_THAT(ls.out, HasSubstr(filler));
  EXPECT_THAT(ls.err, HasSubstr(servers_[1]->address() + ": 2 tensors"));

  CommandResult mixed = lossctl({"forward", handle, filler});
  EXPECT_EQ(mixed.exit_code, 1);
  EXPECT_THAT(mixed.err, HasSubstr("INVALID_ARGUMENT"));
  CommandResult health = lossctl({"health"});
  EXPECT_EQ(health.exit_code, 0) << health.err;
  EXPECT_THAT(health.out,
              HasSubstr(servers_[2]->address() + " readiness SERVING"));
}

TEST(RoutingDnsTest, DnsNameReachesEveryAddress) {
  absl::StatusOr<std::unique_ptr<LossdProcess>> server =
      LossdProcess::Start(LOSSD_BINARY_PATH, {"--memory_budget=16M"});
  ASSERT_TRUE(server.ok()) << server.status();
  absl::StatusOr<std::unique_ptr<RoutingClient>> router =
      RoutingClient::Connect(
          {absl::StrCat("dns:///localhost:", (*server)->port())});
  ASSERT_TRUE(router.ok()) << router.status();
  // localhost may also resolve to ::1, where nothing listens: that endpoint
  // is reported unreachable and never chosen.
  std::vector<InstanceStatus> instances = (*router)->Instances();
  int reachable = 0;
  for (const InstanceStatus& instance : instances) {
    if (instance.status.ok()) {
      ++reachable;
      EXPECT_EQ(instance.endpoint,
                absl::StrCat("127.0.0.1:", (*server)->port()));
    }
  }
  EXPECT_EQ(reachable, 1);
  const std::vector<float> data = {1.0f, -2.0f, 3.5f};
  const int64_t shape[] = {1, 3};
  absl::StatusOr<TensorInfo> info =
      (*router)->Upload(DType::kFloat32, shape, data.data(), 12);
  ASSERT_TRUE(info.ok()) << info.status();
  absl::StatusOr<DownloadedTensor> back = (*router)->Download(info->handle);
  ASSERT_TRUE(back.ok()) << back.status();
  ASSERT_EQ(back->data.size(), 12u);
  EXPECT_EQ(std::memcmp(back->data.data(), data.data(), 12), 0);

  absl::StatusOr<std::unique_ptr<RoutingClient>> nowhere =
      RoutingClient::Connect({"dns:///no-such-host.invalid:50051"});
  ASSERT_TRUE(nowhere.ok()) << nowhere.status();
  absl::StatusOr<TensorInfo> lost =
      (*nowhere)->Upload(DType::kFloat32, shape, data.data(), 12);
  EXPECT_EQ(lost.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(lost.status().message(), HasSubstr("no-such-host.invalid"));
}

TEST(RoutingConnectTest, RejectsBadTargets) {
  EXPECT_EQ(RoutingClient::Connect({}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(RoutingClient::Connect({""}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      RoutingClient::Connect({"dns://8.8.8.8/lossd:50051"}).status().code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(RoutingClient::Connect({"dns:///lossd:99999"}).status().code(),
            absl::StatusCode::kInvalidArgument);
  RoutingOptions options;
  options.probe_deadline = absl::ZeroDuration();
  EXPECT_EQ(RoutingClient::Connect({"127.0.0.1:1"}, options).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      *RoutingClient::InstanceOf("0a1b2c3d-00ff00ff00ff00ff00ff00ff00ff00ff"),
      "0a1b2c3d");
  EXPECT_EQ(RoutingClient::InstanceOf("0a1b2c3d-00ff").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(RoutingClient::InstanceOf("no-dash-hex").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(RoutingClient::InstanceOf("nodash").status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace lossd
