// The CUDA cross-entropy's gradient against the contract's formula in fp64, at
// the oracle's precision, on the configurations the oracle failed once;
// skipped without a GPU.
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

// The oracle's gradient check (tests/reference/oracle_test.py) against the
// contract's formula in fp64: fp32 within 1e-6 absolute (relative past 1);
// halves within one rounding of the dtype plus 64 fp32 ulps of the terms that
// cancel. The fp32-rounded reference of CheckCase is too coarse to see the
// few-ulp errors the oracle found on the H200 (issue 3).
double Ulp(double v, DType dtype) {
  const int mant = dtype == DType::kBFloat16 ? 7 : 10;
  const int min_exp = dtype == DType::kBFloat16 ? -126 : -14;
  const int e = v != 0 ? std::max(std::ilogb(v), min_exp) : min_exp;
  return std::ldexp(1.0, e - mant);
}

void CheckOraclePrecision(const Case& c, uint32_t seed) {
  SCOPED_TRACE(absl::StrCat(c.name, " seed=", seed));
  const Inputs in = MakeInputs(c, seed);
  const Outputs gpu = RunGpu(c, in);
  ASSERT_TRUE(gpu.status.ok()) << gpu.status;
  const int64_t stride = c.vocab + c.pad, V = c.vocab;
  const CrossEntropyOptions& o = c.options;
  const double eps = o.label_smoothing, zls = o.z_loss_scale, cap = o.softcap;
  std::vector<double> w(V, 1.0);
  if (c.weights) w.assign(in.weights.begin(), in.weights.end());
  double wtotal = 0, denominator = 0;
  for (double x : w) wtotal += x;
  std::vector<int64_t> y(c.rows);
  for (int64_t r = 0; r < c.rows; ++r) {
    if (c.targets_dtype == DType::kInt64) {
      std::memcpy(&y[r], in.targets.data() + 8 * r, 8);
    } else {
      int32_t t;
      std::memcpy(&t, in.targets.data() + 4 * r, 4);
      y[r] = t;
    }
    if (y[r] != o.ignore_index) denominator += w[y[r]];
  }
  double s = o.grad_scale;
  if (o.reduction == Reduction::kMean) {
    s = denominator > 0 ? s / (o.normalizer > 0 ? o.normalizer : denominator)
                        : 0.0;
  }
  std::vector<double> ref(c.rows * V, 0.0), terms(c.rows * V, 0.0);
  double max_ref = 0;
  std::vector<double> z(V), dfac(V);
  for (int64_t r = 0; r < c.rows; ++r) {
    if (y[r] == o.ignore_index) continue;
    double m = -INFINITY;
    for (int64_t v = 0; v < V; ++v) {
      const double x = ToFloat(in.logits, c.dtype, r * stride + v);
      const double t = cap > 0 ? std::tanh(x / cap) : 0.0;
      z[v] = cap > 0 ? cap * t : x;
      dfac[v] = cap > 0 ? 1.0 - t * t : 1.0;
      m = std::max(m, z[v]);
    }
    double sum = 0;
    for (int64_t v = 0; v < V; ++v) sum += std::exp(z[v] - m);
    const double lse = m + std::log(sum);
    const double wy = w[y[r]];
    const double a = (1 - eps) * wy + eps * wtotal / V + 2 * zls * lse;
    for (int64_t v = 0; v < V; ++v) {
      const double pc = std::exp(z[v] - lse);
      const double hot = v == y[r] ? (1 - eps) * wy : 0.0;
      const double g = s * (pc * a - hot - eps * w[v] / V) * dfac[v];
      ref[r * V + v] = g;
      terms[r * V + v] =
          std::fabs(s) * (pc * std::fabs(a) + hot + eps * w[v] / V);
      max_ref = std::max(max_ref, std::fabs(g));
    }
  }
  int bad = 0;
  double worst = 0;
  for (int64_t r = 0; r < c.rows && bad < 5; ++r) {
    for (int64_t v = 0; v < V && bad < 5; ++v) {
      const double got = ToFloat(gpu.gradient, c.dtype, r * stride + v);
      const double want = ref[r * V + v];
      const double tol = c.dtype == DType::kFloat32
                             ? 1e-6 * std::max(1.0, max_ref)
                             : 64 * std::ldexp(1.0, -23) * terms[r * V + v] +
                                   Ulp(want, c.dtype);
      worst = std::max(worst, std::fabs(got - want) / tol);
      if (!(std::fabs(got - want) <= tol)) {
        ADD_FAILURE() << "gradient row " << r << " col " << v << ": got " << got
                      << " want " << want << " |err| " << std::fabs(got - want)
                      << " > tol " << tol;
        ++bad;
      }
    }
  }
  std::printf("  %-40s worst |err|/tol %.3f\n", c.name.c_str(), worst);
}

// The oracle's failing configurations (seed 1199677219, cases 7, 38, 87, 98,
// 143) and their aligned twins, on every path that can take them.
TEST_F(CudaCrossEntropyTest, OraclePrecision) {
  std::vector<Case> cases;
  // 0: auto, -1: generic rows, 4: cluster register rows (generic rows where
  // they cannot), 5: cluster stream rows.
  auto add = [&](Case c, std::initializer_list<int> versions) {
    for (int version : versions) {
      Case v = c;
      v.config.schedule =
          version == -1  ? CrossEntropyCudaSchedule::kGenericRows
          : version == 4 ? CrossEntropyCudaSchedule::kClusterRegisterRows
          : version == 5 ? CrossEntropyCudaSchedule::kClusterStreamRows
                         : CrossEntropyCudaSchedule::kAuto;
      v.name =
          absl::StrCat(c.name, version == -1  ? " generic"
                               : version == 0 ? " auto"
                                              : absl::StrCat(" v", version));
      cases.push_back(v);
    }
  };
  {  // case 7: eps = 1, fp16, sum, grad_scale
    Case c = Make("eps=1 fp16 V=1000", 12, 1000, DType::kFloat16);
    c.options.label_smoothing = 1.0f;
    c.options.reduction = Reduction::kSum;
    c.options.grad_scale = 3.656f;
    add(c, {0, -1});
  }
  for (int64_t v : {50257, 50256, 131072}) {  // case 38: |lse| ~ 30, fp32
    Case c = Make(absl::StrCat("lse~30 fp32 V=", v), 3, v, DType::kFloat32);
    c.scale = 8.0;
    c.offset = -5.0;
    c.options.reduction = Reduction::kNone;
    c.mode = GradientMode::kOutOfPlace;
    add(c, {0, 4, -1});
  }
  {  // case 87: eps = 1 + z-loss, bf16
    Case c = Make("eps=1 z-loss bf16 V=32000", 4, 32000, DType::kBFloat16);
    c.options.label_smoothing = 1.0f;
    c.options.z_loss_scale = 1e-4f;
    c.options.reduction = Reduction::kNone;
    add(c, {0, -1});
  }
  for (int64_t v : {4097, 4096}) {  // case 98: z-loss, weights, fp32, scale 8
    Case c =
        Make(absl::StrCat("z-loss weights fp32 V=", v), 35, v, DType::kFloat32);
    c.scale = 8.0;
    c.weights = true;
    c.options.z_loss_scale = 0.0116f;
    c.options.reduction = Reduction::kSum;
    c.options.grad_scale = 3.894f;
    add(c, {0, -1});
  }
  for (int64_t pad : {0, 7}) {  // case 143: eps = 1 + softcap, bf16
    Case c = Make(absl::StrCat("eps=1 softcap bf16 pad=", pad), 6, 50257,
                  DType::kBFloat16);
    c.pad = pad;
    c.options.label_smoothing = 1.0f;
    c.options.softcap = 19.43f;
    c.options.reduction = Reduction::kNone;
    add(c, {0, -1});
  }
  for (int64_t v : {50257, 32000}) {
    // The CPU oracle's seed 2497868560, case 384: softcap 21 with |z| ~ 15-20
    // in fp32, where a few ulps of z = c tanh(x / c) move every p by ~1e-6.
    Case c = Make(absl::StrCat("softcap 21 eps=1 z-loss fp32 V=", v), 24, v,
                  DType::kFloat32);
    c.scale = 4.5;  // the largest x ~ 19, z ~ 15: a few classes dominate
    c.options.softcap = 21.0f;
    c.options.label_smoothing = 1.0f;
    c.options.z_loss_scale = 1e-3f;
    c.options.grad_scale = 3.65f;
    c.options.reduction = Reduction::kSum;
    add(c, {0, -1});
  }
  for (DType d : {DType::kFloat32, DType::kBFloat16}) {  // the fast paths
    Case c = Make("z-loss mean scale 8", 16, 65536, d);
    c.scale = 8.0;
    c.offset = 7.5;
    c.ignore_fraction = 0.2;
    c.options.z_loss_scale = 0.05f;
    add(c, {5, 4, -1});
    Case e = Make("eps 0.9 weights smoothing", 8, 40000, d);
    e.weights = true;
    e.options.label_smoothing = 0.9f;
    add(e, {0, -1});
  }
  uint32_t seed = 600;
  for (Case& c : cases) {
    c.logits = Logits::kGaussian;
    c.targets_dtype = seed % 2 ? DType::kInt32 : DType::kInt64;
    CheckOraclePrecision(c, seed++);
  }
}

}  // namespace
}  // namespace cuda_ce_test
}  // namespace lossd
