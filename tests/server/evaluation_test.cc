// The evaluation engine's pure units: BlockOrderSum (block-order sums that do
// not depend on how many lanes carried the blocks) and ReduceEvaluation.
#include "server/evaluation.h"

#include <cstdint>
#include <vector>

#include "gtest/gtest.h"

namespace lossd {
namespace {

// A block whose sums are not exact in binary, so that the order of the adds
// shows in the bits.
EvaluationSums Block(int64_t number) {
  EvaluationSums sums;
  sums.loss = 0.1 * static_cast<double>(number + 1) + 1e-17 * number;
  sums.z_loss = 1.0 / static_cast<double>(number + 3);
  sums.weight = 1.0;
  sums.rows = number + 1;
  sums.valid_tokens = 1;
  sums.correct_tokens = number % 2;
  return sums;
}

EvaluationSums InOrder(int64_t blocks) {
  EvaluationSums total;
  for (int64_t b = 0; b < blocks; ++b) total.Add(Block(b));
  return total;
}

void ExpectSameBits(const EvaluationSums& a, const EvaluationSums& b) {
  EXPECT_EQ(a.loss, b.loss);
  EXPECT_EQ(a.z_loss, b.z_loss);
  EXPECT_EQ(a.weight, b.weight);
  EXPECT_EQ(a.rows, b.rows);
  EXPECT_EQ(a.valid_tokens, b.valid_tokens);
  EXPECT_EQ(a.correct_tokens, b.correct_tokens);
}

TEST(BlockOrderSumTest, OneLaneInOrderIsThePlainSum) {
  BlockOrderSum sum(1);
  for (int64_t b = 0; b < 10; ++b) ASSERT_TRUE(sum.Add(0, b, Block(b)).ok());
  ExpectSameBits(sum.Total(), InOrder(10));
}

TEST(BlockOrderSumTest, LanesArrivingOutOfStepGiveTheSameBits) {
  // Block b is frame b / 3 of lane b % 3; lane 2 sends all its frames first,
  // then lane 1, then lane 0.
  constexpr int kLanes = 3;
  constexpr int64_t kBlocks = 12;
  BlockOrderSum sum(kLanes);
  for (int lane = kLanes - 1; lane >= 0; --lane) {
    for (int64_t frame = 0; frame < kBlocks / kLanes; ++frame) {
      ASSERT_TRUE(sum.Add(lane, frame, Block(frame * kLanes + lane)).ok());
    }
  }
  ExpectSameBits(sum.Total(), InOrder(kBlocks));
}

TEST(BlockOrderSumTest, TotalAddsBlocksStillWaitingInTheirOrder) {
  // Lane 0 ended after one frame: lane 1's later frames wait, and Total adds
  // them after the blocks before them, in block order.
  BlockOrderSum sum(2);
  ASSERT_TRUE(sum.Add(1, 2, Block(5)).ok());
  ASSERT_TRUE(sum.Add(1, 1, Block(3)).ok());
  ASSERT_TRUE(sum.Add(1, 0, Block(1)).ok());
  ASSERT_TRUE(sum.Add(0, 0, Block(0)).ok());
  EvaluationSums expected;
  for (int64_t b : {0, 1, 3, 5}) expected.Add(Block(b));
  ExpectSameBits(sum.Total(), expected);
}

TEST(BlockOrderSumTest, ALaneTooFarAheadIsRefused) {
  BlockOrderSum sum(2);
  for (int64_t frame = 0; frame < static_cast<int64_t>(kMaxWaitingBlocks);
       ++frame) {
    ASSERT_TRUE(sum.Add(1, frame, EvaluationSums()).ok());
  }
  const absl::Status status =
      sum.Add(1, static_cast<int64_t>(kMaxWaitingBlocks), EvaluationSums());
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("data connection 1"), std::string::npos)
      << status;
  // The lane behind catches up: the waiting blocks join the sum.
  ASSERT_TRUE(sum.Add(0, 0, Block(0)).ok());
  EXPECT_EQ(sum.Total().rows, 1);
}

TEST(ReduceEvaluationTest, MeanDividesByTheValidWeightOrTheNormalizer) {
  EvaluationSums total;
  total.loss = 6.0;
  total.z_loss = 3.0;
  total.weight = 4.0;
  total.valid_tokens = 4;
  CrossEntropyOptions options;
  options.reduction = Reduction::kMean;
  EvaluationLoss mean = ReduceEvaluation(total, options);
  EXPECT_DOUBLE_EQ(mean.loss, 1.5);
  EXPECT_DOUBLE_EQ(mean.z_loss, 0.75);
  EXPECT_DOUBLE_EQ(mean.denominator, 4.0);
  options.normalizer = 2.0;
  mean = ReduceEvaluation(total, options);
  EXPECT_DOUBLE_EQ(mean.loss, 3.0);
  EXPECT_DOUBLE_EQ(mean.denominator, 2.0);
  options.reduction = Reduction::kSum;
  const EvaluationLoss sum = ReduceEvaluation(total, options);
  EXPECT_DOUBLE_EQ(sum.loss, 6.0);
  EXPECT_DOUBLE_EQ(sum.denominator, 0.0);
}

TEST(ReduceEvaluationTest, AMeanOverNoValidTargetIsZero) {
  CrossEntropyOptions options;
  options.reduction = Reduction::kMean;
  const EvaluationLoss mean = ReduceEvaluation(EvaluationSums(), options);
  EXPECT_EQ(mean.loss, 0.0);
  EXPECT_EQ(mean.denominator, 0.0);
}

}  // namespace
}  // namespace lossd
