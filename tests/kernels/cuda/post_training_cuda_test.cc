// The CUDA post-training losses against the fp64 CPU backend (families,
// dtypes, odd V, V = 128256; the fast schedule and the row kernel; skipped
// without a GPU), and disabled benches of distillation and the policy losses.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "common/float16.h"
#include "gtest/gtest.h"
#include "kernels/cpu/post_training_cpu.h"
#include "kernels/cuda/cross_entropy_cuda_host.h"
#include "kernels/cuda/post_training_cuda_host.h"

namespace lossd {
namespace {

bool HaveGpu() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

// Values rounded to `dtype` and their bytes.
std::vector<uint8_t> Encode(const std::vector<float>& values, DType dtype,
                            std::vector<float>* rounded) {
  std::vector<uint8_t> bytes(values.size() * DTypeSize(dtype));
  rounded->resize(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    if (dtype == DType::kFloat32) {
      std::memcpy(bytes.data() + 4 * i, &values[i], 4);
      (*rounded)[i] = values[i];
    } else {
      const uint16_t h = dtype == DType::kBFloat16 ? FloatToBF16(values[i])
                                                   : FloatToHalf(values[i]);
      std::memcpy(bytes.data() + 2 * i, &h, 2);
      (*rounded)[i] =
          dtype == DType::kBFloat16 ? BF16ToFloat(h) : HalfToFloat(h);
    }
  }
  return bytes;
}

float Decode(const std::vector<uint8_t>& bytes, DType dtype, size_t i) {
  if (dtype == DType::kFloat32) {
    float v;
    std::memcpy(&v, bytes.data() + 4 * i, 4);
    return v;
  }
  uint16_t h;
  std::memcpy(&h, bytes.data() + 2 * i, 2);
  return dtype == DType::kBFloat16 ? BF16ToFloat(h) : HalfToFloat(h);
}

// Device copy of host bytes, freed at the end of the test.
class DeviceBytes {
 public:
  explicit DeviceBytes(const void* host, size_t bytes) : bytes_(bytes) {
    EXPECT_EQ(cudaMalloc(&pointer_, std::max<size_t>(bytes, 1)), cudaSuccess);
    if (bytes > 0) {
      EXPECT_EQ(cudaMemcpy(pointer_, host, bytes, cudaMemcpyHostToDevice),
                cudaSuccess);
    }
  }
  ~DeviceBytes() { cudaFree(pointer_); }
  DeviceBytes(const DeviceBytes&) = delete;
  DeviceBytes& operator=(const DeviceBytes&) = delete;
  void* get() const { return pointer_; }
  std::vector<uint8_t> Read() const {
    std::vector<uint8_t> out(bytes_);
    EXPECT_EQ(cudaMemcpy(out.data(), pointer_, bytes_, cudaMemcpyDeviceToHost),
              cudaSuccess);
    return out;
  }

 private:
  void* pointer_ = nullptr;
  size_t bytes_;
};

enum class Family { kDense, kTopK, kPolicy, kPlain };

struct Config {
  Family family;
  DType dtype;
  int64_t rows, vocab;
  Divergence divergence = Divergence::kForwardKl;
  float beta = 0.5f, tau = 1.0f, alpha = 0.0f;
  int64_t k = 0;
  TopKTail tail = TopKTail::kRenormalize;
  PolicyLossKind loss = PolicyLossKind::kPpoClip;
  KlEstimator estimator = KlEstimator::kK3;
  bool reference = false;
  float softcap = 0.0f;
  float logit_scale = 1.0f;  // the student's logits: N(0, 2) times this,
  float teacher_mix = 0.0f;  // plus this times the teacher's
  bool segments = false;
  uint32_t seed = 1;
  PostTrainingCudaPath path = PostTrainingCudaPath::kAuto;
  bool in_place = false;                   // the GPU's gradient over its logits
  DType teacher_dtype = DType::kBFloat16;  // a dense teacher's on the GPU
  bool targets = true;        // else none (distillation with alpha 0)
  bool indices64 = false;     // a top-k teacher's indices int64 (else int32)
  bool forward_only = false;  // GradientMode::kNone: no gradient written
  bool entropy = true;        // token_entropy asked of the GPU
};

std::string Name(const Config& c) {
  return "family " + std::to_string(static_cast<int>(c.family)) + " dtype " +
         std::string(DTypeName(c.dtype)) + " V " + std::to_string(c.vocab) +
         " div " + std::to_string(static_cast<int>(c.divergence)) + " k " +
         std::to_string(c.k) + " tail " +
         std::to_string(static_cast<int>(c.tail)) + " tau " +
         std::to_string(c.tau) + " alpha " + std::to_string(c.alpha) +
         " loss " + std::to_string(static_cast<int>(c.loss)) + " teacher " +
         std::string(DTypeName(c.teacher_dtype)) + " targets " +
         std::to_string(c.targets) + " path " +
         std::to_string(static_cast<int>(c.path)) + " in place " +
         std::to_string(c.in_place) + " indices64 " +
         std::to_string(c.indices64) + " forward only " +
         std::to_string(c.forward_only);
}

// Runs `c` on both backends and compares.
void Compare(const Config& c) {
  SCOPED_TRACE(Name(c));
  std::mt19937 rng(c.seed);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  const int64_t n = c.rows * c.vocab;
  std::vector<float> raw(n), logits;
  for (float& v : raw) v = normal(rng) * c.logit_scale;
  std::vector<int64_t> targets(c.rows);
  for (int64_t& y : targets) y = rng() % c.vocab;
  targets[0] = -100;
  std::vector<float> teacher_raw(n), teacher;
  for (float& v : teacher_raw) v = normal(rng);
  const std::vector<uint8_t> teacher_bytes =
      Encode(teacher_raw, c.teacher_dtype, &teacher);
  for (int64_t i = 0; i < n; ++i) raw[i] += c.teacher_mix * teacher[i];
  const std::vector<uint8_t> logit_bytes = Encode(raw, c.dtype, &logits);
  std::vector<int32_t> indices;
  std::vector<float> logprobs;
  if (c.family == Family::kTopK) {
    for (int64_t row = 0; row < c.rows; ++row) {
      const float* t = teacher.data() + row * c.vocab;
      std::vector<int32_t> order(c.vocab);
      for (int32_t i = 0; i < c.vocab; ++i) order[i] = i;
      std::partial_sort(order.begin(), order.begin() + c.k, order.end(),
                        [t](int32_t a, int32_t b) { return t[a] > t[b]; });
      double m = *std::max_element(t, t + c.vocab), sum = 0.0;
      for (int64_t i = 0; i < c.vocab; ++i) sum += std::exp(t[i] - m);
      for (int64_t j = 0; j < c.k; ++j) {
        indices.push_back(order[j]);
        logprobs.push_back(static_cast<float>(t[order[j]] - m - std::log(sum)));
      }
    }
  }
  const std::vector<int64_t> indices64(indices.begin(), indices.end());
  const void* host_indices =
      c.indices64 ? static_cast<const void*>(indices64.data()) : indices.data();
  const size_t index_bytes = indices.size() * (c.indices64 ? 8 : 4);
  std::vector<float> advantages(c.rows), sampling(c.rows), reference(c.rows);
  for (int64_t row = 0; row < c.rows; ++row) {
    advantages[row] = normal(rng) / 2;
    sampling[row] = -std::log(static_cast<float>(c.vocab)) + normal(rng) / 4;
    reference[row] = sampling[row] + normal(rng) / 8;
  }
  std::vector<int32_t> ids(c.rows);
  for (int64_t row = 0; row < c.rows; ++row) ids[row] = row * 3 / c.rows;

  // The CPU reads the rounded values as fp32 (exactly the device's bytes).
  auto fill = [&](PostTrainingArgs* args, DistillationArgs* kd, PolicyArgs* pg,
                  SegmentArgs* seg) {
    args->base.rows = c.rows;
    args->base.vocab = c.vocab;
    args->base.row_stride = c.vocab;
    args->base.targets_dtype = DType::kInt64;
    args->base.options.softcap = c.softcap;
    args->base.options.grad_scale = 1.5f;
    args->base.mode =
        c.forward_only ? GradientMode::kNone : GradientMode::kOutOfPlace;
    if (c.family == Family::kDense || c.family == Family::kTopK) {
      kd->temperature = c.tau;
      kd->alpha = c.alpha;
      kd->divergence = c.divergence;
      kd->beta = c.beta;
      kd->top_k = c.family == Family::kTopK ? c.k : 0;
      kd->tail = c.tail;
      kd->top_k_indices_dtype = c.indices64 ? DType::kInt64 : DType::kInt32;
      kd->teacher_dtype = DType::kFloat32;
      kd->teacher_row_stride = c.vocab;
      args->distillation = kd;
    }
    if (c.family == Family::kPolicy) {
      pg->loss = c.loss;
      pg->epsilon_low = 0.2f;
      pg->epsilon_high = 0.28f;
      pg->kl_coef = c.reference ? 0.1f : 0.0f;
      pg->kl_estimator = c.estimator;
      args->policy = pg;
    }
    if (c.segments) {
      seg->count = 3;
      seg->reduction = SegmentReduction::kSeqMeanTokenMean;
      args->segments = seg;
    }
  };
  PostTrainingArgs cpu;
  DistillationArgs cpu_kd;
  PolicyArgs cpu_pg;
  SegmentArgs cpu_seg;
  fill(&cpu, &cpu_kd, &cpu_pg, &cpu_seg);
  std::vector<float> cpu_grad(n);
  std::vector<float> cpu_loss(c.rows), cpu_entropy(c.rows);
  cpu.base.logits_dtype = DType::kFloat32;
  cpu.base.logits = logits.data();
  // (mode none takes no gradient pointer)
  cpu.base.gradient = c.forward_only ? nullptr : cpu_grad.data();
  cpu.base.targets = c.targets ? targets.data() : nullptr;
  cpu.base.token_loss = cpu_loss.data();
  cpu.token_entropy = cpu_entropy.data();
  if (cpu.distillation != nullptr) {
    if (c.family == Family::kDense) cpu_kd.teacher_logits = teacher.data();
    cpu_kd.top_k_indices = host_indices;
    cpu_kd.top_k_logprobs = logprobs.data();
    if (c.family == Family::kDense) {
      cpu_kd.top_k_indices = nullptr;
      cpu_kd.top_k_logprobs = nullptr;
    }
  }
  cpu_pg.advantages = advantages.data();
  cpu_pg.sampling_logprobs = sampling.data();
  cpu_pg.reference_logprobs = c.reference ? reference.data() : nullptr;
  cpu_seg.ids = ids.data();
  PostTrainingResult want;
  ASSERT_TRUE(PostTrainingCpu(cpu, &want).ok());

  DeviceBytes d_logits(logit_bytes.data(), logit_bytes.size());
  DeviceBytes d_grad(logit_bytes.data(), logit_bytes.size());
  DeviceBytes d_targets(targets.data(), targets.size() * 8);
  DeviceBytes d_teacher(teacher_bytes.data(), teacher_bytes.size());
  DeviceBytes d_indices(host_indices, index_bytes);
  DeviceBytes d_logprobs(logprobs.data(), logprobs.size() * 4);
  DeviceBytes d_adv(advantages.data(), advantages.size() * 4);
  DeviceBytes d_sampling(sampling.data(), sampling.size() * 4);
  DeviceBytes d_reference(reference.data(), reference.size() * 4);
  DeviceBytes d_ids(ids.data(), ids.size() * 4);
  PostTrainingArgs gpu;
  DistillationArgs gpu_kd;
  PolicyArgs gpu_pg;
  SegmentArgs gpu_seg;
  fill(&gpu, &gpu_kd, &gpu_pg, &gpu_seg);
  std::vector<float> gpu_loss(c.rows), gpu_entropy(c.rows);
  gpu.base.logits_dtype = c.dtype;
  gpu.base.logits = d_logits.get();
  gpu.base.gradient = c.forward_only ? nullptr
                      : c.in_place   ? d_logits.get()
                                     : d_grad.get();
  if (c.in_place && !c.forward_only) gpu.base.mode = GradientMode::kInPlace;
  gpu.base.targets = c.targets ? d_targets.get() : nullptr;
  gpu.base.token_loss = gpu_loss.data();
  gpu.token_entropy = c.entropy ? gpu_entropy.data() : nullptr;
  if (c.family == Family::kDense) {
    gpu_kd.teacher_logits = d_teacher.get();
    gpu_kd.teacher_dtype = c.teacher_dtype;
  } else {
    gpu_kd.top_k_indices = d_indices.get();
    gpu_kd.top_k_logprobs = static_cast<const float*>(d_logprobs.get());
  }
  gpu_pg.advantages = static_cast<const float*>(d_adv.get());
  gpu_pg.sampling_logprobs = static_cast<const float*>(d_sampling.get());
  gpu_pg.reference_logprobs =
      c.reference ? static_cast<const float*>(d_reference.get()) : nullptr;
  gpu_seg.ids = static_cast<const int32_t*>(d_ids.get());
  PostTrainingResult got;
  const absl::Status status = PostTrainingCuda(gpu, &got, nullptr, c.path);
  ASSERT_TRUE(status.ok()) << status;

  EXPECT_NEAR(got.base.loss, want.base.loss,
              2e-4 * std::fabs(want.base.loss) + 1e-5);
  EXPECT_NEAR(got.distillation_loss, want.distillation_loss,
              2e-4 * std::fabs(want.distillation_loss) + 1e-5);
  EXPECT_EQ(got.base.valid_tokens, want.base.valid_tokens);
  EXPECT_EQ(got.base.correct_tokens, want.base.correct_tokens);
  EXPECT_EQ(got.policy.clipped_tokens, want.policy.clipped_tokens);
  EXPECT_EQ(got.segment_tokens, want.segment_tokens);
  EXPECT_NEAR(got.policy.ratio_sum, want.policy.ratio_sum,
              2e-4 * std::fabs(want.policy.ratio_sum) + 1e-5);
  EXPECT_NEAR(got.policy.kl_sum, want.policy.kl_sum,
              2e-4 * std::fabs(want.policy.kl_sum) + 1e-5);
  EXPECT_NEAR(got.policy.entropy_sum, want.policy.entropy_sum,
              1e-4 * std::fabs(want.policy.entropy_sum) + 1e-4);
  for (int64_t row = 0; row < c.rows; ++row) {
    EXPECT_NEAR(gpu_loss[row], cpu_loss[row],
                2e-4 * std::fabs(cpu_loss[row]) + 2e-5)
        << "row " << row;
    if (c.entropy) {
      EXPECT_NEAR(gpu_entropy[row], cpu_entropy[row],
                  1e-4 * std::fabs(cpu_entropy[row]) + 2e-5);
    }
  }
  const std::vector<uint8_t> grad =
      c.in_place ? d_logits.Read() : d_grad.Read();
  if (c.forward_only) {
    // Nothing written: both buffers still hold the logits.
    EXPECT_TRUE(grad == logit_bytes);
    EXPECT_TRUE(d_logits.Read() == logit_bytes);
    return;
  }
  // Each row's factor s in the reduced, scaled loss.
  const PostTrainingPlan plan = PlanPostTraining(cpu);
  const double unit = c.dtype == DType::kFloat32   ? 1.0 / (1 << 23)
                      : c.dtype == DType::kFloat16 ? 1.0 / (1 << 10)
                                                   : 1.0 / (1 << 7);
  int bad = 0;
  for (int64_t row = 0; row < c.rows; ++row) {
    double row_max = 0.0;
    for (int64_t i = 0; i < c.vocab; ++i) {
      row_max =
          std::max(row_max, std::fabs(double(cpu_grad[row * c.vocab + i])));
    }
    for (int64_t i = 0; i < c.vocab; ++i) {
      const size_t at = row * c.vocab + i;
      const double want_g = cpu_grad[at];
      const double got_g = Decode(grad, c.dtype, at);
      // One rounding of the output dtype (fp16's subnormal spacing near 0),
      // plus fp32 row math against the fp64 reference: 5e-5 of the row's
      // largest element and 2^-18 of its factor s (grad_scale 1.5 times the
      // reduction's; docs/api.md, "Post-training losses").
      const double floor =
          c.dtype == DType::kFloat16 ? std::ldexp(1.0, -24) : 0.0;
      const double tolerance =
          std::max(unit * std::fabs(want_g), floor) + 5e-5 * row_max +
          std::ldexp(std::fabs(plan.row_scale[row] * 1.5), -18) + 1e-30;
      if (!(std::fabs(got_g - want_g) <= tolerance) && bad++ < 5) {
        ADD_FAILURE() << "gradient [" << row << ", " << i << "] = " << got_g
                      << ", expected " << want_g;
      }
    }
  }
  EXPECT_EQ(bad, 0);
}

class PostTrainingCudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!HaveGpu()) GTEST_SKIP() << "no CUDA GPU visible";
  }
};

TEST_F(PostTrainingCudaTest, DenseDistillationMatchesTheCpu) {
  uint32_t seed = 10;
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    for (Divergence divergence :
         {Divergence::kForwardKl, Divergence::kReverseKl, Divergence::kJsd}) {
      for (int64_t vocab : {7, 1001}) {
        Config c{Family::kDense, dtype, 9, vocab};
        c.divergence = divergence;
        c.beta = 0.3f;
        c.tau = vocab == 7 ? 2.0f : 1.0f;
        c.alpha = divergence == Divergence::kJsd ? 0.4f : 0.0f;
        c.softcap = vocab == 7 ? 5.0f : 0.0f;
        c.segments = divergence == Divergence::kReverseKl;
        c.seed = seed++;
        Compare(c);
      }
    }
  }
}

// A student nearly sure of one class against a teacher that is not: its
// reverse-KL gradient P_c (log P_c - log Q_c - gbar) is a difference of two
// terms ~10 that are ~1e-3 apart, and each log carries fp32's rounding of
// its lse (the oracle's seed 21, case 197).
TEST_F(PostTrainingCudaTest, DenseReverseKlOfASharpStudentMatchesTheCpu) {
  uint32_t seed = 40;
  for (DType dtype : {DType::kFloat16, DType::kFloat32}) {
    for (float tau : {0.5f, 1.0f}) {
      // (V 65536: the dense teacher's row pieces)
      Config c{Family::kDense, dtype, 24, tau == 1.0f ? 31 : 65536};
      c.divergence = Divergence::kReverseKl;
      c.tau = tau;
      c.logit_scale = 3.0f;
      c.in_place = true;
      c.seed = seed++;
      Compare(c);
    }
  }
  // A top-k teacher whose support holds the student's favourite class, on
  // both schedules.
  for (PostTrainingCudaPath path :
       {PostTrainingCudaPath::kAuto, PostTrainingCudaPath::kRowKernel}) {
    for (TopKTail tail : {TopKTail::kRenormalize, TopKTail::kBucket}) {
      Config c{Family::kTopK, DType::kBFloat16, 6, 32768};
      c.k = 64;
      c.tail = tail;
      c.divergence = Divergence::kReverseKl;
      c.logit_scale = 0.5f;
      c.teacher_mix = 3.0f;
      c.path = path;
      c.seed = seed++;
      Compare(c);
    }
  }
}

TEST_F(PostTrainingCudaTest, TopKDistillationMatchesTheCpu) {
  uint32_t seed = 100;
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    for (TopKTail tail : {TopKTail::kRenormalize, TopKTail::kBucket}) {
      for (int64_t k : {1, 5, 13}) {
        for (Divergence divergence :
             {Divergence::kForwardKl, Divergence::kReverseKl,
              Divergence::kJsd}) {
          Config c{Family::kTopK, dtype, 6, 13};
          c.k = k;
          c.tail = tail;
          c.divergence = divergence;
          c.tau = 0.7f;
          c.seed = seed++;
          Compare(c);
        }
      }
    }
  }
}

TEST_F(PostTrainingCudaTest, PolicyLossesMatchTheCpu) {
  uint32_t seed = 200;
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    for (PolicyLossKind loss :
         {PolicyLossKind::kImportanceSampling, PolicyLossKind::kPpoClip,
          PolicyLossKind::kCispo}) {
      for (KlEstimator estimator :
           {KlEstimator::kK1, KlEstimator::kK2, KlEstimator::kK3}) {
        Config c{Family::kPolicy, dtype, 17, 257};
        c.loss = loss;
        c.estimator = estimator;
        c.reference = estimator != KlEstimator::kK1 || dtype == DType::kFloat32;
        c.segments = loss == PolicyLossKind::kCispo;
        c.seed = seed++;
        Compare(c);
      }
    }
  }
}

// What the GPU path refuses before touching anything (a pure check: no GPU
// needed): a top-k teacher past the support bitmap. Label smoothing and z-loss
// beside the loss are served.
TEST(PostTrainingCudaSupportTest, RefusesWhatTheGpuDoesNotOffer) {
  PolicyArgs policy;
  PostTrainingArgs args;
  args.base.vocab = 1000;
  args.policy = &policy;
  EXPECT_TRUE(CheckPostTrainingCudaSupport(args).ok());
  args.base.options.z_loss_scale = 1e-4f;
  args.base.options.label_smoothing = 0.1f;
  EXPECT_TRUE(CheckPostTrainingCudaSupport(args).ok());
  DistillationArgs top_k;
  args.policy = nullptr;
  args.distillation = &top_k;
  args.base.vocab = kPostTrainingCudaMaxTopKVocab;
  EXPECT_TRUE(CheckPostTrainingCudaSupport(args).ok());
  args.base.vocab = kPostTrainingCudaMaxTopKVocab + 1;
  EXPECT_EQ(CheckPostTrainingCudaSupport(args).code(),
            absl::StatusCode::kUnimplemented);
}

TEST_F(PostTrainingCudaTest, LargeVocabularyMatchesTheCpu) {
  Config dense{Family::kDense, DType::kBFloat16, 3, 128256};
  dense.divergence = Divergence::kJsd;
  dense.beta = 0.5f;
  Compare(dense);
  Config top_k{Family::kTopK, DType::kBFloat16, 3, 128256};
  top_k.k = 512;
  top_k.tail = TopKTail::kBucket;
  Compare(top_k);
  Config policy{Family::kPolicy, DType::kBFloat16, 3, 128256};
  Compare(policy);
  // A top-k teacher past the default shared memory's bitmap (V 327680), up
  // to the largest offered, on the row kernel (tau 2).
  for (int64_t vocab : {int64_t{327681}, kPostTrainingCudaMaxTopKVocab}) {
    for (TopKTail tail : {TopKTail::kRenormalize, TopKTail::kBucket}) {
      Config c{Family::kTopK, DType::kBFloat16, 2, vocab};
      c.k = 64;
      c.tail = tail;
      c.tau = 2.0f;
      c.divergence = Divergence::kReverseKl;
      c.seed = static_cast<uint32_t>(vocab) + static_cast<uint32_t>(tail);
      Compare(c);
    }
  }
}

// Rows of whole 16-byte vectors long enough for the smem row pieces schedule
// (2-byte rows from 32 KiB, fp32 from 120 KiB): the policy losses, plain
// cross entropy with segments and top-k distillation (k 1, 64, 512) there,
// a dense teacher on its own pieces (every divergence, dtype pair,
// temperature and the alpha mix, in place and not, without targets; a sharp
// student; JSD at beta 0 and 1), and the same calls on the row kernel.
TEST_F(PostTrainingCudaTest, FastScheduleMatchesTheCpuAndTheRowKernel) {
  uint32_t seed = 300;
  for (PostTrainingCudaPath path :
       {PostTrainingCudaPath::kAuto, PostTrainingCudaPath::kRowKernel}) {
    for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
      for (PolicyLossKind loss :
           {PolicyLossKind::kImportanceSampling, PolicyLossKind::kPpoClip,
            PolicyLossKind::kCispo}) {
        Config c{Family::kPolicy, dtype, 9, 32768};
        c.loss = loss;
        c.estimator = loss == PolicyLossKind::kCispo ? KlEstimator::kK2
                                                     : KlEstimator::kK3;
        c.reference = loss != PolicyLossKind::kImportanceSampling;
        c.segments = loss == PolicyLossKind::kPpoClip;
        c.softcap = dtype == DType::kBFloat16 ? 20.0f : 0.0f;
        // (2-byte logits in place: the build with the threads' own loads)
        c.in_place = dtype != DType::kFloat32 &&
                     loss == PolicyLossKind::kImportanceSampling;
        c.path = path;
        c.seed = seed++;
        Compare(c);
      }
      Config plain{Family::kPlain, dtype, 7, 40000};
      plain.segments = true;
      plain.path = path;
      plain.seed = seed++;
      Compare(plain);
      for (Divergence divergence :
           {Divergence::kForwardKl, Divergence::kReverseKl, Divergence::kJsd}) {
        for (TopKTail tail : {TopKTail::kRenormalize, TopKTail::kBucket}) {
          Config c{Family::kTopK, dtype, 5, 32768};
          c.k = tail == TopKTail::kBucket ? 64 : 1 + seed % 2 * 511;
          c.tail = tail;
          c.divergence = divergence;
          c.beta = 0.3f;
          c.alpha = divergence == Divergence::kJsd ? 0.4f : 0.0f;
          c.softcap = dtype == DType::kBFloat16 ? 20.0f : 0.0f;
          c.segments = divergence == Divergence::kReverseKl;
          c.in_place = dtype != DType::kFloat32 && tail == TopKTail::kBucket &&
                       divergence == Divergence::kForwardKl;
          c.path = path;
          c.seed = seed++;
          Compare(c);
        }
      }
      for (Divergence divergence :
           {Divergence::kForwardKl, Divergence::kReverseKl, Divergence::kJsd}) {
        Config c{Family::kDense, dtype, 5,
                 dtype == DType::kFloat32 ? 32768 : 40000};
        c.divergence = divergence;
        // (fp16: JSD at beta 0 or 1, defined as forward or reverse KL)
        c.beta = dtype == DType::kFloat16 ? static_cast<float>(seed % 2) : 0.3f;
        c.tau = seed % 3 == 0 ? 1.0f : seed % 3 == 1 ? 2.0f : 0.5f;
        c.alpha = seed % 2 == 0 ? 0.4f : 0.0f;
        c.targets = c.alpha > 0.0f || seed % 4 != 1;
        c.teacher_dtype = seed % 3 == 0   ? DType::kFloat32
                          : seed % 3 == 1 ? DType::kBFloat16
                                          : DType::kFloat16;
        c.teacher_mix = divergence == Divergence::kReverseKl ? 1.0f : 0.0f;
        c.segments = divergence == Divergence::kJsd;
        c.in_place = seed % 2 == 1;
        c.path = path;
        c.seed = seed++;
        Compare(c);
      }
    }
  }
}

// Top-k distillation at temperature 0.5 and 2 on the fast schedule (the tail
// bucket on the builds that also sum exp(z / tau), the renormalised support
// at tau on the others) and on the row kernel: every dtype, both tails, alpha
// 0 and 0.4, each divergence, k 1 and 64 (staged in shared memory) and 200 /
// 512 (read from global memory), int32 and int64 indices, a softcap, in place,
// segments, a sharper student, with and without the entropy asked for;
// ignore_index rows (row 0 of every call).
TEST_F(PostTrainingCudaTest, TopKAtAnyTemperatureMatchesTheCpuAndTheRowKernel) {
  uint32_t seed = 500;
  for (PostTrainingCudaPath path :
       {PostTrainingCudaPath::kAuto, PostTrainingCudaPath::kRowKernel}) {
    for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
      for (float tau : {0.5f, 2.0f}) {
        for (TopKTail tail : {TopKTail::kRenormalize, TopKTail::kBucket}) {
          for (float alpha : {0.0f, 0.4f}) {
            Config c{Family::kTopK, dtype, 5,
                     dtype == DType::kFloat32 ? 32768 : 40000};
            const int64_t ks[] = {1, 64, tail == TopKTail::kBucket ? 200 : 512};
            c.k = ks[seed % 3];
            c.tail = tail;
            c.tau = tau;
            c.alpha = alpha;
            const Divergence divergences[] = {Divergence::kForwardKl,
                                              Divergence::kReverseKl,
                                              Divergence::kJsd};
            c.divergence = divergences[seed / 3 % 3];
            c.beta = 0.3f;
            c.softcap =
                dtype == DType::kBFloat16 && seed % 2 == 0 ? 20.0f : 0.0f;
            c.logit_scale = seed % 4 == 0 ? 2.5f : 1.0f;
            c.in_place = dtype != DType::kFloat32 && seed % 3 == 1;
            c.indices64 = seed % 2 == 1;
            c.segments = seed % 5 == 0;
            c.entropy = seed % 3 != 2;
            c.path = path;
            c.seed = seed++;
            Compare(c);
          }
        }
      }
    }
  }
}

// Forward only (no gradient, as Evaluate calls it) on the fast schedule and
// on the row kernel: the policy losses, top-k at temperature 1 and 2, plain
// cross entropy with segments; nothing written over the logits or the
// gradient buffer.
TEST_F(PostTrainingCudaTest, ForwardOnlyMatchesTheCpuAndWritesNothing) {
  uint32_t seed = 700;
  for (PostTrainingCudaPath path :
       {PostTrainingCudaPath::kAuto, PostTrainingCudaPath::kRowKernel}) {
    for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
      const int64_t vocab = dtype == DType::kFloat32 ? 32768 : 40000;
      std::vector<Config> configs;
      for (PolicyLossKind loss :
           {PolicyLossKind::kImportanceSampling, PolicyLossKind::kPpoClip,
            PolicyLossKind::kCispo}) {
        Config c{Family::kPolicy, dtype, 7, vocab};
        c.loss = loss;
        c.reference = true;
        configs.push_back(c);
      }
      for (float tau : {1.0f, 2.0f}) {
        Config c{Family::kTopK, dtype, 5, vocab};
        c.k = 64;
        c.tail = TopKTail::kBucket;
        c.tau = tau;
        c.alpha = 0.4f;
        configs.push_back(c);
      }
      Config plain{Family::kPlain, dtype, 7, vocab};
      plain.segments = true;
      configs.push_back(plain);
      for (Divergence divergence : {Divergence::kForwardKl, Divergence::kJsd}) {
        Config c{Family::kDense, dtype, 5, vocab};  // the dense pieces' records
        c.divergence = divergence;
        c.tau = divergence == Divergence::kJsd ? 1.0f : 2.0f;
        c.alpha = 0.4f;
        configs.push_back(c);
      }
      for (Config& c : configs) {
        c.forward_only = true;
        c.in_place = seed % 2 == 0;
        c.softcap = dtype == DType::kBFloat16 && seed % 3 == 0 ? 20.0f : 0.0f;
        c.path = path;
        c.seed = seed++;
        Compare(c);
      }
    }
  }
}

// Times a kernel call (median of 5 after one warm-up) in seconds.
template <typename Call>
double Time(Call call) {
  std::vector<double> times;
  for (int i = 0; i < 6; ++i) {
    cudaDeviceSynchronize();
    const auto start = std::chrono::steady_clock::now();
    call();
    cudaDeviceSynchronize();
    times.push_back(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
            .count());
  }
  std::sort(times.begin() + 1, times.end());
  return times[3];
}

// A bench's bf16 call in place on `logits` [rows, vocab] with int64
// targets, and in the same run the times of a device copy of the logits
// (into `copy`) and of cross entropy on them.
struct BenchBase {
  CrossEntropyArgs base;
  double copy_s = 0.0;
  double ce_s = 0.0;
};
BenchBase TimeCopyAndCrossEntropy(int64_t rows, int64_t vocab, void* logits,
                                  void* copy, const void* targets) {
  BenchBase b;
  const size_t bytes = static_cast<size_t>(rows * vocab) * 2;
  b.copy_s =
      Time([&] { cudaMemcpy(copy, logits, bytes, cudaMemcpyDeviceToDevice); });
  CrossEntropyArgs& base = b.base;
  base.rows = rows;
  base.vocab = base.row_stride = vocab;
  base.logits_dtype = DType::kBFloat16;
  base.logits = base.gradient = logits;
  base.mode = GradientMode::kInPlace;
  base.targets = targets;
  base.targets_dtype = DType::kInt64;
  b.ce_s = Time([&] {
    CrossEntropyResult result;
    const absl::Status status = CrossEntropyCuda(base, &result, nullptr);
    EXPECT_TRUE(status.ok()) << status;
  });
  return b;
}

// Dense KD (forward KL, reverse KL, JSD(0.5)) and top-k KD (k = 64, tail
// bucket, tau 1 and 2) fwd+gradient in place, bf16, at the two large shapes,
// against a device copy of the logits and cross entropy in the same run; a
// dense teacher's traffic floor is 1.5 copies (student read + write, teacher
// read). Run with --gtest_also_run_disabled_tests --gtest_filter=*Bench*.
TEST_F(PostTrainingCudaTest, DISABLED_BenchDistillation) {
  const int64_t k = 64;
  for (const auto& [rows, vocab] :
       {std::pair<int64_t, int64_t>{8192, 128256}, {16384, 131072}}) {
    const size_t bytes = static_cast<size_t>(rows * vocab) * 2;
    void *student = nullptr, *teacher = nullptr, *copy = nullptr;
    ASSERT_EQ(cudaMalloc(&student, bytes), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&teacher, bytes), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&copy, bytes), cudaSuccess);
    cudaMemset(student, 0x3c, bytes);  // bf16 ~0.011
    cudaMemset(teacher, 0x3d, bytes);
    std::vector<int32_t> indices(rows * k);
    std::vector<float> logprobs(rows * k, -6.0f);
    for (int64_t row = 0; row < rows; ++row) {
      for (int64_t j = 0; j < k; ++j)
        indices[row * k + j] = (row + j * 997) % vocab;
    }
    DeviceBytes d_indices(indices.data(), indices.size() * 4);
    DeviceBytes d_logprobs(logprobs.data(), logprobs.size() * 4);
    std::vector<int64_t> targets(rows);
    for (int64_t row = 0; row < rows; ++row)
      targets[row] = (row * 7919) % vocab;
    DeviceBytes d_targets(targets.data(), targets.size() * 8);
    const BenchBase b =
        TimeCopyAndCrossEntropy(rows, vocab, student, copy, d_targets.get());
    const CrossEntropyArgs& base = b.base;
    const double copy_s = b.copy_s, ce_s = b.ce_s;
    auto run = [&](bool dense, Divergence divergence, float tau,
                   PostTrainingCudaPath path) {
      PostTrainingArgs args;
      args.base = base;
      DistillationArgs kd;
      kd.divergence = divergence;
      kd.temperature = tau;
      if (dense) {
        kd.teacher_logits = teacher;
        kd.teacher_dtype = DType::kBFloat16;
        kd.teacher_row_stride = vocab;
      } else {
        kd.top_k = k;
        kd.top_k_indices = d_indices.get();
        kd.top_k_logprobs = static_cast<const float*>(d_logprobs.get());
        kd.tail = TopKTail::kBucket;
      }
      args.distillation = &kd;
      PostTrainingResult result;
      const absl::Status status =
          PostTrainingCuda(args, &result, nullptr, path);
      EXPECT_TRUE(status.ok()) << status;
    };
    struct BenchRow {
      const char* name;
      bool dense;
      Divergence divergence;
      float tau;
      PostTrainingCudaPath path;
    };
    constexpr auto kAuto = PostTrainingCudaPath::kAuto;
    const BenchRow bench_rows[] = {
        {"dense FKL", true, Divergence::kForwardKl, 1.0f, kAuto},
        {"dense RKL", true, Divergence::kReverseKl, 1.0f, kAuto},
        {"dense JSD(0.5)", true, Divergence::kJsd, 1.0f, kAuto},
        {"dense FKL tau 2", true, Divergence::kForwardKl, 2.0f, kAuto},
        {"dense FKL on the row kernel", true, Divergence::kForwardKl, 1.0f,
         PostTrainingCudaPath::kRowKernel},
        {"dense JSD(0.5) on the row kernel", true, Divergence::kJsd, 1.0f,
         PostTrainingCudaPath::kRowKernel},
        {"top-k (k=64, bucket) FKL", false, Divergence::kForwardKl, 1.0f,
         kAuto},
        {"top-k (k=64, bucket) FKL tau 2", false, Divergence::kForwardKl, 2.0f,
         kAuto}};
    std::printf(
        "bench: bf16 %lld x %lld in place: copy %.3f ms; cross entropy %.3f "
        "ms (%.0f%% of copy)\n",
        static_cast<long long>(rows), static_cast<long long>(vocab),
        copy_s * 1e3, ce_s * 1e3, 100.0 * copy_s / ce_s);
    for (const BenchRow& r : bench_rows) {
      const double t = Time([&] { run(r.dense, r.divergence, r.tau, r.path); });
      // (a dense teacher's floor: 1.5 copies)
      std::printf("bench:   %s %.3f ms (%.0f%% of copy, %.0f%% of its floor)\n",
                  r.name, t * 1e3, 100.0 * copy_s / t,
                  (r.dense ? 150.0 : 100.0) * copy_s / t);
    }
    cudaFree(student);
    cudaFree(teacher);
    cudaFree(copy);
  }
}

// The policy losses (importance sampling, PPO-clip and CISPO, each with a k3
// reference KL), top-k distillation (k = 64: the tail bucket at temperature
// 1, 2 and 0.5 with alpha 0.5, reverse KL at 2, renormalised at 2) and plain
// cross entropy, fwd+gradient in place, bf16, at the two large shapes,
// against a device copy of the logits (their traffic floor: one read and one
// write) and cross entropy itself in the same run, on the fast schedule and
// (two rows) on the row kernel, with every per-token output asked for (two
// rows: what comes back to the host); then forward only (no gradient: one
// read), beside cross entropy's forward only. Run with
// --gtest_also_run_disabled_tests --gtest_filter=*Bench*.
TEST_F(PostTrainingCudaTest, DISABLED_BenchPolicyAndTopK) {
  const int64_t k = 64;
  for (const auto& [rows, vocab] :
       {std::pair<int64_t, int64_t>{8192, 128256}, {16384, 131072}}) {
    const size_t bytes = static_cast<size_t>(rows * vocab) * 2;
    void *logits = nullptr, *copy = nullptr;
    ASSERT_EQ(cudaMalloc(&logits, bytes), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&copy, bytes), cudaSuccess);
    cudaMemset(logits, 0x3c, bytes);  // bf16 ~0.011
    std::vector<int64_t> targets(rows);
    std::vector<float> advantages(rows), sampling(rows), reference(rows);
    std::vector<int32_t> indices(rows * k);
    std::vector<float> logprobs(rows * k, -6.0f);
    for (int64_t row = 0; row < rows; ++row) {
      targets[row] = (row * 7919) % vocab;
      advantages[row] = (row % 3) - 1.0f;
      sampling[row] = -std::log(static_cast<float>(vocab)) + (row % 5) * 0.1f;
      reference[row] = sampling[row] - 0.05f;
      for (int64_t j = 0; j < k; ++j)
        indices[row * k + j] = (row + j * 997) % vocab;
    }
    DeviceBytes d_targets(targets.data(), targets.size() * 8);
    DeviceBytes d_adv(advantages.data(), advantages.size() * 4);
    DeviceBytes d_sampling(sampling.data(), sampling.size() * 4);
    DeviceBytes d_reference(reference.data(), reference.size() * 4);
    DeviceBytes d_indices(indices.data(), indices.size() * 4);
    DeviceBytes d_logprobs(logprobs.data(), logprobs.size() * 4);
    const BenchBase b =
        TimeCopyAndCrossEntropy(rows, vocab, logits, copy, d_targets.get());
    CrossEntropyArgs forward = b.base;
    forward.mode = GradientMode::kNone;
    forward.gradient = nullptr;
    const double ce_forward_s = Time([&] {
      CrossEntropyResult result;
      const absl::Status status = CrossEntropyCuda(forward, &result, nullptr);
      EXPECT_TRUE(status.ok()) << status;
    });
    struct BenchRow {
      const char* name;
      Family family;
      PolicyLossKind loss = PolicyLossKind::kPpoClip;
      float tau = 1.0f, alpha = 0.0f;
      Divergence divergence = Divergence::kForwardKl;
      TopKTail tail = TopKTail::kBucket;
      PostTrainingCudaPath path = PostTrainingCudaPath::kAuto;
      bool forward_only = false;
      bool tokens = false;  // every per-token output asked for
    };
    constexpr auto kRowKernel = PostTrainingCudaPath::kRowKernel;
    const BenchRow bench_rows[] = {
        {"plain CE (post-training call)", Family::kPlain},
        {"IS + k3 KL", Family::kPolicy, PolicyLossKind::kImportanceSampling},
        {"PPO-clip + k3 KL", Family::kPolicy, PolicyLossKind::kPpoClip},
        {"CISPO + k3 KL", Family::kPolicy, PolicyLossKind::kCispo},
        {"PPO-clip + k3 KL, row kernel", Family::kPolicy,
         PolicyLossKind::kPpoClip, 1.0f, 0.0f, Divergence::kForwardKl,
         TopKTail::kBucket, kRowKernel},
        {"PPO-clip + k3 KL, every per-token output", Family::kPolicy,
         PolicyLossKind::kPpoClip, 1.0f, 0.0f, Divergence::kForwardKl,
         TopKTail::kBucket, PostTrainingCudaPath::kAuto, false, true},
        {"top-k bucket FKL tau 1", Family::kTopK},
        {"top-k bucket FKL tau 1, every per-token output",
         Family::kTopK,
         {},
         1.0f,
         0.0f,
         Divergence::kForwardKl,
         TopKTail::kBucket,
         PostTrainingCudaPath::kAuto,
         false,
         true},
        {"top-k bucket FKL tau 2", Family::kTopK, {}, 2.0f},
        {"top-k bucket FKL tau 0.5 alpha 0.5", Family::kTopK, {}, 0.5f, 0.5f},
        {"top-k bucket RKL tau 2",
         Family::kTopK,
         {},
         2.0f,
         0.0f,
         Divergence::kReverseKl},
        {"top-k renormalized FKL tau 2",
         Family::kTopK,
         {},
         2.0f,
         0.0f,
         Divergence::kForwardKl,
         TopKTail::kRenormalize},
        {"top-k bucket FKL tau 2, row kernel",
         Family::kTopK,
         {},
         2.0f,
         0.0f,
         Divergence::kForwardKl,
         TopKTail::kBucket,
         kRowKernel},
        {"forward only: plain CE (post-training call)",
         Family::kPlain,
         {},
         1.0f,
         0.0f,
         Divergence::kForwardKl,
         TopKTail::kBucket,
         PostTrainingCudaPath::kAuto,
         true},
        {"forward only: PPO-clip + k3 KL", Family::kPolicy,
         PolicyLossKind::kPpoClip, 1.0f, 0.0f, Divergence::kForwardKl,
         TopKTail::kBucket, PostTrainingCudaPath::kAuto, true},
        {"forward only: top-k bucket FKL tau 2",
         Family::kTopK,
         {},
         2.0f,
         0.0f,
         Divergence::kForwardKl,
         TopKTail::kBucket,
         PostTrainingCudaPath::kAuto,
         true},
        {"forward only: PPO-clip + k3 KL, row kernel", Family::kPolicy,
         PolicyLossKind::kPpoClip, 1.0f, 0.0f, Divergence::kForwardKl,
         TopKTail::kBucket, kRowKernel, true},
    };
    std::vector<float> token_floats(static_cast<size_t>(rows) * 6);
    std::vector<int32_t> token_argmax(rows);
    std::vector<uint8_t> token_clipped(rows);
    auto run = [&](const BenchRow& r) {
      PostTrainingArgs args;
      args.base = r.forward_only ? forward : b.base;
      if (r.tokens) {
        float* f = token_floats.data();
        args.base.token_loss = f;
        args.base.token_lse = f + rows;
        args.token_logprob = f + 2 * rows;
        args.token_entropy = f + 3 * rows;
        args.token_ratio = f + 4 * rows;
        args.base.token_argmax = token_argmax.data();
        args.token_clipped = token_clipped.data();
      }
      PolicyArgs pg;
      pg.loss = r.loss;
      pg.advantages = static_cast<const float*>(d_adv.get());
      pg.sampling_logprobs = static_cast<const float*>(d_sampling.get());
      pg.reference_logprobs = static_cast<const float*>(d_reference.get());
      pg.kl_coef = 0.05f;
      if (r.family == Family::kPolicy) args.policy = &pg;
      DistillationArgs kd;
      kd.divergence = r.divergence;
      kd.temperature = r.tau;
      kd.alpha = r.alpha;
      kd.top_k = k;
      kd.top_k_indices = d_indices.get();
      kd.top_k_logprobs = static_cast<const float*>(d_logprobs.get());
      kd.tail = r.tail;
      if (r.family == Family::kTopK) args.distillation = &kd;
      PostTrainingResult result;
      const absl::Status status =
          PostTrainingCuda(args, &result, nullptr, r.path);
      EXPECT_TRUE(status.ok()) << status;
    };
    auto pct = [&](double t) { return 100.0 * b.copy_s / t; };
    std::printf(
        "bench: bf16 %lld x %lld in place: copy %.3f ms; cross entropy %.3f "
        "ms (%.0f%% of copy); cross entropy forward only %.3f ms\n",
        static_cast<long long>(rows), static_cast<long long>(vocab),
        b.copy_s * 1e3, b.ce_s * 1e3, pct(b.ce_s), ce_forward_s * 1e3);
    for (const BenchRow& r : bench_rows) {
      const double t = Time([&] { run(r); });
      std::printf("bench:   %s %.3f ms (%.0f%% of copy)\n", r.name, t * 1e3,
                  pct(t));
    }
    cudaFree(logits);
    cudaFree(copy);
  }
}

}  // namespace
}  // namespace lossd
