// common/checked_math.h: sums and products at the int64 limits, where the
// unchecked ones would be undefined behaviour (scripts/sanitize aborts on it).
#include "common/checked_math.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <limits>

namespace lossd {
namespace {

constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
constexpr int64_t kMin = std::numeric_limits<int64_t>::min();
constexpr int64_t k2p62 = int64_t{1} << 62;

TEST(CheckedAddTest, FitsOrNothing) {
  EXPECT_EQ(CheckedAdd(2, 3), 5);
  EXPECT_EQ(CheckedAdd(kMax, 0), kMax);
  EXPECT_EQ(CheckedAdd(kMax, -1), kMax - 1);
  EXPECT_EQ(CheckedAdd(kMin, kMax), -1);
  EXPECT_EQ(CheckedAdd(k2p62 - 1, k2p62), kMax);
  EXPECT_EQ(CheckedAdd(-k2p62, -k2p62), kMin);
  EXPECT_FALSE(CheckedAdd(k2p62, k2p62).has_value());
  EXPECT_FALSE(CheckedAdd(kMax, 1).has_value());
  EXPECT_FALSE(CheckedAdd(kMax, kMax).has_value());
  EXPECT_FALSE(CheckedAdd(kMin, -1).has_value());
  EXPECT_FALSE(CheckedAdd(kMin, kMin).has_value());
}

TEST(CheckedMulTest, FitsOrNothing) {
  EXPECT_EQ(CheckedMul(6, 7), 42);
  EXPECT_EQ(CheckedMul(kMax, 1), kMax);
  EXPECT_EQ(CheckedMul(kMax, -1), -kMax);
  EXPECT_EQ(CheckedMul(kMin, 1), kMin);
  EXPECT_EQ(CheckedMul(kMin, 0), 0);
  EXPECT_EQ(CheckedMul(-k2p62, 2), kMin);
  EXPECT_FALSE(CheckedMul(k2p62, 2).has_value());
  EXPECT_FALSE(CheckedMul(kMin, -1).has_value());
  EXPECT_FALSE(CheckedMul(kMax, 2).has_value());
  EXPECT_FALSE(CheckedMul(kMax / 4 + 1, 4).has_value());
  EXPECT_FALSE(CheckedMul(int64_t{1} << 32, int64_t{1} << 31).has_value());
}

}  // namespace
}  // namespace lossd
