// The CPU post-training losses: gradients against finite differences for every
// divergence, tail, policy loss and segment reduction; properties; k = V as the
// dense teacher; clipping exactly at epsilon; segments; validation; and the
// same losses after a linear head (LinearPostTrainingCpu) against them on Z.
#include "kernels/cpu/post_training_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/linear_cross_entropy_cpu.h"

namespace lossd {
namespace {

constexpr int64_t kIgnore = -100;

// A problem in fp32 with every optional input owned here.
struct Problem {
  int64_t rows = 0;
  int64_t vocab = 0;
  std::vector<float> logits;
  std::vector<int64_t> targets;  // empty: none
  CrossEntropyOptions options;
  bool distill = false;
  DistillationArgs kd;
  std::vector<float> teacher;  // dense [rows, vocab]
  std::vector<int32_t> indices;
  std::vector<float> logprobs;
  bool policy = false;
  PolicyArgs pg;
  std::vector<float> advantages, sampling, reference;
  bool segmented = false;
  SegmentArgs segment_args;
  std::vector<int32_t> segment_ids;
};

struct Outcome {
  absl::Status status;
  PostTrainingResult result;
  std::vector<float> gradient;
  std::vector<float> token_loss, token_logprob;
};

// The problem's loss inputs (targets, options, teacher, policy, segments)
// pointed at from `args`, `held` keeping the pointed-to structs.
struct HeldInputs {
  DistillationArgs kd;
  PolicyArgs pg;
  SegmentArgs segments;
};
void PointInputs(const Problem& problem, HeldInputs* held,
                 PostTrainingArgs* args) {
  args->base.targets_dtype = DType::kInt64;
  args->base.targets =
      problem.targets.empty() ? nullptr : problem.targets.data();
  args->base.options = problem.options;
  held->kd = problem.kd;
  if (problem.distill) {
    DistillationArgs& kd = held->kd;
    if (!problem.teacher.empty()) {
      kd.teacher_logits = problem.teacher.data();
      kd.teacher_dtype = DType::kFloat32;
      kd.teacher_row_stride = problem.vocab;
    } else {
      kd.top_k_indices = problem.indices.data();
      kd.top_k_indices_dtype = DType::kInt32;
      kd.top_k_logprobs = problem.logprobs.data();
    }
    args->distillation = &kd;
  }
  held->pg = problem.pg;
  if (problem.policy) {
    PolicyArgs& pg = held->pg;
    pg.advantages = problem.advantages.data();
    pg.sampling_logprobs = problem.sampling.data();
    pg.reference_logprobs =
        problem.reference.empty() ? nullptr : problem.reference.data();
    args->policy = &pg;
  }
  held->segments = problem.segment_args;
  if (problem.segmented) {
    held->segments.ids = problem.segment_ids.data();
    args->segments = &held->segments;
  }
}

Outcome RunLoss(const Problem& problem, const std::vector<float>& logits,
                GradientMode mode = GradientMode::kOutOfPlace) {
  Outcome outcome;
  outcome.gradient.assign(logits.size(), -7.0f);
  outcome.token_loss.assign(problem.rows, -7.0f);
  outcome.token_logprob.assign(problem.rows, -7.0f);
  PostTrainingArgs args;
  HeldInputs held;
  PointInputs(problem, &held, &args);
  args.base.rows = problem.rows;
  args.base.vocab = problem.vocab;
  args.base.row_stride = problem.vocab;
  args.base.logits_dtype = DType::kFloat32;
  args.base.logits = logits.data();
  args.base.mode = mode;
  args.base.gradient =
      mode == GradientMode::kNone ? nullptr : outcome.gradient.data();
  args.base.token_loss = outcome.token_loss.data();
  args.token_logprob = outcome.token_logprob.data();
  outcome.status = PostTrainingCpu(args, &outcome.result, 3);
  return outcome;
}

Problem Random(int64_t rows, int64_t vocab, uint32_t seed, double scale = 2.0) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, static_cast<float>(scale));
  std::uniform_int_distribution<int64_t> cls(0, vocab - 1);
  Problem problem;
  problem.rows = rows;
  problem.vocab = vocab;
  problem.logits.resize(rows * vocab);
  for (float& v : problem.logits) v = normal(rng);
  problem.targets.resize(rows);
  for (int64_t& t : problem.targets) t = cls(rng);
  return problem;
}

void AddDenseTeacher(Problem* problem, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  problem->distill = true;
  problem->teacher.resize(problem->rows * problem->vocab);
  for (float& v : problem->teacher) v = normal(rng);
}

// Top k of a random teacher: distinct indices and their logprobs.
void AddTopKTeacher(Problem* problem, int64_t k, TopKTail tail, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> normal(0.0, 2.0);
  problem->distill = true;
  problem->kd.top_k = k;
  problem->kd.tail = tail;
  const int64_t vocab = problem->vocab;
  for (int64_t row = 0; row < problem->rows; ++row) {
    std::vector<double> t(vocab);
    for (double& v : t) v = normal(rng);
    double max_t = *std::max_element(t.begin(), t.end());
    double sum = 0.0;
    for (double v : t) sum += std::exp(v - max_t);
    std::vector<int32_t> order(vocab);
    for (int32_t c = 0; c < vocab; ++c) order[c] = c;
    std::shuffle(order.begin(), order.end(), rng);
    for (int64_t j = 0; j < k; ++j) {
      problem->indices.push_back(order[j]);
      problem->logprobs.push_back(
          static_cast<float>(t[order[j]] - max_t - std::log(sum)));
    }
  }
}

void AddPolicy(Problem* problem, PolicyLossKind loss, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  problem->policy = true;
  problem->pg.loss = loss;
  for (int64_t row = 0; row < problem->rows; ++row) {
    problem->advantages.push_back(normal(rng));
    // log p of the target plus noise, so ratios land on both sides of the
    // clip range.
    const float* z = problem->logits.data() + row * problem->vocab;
    double max_z = *std::max_element(z, z + problem->vocab);
    double sum = 0.0;
    for (int64_t c = 0; c < problem->vocab; ++c) sum += std::exp(z[c] - max_z);
    const int64_t y = problem->targets[row];
    const double logp = z[y] - max_z - std::log(sum);
    problem->sampling.push_back(static_cast<float>(logp + 0.4 * normal(rng)));
  }
}

// The reduced loss at logits x (no gradient).
double LossAt(const Problem& problem, const std::vector<float>& x) {
  Outcome outcome = RunLoss(problem, x, GradientMode::kNone);
  EXPECT_TRUE(outcome.status.ok()) << outcome.status;
  return outcome.result.base.loss;
}

// The gradient against central differences on every element.
void ExpectGradientMatchesDifferences(const Problem& problem,
                                      const std::string& what) {
  Outcome outcome = RunLoss(problem, problem.logits);
  ASSERT_TRUE(outcome.status.ok()) << what << ": " << outcome.status;
  for (size_t i = 0; i < problem.logits.size(); ++i) {
    std::vector<float> plus = problem.logits, minus = problem.logits;
    plus[i] += 1e-2f;
    minus[i] -= 1e-2f;
    const double h = static_cast<double>(plus[i]) - minus[i];
    const double numeric = (LossAt(problem, plus) - LossAt(problem, minus)) / h;
    EXPECT_NEAR(outcome.gradient[i], numeric, 2e-4 + 2e-4 * std::fabs(numeric))
        << what << " element " << i;
  }
}

TEST(PostTrainingCpuTest, DenseDistillationGradientMatchesDifferences) {
  for (Divergence divergence :
       {Divergence::kForwardKl, Divergence::kReverseKl, Divergence::kJsd}) {
    for (float tau : {1.0f, 2.5f}) {
      for (float alpha : {0.0f, 0.4f}) {
        Problem problem = Random(3, 7, 11);
        AddDenseTeacher(&problem, 12);
        problem.kd.divergence = divergence;
        problem.kd.beta = 0.3f;
        problem.kd.temperature = tau;
        problem.kd.alpha = alpha;
        problem.targets[1] = kIgnore;
        ExpectGradientMatchesDifferences(
            problem, "divergence " +
                         std::to_string(static_cast<int>(divergence)) +
                         " tau " + std::to_string(tau) + " alpha " +
                         std::to_string(alpha));
      }
    }
  }
}

TEST(PostTrainingCpuTest, TopKDistillationGradientMatchesDifferences) {
  for (TopKTail tail : {TopKTail::kRenormalize, TopKTail::kBucket}) {
    for (int64_t k : {1, 3, 7}) {
      for (Divergence divergence :
           {Divergence::kForwardKl, Divergence::kReverseKl, Divergence::kJsd}) {
        Problem problem = Random(3, 7, 21);
        AddTopKTeacher(&problem, k, tail, 22);
        problem.kd.divergence = divergence;
        problem.kd.beta = 0.6f;
        problem.kd.temperature = 0.7f;
        problem.options.reduction = Reduction::kSum;
        problem.targets.clear();
        ExpectGradientMatchesDifferences(
            problem, "tail " + std::to_string(static_cast<int>(tail)) + " k " +
                         std::to_string(k) + " divergence " +
                         std::to_string(static_cast<int>(divergence)));
      }
    }
  }
}

TEST(PostTrainingCpuTest, PolicyGradientMatchesDifferences) {
  for (PolicyLossKind loss :
       {PolicyLossKind::kImportanceSampling, PolicyLossKind::kPpoClip}) {
    for (KlEstimator estimator :
         {KlEstimator::kK1, KlEstimator::kK2, KlEstimator::kK3}) {
      Problem problem = Random(6, 9, 31);
      AddPolicy(&problem, loss, 32);
      problem.pg.epsilon_low = 0.2f;
      problem.pg.epsilon_high = 0.28f;
      problem.reference = problem.sampling;
      for (float& v : problem.reference) v -= 0.1f;
      problem.pg.kl_coef = 0.05f;
      problem.pg.kl_estimator = estimator;
      problem.options.softcap = 3.0f;
      problem.targets[2] = kIgnore;
      ExpectGradientMatchesDifferences(
          problem, "policy " + std::to_string(static_cast<int>(loss)) +
                       " estimator " +
                       std::to_string(static_cast<int>(estimator)));
    }
  }
}

TEST(PostTrainingCpuTest, CispoHoldsTheClippedWeightConstant) {
  Problem problem = Random(5, 6, 41);
  AddPolicy(&problem, PolicyLossKind::kCispo, 42);
  problem.options.reduction = Reduction::kSum;
  Outcome outcome = RunLoss(problem, problem.logits);
  ASSERT_TRUE(outcome.status.ok()) << outcome.status;
  int64_t clipped = 0;
  for (int64_t row = 0; row < problem.rows; ++row) {
    const double logp = outcome.token_logprob[row];
    const double r = std::exp(logp - problem.sampling[row]);
    const double weight = std::min(std::max(r, 0.8), 1.2);
    clipped += weight != r;
    const double a = problem.advantages[row];
    EXPECT_NEAR(outcome.token_loss[row], -weight * a * logp, 1e-5);
    const float* z = problem.logits.data() + row * problem.vocab;
    double max_z = *std::max_element(z, z + problem.vocab), sum = 0.0;
    for (int64_t c = 0; c < problem.vocab; ++c) sum += std::exp(z[c] - max_z);
    for (int64_t c = 0; c < problem.vocab; ++c) {
      const double p = std::exp(z[c] - max_z) / sum;
      const double expected =
          weight * a * (p - (c == problem.targets[row] ? 1.0 : 0.0));
      EXPECT_NEAR(outcome.gradient[row * problem.vocab + c], expected, 1e-6);
    }
  }
  EXPECT_EQ(outcome.result.policy.clipped_tokens, clipped);
  EXPECT_GT(clipped, 0);
}

TEST(PostTrainingCpuTest, SegmentReductionsGradientMatchesDifferences) {
  for (SegmentReduction reduction :
       {SegmentReduction::kNone, SegmentReduction::kSeqMeanTokenMean,
        SegmentReduction::kSeqMeanTokenSum}) {
    Problem problem = Random(6, 5, 51);
    AddPolicy(&problem, PolicyLossKind::kImportanceSampling, 52);
    problem.segmented = true;
    problem.segment_ids = {0, 0, 0, 2, 3, 3};  // 1 empty, 2 one token
    problem.segment_args.count = 4;
    problem.segment_args.reduction = reduction;
    problem.targets[4] = kIgnore;
    ExpectGradientMatchesDifferences(
        problem,
        "segment reduction " + std::to_string(static_cast<int>(reduction)));
  }
}

TEST(PostTrainingCpuTest, ZLossAndLabelSmoothingGradientsMatchDifferences) {
  {
    Problem problem = Random(3, 7, 61);
    AddTopKTeacher(&problem, 3, TopKTail::kBucket, 62);
    problem.kd.alpha = 0.4f;
    problem.kd.temperature = 1.5f;
    problem.options.label_smoothing = 0.2f;
    problem.options.z_loss_scale = 0.05f;
    problem.targets[1] = kIgnore;
    ExpectGradientMatchesDifferences(problem,
                                     "distillation, smoothing, z-loss");
  }
  {
    Problem problem = Random(3, 7, 63);
    AddPolicy(&problem, PolicyLossKind::kImportanceSampling, 64);
    problem.options.z_loss_scale = 0.1f;
    problem.options.reduction = Reduction::kSum;
    ExpectGradientMatchesDifferences(problem, "importance sampling, z-loss");
  }
  {
    Problem problem = Random(4, 6, 65);
    problem.segmented = true;
    problem.segment_ids = {0, 0, 1, 1};
    problem.segment_args.count = 2;
    problem.segment_args.reduction = SegmentReduction::kSeqMeanTokenMean;
    problem.options.label_smoothing = 0.3f;
    problem.options.z_loss_scale = 0.02f;
    ExpectGradientMatchesDifferences(problem, "segments, smoothing, z-loss");
  }
}

TEST(PostTrainingCpuTest, ZLossIsReportedAloneAndLabelSmoothingIsTorchs) {
  // Plain cross entropy over segments with smoothing equals the smoothed
  // formula; z_loss is the mean of z_loss_scale lse^2.
  Problem problem = Random(3, 5, 71);
  problem.segmented = true;
  problem.segment_ids = {0, 1, 1};
  problem.segment_args.count = 2;
  problem.options.label_smoothing = 0.25f;
  problem.options.z_loss_scale = 0.1f;
  const Outcome outcome = RunLoss(problem, problem.logits);
  ASSERT_TRUE(outcome.status.ok()) << outcome.status;
  double loss = 0.0, z_loss = 0.0;
  for (int64_t row = 0; row < 3; ++row) {
    const float* z = problem.logits.data() + row * 5;
    double max_z = *std::max_element(z, z + 5), sum = 0.0, z_sum = 0.0;
    for (int c = 0; c < 5; ++c) {
      sum += std::exp(z[c] - max_z);
      z_sum += z[c];
    }
    const double lse = max_z + std::log(sum);
    const double ce =
        0.75 * (lse - z[problem.targets[row]]) + 0.25 * (lse - z_sum / 5.0);
    const double zl = static_cast<double>(0.1f) * lse * lse;
    loss += ce + zl;
    z_loss += zl;
  }
  EXPECT_NEAR(outcome.result.base.loss, loss / 3.0, 1e-6);
  EXPECT_NEAR(outcome.result.base.z_loss, z_loss / 3.0, 1e-9);
}

TEST(PostTrainingCpuTest, SegmentSumsAndMeans) {
  Problem problem = Random(6, 5, 61);
  problem.segmented = true;
  problem.segment_ids = {0, 0, 0, 2, 3, 3};
  problem.segment_args.count = 4;
  problem.segment_args.reduction = SegmentReduction::kSeqMeanTokenMean;
  problem.targets[4] = kIgnore;
  Outcome outcome = RunLoss(problem, problem.logits);
  ASSERT_TRUE(outcome.status.ok()) << outcome.status;
  const auto& r = outcome.result;
  ASSERT_EQ(r.segment_loss.size(), 4u);
  EXPECT_EQ(r.segment_tokens, (std::vector<int64_t>{3, 0, 1, 1}));
  const std::vector<float>& l = outcome.token_loss;
  EXPECT_NEAR(r.segment_loss[0], l[0] + l[1] + l[2], 1e-5);
  EXPECT_EQ(r.segment_loss[1], 0.0);
  EXPECT_NEAR(r.segment_loss[2], l[3], 1e-6);
  EXPECT_NEAR(r.segment_loss[3], l[5], 1e-6);
  EXPECT_EQ(l[4], 0.0f);
  // The mean over the three segments that have a valid token.
  EXPECT_NEAR(r.base.loss, ((l[0] + l[1] + l[2]) / 3 + l[3] + l[5]) / 3, 1e-5);
  EXPECT_EQ(r.base.denominator, 3.0);
  EXPECT_EQ(r.base.valid_tokens, 5);
}

TEST(PostTrainingCpuTest, DivergencesAreNonNegativeAndGradientRowsSumToZero) {
  for (Divergence divergence :
       {Divergence::kForwardKl, Divergence::kReverseKl, Divergence::kJsd}) {
    Problem problem = Random(16, 33, 71, 4.0);
    AddDenseTeacher(&problem, 72);
    problem.kd.divergence = divergence;
    problem.targets.clear();
    Outcome outcome = RunLoss(problem, problem.logits);
    ASSERT_TRUE(outcome.status.ok()) << outcome.status;
    EXPECT_GE(outcome.result.base.loss, 0.0);
    for (int64_t row = 0; row < problem.rows; ++row) {
      EXPECT_GE(outcome.token_loss[row], -1e-7f);
      double sum = 0.0;
      for (int64_t c = 0; c < problem.vocab; ++c) {
        sum += outcome.gradient[row * problem.vocab + c];
      }
      EXPECT_NEAR(sum, 0.0, 1e-7);
    }
    // Shifting the student's rows (and the teacher's) changes nothing.
    Problem shifted = problem;
    for (float& v : shifted.logits) v += 8.0f;
    for (float& v : shifted.teacher) v -= 16.0f;
    Outcome after = RunLoss(shifted, shifted.logits);
    ASSERT_TRUE(after.status.ok());
    EXPECT_NEAR(after.result.base.loss, outcome.result.base.loss, 1e-5);
  }
}

// A student nearly sure of the tail (P_support ~ 1e-11 at tau 0.5): the tail
// classes' factor g_tail - gbar = P_support (g_tail - g_support) is tiny
// beside g, and each gradient element must still be one fp32 rounding of the
// formula, written here in long double with the tail mass summed directly.
TEST(PostTrainingCpuTest, AStudentSureOfTheTailKeepsTheGradientsDigits) {
  Problem problem;
  problem.rows = 1;
  problem.vocab = 4;
  problem.logits = {-6.0f, 6.0f, 6.5f, 5.5f};
  problem.options.reduction = Reduction::kSum;
  problem.distill = true;
  problem.kd.top_k = 1;
  problem.kd.tail = TopKTail::kBucket;
  problem.kd.divergence = Divergence::kReverseKl;
  problem.kd.temperature = 0.5f;
  problem.indices = {0};
  problem.logprobs = {-1.0f};
  const Outcome outcome = RunLoss(problem, problem.logits);
  ASSERT_TRUE(outcome.status.ok()) << outcome.status;

  const long double tau = 0.5L;
  std::vector<long double> p(4);
  long double sum = 0.0L;
  for (int c = 0; c < 4; ++c) sum += std::exp(problem.logits[c] / tau);
  for (int c = 0; c < 4; ++c) p[c] = std::exp(problem.logits[c] / tau) / sum;
  const long double tail = p[1] + p[2] + p[3];
  const long double q = std::exp(-1.0L);
  const long double g_support = std::log(p[0]) - std::log(q) + 1.0L;
  const long double g_tail = std::log(tail) - std::log(1.0L - q) + 1.0L;
  for (int c = 0; c < 4; ++c) {
    const long double want = c == 0 ? p[0] * tail * (g_support - g_tail) / tau
                                    : p[c] * p[0] * (g_tail - g_support) / tau;
    const double bound = std::ldexp(std::abs(static_cast<double>(want)), -24);
    EXPECT_NEAR(outcome.gradient[c], static_cast<double>(want), bound) << c;
  }
}

TEST(PostTrainingCpuTest, TopKWithKEqualVIsTheDenseTeacher) {
  Problem sparse = Random(4, 6, 81);
  AddTopKTeacher(&sparse, 6, TopKTail::kBucket, 82);
  // The same teacher, dense: its logprobs scattered back as logits.
  Problem dense = sparse;
  dense.indices.clear();
  dense.logprobs.clear();
  dense.kd.top_k = 0;
  dense.teacher.assign(sparse.rows * sparse.vocab, 0.0f);
  for (int64_t row = 0; row < sparse.rows; ++row) {
    for (int64_t j = 0; j < 6; ++j) {
      dense.teacher[row * 6 + sparse.indices[row * 6 + j]] =
          sparse.logprobs[row * 6 + j];
    }
  }
  for (TopKTail tail : {TopKTail::kBucket, TopKTail::kRenormalize}) {
    for (Divergence divergence :
         {Divergence::kForwardKl, Divergence::kReverseKl, Divergence::kJsd}) {
      sparse.kd.tail = tail;
      sparse.kd.divergence = divergence;
      dense.kd.divergence = divergence;
      Outcome a = RunLoss(sparse, sparse.logits);
      Outcome b = RunLoss(dense, dense.logits);
      ASSERT_TRUE(a.status.ok()) << a.status;
      ASSERT_TRUE(b.status.ok()) << b.status;
      EXPECT_NEAR(a.result.base.loss, b.result.base.loss, 1e-6);
      for (size_t i = 0; i < a.gradient.size(); ++i) {
        EXPECT_NEAR(a.gradient[i], b.gradient[i], 1e-6) << i;
      }
    }
  }
}

// Edge rows (docs/api.md, "Edge rows"). Checks the row `row` of `outcome`:
// its token loss is `loss` (NaN, +inf or finite), its gradient is NaN over
// the whole row or finite, and every other row stays finite.
void ExpectEdgeRow(const Problem& problem, const Outcome& outcome, int64_t row,
                   double loss, bool nan_gradient, const std::string& what) {
  ASSERT_TRUE(outcome.status.ok()) << what << ": " << outcome.status;
  const double got = outcome.token_loss[row];
  if (std::isnan(loss)) {
    EXPECT_TRUE(std::isnan(got)) << what << ": " << got;
  } else if (std::isinf(loss)) {
    EXPECT_EQ(got, loss) << what;
  } else {
    EXPECT_TRUE(std::isfinite(got)) << what << ": " << got;
  }
  EXPECT_EQ(outcome.result.base.nonfinite_rows, std::isfinite(loss) ? 0 : 1)
      << what;
  for (int64_t r = 0; r < problem.rows; ++r) {
    for (int64_t c = 0; c < problem.vocab; ++c) {
      const float g = outcome.gradient[r * problem.vocab + c];
      if (r == row && nan_gradient) {
        ASSERT_TRUE(std::isnan(g)) << what << " [" << r << ", " << c << "]";
      } else {
        ASSERT_TRUE(std::isfinite(g)) << what << " [" << r << ", " << c << "]";
      }
    }
  }
}

constexpr Divergence kDivergences[] = {
    Divergence::kForwardKl, Divergence::kReverseKl, Divergence::kJsd};

TEST(PostTrainingCpuTest, AStudentOfNoMassWhereTheTeacherHasIt) {
  // Class 2 of row 1 masked (-inf) in the student, not in the teacher:
  // forward KL is +inf with torch's kl_div gradient (p - q) / tau; reverse
  // KL and JSD are finite and give the class no gradient.
  for (Divergence divergence : kDivergences) {
    Problem problem = Random(3, 6, 51);
    AddDenseTeacher(&problem, 52);
    problem.kd.divergence = divergence;
    problem.kd.temperature = 2.0f;
    problem.options.reduction = Reduction::kSum;
    problem.logits[1 * 6 + 2] = -INFINITY;
    const Outcome outcome = RunLoss(problem, problem.logits);
    const bool forward = divergence == Divergence::kForwardKl;
    const std::string what =
        "divergence " + std::to_string(static_cast<int>(divergence));
    ExpectEdgeRow(problem, outcome, 1, forward ? INFINITY : 1.0, false, what);
    if (!forward) {
      EXPECT_EQ(outcome.gradient[1 * 6 + 2], 0.0f) << what;
      continue;
    }
    EXPECT_EQ(outcome.result.distillation_loss, INFINITY);
    double sum_p = 0.0, sum_q = 0.0;
    for (int64_t c = 0; c < 6; ++c) {
      sum_p += std::exp(problem.logits[6 + c] / 2.0);
      sum_q += std::exp(problem.teacher[6 + c] / 2.0);
    }
    for (int64_t c = 0; c < 6; ++c) {
      const double p = std::exp(problem.logits[6 + c] / 2.0) / sum_p;
      const double q = std::exp(problem.teacher[6 + c] / 2.0) / sum_q;
      EXPECT_NEAR(outcome.gradient[6 + c], (p - q) / 2.0, 1e-6) << c;
    }
  }
}

TEST(PostTrainingCpuTest, ATeacherOfNoMassWhereTheStudentHasIt) {
  // Reverse KL is +inf and its gradient NaN over the row (torch's: inf -
  // inf); forward KL and JSD are finite. Three teachers: a dense logit -inf,
  // a top-k logprob -inf inside the support, and a tail bucket of no mass (a
  // support whose mass is 1.1: the tail is max(0, 1 - 1.1), the support not
  // rescaled).
  for (int teacher = 0; teacher < 3; ++teacher) {
    for (Divergence divergence : kDivergences) {
      Problem problem = Random(3, 6, 61);
      if (teacher == 0) {
        AddDenseTeacher(&problem, 62);
        problem.teacher[1 * 6 + 4] = -INFINITY;
      } else {
        AddTopKTeacher(
            &problem, 2,
            teacher == 1 ? TopKTail::kRenormalize : TopKTail::kBucket, 63);
        if (teacher == 1) {
          problem.logprobs[2 + 1] = -INFINITY;
        } else {
          problem.logprobs[2] = std::log(0.6f);
          problem.logprobs[2 + 1] = std::log(0.5f);
        }
      }
      problem.kd.divergence = divergence;
      problem.kd.temperature = 0.8f;
      const bool reverse = divergence == Divergence::kReverseKl;
      const std::string what = "teacher " + std::to_string(teacher) +
                               " divergence " +
                               std::to_string(static_cast<int>(divergence));
      const Outcome outcome = RunLoss(problem, problem.logits);
      ExpectEdgeRow(problem, outcome, 1, reverse ? INFINITY : 1.0, reverse,
                    what);
      if (!reverse) ExpectGradientMatchesDifferences(problem, what);
    }
  }
}

TEST(PostTrainingCpuTest, RowsWithoutADistributionAreNaN) {
  // A student row all -inf, a dense teacher row all -inf, a student of no
  // mass on a renormalised support: D, the loss and the row's gradient are
  // NaN (torch's softmax of such a row); with ignore_index the row is
  // skipped as any other.
  for (int edge = 0; edge < 3; ++edge) {
    for (Divergence divergence : kDivergences) {
      for (bool ignored : {false, true}) {
        Problem problem = Random(3, 6, 71);
        if (edge == 1) {
          AddDenseTeacher(&problem, 72);
          for (int64_t c = 0; c < 6; ++c) problem.teacher[6 + c] = -INFINITY;
        } else {
          AddTopKTeacher(&problem, 3, TopKTail::kRenormalize, 73);
        }
        for (int64_t j = 0; j < 6; ++j) {
          const int64_t c = edge == 2 && j < 3 ? problem.indices[3 + j] : j;
          if (edge != 1 && (edge == 0 || j < 3)) {
            problem.logits[6 + c] = -INFINITY;
          }
        }
        problem.kd.divergence = divergence;
        problem.kd.alpha = 0.3f;
        problem.targets[1] = ignored                   ? kIgnore
                             : problem.indices.empty() ? 0
                                                       : problem.indices[3];
        const std::string what = "edge " + std::to_string(edge) +
                                 " divergence " +
                                 std::to_string(static_cast<int>(divergence)) +
                                 (ignored ? " ignored" : "");
        const Outcome outcome = RunLoss(problem, problem.logits);
        ExpectEdgeRow(problem, outcome, 1, ignored ? 0.0 : NAN, !ignored, what);
        if (ignored) {
          EXPECT_EQ(outcome.result.base.valid_tokens, 2) << what;
          EXPECT_TRUE(std::isfinite(outcome.result.base.loss)) << what;
        } else {
          EXPECT_TRUE(std::isnan(outcome.result.distillation_loss)) << what;
        }
      }
    }
  }
}

TEST(PostTrainingCpuTest, PpoClipsOnlyStrictlyPastEpsilon) {
  // V = 2 with one masked class: log p(y) is exactly 0, so the ratio against
  // a sampling logprob of 0 is exactly 1 = 1 + epsilon_high = 1 - epsilon_low.
  Problem problem;
  problem.rows = 2;
  problem.vocab = 2;
  problem.logits = {0.0f, -INFINITY, 0.0f, -INFINITY};
  problem.targets = {0, 0};
  problem.policy = true;
  problem.pg.loss = PolicyLossKind::kPpoClip;
  problem.pg.epsilon_low = 0.0f;
  problem.pg.epsilon_high = 0.0f;
  problem.advantages = {1.0f, -1.0f};
  problem.sampling = {0.0f, 0.0f};
  Outcome at = RunLoss(problem, problem.logits, GradientMode::kNone);
  ASSERT_TRUE(at.status.ok()) << at.status;
  EXPECT_EQ(at.result.policy.clipped_tokens, 0);
  EXPECT_EQ(at.result.policy.ratio_sum, 2.0);
  // A hair past the boundary on each side clips both.
  problem.sampling = {-1e-6f, 1e-6f};
  Outcome past = RunLoss(problem, problem.logits, GradientMode::kNone);
  ASSERT_TRUE(past.status.ok());
  EXPECT_EQ(past.result.policy.clipped_tokens, 2);
}

TEST(PostTrainingCpuTest, RefusesBadInputAndWritesNothing) {
  Problem base = Random(2, 5, 91);
  AddTopKTeacher(&base, 2, TopKTail::kRenormalize, 92);
  auto expect_invalid = [&](Problem problem, const std::string& what) {
    Outcome outcome = RunLoss(problem, problem.logits);
    EXPECT_EQ(outcome.status.code(), absl::StatusCode::kInvalidArgument)
        << what << ": " << outcome.status;
    for (float g : outcome.gradient) ASSERT_EQ(g, -7.0f) << what;
  };
  Problem p = base;
  p.kd.top_k = 6;
  p.indices.resize(12, 0);
  p.logprobs.resize(12, -1.0f);
  expect_invalid(p, "k > V");
  p = base;
  p.indices[1] = 5;
  expect_invalid(p, "index out of range");
  p = base;
  p.indices[1] = p.indices[0];
  expect_invalid(p, "duplicate index");
  p = base;
  p.logprobs[0] = 0.5f;
  expect_invalid(p, "positive logprob");
  p = base;
  p.logprobs[2] = p.logprobs[3] = -INFINITY;
  expect_invalid(p, "a renormalised support of no mass");
  p = base;
  p.kd.temperature = 0.0f;
  expect_invalid(p, "temperature 0");
  p = base;
  p.kd.alpha = 0.5f;
  p.targets.clear();
  expect_invalid(p, "alpha without targets");
  Problem q = Random(2, 5, 93);
  AddPolicy(&q, PolicyLossKind::kPpoClip, 94);
  Problem r = q;
  r.options.label_smoothing = 0.1f;
  expect_invalid(r, "label smoothing with a policy");
  r = q;
  r.advantages[1] = NAN;
  expect_invalid(r, "NaN advantage");
  r = q;
  r.sampling[0] = INFINITY;
  expect_invalid(r, "infinite sampling logprob");
  r = q;
  r.pg.kl_coef = 0.1f;
  expect_invalid(r, "kl_coef without reference");
  r = q;
  r.segmented = true;
  r.segment_ids = {0, 2};
  r.segment_args.count = 2;
  expect_invalid(r, "segment id out of range");
  r = q;
  r.segmented = true;
  r.segment_ids = {0, 1};
  r.segment_args.count = 2;
  r.segment_args.reduction = SegmentReduction::kSeqMeanTokenSum;
  r.options.reduction = Reduction::kSum;
  expect_invalid(r, "segment reduction with SUM");
  r = q;
  r.targets.clear();
  expect_invalid(r, "policy without targets");
}

// Hidden states and a head whose logits Z = X W^T replace the problem's
// (rounded to fp32, as the CPU backend's sgemm leaves them).
struct Head {
  int64_t hidden = 0;
  std::vector<float> x, weight;
};
Head RandomHead(Problem* problem, int64_t hidden, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  Head head;
  head.hidden = hidden;
  head.x.resize(problem->rows * hidden);
  head.weight.resize(problem->vocab * hidden);
  for (float& v : head.x) v = normal(rng);
  for (float& v : head.weight) v = normal(rng) * 0.7f;
  for (int64_t n = 0; n < problem->rows; ++n) {
    for (int64_t v = 0; v < problem->vocab; ++v) {
      double z = 0.0;
      for (int64_t h = 0; h < hidden; ++h) {
        z += static_cast<double>(head.x[n * hidden + h]) *
             head.weight[v * hidden + h];
      }
      problem->logits[n * problem->vocab + v] = static_cast<float>(z);
    }
  }
  return head;
}

// LinearPostTrainingCpu against PostTrainingCpu on Z and the products of its
// gradient: loss, segment sums, per-token outputs, dX = G W and dW = G^T X.
void ExpectLinearMatchesLogits(const Problem& problem, const Head& head,
                               const std::string& what) {
  const Outcome on_z = RunLoss(problem, problem.logits);
  ASSERT_TRUE(on_z.status.ok()) << what << ": " << on_z.status;
  const int64_t rows = problem.rows, vocab = problem.vocab,
                hidden = head.hidden;
  std::vector<float> dx(rows * hidden, -7.0f), dw(vocab * hidden, -7.0f);
  std::vector<float> token_loss(rows, -7.0f), token_logprob(rows, -7.0f);
  LinearPostTrainingArgs args;
  PostTrainingArgs inputs;
  HeldInputs held;
  PointInputs(problem, &held, &inputs);
  LinearCrossEntropyArgs& linear = args.linear;
  linear.rows = rows;
  linear.hidden = hidden;
  linear.vocab = vocab;
  linear.dtype = DType::kFloat32;
  linear.x = head.x.data();
  linear.weight = head.weight.data();
  linear.targets_dtype = inputs.base.targets_dtype;
  linear.targets = inputs.base.targets;
  linear.options = inputs.base.options;
  linear.dx_mode = GradientMode::kOutOfPlace;
  linear.dx = dx.data();
  linear.accumulate = AccumulateMode::kOverwrite;
  linear.grad_weight = dw.data();
  linear.token_loss = token_loss.data();
  args.distillation = inputs.distillation;
  args.policy = inputs.policy;
  args.segments = inputs.segments;
  args.token_logprob = token_logprob.data();
  PostTrainingResult result;
  const absl::Status status = LinearPostTrainingCpu(args, &result, 2);
  ASSERT_TRUE(status.ok()) << what << ": " << status;
  const double loss = on_z.result.base.loss;
  EXPECT_NEAR(result.base.loss, loss, 1e-5 * std::fabs(loss) + 1e-6) << what;
  EXPECT_EQ(result.base.valid_tokens, on_z.result.base.valid_tokens) << what;
  EXPECT_EQ(result.base.denominator, on_z.result.base.denominator) << what;
  EXPECT_EQ(result.policy.clipped_tokens, on_z.result.policy.clipped_tokens);
  EXPECT_EQ(result.segment_tokens, on_z.result.segment_tokens) << what;
  ASSERT_EQ(result.segment_loss.size(), on_z.result.segment_loss.size());
  for (size_t s = 0; s < result.segment_loss.size(); ++s) {
    EXPECT_NEAR(result.segment_loss[s], on_z.result.segment_loss[s],
                1e-4 * std::fabs(on_z.result.segment_loss[s]) + 1e-5);
  }
  for (int64_t n = 0; n < rows; ++n) {
    EXPECT_NEAR(token_loss[n], on_z.token_loss[n],
                1e-4 * std::fabs(on_z.token_loss[n]) + 1e-5)
        << what << " row " << n;
    EXPECT_NEAR(token_logprob[n], on_z.token_logprob[n],
                1e-4 * std::fabs(on_z.token_logprob[n]) + 1e-5);
  }
  // The products of the gradient on Z, in fp64.
  const std::vector<float>& g = on_z.gradient;
  std::vector<double> ref_dx(rows * hidden, 0.0), ref_dw(vocab * hidden, 0.0);
  for (int64_t n = 0; n < rows; ++n) {
    for (int64_t v = 0; v < vocab; ++v) {
      const double gv = g[n * vocab + v];
      if (gv == 0.0) continue;
      for (int64_t h = 0; h < hidden; ++h) {
        ref_dx[n * hidden + h] += gv * head.weight[v * hidden + h];
        ref_dw[v * hidden + h] += gv * head.x[n * hidden + h];
      }
    }
  }
  auto expect_close = [&](const std::vector<float>& got,
                          const std::vector<double>& ref, const char* name) {
    double scale = 0.0;
    for (double r : ref) scale = std::max(scale, std::fabs(r));
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_NEAR(got[i], ref[i], 1e-4 * scale + 1e-9)
          << what << " " << name << "[" << i << "]";
    }
  };
  expect_close(dx, ref_dx, "dX");
  expect_close(dw, ref_dw, "dW");
}

TEST(PostTrainingCpuTest, LinearMatchesTheLossOnTheLogits) {
  {
    // Two chunks of rows (one chunk holds 32 MiB of fp32 logits), segments
    // spanning them: the mean over segments is the whole call's.
    Problem problem = Random(230, 40000, 101);
    const Head head = RandomHead(&problem, 6, 102);
    AddPolicy(&problem, PolicyLossKind::kPpoClip, 103);
    problem.targets[3] = kIgnore;
    problem.segmented = true;
    problem.segment_args.count = 3;
    problem.segment_args.reduction = SegmentReduction::kSeqMeanTokenMean;
    for (int64_t n = 0; n < problem.rows; ++n) {
      problem.segment_ids.push_back(n < 100 ? 0 : n < 220 ? 2 : 1);
    }
    problem.options.grad_scale = 3.0f;
    ExpectLinearMatchesLogits(problem, head, "ppo, segments over two chunks");
  }
  {
    Problem problem = Random(9, 37, 111);
    const Head head = RandomHead(&problem, 5, 112);
    AddTopKTeacher(&problem, 4, TopKTail::kBucket, 113);
    problem.kd.alpha = 0.3f;
    problem.kd.temperature = 2.0f;
    problem.kd.divergence = Divergence::kJsd;
    problem.targets[2] = kIgnore;
    ExpectLinearMatchesLogits(problem, head, "top-k bucket, alpha 0.3");
  }
  {
    Problem problem = Random(7, 29, 121);
    const Head head = RandomHead(&problem, 4, 122);
    AddDenseTeacher(&problem, 123);
    problem.kd.divergence = Divergence::kReverseKl;
    problem.targets.clear();
    problem.options.reduction = Reduction::kSum;
    problem.options.softcap = 5.0f;
    ExpectLinearMatchesLogits(problem, head, "dense teacher, no targets");
  }
  {
    Problem problem = Random(6, 11, 131);
    const Head head = RandomHead(&problem, 3, 132);
    AddPolicy(&problem, PolicyLossKind::kCispo, 133);
    ExpectLinearMatchesLogits(problem, head, "cispo");
  }
}

TEST(PostTrainingCpuTest, LinearRefusesBadInputAndWritesNothing) {
  Problem problem = Random(4, 9, 141);
  const Head head = RandomHead(&problem, 3, 142);
  AddPolicy(&problem, PolicyLossKind::kPpoClip, 143);
  problem.advantages[2] = NAN;
  std::vector<float> dx(4 * 3, -7.0f), dw(9 * 3, -7.0f);
  LinearPostTrainingArgs args;
  PostTrainingArgs inputs;
  HeldInputs held;
  PointInputs(problem, &held, &inputs);
  args.linear.rows = 4;
  args.linear.hidden = 3;
  args.linear.vocab = 9;
  args.linear.dtype = DType::kFloat32;
  args.linear.x = head.x.data();
  args.linear.weight = head.weight.data();
  args.linear.targets_dtype = DType::kInt64;
  args.linear.targets = problem.targets.data();
  args.linear.dx_mode = GradientMode::kOutOfPlace;
  args.linear.dx = dx.data();
  args.linear.accumulate = AccumulateMode::kOverwrite;
  args.linear.grad_weight = dw.data();
  args.policy = inputs.policy;
  PostTrainingResult result;
  EXPECT_EQ(LinearPostTrainingCpu(args, &result).code(),
            absl::StatusCode::kInvalidArgument);
  args.policy = nullptr;
  args.linear.class_weights = head.weight.data();
  EXPECT_EQ(LinearPostTrainingCpu(args, &result).code(),
            absl::StatusCode::kInvalidArgument);
  for (float v : dx) ASSERT_EQ(v, -7.0f);
  for (float v : dw) ASSERT_EQ(v, -7.0f);
}

}  // namespace
}  // namespace lossd
