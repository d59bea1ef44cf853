// Evaluate over hidden states (EvaluateHeader.weight) through lossd::Client on
// the CPU device: the loss of X W^T + b against a float64 reference for fp32
// and bf16, with every loss option; the same bits over the stream and 1 or 3
// data connections; LinearForward's loss on the same rows; the budget; the
// weight read for the RPC's life (an overwrite refused, a Release deferred);
// another tenant's weight; the post-training losses against LinearForward's;
// and errors that change nothing.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "client/client.h"
#include "common/float16.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/server.h"
#include "tests/e2e/scrape.h"
#include "tests/e2e/test_server.h"

namespace lossd {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kBudget = 64 << 20;

// A problem: X [rows, width], W [vocab, width], b [vocab], targets (some
// ignored), class weights; values as stored (bf16 ones already rounded).
struct Problem {
  int64_t rows = 0, width = 0, vocab = 0;
  DType dtype = DType::kFloat32;
  std::vector<float> x, weight, bias, class_weights;
  std::vector<int64_t> targets;
};

constexpr int64_t kIgnored = -7;

Problem MakeProblem(int64_t rows, int64_t width, int64_t vocab, DType dtype,
                    uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int64_t> target(0, vocab - 1);
  std::uniform_real_distribution<float> uniform(0.3f, 3.0f);
  const auto stored = [dtype](float value) {
    return dtype == DType::kBFloat16 ? BF16ToFloat(FloatToBF16(value)) : value;
  };
  Problem p;
  p.rows = rows;
  p.width = width;
  p.vocab = vocab;
  p.dtype = dtype;
  for (int64_t i = 0; i < rows * width; ++i) p.x.push_back(stored(normal(rng)));
  for (int64_t i = 0; i < vocab * width; ++i) {
    p.weight.push_back(stored(0.4f * normal(rng)));
  }
  for (int64_t i = 0; i < vocab; ++i) {
    p.bias.push_back(stored(0.2f * normal(rng)));
    p.class_weights.push_back(uniform(rng));
  }
  for (int64_t i = 0; i < rows; ++i) {
    p.targets.push_back(i % 7 == 4 ? kIgnored : target(rng));
  }
  return p;
}

// The bytes of `values` as `dtype` (fp32 or bf16), little-endian.
std::string AsBytes(const std::vector<float>& values, DType dtype) {
  if (dtype == DType::kFloat32) {
    return std::string(reinterpret_cast<const char*>(values.data()),
                       values.size() * sizeof(float));
  }
  std::vector<uint16_t> half(values.size());
  for (size_t i = 0; i < values.size(); ++i) half[i] = FloatToBF16(values[i]);
  return std::string(reinterpret_cast<const char*>(half.data()),
                     half.size() * 2);
}

// The float64 loss of Evaluate (loss_options.h's formula) on z = X W^T (+ b).
struct Expected {
  double loss = 0.0, z_loss = 0.0, denominator = 0.0;
  int64_t valid = 0;
};
Expected Reference(const Problem& p, bool with_bias, bool with_weights,
                   const CrossEntropyOptions& options) {
  const int64_t v = p.vocab, h = p.width;
  const double eps = options.label_smoothing;
  double loss = 0.0, z_loss = 0.0, weight_sum = 0.0;
  Expected e;
  for (int64_t i = 0; i < p.rows; ++i) {
    const int64_t y = p.targets[i];
    if (y == options.ignore_index) continue;
    std::vector<double> z(v);
    double top = -INFINITY;
    for (int64_t c = 0; c < v; ++c) {
      double sum = with_bias ? double{p.bias[c]} : 0.0;
      for (int64_t k = 0; k < h; ++k) {
        sum += double{p.weight[c * h + k]} * double{p.x[i * h + k]};
      }
      if (options.softcap > 0) {
        sum = options.softcap * std::tanh(sum / options.softcap);
      }
      z[c] = sum;
      top = std::max(top, sum);
    }
    double total = 0.0;
    for (double zc : z) total += std::exp(zc - top);
    const double lse = top + std::log(total);
    const auto w = [&](int64_t c) {
      return with_weights ? double{p.class_weights[c]} : 1.0;
    };
    double smooth = 0.0;
    for (int64_t c = 0; c < v; ++c) smooth += w(c) * (lse - z[c]);
    const double z_term = options.z_loss_scale * lse * lse;
    loss += (1 - eps) * w(y) * (lse - z[y]) + eps / v * smooth + z_term;
    z_loss += z_term;
    weight_sum += w(y);
    ++e.valid;
  }
  e.loss = loss;
  e.z_loss = z_loss;
  if (options.reduction == Reduction::kMean) {
    e.denominator = options.normalizer > 0 ? options.normalizer : weight_sum;
    e.loss /= e.denominator;
    e.z_loss /= e.denominator;
  }
  return e;
}

// The same blocks give the same bits, however they travel.
void ExpectSameBits(const EvaluateResult& got, const EvaluateResult& want) {
  EXPECT_EQ(got.loss, want.loss);
  EXPECT_EQ(got.z_loss, want.z_loss);
  EXPECT_EQ(got.rows, want.rows);
  EXPECT_EQ(got.valid_tokens, want.valid_tokens);
  EXPECT_EQ(got.correct_tokens, want.correct_tokens);
  EXPECT_EQ(got.nonfinite_rows, want.nonfinite_rows);
  EXPECT_EQ(got.denominator, want.denominator);
}

class EvaluateLinearTest : public ::testing::Test {
 protected:
  void SetUp() override { Start("", kBudget); }

  // (Re)starts the server with `budget` bytes; with `tokens` ("token tenant"
  // lines) it authenticates callers.
  void Start(const std::string& tokens, int64_t budget) {
    client_.reset();
    server_.reset();
    ServerConfig config =
        e2e_test::LoopbackConfig("cpu", budget, absl::Seconds(10));
    config.data_port = 0;
    config.metrics_port = 0;
    if (!tokens.empty()) e2e_test::UseTokens(tokens, &config);
    absl::StatusOr<std::unique_ptr<LossdServer>> server =
        LossdServer::Start(config);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    client_ = Connect(false, 1);
  }

  // A client whose evaluations go over `connections` data connections, or
  // over the stream.
  std::unique_ptr<Client> Connect(bool data_connection, int connections,
                                  const std::string& token = "") {
    ClientOptions options;
    options.data_connection = data_connection;
    options.upload_streams = connections;
    options.stripe_min_bytes = 1;
    options.bearer_token = token;
    absl::StatusOr<std::unique_ptr<Client>> client =
        Client::Connect(server_->address(), options);
    EXPECT_TRUE(client.ok()) << client.status();
    return client.ok() ? *std::move(client) : nullptr;
  }

  std::string Put(DType dtype, const std::vector<float>& values,
                  std::vector<int64_t> shape, Client* client = nullptr) {
    const std::string bytes = AsBytes(values, dtype);
    absl::StatusOr<TensorInfo> info =
        (client != nullptr ? client : client_.get())
            ->Upload(dtype, shape, bytes.data(), bytes.size());
    EXPECT_TRUE(info.ok()) << info.status();
    return info.ok() ? info->handle : "";
  }

  // The LM head of `p` on the server.
  struct Head {
    std::string weight, bias, class_weights;
  };
  Head Store(const Problem& p, Client* client = nullptr) {
    return {Put(p.dtype, p.weight, {p.vocab, p.width}, client),
            Put(p.dtype, p.bias, {p.vocab}, client),
            Put(DType::kFloat32, p.class_weights, {p.vocab}, client)};
  }

  // Client::Evaluate of p's hidden states in blocks of `block_rows`.
  absl::StatusOr<EvaluateResult> Evaluate(Client* client, const Problem& p,
                                          const EvaluateOptions& options,
                                          int64_t block_rows) {
    const std::string x = AsBytes(p.x, p.dtype);
    return client->Evaluate(p.rows, p.width, p.dtype, x.data(), DType::kInt64,
                            p.targets.data(), options, block_rows);
  }

  int64_t Completed() const { return server_->data_plane()->completed(); }
  int64_t UsedBytes() const { return server_->store()->Stats().used_bytes; }

  std::vector<scrape::Sample> Scrape() {
    absl::StatusOr<std::vector<scrape::Sample>> samples =
        scrape::Scrape(server_->metrics_port());
    EXPECT_TRUE(samples.ok()) << samples.status();
    return samples.ok() ? *samples : std::vector<scrape::Sample>{};
  }
  double Metric(const std::string& name,
                const std::map<std::string, std::string>& labels) {
    return scrape::FindSample(Scrape(), name, labels).value_or(0.0);
  }
  // Waits (at most 10 s) until `name{labels}` reaches `value`.
  bool AwaitMetric(const std::string& name,
                   const std::map<std::string, std::string>& labels,
                   double value) {
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (Metric(name, labels) < value) {
      if (absl::Now() > deadline) return false;
      absl::SleepFor(absl::Milliseconds(2));
    }
    return true;
  }

  // The bytes stored behind `handle`, as stored.
  std::vector<uint8_t> Stored(const std::string& handle) {
    absl::StatusOr<DownloadedTensor> got = client_->Download(handle);
    EXPECT_TRUE(got.ok()) << got.status();
    return got.ok() ? got->data : std::vector<uint8_t>{};
  }

  std::unique_ptr<LossdServer> server_;
  std::unique_ptr<Client> client_;
};

// The loss of every option set, fp32 and bf16, with and without a bias,
// against the float64 reference; over 1 and 3 data connections the stream's
// bits.
TEST_F(EvaluateLinearTest, MatchesFloat64ReferenceOverEveryPath) {
  struct OptionSet {
    const char* name;
    CrossEntropyOptions loss;
    bool class_weights = false;
  };
  std::vector<OptionSet> sets(5);
  sets[0].name = "mean";
  sets[0].loss.ignore_index = kIgnored;
  sets[1].name = "sum, label smoothing, z-loss";
  sets[1].loss.reduction = Reduction::kSum;
  sets[1].loss.label_smoothing = 0.1f;
  sets[1].loss.z_loss_scale = 1e-3f;
  sets[1].loss.ignore_index = kIgnored;
  sets[2].name = "mean, class weights, label smoothing";
  sets[2].loss.label_smoothing = 0.2f;
  sets[2].loss.ignore_index = kIgnored;
  sets[2].class_weights = true;
  sets[3].name = "mean over a normalizer, softcap";
  sets[3].loss.normalizer = 100.0;
  sets[3].loss.softcap = 3.0f;
  sets[3].loss.ignore_index = kIgnored;
  sets[4].name = "sum, class weights, z-loss";
  sets[4].loss.reduction = Reduction::kSum;
  sets[4].loss.z_loss_scale = 1e-2f;
  sets[4].loss.ignore_index = kIgnored;
  sets[4].class_weights = true;
  std::unique_ptr<Client> one = Connect(true, 1);
  std::unique_ptr<Client> three = Connect(true, 3);
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    const Problem p = MakeProblem(41, 24, 37, dtype, 3);
    const Head head = Store(p);
    for (bool with_bias : {false, true}) {
      for (const OptionSet& set : sets) {
        SCOPED_TRACE(absl::StrCat(DTypeName(dtype), with_bias ? " bias " : " ",
                                  set.name));
        EvaluateOptions options;
        options.loss = set.loss;
        options.weight = head.weight;
        if (with_bias) options.bias = head.bias;
        if (set.class_weights) options.class_weights = head.class_weights;
        const Expected want =
            Reference(p, with_bias, set.class_weights, set.loss);
        absl::StatusOr<EvaluateResult> streamed =
            Evaluate(client_.get(), p, options, 6);
        ASSERT_TRUE(streamed.ok()) << streamed.status();
        EXPECT_NEAR(streamed->loss, want.loss, 2e-5 * std::abs(want.loss));
        EXPECT_NEAR(streamed->z_loss, want.z_loss,
                    2e-5 * std::abs(want.z_loss) + 1e-12);
        EXPECT_NEAR(streamed->denominator, want.denominator,
                    1e-6 * want.denominator);
        EXPECT_EQ(streamed->rows, p.rows);
        EXPECT_EQ(streamed->valid_tokens, want.valid);

        const int64_t before = Completed();
        absl::StatusOr<EvaluateResult> over_one =
            Evaluate(one.get(), p, options, 6);
        ASSERT_TRUE(over_one.ok()) << over_one.status();
        absl::StatusOr<EvaluateResult> over_three =
            Evaluate(three.get(), p, options, 6);
        ASSERT_TRUE(over_three.ok()) << over_three.status();
        EXPECT_EQ(Completed(), before + 4);  // the data connections carried
        ExpectSameBits(*over_one, *streamed);
        ExpectSameBits(*over_three, *streamed);
      }
    }
  }
}

// The loss LinearForward (mode NONE) gives on the same rows stored.
TEST_F(EvaluateLinearTest, EqualsLinearForwardWithoutGradient) {
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    SCOPED_TRACE(DTypeName(dtype));
    const Problem p = MakeProblem(29, 16, 53, dtype, 5);
    const Head head = Store(p);
    const std::string x = Put(dtype, p.x, {p.rows, p.width});
    const std::vector<int64_t> shape = {p.rows};
    absl::StatusOr<TensorInfo> targets = client_->Upload(
        DType::kInt64, shape, p.targets.data(), p.targets.size() * 8);
    ASSERT_TRUE(targets.ok()) << targets.status();
    LinearForwardOptions forward;
    forward.mode = GradientMode::kNone;
    forward.bias = head.bias;
    forward.class_weights = head.class_weights;
    forward.loss.label_smoothing = 0.05f;
    forward.loss.z_loss_scale = 1e-4f;
    forward.loss.ignore_index = kIgnored;
    absl::StatusOr<LinearForwardResult> stored = client_->LinearForward(
        x, head.weight, Targets::Handle(targets->handle), forward);
    ASSERT_TRUE(stored.ok()) << stored.status();
    EvaluateOptions options;
    options.loss = forward.loss;
    options.weight = head.weight;
    options.bias = head.bias;
    options.class_weights = head.class_weights;
    absl::StatusOr<EvaluateResult> streamed =
        Evaluate(client_.get(), p, options, 8);
    ASSERT_TRUE(streamed.ok()) << streamed.status();
    EXPECT_NEAR(streamed->loss, stored->forward.loss,
                1e-6 * std::abs(stored->forward.loss));
    EXPECT_NEAR(streamed->z_loss, stored->forward.z_loss,
                1e-6 * std::abs(stored->forward.z_loss));
    EXPECT_EQ(streamed->valid_tokens, stored->forward.valid_tokens);
    EXPECT_EQ(streamed->correct_tokens, stored->forward.correct_tokens);
    EXPECT_EQ(streamed->nonfinite_rows, stored->forward.nonfinite_rows);
  }
}

// Distillation (a top-k teacher, bucket tail, tau 2, alpha 0.3) and PPO, each
// with segments, over hidden states in blocks of 8 rows (the teacher's,
// policy's and segments' rows in the blocks) against LinearForward's loss of
// the same rows without a gradient.
TEST_F(EvaluateLinearTest, PostTrainingLossesEqualLinearForward) {
  const Problem p = MakeProblem(29, 16, 53, DType::kFloat32, 9);
  const Head head = Store(p);
  const std::string x = Put(p.dtype, p.x, {p.rows, p.width});
  constexpr int32_t kTopK = 3;
  std::vector<int32_t> indices, ids;
  std::vector<float> logprobs, advantages, sampling;
  for (int64_t row = 0; row < p.rows; ++row) {
    for (int32_t j = 0; j < kTopK; ++j) {
      indices.push_back(static_cast<int32_t>((row * 7 + j * 11) % p.vocab));
    }
    logprobs.insert(logprobs.end(),
                    {std::log(0.5f), std::log(0.2f), std::log(0.1f)});
    ids.push_back(static_cast<int32_t>(row / 10));
    advantages.push_back(static_cast<float>(row % 5) - 2.0f);
    sampling.push_back(-3.0f - 0.1f * static_cast<float>(row % 4));
  }
  SegmentOptions segments;
  segments.count = 3;
  for (const bool distill : {true, false}) {
    SCOPED_TRACE(distill ? "distillation" : "ppo");
    LinearForwardOptions forward;
    forward.mode = GradientMode::kNone;
    forward.bias = head.bias;
    forward.loss.ignore_index = kIgnored;
    EvaluateOptions options;
    options.loss = forward.loss;
    options.weight = head.weight;
    options.bias = head.bias;
    options.segments = segments;
    forward.segments = segments;
    forward.segments->ids = LossInput::Inline(absl::MakeConstSpan(ids));
    if (distill) {
      DistillationOptions kd;
      kd.top_k = kTopK;
      kd.tail = TopKTail::kBucket;
      kd.temperature = 2.0f;
      kd.alpha = 0.3f;
      options.distillation = kd;
      kd.top_k_indices = LossInput::Inline(absl::MakeConstSpan(indices));
      kd.top_k_logprobs = LossInput::Inline(absl::MakeConstSpan(logprobs));
      forward.distillation = kd;
    } else {
      PolicyGradientOptions pg;
      pg.loss = PolicyLossKind::kPpoClip;
      options.policy = pg;
      pg.advantages = LossInput::Inline(absl::MakeConstSpan(advantages));
      pg.sampling_logprobs = LossInput::Inline(absl::MakeConstSpan(sampling));
      forward.policy = pg;
    }
    const std::vector<int64_t> shape = {p.rows};
    absl::StatusOr<TensorInfo> targets = client_->Upload(
        DType::kInt64, shape, p.targets.data(), p.targets.size() * 8);
    ASSERT_TRUE(targets.ok()) << targets.status();
    absl::StatusOr<LinearForwardResult> stored = client_->LinearForward(
        x, head.weight, Targets::Handle(targets->handle), forward);
    ASSERT_TRUE(stored.ok()) << stored.status();

    const std::string rows = AsBytes(p.x, p.dtype);
    const auto slice = [](const auto& values, int64_t per_row, int64_t start,
                          int64_t count) {
      return std::string(
          reinterpret_cast<const char*>(values.data() + start * per_row),
          count * per_row * sizeof(values[0]));
    };
    int64_t next = 0;
    absl::StatusOr<EvaluateResult> streamed = client_->Evaluate(
        p.width, p.dtype, DType::kInt64, options,
        [&](RowBlock* block) -> absl::StatusOr<bool> {
          if (next >= p.rows) return false;
          const int64_t count = std::min<int64_t>(8, p.rows - next);
          block->logits = rows.substr(next * p.width * 4, count * p.width * 4);
          block->targets = slice(p.targets, 1, next, count);
          block->segment_ids = slice(ids, 1, next, count);
          if (distill) {
            block->teacher_indices = slice(indices, kTopK, next, count);
            block->teacher_logprobs = slice(logprobs, kTopK, next, count);
          } else {
            block->advantages = slice(advantages, 1, next, count);
            block->sampling_logprobs = slice(sampling, 1, next, count);
          }
          next += count;
          return true;
        });
    ASSERT_TRUE(streamed.ok()) << streamed.status();
    const ForwardResult& want = stored->forward;
    EXPECT_NEAR(streamed->loss, want.loss, 1e-6 * std::abs(want.loss));
    EXPECT_NEAR(streamed->distillation_loss, want.distillation_loss,
                1e-6 * std::abs(want.distillation_loss) + 1e-12);
    EXPECT_EQ(streamed->valid_tokens, want.valid_tokens);
    EXPECT_EQ(streamed->segment_tokens, want.segment_tokens);
    ASSERT_EQ(streamed->segment_loss.size(), want.segment_loss.size());
    for (size_t s = 0; s < want.segment_loss.size(); ++s) {
      EXPECT_NEAR(streamed->segment_loss[s], want.segment_loss[s],
                  1e-6 * std::abs(want.segment_loss[s]) + 1e-12);
    }
    EXPECT_EQ(streamed->policy_stats.clipped_tokens,
              want.policy_stats.clipped_tokens);
    EXPECT_NEAR(streamed->policy_stats.ratio_sum, want.policy_stats.ratio_sum,
                1e-6 * std::abs(want.policy_stats.ratio_sum) + 1e-12);
    EXPECT_NEAR(streamed->policy_stats.entropy_sum,
                want.policy_stats.entropy_sum,
                1e-6 * std::abs(want.policy_stats.entropy_sum) + 1e-12);
    if (distill) {
      EXPECT_GT(std::abs(want.distillation_loss), 0.0);
    }
    if (!distill) {
      EXPECT_GT(want.policy_stats.ratio_sum, 0.0);
    }
  }
}

// Issue 31: a mean whose every row is ignored divides by D = normalizer when
// one is given (and by nothing otherwise), and Forward, LinearForward (with
// and without a gradient) and Evaluate (over logits and over hidden states)
// all report that D, with a loss of 0 and no valid rows.
TEST_F(EvaluateLinearTest, AllRowsIgnoredAgreeOnTheDenominator) {
  Problem p = MakeProblem(9, 8, 11, DType::kFloat32, 17);
  std::fill(p.targets.begin(), p.targets.end(), kIgnored);
  const Head head = Store(p);
  const std::vector<int64_t> shape = {p.rows};
  absl::StatusOr<TensorInfo> targets = client_->Upload(
      DType::kInt64, shape, p.targets.data(), p.targets.size() * 8);
  ASSERT_TRUE(targets.ok()) << targets.status();
  std::vector<float> logits(p.rows * p.vocab, 0.25f);
  for (double normalizer : {100.0, 0.0}) {
    SCOPED_TRACE(absl::StrCat("normalizer ", normalizer));
    CrossEntropyOptions loss;
    loss.reduction = Reduction::kMean;
    loss.normalizer = normalizer;
    loss.ignore_index = kIgnored;
    const auto expect = [&](const char* what, double got_loss,
                            int64_t got_valid, double got_denominator) {
      SCOPED_TRACE(what);
      EXPECT_EQ(got_loss, 0.0);
      EXPECT_EQ(got_valid, 0);
      EXPECT_EQ(got_denominator, normalizer);
    };

    ForwardOptions forward;
    forward.loss = loss;
    forward.mode = GradientMode::kOutOfPlace;
    const std::string z = Put(DType::kFloat32, logits, {p.rows, p.vocab});
    absl::StatusOr<ForwardResult> on_logits =
        client_->Forward(z, Targets::Handle(targets->handle), forward);
    ASSERT_TRUE(on_logits.ok()) << on_logits.status();
    expect("Forward", on_logits->loss, on_logits->valid_tokens,
           on_logits->denominator);

    for (GradientMode mode : {GradientMode::kNone, GradientMode::kInPlace}) {
      const std::string x = Put(p.dtype, p.x, {p.rows, p.width});
      LinearForwardOptions linear;
      linear.loss = loss;
      linear.mode = mode;
      absl::StatusOr<LinearForwardResult> stored = client_->LinearForward(
          x, head.weight, Targets::Handle(targets->handle), linear);
      ASSERT_TRUE(stored.ok()) << stored.status();
      expect(mode == GradientMode::kNone ? "LinearForward, no gradient"
                                         : "LinearForward, in place",
             stored->forward.loss, stored->forward.valid_tokens,
             stored->forward.denominator);
    }

    EvaluateOptions over_hidden;
    over_hidden.loss = loss;
    over_hidden.weight = head.weight;
    absl::StatusOr<EvaluateResult> hidden =
        Evaluate(client_.get(), p, over_hidden, 4);
    ASSERT_TRUE(hidden.ok()) << hidden.status();
    expect("Evaluate over hidden states", hidden->loss, hidden->valid_tokens,
           hidden->denominator);

    EvaluateOptions over_logits;
    over_logits.loss = loss;
    absl::StatusOr<EvaluateResult> streamed =
        client_->Evaluate(p.rows, p.vocab, DType::kFloat32, logits.data(),
                          DType::kInt64, p.targets.data(), over_logits, 4);
    ASSERT_TRUE(streamed.ok()) << streamed.status();
    expect("Evaluate over logits", streamed->loss, streamed->valid_tokens,
           streamed->denominator);
  }
}

// Evaluate's metrics: every block's bytes (H values a row, not V) and a
// linear_cross_entropy kernel run per block.
TEST_F(EvaluateLinearTest, CountsBytesAndKernelRuns) {
  const Problem p = MakeProblem(10, 8, 300, DType::kFloat32, 7);
  const Head head = Store(p);
  EvaluateOptions options;
  options.weight = head.weight;
  options.loss.ignore_index = kIgnored;
  const double bytes_before =
      Metric("lossd_transfer_bytes_total", {{"direction", "evaluate"}});
  ASSERT_TRUE(Evaluate(client_.get(), p, options, 4).ok());
  EXPECT_EQ(Metric("lossd_transfer_bytes_total", {{"direction", "evaluate"}}) -
                bytes_before,
            p.rows * p.width * 4 + p.rows * 8);
  EXPECT_EQ(Metric("lossd_kernel_runs_total",
                   {{"device", "cpu"}, {"kernel", "linear_cross_entropy"}}),
            3);
  EXPECT_EQ(Metric("lossd_kernel_runs_total",
                   {{"device", "cpu"}, {"kernel", "cross_entropy"}}),
            0);
  EXPECT_EQ(Metric("lossd_rpc_total", {{"method", "Evaluate"}, {"code", "OK"}}),
            1);
}

// A block's buffer is charged to the budget: one that does not fit what is
// left is RESOURCE_EXHAUSTED, and nothing stays charged.
TEST_F(EvaluateLinearTest, BlockBufferOverBudget) {
  Start("", 1 << 20);
  const Problem p = MakeProblem(1200, 256, 4, DType::kFloat32, 9);
  const Head head = Store(p);
  const int64_t baseline = UsedBytes();
  EvaluateOptions options;
  options.weight = head.weight;
  options.loss.ignore_index = kIgnored;
  // 1200 rows of 1 KiB: more than the budget's 1 MiB.
  absl::StatusOr<EvaluateResult> result =
      Evaluate(client_.get(), p, options, p.rows);
  ASSERT_EQ(result.status().code(), absl::StatusCode::kResourceExhausted)
      << result.status();
  EXPECT_EQ(UsedBytes(), baseline);
  // Smaller blocks fit.
  absl::StatusOr<EvaluateResult> fits = Evaluate(client_.get(), p, options, 50);
  ASSERT_TRUE(fits.ok()) << fits.status();
  EXPECT_EQ(fits->rows, p.rows);
  EXPECT_EQ(UsedBytes(), baseline);
}

// The weight is read for the RPC's whole life: while an evaluation runs, an
// overwrite of it is refused, and a Release succeeds but the blocks still
// meet the weight; its memory goes as soon as the evaluation's status is
// back.
TEST_F(EvaluateLinearTest, WeightHeldForTheWholeEvaluation) {
  const Problem p = MakeProblem(30, 16, 40, DType::kFloat32, 11);
  const Head head = Store(p);
  const int64_t baseline = UsedBytes();
  const int64_t weight_bytes = p.vocab * p.width * 4;
  std::unique_ptr<Client> other = Connect(false, 1);
  const std::string x = AsBytes(p.x, p.dtype);
  const int64_t block_rows = 10;
  int64_t next = 0;
  absl::Status overwrite;
  absl::Status release;
  EvaluateOptions options;
  options.weight = head.weight;
  options.bias = head.bias;
  options.loss.ignore_index = kIgnored;
  absl::StatusOr<EvaluateResult> result = client_->Evaluate(
      p.width, p.dtype, DType::kInt64, options,
      [&](RowBlock* block) -> absl::StatusOr<bool> {
        if (next >= p.rows) return false;
        if (next == block_rows) {
          // The first block was evaluated, so the header's leases are held.
          if (!AwaitMetric(
                  "lossd_kernel_runs_total",
                  {{"device", "cpu"}, {"kernel", "linear_cross_entropy"}}, 1)) {
            return absl::DeadlineExceededError("the first block never ran");
          }
          const std::vector<float> zeros(p.weight.size(), 0.0f);
          const std::vector<int64_t> shape = {p.vocab, p.width};
          overwrite = other
                          ->Overwrite(head.weight, DType::kFloat32, shape,
                                      zeros.data(), zeros.size() * 4)
                          .status();
          release = other->Release(head.weight).status();
        }
        block->logits.assign(x.data() + next * p.width * 4,
                             block_rows * p.width * 4);
        block->targets.assign(
            reinterpret_cast<const char*>(p.targets.data() + next),
            block_rows * 8);
        next += block_rows;
        return true;
      });
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(overwrite.code(), absl::StatusCode::kFailedPrecondition)
      << overwrite;
  EXPECT_THAT(std::string(overwrite.message()), HasSubstr(head.weight));
  EXPECT_TRUE(release.ok()) << release;
  CrossEntropyOptions loss;
  loss.ignore_index = kIgnored;
  const Expected want = Reference(p, true, false, loss);
  EXPECT_NEAR(result->loss, want.loss, 2e-5 * want.loss);
  EXPECT_EQ(result->rows, p.rows);
  // Released with the status: nothing waits for gRPC's clean-up.
  EXPECT_EQ(UsedBytes(), baseline - weight_bytes);
  EXPECT_EQ(client_->Describe(head.weight).status().code(),
            absl::StatusCode::kNotFound);
}

// An evaluation that meets its weight being overwritten fails
// FAILED_PRECONDITION at once (it would otherwise wait on a client's upload);
// once the overwrite is done, the new values are evaluated.
TEST_F(EvaluateLinearTest, WeightBeingOverwrittenIsRefused) {
  const Problem p = MakeProblem(12, 8, 20, DType::kFloat32, 13);
  const Head head = Store(p);
  Problem updated = p;
  for (float& w : updated.weight) w *= -0.5f;
  EvaluateOptions options;
  options.weight = head.weight;
  options.loss.ignore_index = kIgnored;
  // The overwrite goes in two chunks; between them it holds the weight.
  ClientOptions halves;
  halves.chunk_bytes = updated.weight.size() * sizeof(float) / 2;
  absl::StatusOr<std::unique_ptr<Client>> writer =
      Client::Connect(server_->address(), halves);
  ASSERT_TRUE(writer.ok()) << writer.status();
  const double uploaded =
      Metric("lossd_transfer_bytes_total", {{"direction", "upload"}});
  absl::StatusOr<EvaluateResult> refused;
  int64_t used = -1;
  bool first_chunk = true;
  const std::vector<int64_t> shape = {p.vocab, p.width};
  absl::StatusOr<TensorInfo> overwritten = (*writer)->Overwrite(
      head.weight, DType::kFloat32, shape, updated.weight.data(),
      updated.weight.size() * sizeof(float), [&](int64_t done, int64_t) {
        if (!first_chunk) return;
        first_chunk = false;
        // The first half arrived, so the overwrite holds the weight.
        ASSERT_TRUE(AwaitMetric("lossd_transfer_bytes_total",
                                {{"direction", "upload"}}, uploaded + done));
        used = UsedBytes();
        refused = Evaluate(client_.get(), p, options, 4);
      });
  ASSERT_TRUE(overwritten.ok()) << overwritten.status();
  ASSERT_FALSE(first_chunk);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition)
      << refused.status();
  EXPECT_THAT(
      std::string(refused.status().message()),
      HasSubstr(absl::StrCat("handle ", head.weight, " is being written")));
  EXPECT_EQ(UsedBytes(), used);

  // Once the overwrite is done, the new values are evaluated.
  absl::StatusOr<EvaluateResult> result =
      Evaluate(client_.get(), updated, options, 4);
  ASSERT_TRUE(result.ok()) << result.status();
  CrossEntropyOptions loss;
  loss.ignore_index = kIgnored;
  const Expected want = Reference(updated, false, false, loss);
  EXPECT_NEAR(result->loss, want.loss, 2e-5 * want.loss);
}

// A block that fails (a target out of range) after others succeeded, on the
// stream and over data connections: the error, nothing left charged, the
// weight unchanged and usable by the next evaluation.
TEST_F(EvaluateLinearTest, FailedEvaluationChangesNothing) {
  Problem p = MakeProblem(20, 8, 10, DType::kBFloat16, 17);
  const Head head = Store(p);
  const std::vector<uint8_t> weight = Stored(head.weight);
  const int64_t baseline = UsedBytes();
  Problem bad = p;
  bad.targets[17] = p.vocab;
  EvaluateOptions options;
  options.weight = head.weight;
  options.bias = head.bias;
  options.loss.ignore_index = kIgnored;
  for (int connections : {0, 1, 3}) {
    SCOPED_TRACE(absl::StrCat(connections, " data connections"));
    std::unique_ptr<Client> client =
        Connect(connections > 0, std::max(connections, 1));
    absl::StatusOr<EvaluateResult> failed =
        Evaluate(client.get(), bad, options, 3);
    EXPECT_EQ(failed.status().code(), absl::StatusCode::kInvalidArgument)
        << failed.status();
    EXPECT_THAT(std::string(failed.status().message()),
                HasSubstr("targets[2] = 10 is out of range"));
    EXPECT_EQ(UsedBytes(), baseline);
    EXPECT_EQ(Stored(head.weight), weight);
    absl::StatusOr<EvaluateResult> good = Evaluate(client.get(), p, options, 3);
    ASSERT_TRUE(good.ok()) << good.status();
    EXPECT_EQ(good->rows, p.rows);
  }
  // Client-side checks: a bias needs a weight; blocks of whole rows of H.
  EvaluateOptions bias_only;
  bias_only.bias = head.bias;
  absl::StatusOr<EvaluateResult> refused =
      Evaluate(client_.get(), p, bias_only, 3);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(refused.status().message()),
              HasSubstr("bias is set but weight is not"));
  std::unique_ptr<Client> framed = Connect(true, 2);
  absl::StatusOr<EvaluateResult> partial = framed->Evaluate(
      p.width, p.dtype, DType::kInt64,
      [&] {
        EvaluateOptions known = options;
        known.total_rows = 1;
        return known;
      }(),
      [sent = false](RowBlock* block) mutable -> absl::StatusOr<bool> {
        if (sent) return false;
        sent = true;
        block->logits.assign(3, '\0');
        block->targets.assign(8, '\0');
        return true;
      });
  EXPECT_EQ(partial.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(partial.status().message()),
              HasSubstr("3 hidden-state bytes and 8 targets bytes are not "
                        "whole rows of 16 and 8 bytes"));
  EXPECT_EQ(UsedBytes(), baseline);
}

// A weight (or bias) is the tenant's own: another tenant's is unknown.
TEST_F(EvaluateLinearTest, AnotherTenantsWeightIsNotFound) {
  Start("secret-a alpha\nsecret-b beta\n", kBudget);
  std::unique_ptr<Client> alpha = Connect(false, 1, "secret-a");
  std::unique_ptr<Client> beta = Connect(true, 2, "secret-b");
  const Problem p = MakeProblem(6, 4, 5, DType::kFloat32, 19);
  const Head theirs = Store(p, alpha.get());
  const Head mine = Store(p, beta.get());
  const int64_t baseline = UsedBytes();
  EvaluateOptions options;
  options.weight = theirs.weight;
  options.loss.ignore_index = kIgnored;
  absl::StatusOr<EvaluateResult> weight = Evaluate(beta.get(), p, options, 2);
  EXPECT_EQ(weight.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(weight.status().message()),
              HasSubstr("header.weight: unknown handle " + theirs.weight));
  options.weight = mine.weight;
  options.bias = theirs.bias;
  absl::StatusOr<EvaluateResult> bias = Evaluate(beta.get(), p, options, 2);
  EXPECT_EQ(bias.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(bias.status().message()),
              HasSubstr("header.bias: unknown handle " + theirs.bias));
  EXPECT_EQ(UsedBytes(), baseline);
  options.bias = mine.bias;
  EXPECT_TRUE(Evaluate(beta.get(), p, options, 2).ok());
}

}  // namespace
}  // namespace lossd
