// The handle shape (common/handle.h) and the quoting of client values in
// messages (common/echo.h).
#include "common/handle.h"

#include <string>

#include "common/echo.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace lossd {
namespace {

using ::testing::HasSubstr;

TEST(EchoTest, ShortValuesWholeLongOnesAsAPrefixAndTheirSize) {
  EXPECT_EQ(Echo("abc"), "'abc'");
  EXPECT_EQ(Echo(""), "''");
  EXPECT_EQ(Echo("a\nb\x01"), "'a\\nb\\x01'");
  const std::string exact(kEchoPrefixBytes, 'x');
  EXPECT_EQ(Echo(exact), "'" + exact + "'");
  const std::string long_value(7000, 'y');
  EXPECT_EQ(Echo(long_value),
            "'" + std::string(kEchoPrefixBytes, 'y') + "...' (7000 bytes)");
  // Escaping cannot make it long: every byte escaped is 4 characters.
  EXPECT_LE(Echo(std::string(1 << 20, '\x01')).size(),
            4 * kEchoPrefixBytes + 32);
}

TEST(HandleTest, OnlyTheShapeOfIssuedHandlesIsWellFormed) {
  const std::string good = "0a1b2c3d-" + std::string(32, 'f');
  EXPECT_TRUE(IsWellFormedHandle(good));
  EXPECT_TRUE(CheckHandle(good, "handle").ok());
  for (const std::string& bad :
       {std::string(), std::string("not-a-handle"), good.substr(0, 40),
        good + "0", "0A1B2C3D-" + std::string(32, 'f'),
        "0a1b2c3d_" + std::string(32, 'f'), "0a1b2c3g-" + std::string(32, 'f'),
        "0a1b2c3d-" + std::string(31, 'f') + "-", std::string(1 << 20, 'a')}) {
    SCOPED_TRACE(bad.substr(0, 64));
    EXPECT_FALSE(IsWellFormedHandle(bad));
    const absl::Status status = CheckHandle(bad, "logits");
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(status.message(),
                HasSubstr(bad.empty() ? "logits: empty handle"
                                      : "logits: malformed handle"));
    EXPECT_THAT(status.message(),
                HasSubstr("8 lower-case hex digits, '-', 32"));
    EXPECT_LT(status.message().size(), 400u);
  }
}

}  // namespace
}  // namespace lossd
