// ParseByteSize: the --memory_budget and --chunk_bytes syntax; ConfigFromFlags
// for --staging_bytes, the data connections' bounds and --advertise_features.
#include "server/flags.h"

#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "gtest/gtest.h"

namespace lossd {
namespace {

// ConfigFromFlags with the flags as set refuses them with INVALID_ARGUMENT and
// a message that names `flag` (set to `value`).
void ExpectRefused(const std::string& flag, const std::string& value) {
  const absl::StatusOr<ServerConfig> config = ConfigFromFlags();
  EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument)
      << flag << "=" << value;
  EXPECT_NE(config.status().message().find(flag), std::string::npos)
      << config.status();
}

TEST(ParseByteSizeTest, AcceptsPlainAndSuffixedCounts) {
  EXPECT_EQ(*ParseByteSize("0"), 0);
  EXPECT_EQ(*ParseByteSize("auto"), 0);
  EXPECT_EQ(*ParseByteSize("1048576"), 1048576);
  EXPECT_EQ(*ParseByteSize("4K"), 4096);
  EXPECT_EQ(*ParseByteSize("512M"), int64_t{512} << 20);
  EXPECT_EQ(*ParseByteSize("512MiB"), int64_t{512} << 20);
  EXPECT_EQ(*ParseByteSize("8G"), int64_t{8} << 30);
  EXPECT_EQ(*ParseByteSize("8gb"), int64_t{8} << 30);
  EXPECT_EQ(*ParseByteSize("2T"), int64_t{2} << 40);
}

TEST(ParseByteSizeTest, RejectsGarbageAndOverflow) {
  for (const char* text : {"", "G", "-1", "1.5G", "12X", "1 G B", "9E",
                           "99999999999T", "99999999999999999999"}) {
    EXPECT_EQ(ParseByteSize(text).status().code(),
              absl::StatusCode::kInvalidArgument)
        << text;
  }
}

TEST(ConfigFromFlagsTest, StagingBytesIsParsedAndBounded) {
  absl::FlagSaver saver;  // restores every flag at the end
  absl::StatusOr<ServerConfig> config = ConfigFromFlags();
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->staging_bytes, int64_t{4} << 20);
  absl::SetFlag(&FLAGS_staging_bytes, "1M");
  config = ConfigFromFlags();
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->staging_bytes, int64_t{1} << 20);
  absl::SetFlag(&FLAGS_staging_bytes, "64K");
  EXPECT_EQ(ConfigFromFlags()->staging_bytes, int64_t{64} << 10);
  for (const char* bad : {"0", "auto", "32K", "257M", "1G", "x", "-4M"}) {
    absl::SetFlag(&FLAGS_staging_bytes, bad);
    ExpectRefused("--staging_bytes", bad);
  }
}

TEST(ConfigFromFlagsTest, DataMaxConnectionsIsBounded) {
  absl::FlagSaver saver;
  absl::StatusOr<ServerConfig> config = ConfigFromFlags();
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->data_max_connections, 64);
  absl::SetFlag(&FLAGS_data_max_connections, 512);
  config = ConfigFromFlags();
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->data_max_connections, 512);
  for (int bad : {0, -1, 4097}) {
    absl::SetFlag(&FLAGS_data_max_connections, bad);
    ExpectRefused("--data_max_connections", std::to_string(bad));
  }
}

TEST(ConfigFromFlagsTest, DataAuthFlagsAreBounded) {
  absl::FlagSaver saver;
  absl::StatusOr<ServerConfig> config = ConfigFromFlags();
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->data_auth_timeout, absl::Seconds(1));
  EXPECT_EQ(config->data_max_unauthenticated_per_peer, 128);
  absl::SetFlag(&FLAGS_data_auth_timeout, absl::Milliseconds(250));
  absl::SetFlag(&FLAGS_data_max_unauthenticated_per_peer, 64);
  config = ConfigFromFlags();
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->data_auth_timeout, absl::Milliseconds(250));
  EXPECT_EQ(config->data_max_unauthenticated_per_peer, 64);
  for (absl::Duration bad : {absl::ZeroDuration(), absl::Seconds(-1)}) {
    absl::SetFlag(&FLAGS_data_auth_timeout, bad);
    ExpectRefused("--data_auth_timeout", absl::FormatDuration(bad));
  }
  absl::SetFlag(&FLAGS_data_auth_timeout, absl::Seconds(1));
  for (int bad : {0, -1, 63, 65537}) {
    absl::SetFlag(&FLAGS_data_max_unauthenticated_per_peer, bad);
    ExpectRefused("--data_max_unauthenticated_per_peer", std::to_string(bad));
  }
}

TEST(ConfigFromFlagsTest, AdvertiseFeaturesNamesServedFeaturesOnly) {
  absl::FlagSaver saver;
  absl::StatusOr<ServerConfig> config = ConfigFromFlags();
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_FALSE(config->advertised_features.has_value());  // "all"
  absl::SetFlag(&FLAGS_advertise_features, "");
  config = ConfigFromFlags();
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->advertised_features, std::vector<std::string>());
  absl::SetFlag(&FLAGS_advertise_features, "linear_forward,post_training");
  config = ConfigFromFlags();
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->advertised_features,
            (std::vector<std::string>{"linear_forward", "post_training"}));
  for (const char* bad : {"post-training", "all,post_training", "ALL"}) {
    absl::SetFlag(&FLAGS_advertise_features, bad);
    ExpectRefused("--advertise_features", bad);
  }
}

}  // namespace
}  // namespace lossd
