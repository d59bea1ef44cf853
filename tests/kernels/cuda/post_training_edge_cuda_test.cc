// Distillation's edge rows on the GPU against the CPU backend (docs/api.md,
// "Edge rows"): a class of no mass on one side, a side of no mass at all, a
// top-k support whose mass passes 1; on each schedule that takes them.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/post_training_cpu.h"
#include "kernels/cuda/post_training_cuda_host.h"
#include "tests/kernels/cuda/cross_entropy_cuda_test_util.h"

namespace lossd {
namespace {

using cuda_ce_test::DeviceBuffer;
using cuda_ce_test::FromFloat;
using cuda_ce_test::HaveGpu;
using cuda_ce_test::ToFloat;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int64_t kRows = 6;
constexpr int64_t kTopK = 4;

// One call's inputs, as the GPU gets them (student in `dtype`, a dense
// teacher in bf16) and as the CPU reads them (the same values in fp32).
struct EdgeCase {
  DType dtype = DType::kBFloat16;
  int64_t vocab = 0;
  bool dense = true;
  TopKTail tail = TopKTail::kRenormalize;
  Divergence divergence = Divergence::kForwardKl;
  float tau = 1.0f;
  float alpha = 0.0f;
  PostTrainingCudaPath path = PostTrainingCudaPath::kAuto;
  std::vector<float> student, teacher, logprobs;
  std::vector<int32_t> indices;
  std::vector<int64_t> targets;
};

float Rounded(DType dtype, float v) {
  std::vector<uint8_t> raw(4);
  FromFloat(&raw, dtype, 0, v);
  return ToFloat(raw, dtype, 0);
}

// Random rows, then row r's edge: 1 a student class of no mass inside the
// support (or the dense teacher's same column); 2 a teacher class of no mass
// where the student has some; 3 the dense teacher's row all -inf, the
// student's renormalised support all -inf, or a tail bucket's support all
// -inf; 4 the student's row all -inf; 5 a support of mass 1.1 + (the tail
// bucket's teacher tail 0).
void Fill(EdgeCase* c, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  const int64_t vocab = c->vocab;
  c->student.resize(kRows * vocab);
  c->teacher.resize(kRows * vocab);
  for (float& v : c->student) v = Rounded(c->dtype, normal(rng));
  for (float& v : c->teacher) v = Rounded(DType::kBFloat16, normal(rng));
  for (int64_t r = 0; r < kRows; ++r) {
    c->targets.push_back((r * 5 + 3) % vocab);
    double sum = 0.0;
    std::vector<double> q(kTopK);
    for (double& v : q) sum += v = std::exp(normal(rng) / 2);
    for (int64_t j = 0; j < kTopK; ++j) {
      c->indices.push_back(static_cast<int32_t>((r * 37 + j * 101) % vocab));
      c->logprobs.push_back(static_cast<float>(std::log(0.9 * q[j] / sum)));
    }
  }
  auto at = [&](int64_t r, int64_t j) {
    return r * vocab + c->indices[r * kTopK + j];
  };
  c->student[at(1, 1)] = kNegInf;
  c->teacher[at(2, 1)] = kNegInf;
  c->logprobs[2 * kTopK + 1] = kNegInf;
  for (int64_t i = 0; i < vocab; ++i) {
    if (c->dense) c->teacher[3 * vocab + i] = kNegInf;
    c->student[4 * vocab + i] = kNegInf;
  }
  for (int64_t j = 0; j < kTopK; ++j) {
    if (c->dense) break;
    if (c->tail == TopKTail::kRenormalize) {
      c->student[at(3, j)] = kNegInf;
    } else {
      c->logprobs[3 * kTopK + j] = kNegInf;
    }
  }
  c->logprobs[5 * kTopK] = std::log(0.6f);
  c->logprobs[5 * kTopK + 1] = std::log(0.5f);
}

std::string Name(const EdgeCase& c) {
  return std::string(DTypeName(c.dtype)) + " V " + std::to_string(c.vocab) +
         (c.dense ? " dense" : " top-k tail ") +
         (c.dense ? "" : std::to_string(static_cast<int>(c.tail))) + " div " +
         std::to_string(static_cast<int>(c.divergence)) + " tau " +
         std::to_string(c.tau) + " alpha " + std::to_string(c.alpha) +
         " path " + std::to_string(static_cast<int>(c.path));
}

// Equal where not finite (NaN with NaN, inf with inf), else within `tol`.
void ExpectSame(double got, double want, double tol, const std::string& what) {
  if (std::isnan(want)) {
    EXPECT_TRUE(std::isnan(got)) << what << ": " << got << ", expected NaN";
  } else if (std::isinf(want)) {
    EXPECT_EQ(got, want) << what;
  } else {
    EXPECT_NEAR(got, want, tol) << what;
  }
}

void CompareEdges(const EdgeCase& c) {
  SCOPED_TRACE(Name(c));
  const int64_t n = kRows * c.vocab;
  DistillationArgs kd;
  kd.temperature = c.tau;
  kd.alpha = c.alpha;
  kd.divergence = c.divergence;
  kd.beta = 0.3f;
  kd.tail = c.tail;
  kd.teacher_row_stride = c.vocab;
  if (!c.dense) kd.top_k = kTopK;
  PostTrainingArgs cpu;
  cpu.base.rows = kRows;
  cpu.base.vocab = cpu.base.row_stride = c.vocab;
  cpu.base.targets_dtype = DType::kInt64;
  cpu.base.targets = c.targets.data();
  cpu.base.options.reduction = Reduction::kSum;
  cpu.base.mode = GradientMode::kOutOfPlace;
  cpu.base.logits_dtype = DType::kFloat32;
  cpu.base.logits = c.student.data();
  std::vector<float> cpu_grad(n), cpu_loss(kRows), gpu_loss(kRows);
  std::vector<int32_t> cpu_argmax(kRows), gpu_argmax(kRows);
  cpu.base.gradient = cpu_grad.data();
  cpu.base.token_loss = cpu_loss.data();
  cpu.base.token_argmax = cpu_argmax.data();
  DistillationArgs cpu_kd = kd;
  if (c.dense) {
    cpu_kd.teacher_logits = c.teacher.data();
  } else {
    cpu_kd.top_k_indices = c.indices.data();
    cpu_kd.top_k_logprobs = c.logprobs.data();
  }
  cpu.distillation = &cpu_kd;
  PostTrainingResult want;
  ASSERT_TRUE(PostTrainingCpu(cpu, &want).ok());

  std::vector<uint8_t> student(n * DTypeSize(c.dtype)), teacher(n * 2);
  for (int64_t i = 0; i < n; ++i) {
    FromFloat(&student, c.dtype, i, c.student[i]);
    FromFloat(&teacher, DType::kBFloat16, i, c.teacher[i]);
  }
  DeviceBuffer d_student(student.size()), d_grad(student.size()),
      d_teacher(teacher.size()), d_targets(kRows * 8),
      d_indices(c.indices.size() * 4), d_logprobs(c.logprobs.size() * 4);
  d_student.Upload(student.data());
  d_teacher.Upload(teacher.data());
  d_targets.Upload(c.targets.data());
  d_indices.Upload(c.indices.data());
  d_logprobs.Upload(c.logprobs.data());
  PostTrainingArgs gpu = cpu;
  gpu.base.logits_dtype = c.dtype;
  gpu.base.logits = d_student.get();
  gpu.base.gradient = d_grad.get();
  gpu.base.targets = d_targets.get();
  gpu.base.token_loss = gpu_loss.data();
  gpu.base.token_argmax = gpu_argmax.data();
  DistillationArgs gpu_kd = kd;
  if (c.dense) {
    gpu_kd.teacher_logits = d_teacher.get();
    gpu_kd.teacher_dtype = DType::kBFloat16;
  } else {
    gpu_kd.top_k_indices = d_indices.get();
    gpu_kd.top_k_logprobs = static_cast<const float*>(d_logprobs.get());
  }
  gpu.distillation = &gpu_kd;
  PostTrainingResult got;
  const absl::Status status = PostTrainingCuda(gpu, &got, nullptr, c.path);
  ASSERT_TRUE(status.ok()) << status;

  EXPECT_EQ(got.base.nonfinite_rows, want.base.nonfinite_rows);
  EXPECT_EQ(got.base.valid_tokens, want.base.valid_tokens);
  ExpectSame(got.distillation_loss, want.distillation_loss,
             2e-4 * std::fabs(want.distillation_loss) + 1e-5, "D");
  const std::vector<uint8_t> grad = d_grad.Download<uint8_t>();
  const double unit = c.dtype == DType::kFloat32 ? 0x1p-23 : 0x1p-7;
  for (int64_t r = 0; r < kRows; ++r) {
    const std::string row = "row " + std::to_string(r);
    ExpectSame(gpu_loss[r], cpu_loss[r], 2e-4 * std::fabs(cpu_loss[r]) + 2e-5,
               row + " loss");
    // (row 4, the student all -inf: column 0 on every path)
    EXPECT_EQ(gpu_argmax[r], cpu_argmax[r]) << row << " argmax";
    double row_max = 0.0;
    for (int64_t i = 0; i < c.vocab; ++i) {
      const double g = cpu_grad[r * c.vocab + i];
      if (std::isfinite(g)) row_max = std::max(row_max, std::fabs(g));
    }
    int bad = 0;
    for (int64_t i = 0; i < c.vocab && bad < 3; ++i) {
      const double w = cpu_grad[r * c.vocab + i];
      const double g = ToFloat(grad, c.dtype, r * c.vocab + i);
      const bool same = std::isnan(w)
                            ? std::isnan(g)
                            : std::fabs(g - w) <= unit * std::fabs(w) +
                                                      5e-5 * row_max + 0x1p-18;
      if (!same) {
        ++bad;
        ADD_FAILURE() << row << " gradient [" << i << "] = " << g
                      << ", expected " << w;
      }
    }
  }
}

class PostTrainingEdgeCudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!HaveGpu()) GTEST_SKIP() << "no CUDA GPU visible";
  }
};

// bf16 rows of V 16384 take the dense teacher's row pieces and the top-k
// builds of the smem row pieces (kAuto); the same on the row kernel; V 7 in
// fp32 (the row kernel, its edge columns).
TEST_F(PostTrainingEdgeCudaTest, EdgeRowsMatchTheCpu) {
  uint32_t seed = 900;
  for (PostTrainingCudaPath path :
       {PostTrainingCudaPath::kAuto, PostTrainingCudaPath::kRowKernel}) {
    for (int family = 0; family < 3; ++family) {
      for (Divergence divergence :
           {Divergence::kForwardKl, Divergence::kReverseKl, Divergence::kJsd}) {
        for (float tau : {1.0f, 2.0f}) {
          EdgeCase c;
          c.vocab = seed % 4 == 0 ? 7 : 16384;
          c.dtype = c.vocab == 7 ? DType::kFloat32 : DType::kBFloat16;
          c.dense = family == 0;
          c.tail = family == 2 ? TopKTail::kBucket : TopKTail::kRenormalize;
          c.divergence = divergence;
          c.tau = tau;
          c.alpha = seed % 2 == 0 ? 0.0f : 0.3f;
          c.path = path;
          Fill(&c, seed++);
          CompareEdges(c);
        }
      }
    }
  }
}

}  // namespace
}  // namespace lossd
