// AlignUp (kernels/cuda/align_up.h) on the CPU: every workspace layout of the
// CUDA backend places its parts with it, so a wrong rounding would misalign a
// part on the device.
#include "kernels/cuda/align_up.h"

#include <cstddef>

#include "gtest/gtest.h"

namespace lossd {
namespace {

TEST(AlignUpTest, ZeroStaysZero) { EXPECT_EQ(AlignUp(0), 0u); }

TEST(AlignUpTest, MultiplesStayAndOthersRoundUpToTheNext) {
  EXPECT_EQ(AlignUp(1), kDeviceAlign);
  EXPECT_EQ(AlignUp(kDeviceAlign - 1), kDeviceAlign);
  EXPECT_EQ(AlignUp(kDeviceAlign), kDeviceAlign);
  EXPECT_EQ(AlignUp(kDeviceAlign + 1), 2 * kDeviceAlign);
  EXPECT_EQ(AlignUp(3 * kDeviceAlign), 3 * kDeviceAlign);
}

TEST(AlignUpTest, SizesPastFourGigabytes) {
  const std::size_t big = std::size_t{1} << 40;
  EXPECT_EQ(AlignUp(big), big);
  EXPECT_EQ(AlignUp(big + 1), big + kDeviceAlign);
}

// A constant expression: layouts may size static parts with it.
static_assert(AlignUp(17) == 256, "AlignUp is usable at compile time");

}  // namespace
}  // namespace lossd
