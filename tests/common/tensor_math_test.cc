// common/tensor_math.h: shapes, byte counts and the stripe split that client
// and server must compute alike.
#include "common/tensor_math.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <vector>

namespace lossd {
namespace {

using ::testing::HasSubstr;

TEST(ShapeStringTest, Formats) {
  EXPECT_EQ(ShapeString({}), "[]");
  EXPECT_EQ(ShapeString({7}), "[7]");
  EXPECT_EQ(ShapeString({4, 5}), "[4, 5]");
}

TEST(TensorBytesTest, ProductOfDimensionsTimesElementSize) {
  EXPECT_EQ(*TensorBytes(DType::kFloat32, {3, 5}), 60);
  EXPECT_EQ(*TensorBytes(DType::kInt64, {7}), 56);
  EXPECT_EQ(*TensorBytes(DType::kBFloat16, {}), 2);  // a scalar
  EXPECT_EQ(*TensorBytes(DType::kFloat16, {0, 9}), 0);
  EXPECT_EQ(*TensorBytes(DType::kFloat32, {2, 3, 4}), 96);
}

TEST(TensorBytesTest, Errors) {
  EXPECT_THAT(TensorBytes(DType::kInvalid, {1}).status().message(),
              HasSubstr("invalid dtype 0"));
  EXPECT_THAT(TensorBytes(DType::kFloat32, {2, -3}).status().message(),
              HasSubstr("negative dimension -3"));
  const int64_t big = int64_t{1} << 31;
  EXPECT_THAT(TensorBytes(DType::kFloat32, {big, big}).status().message(),
              HasSubstr("tensor size float32 [2147483648, 2147483648] "
                        "overflows int64"));
  EXPECT_THAT(TensorBytes(DType::kInt64, {std::numeric_limits<int64_t>::max()})
                  .status()
                  .message(),
              HasSubstr("overflows int64"));
  // The largest that fits, and the next that does not.
  EXPECT_EQ(*TensorBytes(DType::kInt32, {int64_t{1} << 60}), int64_t{1} << 62);
  EXPECT_FALSE(TensorBytes(DType::kInt32, {int64_t{1} << 61}).ok());
}

TEST(StoredTensorBytesTest, OneOrTwoPositiveDimensions) {
  EXPECT_EQ(*StoredTensorBytes(DType::kFloat32, {3, 5}), 60);
  EXPECT_EQ(*StoredTensorBytes(DType::kInt32, {9}), 36);
  EXPECT_THAT(StoredTensorBytes(DType::kFloat32, {}).status().message(),
              HasSubstr("a tensor has 1 or 2 dimensions, got 0"));
  EXPECT_THAT(StoredTensorBytes(DType::kFloat32, {1, 2, 3}).status().message(),
              HasSubstr("got 3"));
  EXPECT_THAT(StoredTensorBytes(DType::kFloat32, {4, 0}).status().message(),
              HasSubstr("dimension 0 must be > 0"));
  EXPECT_THAT(StoredTensorBytes(DType::kFloat32, {-3}).status().message(),
              HasSubstr("dimension -3 must be > 0"));
  EXPECT_THAT(StoredTensorBytes(DType::kInvalid, {3}).status().message(),
              HasSubstr("invalid dtype"));
  // Checked in order: an overflow before a bad dimension is the overflow.
  const int64_t max = std::numeric_limits<int64_t>::max();
  EXPECT_THAT(StoredTensorBytes(DType::kFloat32, {max, -1}).status().message(),
              HasSubstr("overflows int64"));
}

TEST(StripeElementsTest, TilesEveryCount) {
  for (int64_t elements : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{1000},
                           std::numeric_limits<int64_t>::max()}) {
    for (int count = 1; count <= 64; ++count) {
      int64_t next = 0;
      for (int index = 0; index < count; ++index) {
        const ElementRange range = StripeElements(elements, index, count);
        ASSERT_EQ(range.first, next)
            << elements << " " << index << "/" << count;
        ASSERT_GE(range.end, range.first);
        // Sizes differ by at most one element.
        ASSERT_LE(range.end - range.first - elements / count, 1);
        next = range.end;
      }
      ASSERT_EQ(next, elements);
    }
  }
}

TEST(StripeElementsTest, IsFloorOfTheProportion) {
  // [floor(i * E / K), floor((i + 1) * E / K)) for small E, K.
  for (int64_t elements = 0; elements < 50; ++elements) {
    for (int count = 1; count < 9; ++count) {
      for (int index = 0; index < count; ++index) {
        const ElementRange range = StripeElements(elements, index, count);
        EXPECT_EQ(range.first, index * elements / count);
        EXPECT_EQ(range.end, (index + 1) * elements / count);
      }
    }
  }
}

}  // namespace
}  // namespace lossd
