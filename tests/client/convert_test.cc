// The client's vectorized conversions (client/convert.h) against the scalar
// reference of common/float16.h, bit for bit: every 16-bit input, a
// sweep of fp32 bit patterns with the edge cases, and the pool's splitting.
#include "client/convert.h"

#include <atomic>
#include <cstdint>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "common/float16.h"
#include "gtest/gtest.h"

namespace lossd {
namespace {

// fp32 bit patterns: a stride over all 2^32 plus the boundaries of both
// 16-bit formats (rounding ties, subnormals, overflow, inf, NaN payloads).
std::vector<uint32_t> FloatPatterns() {
  std::vector<uint32_t> bits;
  for (uint64_t b = 0; b < (uint64_t{1} << 32); b += 4093) {
    bits.push_back(static_cast<uint32_t>(b));
  }
  for (uint32_t edge :
       {0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u, 0x7f800001u,
        0x7fc00000u, 0xffffffffu, 0x7f7fffffu, 0x477fefffu, 0x477ff000u,
        0x38800000u, 0x387fffffu, 0x33800000u, 0x33000000u, 0x33000001u,
        0x3f808000u, 0x3f818000u, 0x3f807fffu, 0x7f7f8000u, 0x00000001u}) {
    for (int delta = -2; delta <= 2; ++delta) {
      bits.push_back(edge + delta);
      bits.push_back((edge + delta) | 0x80000000u);
    }
  }
  return bits;
}

TEST(ConvertTest, FloatToSixteenMatchesReference) {
  const std::vector<uint32_t> bits = FloatPatterns();
  std::vector<uint16_t> bf16(bits.size()), half(bits.size());
  ASSERT_TRUE(ConvertElements(bits.data(), DType::kFloat32, bf16.data(),
                              DType::kBFloat16, bits.size())
                  .ok());
  ASSERT_TRUE(ConvertElements(bits.data(), DType::kFloat32, half.data(),
                              DType::kFloat16, bits.size())
                  .ok());
  for (std::size_t i = 0; i < bits.size(); ++i) {
    const float value = FloatFromBits(bits[i]);
    ASSERT_EQ(bf16[i], FloatToBF16(value)) << std::hex << bits[i];
    ASSERT_EQ(half[i], FloatToHalf(value)) << std::hex << bits[i];
  }
}

TEST(ConvertTest, SixteenToFloatIsExactForEveryInput) {
  std::vector<uint16_t> all(1 << 16);
  for (uint32_t i = 0; i < all.size(); ++i) all[i] = static_cast<uint16_t>(i);
  std::vector<uint32_t> from_bf16(all.size()), from_half(all.size());
  ASSERT_TRUE(ConvertElements(all.data(), DType::kBFloat16, from_bf16.data(),
                              DType::kFloat32, all.size())
                  .ok());
  ASSERT_TRUE(ConvertElements(all.data(), DType::kFloat16, from_half.data(),
                              DType::kFloat32, all.size())
                  .ok());
  std::vector<uint16_t> half_to_bf16(all.size());
  ASSERT_TRUE(ConvertElements(all.data(), DType::kFloat16, half_to_bf16.data(),
                              DType::kBFloat16, all.size())
                  .ok());
  for (uint32_t i = 0; i < all.size(); ++i) {
    ASSERT_EQ(from_bf16[i], FloatBits(BF16ToFloat(all[i]))) << i;
    ASSERT_EQ(from_half[i], FloatBits(HalfToFloat(all[i]))) << i;
    ASSERT_EQ(half_to_bf16[i], FloatToBF16(HalfToFloat(all[i]))) << i;
  }
}

TEST(ConvertTest, UnalignedBuffersAndOddCounts) {
  std::mt19937 rng(7);
  std::vector<uint8_t> src(4 * 1000 + 3), dst(2 * 1000 + 3);
  for (uint8_t& b : src) b = static_cast<uint8_t>(rng());
  for (std::size_t count : {0, 1, 7, 31, 999}) {
    ASSERT_TRUE(ConvertElements(src.data() + 1, DType::kFloat32, dst.data() + 3,
                                DType::kBFloat16, count)
                    .ok());
    for (std::size_t i = 0; i < count; ++i) {
      float value;
      std::memcpy(&value, src.data() + 1 + 4 * i, 4);
      uint16_t got;
      std::memcpy(&got, dst.data() + 3 + 2 * i, 2);
      ASSERT_EQ(got, FloatToBF16(value)) << count << " " << i;
    }
  }
}

TEST(ConvertTest, IntegersAndRefusals) {
  const std::vector<int64_t> wide = {0, -1, 2147483647, -2147483648LL, 5};
  std::vector<int32_t> narrow(wide.size());
  ASSERT_TRUE(ConvertElements(wide.data(), DType::kInt64, narrow.data(),
                              DType::kInt32, wide.size())
                  .ok());
  EXPECT_EQ(narrow,
            (std::vector<int32_t>{0, -1, 2147483647, -2147483647 - 1, 5}));
  const std::vector<int64_t> too_big = {1, int64_t{1} << 31};
  absl::Status status = ConvertElements(too_big.data(), DType::kInt64,
                                        narrow.data(), DType::kInt32, 2);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("element 1"), absl::string_view::npos)
      << status;
  float as_float = 0.0f;
  status = ConvertElements(narrow.data(), DType::kInt32, &as_float,
                           DType::kFloat32, 1);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(CanConvert(DType::kFloat32, DType::kInt32));
  EXPECT_TRUE(CanConvert(DType::kInt32, DType::kInt32));
}

TEST(ConvertTest, PoolSplitsLikeOneCall) {
  ConvertPool pool(3);
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 5.0f);
  for (std::size_t count :
       {std::size_t{1}, std::size_t{1000}, std::size_t{3} << 20,
        (std::size_t{3} << 20) + 17}) {
    std::vector<float> src(count);
    for (float& v : src) v = normal(rng);
    std::vector<uint16_t> one(count), split(count, 0xdead);
    ASSERT_TRUE(ConvertElements(src.data(), DType::kFloat32, one.data(),
                                DType::kBFloat16, count)
                    .ok());
    ASSERT_TRUE(pool.Convert(src.data(), DType::kFloat32, split.data(),
                             DType::kBFloat16, count)
                    .ok());
    ASSERT_EQ(one, split) << count;
  }
}

TEST(ConvertTest, ParallelForFromSeveralThreadsRunsEveryTaskOnce) {
  ConvertPool pool(2);
  constexpr int kCallers = 4;
  constexpr int kTasks = 1000;
  std::vector<std::atomic<int>> runs(kCallers * kTasks);
  std::vector<std::thread> callers;
  for (int c = 0; c < kCallers; ++c) {
    callers.emplace_back([&, c] {
      for (int round = 0; round < 5; ++round) {
        absl::Status status = pool.ParallelFor(kTasks, [&](int64_t t) {
          runs[c * kTasks + t]++;
          return t == 500 && round == 4 ? absl::DataLossError("task 500 failed")
                                        : absl::OkStatus();
        });
        EXPECT_EQ(status.ok(), round != 4) << status;
      }
    });
  }
  for (std::thread& t : callers) t.join();
  for (const std::atomic<int>& count : runs) ASSERT_EQ(count.load(), 5);
}

}  // namespace
}  // namespace lossd
