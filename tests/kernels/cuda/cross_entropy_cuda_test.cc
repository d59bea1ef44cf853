// Checks the CUDA cross-entropy against the fp64 CPU reference on seeded random
// inputs over awkward shapes, every option and mode; skipped without a GPU.
#include "kernels/cuda/cross_entropy_cuda.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/float16.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cross_entropy_cpu.h"
#include "kernels/cuda/cross_entropy_cuda_host.h"

namespace lossd {
namespace {

bool HaveGpu() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

#define SKIP_WITHOUT_GPU() \
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA GPU visible"

// Owns device memory; copy-free.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    EXPECT_EQ(cudaMalloc(&ptr_, std::max<size_t>(bytes, 1)), cudaSuccess);
  }
  ~DeviceBuffer() { cudaFree(ptr_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void* get() const { return ptr_; }
  void Upload(const void* host) {
    ASSERT_EQ(cudaMemcpy(ptr_, host, bytes_, cudaMemcpyHostToDevice),
              cudaSuccess);
  }
  template <typename V>
  std::vector<V> Download() const {
    std::vector<V> out(bytes_ / sizeof(V));
    EXPECT_EQ(cudaMemcpy(out.data(), ptr_, bytes_, cudaMemcpyDeviceToHost),
              cudaSuccess);
    return out;
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_;
};

float ToFloat(const std::vector<uint8_t>& raw, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kFloat32: {
      float f;
      std::memcpy(&f, raw.data() + 4 * i, 4);
      return f;
    }
    case DType::kBFloat16: {
      uint16_t b;
      std::memcpy(&b, raw.data() + 2 * i, 2);
      return BF16ToFloat(b);
    }
    default: {
      uint16_t b;
      std::memcpy(&b, raw.data() + 2 * i, 2);
      return HalfToFloat(b);
    }
  }
}

void FromFloat(std::vector<uint8_t>* raw, DType dtype, int64_t i, float v) {
  if (dtype == DType::kFloat32) {
    std::memcpy(raw->data() + 4 * i, &v, 4);
  } else {
    const uint16_t b =
        dtype == DType::kBFloat16 ? FloatToBF16(v) : FloatToHalf(v);
    std::memcpy(raw->data() + 2 * i, &b, 2);
  }
}

// kGaussian: normal * scale + offset (the oracle's inputs).
// kNonFinite: rows 1, 2, 3 (mod 4) hold one NaN, -inf or +inf.
enum class Logits { kNormal, kHuge, kTargetDominant, kGaussian, kNonFinite };

struct Case {
  std::string name;
  int64_t rows = 8;
  int64_t vocab = 100;
  int64_t pad = 0;  // row_stride = vocab + pad
  DType dtype = DType::kFloat32;
  DType targets_dtype = DType::kInt64;
  GradientMode mode = GradientMode::kInPlace;
  CrossEntropyOptions options;
  bool weights = false;
  double ignore_fraction = 0.0;
  Logits logits = Logits::kNormal;
  double scale = 1.0, offset = 0.0;  // kGaussian
  bool token_outputs = true;
  CrossEntropyCudaConfig config;
  // Tolerances: gradient elementwise rtol (plus 1e-5 * max|ref|) and the
  // relative tolerance of losses.
  double grad_rtol = 1e-4;
  double loss_rtol = 2e-5;
  bool exact_argmax = true;
  double grad_norm_rtol = 0;  // 0: 1e-5 for fp32, 5e-3 for halves
};

double DefaultGradRtol(DType dtype) {
  return dtype == DType::kFloat32 ? 1e-4 : 1.0 / 128;
}

struct Inputs {
  std::vector<uint8_t> logits;  // rows * stride elements, padding poisoned
  std::vector<uint8_t> targets;
  std::vector<float> weights;
};

Inputs MakeInputs(const Case& c, uint32_t seed) {
  std::mt19937_64 rng(seed);
  const int64_t stride = c.vocab + c.pad;
  const size_t esize = DTypeSize(c.dtype);
  Inputs in;
  in.logits.assign(c.rows * stride * esize, 0xff);  // NaN in the padding
  std::uniform_int_distribution<int64_t> target(0, c.vocab - 1);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  std::vector<int64_t> t(c.rows);
  // A cheap generator for the bulk (the 2^32-element case): xorshift64,
  // uniform in [-range, range).
  uint64_t state = seed * 0x9e3779b97f4a7c15ull + 1;
  const float range = c.logits == Logits::kHuge ? 1e4f : 4.0f;
  std::normal_distribution<double> gauss(0.0, 1.0);
  for (int64_t r = 0; r < c.rows; ++r) {
    t[r] = unit(rng) < c.ignore_fraction ? c.options.ignore_index : target(rng);
    for (int64_t v = 0; v < c.vocab; ++v) {
      state ^= state << 13;
      state ^= state >> 7;
      state ^= state << 17;
      float x = (static_cast<float>(state >> 40) * (1.0f / 16777216.0f) * 2.0f -
                 1.0f) *
                range;
      if (c.logits == Logits::kTargetDominant && v == t[r]) x = 24.0f;
      if (c.logits == Logits::kNonFinite && v == (r * 7919) % c.vocab) {
        const float special[4] = {x, NAN, -INFINITY, INFINITY};
        x = special[r % 4];
      }
      if (c.logits == Logits::kGaussian) {
        x = static_cast<float>(gauss(rng) * c.scale + c.offset);
      }
      FromFloat(&in.logits, c.dtype, r * stride + v, x);
    }
  }
  const size_t tsize = DTypeSize(c.targets_dtype);
  in.targets.resize(c.rows * tsize);
  for (int64_t r = 0; r < c.rows; ++r) {
    if (c.targets_dtype == DType::kInt64) {
      std::memcpy(in.targets.data() + 8 * r, &t[r], 8);
    } else {
      const int32_t v = static_cast<int32_t>(t[r]);
      std::memcpy(in.targets.data() + 4 * r, &v, 4);
    }
  }
  if (c.weights) {
    std::uniform_real_distribution<float> w(0.25f, 2.0f);
    in.weights.resize(c.vocab);
    for (float& x : in.weights) x = w(rng);
  }
  return in;
}

struct Outputs {
  absl::Status status;
  CrossEntropyResult result;
  std::vector<uint8_t> gradient;  // whole strided buffer
  std::vector<uint8_t> logits_after;
  std::vector<float> token_loss, token_lse;
  std::vector<int32_t> token_argmax;
};

CrossEntropyArgs ArgsFor(const Case& c) {
  CrossEntropyArgs a;
  a.rows = c.rows;
  a.vocab = c.vocab;
  a.row_stride = c.vocab + c.pad;
  a.logits_dtype = c.dtype;
  a.targets_dtype = c.targets_dtype;
  a.options = c.options;
  a.mode = c.mode;
  return a;
}

Outputs RunGpu(const Case& c, const Inputs& in) {
  Outputs out;
  const size_t bytes = in.logits.size();
  DeviceBuffer logits(bytes), targets(in.targets.size()),
      weights(in.weights.size() * 4), grad(bytes);
  DeviceBuffer tl(c.rows * 4), tlse(c.rows * 4), targ(c.rows * 4);
  logits.Upload(in.logits.data());
  targets.Upload(in.targets.data());
  if (c.weights) weights.Upload(in.weights.data());
  // Poison every output with NaN / -1 bytes so unwritten elements show.
  cudaMemset(grad.get(), 0xff, bytes);
  cudaMemset(tl.get(), 0xff, c.rows * 4);
  cudaMemset(tlse.get(), 0xff, c.rows * 4);
  cudaMemset(targ.get(), 0xff, c.rows * 4);
  CrossEntropyArgs a = ArgsFor(c);
  a.logits = logits.get();
  a.targets = targets.get();
  a.class_weights =
      c.weights ? static_cast<const float*>(weights.get()) : nullptr;
  a.gradient = c.mode == GradientMode::kInPlace      ? logits.get()
               : c.mode == GradientMode::kOutOfPlace ? grad.get()
                                                     : nullptr;
  if (c.token_outputs) {
    a.token_loss = static_cast<float*>(tl.get());
    a.token_lse = static_cast<float*>(tlse.get());
    a.token_argmax = static_cast<int32_t*>(targ.get());
  }
  out.status = CrossEntropyCuda(a, &out.result, nullptr, &c.config);
  out.logits_after = logits.Download<uint8_t>();
  out.gradient = c.mode == GradientMode::kInPlace ? out.logits_after
                                                  : grad.Download<uint8_t>();
  out.token_loss = tl.Download<float>();
  out.token_lse = tlse.Download<float>();
  out.token_argmax = targ.Download<int32_t>();
  return out;
}

// Runs the reference on rows [first, first + count) of host inputs.
Outputs RunReference(const Case& c, const Inputs& in, int64_t first,
                     int64_t count) {
  Outputs out;
  const int64_t stride = c.vocab + c.pad;
  const size_t esize = DTypeSize(c.dtype);
  std::vector<uint8_t> logits(
      in.logits.begin() + first * stride * esize,
      in.logits.begin() + (first + count) * stride * esize);
  CrossEntropyArgs a = ArgsFor(c);
  a.rows = count;
  a.logits = logits.data();
  a.targets = in.targets.data() + first * DTypeSize(c.targets_dtype);
  a.class_weights = c.weights ? in.weights.data() : nullptr;
  out.gradient.assign(logits.size(), 0xff);
  a.mode = c.mode == GradientMode::kNone ? GradientMode::kNone
                                         : GradientMode::kOutOfPlace;
  a.gradient = c.mode == GradientMode::kNone ? nullptr : out.gradient.data();
  out.token_loss.assign(count, 0);
  out.token_lse.assign(count, 0);
  out.token_argmax.assign(count, 0);
  a.token_loss = out.token_loss.data();
  a.token_lse = out.token_lse.data();
  a.token_argmax = out.token_argmax.data();
  out.status = CrossEntropyReference(a, &out.result);
  return out;
}

// Non-finite values must match in kind (NaN with NaN, inf with the same inf).
bool Close(double got, double want, double atol, double rtol) {
  if (std::isnan(want)) return std::isnan(got);
  if (std::isinf(want)) return got == want;
  return std::fabs(got - want) <= atol + rtol * std::fabs(want);
}

void ExpectNear(double got, double want, double rtol, const std::string& what) {
  EXPECT_TRUE(Close(got, want, rtol, rtol))
      << what << ": got " << got << " want " << want;
}

// Compares rows [first, first+count) of `gpu` with `ref` (which holds only
// those rows).
void CompareRows(const Case& c, const Outputs& gpu, const Outputs& ref,
                 int64_t first, int64_t count, uint32_t seed) {
  SCOPED_TRACE(
      absl::StrCat(c.name, " seed=", seed, " rows ", first, "+", count));
  const int64_t stride = c.vocab + c.pad;
  if (c.mode != GradientMode::kNone) {
    double max_ref = 0, diff2 = 0, ref2 = 0;
    for (int64_t r = 0; r < count; ++r)
      for (int64_t v = 0; v < c.vocab; ++v)
        if (std::isfinite(ToFloat(ref.gradient, c.dtype, r * stride + v)))
          max_ref = std::max<double>(
              max_ref,
              std::fabs(ToFloat(ref.gradient, c.dtype, r * stride + v)));
    const double atol = 1e-5 * max_ref + 1e-7;
    int bad = 0;
    for (int64_t r = 0; r < count && bad < 5; ++r) {
      for (int64_t v = 0; v < stride && bad < 5; ++v) {
        const float g =
            ToFloat(gpu.gradient, c.dtype, (first + r) * stride + v);
        if (v >= c.vocab) {
          // Padding: never written (still the NaN poison, or the input).
          if (!std::isnan(g)) {
            ADD_FAILURE() << "padding written at row " << first + r;
            ++bad;
          }
          continue;
        }
        const float want = ToFloat(ref.gradient, c.dtype, r * stride + v);
        if (std::isfinite(want)) {
          diff2 += (double(g) - want) * (double(g) - want);
          ref2 += double(want) * want;
        }
        if (!Close(g, want, atol, c.grad_rtol)) {
          ADD_FAILURE() << "gradient row " << first + r << " col " << v
                        << ": got " << g << " want " << want;
          ++bad;
        }
      }
    }
    if (ref2 > 0) {
      const double norm_tol = c.grad_norm_rtol > 0         ? c.grad_norm_rtol
                              : c.dtype == DType::kFloat32 ? 1e-5
                                                           : 5e-3;
      EXPECT_LE(std::sqrt(diff2 / ref2), norm_tol);
    }
  }
  if (c.token_outputs) {
    for (int64_t r = 0; r < count; ++r) {
      ExpectNear(gpu.token_loss[first + r], ref.token_loss[r], c.loss_rtol,
                 absl::StrCat("token_loss ", first + r));
      ExpectNear(gpu.token_lse[first + r], ref.token_lse[r], 2e-6,
                 absl::StrCat("token_lse ", first + r));
      if (c.exact_argmax) {
        EXPECT_EQ(gpu.token_argmax[first + r], ref.token_argmax[r])
            << "token_argmax " << first + r;
      }
    }
  }
}

void CheckCase(const Case& c, uint32_t seed) {
  const Inputs in = MakeInputs(c, seed);
  const Outputs gpu = RunGpu(c, in);
  ASSERT_TRUE(gpu.status.ok()) << c.name << ": " << gpu.status;
  const Outputs ref = RunReference(c, in, 0, c.rows);
  ASSERT_TRUE(ref.status.ok()) << ref.status;
  CompareRows(c, gpu, ref, 0, c.rows, seed);
  SCOPED_TRACE(absl::StrCat(c.name, " seed=", seed));
  ExpectNear(gpu.result.loss, ref.result.loss, c.loss_rtol, "loss");
  ExpectNear(gpu.result.z_loss, ref.result.z_loss, c.loss_rtol, "z_loss");
  ExpectNear(gpu.result.denominator, ref.result.denominator, 1e-12,
             "denominator");
  EXPECT_EQ(gpu.result.valid_tokens, ref.result.valid_tokens);
  EXPECT_EQ(gpu.result.nonfinite_rows, ref.result.nonfinite_rows);
  if (c.exact_argmax) {
    EXPECT_EQ(gpu.result.correct_tokens, ref.result.correct_tokens);
  }
  if (c.mode != GradientMode::kInPlace) {
    EXPECT_EQ(gpu.logits_after, in.logits) << "logits changed";
  }
}

class CudaCrossEntropyTest : public ::testing::Test {
 protected:
  void SetUp() override { SKIP_WITHOUT_GPU(); }
};

Case Make(std::string name, int64_t rows, int64_t vocab, DType dtype) {
  Case c;
  c.name = std::move(name);
  c.rows = rows;
  c.vocab = vocab;
  c.dtype = dtype;
  c.grad_rtol = DefaultGradRtol(dtype);
  return c;
}

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

// Cluster stream rows (v5) with slices of 16 to 64 KiB, in place and out of
// place, p_y -> 1 rows (the second exchange) and tails that cut a vector,
// against the reference. (The occupancy caps of the sweep left with the bench
// knobs: bench/NOTES.md.)
TEST_F(CudaCrossEntropyTest, StreamKernelConfigs) {
  uint32_t seed = 700;
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    for (int slice : {16, 32, 64}) {
      for (GradientMode mode :
           {GradientMode::kInPlace, GradientMode::kOutOfPlace}) {
        Case c = Make(
            absl::StrCat("v5 slice=", slice, " mode=", static_cast<int>(mode)),
            7, 100003, dtype);
        c.pad = dtype == DType::kFloat32 ? 1 : 5;  // 16-byte rows
        c.config.schedule = CrossEntropyCudaSchedule::kClusterStreamRows;
        c.config.piece_kib = slice;
        c.mode = mode;
        c.ignore_fraction = 0.3;
        c.options.z_loss_scale = 1e-3f;
        CheckCase(c, seed++);
      }
    }
    Case d = Make("v5 p_y -> 1", 6, 131072, dtype);
    d.logits = Logits::kTargetDominant;
    d.config.schedule = CrossEntropyCudaSchedule::kClusterStreamRows;
    CheckCase(d, seed++);
    Case f = Make("v5 forward only", 9, 131072, dtype);
    f.config.schedule = CrossEntropyCudaSchedule::kClusterStreamRows;
    f.mode = GradientMode::kNone;
    CheckCase(f, seed++);
  }
}

// Cluster slice rows (v6: slices in shared memory, bulk copies, persistent
// clusters): slice sizes that give clusters of 1 to 16 blocks, as many stages
// as fit (2 at 48 KiB), more rows than resident clusters (so each cluster
// loops and the pipeline turns over), ignored rows, padded rows, every mode,
// and the rare p_max -> 1 exchange. (The 512-thread build and the stages knob
// left with the bench knobs: bench/NOTES.md.)
TEST_F(CudaCrossEntropyTest, TmaKernelConfigs) {
  uint32_t seed = 900;
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    for (int slice : {8, 32, 48}) {
      for (GradientMode mode :
           {GradientMode::kInPlace, GradientMode::kOutOfPlace}) {
        // Clusters of at most 16: the 8 KiB slices on shorter rows.
        const int64_t vocab = slice == 8 ? 16000 : 100000;
        Case c = Make(
            absl::StrCat("v6 slice=", slice, " mode=", static_cast<int>(mode)),
            300, vocab, dtype);
        c.pad = dtype == DType::kFloat32 ? 4 : 8;  // 16-byte rows
        c.config.schedule = CrossEntropyCudaSchedule::kClusterSliceRows;
        c.config.piece_kib = slice;
        c.ignore_fraction = 0.3;
        c.options.z_loss_scale = 1e-3f;
        c.options.grad_scale = 0.5f;
        c.mode = mode;
        CheckCase(c, seed++);
      }
    }
    Case d = Make("v6 p_y -> 1", 300, 131072, dtype);
    d.logits = Logits::kTargetDominant;
    d.config.schedule = CrossEntropyCudaSchedule::kClusterSliceRows;
    CheckCase(d, seed++);
    for (int slice : {32, 48}) {
      Case f = Make(absl::StrCat("v6 forward only, slice=", slice), 300, 131072,
                    dtype);
      f.config.schedule = CrossEntropyCudaSchedule::kClusterSliceRows;
      f.config.piece_kib = slice;
      f.mode = GradientMode::kNone;
      f.options.reduction = Reduction::kSum;
      CheckCase(f, seed++);
    }
    Case f1 = Make("v6 forward only, p_y -> 1", 300, 131072, dtype);
    f1.logits = Logits::kTargetDominant;
    f1.config.schedule = CrossEntropyCudaSchedule::kClusterSliceRows;
    f1.mode = GradientMode::kNone;
    CheckCase(f1, seed++);
    Case s = Make("v6 one row, one block", 1, 32000, dtype);
    s.config.schedule = CrossEntropyCudaSchedule::kClusterSliceRows;
    CheckCase(s, seed++);
  }
}

// v7 (forward-only, row pieces on independent blocks): piece sizes that give
// 1 to 16 pieces a row (the last one short), padded rows, ignored rows, z-loss,
// per-token outputs, every reduction, and p_max -> 1 (a thread's exact second
// sum).
TEST_F(CudaCrossEntropyTest, PieceKernelConfigs) {
  uint32_t seed = 1100;
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    for (int slice : {8, 32, 64, 128}) {
      Case c = Make(absl::StrCat("v7 slice=", slice), 257, 100000, dtype);
      c.pad = dtype == DType::kFloat32 ? 4 : 8;  // 16-byte rows
      c.mode = GradientMode::kNone;
      c.config.schedule = CrossEntropyCudaSchedule::kSplitRowForward;
      c.config.piece_kib = slice;
      c.ignore_fraction = 0.3;
      c.options.z_loss_scale = 1e-3f;
      c.options.reduction = slice == 32 ? Reduction::kSum : Reduction::kMean;
      CheckCase(c, seed++);
    }
    Case d = Make("v7 p_y -> 1", 300, 131072, dtype);
    d.logits = Logits::kTargetDominant;
    d.mode = GradientMode::kNone;
    d.config.schedule = CrossEntropyCudaSchedule::kSplitRowForward;
    CheckCase(d, seed++);
    Case a = Make("v7 auto, 262144", 40, 262144, dtype);
    a.mode = GradientMode::kNone;
    CheckCase(a, seed++);
  }
}

// L2 row pieces (v8: forward+gradient on row pieces through L2, one
// persistent kernel, 2-byte logits): pieces of 8 to 256 KiB, groups of one to
// many rows (so that statistics and gradient items of different groups
// interleave), in place and out of place, ignored rows, z-loss, grad_scale,
// p_y -> 1, NaN and infinite logits. (fp32 and the runs without L2 hints left
// with the bench knobs: bench/NOTES.md.)
TEST_F(CudaCrossEntropyTest, L2PieceKernelConfigs) {
  uint32_t seed = 1200;
  for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
    for (int slice : {8, 64, 256}) {
      for (int group : {1, 16}) {
        Case c = Make(absl::StrCat("v8 slice=", slice, " group=", group, "MiB"),
                      300, 100000, dtype);
        c.pad = dtype == DType::kFloat32 ? 4 : 8;  // 16-byte rows
        c.config.schedule = CrossEntropyCudaSchedule::kL2RowPieces;
        c.config.piece_kib = slice;
        c.config.group_mib = group;
        c.ignore_fraction = 0.3;
        c.options.z_loss_scale = 1e-3f;
        c.options.grad_scale = 0.5f;
        c.mode =
            group == 1 ? GradientMode::kOutOfPlace : GradientMode::kInPlace;
        CheckCase(c, seed++);
      }
    }
    Case d = Make("v8 p_y -> 1", 300, 131072, dtype);
    d.logits = Logits::kTargetDominant;
    d.config.schedule = CrossEntropyCudaSchedule::kL2RowPieces;
    d.config.group_mib = 2;
    CheckCase(d, seed++);
  }
  for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
    Case nf = Make("v8 NaN and inf logits", 64, 8192, dtype);
    nf.logits = Logits::kNonFinite;
    nf.config.schedule = CrossEntropyCudaSchedule::kL2RowPieces;
    nf.config.piece_kib = 8;
    nf.config.group_mib = 1;
    nf.exact_argmax = false;  // NaN rows: the first max is not defined
    CheckCase(nf, seed++);
    Case one = Make("v8 one row", 1, 32000, dtype);
    one.config.schedule = CrossEntropyCudaSchedule::kL2RowPieces;
    CheckCase(one, seed++);
  }
}

// Smem row pieces (v9: forward+gradient on row pieces kept in shared memory):
// pieces of 8 to 96 KiB (one to 13 a row), in place and out of place (for
// 2-byte logits: the threads' loads and bulk copies), the L2 prefetch where
// four blocks fit a SM and none where they do not (96 KiB), ignored rows,
// z-loss, grad_scale, p_y -> 1, NaN and infinite logits, one row. (The 128-
// and 512-thread builds and the prefetch knob left with the bench knobs.)
TEST_F(CudaCrossEntropyTest, SmemPieceKernelConfigs) {
  uint32_t seed = 1300;
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    for (int slice : {8, 48, 96}) {
      Case c = Make(absl::StrCat("v9 slice=", slice), 300, 100000, dtype);
      c.pad = dtype == DType::kFloat32 ? 4 : 8;  // 16-byte rows
      c.config.schedule = CrossEntropyCudaSchedule::kSmemRowPieces;
      c.config.piece_kib = slice;
      c.ignore_fraction = 0.3;
      c.options.z_loss_scale = 1e-3f;
      c.options.grad_scale = 0.5f;
      c.mode = slice == 48 ? GradientMode::kOutOfPlace : GradientMode::kInPlace;
      CheckCase(c, seed++);
    }
    Case d = Make("v9 p_y -> 1", 300, 131072, dtype);
    d.logits = Logits::kTargetDominant;
    d.config.schedule = CrossEntropyCudaSchedule::kSmemRowPieces;
    CheckCase(d, seed++);
    // Pieces by the threads' loads (2-byte logits in place) and by bulk
    // copies (in chunks of one batch, 16 KiB, the last piece of a row
    // shorter), default and 27 KiB pieces.
    for (int kib : {0, 27}) {
      for (GradientMode mode :
           {GradientMode::kInPlace, GradientMode::kOutOfPlace}) {
        Case b =
            Make(absl::StrCat("v9 mode=", static_cast<int>(mode), " kib=", kib),
                 200, 100000, dtype);
        b.pad = dtype == DType::kFloat32 ? 4 : 8;
        b.config.schedule = CrossEntropyCudaSchedule::kSmemRowPieces;
        b.config.piece_kib = kib;
        b.ignore_fraction = 0.3;
        b.options.z_loss_scale = 1e-3f;
        b.mode = mode;
        CheckCase(b, seed++);
      }
    }
  }
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    Case big = Make("v9 262144", 40, 262144, dtype);
    big.config.schedule = CrossEntropyCudaSchedule::kSmemRowPieces;
    CheckCase(big, seed++);
    Case nf = Make("v9 NaN and inf logits", 64, 8192, dtype);
    nf.logits = Logits::kNonFinite;
    nf.config.schedule = CrossEntropyCudaSchedule::kSmemRowPieces;
    nf.config.piece_kib = 8;
    nf.exact_argmax = false;  // NaN rows: the first max is not defined
    CheckCase(nf, seed++);
    Case one = Make("v9 one row", 1, 32000, dtype);
    one.config.schedule = CrossEntropyCudaSchedule::kSmemRowPieces;
    CheckCase(one, seed++);
  }
  // Rows whose 32 pieces pass a block's shared memory (fp32, 8 MB rows):
  // the automatic choice falls back to another path, same results.
  Case wide = Make("v9 pieces past shared memory", 3, 2000000, DType::kFloat32);
  CheckCase(wide, seed++);
}

// Small v9 cases for compute-sanitizer (scripts/gpu-run): 2 pieces a row,
// ignored rows, both modes (the threads' loads and bulk copies), fp32 too.
TEST_F(CudaCrossEntropyTest, SmemPieceKernelSmall) {
  uint32_t seed = 1350;
  for (GradientMode mode :
       {GradientMode::kInPlace, GradientMode::kOutOfPlace}) {
    Case c = Make("v9 small", 96, 8192, DType::kBFloat16);
    c.config.schedule = CrossEntropyCudaSchedule::kSmemRowPieces;
    c.config.piece_kib = 8;
    c.ignore_fraction = 0.2;
    c.mode = mode;
    CheckCase(c, seed++);
    c.dtype = DType::kFloat32;  // bulk copies in both modes
    c.config.piece_kib = 16;
    c.grad_rtol = DefaultGradRtol(c.dtype);
    CheckCase(c, seed++);
  }
}

// Small v8 cases for compute-sanitizer (scripts/gpu-run): 2 pieces a row,
// groups of 4 rows, ignored rows, in place and out of place.
TEST_F(CudaCrossEntropyTest, L2PieceKernelSmall) {
  uint32_t seed = 1250;
  for (int hints : {1, 2}) {  // (1: out of place)
    Case c = Make("v8 small", 96, 8192, DType::kBFloat16);
    c.config.schedule = CrossEntropyCudaSchedule::kL2RowPieces;
    c.config.piece_kib = 8;
    c.config.group_mib = 1;
    c.ignore_fraction = 0.2;
    c.mode = hints == 2 ? GradientMode::kInPlace : GradientMode::kOutOfPlace;
    CheckCase(c, seed++);
  }
}

// Small v7 cases for compute-sanitizer (scripts/gpu-run): 4 pieces a row,
// ignored rows, NaN and infinite logits.
TEST_F(CudaCrossEntropyTest, PieceKernelSmall) {
  uint32_t seed = 1150;
  Case c = Make("v7 small", 200, 16384, DType::kBFloat16);
  c.mode = GradientMode::kNone;
  c.config.schedule = CrossEntropyCudaSchedule::kSplitRowForward;
  c.config.piece_kib = 8;
  c.ignore_fraction = 0.2;
  CheckCase(c, seed++);
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    Case nf = Make("v7 NaN and inf logits", 64, 8192, dtype);
    nf.logits = Logits::kNonFinite;
    nf.mode = GradientMode::kNone;
    nf.config.schedule = CrossEntropyCudaSchedule::kSplitRowForward;
    nf.config.piece_kib = 8;
    nf.exact_argmax = false;  // NaN rows: the first max is not defined
    CheckCase(nf, seed++);
  }
}

// Small v6 cases for compute-sanitizer (scripts/gpu-run): clusters of 2 and
// 4, more rows than clusters, both modes, the rare exchange; twice (the
// one-block-a-SM build is gone: bench/NOTES.md).
TEST_F(CudaCrossEntropyTest, TmaKernelSmall) {
  uint32_t seed = 950;
  for (int round : {1, 2}) {
    for (GradientMode mode : {GradientMode::kInPlace, GradientMode::kNone}) {
      Case c = Make(absl::StrCat("v6 small, round ", round), 600, 16384,
                    DType::kBFloat16);
      c.config.schedule = CrossEntropyCudaSchedule::kClusterSliceRows;
      c.config.piece_kib = 8;
      c.mode = mode;
      c.ignore_fraction = 0.2;
      CheckCase(c, seed++);
    }
    Case h = Make("v6 small fp16", 300, 8192, DType::kFloat16);
    h.config.schedule = CrossEntropyCudaSchedule::kClusterSliceRows;
    h.config.piece_kib = 8;
    CheckCase(h, seed++);
    for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
      Case nf = Make("v6 small, NaN and inf logits", 64, 8192, dtype);
      nf.logits = Logits::kNonFinite;
      nf.config.schedule = CrossEntropyCudaSchedule::kClusterSliceRows;
      nf.config.piece_kib = 8;
      nf.exact_argmax = false;  // NaN rows: the first max is not defined
      CheckCase(nf, seed++);
    }
    // Clusters of one block: a 32 KiB row in 32 KiB slices.
    Case one =
        Make("v6 auto, clusters of one block", 500, 16384, DType::kBFloat16);
    one.config.piece_kib = 32;
    one.config.schedule = CrossEntropyCudaSchedule::kClusterSliceRows;
    one.ignore_fraction = 0.1;
    CheckCase(one, seed++);
    Case d = Make("v6 small p_y -> 1", 300, 8192, DType::kFloat32);
    d.logits = Logits::kTargetDominant;
    d.config.schedule = CrossEntropyCudaSchedule::kClusterSliceRows;
    d.config.piece_kib = 8;
    CheckCase(d, seed++);
  }
}

// Odd vocabularies: contiguous rows that start off 16-byte boundaries (each
// row at another offset) and end inside a vector, on the schedules that take
// them (smem row pieces and split row forward handle the edges; cluster stream
// and register rows need rows padded to 16 bytes), in small pieces so that
// rows have several, against the reference.
TEST_F(CudaCrossEntropyTest, OddVocabOnFastSchedules) {
  uint32_t seed = 1500;
  using S = CrossEntropyCudaSchedule;
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    for (int64_t vocab : {1, 3, 50257, 32001}) {
      const int64_t rows = vocab > 1000 ? 24 : 40;
      const auto make = [&](const std::string& what, S schedule,
                            GradientMode mode) {
        Case c = Make(absl::StrCat("V=", vocab, " ", what), rows, vocab, dtype);
        c.config.schedule = schedule;
        c.config.piece_kib = schedule == S::kAuto ? 0 : 8;
        c.mode = mode;
        c.ignore_fraction = 0.2;
        c.options.z_loss_scale = 1e-3f;
        c.options.grad_scale = 0.5f;
        return c;
      };
      CheckCase(make("smem row pieces in place", S::kSmemRowPieces,
                     GradientMode::kInPlace),
                seed++);
      CheckCase(make("smem row pieces out of place", S::kSmemRowPieces,
                     GradientMode::kOutOfPlace),
                seed++);
      CheckCase(
          make("split row forward", S::kSplitRowForward, GradientMode::kNone),
          seed++);
      CheckCase(make("auto", S::kAuto, GradientMode::kInPlace), seed++);
      CheckCase(make("auto forward", S::kAuto, GradientMode::kNone), seed++);
      const int vec = static_cast<int>(16 / DTypeSize(dtype));
      for (S schedule : {S::kClusterStreamRows, S::kClusterRegisterRows}) {
        Case c =
            make(schedule == S::kClusterStreamRows ? "stream rows, padded"
                                                   : "register rows, padded",
                 schedule, GradientMode::kInPlace);
        c.pad = (vec - vocab % vec) % vec;  // 16-byte rows
        CheckCase(c, seed++);
      }
    }
  }
}

// Small odd-vocabulary cases for compute-sanitizer: every row at another
// offset from a 16-byte boundary, heads, tails and pieces without whole
// vectors, both schedules that handle edges.
TEST_F(CudaCrossEntropyTest, OddVocabSmall) {
  uint32_t seed = 1600;
  using S = CrossEntropyCudaSchedule;
  for (int64_t vocab : {3, 17, 4099}) {
    for (GradientMode mode : {GradientMode::kInPlace, GradientMode::kOutOfPlace,
                              GradientMode::kNone}) {
      Case c =
          Make(absl::StrCat("odd small V=", vocab), 9, vocab, DType::kBFloat16);
      c.config.schedule =
          mode == GradientMode::kNone ? S::kSplitRowForward : S::kSmemRowPieces;
      c.config.piece_kib = 1;
      c.mode = mode;
      c.ignore_fraction = 0.2;
      CheckCase(c, seed++);
    }
  }
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
}  // namespace lossd
