// common/float16.h: the fp32 <-> bfloat16 / half conversions at their edges
// (the kernels' tests cover them over every 16-bit value).
#include "common/float16.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>

namespace lossd {
namespace {

TEST(Float16Test, EveryHalfAndBFloat16RoundTrips) {
  for (uint32_t bits = 0; bits <= 0xffff; ++bits) {
    const uint16_t value = static_cast<uint16_t>(bits);
    const float half = HalfToFloat(value);
    if (std::isnan(half)) {
      EXPECT_TRUE(std::isnan(HalfToFloat(FloatToHalf(half))));
    } else {
      EXPECT_EQ(FloatToHalf(half), value) << bits;
    }
    const float bf16 = BF16ToFloat(value);
    if (std::isnan(bf16)) {
      EXPECT_TRUE(std::isnan(BF16ToFloat(FloatToBF16(bf16))));
    } else {
      EXPECT_EQ(FloatToBF16(bf16), value) << bits;
    }
  }
}

TEST(Float16Test, RoundsToNearestEvenAndOverflowsToInfinity) {
  EXPECT_EQ(FloatToHalf(65504.0f), 0x7bff);
  EXPECT_EQ(FloatToHalf(65520.0f), 0x7c00);
  EXPECT_EQ(FloatToHalf(-std::numeric_limits<float>::infinity()), 0xfc00);
  EXPECT_EQ(FloatToHalf(0x1p-24f), 0x0001);        // the smallest subnormal
  EXPECT_EQ(FloatToHalf(0x1p-25f), 0x0000);        // a tie: to even
  EXPECT_EQ(FloatToBF16(1.0f + 0x1p-8f), 0x3f80);  // a tie: to even
  EXPECT_EQ(FloatToBF16(1.0f + 0x1p-7f), 0x3f81);
}

}  // namespace
}  // namespace lossd
