// The gradient's rounding promise on the GPU (docs/api.md "Precision"): label
// smoothing's p_c A - eps w_c / V cancels, a softcap's factor multiplies every
// rounding, and every schedule that can take the shape must keep the result
// within one rounding plus the stated slack of the fp64 gradient. Skipped
// without a GPU.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/cuda/cross_entropy_cuda.h"
#include "kernels/cuda/cross_entropy_cuda_host.h"
#include "tests/kernels/gradient_rounding.h"

namespace lossd {
namespace {

using rounding_test::CheckRounding;
using rounding_test::MakeRoundingInputs;
using rounding_test::RoundingBound;
using rounding_test::RoundingCase;
using rounding_test::RoundingInputs;
using rounding_test::RoundingOptions;
using rounding_test::RoundingReport;

bool HaveGpu() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

// Device memory freed on scope exit.
class DeviceBytes {
 public:
  explicit DeviceBytes(size_t bytes) {
    EXPECT_EQ(cudaMalloc(&ptr_, bytes > 0 ? bytes : 1), cudaSuccess);
  }
  ~DeviceBytes() { cudaFree(ptr_); }
  DeviceBytes(const DeviceBytes&) = delete;
  DeviceBytes& operator=(const DeviceBytes&) = delete;
  void* get() const { return ptr_; }

 private:
  void* ptr_ = nullptr;
};

// The bound each dtype is held to (docs/api.md "Precision"): halves within
// one rounding plus 1/32 ulp and kHalfUnits fp32 roundings of the terms; fp32
// within one rounding and kFp32Units fp32 roundings of the terms.
constexpr double kHalfUnits = 2.0;
constexpr double kFp32Units = 24.0;
// With a softcap c (any dtype): one ulp and max(128, 16 c) roundings of the
// terms (tanh's own rounding, a few ulp of c tanh, reaches every p_c).
RoundingBound BoundFor(DType dtype, float softcap) {
  RoundingBound b;
  if (softcap > 0) {
    b.slack_ulps = 0.5;
    b.k = std::max(128.0, 16.0 * softcap);
  } else if (dtype == DType::kFloat32) {
    b.slack_ulps = 0.0;
    b.k = kFp32Units;
  } else {
    b.k = kHalfUnits;
  }
  return b;
}

// Runs `schedule` out of place and returns the gradient's bytes.
std::vector<uint8_t> RunGpu(const RoundingCase& c, const RoundingInputs& in,
                            CrossEntropyCudaSchedule schedule) {
  const size_t bytes = in.logits.size();
  DeviceBytes logits(bytes), grad(bytes), targets(in.targets.size() * 8),
      weights(in.weights.size() * 4);
  EXPECT_EQ(
      cudaMemcpy(logits.get(), in.logits.data(), bytes, cudaMemcpyHostToDevice),
      cudaSuccess);
  EXPECT_EQ(cudaMemcpy(targets.get(), in.targets.data(), in.targets.size() * 8,
                       cudaMemcpyHostToDevice),
            cudaSuccess);
  if (c.weights) {
    EXPECT_EQ(cudaMemcpy(weights.get(), in.weights.data(),
                         in.weights.size() * 4, cudaMemcpyHostToDevice),
              cudaSuccess);
  }
  EXPECT_EQ(cudaMemset(grad.get(), 0xff, bytes), cudaSuccess);
  CrossEntropyArgs a;
  a.rows = c.rows;
  a.vocab = c.vocab;
  a.row_stride = c.vocab;
  a.logits_dtype = c.dtype;
  a.logits = logits.get();
  a.targets_dtype = DType::kInt64;
  a.targets = targets.get();
  a.class_weights =
      c.weights ? static_cast<const float*>(weights.get()) : nullptr;
  a.options = RoundingOptions(c);
  a.mode = GradientMode::kOutOfPlace;
  a.gradient = grad.get();
  CrossEntropyCudaConfig config;
  config.schedule = schedule;
  CrossEntropyResult result;
  const absl::Status status = CrossEntropyCuda(a, &result, nullptr, &config);
  EXPECT_TRUE(status.ok()) << status;
  std::vector<uint8_t> out(bytes);
  EXPECT_EQ(cudaMemcpy(out.data(), grad.get(), bytes, cudaMemcpyDeviceToHost),
            cudaSuccess);
  return out;
}

// Every forward+gradient schedule that can take the case's shape (rows of
// `vocab` elements, unpadded, out of place): the automatic choice, then each
// by name.
void CheckEverySchedule(const RoundingCase& c) {
  const RoundingInputs in = MakeRoundingInputs(c);
  const int64_t esize = static_cast<int64_t>(DTypeSize(c.dtype));
  const bool whole_vectors = c.vocab * esize % 16 == 0;
  const struct {
    const char* name;
    CrossEntropyCudaSchedule schedule;
    bool takes;
  } schedules[] = {
      {"auto", CrossEntropyCudaSchedule::kAuto, true},
      {"smem row pieces", CrossEntropyCudaSchedule::kSmemRowPieces, true},
      {"L2 row pieces", CrossEntropyCudaSchedule::kL2RowPieces,
       whole_vectors && esize == 2},
      {"cluster slice rows", CrossEntropyCudaSchedule::kClusterSliceRows,
       whole_vectors && c.vocab * esize <= 16 * 32 * 1024},
      {"cluster stream rows", CrossEntropyCudaSchedule::kClusterStreamRows,
       whole_vectors},
      {"cluster register rows", CrossEntropyCudaSchedule::kClusterRegisterRows,
       true},
      {"generic rows", CrossEntropyCudaSchedule::kGenericRows, true},
  };
  for (const auto& s : schedules) {
    if (!s.takes) continue;
    const std::string what = absl::StrCat(c.name, ", ", s.name);
    SCOPED_TRACE(what);
    const std::vector<uint8_t> grad = RunGpu(c, in, s.schedule);
    const RoundingReport rep =
        CheckRounding(c, in, grad, BoundFor(c.dtype, c.softcap));
    rounding_test::PrintRoundingReport(what, rep);
    EXPECT_EQ(rep.failures, 0) << rep.first_failures;
  }
}

class CudaGradientRoundingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!HaveGpu()) GTEST_SKIP() << "no CUDA GPU visible";
  }
};

// A client's report: 256 x 128256 bf16, normal * 3, a quarter of the rows
// ignored, label smoothing 0.1, z-loss 1e-4, mean.
TEST_F(CudaGradientRoundingTest, LabelSmoothingBf16) {
  RoundingCase c;
  c.name = "bf16 256x128256 eps=0.1 z-loss";
  CheckEverySchedule(c);
}

TEST_F(CudaGradientRoundingTest, LabelSmoothingFp16) {
  RoundingCase c;
  c.name = "fp16 256x128256 eps=0.1 z-loss";
  c.dtype = DType::kFloat16;
  c.grad_scale = 4e6f;  // the largest |dz| ~ 2e4 < 65504
  c.seed = 2;
  CheckEverySchedule(c);
}

TEST_F(CudaGradientRoundingTest, LabelSmoothingFp32) {
  RoundingCase c;
  c.name = "fp32 256x128256 eps=0.1 z-loss";
  c.dtype = DType::kFloat32;
  c.seed = 3;
  CheckEverySchedule(c);
}

// Class weights move the cancellation point per class (ln w_c); an odd
// vocabulary takes the edge paths.
TEST_F(CudaGradientRoundingTest, LabelSmoothingWeightsOddVocab) {
  for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
    RoundingCase c;
    c.name = absl::StrCat(DTypeName(dtype), " 192x50257 eps=0.3 weights");
    c.rows = 192;
    c.vocab = 50257;
    c.dtype = dtype;
    c.label_smoothing = 0.3f;
    c.weights = true;
    c.scale = 2.0;
    if (dtype == DType::kFloat16) c.grad_scale = 2e6f;
    c.seed = 4;
    CheckEverySchedule(c);
  }
}

// eps = 1: the whole gradient is p_c A - w_c / V.
TEST_F(CudaGradientRoundingTest, FullSmoothingBf16) {
  RoundingCase c;
  c.name = "bf16 128x32000 eps=1";
  c.rows = 128;
  c.vocab = 32000;
  c.label_smoothing = 1.0f;
  c.z_loss_scale = 0.0f;
  c.seed = 5;
  CheckEverySchedule(c);
}

// Softcap 30 (Gemma's final logits) with smoothing and z-loss: the factor
// 1 - tanh^2 on every element, tanh's rounding in every p_c.
TEST_F(CudaGradientRoundingTest, SoftcapBf16) {
  RoundingCase c;
  c.name = "bf16 256x128256 softcap=30 eps=0.1 z-loss";
  c.softcap = 30.0f;
  c.scale = 20.0;  // logits that reach the cap's curve
  c.seed = 6;
  CheckEverySchedule(c);
}

TEST_F(CudaGradientRoundingTest, SoftcapFp32) {
  RoundingCase c;
  c.name = "fp32 128x65536 softcap=30";
  c.dtype = DType::kFloat32;
  c.rows = 128;
  c.vocab = 65536;
  c.softcap = 30.0f;
  c.label_smoothing = 0.0f;
  c.scale = 20.0;
  c.seed = 7;
  CheckEverySchedule(c);
}

// Every option at once, odd vocabulary (the edges), fp16 with a scale.
TEST_F(CudaGradientRoundingTest, AllOptionsOddVocab) {
  for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
    RoundingCase c;
    c.name = absl::StrCat(DTypeName(dtype),
                          " 128x50257 softcap=30 eps=0.1 weights z-loss");
    c.rows = 128;
    c.vocab = 50257;
    c.dtype = dtype;
    c.softcap = 30.0f;
    c.weights = true;
    c.scale = 10.0;
    if (dtype == DType::kFloat16) c.grad_scale = 2e6f;
    c.seed = 8;
    CheckEverySchedule(c);
  }
}

}  // namespace
}  // namespace lossd
