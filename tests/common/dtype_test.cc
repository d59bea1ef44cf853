// common/dtype.h and common/loss_options.h: sizes, names and the values the
// proto's enums must match.
#include "common/dtype.h"

#include <gtest/gtest.h>

#include <string>

#include "common/loss_options.h"
#include "lossd/v1/lossd.pb.h"

namespace lossd {
namespace {

namespace pb = ::lossd::v1;

TEST(DTypeTest, SizesAndNames) {
  EXPECT_EQ(DTypeSize(DType::kFloat32), 4u);
  EXPECT_EQ(DTypeSize(DType::kBFloat16), 2u);
  EXPECT_EQ(DTypeSize(DType::kFloat16), 2u);
  EXPECT_EQ(DTypeSize(DType::kInt32), 4u);
  EXPECT_EQ(DTypeSize(DType::kInt64), 8u);
  EXPECT_EQ(DTypeSize(DType::kInvalid), 0u);
  EXPECT_EQ(DTypeSize(static_cast<DType>(99)), 0u);
  EXPECT_EQ(std::string(DTypeName(DType::kBFloat16)), "bfloat16");
  EXPECT_EQ(std::string(DTypeName(static_cast<DType>(-1))), "invalid");
  EXPECT_TRUE(IsLogitsDType(DType::kFloat16));
  EXPECT_FALSE(IsLogitsDType(DType::kInt32));
  EXPECT_TRUE(IsTargetsDType(DType::kInt64));
  EXPECT_FALSE(IsTargetsDType(DType::kFloat32));
}

TEST(DTypeTest, NumpyTypestrsAreLittleEndianAndBf16IsItsRawBits) {
  EXPECT_EQ(std::string(DTypeNumpyTypestr(DType::kFloat32)), "<f4");
  EXPECT_EQ(std::string(DTypeNumpyTypestr(DType::kFloat16)), "<f2");
  EXPECT_EQ(std::string(DTypeNumpyTypestr(DType::kBFloat16)), "<u2");
  EXPECT_EQ(std::string(DTypeNumpyTypestr(DType::kInt32)), "<i4");
  EXPECT_EQ(std::string(DTypeNumpyTypestr(DType::kInt64)), "<i8");
  EXPECT_EQ(DTypeNumpyTypestr(DType::kInvalid), nullptr);
  EXPECT_EQ(DTypeNumpyTypestr(static_cast<DType>(42)), nullptr);
}

TEST(DTypeTest, TensorStateNamesAreTheProtosWithoutPrefix) {
  EXPECT_EQ(std::string(TensorStateName(TensorState::kLogits)), "LOGITS");
  EXPECT_EQ(std::string(TensorStateName(TensorState::kGradient)), "GRADIENT");
  EXPECT_EQ(std::string(TensorStateName(TensorState::kUnspecified)),
            "UNSPECIFIED");
  EXPECT_EQ(
      pb::TensorState_Name(pb::TENSOR_STATE_LOGITS),
      std::string("TENSOR_STATE_") + TensorStateName(TensorState::kLogits));
}

TEST(DTypeTest, ProtoNamesAreTheProtosWithoutPrefix) {
  for (int value = pb::DTYPE_UNSPECIFIED; value <= pb::DTYPE_INT64; ++value) {
    EXPECT_EQ(
        pb::DType_Name(static_cast<pb::DType>(value)),
        std::string("DTYPE_") + DTypeProtoName(static_cast<DType>(value)));
  }
  EXPECT_EQ(std::string(DTypeProtoName(static_cast<DType>(99))), "UNSPECIFIED");
}

TEST(DTypeTest, ValuesMatchTheProto) {
  EXPECT_EQ(static_cast<int>(DType::kFloat32), pb::DTYPE_FLOAT32);
  EXPECT_EQ(static_cast<int>(DType::kBFloat16), pb::DTYPE_BFLOAT16);
  EXPECT_EQ(static_cast<int>(DType::kFloat16), pb::DTYPE_FLOAT16);
  EXPECT_EQ(static_cast<int>(DType::kInt32), pb::DTYPE_INT32);
  EXPECT_EQ(static_cast<int>(DType::kInt64), pb::DTYPE_INT64);
  EXPECT_EQ(static_cast<int>(TensorState::kGradient),
            pb::TENSOR_STATE_GRADIENT);
  EXPECT_EQ(static_cast<int>(Reduction::kMean), pb::REDUCTION_MEAN);
  EXPECT_EQ(static_cast<int>(Reduction::kNone), pb::REDUCTION_NONE);
  EXPECT_EQ(static_cast<int>(GradientMode::kOutOfPlace),
            pb::GRADIENT_MODE_OUT_OF_PLACE);
  EXPECT_EQ(static_cast<int>(GradientMode::kNone), pb::GRADIENT_MODE_NONE);
}

TEST(LossOptionsTest, DefaultsAreTorchs) {
  const CrossEntropyOptions options;
  EXPECT_EQ(options.ignore_index, -100);
  EXPECT_EQ(options.reduction, Reduction::kMean);
  EXPECT_EQ(options.label_smoothing, 0.0f);
  EXPECT_EQ(options.grad_scale, 1.0f);
}

}  // namespace
}  // namespace lossd
