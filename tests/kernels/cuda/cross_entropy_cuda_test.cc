// Checks the CUDA cross-entropy against the fp64 CPU reference on seeded random
// inputs over awkward shapes, every option and mode, and its edges (bad
// arguments, determinism, N * V >= 2^32); skipped without a GPU.
#include "kernels/cuda/cross_entropy_cuda.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/kernels/cuda/cross_entropy_cuda_test_util.h"

namespace lossd {
namespace cuda_ce_test {
namespace {

TEST_F(CudaCrossEntropyTest, Shapes) {
  std::vector<Case> cases;
  cases.push_back(Make("V=1", 5, 1, DType::kFloat32));
  cases.push_back(Make("V=7 bf16", 33, 7, DType::kBFloat16));
  cases.push_back(Make("V=8 fp32 cluster", 3, 8, DType::kFloat32));
  cases.push_back(Make("V=50257 unaligned", 24, 50257, DType::kFloat32));
  cases.push_back(Make("V=50257 padded bf16", 24, 50257, DType::kBFloat16));
  cases.back().pad = 47;
  cases.push_back(Make("V=128256 bf16", 40, 128256, DType::kBFloat16));
  cases.push_back(Make("V=128256 fp32", 16, 128256, DType::kFloat32));
  cases.push_back(Make("V=262144 fp32", 12, 262144, DType::kFloat32));
  cases.push_back(Make("V=262144 bf16", 12, 262144, DType::kBFloat16));
  cases.push_back(Make("V=131072 fp16", 8, 131072, DType::kFloat16));
  cases.push_back(Make("N=16384 V=1000 fp16", 16384, 1000, DType::kFloat16));
  cases.push_back(Make("N=1 V=32000", 1, 32000, DType::kBFloat16));
  uint32_t seed = 1;
  for (Case& c : cases) {
    c.ignore_fraction = 0.2;
    c.targets_dtype = (seed % 2) ? DType::kInt32 : DType::kInt64;
    c.mode =
        (seed % 3 == 0) ? GradientMode::kOutOfPlace : GradientMode::kInPlace;
    CheckCase(c, seed++);
  }
}

TEST_F(CudaCrossEntropyTest, EveryPathConfigAgrees) {
  uint32_t seed = 100;
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    for (int vpt : {1, 2, 4, 8, 16}) {
      Case c = Make(absl::StrCat("vpt=", vpt), 9, 20000, dtype);
      c.config.schedule = CrossEntropyCudaSchedule::kClusterRegisterRows;
      c.config.vectors_per_thread = vpt;
      c.ignore_fraction = 0.3;
      // 20000 needs more than 16 blocks at vpt=1 (fp32): the generic path.
      CheckCase(c, seed++);
    }
    Case g = Make("generic", 9, 20000, dtype);
    g.config.schedule = CrossEntropyCudaSchedule::kGenericRows;
    CheckCase(g, seed++);
  }
}

TEST_F(CudaCrossEntropyTest, Options) {
  std::vector<Case> cases;
  {
    Case c = Make("all ignored", 16, 4096, DType::kBFloat16);
    c.ignore_fraction = 1.0;
    cases.push_back(c);
  }
  {
    Case c = Make("all ignored, no token outputs", 16, 4096, DType::kFloat32);
    c.ignore_fraction = 1.0;
    c.token_outputs = false;
    cases.push_back(c);
  }
  {
    Case c = Make("ignore_index inside vocab", 64, 512, DType::kFloat32);
    c.options.ignore_index = 3;
    c.ignore_fraction = 0.3;
    cases.push_back(c);
  }
  {
    Case c = Make("p_y -> 1 bf16", 32, 32000, DType::kBFloat16);
    c.logits = Logits::kTargetDominant;
    cases.push_back(c);
  }
  for (DType d : {DType::kFloat32, DType::kBFloat16}) {
    // fp32 lse of |z| ~ 1e4 carries an absolute error of ~5e-4, so p does too.
    Case c = Make("logits +-1e4", 32, 32768, d);
    c.logits = Logits::kHuge;
    c.grad_norm_rtol = 1e-3;
    c.grad_rtol = 2e-2;
    c.loss_rtol = 1e-5;
    cases.push_back(c);
  }
  for (DType d : {DType::kFloat32, DType::kBFloat16}) {
    Case c = Make("softcap", 24, 40000, d);
    c.options.softcap = 3.0f;
    c.exact_argmax = false;  // tanh in fp32 vs fp64 can reorder near-ties
    c.ignore_fraction = 0.1;
    cases.push_back(c);
  }
  for (DType d : {DType::kFloat32, DType::kBFloat16}) {
    Case c = Make("weights + label smoothing", 24, 40000, d);
    c.weights = true;
    c.options.label_smoothing = 0.1f;
    c.ignore_fraction = 0.1;
    c.loss_rtol = 5e-5;
    cases.push_back(c);
  }
  {
    Case c = Make("smoothing, unaligned", 24, 5001, DType::kFloat32);
    c.options.label_smoothing = 0.2f;
    c.loss_rtol = 5e-5;
    cases.push_back(c);
  }
  {
    Case c = Make("z-loss, sum, grad_scale", 24, 32000, DType::kFloat32);
    c.options.z_loss_scale = 1e-3f;
    c.options.reduction = Reduction::kSum;
    c.options.grad_scale = 0.5f;
    cases.push_back(c);
  }
  {
    Case c = Make("none reduction, forward only", 40, 32000, DType::kBFloat16);
    c.options.reduction = Reduction::kNone;
    c.mode = GradientMode::kNone;
    cases.push_back(c);
  }
  {
    Case c = Make("normalizer, out of place", 40, 32000, DType::kFloat16);
    c.options.normalizer = 1000.0;
    c.mode = GradientMode::kOutOfPlace;
    c.ignore_fraction = 0.5;
    cases.push_back(c);
  }
  {
    Case c = Make("everything", 20, 30001, DType::kBFloat16);
    c.pad = 15;
    c.weights = true;
    c.options.label_smoothing = 0.05f;
    c.options.z_loss_scale = 1e-4f;
    c.options.softcap = 15.0f;
    c.options.grad_scale = 3.0f;
    c.ignore_fraction = 0.25;
    c.exact_argmax = false;
    c.loss_rtol = 5e-5;
    c.mode = GradientMode::kOutOfPlace;
    cases.push_back(c);
  }
  uint32_t seed = 200;
  for (const Case& c : cases) CheckCase(c, seed++);
}

TEST_F(CudaCrossEntropyTest, TargetGradientKeepsItsDigitsWhenPyNearOne) {
  Case c = Make("p_y -> 1", 4, 32000, DType::kBFloat16);
  c.logits = Logits::kTargetDominant;
  c.options.reduction = Reduction::kSum;
  const Inputs in = MakeInputs(c, 7);
  const Outputs gpu = RunGpu(c, in);
  ASSERT_TRUE(gpu.status.ok()) << gpu.status;
  const Outputs ref = RunReference(c, in, 0, c.rows);
  for (int64_t r = 0; r < c.rows; ++r) {
    int64_t y;
    std::memcpy(&y, in.targets.data() + 8 * r, 8);
    const float g = ToFloat(gpu.gradient, c.dtype, r * c.vocab + y);
    const float want = ToFloat(ref.gradient, c.dtype, r * c.vocab + y);
    ASSERT_LT(want, 0.0f);
    EXPECT_NEAR(g, want, std::fabs(want) / 100) << "row " << r;
  }
}

TEST_F(CudaCrossEntropyTest, BitwiseDeterministic) {
  for (DType d : {DType::kFloat32, DType::kBFloat16}) {
    Case c = Make("determinism", 256, 128256, d);
    c.ignore_fraction = 0.1;
    c.mode = GradientMode::kOutOfPlace;
    const Inputs in = MakeInputs(c, 300);
    const Outputs first = RunGpu(c, in);
    ASSERT_TRUE(first.status.ok());
    for (int i = 0; i < 3; ++i) {
      const Outputs again = RunGpu(c, in);
      ASSERT_TRUE(again.status.ok());
      EXPECT_EQ(std::memcmp(&again.result.loss, &first.result.loss, 8), 0);
      EXPECT_EQ(again.result.correct_tokens, first.result.correct_tokens);
      EXPECT_TRUE(again.gradient == first.gradient);
      EXPECT_TRUE(again.token_loss == first.token_loss);
      EXPECT_TRUE(again.token_lse == first.token_lse);
    }
  }
}

TEST_F(CudaCrossEntropyTest, BadTargetChangesNothing) {
  for (int64_t bad_value : {-1LL, 4096LL}) {
    Case c = Make("bad target", 64, 4096, DType::kBFloat16);
    Inputs in = MakeInputs(c, 400);
    std::memcpy(in.targets.data() + 8 * 37, &bad_value, 8);
    std::memcpy(in.targets.data() + 8 * 50, &bad_value, 8);
    const Outputs gpu = RunGpu(c, in);
    EXPECT_EQ(gpu.status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(std::string(gpu.status.message()).find("row 37"),
              std::string::npos)
        << gpu.status;
    EXPECT_TRUE(gpu.logits_after == in.logits) << "in-place logits changed";
    for (float v : gpu.token_loss) ASSERT_TRUE(std::isnan(v));
  }
}

TEST_F(CudaCrossEntropyTest, InvalidArgsAreRejected) {
  CrossEntropyArgs a;
  a.rows = 4;
  a.vocab = 10;
  a.row_stride = 5;
  CrossEntropyResult r;
  EXPECT_EQ(CrossEntropyCuda(a, &r, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CudaStatus(cudaErrorMemoryAllocation, "x").code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(CudaStatus(cudaErrorIllegalAddress, "x").code(),
            absl::StatusCode::kInternal);
}

// N * V >= 2^32: 32768 x 131072 bf16 (8 GiB) in place; sampled rows against
// the reference, and the total against the sum of the per-token losses.
TEST_F(CudaCrossEntropyTest, HugeTensorSampledRows) {
  size_t free_bytes = 0, total = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_bytes, &total), cudaSuccess);
  if (free_bytes < (size_t{10} << 30)) GTEST_SKIP() << "needs 10 GiB of GPU";
  Case c = Make("2^32 elements", 32768, 131072, DType::kBFloat16);
  c.options.reduction = Reduction::kSum;
  c.ignore_fraction = 0.05;
  const uint32_t seed = 500;
  const Inputs in = MakeInputs(c, seed);
  const Outputs gpu = RunGpu(c, in);
  ASSERT_TRUE(gpu.status.ok()) << gpu.status;
  for (int64_t first : {int64_t{0}, int64_t{16383}, int64_t{32760}}) {
    const Outputs ref = RunReference(c, in, first, 8);
    ASSERT_TRUE(ref.status.ok());
    CompareRows(c, gpu, ref, first, 8, seed);
  }
  double sum = 0;
  for (float v : gpu.token_loss) sum += v;
  ExpectNear(gpu.result.loss, sum, 1e-9, "loss vs sum of token_loss");
}

}  // namespace
}  // namespace cuda_ce_test
}  // namespace lossd
