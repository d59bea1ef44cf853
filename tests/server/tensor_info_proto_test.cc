// ToProto of a TensorRecord (server/tensor_info_proto.h) alone: what
// Describe, List, Upload and Backward answer with, field by field, and the
// timestamps' split into seconds and non-negative nanoseconds, which a time
// before 1970 would otherwise get wrong.
#include "server/tensor_info_proto.h"

#include "absl/time/time.h"
#include "gtest/gtest.h"

namespace lossd {
namespace {

namespace pb = ::lossd::v1;

TensorRecord Record() {
  TensorRecord record;
  record.handle = "t-1";
  record.tenant = "alice";
  record.label = "logits/step-3";
  record.device = "cuda:0";
  record.dtype = DType::kBFloat16;
  record.shape = {4, 32000};
  record.bytes = 4 * 32000 * 2;
  record.state = TensorState::kGradient;
  record.created = absl::FromUnixNanos(1700000000123456789);
  record.last_used = absl::FromUnixNanos(1700000001000000000);
  record.pending_scale = 0.25;
  record.pending_token_scale = true;
  return record;
}

TEST(TensorInfoProtoTest, EveryFieldCarriesOver) {
  pb::TensorInfo info;
  ToProto(Record(), &info);
  EXPECT_EQ(info.handle(), "t-1");
  EXPECT_EQ(info.tenant(), "alice");
  EXPECT_EQ(info.label(), "logits/step-3");
  EXPECT_EQ(info.device(), "cuda:0");
  EXPECT_EQ(info.dtype(), pb::DTYPE_BFLOAT16);
  ASSERT_EQ(info.shape_size(), 2);
  EXPECT_EQ(info.shape(0), 4);
  EXPECT_EQ(info.shape(1), 32000);
  EXPECT_EQ(info.bytes(), 4 * 32000 * 2);
  EXPECT_EQ(info.state(), pb::TENSOR_STATE_GRADIENT);
  EXPECT_EQ(info.created().seconds(), 1700000000);
  EXPECT_EQ(info.created().nanos(), 123456789);
  EXPECT_EQ(info.last_used().seconds(), 1700000001);
  EXPECT_EQ(info.last_used().nanos(), 0);
  EXPECT_EQ(info.pending_scale(), 0.25);
  EXPECT_TRUE(info.pending_token_scale());
}

// google.protobuf.Timestamp keeps nanos in [0, 1e9): 1.5 s before the epoch
// is seconds -2 plus 0.5 s, not seconds -1 and nanos -5e8.
TEST(TensorInfoProtoTest, TimesBeforeTheEpochKeepNanosNonNegative) {
  TensorRecord record = Record();
  record.created = absl::FromUnixNanos(-1500000000);
  record.last_used = absl::FromUnixNanos(-2000000000);
  pb::TensorInfo info;
  ToProto(record, &info);
  EXPECT_EQ(info.created().seconds(), -2);
  EXPECT_EQ(info.created().nanos(), 500000000);
  EXPECT_EQ(info.last_used().seconds(), -2);
  EXPECT_EQ(info.last_used().nanos(), 0);
}

}  // namespace
}  // namespace lossd
