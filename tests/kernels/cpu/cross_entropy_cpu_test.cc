// Tests of the CPU cross-entropy backends: hand-computed rows for each option,
// the fast path against the fp64 reference over options x reductions x modes x
// dtypes x awkward shapes, properties (loss >= 0, rows of the gradient sum to
// 0, shift invariance, bounds, finite differences), modes, validation and
// determinism across thread counts.
#include "kernels/cpu/cross_entropy_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "common/float16.h"
#include "gtest/gtest.h"

namespace lossd {
namespace {

constexpr uint8_t kSentinelByte = 0xa5;
constexpr double kSentinelLoss = 12345.0;

enum class Backend { kFast, kReference };

std::string BackendName(Backend backend) {
  return backend == Backend::kFast ? "fast" : "reference";
}

std::vector<uint8_t> Encode(const std::vector<float>& values, DType dtype) {
  std::vector<uint8_t> bytes(values.size() * DTypeSize(dtype));
  for (size_t i = 0; i < values.size(); ++i) {
    if (dtype == DType::kFloat32) {
      std::memcpy(bytes.data() + 4 * i, &values[i], 4);
    } else {
      const uint16_t h = dtype == DType::kBFloat16 ? FloatToBF16(values[i])
                                                   : FloatToHalf(values[i]);
      std::memcpy(bytes.data() + 2 * i, &h, 2);
    }
  }
  return bytes;
}

std::vector<float> Decode(const std::vector<uint8_t>& bytes, DType dtype) {
  const size_t size = DTypeSize(dtype);
  std::vector<float> values(bytes.size() / size);
  for (size_t i = 0; i < values.size(); ++i) {
    if (dtype == DType::kFloat32) {
      std::memcpy(&values[i], bytes.data() + 4 * i, 4);
    } else {
      uint16_t h;
      std::memcpy(&h, bytes.data() + 2 * i, 2);
      values[i] = dtype == DType::kBFloat16 ? BF16ToFloat(h) : HalfToFloat(h);
    }
  }
  return values;
}

// One problem, in plain floats; the logits are representable in `dtype`.
struct Problem {
  int64_t rows = 0;
  int64_t vocab = 0;
  int64_t row_stride = 0;
  DType dtype = DType::kFloat32;
  std::vector<float> logits;  // [rows * row_stride]
  std::vector<int64_t> targets;
  DType targets_dtype = DType::kInt64;
  std::vector<float> weights;  // empty: no class weights
  CrossEntropyOptions options;
  GradientMode mode = GradientMode::kOutOfPlace;
  bool token_outputs = true;
};

struct Outcome {
  absl::Status status;
  CrossEntropyResult result;
  std::vector<uint8_t> logits_after;  // the logits buffer after the call
  std::vector<uint8_t> gradient_raw;  // in-place: == logits_after; none: empty
  std::vector<float> gradient;        // gradient_raw decoded
  std::vector<float> token_loss;
  std::vector<float> token_lse;
  std::vector<int32_t> token_argmax;
};

template <typename T>
std::vector<T> SentinelVector(int64_t n) {
  std::vector<T> v(n);
  std::memset(v.data(), kSentinelByte, n * sizeof(T));
  return v;
}

template <typename T>
bool IsSentinel(const T& value) {
  T sentinel;
  std::memset(&sentinel, kSentinelByte, sizeof(T));
  return std::memcmp(&sentinel, &value, sizeof(T)) == 0;
}

Outcome Compute(const Problem& p, Backend backend, int threads = 0) {
  Outcome o;
  std::vector<uint8_t> logits = Encode(p.logits, p.dtype);
  std::vector<uint8_t> gradient;
  std::vector<int64_t> targets64 = p.targets;
  std::vector<int32_t> targets32(p.targets.begin(), p.targets.end());
  CrossEntropyArgs args;
  args.rows = p.rows;
  args.vocab = p.vocab;
  args.row_stride = p.row_stride;
  args.logits_dtype = p.dtype;
  args.logits = logits.data();
  args.targets_dtype = p.targets_dtype;
  args.targets = p.targets_dtype == DType::kInt32
                     ? static_cast<const void*>(targets32.data())
                     : static_cast<const void*>(targets64.data());
  args.class_weights = p.weights.empty() ? nullptr : p.weights.data();
  args.options = p.options;
  args.mode = p.mode;
  if (p.mode == GradientMode::kInPlace) args.gradient = logits.data();
  if (p.mode == GradientMode::kOutOfPlace) {
    gradient.assign(logits.size(), kSentinelByte);
    args.gradient = gradient.data();
  }
  if (p.token_outputs) {
    o.token_loss = SentinelVector<float>(p.rows);
    o.token_lse = SentinelVector<float>(p.rows);
    o.token_argmax = SentinelVector<int32_t>(p.rows);
    args.token_loss = o.token_loss.data();
    args.token_lse = o.token_lse.data();
    args.token_argmax = o.token_argmax.data();
  }
  o.result.loss = kSentinelLoss;
  o.status = backend == Backend::kFast
                 ? CrossEntropyCpu(args, &o.result, threads)
                 : CrossEntropyReference(args, &o.result);
  o.logits_after = logits;
  if (p.mode == GradientMode::kInPlace) o.gradient_raw = logits;
  if (p.mode == GradientMode::kOutOfPlace) o.gradient_raw = gradient;
  o.gradient = Decode(o.gradient_raw, p.dtype);
  return o;
}

// Random logits ~ N(0, scale) rounded to `dtype`, a few large ones, padding
// filled with a value that would show up if it were read; ~1/5 of the targets
// ignored.
Problem RandomProblem(uint64_t seed, int64_t rows, int64_t vocab, int64_t pad,
                      DType dtype, float scale = 3.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, scale);
  std::uniform_int_distribution<int64_t> klass(0, vocab - 1);
  std::uniform_int_distribution<int> percent(0, 99);
  Problem p;
  p.rows = rows;
  p.vocab = vocab;
  p.row_stride = vocab + pad;
  p.dtype = dtype;
  p.logits.resize(rows * p.row_stride);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < p.row_stride; ++c) {
      float v = c < vocab ? normal(rng) : 999.0f;
      if (c < vocab && percent(rng) == 0) v *= 4.0f;
      p.logits[r * p.row_stride + c] = v;
    }
  }
  p.logits = Decode(Encode(p.logits, dtype), dtype);
  for (int64_t r = 0; r < rows; ++r) {
    p.targets.push_back(percent(rng) < 20 ? p.options.ignore_index
                                          : klass(rng));
  }
  return p;
}

std::vector<float> RandomWeights(uint64_t seed, int64_t vocab) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> uniform(0.25f, 2.0f);
  std::vector<float> weights(vocab);
  for (float& w : weights) w = uniform(rng);
  return weights;
}

// Named option sets that between them exercise every option.
struct OptionSet {
  std::string name;
  float label_smoothing = 0.0f;
  bool weights = false;
  float z_loss_scale = 0.0f;
  float softcap = 0.0f;
  double normalizer = 0.0;
  float grad_scale = 1.0f;
};

std::vector<OptionSet> AllOptionSets() {
  std::vector<OptionSet> sets(8);
  sets[0].name = "plain";
  sets[1].name = "label_smoothing";
  sets[1].label_smoothing = 0.1f;
  sets[2].name = "weights";
  sets[2].weights = true;
  sets[3].name = "weights+smoothing";
  sets[3].weights = true;
  sets[3].label_smoothing = 0.2f;
  sets[4].name = "z_loss";
  sets[4].z_loss_scale = 1e-2f;
  sets[5].name = "softcap";
  sets[5].softcap = 5.0f;
  sets[6].name = "normalizer+grad_scale";
  sets[6].normalizer = 37.0;
  sets[6].grad_scale = 0.75f;
  sets[7].name = "everything";
  sets[7].label_smoothing = 1.0f;
  sets[7].weights = true;
  sets[7].z_loss_scale = 1e-3f;
  sets[7].softcap = 30.0f;
  sets[7].grad_scale = -2.0f;
  return sets;
}

void Apply(const OptionSet& set, uint64_t seed, Problem* p) {
  p->options.label_smoothing = set.label_smoothing;
  p->options.z_loss_scale = set.z_loss_scale;
  p->options.softcap = set.softcap;
  p->options.normalizer = set.normalizer;
  p->options.grad_scale = set.grad_scale;
  p->weights =
      set.weights ? RandomWeights(seed ^ 0x77, p->vocab) : std::vector<float>();
}

void ExpectNear(double actual, double expected, double rel, double abs,
                const std::string& what) {
  if (std::isnan(expected)) {
    EXPECT_TRUE(std::isnan(actual)) << what;
    return;
  }
  EXPECT_LE(std::fabs(actual - expected), abs + rel * std::fabs(expected))
      << what << ": actual " << actual << " expected " << expected;
}

// Checks `actual` against `expected` (same problem): totals, per-token
// outputs, the gradient within `grad_abs` (plus `grad_ulps` units of the
// gradient dtype's last place), the padding left alone.
void ExpectMatches(const Problem& p, const Outcome& actual,
                   const Outcome& expected, double grad_abs,
                   double grad_ulps = 0.0) {
  ASSERT_TRUE(actual.status.ok()) << actual.status;
  ASSERT_TRUE(expected.status.ok()) << expected.status;
  ExpectNear(actual.result.loss, expected.result.loss, 1e-6, 1e-9, "loss");
  ExpectNear(actual.result.z_loss, expected.result.z_loss, 1e-6, 1e-9,
             "z_loss");
  EXPECT_EQ(actual.result.valid_tokens, expected.result.valid_tokens);
  EXPECT_EQ(actual.result.correct_tokens, expected.result.correct_tokens);
  EXPECT_EQ(actual.result.nonfinite_rows, expected.result.nonfinite_rows);
  ExpectNear(actual.result.denominator, expected.result.denominator, 1e-12, 0,
             "denominator");
  for (int64_t r = 0; r < p.rows && p.token_outputs; ++r) {
    ExpectNear(actual.token_loss[r], expected.token_loss[r], 1e-6, 1e-6,
               "token_loss row " + std::to_string(r));
    ExpectNear(actual.token_lse[r], expected.token_lse[r], 1e-6, 1e-6,
               "token_lse row " + std::to_string(r));
    EXPECT_EQ(actual.token_argmax[r], expected.token_argmax[r]) << r;
  }
  ASSERT_EQ(actual.gradient.size(), expected.gradient.size());
  const int mantissa_bits = p.dtype == DType::kFloat32    ? 24
                            : p.dtype == DType::kBFloat16 ? 8
                                                          : 11;
  int failures = 0;
  for (int64_t r = 0; r < p.rows && !actual.gradient.empty(); ++r) {
    for (int64_t c = 0; c < p.vocab; ++c) {
      const size_t i = r * p.row_stride + c;
      const double want = expected.gradient[i];
      int exponent = 0;
      std::frexp(want, &exponent);
      // Subnormals of the gradient dtype have a fixed spacing.
      const double min_ulp = p.dtype == DType::kFloat32    ? 0x1p-149
                             : p.dtype == DType::kBFloat16 ? 0x1p-133
                                                           : 0x1p-24;
      const double ulp =
          std::max(std::ldexp(1.0, exponent - mantissa_bits), min_ulp);
      const double tolerance = grad_abs + grad_ulps * ulp;
      if (!(std::fabs(actual.gradient[i] - want) <= tolerance) &&
          failures++ < 5) {
        ADD_FAILURE() << "gradient[" << r << ", " << c
                      << "] = " << actual.gradient[i] << ", expected " << want;
      }
    }
  }
  EXPECT_EQ(failures, 0);
  // Padding: in-place keeps the logits' padding; out-of-place the sentinel.
  const size_t size = DTypeSize(p.dtype);
  const std::vector<uint8_t> original = Encode(p.logits, p.dtype);
  for (int64_t r = 0; r < p.rows; ++r) {
    for (int64_t c = p.vocab; c < p.row_stride; ++c) {
      const size_t byte = (r * p.row_stride + c) * size;
      for (size_t b = 0; b < size; ++b) {
        if (p.mode == GradientMode::kOutOfPlace) {
          ASSERT_EQ(actual.gradient_raw[byte + b], kSentinelByte);
        }
        ASSERT_EQ(actual.logits_after[byte + b], original[byte + b]);
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Hand-computed rows.

Problem OneRow(std::vector<float> logits, int64_t target) {
  Problem p;
  p.rows = 1;
  p.vocab = static_cast<int64_t>(logits.size());
  p.row_stride = p.vocab;
  p.logits = std::move(logits);
  p.targets = {target};
  return p;
}

void ExpectGradient(const Outcome& o, const std::vector<double>& expected,
                    double tolerance = 1e-6) {
  ASSERT_EQ(o.gradient.size(), expected.size());
  for (size_t c = 0; c < expected.size(); ++c) {
    EXPECT_NEAR(o.gradient[c], expected[c], tolerance) << "column " << c;
  }
}

class HandComputedTest : public testing::TestWithParam<Backend> {
 protected:
  // The fast path sums fp32 exponentials (relative error ~1e-8); the
  // reference is fp64 throughout.
  double LossTolerance() const {
    return GetParam() == Backend::kFast ? 1e-7 : 1e-12;
  }
};

TEST_P(HandComputedTest, PlainRow) {
  Problem p = OneRow({1.0f, 2.0f, 3.0f}, 2);
  const double sum = std::exp(1.0) + std::exp(2.0) + std::exp(3.0);
  const double lse = std::log(sum);
  const Outcome o = Compute(p, GetParam());
  ASSERT_TRUE(o.status.ok()) << o.status;
  EXPECT_NEAR(o.result.loss, lse - 3.0, LossTolerance());
  EXPECT_EQ(o.result.valid_tokens, 1);
  EXPECT_EQ(o.result.correct_tokens, 1);
  EXPECT_EQ(o.result.denominator, 1.0);
  EXPECT_EQ(o.result.z_loss, 0.0);
  EXPECT_EQ(o.token_argmax[0], 2);
  EXPECT_NEAR(o.token_lse[0], lse, 1e-6);
  EXPECT_NEAR(o.token_loss[0], lse - 3.0, 1e-6);
  ExpectGradient(
      o, {std::exp(1.0) / sum, std::exp(2.0) / sum, std::exp(3.0) / sum - 1.0});
}

TEST_P(HandComputedTest, LabelSmoothing) {
  Problem p = OneRow({1.0f, 2.0f, 3.0f}, 0);
  p.options.label_smoothing = 0.1f;
  const double eps = 0.1f;
  const double sum = std::exp(1.0) + std::exp(2.0) + std::exp(3.0);
  const double lse = std::log(sum);
  // torch: (1 - eps) * nll + eps / V * sum_c (lse - z_c).
  const double loss = (1 - eps) * (lse - 1.0) +
                      eps / 3 * ((lse - 1.0) + (lse - 2.0) + (lse - 3.0));
  const Outcome o = Compute(p, GetParam());
  ASSERT_TRUE(o.status.ok()) << o.status;
  EXPECT_NEAR(o.result.loss, loss, LossTolerance());
  EXPECT_EQ(o.result.correct_tokens, 0);
  ExpectGradient(
      o, {std::exp(1.0) / sum - (1 - eps) - eps / 3,
          std::exp(2.0) / sum - eps / 3, std::exp(3.0) / sum - eps / 3});
}

TEST_P(HandComputedTest, ClassWeightsWithSmoothingMean) {
  // Two rows, torch's weighted mean: divide by the sum of target weights, the
  // smoothing term included.
  Problem p;
  p.rows = 2;
  p.vocab = 3;
  p.row_stride = 3;
  p.logits = {1.0f, 2.0f, 3.0f, 0.5f, -1.0f, 0.0f};
  p.targets = {1, 2};
  p.weights = {0.5f, 2.0f, 1.5f};
  p.options.label_smoothing = 0.25f;
  const double eps = 0.25, w[3] = {0.5, 2.0, 1.5};
  const double lse0 = std::log(std::exp(1.0) + std::exp(2.0) + std::exp(3.0));
  const double lse1 = std::log(std::exp(0.5) + std::exp(-1.0) + 1.0);
  const double nll = w[1] * (lse0 - 2.0) + w[2] * (lse1 - 0.0);
  const double smooth = w[0] * (lse0 - 1) + w[1] * (lse0 - 2) +
                        w[2] * (lse0 - 3) + w[0] * (lse1 - 0.5) +
                        w[1] * (lse1 + 1) + w[2] * (lse1 - 0);
  const double denominator = w[1] + w[2];
  const Outcome o = Compute(p, GetParam());
  ASSERT_TRUE(o.status.ok()) << o.status;
  EXPECT_NEAR(o.result.loss, ((1 - eps) * nll + eps / 3 * smooth) / denominator,
              LossTolerance());
  EXPECT_EQ(o.result.denominator, denominator);
  // Row 0, column 0: d/dz_0 of [(1-eps) w_1 (lse - z_1) + eps/3 sum_c w_c
  // (lse - z_c)] / D = [(1-eps) w_1 p_0 + eps/3 (W p_0 - w_0)] / D.
  const double p00 = std::exp(1.0 - lse0);
  const double p01 = std::exp(2.0 - lse0);
  EXPECT_NEAR(
      o.gradient[0],
      ((1 - eps) * w[1] * p00 + eps / 3 * (4.0 * p00 - w[0])) / denominator,
      1e-6);
  EXPECT_NEAR(o.gradient[1],
              ((1 - eps) * w[1] * (p01 - 1) + eps / 3 * (4.0 * p01 - w[1])) /
                  denominator,
              1e-6);
}

TEST_P(HandComputedTest, ZLossAndSumReduction) {
  Problem p = OneRow({0.0f, 1.0f}, 1);
  p.options.z_loss_scale = 0.5f;
  p.options.reduction = Reduction::kSum;
  const double lse = std::log(1.0 + std::exp(1.0));
  const Outcome o = Compute(p, GetParam());
  ASSERT_TRUE(o.status.ok()) << o.status;
  EXPECT_NEAR(o.result.z_loss, 0.5 * lse * lse, LossTolerance());
  EXPECT_NEAR(o.result.loss, lse - 1.0 + 0.5 * lse * lse, LossTolerance());
  EXPECT_EQ(o.result.denominator, 0.0);  // only kMean has a D
  const double p0 = 1.0 / (1.0 + std::exp(1.0));
  ExpectGradient(o, {p0 * (1 + lse), (1 - p0) * (1 + lse) - 1});
}

TEST_P(HandComputedTest, Softcap) {
  Problem p = OneRow({4.0f, -2.0f, 0.5f}, 0);
  p.options.softcap = 3.0f;
  double z[3], sum = 0;
  for (int c = 0; c < 3; ++c) {
    z[c] = 3.0 * std::tanh(p.logits[c] / 3.0);
    sum += std::exp(z[c]);
  }
  const double lse = std::log(sum);
  const Outcome o = Compute(p, GetParam());
  ASSERT_TRUE(o.status.ok()) << o.status;
  EXPECT_NEAR(o.result.loss, lse - z[0], LossTolerance());
  EXPECT_NEAR(o.token_lse[0], lse, 1e-6);
  std::vector<double> expected(3);
  for (int c = 0; c < 3; ++c) {
    const double t = std::tanh(p.logits[c] / 3.0);
    expected[c] = (std::exp(z[c] - lse) - (c == 0)) * (1 - t * t);
  }
  ExpectGradient(o, expected);
}

TEST_P(HandComputedTest, NoneReductionNormalizerAndGradScale) {
  Problem p;
  p.rows = 3;
  p.vocab = 2;
  p.row_stride = 2;
  p.logits = {0.0f, 0.0f, 2.0f, 0.0f, 5.0f, 5.0f};
  p.targets = {0, -100, 1};
  const double log2 = std::log(2.0);
  const double row1 = std::log(1.0 + std::exp(2.0));
  for (Reduction reduction :
       {Reduction::kNone, Reduction::kSum, Reduction::kMean}) {
    p.options.reduction = reduction;
    p.options.grad_scale = 3.0f;
    p.options.normalizer = reduction == Reduction::kMean ? 4.0 : 0.0;
    const Outcome o = Compute(p, GetParam());
    ASSERT_TRUE(o.status.ok()) << o.status;
    const double sum = 2 * log2;
    EXPECT_NEAR(o.result.loss, reduction == Reduction::kMean ? sum / 4 : sum,
                LossTolerance());
    EXPECT_EQ(o.result.valid_tokens, 2);
    EXPECT_EQ(o.result.correct_tokens, 1);  // row 2 ties: argmax 0 != 1
    EXPECT_NEAR(o.token_loss[0], log2, 1e-6);
    EXPECT_EQ(o.token_loss[1], 0.0f);
    EXPECT_NEAR(o.token_lse[1], row1, 1e-6);  // ignored rows still get lse
    EXPECT_EQ(o.token_argmax[1], 0);
    EXPECT_EQ(o.token_argmax[2], 0);
    const double s = reduction == Reduction::kMean ? 3.0 / 4 : 3.0;
    ExpectGradient(o, {-0.5 * s, 0.5 * s, 0, 0, 0.5 * s, -0.5 * s});
  }
}

TEST_P(HandComputedTest, VocabOfOne) {
  Problem p = OneRow({7.0f}, 0);
  p.options.label_smoothing = 0.3f;
  const Outcome o = Compute(p, GetParam());
  ASSERT_TRUE(o.status.ok()) << o.status;
  EXPECT_EQ(o.result.loss, 0.0);
  EXPECT_EQ(o.result.correct_tokens, 1);
  ExpectGradient(o, {0.0}, 0.0);
}

INSTANTIATE_TEST_SUITE_P(Backends, HandComputedTest,
                         testing::Values(Backend::kFast, Backend::kReference),
                         [](const testing::TestParamInfo<Backend>& info) {
                           return BackendName(info.param);
                         });

// ---------------------------------------------------------------------------
// Fast path against the reference, and properties, over awkward shapes.

struct Shape {
  int64_t rows;
  int64_t vocab;
  int64_t pad;
};

class ShapeTest : public testing::TestWithParam<Shape> {
 protected:
  uint64_t Seed() const {
    return 1000003u * GetParam().vocab + 101u * GetParam().rows +
           GetParam().pad;
  }
};

TEST_P(ShapeTest, FastMatchesReferenceForEveryOptionReductionAndMode) {
  const Shape shape = GetParam();
  const uint64_t seed = Seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  for (const OptionSet& set : AllOptionSets()) {
    for (Reduction reduction :
         {Reduction::kMean, Reduction::kSum, Reduction::kNone}) {
      for (GradientMode mode :
           {GradientMode::kInPlace, GradientMode::kOutOfPlace,
            GradientMode::kNone}) {
        SCOPED_TRACE(set.name + " reduction " +
                     std::to_string(static_cast<int>(reduction)) + " mode " +
                     std::to_string(static_cast<int>(mode)));
        Problem p = RandomProblem(seed, shape.rows, shape.vocab, shape.pad,
                                  DType::kFloat32);
        Apply(set, seed, &p);
        p.options.reduction = reduction;
        p.mode = mode;
        const Outcome fast = Compute(p, Backend::kFast);
        const Outcome reference = Compute(p, Backend::kReference);
        ExpectMatches(p, fast, reference, 1e-6);
        if (HasFatalFailure() || HasNonfatalFailure()) return;
      }
    }
  }
}

// With 16-bit logits the fast path rounds the fp32 gradient once, so it lies
// within half a last place of the fp32 result for the same logit values.
TEST_P(ShapeTest, SixteenBitGradientsAreOneRoundingFromFloat32) {
  const Shape shape = GetParam();
  const uint64_t seed = Seed() + 1;
  SCOPED_TRACE("seed " + std::to_string(seed));
  for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
    for (const OptionSet& set : AllOptionSets()) {
      SCOPED_TRACE(set.name + " dtype " +
                   std::to_string(static_cast<int>(dtype)));
      Problem p =
          RandomProblem(seed, shape.rows, shape.vocab, shape.pad, dtype);
      Apply(set, seed, &p);
      Problem p32 = p;
      p32.dtype = DType::kFloat32;
      const Outcome narrow = Compute(p, Backend::kFast);
      const Outcome wide = Compute(p32, Backend::kFast);
      ExpectMatches(p, narrow, wide, 1e-30, 0.5 * (1 + 1e-6));
      // The reference rounds its fp64 gradient once: within one last place.
      const Outcome reference = Compute(p, Backend::kReference);
      ExpectMatches(p, narrow, reference, 1e-30, 1.0);
      if (HasFatalFailure() || HasNonfatalFailure()) return;
    }
  }
}

TEST_P(ShapeTest, Properties) {
  const Shape shape = GetParam();
  const uint64_t seed = Seed() + 2;
  SCOPED_TRACE("seed " + std::to_string(seed));
  for (const OptionSet& set : AllOptionSets()) {
    SCOPED_TRACE(set.name);
    Problem p = RandomProblem(seed, shape.rows, shape.vocab, shape.pad,
                              DType::kFloat32);
    Apply(set, seed, &p);
    const Outcome o = Compute(p, Backend::kFast);
    ASSERT_TRUE(o.status.ok()) << o.status;
    EXPECT_GE(o.result.loss, 0.0);
    double max_weight = 1.0;
    for (float w : p.weights) max_weight = std::max<double>(max_weight, w);
    const double s = std::fabs(o.result.denominator > 0
                                   ? set.grad_scale / o.result.denominator
                                   : set.grad_scale);
    for (int64_t r = 0; r < p.rows; ++r) {
      EXPECT_GE(o.token_loss[r], 0.0f) << r;
      double row_sum = 0, row_abs = 0;
      for (int64_t c = 0; c < p.vocab; ++c) {
        const double g = o.gradient[r * p.row_stride + c];
        row_sum += g;
        row_abs += std::fabs(g);
        // |dL/dz_c| <= s * (a + (1 - eps) w_y + eps w_c / V) <= s * 3 max_w
        // without z-loss.
        if (set.z_loss_scale == 0) {
          ASSERT_LE(std::fabs(g), s * 3 * max_weight * (1 + 1e-6))
              << r << ", " << c;
        }
        if (set.name == "plain" && p.targets[r] != p.options.ignore_index) {
          if (c == p.targets[r]) {
            ASSERT_LE(g, 0.0);
            ASSERT_GE(g, -s * (1 + 1e-6));
          } else {
            ASSERT_GE(g, 0.0);
            ASSERT_LE(g, s * (1 + 1e-6));
          }
        }
      }
      if (set.z_loss_scale == 0 && set.softcap == 0) {
        EXPECT_NEAR(row_sum, 0.0, 1e-6 * (row_abs + s)) << "row " << r;
      }
      if (p.targets[r] == p.options.ignore_index) {
        EXPECT_EQ(row_abs, 0.0) << "ignored row " << r;
      }
    }
  }
}

TEST_P(ShapeTest, ShiftingARowChangesNothing) {
  const Shape shape = GetParam();
  const uint64_t seed = Seed() + 3;
  SCOPED_TRACE("seed " + std::to_string(seed));
  for (const OptionSet& set : AllOptionSets()) {
    if (set.z_loss_scale != 0 || set.softcap != 0) continue;
    SCOPED_TRACE(set.name);
    Problem p = RandomProblem(seed, shape.rows, shape.vocab, shape.pad,
                              DType::kFloat32);
    Apply(set, seed, &p);
    // Multiples of 2^-10 within +-64 stay exact when shifted by 16.
    for (float& v : p.logits) v = std::round(v * 1024) / 1024;
    Problem shifted = p;
    for (int64_t r = 0; r < p.rows; ++r) {
      for (int64_t c = 0; c < p.vocab; ++c) {
        shifted.logits[r * p.row_stride + c] += 16.0f * (r % 3 - 1);
      }
    }
    Outcome a = Compute(p, Backend::kFast);
    const Outcome b = Compute(shifted, Backend::kFast);
    // Everything but the lse matches; lse moves by the shift.
    for (int64_t r = 0; r < p.rows; ++r) {
      a.token_lse[r] += 16.0f * (r % 3 - 1);
    }
    ExpectMatches(p, b, a, 1e-6);
  }
}

TEST_P(ShapeTest, DeterministicAcrossThreadCounts) {
  const Shape shape = GetParam();
  const uint64_t seed = Seed() + 4;
  SCOPED_TRACE("seed " + std::to_string(seed));
  Problem p = RandomProblem(seed, shape.rows * 64, shape.vocab, shape.pad,
                            DType::kBFloat16);
  Apply(AllOptionSets().back(), seed, &p);
  const Outcome one = Compute(p, Backend::kFast, 1);
  for (int threads : {2, 3, 8, 0}) {
    const Outcome many = Compute(p, Backend::kFast, threads);
    ASSERT_TRUE(many.status.ok());
    EXPECT_EQ(std::memcmp(&one.result.loss, &many.result.loss, 8), 0)
        << threads;
    EXPECT_EQ(std::memcmp(&one.result.z_loss, &many.result.z_loss, 8), 0);
    EXPECT_EQ(one.gradient_raw, many.gradient_raw) << threads;
    EXPECT_EQ(one.token_loss, many.token_loss) << threads;
    EXPECT_EQ(one.token_lse, many.token_lse) << threads;
    EXPECT_EQ(one.token_argmax, many.token_argmax) << threads;
  }
}

INSTANTIATE_TEST_SUITE_P(AwkwardShapes, ShapeTest,
                         testing::Values(Shape{5, 1, 0}, Shape{9, 7, 0},
                                         Shape{6, 7, 3}, Shape{17, 33, 0},
                                         Shape{4, 33, 5}, Shape{3, 50257, 0},
                                         Shape{2, 50257, 7}),
                         [](const testing::TestParamInfo<Shape>& info) {
                           return "rows" + std::to_string(info.param.rows) +
                                  "_vocab" + std::to_string(info.param.vocab) +
                                  "_pad" + std::to_string(info.param.pad);
                         });

// ---------------------------------------------------------------------------
// Gradient against central finite differences of the fp64 reference loss.

TEST(FiniteDifferenceTest, GradientMatchesLossDerivative) {
  const uint64_t seed = 4242;
  SCOPED_TRACE("seed " + std::to_string(seed));
  for (Reduction reduction : {Reduction::kMean, Reduction::kSum}) {
    Problem p = RandomProblem(seed, 4, 6, 0, DType::kFloat32, 2.0f);
    // Multiples of 2^-6 so that x +- h (h = 2^-9) is exact in fp32.
    for (float& v : p.logits) v = std::round(v * 64) / 64;
    p.targets = {3, -100, 0, 5};
    p.weights = RandomWeights(seed, 6);
    p.options.label_smoothing = 0.15f;
    p.options.z_loss_scale = 0.05f;
    p.options.softcap = 2.5f;
    p.options.reduction = reduction;
    p.token_outputs = false;
    for (Backend backend : {Backend::kReference, Backend::kFast}) {
      SCOPED_TRACE(BackendName(backend));
      const Outcome o = Compute(p, backend);
      ASSERT_TRUE(o.status.ok()) << o.status;
      Problem probe = p;
      probe.mode = GradientMode::kNone;
      const float h = 1.0f / 512;
      for (size_t i = 0; i < p.logits.size(); ++i) {
        probe.logits = p.logits;
        probe.logits[i] = p.logits[i] + h;
        const double up = Compute(probe, Backend::kReference).result.loss;
        probe.logits[i] = p.logits[i] - h;
        const double down = Compute(probe, Backend::kReference).result.loss;
        EXPECT_NEAR(o.gradient[i], (up - down) / (2 * h), 2e-5) << "i " << i;
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Modes, targets, ignored rows, non-finite values.

class BackendTest : public testing::TestWithParam<Backend> {};

TEST_P(BackendTest, ModesWriteWhatTheySay) {
  const uint64_t seed = 77;
  SCOPED_TRACE("seed " + std::to_string(seed));
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    Problem p = RandomProblem(seed, 6, 33, 4, dtype);
    p.options.label_smoothing = 0.1f;
    const std::vector<uint8_t> original = Encode(p.logits, dtype);
    p.mode = GradientMode::kOutOfPlace;
    const Outcome out_of_place = Compute(p, GetParam());
    ASSERT_TRUE(out_of_place.status.ok());
    EXPECT_EQ(out_of_place.logits_after, original) << "logits touched";
    p.mode = GradientMode::kInPlace;
    const Outcome in_place = Compute(p, GetParam());
    ASSERT_TRUE(in_place.status.ok());
    EXPECT_NE(in_place.logits_after, original) << "in-place wrote nothing";
    // Same gradient bits; the padding of the in-place buffer keeps logits.
    for (int64_t r = 0; r < p.rows; ++r) {
      for (int64_t c = 0; c < p.vocab; ++c) {
        const size_t i = r * p.row_stride + c;
        EXPECT_EQ(FloatBits(in_place.gradient[i]),
                  FloatBits(out_of_place.gradient[i]));
      }
    }
    p.mode = GradientMode::kNone;
    const Outcome none = Compute(p, GetParam());
    ASSERT_TRUE(none.status.ok());
    EXPECT_EQ(none.logits_after, original) << "forward-only wrote logits";
    EXPECT_EQ(none.result.loss, in_place.result.loss);
    EXPECT_EQ(none.token_loss, in_place.token_loss);
  }
}

TEST_P(BackendTest, Int32AndInt64TargetsAgree) {
  const uint64_t seed = 78;
  SCOPED_TRACE("seed " + std::to_string(seed));
  Problem p = RandomProblem(seed, 11, 7, 0, DType::kFloat32);
  const Outcome wide = Compute(p, GetParam());
  p.targets_dtype = DType::kInt32;
  const Outcome narrow = Compute(p, GetParam());
  ASSERT_TRUE(wide.status.ok() && narrow.status.ok());
  EXPECT_EQ(wide.result.loss, narrow.result.loss);
  EXPECT_EQ(wide.gradient_raw, narrow.gradient_raw);
}

TEST_P(BackendTest, AllRowsIgnored) {
  Problem p = RandomProblem(79, 5, 9, 2, DType::kFloat32);
  p.targets.assign(5, p.options.ignore_index);
  for (Reduction reduction : {Reduction::kMean, Reduction::kSum}) {
    p.options.reduction = reduction;
    p.options.normalizer = 0;
    for (double normalizer : {0.0, 8.0}) {
      p.options.normalizer = normalizer;
      const Outcome o = Compute(p, GetParam());
      ASSERT_TRUE(o.status.ok()) << o.status;
      EXPECT_EQ(o.result.loss, 0.0);  // torch would give NaN for a mean
      EXPECT_EQ(o.result.valid_tokens, 0);
      // A mean's D is the normalizer when one is given, valid rows or not
      // (issue 31: as Evaluate reports it); else 0 without valid rows.
      EXPECT_EQ(o.result.denominator,
                reduction == Reduction::kMean ? normalizer : 0.0);
      for (int64_t r = 0; r < p.rows; ++r) {
        EXPECT_EQ(o.token_loss[r], 0.0f);
        EXPECT_FALSE(IsSentinel(o.token_lse[r]));
        EXPECT_GT(o.token_lse[r], -100.0f);
        for (int64_t c = 0; c < p.vocab; ++c) {
          EXPECT_EQ(FloatBits(o.gradient[r * p.row_stride + c]), 0u);
        }
      }
    }
  }
}

TEST_P(BackendTest, IgnoreIndexInsideTheVocabulary) {
  Problem p = RandomProblem(80, 8, 7, 0, DType::kFloat32);
  p.options.ignore_index = 3;
  p.targets = {3, 0, 3, 6, 1, 3, 2, 4};
  const Outcome o = Compute(p, GetParam());
  ASSERT_TRUE(o.status.ok()) << o.status;
  EXPECT_EQ(o.result.valid_tokens, 5);
  for (int64_t r : {0, 2, 5}) {
    EXPECT_EQ(o.token_loss[r], 0.0f);
    for (int64_t c = 0; c < p.vocab; ++c) {
      EXPECT_EQ(o.gradient[r * p.row_stride + c], 0.0f);
    }
  }
  EXPECT_GT(o.token_loss[1], 0.0f);
}

TEST_P(BackendTest, BadTargetChangesNothing) {
  for (int64_t bad : {int64_t{7}, int64_t{-1}, int64_t{1} << 40}) {
    for (GradientMode mode :
         {GradientMode::kInPlace, GradientMode::kOutOfPlace}) {
      Problem p = RandomProblem(81, 4, 7, 1, DType::kBFloat16);
      p.targets[2] = bad;
      p.mode = mode;
      const Outcome o = Compute(p, GetParam());
      EXPECT_EQ(o.status.code(), absl::StatusCode::kInvalidArgument);
      const std::string expected = "targets[2] = " + std::to_string(bad);
      EXPECT_NE(o.status.message().find(expected), std::string::npos)
          << o.status;
      EXPECT_EQ(o.logits_after, Encode(p.logits, p.dtype));
      EXPECT_EQ(o.result.loss, kSentinelLoss);
      for (int64_t r = 0; r < p.rows; ++r) {
        EXPECT_TRUE(IsSentinel(o.token_loss[r]));
        EXPECT_TRUE(IsSentinel(o.token_lse[r]));
        EXPECT_TRUE(IsSentinel(o.token_argmax[r]));
      }
      if (mode == GradientMode::kOutOfPlace) {
        for (uint8_t byte : o.gradient_raw) ASSERT_EQ(byte, kSentinelByte);
      }
    }
  }
}

TEST_P(BackendTest, NonFiniteLogitsAreCounted) {
  Problem p = RandomProblem(82, 4, 5, 0, DType::kFloat32);
  p.targets = {0, 1, 2, -100};
  p.logits[1 * 5 + 3] = std::numeric_limits<float>::quiet_NaN();
  p.logits[2 * 5 + 0] = std::numeric_limits<float>::infinity();
  p.logits[3 * 5 + 0] = std::numeric_limits<float>::quiet_NaN();  // ignored
  const Outcome o = Compute(p, GetParam());
  ASSERT_TRUE(o.status.ok()) << o.status;
  EXPECT_EQ(o.result.nonfinite_rows, 2);
  EXPECT_FALSE(std::isfinite(o.result.loss));
  EXPECT_TRUE(std::isfinite(o.token_loss[0]));
  EXPECT_EQ(o.token_argmax[1], 3);  // NaN is the maximum, as in torch
}

TEST_P(BackendTest, ZeroRows) {
  CrossEntropyArgs args;
  args.vocab = 5;
  args.row_stride = 5;
  CrossEntropyResult result;
  result.loss = kSentinelLoss;
  const absl::Status status = GetParam() == Backend::kFast
                                  ? CrossEntropyCpu(args, &result)
                                  : CrossEntropyReference(args, &result);
  ASSERT_TRUE(status.ok()) << status;
  EXPECT_EQ(result.loss, 0.0);
  EXPECT_EQ(result.valid_tokens, 0);
}

INSTANTIATE_TEST_SUITE_P(Backends, BackendTest,
                         testing::Values(Backend::kFast, Backend::kReference),
                         [](const testing::TestParamInfo<Backend>& info) {
                           return BackendName(info.param);
                         });

// ---------------------------------------------------------------------------
// Validation.

struct ValidArgs {
  std::vector<float> logits = std::vector<float>(12, 0.5f);
  std::vector<float> gradient = std::vector<float>(12, 0.0f);
  std::vector<int64_t> targets = {0, 1, 2};
  CrossEntropyArgs args;
  ValidArgs() {
    args.rows = 3;
    args.vocab = 4;
    args.row_stride = 4;
    args.logits = logits.data();
    args.gradient = logits.data();
    args.targets = targets.data();
  }
};

TEST(ValidateTest, AcceptsValidArgs) {
  ValidArgs v;
  EXPECT_TRUE(ValidateCrossEntropyArgs(v.args).ok());
}

TEST(ValidateTest, RejectsEachBadFieldByName) {
  struct Case {
    std::string field;
    void (*mutate)(ValidArgs*);
  };
  const std::vector<Case> cases = {
      {"rows", [](ValidArgs* v) { v->args.rows = -1; }},
      {"vocab", [](ValidArgs* v) { v->args.vocab = 0; }},
      {"row_stride", [](ValidArgs* v) { v->args.row_stride = 3; }},
      {"overflows",
       [](ValidArgs* v) { v->args.row_stride = int64_t{1} << 62; }},
      {"logits_dtype",
       [](ValidArgs* v) { v->args.logits_dtype = DType::kInt32; }},
      {"targets_dtype",
       [](ValidArgs* v) { v->args.targets_dtype = DType::kFloat32; }},
      {"logits is nullptr",
       [](ValidArgs* v) {
         v->args.logits = nullptr;
         v->args.gradient = nullptr;
       }},
      {"targets is nullptr", [](ValidArgs* v) { v->args.targets = nullptr; }},
      {"in-place", [](ValidArgs* v) { v->args.gradient = v->gradient.data(); }},
      {"out-of-place",
       [](ValidArgs* v) { v->args.mode = GradientMode::kOutOfPlace; }},
      {"out-of-place",
       [](ValidArgs* v) {
         v->args.mode = GradientMode::kOutOfPlace;
         v->args.gradient = v->logits.data() + 4;  // overlaps
       }},
      {"mode none", [](ValidArgs* v) { v->args.mode = GradientMode::kNone; }},
      {"mode must be",
       [](ValidArgs* v) { v->args.mode = static_cast<GradientMode>(9); }},
      {"reduction",
       [](ValidArgs* v) {
         v->args.options.reduction = static_cast<Reduction>(0);
       }},
      {"label_smoothing",
       [](ValidArgs* v) { v->args.options.label_smoothing = 1.5f; }},
      {"label_smoothing",
       [](ValidArgs* v) {
         v->args.options.label_smoothing =
             std::numeric_limits<float>::quiet_NaN();
       }},
      {"z_loss_scale",
       [](ValidArgs* v) { v->args.options.z_loss_scale = -1e-4f; }},
      {"softcap", [](ValidArgs* v) { v->args.options.softcap = -1.0f; }},
      {"softcap",
       [](ValidArgs* v) {
         v->args.options.softcap = std::numeric_limits<float>::infinity();
       }},
      {"normalizer", [](ValidArgs* v) { v->args.options.normalizer = -2.0; }},
      {"grad_scale",
       [](ValidArgs* v) {
         v->args.options.grad_scale = std::numeric_limits<float>::infinity();
       }},
  };
  for (const Case& c : cases) {
    ValidArgs v;
    c.mutate(&v);
    const absl::Status status = ValidateCrossEntropyArgs(v.args);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_NE(status.message().find(c.field), std::string::npos)
        << "message '" << status.message() << "' does not name " << c.field;
    CrossEntropyResult result;
    EXPECT_EQ(CrossEntropyCpu(v.args, &result).code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(v.logits, std::vector<float>(12, 0.5f)) << c.field;
  }
  ValidArgs v;
  EXPECT_EQ(CrossEntropyCpu(v.args, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CrossEntropyReference(v.args, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(CheckTargetsTest, NamesTheFirstBadRow) {
  const std::vector<int32_t> targets = {0, -100, 3, 9, -5};
  EXPECT_TRUE(CheckTargets(targets.data(), DType::kInt32, 3, 4, -100).ok());
  const absl::Status status =
      CheckTargets(targets.data(), DType::kInt32, 5, 4, -100);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("targets[3] = 9"), std::string::npos)
      << status;
  EXPECT_EQ(CheckTargets(nullptr, DType::kInt64, 1, 4, -100).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(CheckTargets(nullptr, DType::kInt64, 0, 4, -100).ok());
}

}  // namespace
}  // namespace lossd
