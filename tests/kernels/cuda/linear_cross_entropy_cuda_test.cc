// Checks the CUDA linear cross-entropy against the fp64 reference (the CPU
// tests' harness) for each precision, over chunks, micro-batches, repeated
// runs and bad inputs; skipped without a GPU.
#include <cuda_runtime_api.h>

#include <cstring>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/linear_cross_entropy_lab.h"
#include "tests/kernels/linear_cross_entropy_test_util.h"

namespace lossd {
namespace {

using linear_test::Case;
using linear_test::CheckCase;
using linear_test::Problem;

bool HaveGpu() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

#define SKIP_WITHOUT_GPU() \
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA GPU visible"

// Device copies of the host buffers an args struct points at; Finish copies
// every output back into them.
class DeviceCopy {
 public:
  explicit DeviceCopy(const LinearCrossEntropyArgs& host) : host_(host) {
    device_ = host;
    const size_t es = DTypeSize(host.dtype);
    const size_t x_bytes = host.rows * host.hidden * es;
    device_.x = Put(host.x, x_bytes);
    device_.weight = Put(host.weight, host.vocab * host.hidden * es);
    device_.bias = Put(host.bias, host.vocab * es);
    device_.targets =
        Put(host.targets, host.rows * DTypeSize(host.targets_dtype));
    device_.class_weights = static_cast<const float*>(
        Put(host.class_weights, host.vocab * sizeof(float)));
    device_.token_grad_output = static_cast<const float*>(
        Put(host.token_grad_output, host.rows * sizeof(float)));
    if (host.dx_mode == GradientMode::kInPlace) {
      device_.dx = const_cast<void*>(device_.x);
    } else {
      device_.dx = Put(host.dx, x_bytes);
    }
    device_.grad_weight = static_cast<float*>(
        Put(host.grad_weight, host.vocab * host.hidden * sizeof(float)));
    device_.grad_bias =
        static_cast<float*>(Put(host.grad_bias, host.vocab * sizeof(float)));
    device_.token_loss =
        static_cast<float*>(Put(host.token_loss, host.rows * sizeof(float)));
    device_.token_lse =
        static_cast<float*>(Put(host.token_lse, host.rows * sizeof(float)));
    device_.token_argmax = static_cast<int32_t*>(
        Put(host.token_argmax, host.rows * sizeof(int32_t)));
  }
  ~DeviceCopy() {
    for (void* p : owned_) cudaFree(p);
  }
  DeviceCopy(const DeviceCopy&) = delete;
  DeviceCopy& operator=(const DeviceCopy&) = delete;

  const LinearCrossEntropyArgs& args() const { return device_; }

  void Finish() {
    const size_t es = DTypeSize(host_.dtype);
    Get(host_.dx, device_.dx, host_.rows * host_.hidden * es);
    if (host_.dx_mode == GradientMode::kInPlace) {
      Get(host_.x, device_.x, host_.rows * host_.hidden * es);
    }
    Get(host_.grad_weight, device_.grad_weight,
        host_.vocab * host_.hidden * sizeof(float));
    Get(host_.grad_bias, device_.grad_bias, host_.vocab * sizeof(float));
    Get(host_.token_loss, device_.token_loss, host_.rows * sizeof(float));
    Get(host_.token_lse, device_.token_lse, host_.rows * sizeof(float));
    Get(host_.token_argmax, device_.token_argmax, host_.rows * sizeof(int32_t));
  }

 private:
  void* Put(const void* host, size_t bytes) {
    if (host == nullptr) return nullptr;
    void* d = nullptr;
    EXPECT_EQ(cudaMalloc(&d, std::max<size_t>(bytes, 1)), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(d, host, bytes, cudaMemcpyHostToDevice), cudaSuccess);
    owned_.push_back(d);
    return d;
  }
  static void Get(const void* host, const void* device, size_t bytes) {
    if (host == nullptr || bytes == 0) return;
    EXPECT_EQ(cudaMemcpy(const_cast<void*>(host), device, bytes,
                         cudaMemcpyDeviceToHost),
              cudaSuccess);
  }

  LinearCrossEntropyArgs host_;
  LinearCrossEntropyArgs device_;
  std::vector<void*> owned_;
};

linear_test::Runner CudaRunner(LinearCrossEntropyLabConfig config) {
  return [config](const LinearCrossEntropyArgs& host, CrossEntropyResult* r) {
    DeviceCopy copy(host);
    const absl::Status status =
        LinearCrossEntropyCudaLab(copy.args(), r, nullptr, config);
    copy.Finish();
    return status;
  };
}

TEST(LinearCrossEntropyCudaTest, SplitWeightMatchesReference) {
  SKIP_WITHOUT_GPU();
  LinearCrossEntropyLabConfig config;
  config.precision = LinearPrecision::kSplitWeight;
  linear_test::Tolerance tol;
  tol.grad_weight = 5e-5;  // the bar
  for (const Case& c : linear_test::SweepCases()) {
    CheckCase(c, CudaRunner(config), tol);
  }
}

TEST(LinearCrossEntropyCudaTest, OtherPrecisionsMatchReference) {
  SKIP_WITHOUT_GPU();
  LinearCrossEntropyLabConfig both;
  both.precision = kLinearSplitBoth;
  linear_test::Tolerance tol;
  tol.grad_weight = 5e-5;
  LinearCrossEntropyLabConfig fast;
  fast.precision = LinearPrecision::kFast;
  linear_test::Tolerance loose;  // 16-bit logits and G, as the peers
  loose.loss = 2e-2;
  loose.dx_16 = 3e-2;
  loose.grad_weight = 3e-2;
  loose.token = 1e-2;  // lse of bf16-rounded logits
  LinearCrossEntropyLabConfig fp32_logits;
  fp32_logits.precision = kLinearFp32Logits;
  linear_test::Tolerance single;  // exact logits, G rounded once to 16 bits
  single.grad_weight = 1e-2;
  for (const Case& c : linear_test::SweepCases()) {
    CheckCase(c, CudaRunner(both), tol);
    if (c.dtype != DType::kFloat32) CheckCase(c, CudaRunner(fast), loose);
    CheckCase(c, CudaRunner(fp32_logits), single);
  }
}

TEST(LinearCrossEntropyCudaTest, SparseResidualMatchesReference) {
  SKIP_WITHOUT_GPU();
  LinearCrossEntropyLabConfig config;
  config.precision = LinearPrecision::kSparseResidual;
  // At these small vocabularies G's small entries, left rounded to 16 bits,
  // still carry a fair share of dW (the default uses the dense split here).
  linear_test::Tolerance small_vocab;
  small_vocab.grad_weight = 2e-4;
  for (const Case& c : linear_test::SweepCases()) {
    CheckCase(c, CudaRunner(config), small_vocab);
  }
  linear_test::Tolerance tol;
  tol.grad_weight = 5e-5;
  // Peaked logits over a wider vocabulary: several large entries a row
  // besides the target, where one 16-bit rounding of G shows in dW.
  Case peaked;
  peaked.rows = 384;
  peaked.hidden = 64;
  peaked.vocab = 8192;
  peaked.dtype = DType::kBFloat16;
  peaked.logit_scale = 8.0f;
  peaked.accumulate = AccumulateMode::kOverwrite;
  // dbias over chunks of 192 rows: column sums in three segments of rows.
  peaked.bias = true;
  peaked.grad_bias = true;
  CheckCase(peaked, CudaRunner(config), tol);
}

// The records' order within a row changes run to run (atomics); the sorted
// apply must not let that reach dW. A row that overflows its slots keeps no
// record, so with one slot and every entry recorded, dW is kFp32Logits'.
TEST(LinearCrossEntropyCudaTest, SparseResidualRepeatsAndOverflowsToHi) {
  SKIP_WITHOUT_GPU();
  Case c;
  c.rows = 512;
  c.hidden = 96;
  c.vocab = 6000;
  c.dtype = DType::kBFloat16;
  c.logit_scale = 6.0f;
  c.accumulate = AccumulateMode::kOverwrite;
  LinearCrossEntropyLabConfig sparse;
  sparse.precision = LinearPrecision::kSparseResidual;
  sparse.chunk_rows = 128;
  sparse.sparse_threshold = 1e-3f;
  Problem first(c);
  CrossEntropyResult first_result;
  ASSERT_TRUE(CudaRunner(sparse)(first.Args(), &first_result).ok());
  Problem second(c);
  CrossEntropyResult second_result;
  ASSERT_TRUE(CudaRunner(sparse)(second.Args(), &second_result).ok());
  linear_test::ExpectSameBits(first, first_result, second, second_result);

  LinearCrossEntropyLabConfig overflow = sparse;
  overflow.sparse_threshold = 1e-30f;
  overflow.sparse_slots = 1;
  LinearCrossEntropyLabConfig hi_only;
  hi_only.precision = kLinearFp32Logits;
  hi_only.chunk_rows = 128;
  Problem dropped(c);
  CrossEntropyResult dropped_result;
  ASSERT_TRUE(CudaRunner(overflow)(dropped.Args(), &dropped_result).ok());
  Problem plain(c);
  CrossEntropyResult plain_result;
  ASSERT_TRUE(CudaRunner(hi_only)(plain.Args(), &plain_result).ok());
  linear_test::ExpectSameBits(dropped, dropped_result, plain, plain_result);
  // ... and the kept records did change dW.
  EXPECT_NE(std::memcmp(first.grad_weight.data(), plain.grad_weight.data(),
                        first.grad_weight.size() * sizeof(float)),
            0);
}

TEST(LinearCrossEntropyCudaTest, ManyChunksWithATail) {
  SKIP_WITHOUT_GPU();
  for (DType dtype : {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
    Case c;
    c.rows = 70;  // chunks of 16: four full ones and a tail of 6
    c.hidden = 40;
    c.vocab = 1000;
    c.dtype = dtype;
    c.bias = true;
    c.grad_bias = true;
    c.class_weights = true;
    c.token_outputs = true;
    c.dx_mode = GradientMode::kInPlace;
    c.accumulate = AccumulateMode::kOverwrite;
    c.options.label_smoothing = 0.1f;
    c.options.z_loss_scale = 1e-3f;
    LinearCrossEntropyLabConfig config;
    config.chunk_rows = 16;
    linear_test::Tolerance tol;
    tol.grad_weight = 5e-5;
    CheckCase(c, CudaRunner(config), tol);
    c.options.reduction = Reduction::kNone;
    c.accumulate = AccumulateMode::kAdd;
    CheckCase(c, CudaRunner(config), tol);
  }
}

TEST(LinearCrossEntropyCudaTest, FourMicroBatchesEqualOneBatchAndRepeat) {
  SKIP_WITHOUT_GPU();
  Case c;
  c.rows = 256;
  c.hidden = 64;
  c.vocab = 4096;
  c.dtype = DType::kBFloat16;
  c.bias = true;
  c.grad_bias = true;
  c.dx_mode = GradientMode::kOutOfPlace;
  c.accumulate = AccumulateMode::kOverwrite;
  LinearCrossEntropyLabConfig config;
  Problem whole(c);
  CrossEntropyResult whole_result;
  ASSERT_TRUE(CudaRunner(config)(whole.Args(), &whole_result).ok());
  Problem again(c);
  CrossEntropyResult again_result;
  ASSERT_TRUE(CudaRunner(config)(again.Args(), &again_result).ok());
  linear_test::ExpectSameBits(whole, whole_result, again, again_result);

  Problem parts(c);
  const absl::StatusOr<double> loss = linear_test::RunMicroBatches(
      &parts, 4, whole_result.denominator, CudaRunner(config));
  ASSERT_TRUE(loss.ok()) << loss.status();
  EXPECT_NEAR(*loss, whole_result.loss, 1e-6 * std::fabs(whole_result.loss));
  linear_test::ExpectSameWeightGradients(parts, whole);
}

TEST(LinearCrossEntropyCudaTest, BadTargetChangesNothing) {
  SKIP_WITHOUT_GPU();
  Case c;
  c.rows = 40;
  c.hidden = 8;
  c.vocab = 100;
  c.dtype = DType::kBFloat16;
  c.dx_mode = GradientMode::kInPlace;
  LinearCrossEntropyLabConfig config;
  config.chunk_rows = 8;  // the bad row is in the last chunk
  Problem p(c);
  p.targets64[37] = 100;
  const std::vector<uint8_t> x = p.x;
  const std::vector<float> gw = p.grad_weight;
  CrossEntropyResult r;
  const absl::Status status = CudaRunner(config)(p.Args(), &r);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_NE(std::string(status.message()).find("row 37"), std::string::npos)
      << status;
  EXPECT_EQ(p.x, x);
  EXPECT_EQ(0, std::memcmp(p.grad_weight.data(), gw.data(),
                           gw.size() * sizeof(float)));
  LinearCrossEntropyArgs bad = p.Args();
  bad.weight_hidden = 9;
  EXPECT_EQ(LinearCrossEntropyCuda(bad, &r, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace lossd
