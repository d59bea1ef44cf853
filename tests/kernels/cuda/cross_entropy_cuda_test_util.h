// The shared harness of the CUDA cross-entropy tests: seeded random cases,
// the GPU run and the fp64 CPU reference, the comparisons, and the fixture
// that skips without a GPU.
#ifndef LOSSD_TESTS_KERNELS_CUDA_CROSS_ENTROPY_CUDA_TEST_UTIL_H_
#define LOSSD_TESTS_KERNELS_CUDA_CROSS_ENTROPY_CUDA_TEST_UTIL_H_

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
#include "kernels/cuda/cross_entropy_cuda.h"
#include "kernels/cuda/cross_entropy_cuda_host.h"

namespace lossd {
namespace cuda_ce_test {

inline bool HaveGpu() {
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

inline float ToFloat(const std::vector<uint8_t>& raw, DType dtype, int64_t i) {
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

inline void FromFloat(std::vector<uint8_t>* raw, DType dtype, int64_t i,
                      float v) {
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
// kExtreme: finite logits of magnitude up to 1e30 (half of each row), the
// others normal (fp16, whose largest is 65504: up to 6e4).
enum class Logits {
  kNormal,
  kHuge,
  kTargetDominant,
  kGaussian,
  kNonFinite,
  kExtreme
};

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

inline double DefaultGradRtol(DType dtype) {
  return dtype == DType::kFloat32 ? 1e-4 : 1.0 / 128;
}

struct Inputs {
  std::vector<uint8_t> logits;  // rows * stride elements, padding poisoned
  std::vector<uint8_t> targets;
  std::vector<float> weights;
};

inline Inputs MakeInputs(const Case& c, uint32_t seed) {
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
      if (c.logits == Logits::kExtreme && (v + r) % 2 == 0) {
        x *= c.dtype == DType::kFloat16 ? 1.5e4f : 2.5e29f;
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

inline CrossEntropyArgs ArgsFor(const Case& c) {
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

inline Outputs RunGpu(const Case& c, const Inputs& in) {
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
inline Outputs RunReference(const Case& c, const Inputs& in, int64_t first,
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
inline bool Close(double got, double want, double atol, double rtol) {
  if (std::isnan(want)) return std::isnan(got);
  if (std::isinf(want)) return got == want;
  return std::fabs(got - want) <= atol + rtol * std::fabs(want);
}

inline void ExpectNear(double got, double want, double rtol,
                       const std::string& what) {
  EXPECT_TRUE(Close(got, want, rtol, rtol))
      << what << ": got " << got << " want " << want;
}

// Compares rows [first, first+count) of `gpu` with `ref` (which holds only
// those rows).
inline void CompareRows(const Case& c, const Outputs& gpu, const Outputs& ref,
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

inline void CheckCase(const Case& c, uint32_t seed) {
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

inline Case Make(std::string name, int64_t rows, int64_t vocab, DType dtype) {
  Case c;
  c.name = std::move(name);
  c.rows = rows;
  c.vocab = vocab;
  c.dtype = dtype;
  c.grad_rtol = DefaultGradRtol(dtype);
  return c;
}

}  // namespace cuda_ce_test
}  // namespace lossd

#endif  // LOSSD_TESTS_KERNELS_CUDA_CROSS_ENTROPY_CUDA_TEST_UTIL_H_
