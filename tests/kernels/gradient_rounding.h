// The gradient's rounding promise (docs/api.md "Precision"), checked against
// the contract's formula in fp64 on the inputs that exposed label smoothing's
// cancellation: shared by the CPU and CUDA kernel tests.
#ifndef LOSSD_TESTS_KERNELS_GRADIENT_ROUNDING_H_
#define LOSSD_TESTS_KERNELS_GRADIENT_ROUNDING_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "common/float16.h"
#include "common/loss_options.h"
#include "kernels/cross_entropy.h"

namespace lossd {
namespace rounding_test {

// Logits normal * scale, a fraction of the rows ignored, mean reduction.
struct RoundingCase {
  std::string name;
  int64_t rows = 256;
  int64_t vocab = 128256;
  DType dtype = DType::kBFloat16;
  float label_smoothing = 0.1f;
  float z_loss_scale = 1e-4f;
  float softcap = 0.0f;
  bool weights = false;
  double ignore_fraction = 0.25;
  double scale = 3.0;
  // fp16 needs one: the mean's cancelling elements (~1e-13) are fp16 zeros.
  float grad_scale = 1.0f;
  uint32_t seed = 1;
};

struct RoundingInputs {
  std::vector<uint8_t> logits;  // rows * vocab elements of dtype
  std::vector<int64_t> targets;
  std::vector<float> weights;  // empty without weights
};

inline double ElementValue(const std::vector<uint8_t>& raw, DType dtype,
                           int64_t i) {
  if (dtype == DType::kFloat32) {
    float f;
    std::memcpy(&f, raw.data() + 4 * i, 4);
    return f;
  }
  uint16_t b;
  std::memcpy(&b, raw.data() + 2 * i, 2);
  return dtype == DType::kBFloat16 ? BF16ToFloat(b) : HalfToFloat(b);
}

inline RoundingInputs MakeRoundingInputs(const RoundingCase& c) {
  std::mt19937_64 rng(c.seed);
  std::normal_distribution<double> gauss(0.0, 1.0);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  std::uniform_int_distribution<int64_t> target(0, c.vocab - 1);
  RoundingInputs in;
  const size_t esize = DTypeSize(c.dtype);
  in.logits.resize(c.rows * c.vocab * esize);
  in.targets.resize(c.rows);
  for (int64_t r = 0; r < c.rows; ++r) {
    in.targets[r] = unit(rng) < c.ignore_fraction ? -100 : target(rng);
    for (int64_t v = 0; v < c.vocab; ++v) {
      const float x = static_cast<float>(gauss(rng) * c.scale);
      uint8_t* dst = in.logits.data() + (r * c.vocab + v) * esize;
      if (c.dtype == DType::kFloat32) {
        std::memcpy(dst, &x, 4);
      } else {
        const uint16_t b =
            c.dtype == DType::kBFloat16 ? FloatToBF16(x) : FloatToHalf(x);
        std::memcpy(dst, &b, 2);
      }
    }
  }
  if (c.weights) {
    std::uniform_real_distribution<float> w(0.25f, 2.0f);
    in.weights.resize(c.vocab);
    for (float& x : in.weights) x = w(rng);
  }
  return in;
}

inline CrossEntropyOptions RoundingOptions(const RoundingCase& c) {
  CrossEntropyOptions o;
  o.label_smoothing = c.label_smoothing;
  o.z_loss_scale = c.z_loss_scale;
  o.softcap = c.softcap;
  o.reduction = Reduction::kMean;
  o.ignore_index = -100;
  o.grad_scale = c.grad_scale;
  return o;
}

// One unit in the last place of the dtype at |v| (subnormals: the smallest).
inline double DTypeUlp(double v, DType dtype) {
  const int mant = dtype == DType::kBFloat16  ? 7
                   : dtype == DType::kFloat16 ? 10
                                              : 23;
  const int min_exp = dtype == DType::kFloat16 ? -14 : -126;
  const int e = v != 0 ? std::max(std::ilogb(v), min_exp) : min_exp;
  return std::ldexp(1.0, e - mant);
}

// The promise: |got - exact| <= (0.5 + slack_ulps) ulp(exact) + k * 2^-24 *
// terms, terms = |s| (|A| p_c + (1 - eps) w_y [c == y] + eps w_c / V): the
// magnitude of what the element adds, as tests/reference/oracle_test.py has.
struct RoundingBound {
  double slack_ulps = 1.0 / 32;
  double k = 1.0;
};

struct RoundingReport {
  double worst_ulps = 0;  // max |got - exact| / ulp(exact)
  double worst_k = 0;     // the smallest k the bound needs
  int64_t over_055_ulp = 0;
  int64_t failures = 0;
  std::string first_failures;  // up to 5
};

// Checks `gradient` (rows * vocab elements of c.dtype) against the fp64
// gradient of the mean loss with label smoothing, z-loss and softcap (the
// gradient with respect to the logits: dz/dx = 1 - tanh^2 folded in, into the
// terms as well).
inline RoundingReport CheckRounding(const RoundingCase& c,
                                    const RoundingInputs& in,
                                    const std::vector<uint8_t>& gradient,
                                    const RoundingBound& bound) {
  RoundingReport rep;
  const int64_t V = c.vocab;
  const double eps = c.label_smoothing, zls = c.z_loss_scale;
  std::vector<double> w(V, 1.0);
  if (c.weights) w.assign(in.weights.begin(), in.weights.end());
  double wtotal = 0, denominator = 0;
  for (double x : w) wtotal += x;
  for (int64_t y : in.targets) {
    if (y != -100) denominator += w[y];
  }
  const double s =
      denominator > 0 ? static_cast<double>(c.grad_scale) / denominator : 0.0;
  std::vector<double> z(V), dfac(V, 1.0);
  for (int64_t r = 0; r < c.rows; ++r) {
    const int64_t y = in.targets[r];
    double m = -INFINITY;
    for (int64_t v = 0; v < V; ++v) {
      z[v] = ElementValue(in.logits, c.dtype, r * V + v);
      if (c.softcap > 0) {
        const double t = std::tanh(z[v] / c.softcap);
        z[v] = c.softcap * t;
        dfac[v] = 1 - t * t;
      }
      m = std::max(m, z[v]);
    }
    double sum = 0;
    for (int64_t v = 0; v < V; ++v) sum += std::exp(z[v] - m);
    const double lse = m + std::log(sum);
    const bool valid = y != -100;
    const double wy = valid ? w[y] : 0.0;
    const double a = (1 - eps) * wy + eps * wtotal / V + 2 * zls * lse;
    for (int64_t v = 0; v < V; ++v) {
      double want = 0, terms = 0;
      if (valid) {
        const double p = std::exp(z[v] - lse);
        const double hot = v == y ? (1 - eps) * wy : 0.0;
        want = s * (p * a - hot - eps * w[v] / V) * dfac[v];
        terms = s * (p * std::fabs(a) + hot + eps * w[v] / V) * dfac[v];
      }
      const double got = ElementValue(gradient, c.dtype, r * V + v);
      const double err = std::fabs(got - want);
      const double ulp = DTypeUlp(want, c.dtype);
      const double unit = std::ldexp(terms, -24);
      rep.worst_ulps = std::max(rep.worst_ulps, err / ulp);
      if (err > 0.55 * ulp) ++rep.over_055_ulp;
      const double beyond = err - (0.5 + bound.slack_ulps) * ulp;
      if (beyond > 0) {
        rep.worst_k = std::max(rep.worst_k, unit > 0 ? beyond / unit : 1e30);
      }
      if (!(beyond <= bound.k * unit)) {
        if (rep.failures < 5) {
          char line[256];
          std::snprintf(line, sizeof(line),
                        "  row %lld col %lld: got %.9g want %.9g (%.2f ulp)\n",
                        static_cast<long long>(r), static_cast<long long>(v),
                        got, want, err / ulp);
          rep.first_failures += line;
        }
        ++rep.failures;
      }
    }
  }
  return rep;
}

inline void PrintRoundingReport(const std::string& what,
                                const RoundingReport& rep) {
  std::printf(
      "  %-44s worst %.3f ulp, %lld > 0.55 ulp, needs k = %.2f, %lld over "
      "the bound\n",
      what.c_str(), rep.worst_ulps, static_cast<long long>(rep.over_055_ulp),
      rep.worst_k, static_cast<long long>(rep.failures));
}

}  // namespace rounding_test
}  // namespace lossd

#endif  // LOSSD_TESTS_KERNELS_GRADIENT_ROUNDING_H_
