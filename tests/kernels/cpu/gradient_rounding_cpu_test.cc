// The gradient's rounding promise on the CPU backend (docs/api.md
// "Precision") on the inputs where label smoothing's p_c A - eps w_c / V
// cancels: the fast path against the fp64 formula.
#include <cstdint>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cross_entropy_cpu.h"
#include "tests/kernels/gradient_rounding.h"

namespace lossd {
namespace {

using rounding_test::CheckRounding;
using rounding_test::MakeRoundingInputs;
using rounding_test::RoundingBound;
using rounding_test::RoundingCase;
using rounding_test::RoundingInputs;
using rounding_test::RoundingReport;

// The CPU's fp32 p_c A - eps w_c / V carries a few fp32 roundings of each
// term (exp within 1 ulp, 1 / sum, the products): the halves' bound of
// docs/api.md, 1/32 ulp and 2 fp32 roundings of the terms.
RoundingReport RunAndCheck(const RoundingCase& c) {
  const RoundingInputs in = MakeRoundingInputs(c);
  std::vector<uint8_t> grad(in.logits.size());
  CrossEntropyArgs a;
  a.rows = c.rows;
  a.vocab = c.vocab;
  a.row_stride = c.vocab;
  a.logits_dtype = c.dtype;
  a.logits = in.logits.data();
  a.targets_dtype = DType::kInt64;
  a.targets = in.targets.data();
  a.class_weights = c.weights ? in.weights.data() : nullptr;
  a.options = rounding_test::RoundingOptions(c);
  a.mode = GradientMode::kOutOfPlace;
  a.gradient = grad.data();
  CrossEntropyResult result;
  const absl::Status status = CrossEntropyCpu(a, &result);
  EXPECT_TRUE(status.ok()) << status;
  RoundingBound bound;
  bound.k = 2.0;
  const RoundingReport rep = CheckRounding(c, in, grad, bound);
  rounding_test::PrintRoundingReport(c.name, rep);
  EXPECT_EQ(rep.failures, 0) << rep.first_failures;
  return rep;
}

// A client's case: 256 x 128256 bf16, normal * 3, a quarter of the rows
// ignored, label smoothing 0.1, z-loss 1e-4, mean.
TEST(CpuGradientRoundingTest, LabelSmoothingBf16) {
  RoundingCase c;
  c.name = "bf16 256x128256 eps=0.1 z-loss";
  RunAndCheck(c);
}

TEST(CpuGradientRoundingTest, LabelSmoothingWeightsFp16) {
  RoundingCase c;
  c.name = "fp16 64x50257 eps=0.3 weights";
  c.rows = 64;
  c.vocab = 50257;
  c.dtype = DType::kFloat16;
  c.label_smoothing = 0.3f;
  c.weights = true;
  c.scale = 2.0;
  c.grad_scale = 5e5f;  // else the cancelling elements are fp16 zeros
  c.seed = 4;
  RunAndCheck(c);
}

}  // namespace
}  // namespace lossd
