// A float64 reference of LinearForward for the e2e tests (CPU and CUDA
// device): seeded float32 problems, the loss and dX, dW, dbias of a mean or
// sum cross-entropy of X W^T + b, and a tolerance check.
#ifndef LOSSD_TESTS_E2E_LINEAR_REFERENCE_H_
#define LOSSD_TESTS_E2E_LINEAR_REFERENCE_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace lossd {
namespace linear_reference {

inline constexpr int64_t kIgnore = -100;

// A float32 problem: X [rows, width], W [vocab, width], b [vocab], targets.
struct Problem {
  int64_t rows = 0, width = 0, vocab = 0;
  std::vector<float> x, weight, bias;
  std::vector<int64_t> targets;
};

inline Problem MakeProblem(int64_t rows, int64_t width, int64_t vocab,
                           uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int64_t> target(0, vocab - 1);
  Problem p;
  p.rows = rows;
  p.width = width;
  p.vocab = vocab;
  for (int64_t i = 0; i < rows * width; ++i) p.x.push_back(normal(rng));
  for (int64_t i = 0; i < vocab * width; ++i) {
    p.weight.push_back(0.5f * normal(rng));
  }
  for (int64_t i = 0; i < vocab; ++i) p.bias.push_back(0.1f * normal(rng));
  for (int64_t i = 0; i < rows; ++i) {
    p.targets.push_back(i % 5 == 3 ? kIgnore : target(rng));
  }
  return p;
}

// The float64 reference of a mean (over `normalizer`, or the valid rows when
// 0) or sum reduction, times grad_scale.
struct Reference {
  double loss = 0.0;
  std::vector<double> dx, dw, db;
};

// `row_grad` (reduction NONE): row i's gradient is scaled by row_grad[i].
inline Reference Compute(const Problem& p, bool with_bias, bool mean,
                         double normalizer, double grad_scale,
                         const std::vector<float>& row_grad = {}) {
  const int64_t n = p.rows, h = p.width, v = p.vocab;
  Reference r;
  r.dx.assign(n * h, 0.0);
  r.dw.assign(v * h, 0.0);
  r.db.assign(v, 0.0);
  int64_t valid = 0;
  for (int64_t t : p.targets) valid += t != kIgnore;
  const double d = !mean ? 1.0 : normalizer > 0 ? normalizer : valid;
  for (int64_t i = 0; i < n; ++i) {
    if (p.targets[i] == kIgnore) continue;
    std::vector<double> z(v);
    double top = -INFINITY;
    for (int64_t c = 0; c < v; ++c) {
      double sum = with_bias ? p.bias[c] : 0.0;
      for (int64_t k = 0; k < h; ++k) {
        sum += double{p.weight[c * h + k]} * p.x[i * h + k];
      }
      z[c] = sum;
      top = std::max(top, sum);
    }
    double total = 0.0;
    for (double zc : z) total += std::exp(zc - top);
    const double lse = top + std::log(total);
    r.loss += (lse - z[p.targets[i]]) / d;
    for (int64_t c = 0; c < v; ++c) {
      const double g = grad_scale / d *
                       (row_grad.empty() ? 1.0 : double{row_grad[i]}) *
                       (std::exp(z[c] - lse) - (c == p.targets[i] ? 1.0 : 0.0));
      r.db[c] += g;
      for (int64_t k = 0; k < h; ++k) {
        r.dx[i * h + k] += g * p.weight[c * h + k];
        r.dw[c * h + k] += g * p.x[i * h + k];
      }
    }
  }
  return r;
}

inline void ExpectNear(const std::vector<float>& got,
                       const std::vector<double>& want, double tolerance,
                       const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_NEAR(got[i], want[i], tolerance) << what << "[" << i << "]";
  }
}

}  // namespace linear_reference
}  // namespace lossd

#endif  // LOSSD_TESTS_E2E_LINEAR_REFERENCE_H_
