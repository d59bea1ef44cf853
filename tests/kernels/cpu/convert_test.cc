// Tests of the fp32 <-> bf16/half conversions (rounding ties, inf, NaN,
// subnormals, exhaustive round trips) and of ConvertAndScale.
#include "kernels/cpu/convert.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "common/float16.h"
#include "gtest/gtest.h"

namespace lossd {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// Every one of the 65536 encodings survives 16 -> 32 -> 16 bits, NaN payloads
// included (their top payload bits fit; the quiet bit may be set).
TEST(Float16Test, BF16RoundTripsEveryEncoding) {
  for (uint32_t bits = 0; bits <= 0xffff; ++bits) {
    const uint16_t h = static_cast<uint16_t>(bits);
    const float f = BF16ToFloat(h);
    const uint16_t back = FloatToBF16(f);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(BF16ToFloat(back))) << std::hex << bits;
      EXPECT_EQ(back & 0x8000, h & 0x8000) << std::hex << bits;
      EXPECT_EQ(back | 0x0040, h | 0x0040) << std::hex << bits;
    } else {
      EXPECT_EQ(back, h) << std::hex << bits;
    }
  }
}

TEST(Float16Test, HalfRoundTripsEveryEncoding) {
  for (uint32_t bits = 0; bits <= 0xffff; ++bits) {
    const uint16_t h = static_cast<uint16_t>(bits);
    const float f = HalfToFloat(h);
    const uint16_t back = FloatToHalf(f);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(HalfToFloat(back))) << std::hex << bits;
      EXPECT_EQ(back | 0x0200, h | 0x0200) << std::hex << bits;
    } else {
      EXPECT_EQ(back, h) << std::hex << bits;
    }
  }
}

TEST(Float16Test, HalfDecodesKnownValues) {
  EXPECT_EQ(HalfToFloat(0x3c00), 1.0f);
  EXPECT_EQ(HalfToFloat(0xc000), -2.0f);
  EXPECT_EQ(HalfToFloat(0x7bff), 65504.0f);
  EXPECT_EQ(HalfToFloat(0x0400), std::ldexp(1.0f, -14));  // smallest normal
  EXPECT_EQ(HalfToFloat(0x0001), std::ldexp(1.0f, -24));  // smallest subnormal
  EXPECT_EQ(HalfToFloat(0x03ff), 1023 * std::ldexp(1.0f, -24));
  EXPECT_EQ(HalfToFloat(0x7c00), kInf);
  EXPECT_EQ(HalfToFloat(0xfc00), -kInf);
  EXPECT_TRUE(std::isnan(HalfToFloat(0x7e00)));
  EXPECT_TRUE(std::signbit(HalfToFloat(0x8000)));
}

// Each float halfway between two adjacent encodings rounds to the one with an
// even last bit; a hair above or below rounds to the nearer one.
template <typename ToFloat, typename FromFloat>
void CheckTies(uint32_t first, uint32_t last, ToFloat to_float,
               FromFloat from_float) {
  for (uint32_t bits = first; bits < last; ++bits) {
    const uint16_t lo = static_cast<uint16_t>(bits);
    const uint16_t hi = static_cast<uint16_t>(bits + 1);
    const float a = to_float(lo);
    const float b = to_float(hi);
    const float mid = a + (b - a) / 2;  // exact: fp32 has the bits to spare
    ASSERT_GT(mid, a);
    ASSERT_LT(mid, b);
    EXPECT_EQ(from_float(mid), (bits & 1) ? hi : lo) << std::hex << bits;
    EXPECT_EQ(from_float(std::nextafter(mid, b)), hi) << std::hex << bits;
    EXPECT_EQ(from_float(std::nextafter(mid, a)), lo) << std::hex << bits;
  }
}

TEST(Float16Test, BF16RoundsTiesToEven) {
  CheckTies(0x0000, 0x7f7f, BF16ToFloat, FloatToBF16);  // subnormals included
}

TEST(Float16Test, HalfRoundsTiesToEven) {
  CheckTies(0x0000, 0x7bff, HalfToFloat, FloatToHalf);  // subnormals included
}

TEST(Float16Test, OverflowUnderflowAndSpecials) {
  EXPECT_EQ(FloatToHalf(65504.0f), 0x7bff);
  EXPECT_EQ(FloatToHalf(65519.99f), 0x7bff);
  EXPECT_EQ(FloatToHalf(65520.0f), 0x7c00);  // the tie rounds to even: inf
  EXPECT_EQ(FloatToHalf(1e10f), 0x7c00);
  EXPECT_EQ(FloatToHalf(-1e10f), 0xfc00);
  EXPECT_EQ(FloatToHalf(kInf), 0x7c00);
  EXPECT_EQ(FloatToHalf(-kInf), 0xfc00);
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -25)), 0x0000);  // tie to even: 0
  EXPECT_EQ(FloatToHalf(std::ldexp(1.5f, -25)), 0x0001);
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -30)), 0x0000);
  EXPECT_EQ(FloatToHalf(-0.0f), 0x8000);
  EXPECT_EQ(FloatToHalf(std::numeric_limits<float>::denorm_min()), 0x0000);

  EXPECT_EQ(FloatToBF16(std::numeric_limits<float>::max()), 0x7f80);
  EXPECT_EQ(FloatToBF16(-kInf), 0xff80);
  EXPECT_EQ(FloatToBF16(std::numeric_limits<float>::denorm_min()), 0x0000);
  EXPECT_EQ(FloatToBF16(-0.0f), 0x8000);
  EXPECT_EQ(FloatToBF16(1.0f), 0x3f80);

  // A NaN whose payload lives only in the bits that are dropped stays a NaN.
  const float low_payload_nan = FloatFromBits(0x7f800001u);
  ASSERT_TRUE(std::isnan(low_payload_nan));
  EXPECT_TRUE(std::isnan(BF16ToFloat(FloatToBF16(low_payload_nan))));
  EXPECT_TRUE(std::isnan(HalfToFloat(FloatToHalf(low_payload_nan))));
  const float negative_nan = FloatFromBits(0xffc00000u);
  EXPECT_EQ(FloatToBF16(negative_nan) & 0x8000, 0x8000);
  EXPECT_EQ(FloatToHalf(negative_nan) & 0x8000, 0x8000);
}

// Against an independent rounding: the nearest of the two neighbouring
// encodings, computed in double.
TEST(Float16Test, RandomFloatsRoundToNearest) {
  const uint64_t seed = 0x5eed0001;
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<uint32_t> exponent(100, 145);
  std::uniform_int_distribution<uint32_t> mantissa(0, (1u << 23) - 1);
  for (int i = 0; i < 200000; ++i) {
    const float value = FloatFromBits((exponent(rng) << 23) | mantissa(rng) |
                                      static_cast<uint32_t>(i & 1) << 31);
    for (int format = 0; format < 2; ++format) {
      const uint16_t rounded =
          format == 0 ? FloatToBF16(value) : FloatToHalf(value);
      auto decode = [&](uint16_t h) {
        return static_cast<double>(format == 0 ? BF16ToFloat(h)
                                               : HalfToFloat(h));
      };
      const double error = std::fabs(decode(rounded) - value);
      if (std::isinf(decode(rounded))) {
        EXPECT_GE(std::fabs(value), 65520.0f);
        continue;
      }
      // No neighbour is closer.
      const uint16_t up = rounded + 1, down = rounded - 1;
      if ((up & 0x7fff) <= (format == 0 ? 0x7f7f : 0x7bff)) {
        EXPECT_LE(error, std::fabs(decode(up) - value)) << value;
      }
      if ((rounded & 0x7fff) != 0) {
        EXPECT_LE(error, std::fabs(decode(down) - value)) << value;
      }
    }
  }
}

std::vector<uint16_t> ToBF16(const std::vector<float>& values) {
  std::vector<uint16_t> out;
  for (float v : values) out.push_back(FloatToBF16(v));
  return out;
}

TEST(ConvertAndScaleTest, Float32ToBF16WithScaleAndRowScale) {
  // A [3, 4] tensor; convert elements 2..9 (rows 0..2).
  std::vector<float> src(12);
  for (int i = 0; i < 12; ++i) src[i] = 1.0f + 0.25f * i;
  const std::vector<float> row_scale = {2.0f, -1.0f, 0.5f};
  std::vector<uint16_t> dst(8, 0xdead);
  ASSERT_TRUE(ConvertAndScale(src.data() + 2, DType::kFloat32, dst.data(),
                              DType::kBFloat16, 2, 8, 4, 3.0f, row_scale.data())
                  .ok());
  for (int i = 0; i < 8; ++i) {
    const int element = 2 + i;
    const float expected = src[element] * (3.0f * row_scale[element / 4]);
    EXPECT_EQ(dst[i], FloatToBF16(expected)) << i;
  }
}

TEST(ConvertAndScaleTest, EveryFloatPairMatchesElementwiseConversion) {
  const std::vector<float> values = {0.0f,  -0.0f,   1.0f,   -3.14159f,
                                     1e-6f, 70000.f, 1e-30f, kInf};
  const DType dtypes[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};
  auto encode = [](float v, DType dtype, void* out) {
    if (dtype == DType::kFloat32) {
      std::memcpy(out, &v, 4);
    } else {
      const uint16_t h =
          dtype == DType::kBFloat16 ? FloatToBF16(v) : FloatToHalf(v);
      std::memcpy(out, &h, 2);
    }
  };
  auto decode = [](const void* in, DType dtype) {
    if (dtype == DType::kFloat32) {
      float v;
      std::memcpy(&v, in, 4);
      return v;
    }
    uint16_t h;
    std::memcpy(&h, in, 2);
    return dtype == DType::kBFloat16 ? BF16ToFloat(h) : HalfToFloat(h);
  };
  for (DType from : dtypes) {
    for (DType to : dtypes) {
      std::vector<uint8_t> src(values.size() * 4), dst(values.size() * 4, 0);
      for (size_t i = 0; i < values.size(); ++i) {
        encode(values[i], from, src.data() + i * DTypeSize(from));
      }
      ASSERT_TRUE(ConvertAndScale(src.data(), from, dst.data(), to, 0,
                                  values.size(), 1, 0.5f, nullptr)
                      .ok());
      for (size_t i = 0; i < values.size(); ++i) {
        const float in = decode(src.data() + i * DTypeSize(from), from);
        std::vector<uint8_t> expected(4);
        encode(in * 0.5f, to, expected.data());
        EXPECT_EQ(std::memcmp(dst.data() + i * DTypeSize(to), expected.data(),
                              DTypeSize(to)),
                  0)
            << "from " << static_cast<int>(from) << " to "
            << static_cast<int>(to) << " value " << values[i];
      }
    }
  }
}

TEST(ConvertAndScaleTest, InPlaceScaling) {
  std::vector<uint16_t> data = ToBF16({1.0f, 2.0f, 3.0f, 4.0f});
  const std::vector<float> row_scale = {10.0f, 0.5f};
  ASSERT_TRUE(ConvertAndScale(data.data(), DType::kBFloat16, data.data(),
                              DType::kBFloat16, 0, 4, 2, 1.0f, row_scale.data())
                  .ok());
  EXPECT_EQ(data, ToBF16({10.0f, 20.0f, 1.5f, 2.0f}));
}

TEST(ConvertAndScaleTest, IntegersCopyUnchanged) {
  const std::vector<int64_t> src = {-100, 0, 1LL << 40, 7};
  std::vector<int64_t> dst(4, 0);
  ASSERT_TRUE(ConvertAndScale(src.data(), DType::kInt64, dst.data(),
                              DType::kInt64, 0, 4, 4, 1.0f, nullptr)
                  .ok());
  EXPECT_EQ(dst, src);
}

TEST(ConvertAndScaleTest, RejectsBadArguments) {
  std::vector<float> src(4, 1.0f);
  std::vector<float> dst(4, 7.0f);
  std::vector<int32_t> ints(4, 1);
  const float row_scale = 2.0f;
  auto expect_invalid = [&](absl::Status status, const std::string& what) {
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << what;
    EXPECT_EQ(dst, std::vector<float>(4, 7.0f)) << what << " wrote to dst";
  };
  expect_invalid(ConvertAndScale(ints.data(), DType::kInt32, dst.data(),
                                 DType::kFloat32, 0, 4, 4, 1.0f, nullptr),
                 "int to float");
  expect_invalid(ConvertAndScale(ints.data(), DType::kInt32, ints.data(),
                                 DType::kInt32, 0, 4, 4, 2.0f, nullptr),
                 "int scaled");
  expect_invalid(ConvertAndScale(src.data(), DType::kInvalid, dst.data(),
                                 DType::kFloat32, 0, 4, 4, 1.0f, nullptr),
                 "invalid dtype");
  expect_invalid(ConvertAndScale(src.data(), DType::kFloat32, dst.data(),
                                 DType::kFloat32, 0, -1, 4, 1.0f, nullptr),
                 "negative count");
  expect_invalid(ConvertAndScale(src.data(), DType::kFloat32, dst.data(),
                                 DType::kFloat32, 0, 4, 0, 1.0f, &row_scale),
                 "row_length 0 with row_scale");
  expect_invalid(ConvertAndScale(nullptr, DType::kFloat32, dst.data(),
                                 DType::kFloat32, 0, 4, 4, 1.0f, nullptr),
                 "null src");
  // Widening in place would overwrite elements before they are read.
  std::vector<uint16_t> halves(8, 0);
  EXPECT_EQ(ConvertAndScale(halves.data(), DType::kFloat16, halves.data(),
                            DType::kFloat32, 0, 4, 4, 1.0f, nullptr)
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(ConvertAndScale(nullptr, DType::kFloat32, nullptr,
                              DType::kBFloat16, 0, 0, 4, 1.0f, nullptr)
                  .ok());
}

}  // namespace
}  // namespace lossd
