// Checks the CPU linear cross-entropy against the fp64 reference over every
// dtype, option and mode; micro-batch accumulation, repeatability, and the
// validation of bad inputs (nothing changed).
#include "kernels/cpu/linear_cross_entropy_cpu.h"

#include <cstring>
#include <vector>

#include "gtest/gtest.h"
#include "tests/kernels/linear_cross_entropy_test_util.h"

namespace lossd {
namespace {

using linear_test::Case;
using linear_test::CheckCase;
using linear_test::Problem;

const linear_test::Runner kCpu = LinearCrossEntropyCpu;

TEST(LinearCrossEntropyCpuTest, MatchesFp64ReferenceOverTheSweep) {
  for (const Case& c : linear_test::SweepCases()) {
    CheckCase(c, kCpu, linear_test::Tolerance());
  }
}

TEST(LinearCrossEntropyCpuTest, LargeVocabSpansSeveralChunksAndBlocks) {
  // 50257 fp32 logits a row: 166 rows a 32 MiB chunk, so 200 rows are two
  // chunks, and W [50257, 48] is converted in several blocks.
  Case c;
  c.rows = 200;
  c.hidden = 48;
  c.vocab = 50257;
  c.dtype = DType::kBFloat16;
  c.bias = true;
  c.grad_bias = true;
  c.token_outputs = true;
  c.dx_mode = GradientMode::kInPlace;
  c.options.label_smoothing = 0.1f;
  c.options.z_loss_scale = 1e-4f;
  CheckCase(c, kCpu, linear_test::Tolerance());
}

TEST(LinearCrossEntropyCpuTest, FourMicroBatchesEqualOneBatch) {
  Case c;
  c.rows = 64;
  c.hidden = 32;
  c.vocab = 301;
  c.dtype = DType::kBFloat16;
  c.bias = true;
  c.grad_bias = true;
  c.dx_mode = GradientMode::kOutOfPlace;
  c.accumulate = AccumulateMode::kOverwrite;
  c.options.label_smoothing = 0.1f;
  Problem whole(c);
  CrossEntropyResult whole_result;
  ASSERT_TRUE(LinearCrossEntropyCpu(whole.Args(), &whole_result).ok());

  // The same rows as 4 calls of 16 with the whole batch's normalizer and
  // grad_scale 1 (mean over the batch), dW added to.
  Problem parts(c);
  const absl::StatusOr<double> loss =
      linear_test::RunMicroBatches(&parts, 4, whole_result.denominator, kCpu);
  ASSERT_TRUE(loss.ok()) << loss.status();
  EXPECT_NEAR(*loss, whole_result.loss, 1e-6 * std::fabs(whole_result.loss));
  for (int64_t i = 0; i < c.rows * c.hidden; ++i) {
    // Rows are independent; bf16 dX may differ by one rounding at most.
    const float a = linear_test::Decode(parts.dx, c.dtype, i);
    const float b = linear_test::Decode(whole.dx, c.dtype, i);
    EXPECT_NEAR(a, b, 8e-3f * std::fabs(b) + 1e-7f) << i;
  }
  linear_test::ExpectSameWeightGradients(parts, whole);
}

TEST(LinearCrossEntropyCpuTest, RepeatsBitForBit) {
  Case c;
  c.rows = 200;
  c.hidden = 48;
  c.vocab = 1001;
  c.dtype = DType::kFloat16;
  c.bias = true;
  c.grad_bias = true;
  c.class_weights = true;
  c.options.z_loss_scale = 1e-3f;
  Problem first(c), second(c);
  CrossEntropyResult r1, r2;
  ASSERT_TRUE(LinearCrossEntropyCpu(first.Args(), &r1).ok());
  ASSERT_TRUE(LinearCrossEntropyCpu(second.Args(), &r2).ok());
  linear_test::ExpectSameBits(first, r1, second, r2);
}

TEST(LinearCrossEntropyCpuTest, OverwriteWithNoRowsZeroesTheAccumulator) {
  Case c;
  c.rows = 0;
  c.accumulate = AccumulateMode::kOverwrite;
  c.bias = true;
  c.grad_bias = true;
  Problem p(c);
  CrossEntropyResult r;
  ASSERT_TRUE(LinearCrossEntropyCpu(p.Args(), &r).ok());
  for (float v : p.grad_weight) EXPECT_EQ(v, 0.0f);
  for (float v : p.grad_bias) EXPECT_EQ(v, 0.0f);
  EXPECT_EQ(r.loss, 0.0);
}

// Each bad input is INVALID_ARGUMENT and leaves every buffer as it was.
TEST(LinearCrossEntropyCpuTest, BadInputsChangeNothing) {
  Case c;
  c.rows = 9;
  c.hidden = 6;
  c.vocab = 11;
  c.dtype = DType::kBFloat16;
  c.bias = true;
  c.grad_bias = true;
  c.dx_mode = GradientMode::kInPlace;
  struct Bad {
    const char* what;
    std::function<void(LinearCrossEntropyArgs*, Problem*)> spoil;
  };
  const std::vector<Bad> bads = {
      {"H mismatch", [](LinearCrossEntropyArgs* a,
                        Problem*) { a->weight_hidden = a->hidden + 1; }},
      {"dtype mismatch", [](LinearCrossEntropyArgs* a,
                            Problem*) { a->weight_dtype = DType::kFloat16; }},
      {"bias dtype mismatch",
       [](LinearCrossEntropyArgs* a, Problem*) {
         a->bias_dtype = DType::kFloat32;
       }},
      {"accumulator shape",
       [](LinearCrossEntropyArgs* a, Problem*) {
         a->grad_weight_rows = a->vocab;
         a->grad_weight_cols = a->hidden - 1;
       }},
      {"bias accumulator size",
       [](LinearCrossEntropyArgs* a, Problem*) {
         a->grad_bias_size = a->vocab + 1;
       }},
      {"target out of range",
       [](LinearCrossEntropyArgs*, Problem* p) { p->targets64[8] = 11; }},
      {"negative target",
       [](LinearCrossEntropyArgs*, Problem* p) { p->targets64[3] = -3; }},
      {"no grad_weight",
       [](LinearCrossEntropyArgs* a, Problem*) { a->grad_weight = nullptr; }},
      {"in-place dx elsewhere",
       [](LinearCrossEntropyArgs* a, Problem* p) { a->dx = p->weight.data(); }},
      {"none without token_grad_output",
       [](LinearCrossEntropyArgs* a, Problem*) {
         a->options.reduction = Reduction::kNone;
       }},
      {"token_grad_output with mean",
       [](LinearCrossEntropyArgs* a, Problem* p) {
         a->token_grad_output = reinterpret_cast<const float*>(p->x.data());
       }},
      {"label_smoothing", [](LinearCrossEntropyArgs* a,
                             Problem*) { a->options.label_smoothing = 2.0f; }},
      {"vocab 0", [](LinearCrossEntropyArgs* a, Problem*) { a->vocab = 0; }},
  };
  for (const Bad& bad : bads) {
    SCOPED_TRACE(bad.what);
    Problem p(c);
    LinearCrossEntropyArgs a = p.Args();
    bad.spoil(&a, &p);
    const std::vector<uint8_t> x = p.x;
    const std::vector<float> gw = p.grad_weight, gb = p.grad_bias;
    CrossEntropyResult r;
    const absl::Status status = LinearCrossEntropyCpu(a, &r);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_EQ(p.x, x);
    EXPECT_EQ(0, std::memcmp(p.grad_weight.data(), gw.data(),
                             gw.size() * sizeof(float)));
    EXPECT_EQ(0, std::memcmp(p.grad_bias.data(), gb.data(),
                             gb.size() * sizeof(float)));
  }
  Problem p(c);
  EXPECT_EQ(LinearCrossEntropyCpu(p.Args(), nullptr).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace lossd
