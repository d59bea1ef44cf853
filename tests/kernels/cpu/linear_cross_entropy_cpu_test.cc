// Checks the CPU linear cross-entropy against the fp64 reference over every
// dtype, option and mode; micro-batch accumulation, repeatability, and the
// validation of bad inputs (nothing changed).
#include "kernels/cpu/linear_cross_entropy_cpu.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "absl/status/status.h"
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
// Issue 31: the cancellation predicate is asked before each chunk of rows
// (never inside one): the call stops with CANCELLED at the first chunk
// boundary after it turns true, having written only the chunks before it.
TEST(LinearCrossEntropyCpuTest, CancelledStopsAtAChunkBoundary) {
  // 2048 fp32 logits a row: 4096 rows a 32 MiB chunk, so 3 chunks.
  Case c;
  c.rows = 3 * 4096;
  c.hidden = 4;
  c.vocab = 2048;
  c.dx_mode = GradientMode::kOutOfPlace;
  for (int stop_after : {0, 1, 2}) {
    SCOPED_TRACE(stop_after);
    Problem p(c);
    const std::vector<uint8_t> poisoned = p.dx;
    int asked = 0;
    LinearCrossEntropyArgs args = p.Args();
    args.cancelled = [&asked, stop_after] { return asked++ >= stop_after; };
    CrossEntropyResult result;
    const absl::Status status = LinearCrossEntropyCpu(args, &result);
    EXPECT_EQ(status.code(), absl::StatusCode::kCancelled) << status;
    EXPECT_EQ(asked, stop_after + 1);
    // dX of the chunks done is written, of the others not.
    const size_t chunk_bytes = size_t{4096} * c.hidden * 4;
    for (int chunk = 0; chunk < 3; ++chunk) {
      const bool same = std::equal(p.dx.begin() + chunk * chunk_bytes,
                                   p.dx.begin() + (chunk + 1) * chunk_bytes,
                                   poisoned.begin() + chunk * chunk_bytes);
      EXPECT_EQ(same, chunk >= stop_after) << "chunk " << chunk;
    }
  }
  // Never true: the call runs to the end, asking once a chunk.
  Problem p(c);
  int asked = 0;
  LinearCrossEntropyArgs args = p.Args();
  args.cancelled = [&asked] {
    ++asked;
    return false;
  };
  CrossEntropyResult result;
  ASSERT_TRUE(LinearCrossEntropyCpu(args, &result).ok());
  EXPECT_EQ(asked, 3);
}

// The workspace a caller charges before the call: the chunk of fp32 logits,
// dX's fp32 chunk, 16-bit rows converted to fp32, the bias and its sums.
TEST(LinearCrossEntropyCpuTest, WorkspaceBytesFollowTheChunks) {
  Case c;
  c.rows = 3 * 4096;
  c.hidden = 4;
  c.vocab = 2048;
  Problem p(c);
  LinearCrossEntropyArgs args = p.Args();
  args.dx_mode = GradientMode::kNone;
  args.dx = nullptr;
  EXPECT_EQ(LinearCrossEntropyCpuWorkspaceBytes(args), int64_t{32} << 20);
  args.dx_mode = GradientMode::kOutOfPlace;
  EXPECT_EQ(LinearCrossEntropyCpuWorkspaceBytes(args),
            (int64_t{32} << 20) + 4096 * 4 * 4);
  args.dtype = DType::kBFloat16;
  EXPECT_EQ(LinearCrossEntropyCpuWorkspaceBytes(args),
            (int64_t{32} << 20) + 2 * 4096 * 4 * 4 + 2048 * 4 * 4);
  // Few rows: one chunk of those rows.
  args.rows = 3;
  args.dtype = DType::kFloat32;
  EXPECT_EQ(LinearCrossEntropyCpuWorkspaceBytes(args), (3 * 2048 + 3 * 4) * 4);
}

}  // namespace lossd
