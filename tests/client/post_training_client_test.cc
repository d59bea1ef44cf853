// lossd::Client's post-training options against a real lossd on the CPU
// device: distillation (dense and top-k teachers), policy-gradient losses and
// segments reach the server and come back with the values that an fp64
// computation written here from docs/api.md's formulas gives.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "client/client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/client/lossd_process.h"

namespace lossd {
namespace {

using ::lossd::client_test::LossdProcess;
using ::testing::HasSubstr;

std::vector<double> LogSoftmax(const float* row, int64_t vocab, double scale) {
  double max = -INFINITY;
  for (int64_t c = 0; c < vocab; ++c) max = std::max(max, row[c] * scale);
  double sum = 0.0;
  for (int64_t c = 0; c < vocab; ++c) sum += std::exp(row[c] * scale - max);
  const double lse = max + std::log(sum);
  std::vector<double> out(vocab);
  for (int64_t c = 0; c < vocab; ++c) out[c] = row[c] * scale - lse;
  return out;
}

std::vector<float> AsFloats(const std::vector<uint8_t>& bytes) {
  std::vector<float> out(bytes.size() / sizeof(float));
  std::memcpy(out.data(), bytes.data(), out.size() * sizeof(float));
  return out;
}

class PostTrainingClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    seed_ = std::random_device{}();
    rng_.seed(seed_);
    absl::StatusOr<std::unique_ptr<LossdProcess>> server =
        LossdProcess::Start(LOSSD_BINARY_PATH);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    absl::StatusOr<std::unique_ptr<Client>> client =
        Client::Connect(server_->address());
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = *std::move(client);
  }

  void TearDown() override {
    if (HasFailure()) std::fprintf(stderr, "random seed: %u\n", seed_);
  }

  std::vector<float> Normal(int64_t count, float scale = 2.0f) {
    std::normal_distribution<float> dist(0.0f, scale);
    std::vector<float> values(count);
    for (float& v : values) v = dist(rng_);
    return values;
  }

  std::string UploadFloats(const std::vector<float>& values,
                           std::vector<int64_t> shape) {
    absl::StatusOr<TensorInfo> info = client_->Upload(
        DType::kFloat32, shape, values.data(), values.size() * sizeof(float));
    EXPECT_TRUE(info.ok()) << info.status();
    return info.ok() ? info->handle : "";
  }

  // Distinct indices per row: the k largest teacher logits, and their log
  // softmax (what a teacher server sends).
  void TopK(const std::vector<float>& teacher, int64_t rows, int64_t vocab,
            int64_t k, std::vector<int32_t>* indices,
            std::vector<float>* logprobs) {
    indices->clear();
    logprobs->clear();
    for (int64_t r = 0; r < rows; ++r) {
      const float* row = teacher.data() + r * vocab;
      std::vector<int32_t> order(vocab);
      for (int32_t c = 0; c < vocab; ++c) order[c] = c;
      std::partial_sort(
          order.begin(), order.begin() + k, order.end(),
          [row](int32_t a, int32_t b) { return row[a] > row[b]; });
      const std::vector<double> lq = LogSoftmax(row, vocab, 1.0);
      for (int64_t j = 0; j < k; ++j) {
        indices->push_back(order[j]);
        logprobs->push_back(static_cast<float>(lq[order[j]]));
      }
    }
  }

  unsigned seed_ = 0;
  std::mt19937 rng_;
  std::unique_ptr<LossdProcess> server_;
  std::unique_ptr<Client> client_;
};

// Dense teacher, forward KL at tau = 2 mixed with cross entropy (alpha 0.3),
// mean over valid rows: loss, distillation_loss and the gradient
// alpha (softmax(z) - onehot) + (1 - alpha) (p^tau - q) / tau, over D.
TEST_F(PostTrainingClientTest, DenseTeacherForwardKlWithGradient) {
  const int64_t rows = 13, vocab = 37;
  const double tau = 2.0, alpha = 0.3;
  std::vector<float> student = Normal(rows * vocab);
  std::vector<float> teacher = Normal(rows * vocab);
  std::vector<int32_t> targets(rows);
  for (int64_t r = 0; r < rows; ++r) targets[r] = (r * 7) % vocab;
  targets[4] = -100;
  const std::string logits = UploadFloats(student, {rows, vocab});
  const std::string teacher_handle = UploadFloats(teacher, {rows, vocab});

  double loss = 0.0, kd = 0.0;
  int64_t valid = 0;
  std::vector<double> grad(rows * vocab, 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    if (targets[r] == -100) continue;
    ++valid;
    const std::vector<double> lp = LogSoftmax(&student[r * vocab], vocab, 1.0);
    const std::vector<double> lpt =
        LogSoftmax(&student[r * vocab], vocab, 1.0 / tau);
    const std::vector<double> lq =
        LogSoftmax(&teacher[r * vocab], vocab, 1.0 / tau);
    double d = 0.0;
    for (int64_t c = 0; c < vocab; ++c) {
      d += std::exp(lq[c]) * (lq[c] - lpt[c]);
      grad[r * vocab + c] =
          alpha * (std::exp(lp[c]) - (c == targets[r])) +
          (1 - alpha) * (std::exp(lpt[c]) - std::exp(lq[c])) / tau;
    }
    kd += d;
    loss += alpha * -lp[targets[r]] + (1 - alpha) * d;
  }
  for (double& g : grad) g /= valid;

  ForwardOptions options;
  options.mode = GradientMode::kOutOfPlace;
  DistillationOptions distillation;
  distillation.teacher_logits = teacher_handle;
  distillation.temperature = static_cast<float>(tau);
  distillation.alpha = static_cast<float>(alpha);
  options.distillation = distillation;
  absl::StatusOr<ForwardResult> fwd = client_->Forward(
      logits, Targets::Inline(DType::kInt32, targets.data(), rows * 4),
      options);
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  EXPECT_EQ(fwd->valid_tokens, valid);
  EXPECT_NEAR(fwd->loss, loss / valid, 1e-6);
  EXPECT_NEAR(fwd->distillation_loss, kd / valid, 1e-6);
  absl::StatusOr<DownloadedTensor> g = client_->Download(fwd->gradient);
  ASSERT_TRUE(g.ok()) << g.status();
  const std::vector<float> got = AsFloats(g->data);
  ASSERT_EQ(got.size(), grad.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    ASSERT_NEAR(got[i], grad[i], 1e-6) << i;
  }
}

// Top-k teacher inline, tail as one bucket, JSD(beta), alpha 0 and no targets
// (every row counts), reduction sum; then k = V, where the bucket tail is the
// dense teacher's loss.
TEST_F(PostTrainingClientTest, TopKTeacherInlineBucketJsdWithoutTargets) {
  const int64_t rows = 9, vocab = 21, k = 5;
  const double beta = 0.4;
  std::vector<float> student = Normal(rows * vocab);
  std::vector<float> teacher = Normal(rows * vocab);
  const std::string logits = UploadFloats(student, {rows, vocab});
  for (int64_t top_k : {k, vocab}) {
    std::vector<int32_t> indices;
    std::vector<float> logprobs;
    TopK(teacher, rows, vocab, top_k, &indices, &logprobs);
    double want = 0.0;
    for (int64_t r = 0; r < rows; ++r) {
      const std::vector<double> lp =
          LogSoftmax(&student[r * vocab], vocab, 1.0);
      std::vector<double> p, q;
      double p_in = 0.0, q_in = 0.0;
      for (int64_t j = 0; j < top_k; ++j) {
        p.push_back(std::exp(lp[indices[r * top_k + j]]));
        q.push_back(std::exp(logprobs[r * top_k + j]));
        p_in += p.back();
        q_in += q.back();
      }
      if (top_k < vocab) {
        p.push_back(1.0 - p_in);
        q.push_back(std::max(0.0, 1.0 - q_in));
      }
      for (std::size_t b = 0; b < p.size(); ++b) {
        const double m = beta * q[b] + (1 - beta) * p[b];
        if (q[b] > 0) want += beta * q[b] * std::log(q[b] / m);
        if (p[b] > 0) want += (1 - beta) * p[b] * std::log(p[b] / m);
      }
    }
    ForwardOptions options;
    options.mode = GradientMode::kNone;
    options.loss.reduction = Reduction::kSum;
    DistillationOptions distillation;
    distillation.top_k = static_cast<int32_t>(top_k);
    distillation.top_k_indices = LossInput::Inline(indices);
    distillation.top_k_logprobs = LossInput::Inline(logprobs);
    distillation.tail = TopKTail::kBucket;
    distillation.divergence = Divergence::kJsd;
    distillation.beta = static_cast<float>(beta);
    options.distillation = distillation;
    absl::StatusOr<ForwardResult> fwd =
        client_->Forward(logits, Targets(), options);
    ASSERT_TRUE(fwd.ok()) << fwd.status();
    EXPECT_EQ(fwd->valid_tokens, rows);
    EXPECT_NEAR(fwd->loss, want, 1e-5 * (1 + want)) << "k " << top_k;
    EXPECT_NEAR(fwd->distillation_loss, want, 1e-5 * (1 + want));
  }
}

// PPO-clip with a reference KL (k3) over two segments reduced
// seq-mean-token-sum: the loss, policy stats, segment sums and the per-token
// logprob and entropy. Handles for the advantages, inline for the rest.
TEST_F(PostTrainingClientTest, PpoClipWithSegmentsAndPolicyStats) {
  const int64_t rows = 11, vocab = 17;
  const double eps_low = 0.2, eps_high = 0.28, kl_coef = 0.05;
  std::vector<float> student = Normal(rows * vocab, 1.0f);
  std::vector<int32_t> targets(rows), ids(rows);
  std::vector<float> advantages = Normal(rows, 1.0f), sampling(rows),
                     reference(rows);
  std::normal_distribution<float> jitter(0.0f, 0.3f);
  for (int64_t r = 0; r < rows; ++r) {
    targets[r] = (r * 5 + 1) % vocab;
    ids[r] = r < 4 ? 0 : 2;  // segment 1 is empty
    const std::vector<double> lp = LogSoftmax(&student[r * vocab], vocab, 1.0);
    sampling[r] = static_cast<float>(lp[targets[r]] + jitter(rng_));
    reference[r] = static_cast<float>(lp[targets[r]] + jitter(rng_));
  }
  targets[6] = -100;
  const std::string logits = UploadFloats(student, {rows, vocab});
  const std::string advantages_handle = UploadFloats(advantages, {rows});

  std::vector<double> segment_loss(3, 0.0);
  std::vector<int64_t> segment_tokens(3, 0);
  PolicyStats stats;
  std::vector<double> logprob(rows, 0.0), entropy(rows, 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    const std::vector<double> lp = LogSoftmax(&student[r * vocab], vocab, 1.0);
    for (int64_t c = 0; c < vocab; ++c) entropy[r] -= std::exp(lp[c]) * lp[c];
    if (targets[r] == -100) continue;
    logprob[r] = lp[targets[r]];
    const double ratio = std::exp(logprob[r] - sampling[r]);
    const double a = advantages[r];
    const double clipped = std::min(std::max(ratio, 1 - eps_low), 1 + eps_high);
    const double d = reference[r] - logprob[r];
    const double kl = std::exp(d) - d - 1;
    segment_loss[ids[r]] += std::max(-ratio * a, -clipped * a) + kl_coef * kl;
    ++segment_tokens[ids[r]];
    stats.clipped_tokens += -clipped * a > -ratio * a;
    stats.ratio_sum += ratio;
    stats.approx_kl_sum += sampling[r] - logprob[r];
    stats.kl_sum += kl;
    stats.entropy_sum += entropy[r];
  }
  const double want = (segment_loss[0] + segment_loss[2]) / 2;

  ForwardOptions options;
  options.mode = GradientMode::kNone;
  options.token_logprob = true;
  options.token_entropy = true;
  PolicyGradientOptions policy;
  policy.loss = PolicyLossKind::kPpoClip;
  policy.advantages = LossInput::Handle(advantages_handle);
  policy.sampling_logprobs = LossInput::Inline(sampling);
  policy.reference_logprobs = LossInput::Inline(reference);
  policy.epsilon_low = static_cast<float>(eps_low);
  policy.epsilon_high = static_cast<float>(eps_high);
  policy.kl_coef = static_cast<float>(kl_coef);
  options.policy = policy;
  SegmentOptions segments;
  segments.ids = LossInput::Inline(ids);
  segments.count = 3;
  segments.reduction = SegmentReduction::kSeqMeanTokenSum;
  options.segments = segments;
  absl::StatusOr<ForwardResult> fwd = client_->Forward(
      logits, Targets::Inline(DType::kInt32, targets.data(), rows * 4),
      options);
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  EXPECT_NEAR(fwd->loss, want, 1e-5 * (1 + std::abs(want)));
  EXPECT_EQ(fwd->denominator, 2.0);
  ASSERT_EQ(fwd->segment_loss.size(), 3u);
  EXPECT_THAT(fwd->segment_tokens, ::testing::ElementsAreArray(segment_tokens));
  for (int s = 0; s < 3; ++s) {
    EXPECT_NEAR(fwd->segment_loss[s], segment_loss[s],
                1e-5 * (1 + std::abs(segment_loss[s])));
  }
  EXPECT_EQ(fwd->policy_stats.clipped_tokens, stats.clipped_tokens);
  EXPECT_NEAR(fwd->policy_stats.ratio_sum, stats.ratio_sum, 1e-5);
  EXPECT_NEAR(fwd->policy_stats.approx_kl_sum, stats.approx_kl_sum, 1e-5);
  EXPECT_NEAR(fwd->policy_stats.kl_sum, stats.kl_sum, 1e-5);
  EXPECT_NEAR(fwd->policy_stats.entropy_sum, stats.entropy_sum, 1e-4);
  ASSERT_EQ(fwd->token_logprob.size(), static_cast<std::size_t>(rows));
  ASSERT_EQ(fwd->token_entropy.size(), static_cast<std::size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) {
    EXPECT_NEAR(fwd->token_logprob[r], logprob[r], 1e-5) << r;
    EXPECT_NEAR(fwd->token_entropy[r], entropy[r], 1e-5) << r;
  }
}

// Evaluate with a top-k teacher and segment ids in the blocks gives the same
// numbers as a Forward in mode NONE over all rows, whatever the block size.
TEST_F(PostTrainingClientTest,
       EvaluateWithTopKTeacherAndSegmentsEqualsForward) {
  const int64_t rows = 23, vocab = 19, k = 4;
  std::vector<float> student = Normal(rows * vocab);
  std::vector<float> teacher = Normal(rows * vocab);
  std::vector<int32_t> targets(rows), ids(rows), indices;
  std::vector<float> logprobs;
  for (int64_t r = 0; r < rows; ++r) {
    targets[r] = r % 3 == 0 ? -100 : static_cast<int32_t>((r * 3) % vocab);
    ids[r] = static_cast<int32_t>(r / 6);
  }
  TopK(teacher, rows, vocab, k, &indices, &logprobs);
  const std::string logits = UploadFloats(student, {rows, vocab});

  DistillationOptions distillation;
  distillation.alpha = 0.5f;
  distillation.temperature = 1.5f;
  distillation.divergence = Divergence::kReverseKl;
  distillation.top_k = k;
  distillation.tail = TopKTail::kRenormalize;
  SegmentOptions segments;
  segments.count = 4;
  segments.reduction = SegmentReduction::kSeqMeanTokenMean;

  ForwardOptions forward_options;
  forward_options.mode = GradientMode::kNone;
  DistillationOptions inline_teacher = distillation;
  inline_teacher.top_k_indices = LossInput::Inline(indices);
  inline_teacher.top_k_logprobs = LossInput::Inline(logprobs);
  forward_options.distillation = inline_teacher;
  SegmentOptions inline_ids = segments;
  inline_ids.ids = LossInput::Inline(ids);
  forward_options.segments = inline_ids;
  absl::StatusOr<ForwardResult> fwd = client_->Forward(
      logits, Targets::Inline(DType::kInt32, targets.data(), rows * 4),
      forward_options);
  ASSERT_TRUE(fwd.ok()) << fwd.status();

  EvaluateOptions eval_options;
  eval_options.distillation = distillation;
  eval_options.segments = segments;
  for (int64_t block_rows : {int64_t{1}, int64_t{5}, rows}) {
    int64_t next = 0;
    absl::StatusOr<EvaluateResult> eval = client_->Evaluate(
        vocab, DType::kFloat32, DType::kInt32, eval_options,
        [&](RowBlock* block) -> absl::StatusOr<bool> {
          if (next >= rows) return false;
          const int64_t n = std::min(block_rows, rows - next);
          auto bytes = [](const void* data, std::size_t size) {
            return std::string(static_cast<const char*>(data), size);
          };
          block->logits = bytes(&student[next * vocab], n * vocab * 4);
          block->targets = bytes(&targets[next], n * 4);
          block->teacher_indices = bytes(&indices[next * k], n * k * 4);
          block->teacher_logprobs = bytes(&logprobs[next * k], n * k * 4);
          block->segment_ids = bytes(&ids[next], n * 4);
          next += n;
          return true;
        });
    ASSERT_TRUE(eval.ok()) << eval.status();
    EXPECT_EQ(eval->rows, rows);
    EXPECT_EQ(eval->valid_tokens, fwd->valid_tokens);
    EXPECT_NEAR(eval->loss, fwd->loss, 1e-9 * (1 + std::abs(fwd->loss)));
    EXPECT_NEAR(eval->distillation_loss, fwd->distillation_loss,
                1e-9 * (1 + std::abs(fwd->distillation_loss)));
    ASSERT_EQ(eval->segment_loss.size(), fwd->segment_loss.size());
    for (std::size_t s = 0; s < fwd->segment_loss.size(); ++s) {
      EXPECT_NEAR(eval->segment_loss[s], fwd->segment_loss[s],
                  1e-9 * (1 + std::abs(fwd->segment_loss[s])));
    }
    EXPECT_EQ(eval->segment_tokens, fwd->segment_tokens);
  }
}

// Evaluate with a CISPO loss whose advantages, sampling and reference
// logprobs come in the blocks gives Forward's loss and policy statistics in
// mode NONE over all rows, whatever the block size.
TEST_F(PostTrainingClientTest, EvaluateWithPolicyEqualsForward) {
  const int64_t rows = 17, vocab = 13;
  std::vector<float> student = Normal(rows * vocab, 1.0f);
  std::vector<int32_t> targets(rows);
  std::vector<float> advantages = Normal(rows, 1.0f), sampling(rows),
                     reference(rows);
  std::normal_distribution<float> jitter(0.0f, 0.3f);
  for (int64_t r = 0; r < rows; ++r) {
    targets[r] = r % 4 == 1 ? -100 : static_cast<int32_t>((r * 7) % vocab);
    const std::vector<double> lp = LogSoftmax(&student[r * vocab], vocab, 1.0);
    const double logp = targets[r] < 0 ? 0.0 : lp[targets[r]];
    sampling[r] = static_cast<float>(logp + jitter(rng_));
    reference[r] = static_cast<float>(logp + jitter(rng_));
  }
  const std::string logits = UploadFloats(student, {rows, vocab});
  PolicyGradientOptions policy;
  policy.loss = PolicyLossKind::kCispo;
  policy.epsilon_high = 0.28f;
  policy.kl_coef = 0.05f;
  policy.kl_estimator = KlEstimator::kK2;

  ForwardOptions forward_options;
  forward_options.mode = GradientMode::kNone;
  forward_options.loss.reduction = Reduction::kSum;
  PolicyGradientOptions inline_policy = policy;
  inline_policy.advantages = LossInput::Inline(advantages);
  inline_policy.sampling_logprobs = LossInput::Inline(sampling);
  inline_policy.reference_logprobs = LossInput::Inline(reference);
  forward_options.policy = inline_policy;
  absl::StatusOr<ForwardResult> fwd = client_->Forward(
      logits, Targets::Inline(DType::kInt32, targets.data(), rows * 4),
      forward_options);
  ASSERT_TRUE(fwd.ok()) << fwd.status();

  EvaluateOptions eval_options;
  eval_options.loss.reduction = Reduction::kSum;
  policy.evaluate_reference_logprobs = true;
  eval_options.policy = policy;
  for (int64_t block_rows : {int64_t{1}, int64_t{6}, rows}) {
    int64_t next = 0;
    absl::StatusOr<EvaluateResult> eval = client_->Evaluate(
        vocab, DType::kFloat32, DType::kInt32, eval_options,
        [&](RowBlock* block) -> absl::StatusOr<bool> {
          if (next >= rows) return false;
          const int64_t n = std::min(block_rows, rows - next);
          auto bytes = [](const void* data, std::size_t size) {
            return std::string(static_cast<const char*>(data), size);
          };
          block->logits = bytes(&student[next * vocab], n * vocab * 4);
          block->targets = bytes(&targets[next], n * 4);
          block->advantages = bytes(&advantages[next], n * 4);
          block->sampling_logprobs = bytes(&sampling[next], n * 4);
          block->reference_logprobs = bytes(&reference[next], n * 4);
          next += n;
          return true;
        });
    ASSERT_TRUE(eval.ok()) << eval.status();
    EXPECT_EQ(eval->valid_tokens, fwd->valid_tokens);
    EXPECT_NEAR(eval->loss, fwd->loss, 1e-9 * (1 + std::abs(fwd->loss)));
    const PolicyStats& got = eval->policy_stats;
    const PolicyStats& want = fwd->policy_stats;
    EXPECT_EQ(got.clipped_tokens, want.clipped_tokens);
    EXPECT_NEAR(got.ratio_sum, want.ratio_sum, 1e-9 * (1 + want.ratio_sum));
    EXPECT_NEAR(got.approx_kl_sum, want.approx_kl_sum, 1e-9);
    EXPECT_NEAR(got.kl_sum, want.kl_sum, 1e-9);
    EXPECT_NEAR(got.entropy_sum, want.entropy_sum, 1e-9 * want.entropy_sum);
  }
}

// Arguments rejected before any RPC, and the server's INVALID_ARGUMENT for a
// bad post-training request, which leaves the logits as they were.
// LinearForward with a policy loss and segments on X = I: Z = W^T exactly,
// so its results are Forward's on the logits W^T.
TEST_F(PostTrainingClientTest, LinearForwardPolicyEqualsForwardOnTheLogits) {
  const int64_t rows = 6, vocab = 9;
  std::vector<float> identity(rows * rows, 0.0f), weight = Normal(vocab * rows);
  std::vector<float> logits(rows * vocab);
  for (int64_t r = 0; r < rows; ++r) {
    identity[r * rows + r] = 1.0f;
    for (int64_t v = 0; v < vocab; ++v) {
      logits[r * vocab + v] = weight[v * rows + r];
    }
  }
  std::vector<int32_t> targets = {1, 4, -100, 8, 0, 2};
  std::vector<float> sampling(rows);
  for (int64_t r = 0; r < rows; ++r) {
    const int32_t y = targets[r] < 0 ? 0 : targets[r];
    sampling[r] = static_cast<float>(
        LogSoftmax(&logits[r * vocab], vocab, 1.0)[y] + 0.3 * (r % 3 - 1));
  }
  // Inline inputs are not copied: these outlive the calls.
  const std::vector<float> advantages = Normal(rows, 1.0f);
  const std::vector<int32_t> ids = {0, 0, 0, 1, 1, 1};
  PolicyGradientOptions policy;
  policy.loss = PolicyLossKind::kPpoClip;
  policy.advantages = LossInput::Inline(advantages);
  policy.sampling_logprobs = LossInput::Inline(sampling);
  SegmentOptions segments;
  segments.ids = LossInput::Inline(ids);
  segments.count = 2;
  segments.reduction = SegmentReduction::kSeqMeanTokenSum;
  const Targets inline_targets =
      Targets::Inline(DType::kInt32, targets.data(), rows * 4);

  ForwardOptions forward_options;
  forward_options.mode = GradientMode::kNone;
  forward_options.policy = policy;
  forward_options.segments = segments;
  forward_options.token_ratio = forward_options.token_clipped = true;
  absl::StatusOr<ForwardResult> forward = client_->Forward(
      UploadFloats(logits, {rows, vocab}), inline_targets, forward_options);
  ASSERT_TRUE(forward.ok()) << forward.status();

  LinearForwardOptions linear_options;
  linear_options.mode = GradientMode::kOutOfPlace;
  linear_options.policy = policy;
  linear_options.segments = segments;
  linear_options.token_ratio = linear_options.token_clipped = true;
  absl::StatusOr<LinearForwardResult> linear = client_->LinearForward(
      UploadFloats(identity, {rows, rows}), UploadFloats(weight, {vocab, rows}),
      inline_targets, linear_options);
  ASSERT_TRUE(linear.ok()) << linear.status();
  const ForwardResult& got = linear->forward;
  EXPECT_DOUBLE_EQ(got.loss, forward->loss);
  EXPECT_EQ(got.denominator, forward->denominator);
  EXPECT_EQ(got.policy_stats.clipped_tokens,
            forward->policy_stats.clipped_tokens);
  EXPECT_DOUBLE_EQ(got.policy_stats.ratio_sum, forward->policy_stats.ratio_sum);
  EXPECT_EQ(got.segment_loss, forward->segment_loss);
  EXPECT_EQ(got.segment_tokens, forward->segment_tokens);
  EXPECT_EQ(got.token_ratio, forward->token_ratio);
  EXPECT_EQ(got.token_clipped, forward->token_clipped);
  EXPECT_FALSE(got.gradient.empty());
  EXPECT_FALSE(linear->weight_grad.empty());
}

TEST_F(PostTrainingClientTest, BadInputIsInvalidArgumentAndChangesNothing) {
  const int64_t rows = 4, vocab = 6;
  std::vector<float> student = Normal(rows * vocab);
  std::vector<int32_t> targets = {0, 1, 2, 3};
  const std::string logits = UploadFloats(student, {rows, vocab});
  const Targets inline_targets =
      Targets::Inline(DType::kInt32, targets.data(), rows * 4);

  ForwardOptions no_teacher;
  no_teacher.distillation = DistillationOptions();
  absl::Status status =
      client_->Forward(logits, inline_targets, no_teacher).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("no teacher"));

  // k > V.
  std::vector<int32_t> indices(rows * 7);
  std::vector<float> logprobs(rows * 7, -2.0f);
  for (std::size_t i = 0; i < indices.size(); ++i) indices[i] = i % 7;
  ForwardOptions too_many;
  DistillationOptions distillation;
  distillation.top_k = 7;
  distillation.top_k_indices = LossInput::Inline(indices);
  distillation.top_k_logprobs = LossInput::Inline(logprobs);
  too_many.distillation = distillation;
  EXPECT_EQ(client_->Forward(logits, inline_targets, too_many).status().code(),
            absl::StatusCode::kInvalidArgument);

  // A NaN advantage.
  std::vector<float> advantages = {1.0f, NAN, 0.5f, -1.0f};
  std::vector<float> sampling(rows, -1.0f);
  ForwardOptions nan_advantage;
  PolicyGradientOptions policy;
  policy.advantages = LossInput::Inline(advantages);
  policy.sampling_logprobs = LossInput::Inline(sampling);
  nan_advantage.policy = policy;
  EXPECT_EQ(
      client_->Forward(logits, inline_targets, nan_advantage).status().code(),
      absl::StatusCode::kInvalidArgument);

  absl::StatusOr<DownloadedTensor> kept = client_->Download(logits);
  ASSERT_TRUE(kept.ok()) << kept.status();
  EXPECT_EQ(AsFloats(kept->data), student);
}

}  // namespace
}  // namespace lossd
