// The shared harness of the linear cross-entropy tests (CPU and CUDA): seeded
// random problems, an fp64 reference (Z and the GEMMs in fp64 around the fp64
// cross-entropy reference) and the checks, so both backends pass one bar.
#ifndef LOSSD_TESTS_KERNELS_LINEAR_CROSS_ENTROPY_TEST_UTIL_H_
#define LOSSD_TESTS_KERNELS_LINEAR_CROSS_ENTROPY_TEST_UTIL_H_

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/float16.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cross_entropy_cpu.h"
#include "kernels/linear_cross_entropy.h"

namespace lossd {
namespace linear_test {

inline float Decode(const std::vector<uint8_t>& raw, DType dtype, int64_t i) {
  if (dtype == DType::kFloat32) {
    float f;
    std::memcpy(&f, raw.data() + 4 * i, 4);
    return f;
  }
  uint16_t b;
  std::memcpy(&b, raw.data() + 2 * i, 2);
  return dtype == DType::kBFloat16 ? BF16ToFloat(b) : HalfToFloat(b);
}

inline void Encode(std::vector<uint8_t>* raw, DType dtype, int64_t i, float v) {
  if (dtype == DType::kFloat32) {
    std::memcpy(raw->data() + 4 * i, &v, 4);
    return;
  }
  const uint16_t b =
      dtype == DType::kBFloat16 ? FloatToBF16(v) : FloatToHalf(v);
  std::memcpy(raw->data() + 2 * i, &b, 2);
}

// One case of the sweep.
struct Case {
  int64_t rows = 7, hidden = 5, vocab = 3;
  DType dtype = DType::kFloat32;
  bool bias = false;
  bool grad_bias = false;
  bool class_weights = false;
  bool token_outputs = false;
  DType targets_dtype = DType::kInt64;
  GradientMode dx_mode = GradientMode::kOutOfPlace;
  AccumulateMode accumulate = AccumulateMode::kAdd;
  CrossEntropyOptions options;
  uint32_t seed = 1;
  float logit_scale = 2.0f;  // spread of the logits

  std::string Name() const {
    return absl::StrCat(
        rows, "x", hidden, "x", vocab, " ", DTypeName(dtype), " bias=", bias,
        "/", grad_bias, " weights=", class_weights,
        " dx=", static_cast<int>(dx_mode),
        " acc=", static_cast<int>(accumulate),
        " red=", static_cast<int>(options.reduction),
        " eps=", options.label_smoothing, " z=", options.z_loss_scale,
        " cap=", options.softcap, " norm=", options.normalizer,
        " gs=", options.grad_scale, " seed=", seed);
  }
};

// Host buffers of one problem; Args() points at them.
struct Problem {
  Case c;
  std::vector<uint8_t> x, weight, bias, dx;
  std::vector<int64_t> targets64;
  std::vector<int32_t> targets32;
  std::vector<float> class_weights, token_grad, grad_weight, grad_bias;
  std::vector<float> token_loss, token_lse;
  std::vector<int32_t> token_argmax;

  explicit Problem(const Case& cs) : c(cs) {
    std::mt19937 rng(c.seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    const size_t es = DTypeSize(c.dtype);
    x.resize(c.rows * c.hidden * es);
    weight.resize(c.vocab * c.hidden * es);
    const float w_scale = c.logit_scale / std::sqrt(float(c.hidden));
    for (int64_t i = 0; i < c.rows * c.hidden; ++i)
      Encode(&x, c.dtype, i, normal(rng));
    for (int64_t i = 0; i < c.vocab * c.hidden; ++i)
      Encode(&weight, c.dtype, i, normal(rng) * w_scale);
    if (c.bias) {
      bias.resize(c.vocab * es);
      for (int64_t i = 0; i < c.vocab; ++i)
        Encode(&bias, c.dtype, i, normal(rng));
    }
    std::uniform_int_distribution<int64_t> target(0, c.vocab - 1);
    for (int64_t r = 0; r < c.rows; ++r) {
      // About one row in five is ignored.
      const int64_t t = (rng() % 5 == 0) ? c.options.ignore_index : target(rng);
      targets64.push_back(t);
      targets32.push_back(static_cast<int32_t>(t));
    }
    if (c.class_weights) {
      std::uniform_real_distribution<float> u(0.25f, 2.0f);
      for (int64_t v = 0; v < c.vocab; ++v) class_weights.push_back(u(rng));
    }
    if (c.options.reduction == Reduction::kNone && WantsGradient()) {
      std::uniform_real_distribution<float> u(-1.5f, 1.5f);
      for (int64_t r = 0; r < c.rows; ++r) token_grad.push_back(u(rng));
    }
    if (c.dx_mode == GradientMode::kOutOfPlace) {
      dx.assign(x.size(), 0xA5);  // poisoned: every element must be written
    }
    if (c.accumulate != AccumulateMode::kNone) {
      std::uniform_real_distribution<float> u(-0.5f, 0.5f);
      for (int64_t i = 0; i < c.vocab * c.hidden; ++i)
        grad_weight.push_back(u(rng));
      if (c.grad_bias)
        for (int64_t v = 0; v < c.vocab; ++v) grad_bias.push_back(u(rng));
    }
    if (c.token_outputs) {
      token_loss.assign(c.rows, NAN);
      token_lse.assign(c.rows, NAN);
      token_argmax.assign(c.rows, -7);
    }
  }

  bool WantsGradient() const {
    return c.dx_mode != GradientMode::kNone ||
           c.accumulate != AccumulateMode::kNone;
  }

  LinearCrossEntropyArgs Args() {
    LinearCrossEntropyArgs a;
    a.rows = c.rows;
    a.hidden = c.hidden;
    a.vocab = c.vocab;
    a.dtype = c.dtype;
    a.x = x.data();
    a.weight = weight.data();
    a.bias = c.bias ? bias.data() : nullptr;
    a.targets_dtype = c.targets_dtype;
    a.targets = c.targets_dtype == DType::kInt64
                    ? static_cast<const void*>(targets64.data())
                    : static_cast<const void*>(targets32.data());
    a.class_weights = c.class_weights ? class_weights.data() : nullptr;
    a.options = c.options;
    a.token_grad_output = token_grad.empty() ? nullptr : token_grad.data();
    a.dx_mode = c.dx_mode;
    a.dx = c.dx_mode == GradientMode::kInPlace      ? x.data()
           : c.dx_mode == GradientMode::kOutOfPlace ? dx.data()
                                                    : nullptr;
    a.accumulate = c.accumulate;
    a.grad_weight = grad_weight.empty() ? nullptr : grad_weight.data();
    a.grad_bias = grad_bias.empty() ? nullptr : grad_bias.data();
    if (c.token_outputs) {
      a.token_loss = token_loss.data();
      a.token_lse = token_lse.data();
      a.token_argmax = token_argmax.data();
    }
    return a;
  }
};

// What the fp64 reference gives for a Problem (computed before the run).
struct Expected {
  CrossEntropyResult result;
  std::vector<double> dx, grad_weight, grad_bias;
  std::vector<float> token_loss, token_lse;
  std::vector<int32_t> token_argmax;
};

// Z in fp64 (rounded once to fp32 for the fp64 cross-entropy reference), the
// gradient from that reference (fp32 out of place), then dX, dW, dbias in
// fp64.
inline Expected Reference(const Problem& p) {
  const Case& c = p.c;
  const int64_t N = c.rows, H = c.hidden, V = c.vocab;
  std::vector<float> z(N * V), g(N * V, 0.0f);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t v = 0; v < V; ++v) {
      double s = c.bias ? Decode(p.bias, c.dtype, v) : 0.0;
      for (int64_t h = 0; h < H; ++h)
        s += double(Decode(p.x, c.dtype, n * H + h)) *
             Decode(p.weight, c.dtype, v * H + h);
      z[n * V + v] = static_cast<float>(s);
    }
  Expected e;
  e.token_loss.resize(N);
  e.token_lse.resize(N);
  e.token_argmax.resize(N);
  CrossEntropyArgs ce;
  ce.rows = N;
  ce.vocab = V;
  ce.row_stride = V;
  ce.logits_dtype = DType::kFloat32;
  ce.logits = z.data();
  ce.targets_dtype = DType::kInt64;
  ce.targets = p.targets64.data();
  ce.class_weights = c.class_weights ? p.class_weights.data() : nullptr;
  ce.options = c.options;
  ce.mode = GradientMode::kOutOfPlace;
  ce.gradient = g.data();
  ce.token_loss = e.token_loss.data();
  ce.token_lse = e.token_lse.data();
  ce.token_argmax = e.token_argmax.data();
  EXPECT_TRUE(CrossEntropyReference(ce, &e.result).ok());
  std::vector<double> gd(N * V);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t v = 0; v < V; ++v)
      gd[n * V + v] =
          double(g[n * V + v]) * (p.token_grad.empty() ? 1.0 : p.token_grad[n]);
  e.dx.assign(N * H, 0.0);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t v = 0; v < V; ++v)
      for (int64_t h = 0; h < H; ++h)
        e.dx[n * H + h] += gd[n * V + v] * Decode(p.weight, c.dtype, v * H + h);
  if (c.accumulate != AccumulateMode::kNone) {
    const bool add = c.accumulate == AccumulateMode::kAdd;
    e.grad_weight.resize(V * H);
    for (int64_t i = 0; i < V * H; ++i)
      e.grad_weight[i] = add ? p.grad_weight[i] : 0.0;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t v = 0; v < V; ++v)
        for (int64_t h = 0; h < H; ++h)
          e.grad_weight[v * H + h] +=
              gd[n * V + v] * Decode(p.x, c.dtype, n * H + h);
    if (c.grad_bias) {
      e.grad_bias.resize(V);
      for (int64_t v = 0; v < V; ++v) {
        double s = add ? p.grad_bias[v] : 0.0;
        for (int64_t n = 0; n < N; ++n) s += gd[n * V + v];
        e.grad_bias[v] = s;
      }
    }
  }
  return e;
}

// ||a - b|| / max(||b||, floor).
template <typename A>
double RelativeError(const A& a, const std::vector<double>& b,
                     double floor = 1e-30) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < b.size(); ++i) {
    const double d = double(a[i]) - b[i];
    num += d * d;
    den += b[i] * b[i];
  }
  if (std::isnan(num)) return INFINITY;
  return std::sqrt(num) / std::max(std::sqrt(den), floor);
}

// Tolerances a backend is held to (relative Frobenius errors).
struct Tolerance {
  double loss = 1e-5;
  double dx_fp32 = 1e-5, dx_16 = 1e-2;
  double grad_weight = 1e-5;
  double token = 1e-4;  // per-token loss and lse, relative to max(1, |v|)
};

// Runs the backend on `p` (host buffers in, host buffers out).
using Runner = std::function<absl::Status(const LinearCrossEntropyArgs&,
                                          CrossEntropyResult*)>;

// Runs `p`'s rows as `parts` equal calls of `run` (rows a multiple of parts)
// with `normalizer`, the whole batch's denominator: dW and dbias overwritten
// by the first call and added to by the others, as over a step's
// micro-batches. Success: the summed loss; else the first call's error.
inline absl::StatusOr<double> RunMicroBatches(Problem* p, int parts,
                                              double normalizer,
                                              const Runner& run) {
  const Case& c = p->c;
  const int64_t part_rows = c.rows / parts;
  const size_t es = DTypeSize(c.dtype);
  double loss = 0.0;
  for (int part = 0; part < parts; ++part) {
    LinearCrossEntropyArgs a = p->Args();
    const int64_t row0 = part * part_rows;
    a.rows = part_rows;
    a.x = p->x.data() + row0 * c.hidden * es;
    a.dx = p->dx.data() + row0 * c.hidden * es;
    a.targets = p->targets64.data() + row0;
    a.options.normalizer = normalizer;
    a.accumulate =
        part == 0 ? AccumulateMode::kOverwrite : AccumulateMode::kAdd;
    CrossEntropyResult r;
    const absl::Status status = run(a, &r);
    if (!status.ok()) return status;
    loss += r.loss;
  }
  return loss;
}

// Expects `parts`' dW and dbias (RunMicroBatches) within fp32 rounding of
// `whole`'s: the sums differ only in their order.
inline void ExpectSameWeightGradients(const Problem& parts,
                                      const Problem& whole) {
  const auto as_double = [](const std::vector<float>& v) {
    return std::vector<double>(v.begin(), v.end());
  };
  EXPECT_LE(RelativeError(parts.grad_weight, as_double(whole.grad_weight)),
            1e-6);
  EXPECT_LE(RelativeError(parts.grad_bias, as_double(whole.grad_bias)), 1e-6);
}

// Expects two runs of one case to agree bit for bit: loss, dX, dW, dbias.
inline void ExpectSameBits(const Problem& first,
                           const CrossEntropyResult& first_result,
                           const Problem& second,
                           const CrossEntropyResult& second_result) {
  EXPECT_EQ(first_result.loss, second_result.loss);
  EXPECT_EQ(first.dx, second.dx);
  EXPECT_EQ(0, std::memcmp(first.grad_weight.data(), second.grad_weight.data(),
                           first.grad_weight.size() * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(first.grad_bias.data(), second.grad_bias.data(),
                           first.grad_bias.size() * sizeof(float)));
}

// Checks one case end to end against the reference.
inline void CheckCase(const Case& c, const Runner& run, const Tolerance& tol) {
  SCOPED_TRACE(c.Name());
  Problem p(c);
  const Expected e = Reference(p);
  CrossEntropyResult r;
  const absl::Status status = run(p.Args(), &r);
  ASSERT_TRUE(status.ok()) << status;
  const double loss_scale = std::max(1.0, std::fabs(e.result.loss));
  EXPECT_NEAR(r.loss, e.result.loss, tol.loss * loss_scale);
  EXPECT_NEAR(r.z_loss, e.result.z_loss,
              tol.loss * std::max(1.0, std::fabs(e.result.z_loss)));
  EXPECT_EQ(r.valid_tokens, e.result.valid_tokens);
  EXPECT_EQ(r.nonfinite_rows, 0);
  EXPECT_DOUBLE_EQ(r.denominator, e.result.denominator);
  if (c.token_outputs) {
    for (int64_t n = 0; n < c.rows; ++n) {
      EXPECT_NEAR(p.token_loss[n], e.token_loss[n],
                  tol.token * std::max(1.0f, std::fabs(e.token_loss[n])));
      EXPECT_NEAR(p.token_lse[n], e.token_lse[n],
                  tol.token * std::max(1.0f, std::fabs(e.token_lse[n])));
    }
  }
  const double floor = 1e-6;
  if (c.dx_mode != GradientMode::kNone) {
    const std::vector<uint8_t>& out =
        c.dx_mode == GradientMode::kInPlace ? p.x : p.dx;
    std::vector<float> dx(c.rows * c.hidden);
    for (int64_t i = 0; i < c.rows * c.hidden; ++i)
      dx[i] = Decode(out, c.dtype, i);
    EXPECT_LE(RelativeError(dx, e.dx, floor),
              c.dtype == DType::kFloat32 ? tol.dx_fp32 : tol.dx_16);
  }
  if (c.accumulate != AccumulateMode::kNone) {
    EXPECT_LE(RelativeError(p.grad_weight, e.grad_weight, floor),
              tol.grad_weight);
    if (c.grad_bias) {
      EXPECT_LE(RelativeError(p.grad_bias, e.grad_bias, floor),
                tol.grad_weight);
    }
  }
}

// Option set `set` (0 to 5) of the sweeps: plain; sum with smoothing and
// class weights; z-loss with softcap; an explicit normalizer, grad_scale,
// ignore_index 0 and class weights; none-reduction with smoothing and
// softcap; grad_scale with smoothing, z-loss and class weights.
inline void ApplyOptionSet(int set, Case* c) {
  CrossEntropyOptions& o = c->options;
  switch (set) {
    case 0:
      break;
    case 1:
      o.reduction = Reduction::kSum;
      o.label_smoothing = 0.1f;
      c->class_weights = true;
      break;
    case 2:
      o.z_loss_scale = 1e-2f;
      o.softcap = 3.0f;
      break;
    case 3:
      o.normalizer = 5.0;
      o.grad_scale = 0.25f;
      o.ignore_index = 0;
      c->class_weights = true;
      break;
    case 4:
      o.reduction = Reduction::kNone;
      o.label_smoothing = 0.2f;
      o.softcap = 5.0f;
      break;
    default:
      o.grad_scale = 3.0f;
      o.label_smoothing = 0.05f;
      o.z_loss_scale = 1e-3f;
      c->class_weights = true;
      break;
  }
}

// The sweep both backends run: every dtype over awkward shapes, with the
// options, modes and extras rotated so that each appears with each dtype.
inline std::vector<Case> SweepCases() {
  std::vector<Case> cases;
  const int64_t rows_list[] = {1, 7, 64};
  const int64_t hidden_list[] = {1, 5, 64};
  const int64_t vocab_list[] = {1, 3, 257};
  const DType dtypes[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};
  uint32_t seed = 1;
  for (DType dtype : dtypes)
    for (int64_t rows : rows_list)
      for (int64_t hidden : hidden_list)
        for (int64_t vocab : vocab_list) {
          Case c;
          c.rows = rows;
          c.hidden = hidden;
          c.vocab = vocab;
          c.dtype = dtype;
          c.seed = seed++;
          const uint32_t k = c.seed;
          c.bias = k % 2 == 0;
          c.grad_bias = c.bias && k % 4 == 0;
          c.targets_dtype = k % 3 == 0 ? DType::kInt32 : DType::kInt64;
          c.token_outputs = k % 5 < 2;
          const GradientMode modes[] = {GradientMode::kOutOfPlace,
                                        GradientMode::kInPlace,
                                        GradientMode::kNone};
          c.dx_mode = modes[k % 3];
          const AccumulateMode acc[] = {
              AccumulateMode::kAdd, AccumulateMode::kOverwrite,
              AccumulateMode::kAdd, AccumulateMode::kNone};
          c.accumulate = acc[(k / 3) % 4];
          if (c.accumulate == AccumulateMode::kNone) c.grad_bias = false;
          ApplyOptionSet(static_cast<int>(k % 6), &c);
          cases.push_back(c);
        }
  return cases;
}

}  // namespace linear_test
}  // namespace lossd

#endif  // LOSSD_TESTS_KERNELS_LINEAR_CROSS_ENTROPY_TEST_UTIL_H_
