// Issue 21, without a server: the quota file format (ParseQuotaFile), limits
// replaced under outstanding charges (TenantQuotas::SetLimits), and the
// ConfigWatcher's change detection (CheckNow, as its period calls it).
#include "server/reload.h"

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/quota.h"

namespace lossd {
namespace {

using ::testing::HasSubstr;

TEST(ParseQuotaFileTest, DefaultLineAndTenantLinesStartFromIt) {
  TenantLimits base;
  base.max_bytes = 100;
  base.max_tensors = 7;
  absl::StatusOr<QuotaConfig> config = ParseQuotaFile(
      "# comment\n"
      "alpha max_bytes=4K   # after the default's keys\n"
      "\n"
      "*  max_inflight=3 max_bytes=1M\n"
      "beta\tmax_tensors=0 max_inflight=9\r\n",
      base);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->defaults.max_bytes, 1 << 20);
  EXPECT_EQ(config->defaults.max_tensors, 7);  // from the flags
  EXPECT_EQ(config->defaults.max_in_flight, 3);
  ASSERT_EQ(config->overrides.size(), 2u);
  const TenantLimits& alpha = config->overrides.at("alpha");
  EXPECT_EQ(alpha.max_bytes, 4096);
  EXPECT_EQ(alpha.max_tensors, 7);
  EXPECT_EQ(alpha.max_in_flight, 3);
  const TenantLimits& beta = config->overrides.at("beta");
  EXPECT_EQ(beta.max_bytes, 1 << 20);
  EXPECT_EQ(beta.max_tensors, 0);
  EXPECT_EQ(beta.max_in_flight, 9);
  // A file of comments only (as deploy/k8s/base/quotas ships): the flags for
  // everyone.
  absl::StatusOr<QuotaConfig> comments = ParseQuotaFile("# none\n", base);
  ASSERT_TRUE(comments.ok());
  EXPECT_EQ(comments->defaults.max_bytes, 100);
  EXPECT_TRUE(comments->overrides.empty());
}

// Issue 31: what a truncated write leaves is refused, not read as "no limit".
TEST(ParseQuotaFileTest, RefusesAnEmptyFile) {
  for (const std::string text : {"", "\n", " \t\r\n\n  ", "\v\f"}) {
    absl::StatusOr<QuotaConfig> config = ParseQuotaFile(text, TenantLimits());
    ASSERT_FALSE(config.ok()) << absl::CEscape(text);
    EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(config.status().message(), HasSubstr("the quota file is empty"))
        << absl::CEscape(text);
  }
}

TEST(ParseQuotaFileTest, RefusesMalformedLinesNamingThem) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"alpha\n", "line 1: expected 'TENANT KEY=VALUE"},
      {"\nalpha max_bytes\n", "line 2: 'max_bytes' is not KEY=VALUE"},
      {"alpha max_things=1\n", "line 1: unknown key 'max_things'"},
      {"alpha max_tensors=-1\n", "line 1: max_tensors='-1' is not a count"},
      {"alpha max_inflight=lots\n", "is not a count"},
      {"alpha max_bytes=4Q\n", "line 1: '4Q': unknown suffix"},
      {"alpha max_tensors=1\nalpha max_tensors=2\n",
       "line 2: tenant 'alpha' repeated"},
      {"* max_tensors=1\n* max_tensors=2\n", "line 2: a second default line"},
      {"* max_tensors=x\n", "line 1: max_tensors='x'"},
  };
  for (const auto& [text, message] : cases) {
    absl::StatusOr<QuotaConfig> config = ParseQuotaFile(text, TenantLimits());
    ASSERT_FALSE(config.ok()) << text;
    EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(config.status().message(), HasSubstr(message)) << text;
  }
}

TEST(TenantQuotasTest, NewLimitsJudgeTheNextChargeAndKeepOutstandingOnes) {
  TenantLimits one;
  one.max_tensors = 1;
  TenantQuotas quotas(one);
  absl::StatusOr<QuotaCharge> first = quotas.ChargeTensor("alpha", 10);
  ASSERT_TRUE(first.ok());
  EXPECT_FALSE(quotas.ChargeTensor("alpha", 10).ok());
  TenantLimits two;
  two.max_tensors = 2;
  quotas.SetLimits(one, {{"alpha", two}});
  EXPECT_EQ(quotas.ConfiguredTenants(), std::vector<std::string>{"alpha"});
  absl::StatusOr<QuotaCharge> second = quotas.ChargeTensor("alpha", 10);
  ASSERT_TRUE(second.ok());
  EXPECT_EQ(quotas.UsageOf("alpha").tensors, 2);
  // Lowered below what is held: nothing is taken back, new charges refused.
  quotas.SetLimits(one, {});
  EXPECT_EQ(quotas.UsageOf("alpha").tensors, 2);
  EXPECT_FALSE(quotas.ChargeTensor("alpha", 10).ok());
  *first = QuotaCharge();
  *second = QuotaCharge();
  EXPECT_EQ(quotas.UsageOf("alpha").tensors, 0);
}

// An RPC's working bytes (ChargeBytes) count against the byte limit beside
// the tensors, never against the tensor limit, and go back when released.
TEST(TenantQuotasTest, WorkingBytesCountAsBytesNotTensors) {
  TenantLimits limits;
  limits.max_tensors = 1;
  limits.max_bytes = 100;
  TenantQuotas quotas(limits);
  absl::StatusOr<QuotaCharge> tensor = quotas.ChargeTensor("alpha", 40);
  ASSERT_TRUE(tensor.ok());
  absl::StatusOr<QuotaCharge> buffer = quotas.ChargeBytes("alpha", 50);
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  EXPECT_EQ(quotas.UsageOf("alpha").bytes, 90);
  EXPECT_EQ(quotas.UsageOf("alpha").tensors, 1);
  const absl::Status over = quotas.ChargeBytes("alpha", 11).status();
  EXPECT_EQ(over.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(over.message().find("byte quota exceeded"), std::string::npos)
      << over;
  EXPECT_EQ(quotas.UsageOf("alpha").bytes, 90);
  *buffer = QuotaCharge();
  *tensor = QuotaCharge();
  EXPECT_EQ(quotas.UsageOf("alpha").bytes, 0);
  EXPECT_EQ(quotas.UsageOf("alpha").tensors, 0);
}

class ConfigWatcherTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/lossd-reload-test-XXXXXX";
    ASSERT_NE(mkdtemp(pattern), nullptr);
    dir_ = pattern;
    path_ = dir_ + "/file";
    Write("one");
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  void Write(const std::string& text) {
    // Written aside, then renamed over: a reader sees the old or the new.
    std::ofstream(path_ + ".tmp") << text;
    std::filesystem::rename(path_ + ".tmp", path_);
  }

  std::string dir_;
  std::string path_;
};

TEST_F(ConfigWatcherTest, ReloadsOnChangeOnlyAndReportsAFailureOnce) {
  int reloads = 0;
  absl::Status next = absl::OkStatus();
  std::vector<std::string> observed;
  // An hour: only CheckNow and Reload act in this test.
  ConfigWatcher watcher(
      {{"thing",
        {path_},
        [&] {
          ++reloads;
          return next;
        }}},
      absl::Hours(1), [&](const std::string& name, const absl::Status& status) {
        observed.push_back(name + (status.ok() ? " ok" : " failed"));
      });
  EXPECT_TRUE(watcher.CheckNow().ok());
  EXPECT_EQ(reloads, 0) << "unchanged since start";

  Write("two");
  EXPECT_TRUE(watcher.CheckNow().ok());
  EXPECT_EQ(reloads, 1);
  EXPECT_TRUE(watcher.CheckNow().ok());
  EXPECT_EQ(reloads, 1);

  next = absl::InvalidArgumentError("bad");
  Write("three");
  EXPECT_FALSE(watcher.CheckNow().ok());
  EXPECT_TRUE(watcher.CheckNow().ok()) << "the same bad contents: not again";
  EXPECT_EQ(reloads, 2);
  // Reload (SIGHUP) retries whatever the contents.
  EXPECT_FALSE(watcher.Reload().ok());
  EXPECT_EQ(reloads, 3);

  next = absl::OkStatus();
  std::filesystem::remove(path_);  // a missing file is a change too
  EXPECT_TRUE(watcher.CheckNow().ok());
  EXPECT_EQ(reloads, 4);
  EXPECT_EQ(observed, (std::vector<std::string>{"thing ok", "thing failed",
                                                "thing failed", "thing ok"}));
}

TEST_F(ConfigWatcherTest, SeesASymlinkSwapLikeKubernetes) {
  // file -> ..data/file, ..data -> v1: the file's own link never changes.
  std::filesystem::create_directory(dir_ + "/v1");
  std::filesystem::create_directory(dir_ + "/v2");
  std::ofstream(dir_ + "/v1/file") << "one";
  std::ofstream(dir_ + "/v2/file") << "two";
  std::filesystem::create_symlink("v1", dir_ + "/..data");
  const std::string linked = dir_ + "/linked";
  std::filesystem::create_symlink("..data/file", linked);
  int reloads = 0;
  ConfigWatcher watcher({{"linked",
                          {linked},
                          [&] {
                            ++reloads;
                            return absl::OkStatus();
                          }}},
                        absl::Hours(1), nullptr);
  std::filesystem::create_symlink("v2", dir_ + "/..data_tmp");
  std::filesystem::rename(dir_ + "/..data_tmp", dir_ + "/..data");
  EXPECT_TRUE(watcher.CheckNow().ok());
  EXPECT_EQ(reloads, 1);
}

}  // namespace
}  // namespace lossd
