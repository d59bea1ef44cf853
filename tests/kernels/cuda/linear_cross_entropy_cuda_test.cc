// Checks the CUDA linear cross-entropy against the fp64 reference (the CPU
// tests' harness) for each precision, over chunks, micro-batches, repeated
// runs and bad inputs, and the fused forward and gradient (the loss in the
// Hopper GEMM's epilogue) on sm_90; skipped without a GPU.
#include <cuda_runtime_api.h>

#include <cmath>
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

// The fused paths run on sm_90 devices only (gemm_sm90_policy.h).
bool HaveSm90() {
  if (!HaveGpu()) return false;
  int major = 0, minor = 0;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0);
  return major == 9 && minor == 0;
}

#define SKIP_WITHOUT_SM90() \
  if (!HaveSm90()) GTEST_SKIP() << "the fused paths need an sm_90 GPU"

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
// record, so with one slot and every entry recorded, dW is kLinearFp32Logits'.
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
  // cuBLASLt's Z on both sides of the overflow's comparison below (the
  // fused gradient's Z, accumulated in another order, has its own test).
  sparse.fused_gradient = LinearFusedForward::kOff;
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

  // The fused gradient's records, the same way: repeated, and every row
  // overflowing equals no record kept.
  if (!HaveSm90()) return;
  sparse.fused_gradient = LinearFusedForward::kRequire;
  overflow.fused_gradient = LinearFusedForward::kRequire;
  LinearCrossEntropyLabConfig none = sparse;
  none.sparse_threshold = 1e30f;
  Problem fused_first(c), fused_second(c), fused_dropped(c), fused_none(c);
  CrossEntropyResult r1, r2, r3, r4;
  ASSERT_TRUE(CudaRunner(sparse)(fused_first.Args(), &r1).ok());
  ASSERT_TRUE(CudaRunner(sparse)(fused_second.Args(), &r2).ok());
  linear_test::ExpectSameBits(fused_first, r1, fused_second, r2);
  ASSERT_TRUE(CudaRunner(overflow)(fused_dropped.Args(), &r3).ok());
  ASSERT_TRUE(CudaRunner(none)(fused_none.Args(), &r4).ok());
  linear_test::ExpectSameBits(fused_dropped, r3, fused_none, r4);
  EXPECT_NE(
      std::memcmp(fused_first.grad_weight.data(), fused_none.grad_weight.data(),
                  fused_first.grad_weight.size() * sizeof(float)),
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

LinearCrossEntropyLabConfig FusedConfig(LinearFusedForward fused) {
  LinearCrossEntropyLabConfig config;
  config.fused_forward = fused;
  return config;
}

LinearCrossEntropyLabConfig FusedGradientConfig(LinearFusedForward fused) {
  LinearCrossEntropyLabConfig config;
  config.precision = LinearPrecision::kSparseResidual;
  config.fused_gradient = fused;
  return config;
}

// Forward-only bf16 problems over ragged shapes (one row, a partial row tile,
// V = 1, V not a multiple of the 256-column tile, H not a multiple of the
// 64-deep block), the sweep's option sets rotated over them.
std::vector<Case> FusedForwardCases() {
  std::vector<Case> cases;
  uint32_t seed = 500;
  for (int64_t rows : {1, 7, 130, 300}) {
    for (int64_t hidden : {8, 72, 136}) {
      for (int64_t vocab : {1, 3, 257, 1000}) {
        Case c;
        c.rows = rows;
        c.hidden = hidden;
        c.vocab = vocab;
        c.dtype = DType::kBFloat16;
        c.dx_mode = GradientMode::kNone;
        c.accumulate = AccumulateMode::kNone;
        c.token_outputs = true;
        c.seed = seed++;
        const uint32_t k = c.seed;
        c.bias = k % 2 == 0;
        c.targets_dtype = k % 3 == 0 ? DType::kInt32 : DType::kInt64;
        linear_test::ApplyOptionSet(static_cast<int>(k % 6), &c);
        cases.push_back(c);
      }
    }
  }
  return cases;
}

TEST(LinearCrossEntropyCudaTest, FusedForwardMatchesReference) {
  SKIP_WITHOUT_SM90();
  const LinearCrossEntropyLabConfig fused =
      FusedConfig(LinearFusedForward::kRequire);
  for (const Case& c : FusedForwardCases()) {
    CheckCase(c, CudaRunner(fused), linear_test::Tolerance());
    // The argmax and the correct count too, which CheckCase leaves out.
    SCOPED_TRACE(c.Name());
    Problem p(c);
    const linear_test::Expected e = linear_test::Reference(p);
    CrossEntropyResult r;
    ASSERT_TRUE(CudaRunner(fused)(p.Args(), &r).ok());
    EXPECT_EQ(p.token_argmax, e.token_argmax);
    EXPECT_EQ(r.correct_tokens, e.result.correct_tokens);
  }
}

TEST(LinearCrossEntropyCudaTest, FusedForwardOverChunksWithATail) {
  SKIP_WITHOUT_SM90();
  Case c;
  c.rows = 300;  // chunks of 128: two full ones and a tail of 44
  c.hidden = 64;
  c.vocab = 2000;
  c.dtype = DType::kBFloat16;
  c.dx_mode = GradientMode::kNone;
  c.accumulate = AccumulateMode::kNone;
  c.token_outputs = true;
  c.bias = true;
  c.class_weights = true;
  c.options.label_smoothing = 0.1f;
  LinearCrossEntropyLabConfig config =
      FusedConfig(LinearFusedForward::kRequire);
  config.chunk_rows = 128;
  CheckCase(c, CudaRunner(config), linear_test::Tolerance());
}

// A shape of many tiles a row and several waves, where the fp64 reference
// would take minutes: against the cuBLASLt path (fp32 Z, the fused
// cross-entropy), which the tests above hold to fp64; and the same bits on a
// second run.
// The large case of the EqualsCublasPathAndRepeats tests: 1000 x 512 x
// vocab bf16 with a bias and z-loss.
Case LargeCase(int64_t vocab) {
  Case c;
  c.rows = 1000;
  c.hidden = 512;
  c.vocab = vocab;
  c.dtype = DType::kBFloat16;
  c.token_outputs = true;
  c.bias = true;
  c.options.z_loss_scale = 1e-4f;
  return c;
}

// A case run twice by a fused path (required) and once by cuBLASLt's.
struct ThreeRuns {
  explicit ThreeRuns(const Case& c) : fused(c), again(c), cublas(c) {}
  Problem fused, again, cublas;
  CrossEntropyResult fused_result, again_result, cublas_result;
};

void RunThree(LinearCrossEntropyLabConfig (*config)(LinearFusedForward),
              ThreeRuns* t) {
  const auto run = [&](LinearFusedForward mode, Problem* p,
                       CrossEntropyResult* r) {
    ASSERT_TRUE(CudaRunner(config(mode))(p->Args(), r).ok());
  };
  run(LinearFusedForward::kRequire, &t->fused, &t->fused_result);
  run(LinearFusedForward::kRequire, &t->again, &t->again_result);
  run(LinearFusedForward::kOff, &t->cublas, &t->cublas_result);
}

TEST(LinearCrossEntropyCudaTest, FusedForwardEqualsCublasPathAndRepeats) {
  SKIP_WITHOUT_SM90();
  Case c = LargeCase(50257);
  c.dx_mode = GradientMode::kNone;
  c.accumulate = AccumulateMode::kNone;
  ThreeRuns t(c);
  RunThree(FusedConfig, &t);
  const Problem& fused = t.fused;
  const Problem& again = t.again;
  const Problem& cublas = t.cublas;
  const CrossEntropyResult& fused_result = t.fused_result;
  const CrossEntropyResult& again_result = t.again_result;
  const CrossEntropyResult& cublas_result = t.cublas_result;
  EXPECT_EQ(fused_result.loss, again_result.loss);
  EXPECT_EQ(fused.token_loss, again.token_loss);
  EXPECT_EQ(fused.token_lse, again.token_lse);
  EXPECT_NEAR(fused_result.loss, cublas_result.loss,
              2e-6 * std::fabs(cublas_result.loss));
  EXPECT_EQ(fused_result.valid_tokens, cublas_result.valid_tokens);
  EXPECT_EQ(fused_result.correct_tokens, cublas_result.correct_tokens);
  EXPECT_EQ(fused.token_argmax, cublas.token_argmax);
  for (int64_t n = 0; n < c.rows; ++n) {
    EXPECT_NEAR(fused.token_lse[n], cublas.token_lse[n], 1e-5f) << "row " << n;
  }
}

// Work the fused forward does not take: it says so when required, and the
// policy's choice runs it on cuBLASLt.
TEST(LinearCrossEntropyCudaTest, FusedForwardRefusesWhatItCannotTake) {
  SKIP_WITHOUT_GPU();
  Case c;
  c.rows = 16;
  c.hidden = 20;  // 40-byte rows: no tensor map
  c.vocab = 300;
  c.dtype = DType::kBFloat16;
  c.dx_mode = GradientMode::kNone;
  c.accumulate = AccumulateMode::kNone;
  Problem p(c);
  CrossEntropyResult r;
  EXPECT_EQ(CudaRunner(FusedConfig(LinearFusedForward::kRequire))(p.Args(), &r)
                .code(),
            absl::StatusCode::kFailedPrecondition);
  CheckCase(c, CudaRunner(FusedConfig(LinearFusedForward::kAuto)),
            linear_test::Tolerance());
  c.hidden = 64;
  c.dx_mode = GradientMode::kOutOfPlace;  // a gradient needs Z in memory
  Problem grad(c);
  EXPECT_EQ(
      CudaRunner(FusedConfig(LinearFusedForward::kRequire))(grad.Args(), &r)
          .code(),
      absl::StatusCode::kFailedPrecondition);
}

// Gradient problems the fused gradient takes (bf16, V a multiple of 4) over
// ragged shapes: one row, a partial row tile, V not a multiple of the
// 256-column tile, H not a multiple of the 64-deep block; about one row in
// five ignored, dX out of place and in place, dW overwritten and added to,
// grad_output a row, and every option set without a softcap (which the
// policy sends to cuBLASLt).
std::vector<Case> FusedGradientCases() {
  std::vector<Case> cases;
  const int kSets[] = {0, 1, 3, 5};
  uint32_t seed = 900;
  for (int64_t rows : {1, 7, 130}) {
    for (int64_t hidden : {8, 72}) {
      for (int64_t vocab : {4, 260, 1000}) {
        Case c;
        c.rows = rows;
        c.hidden = hidden;
        c.vocab = vocab;
        c.dtype = DType::kBFloat16;
        c.token_outputs = true;
        c.seed = seed++;
        const uint32_t k = c.seed;
        c.bias = k % 2 == 0;
        c.dx_mode =
            k % 3 == 0 ? GradientMode::kInPlace : GradientMode::kOutOfPlace;
        c.accumulate =
            k % 2 == 1 ? AccumulateMode::kAdd : AccumulateMode::kOverwrite;
        c.targets_dtype = k % 3 == 1 ? DType::kInt32 : DType::kInt64;
        linear_test::ApplyOptionSet(kSets[k % 4], &c);
        cases.push_back(c);
      }
    }
  }
  return cases;
}

TEST(LinearCrossEntropyCudaTest, FusedGradientMatchesReference) {
  SKIP_WITHOUT_SM90();
  const LinearCrossEntropyLabConfig fused =
      FusedGradientConfig(LinearFusedForward::kRequire);
  // The sparse residual's bound at these small vocabularies, as for the
  // cuBLASLt path (SparseResidualMatchesReference).
  linear_test::Tolerance tol;
  tol.grad_weight = 2e-4;
  // Both GEMM schedules (the rest of the test takes the policy's).
  for (cuda_gemm::GemmSm90Schedule schedule :
       {cuda_gemm::GemmSm90Schedule::kCooperative,
        cuda_gemm::GemmSm90Schedule::kPingPong}) {
    LinearCrossEntropyLabConfig pinned = fused;
    pinned.gemm_schedule = schedule;
    for (const Case& c : FusedGradientCases())
      CheckCase(c, CudaRunner(pinned), tol);
  }
  // One row over a bench vocabulary: the 1-row bound on dW.
  Case one;
  one.rows = 1;
  one.hidden = 256;
  one.vocab = 131072;
  one.dtype = DType::kBFloat16;
  one.accumulate = AccumulateMode::kOverwrite;
  linear_test::Tolerance one_row;
  one_row.grad_weight = 5e-5;
  CheckCase(one, CudaRunner(fused), one_row);
  // Chunks of 64 rows with a tail of 2.
  Case chunked;
  chunked.rows = 130;
  chunked.hidden = 64;
  chunked.vocab = 2000;
  chunked.dtype = DType::kBFloat16;
  chunked.class_weights = true;
  chunked.options.label_smoothing = 0.1f;
  LinearCrossEntropyLabConfig small_chunks = fused;
  small_chunks.chunk_rows = 64;
  CheckCase(chunked, CudaRunner(small_chunks), tol);
}

// Many tiles a row and several waves, where the fp64 reference would take
// minutes: the same bits on a second run, and within the products' rounding
// of the cuBLASLt path of the same precision (held to fp64 above).
TEST(LinearCrossEntropyCudaTest, FusedGradientEqualsCublasPathAndRepeats) {
  SKIP_WITHOUT_SM90();
  Case c = LargeCase(50256);
  c.accumulate = AccumulateMode::kOverwrite;
  ThreeRuns t(c);
  RunThree(FusedGradientConfig, &t);
  const Problem& fused = t.fused;
  const Problem& cublas = t.cublas;
  linear_test::ExpectSameBits(fused, t.fused_result, t.again, t.again_result);
  EXPECT_NEAR(t.fused_result.loss, t.cublas_result.loss,
              2e-6 * std::fabs(t.cublas_result.loss));
  const std::vector<double> reference(cublas.grad_weight.begin(),
                                      cublas.grad_weight.end());
  EXPECT_LE(linear_test::RelativeError(fused.grad_weight, reference, 1e-6),
            1e-5);
  std::vector<float> dx(c.rows * c.hidden);
  std::vector<double> dx_reference(c.rows * c.hidden);
  for (int64_t i = 0; i < c.rows * c.hidden; ++i) {
    dx[i] = linear_test::Decode(fused.dx, c.dtype, i);
    dx_reference[i] = linear_test::Decode(cublas.dx, c.dtype, i);
  }
  EXPECT_LE(linear_test::RelativeError(dx, dx_reference, 1e-6), 1e-2);
}

// Gradient work the fused path does not take: refused when required, and
// the policy's choice runs it on cuBLASLt.
TEST(LinearCrossEntropyCudaTest, FusedGradientRefusesWhatItCannotTake) {
  SKIP_WITHOUT_GPU();
  Case c;
  c.rows = 16;
  c.hidden = 64;
  c.vocab = 300;
  c.dtype = DType::kBFloat16;
  c.options.softcap = 5.0f;  // its factor needs the raw logit
  const auto code = [](const Case& c) {
    Problem p(c);
    CrossEntropyResult r;
    return CudaRunner(FusedGradientConfig(LinearFusedForward::kRequire))(
               p.Args(), &r)
        .code();
  };
  EXPECT_EQ(code(c), absl::StatusCode::kFailedPrecondition);
  linear_test::Tolerance tol;
  tol.grad_weight = 2e-4;
  CheckCase(c, CudaRunner(FusedGradientConfig(LinearFusedForward::kAuto)), tol);
  c.options.softcap = 0.0f;
  c.vocab = 302;  // fp32 rows of 1208 bytes: no TMA store of Z
  EXPECT_EQ(code(c), absl::StatusCode::kFailedPrecondition);
  CheckCase(c, CudaRunner(FusedGradientConfig(LinearFusedForward::kAuto)), tol);
  c.vocab = 300;
  c.grad_bias = true;
  c.bias = true;
  EXPECT_EQ(code(c), absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace lossd
