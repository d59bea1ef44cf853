// What every post-training backend shares (kernels/post_training_plan.h): the
// plan from the targets and segment ids, the row-order reduction and the row
// slicing, tested alone, linked without either backend.
#include "kernels/post_training_plan.h"

#include <cstdint>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"

namespace lossd {
namespace {

constexpr int64_t kIgnore = -100;

// Four rows, the second ignored, in segments {0, 0, 1, 1} of three (the
// third empty).
struct FourRows {
  std::vector<int64_t> targets = {0, kIgnore, 1, 2};
  std::vector<int32_t> ids = {0, 0, 1, 1};
  SegmentArgs segments;
  PostTrainingArgs args;

  explicit FourRows(SegmentReduction reduction) {
    args.base.rows = 4;
    args.base.vocab = 3;
    args.base.targets = targets.data();
    args.base.targets_dtype = DType::kInt64;
    args.base.options.ignore_index = kIgnore;
    args.base.options.reduction = Reduction::kMean;
    segments.ids = ids.data();
    segments.count = 3;
    segments.reduction = reduction;
    args.segments = &segments;
  }
};

TEST(PostTrainingPlanTest, RowsCountUnlessTheirTargetIsIgnored) {
  FourRows rows(SegmentReduction::kNone);
  EXPECT_TRUE(PostTrainingRowIsValid(rows.args, 0));
  EXPECT_FALSE(PostTrainingRowIsValid(rows.args, 1));
  rows.args.base.targets = nullptr;  // an alpha-0 distillation: every row
  EXPECT_TRUE(PostTrainingRowIsValid(rows.args, 1));
}

TEST(PostTrainingPlanTest, ASequenceMeanOfTokenMeansWeighsEachSegmentOnce) {
  FourRows rows(SegmentReduction::kSeqMeanTokenMean);
  const PostTrainingPlan plan = PlanPostTraining(rows.args);
  EXPECT_EQ(plan.valid_tokens, 3);
  EXPECT_EQ(plan.segment_tokens, (std::vector<int64_t>{1, 2, 0}));
  EXPECT_EQ(plan.nonempty_segments, 2);
  EXPECT_EQ(plan.denominator, 2.0);
  EXPECT_TRUE(plan.have_denominator);
  EXPECT_EQ(plan.row_scale, (std::vector<double>{0.5, 0.0, 0.25, 0.25}));

  std::vector<PostTrainingRowTotals> totals(4);
  const double losses[] = {1.0, 100.0, 2.0, 4.0};
  for (int row = 0; row < 4; ++row) {
    totals[row].valid = row != 1;
    totals[row].loss = losses[row];
    totals[row].correct = row == 2;
  }
  const PostTrainingResult result =
      ReducePostTrainingRows(rows.args, plan, totals);
  // (1 / 1 + (2 + 4) / 2) / 2 segments; the ignored row adds nothing.
  EXPECT_EQ(result.base.loss, 2.0);
  EXPECT_EQ(result.base.denominator, 2.0);
  EXPECT_EQ(result.base.valid_tokens, 3);
  EXPECT_EQ(result.base.correct_tokens, 1);
  EXPECT_EQ(result.segment_loss, (std::vector<double>{1.0, 6.0, 0.0}));
}

TEST(PostTrainingPlanTest, AMeanOverTokensWithoutSegmentsTakesTheNormalizer) {
  FourRows rows(SegmentReduction::kNone);
  rows.args.segments = nullptr;
  rows.args.base.options.normalizer = 8.0;
  const PostTrainingPlan plan = PlanPostTraining(rows.args);
  EXPECT_EQ(plan.denominator, 8.0);
  EXPECT_EQ(plan.row_scale, (std::vector<double>{0.125, 0.0, 0.125, 0.125}));
}

// The sums' end (a device reduction's) against the row-order reduction of
// the same rows: equal to rounding, for a mean, a normalizer, a sum and no
// valid rows at all.
TEST(PostTrainingPlanTest, FinishingUnsegmentedSumsMatchesTheRowReduction) {
  for (const auto& [reduction, normalizer, ignored] :
       {std::tuple<Reduction, double, bool>{Reduction::kMean, 0.0, false},
        {Reduction::kMean, 8.0, false},
        {Reduction::kSum, 0.0, false},
        {Reduction::kMean, 0.0, true},
        {Reduction::kMean, 8.0, true}}) {
    FourRows rows(SegmentReduction::kNone);
    rows.args.segments = nullptr;
    rows.args.base.options.reduction = reduction;
    rows.args.base.options.normalizer = normalizer;
    if (ignored) rows.targets.assign(4, kIgnore);
    std::vector<PostTrainingRowTotals> totals(4);
    PostTrainingSums sums;
    for (int row = 0; row < 4; ++row) {
      PostTrainingRowTotals& t = totals[row];
      t.valid = PostTrainingRowIsValid(rows.args, row);
      t.loss = 1.5 + row;
      t.distillation = 0.25 * row;
      t.correct = row % 2 == 0;
      t.clipped = row == 3;
      t.ratio = 1.0 + 0.1 * row;
      t.approx_kl = 0.01 * row;
      t.kl = 0.02 * row;
      t.entropy = 2.0 + row;
      t.z_loss = 0.001 * row;
      if (!t.valid) continue;
      ++sums.valid_tokens;
      sums.correct_tokens += t.correct;
      sums.clipped_tokens += t.clipped;
      sums.loss += t.loss;
      sums.distillation += t.distillation;
      sums.ratio += t.ratio;
      sums.approx_kl += t.approx_kl;
      sums.kl += t.kl;
      sums.entropy += t.entropy;
      sums.z_loss += t.z_loss;
    }
    const PostTrainingResult want =
        ReducePostTrainingRows(rows.args, PlanPostTraining(rows.args), totals);
    const PostTrainingResult got =
        FinishUnsegmentedPostTraining(rows.args.base.options, sums);
    EXPECT_EQ(got.base.valid_tokens, want.base.valid_tokens);
    EXPECT_EQ(got.base.correct_tokens, want.base.correct_tokens);
    EXPECT_EQ(got.policy.clipped_tokens, want.policy.clipped_tokens);
    EXPECT_EQ(got.base.denominator, want.base.denominator);
    EXPECT_DOUBLE_EQ(got.base.loss, want.base.loss);
    EXPECT_DOUBLE_EQ(got.distillation_loss, want.distillation_loss);
    EXPECT_DOUBLE_EQ(got.base.z_loss, want.base.z_loss);
    EXPECT_DOUBLE_EQ(got.policy.ratio_sum, want.policy.ratio_sum);
    EXPECT_DOUBLE_EQ(got.policy.entropy_sum, want.policy.entropy_sum);
    EXPECT_TRUE(got.segment_tokens.empty());
  }
}

TEST(SlicePostTrainingRowsTest, OffsetsEveryRowIndexedInputAndOutput) {
  FourRows rows(SegmentReduction::kSeqMeanTokenSum);
  std::vector<float> advantages(4), sampling(4), token_loss(4), ratio(4);
  PolicyArgs policy;
  policy.advantages = advantages.data();
  policy.sampling_logprobs = sampling.data();
  rows.args.policy = &policy;
  rows.args.base.token_loss = token_loss.data();
  rows.args.token_ratio = ratio.data();
  std::vector<float> chunk_logits(2 * 3);
  PostTrainingChunk chunk;
  SlicePostTrainingRows(rows.args, 2, 2, chunk_logits.data(), DType::kFloat32,
                        /*gradient=*/true, &chunk);
  const PostTrainingArgs& sliced = chunk.args;
  EXPECT_EQ(sliced.base.rows, 2);
  EXPECT_EQ(sliced.base.row_stride, 3);
  EXPECT_EQ(sliced.base.logits, chunk_logits.data());
  EXPECT_EQ(sliced.base.gradient, chunk_logits.data());
  EXPECT_EQ(sliced.base.mode, GradientMode::kInPlace);
  EXPECT_EQ(sliced.base.targets, rows.targets.data() + 2);
  EXPECT_EQ(sliced.base.token_loss, token_loss.data() + 2);
  EXPECT_EQ(sliced.token_ratio, ratio.data() + 2);
  EXPECT_EQ(sliced.token_entropy, nullptr);
  ASSERT_EQ(sliced.policy, &chunk.policy);
  EXPECT_EQ(sliced.policy->advantages, advantages.data() + 2);
  EXPECT_EQ(sliced.policy->reference_logprobs, nullptr);
  ASSERT_EQ(sliced.segments, &chunk.segments);
  EXPECT_EQ(sliced.segments->ids, rows.ids.data() + 2);
  EXPECT_EQ(sliced.segments->count, 3);
  EXPECT_EQ(sliced.distillation, nullptr);
}

}  // namespace
}  // namespace lossd
