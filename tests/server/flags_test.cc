// ParseByteSize: the --memory_budget and --chunk_bytes syntax.
#include "server/flags.h"

#include "gtest/gtest.h"

namespace lossd {
namespace {

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

}  // namespace
}  // namespace lossd
