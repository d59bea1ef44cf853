// What both linear cross-entropy backends share: the argument checks, the
// chunk options that give every chunk the whole call's denominator, and the
// chunk results' sum.
#include "kernels/linear_cross_entropy_validate.h"

#include <cstdint>
#include <vector>

#include "gtest/gtest.h"

namespace lossd {
namespace {

TEST(LinearChunkOptionsTest, AMeanWithoutNormalizerTakesTheCallsWeight) {
  CrossEntropyOptions options;
  options.reduction = Reduction::kMean;
  EXPECT_EQ(LinearChunkOptions(options, 12.5).normalizer, 12.5);
  // No valid target: the chunks keep their own (empty) means.
  EXPECT_EQ(LinearChunkOptions(options, 0.0).normalizer, 0.0);
  options.normalizer = 3.0;
  EXPECT_EQ(LinearChunkOptions(options, 12.5).normalizer, 3.0);
  options.normalizer = 0.0;
  options.reduction = Reduction::kSum;
  EXPECT_EQ(LinearChunkOptions(options, 12.5).normalizer, 0.0);
}

TEST(AddChunkResultTest, SumsCountsAndKeepsTheLastDenominator) {
  CrossEntropyResult total;
  CrossEntropyResult chunk;
  chunk.loss = 1.5;
  chunk.z_loss = 0.25;
  chunk.valid_tokens = 3;
  chunk.correct_tokens = 1;
  chunk.nonfinite_rows = 1;
  chunk.denominator = 8.0;
  AddChunkResult(chunk, &total);
  chunk.denominator = 0.0;  // a chunk with no valid row
  AddChunkResult(chunk, &total);
  EXPECT_EQ(total.loss, 3.0);
  EXPECT_EQ(total.z_loss, 0.5);
  EXPECT_EQ(total.valid_tokens, 6);
  EXPECT_EQ(total.correct_tokens, 2);
  EXPECT_EQ(total.nonfinite_rows, 2);
  EXPECT_EQ(total.denominator, 8.0);
}

// A valid problem of 2 rows, hidden 4, vocab 5, dX in place and dW added.
struct Problem {
  std::vector<float> x = std::vector<float>(8);
  std::vector<float> weight = std::vector<float>(20);
  std::vector<int64_t> targets = {1, 4};
  std::vector<float> grad_weight = std::vector<float>(20);
  LinearCrossEntropyArgs args;
  Problem() {
    args.rows = 2;
    args.hidden = 4;
    args.vocab = 5;
    args.dtype = DType::kFloat32;
    args.x = x.data();
    args.weight = weight.data();
    args.targets_dtype = DType::kInt64;
    args.targets = targets.data();
    args.dx_mode = GradientMode::kInPlace;
    args.dx = x.data();
    args.accumulate = AccumulateMode::kAdd;
    args.grad_weight = grad_weight.data();
  }
};

TEST(ValidateLinearCrossEntropyArgsTest, AcceptsAValidProblem) {
  Problem problem;
  EXPECT_TRUE(ValidateLinearCrossEntropyArgs(problem.args).ok());
  EXPECT_TRUE(LinearCrossEntropyWantsGradient(problem.args));
  problem.args.dx_mode = GradientMode::kNone;
  problem.args.dx = nullptr;
  problem.args.accumulate = AccumulateMode::kNone;
  problem.args.grad_weight = nullptr;
  EXPECT_TRUE(ValidateLinearCrossEntropyArgs(problem.args).ok());
  EXPECT_FALSE(LinearCrossEntropyWantsGradient(problem.args));
}

TEST(ValidateLinearCrossEntropyArgsTest, NamesEachBadFieldAndItsStep) {
  struct Bad {
    const char* message;
    void (*spoil)(LinearCrossEntropyArgs*);
  };
  const Bad cases[] = {
      {"hidden must be", [](LinearCrossEntropyArgs* a) { a->hidden = 0; }},
      {"weight has hidden size",
       [](LinearCrossEntropyArgs* a) { a->weight_hidden = 3; }},
      {"in-place dx must equal x",
       [](LinearCrossEntropyArgs* a) { a->dx = nullptr; }},
      {"grad_weight is nullptr",
       [](LinearCrossEntropyArgs* a) { a->grad_weight = nullptr; }},
      {"token_grad_output is only for reduction none",
       [](LinearCrossEntropyArgs* a) {
         static const float factors[2] = {1.0f, 1.0f};
         a->token_grad_output = factors;
       }},
      {"label_smoothing",
       [](LinearCrossEntropyArgs* a) { a->options.label_smoothing = 2.0f; }},
  };
  for (const Bad& bad : cases) {
    Problem problem;
    bad.spoil(&problem.args);
    const absl::Status status = ValidateLinearCrossEntropyArgs(problem.args);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << bad.message;
    EXPECT_NE(status.message().find("linear_cross_entropy: "),
              std::string::npos)
        << status;
    EXPECT_NE(status.message().find(bad.message), std::string::npos) << status;
  }
}

}  // namespace
}  // namespace lossd
