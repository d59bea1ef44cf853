// The loss options (label smoothing, softcap, class weights, z-loss and all of
// them together) on every schedule, by name, against the fp64 CPU reference;
// with non-finite and with huge finite logits, whose losses and non-finite
// counts must match the CPU device's. Skipped without a GPU.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/kernels/cuda/cross_entropy_cuda_test_util.h"

namespace lossd {
namespace cuda_ce_test {
namespace {

using S = CrossEntropyCudaSchedule;

struct OptionSet {
  const char* name;
  float label_smoothing;
  float softcap;
  bool weights;
  float z_loss_scale;
};
// The sets the users run, and all of them at once.
constexpr OptionSet kOptionSets[] = {
    {"smoothing 0.1", 0.1f, 0.0f, false, 0.0f},
    {"softcap 30", 0.0f, 30.0f, false, 0.0f},
    {"class weights", 0.0f, 0.0f, true, 0.0f},
    {"z-loss 1e-4", 0.0f, 0.0f, false, 1e-4f},
    {"all four", 0.1f, 30.0f, true, 1e-4f},
};

// A schedule by name and a shape it takes: rows of `vocab` elements, padded
// to 16 bytes where `padded`, in `mode`.
struct Placement {
  const char* name;
  S schedule;
  int64_t vocab;
  bool padded;
  GradientMode mode;
  int piece_kib;
};

std::vector<Placement> PlacementsFor(DType dtype) {
  const bool halves = dtype != DType::kFloat32;
  std::vector<Placement> out = {
      {"smem row pieces, odd vocab, in place", S::kSmemRowPieces, 50257, false,
       GradientMode::kInPlace, 0},
      {"smem row pieces, out of place", S::kSmemRowPieces, 32768, false,
       GradientMode::kOutOfPlace, 8},
      {"split row forward, odd vocab", S::kSplitRowForward, 50257, false,
       GradientMode::kNone, 0},
      {"split row forward", S::kSplitRowForward, 65536, false,
       GradientMode::kNone, 0},
      {"cluster slice rows", S::kClusterSliceRows, 32000, false,
       GradientMode::kInPlace, 0},
      {"cluster stream rows, padded", S::kClusterStreamRows, 100003, true,
       GradientMode::kInPlace, 16},
      {"cluster stream rows, forward", S::kClusterStreamRows, 65536, false,
       GradientMode::kNone, 0},
      {"cluster register rows", S::kClusterRegisterRows, 8000, false,
       GradientMode::kInPlace, 0},
      {"generic rows", S::kGenericRows, 3001, false, GradientMode::kOutOfPlace,
       0},
      {"auto", S::kAuto, 128256, false, GradientMode::kInPlace, 0},
      {"auto, forward", S::kAuto, 128256, false, GradientMode::kNone, 0},
  };
  if (halves) {
    out.push_back({"L2 row pieces", S::kL2RowPieces, 65536, false,
                   GradientMode::kInPlace, 0});
  }
  return out;
}

Case MakeOptionCase(const std::string& what, const Placement& at,
                    const OptionSet& o, DType dtype, int64_t rows) {
  Case c = Make(absl::StrCat(at.name, ", ", o.name, ", ", what), rows, at.vocab,
                dtype);
  const int64_t vec = 16 / static_cast<int64_t>(DTypeSize(dtype));
  c.pad = at.padded ? (vec - at.vocab % vec) % vec : 0;
  c.config.schedule = at.schedule;
  c.config.piece_kib = at.piece_kib;
  c.mode = at.mode;
  c.ignore_fraction = 0.2;
  c.options.label_smoothing = o.label_smoothing;
  c.options.softcap = o.softcap;
  c.options.z_loss_scale = o.z_loss_scale;
  c.weights = o.weights;
  return c;
}

// Each option set on each schedule, fp32, bf16 and fp16, against the
// reference: loss, z-loss, per-token outputs and the gradient.
TEST_F(CudaCrossEntropyTest, OptionsOnEverySchedule) {
  uint32_t seed = 3000;
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    for (const Placement& at : PlacementsFor(dtype)) {
      for (const OptionSet& o : kOptionSets) {
        Case c = MakeOptionCase("", at, o, dtype, 6);
        c.logits = Logits::kGaussian;
        c.scale = 8.0;  // reaches the softcap's curve
        CheckCase(c, seed++);
      }
    }
  }
}

// The p_y -> 1 rows (a thread's own dominant element) with the options.
TEST_F(CudaCrossEntropyTest, OptionsTargetDominant) {
  uint32_t seed = 3500;
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    for (const Placement& at : PlacementsFor(dtype)) {
      Case c = MakeOptionCase("p_y -> 1", at, kOptionSets[4], dtype, 5);
      c.options.softcap = 0.0f;  // (a cap of 30 keeps 24 off p_y -> 1)
      c.logits = Logits::kTargetDominant;
      CheckCase(c, seed++);
    }
  }
}

// NaN, -inf and +inf logits, plain and with every option: the loss and the
// non-finite count agree with the CPU device on every schedule, forward and
// forward+gradient.
TEST_F(CudaCrossEntropyTest, NonFiniteOnEverySchedule) {
  uint32_t seed = 3700;
  const OptionSet plain = {"plain", 0.0f, 0.0f, false, 0.0f};
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    for (const Placement& at : PlacementsFor(dtype)) {
      for (const OptionSet& o : {plain, kOptionSets[4]}) {
        Case c = MakeOptionCase("non-finite", at, o, dtype, 8);
        c.logits = Logits::kNonFinite;
        c.ignore_fraction = 0.0;
        c.exact_argmax = false;  // NaN rows: the first max is not defined
        CheckCase(c, seed++);
      }
    }
  }
}

// Finite logits up to 1e30 (fp16: 6e4): a finite loss and gradient wherever
// the reference has them, on every schedule, plain and with every option.
// Halves: many logits of a row tie at its max (a bf16 binade near 1e30 has
// 128 values for ~30000 logits), where the fp64 reference's exp(z - lse)
// gives each tie p = 1 (lse = m + ln(ties) rounds to m); there the loss, the
// counts and a finite gradient whose rows sum to ~0 are checked.
TEST_F(CudaCrossEntropyTest, HugeFiniteLogitsOnEverySchedule) {
  uint32_t seed = 3900;
  const OptionSet plain = {"plain", 0.0f, 0.0f, false, 0.0f};
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    for (const Placement& at : PlacementsFor(dtype)) {
      for (const OptionSet& o : {plain, kOptionSets[0], kOptionSets[4]}) {
        Case c = MakeOptionCase("huge logits", at, o, dtype, 8);
        c.logits = Logits::kExtreme;
        c.ignore_fraction = 0.0;
        c.options.z_loss_scale = 0.0f;  // lse^2 ~ 1e60 is past fp32
        if (dtype == DType::kFloat32 || o.softcap > 0) {
          CheckCase(c, seed++);
          continue;
        }
        SCOPED_TRACE(c.name);
        const Inputs in = MakeInputs(c, seed++);
        const Outputs gpu = RunGpu(c, in);
        ASSERT_TRUE(gpu.status.ok()) << gpu.status;
        const Outputs ref = RunReference(c, in, 0, c.rows);
        ASSERT_TRUE(ref.status.ok()) << ref.status;
        ExpectNear(gpu.result.loss, ref.result.loss, 1e-5, "loss");
        EXPECT_EQ(gpu.result.nonfinite_rows, 0);
        EXPECT_EQ(gpu.result.valid_tokens, ref.result.valid_tokens);
        if (c.mode == GradientMode::kNone) continue;
        const int64_t stride = c.vocab + c.pad;
        for (int64_t r = 0; r < c.rows; ++r) {
          double sum = 0, size = 0;
          for (int64_t v = 0; v < c.vocab; ++v) {
            const double g = ToFloat(gpu.gradient, c.dtype, r * stride + v);
            ASSERT_TRUE(std::isfinite(g)) << "row " << r << " col " << v;
            sum += g;
            size = std::max(size, std::fabs(g));
          }
          EXPECT_LE(std::fabs(sum), 0.05 * size + 1e-6) << "row " << r;
        }
      }
    }
  }
}

// The independent client's case: 8 rows of bf16 logits of +-1e30, plain
// options, the automatic schedule, fwd+gradient and forward only.
TEST_F(CudaCrossEntropyTest, PlusMinus1e30Bf16) {
  for (GradientMode mode : {GradientMode::kInPlace, GradientMode::kNone}) {
    Case c = Make("+-1e30 bf16", 8, 128256, DType::kBFloat16);
    c.logits = Logits::kExtreme;
    c.mode = mode;
    const Inputs in = MakeInputs(c, 42);
    const Outputs gpu = RunGpu(c, in);
    ASSERT_TRUE(gpu.status.ok()) << gpu.status;
    EXPECT_TRUE(std::isfinite(gpu.result.loss)) << gpu.result.loss;
    EXPECT_EQ(gpu.result.nonfinite_rows, 0);
    EXPECT_GT(gpu.result.loss, 1e28);
  }
}

}  // namespace
}  // namespace cuda_ce_test
}  // namespace lossd
