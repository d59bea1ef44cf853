// The device reduction of post-training records (post_training_reduce.h)
// against the host's (CollectPostTrainingCudaRows + ReducePostTrainingRows)
// on random records, its repeat bits, and a disabled bench of the host's
// reduction alone (no GPU needed).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/post_training_cuda_host.h"
#include "kernels/cuda/post_training_reduce.h"
#include "kernels/post_training_plan.h"

namespace lossd {
namespace {

bool HaveGpu() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

enum class Nonfinite { kNone, kNan, kInf };

// Random records as the kernels write them: ~1 in 5 rows ignored (flags 0,
// fields still set), correct and clipped flags on valid rows; `nonfinite`
// puts NaN or +inf into a few valid rows' losses. `targets` (host, int64)
// agree with the valid flags.
std::vector<PostTrainingCudaRow> RandomRecords(int64_t rows,
                                               Nonfinite nonfinite,
                                               uint32_t seed,
                                               std::vector<int64_t>* targets) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> normal(0.0, 2.0);
  std::uniform_int_distribution<int> die(0, 9);
  std::vector<PostTrainingCudaRow> records(rows);
  targets->assign(rows, 0);
  for (int64_t row = 0; row < rows; ++row) {
    PostTrainingCudaRow& r = records[row];
    r.loss = std::abs(normal(rng));
    r.distillation = std::abs(normal(rng));
    r.ratio = std::exp(0.1 * normal(rng));
    r.approx_kl = 0.01 * normal(rng);
    r.kl = 0.01 * std::abs(normal(rng));
    r.entropy = std::abs(normal(rng));
    r.lse = static_cast<float>(normal(rng));
    r.logprob = static_cast<float>(-std::abs(normal(rng)));
    r.argmax = static_cast<int>(rng() % 1000);
    r.z_loss = 1e-4 * r.lse * r.lse;
    const bool valid = rows == 1 || die(rng) < 8;
    r.flags = 0;
    if (valid) {
      r.flags = kPostTrainingRowValid;
      if (die(rng) < 3) r.flags |= kPostTrainingRowCorrect;
      if (die(rng) < 2) r.flags |= kPostTrainingRowClipped;
      if (nonfinite != Nonfinite::kNone &&
          (row == rows / 2 || (row % 97 == 0 && die(rng) == 0))) {
        r.loss = nonfinite == Nonfinite::kNan
                     ? std::numeric_limits<double>::quiet_NaN()
                     : std::numeric_limits<double>::infinity();
      }
    } else {
      (*targets)[row] = -100;
    }
  }
  return records;
}

// The host's answer and the per-token outputs, all asked for.
struct Tokens {
  std::vector<float> loss, lse, logprob, entropy, ratio;
  std::vector<int32_t> argmax;
  std::vector<uint8_t> clipped;
  explicit Tokens(int64_t rows)
      : loss(rows),
        lse(rows),
        logprob(rows),
        entropy(rows),
        ratio(rows),
        argmax(rows),
        clipped(rows) {}
};

PostTrainingArgs HostArgs(const std::vector<int64_t>& targets, bool policy,
                          const PolicyArgs* pg, Reduction reduction,
                          double normalizer, Tokens* tokens) {
  PostTrainingArgs args;
  args.base.rows = static_cast<int64_t>(targets.size());
  args.base.targets = targets.data();
  args.base.targets_dtype = DType::kInt64;
  args.base.options.ignore_index = -100;
  args.base.options.reduction = reduction;
  args.base.options.normalizer = normalizer;
  // (the records carry a z-loss: the host collects it only where it is on)
  args.base.options.z_loss_scale = 1e-4f;
  args.base.token_loss = tokens->loss.data();
  args.base.token_lse = tokens->lse.data();
  args.base.token_argmax = tokens->argmax.data();
  args.token_logprob = tokens->logprob.data();
  args.token_entropy = tokens->entropy.data();
  args.token_ratio = tokens->ratio.data();
  args.token_clipped = tokens->clipped.data();
  if (policy) args.policy = pg;
  return args;
}

// Device copies of `records` and room for the sums and every token output.
class DeviceReduction {
 public:
  explicit DeviceReduction(const std::vector<PostTrainingCudaRow>& records)
      : rows_(static_cast<int64_t>(records.size())) {
    const size_t n = records.size();
    EXPECT_EQ(cudaMalloc(reinterpret_cast<void**>(&records_),
                         n * sizeof(PostTrainingCudaRow)),
              cudaSuccess);
    EXPECT_EQ(
        cudaMemcpy(records_, records.data(), n * sizeof(PostTrainingCudaRow),
                   cudaMemcpyHostToDevice),
        cudaSuccess);
    EXPECT_EQ(
        cudaMalloc(reinterpret_cast<void**>(&sums_), sizeof(PostTrainingSums)),
        cudaSuccess);
    EXPECT_EQ(cudaMalloc(&tokens_, n * 32), cudaSuccess);
  }
  ~DeviceReduction() {
    cudaFree(records_);
    cudaFree(sums_);
    cudaFree(tokens_);
  }
  DeviceReduction(const DeviceReduction&) = delete;
  DeviceReduction& operator=(const DeviceReduction&) = delete;

  PostTrainingSums Sums(bool policy, bool z_loss) {
    EXPECT_EQ(
        LaunchPostTrainingReduce(records_, rows_, policy, z_loss, sums_, 0),
        cudaSuccess);
    PostTrainingSums out;
    EXPECT_EQ(cudaMemcpy(&out, sums_, sizeof(out), cudaMemcpyDeviceToHost),
              cudaSuccess);
    return out;
  }

  // The device's token outputs into `out`.
  void Gather(bool policy, Tokens* out) {
    const size_t n = static_cast<size_t>(rows_);
    char* base = static_cast<char*>(tokens_);
    PostTrainingCudaTokens t;
    t.loss = reinterpret_cast<float*>(base);
    t.lse = reinterpret_cast<float*>(base + 4 * n);
    t.argmax = reinterpret_cast<int32_t*>(base + 8 * n);
    t.logprob = reinterpret_cast<float*>(base + 12 * n);
    t.entropy = reinterpret_cast<float*>(base + 16 * n);
    t.ratio = reinterpret_cast<float*>(base + 20 * n);
    t.clipped = reinterpret_cast<uint8_t*>(base + 24 * n);
    ASSERT_EQ(LaunchPostTrainingTokens(records_, rows_, policy, t, 0),
              cudaSuccess);
    const auto read = [](void* host, const void* device, size_t bytes) {
      EXPECT_EQ(cudaMemcpy(host, device, bytes, cudaMemcpyDeviceToHost),
                cudaSuccess);
    };
    read(out->loss.data(), t.loss, 4 * n);
    read(out->lse.data(), t.lse, 4 * n);
    read(out->argmax.data(), t.argmax, 4 * n);
    read(out->logprob.data(), t.logprob, 4 * n);
    read(out->entropy.data(), t.entropy, 4 * n);
    read(out->ratio.data(), t.ratio, 4 * n);
    read(out->clipped.data(), t.clipped, n);
  }

 private:
  int64_t rows_;
  PostTrainingCudaRow* records_ = nullptr;
  PostTrainingSums* sums_ = nullptr;
  void* tokens_ = nullptr;
};

// The same value up to the summation order: NaN for NaN, inf for inf.
void ExpectSame(double host, double device, const char* what) {
  if (std::isnan(host)) {
    EXPECT_TRUE(std::isnan(device)) << what << ": " << device;
  } else if (std::isinf(host)) {
    EXPECT_EQ(host, device) << what;
  } else {
    EXPECT_NEAR(device, host, 1e-11 * (1.0 + std::abs(host))) << what;
  }
}

class PostTrainingReduceCudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!HaveGpu()) GTEST_SKIP() << "no CUDA GPU visible";
  }
};

TEST_F(PostTrainingReduceCudaTest, MatchesTheHostReduction) {
  PolicyArgs pg;
  for (int64_t rows : {int64_t{1}, int64_t{7}, int64_t{16384 + 3}}) {
    for (Nonfinite nonfinite :
         {Nonfinite::kNone, Nonfinite::kNan, Nonfinite::kInf}) {
      std::vector<int64_t> targets;
      const std::vector<PostTrainingCudaRow> records = RandomRecords(
          rows, nonfinite,
          static_cast<uint32_t>(rows) + 3u * static_cast<uint32_t>(nonfinite),
          &targets);
      DeviceReduction device(records);
      for (bool policy : {false, true}) {
        for (const auto& [reduction, normalizer] :
             {std::pair<Reduction, double>{Reduction::kMean, 0.0},
              {Reduction::kMean, 4096.0},
              {Reduction::kSum, 0.0}}) {
          SCOPED_TRACE(testing::Message()
                       << "rows " << rows << " nonfinite "
                       << static_cast<int>(nonfinite) << " policy " << policy
                       << " reduction " << static_cast<int>(reduction)
                       << " normalizer " << normalizer);
          Tokens host_tokens(rows), device_tokens(rows);
          const PostTrainingArgs args = HostArgs(
              targets, policy, &pg, reduction, normalizer, &host_tokens);
          std::vector<PostTrainingRowTotals> totals(rows);
          CollectPostTrainingCudaRows(args, records.data(), totals.data());
          const PostTrainingResult want =
              ReducePostTrainingRows(args, PlanPostTraining(args), totals);
          const PostTrainingResult got = FinishUnsegmentedPostTraining(
              args.base.options, device.Sums(policy, true));
          EXPECT_EQ(got.base.valid_tokens, want.base.valid_tokens);
          EXPECT_EQ(got.base.nonfinite_rows, want.base.nonfinite_rows);
          EXPECT_EQ(got.base.correct_tokens, want.base.correct_tokens);
          EXPECT_EQ(got.policy.clipped_tokens, want.policy.clipped_tokens);
          EXPECT_EQ(got.base.denominator, want.base.denominator);
          ExpectSame(want.base.loss, got.base.loss, "loss");
          ExpectSame(want.distillation_loss, got.distillation_loss,
                     "distillation");
          ExpectSame(want.base.z_loss, got.base.z_loss, "z_loss");
          ExpectSame(want.policy.ratio_sum, got.policy.ratio_sum, "ratio");
          ExpectSame(want.policy.approx_kl_sum, got.policy.approx_kl_sum,
                     "approx_kl");
          ExpectSame(want.policy.kl_sum, got.policy.kl_sum, "kl");
          ExpectSame(want.policy.entropy_sum, got.policy.entropy_sum,
                     "entropy");
          EXPECT_TRUE(got.segment_loss.empty());
          // (the fast schedule's records: no z-loss summed)
          EXPECT_EQ(device.Sums(policy, false).z_loss, 0.0);

          device.Gather(policy, &device_tokens);
          const auto same_bits = [](const auto& a, const auto& b) {
            return a.size() == b.size() &&
                   std::memcmp(a.data(), b.data(), a.size() * sizeof(a[0])) ==
                       0;
          };
          EXPECT_TRUE(same_bits(host_tokens.loss, device_tokens.loss));
          EXPECT_TRUE(same_bits(host_tokens.lse, device_tokens.lse));
          EXPECT_TRUE(same_bits(host_tokens.argmax, device_tokens.argmax));
          EXPECT_TRUE(same_bits(host_tokens.logprob, device_tokens.logprob));
          EXPECT_TRUE(same_bits(host_tokens.entropy, device_tokens.entropy));
          EXPECT_TRUE(same_bits(host_tokens.ratio, device_tokens.ratio));
          EXPECT_TRUE(same_bits(host_tokens.clipped, device_tokens.clipped));
        }
      }
    }
  }
}

TEST_F(PostTrainingReduceCudaTest, GivesTheSameBitsEveryRun) {
  std::vector<int64_t> targets;
  const std::vector<PostTrainingCudaRow> records =
      RandomRecords(16384 + 3, Nonfinite::kNone, 5, &targets);
  DeviceReduction device(records);
  const PostTrainingSums first = device.Sums(true, true);
  for (int run = 0; run < 3; ++run) {
    const PostTrainingSums again = device.Sums(true, true);
    EXPECT_EQ(std::memcmp(&first, &again, sizeof(first)), 0) << "run " << run;
  }
}

TEST_F(PostTrainingReduceCudaTest, RefusesNoRows) {
  EXPECT_EQ(LaunchPostTrainingReduce(nullptr, 0, false, false, nullptr, 0),
            cudaErrorInvalidValue);
  PostTrainingCudaTokens none;
  EXPECT_EQ(LaunchPostTrainingTokens(nullptr, 5, false, none, 0), cudaSuccess);
}

// The host's end of a call on the records' path at the two large shapes (a
// policy loss, every per-token output asked for, and none): the collection,
// the plan from host targets and the row-order reduction, each the median of
// 21 runs. No GPU needed. Run with --gtest_also_run_disabled_tests
// --gtest_filter=*Bench*.
TEST(PostTrainingReduceHostBench, DISABLED_BenchHostReduction) {
  PolicyArgs pg;
  for (int64_t rows : {int64_t{8192}, int64_t{16384}}) {
    std::vector<int64_t> targets;
    const std::vector<PostTrainingCudaRow> records =
        RandomRecords(rows, Nonfinite::kNone, 11, &targets);
    for (bool tokens_asked : {true, false}) {
      Tokens tokens(rows);
      PostTrainingArgs args =
          HostArgs(targets, true, &pg, Reduction::kMean, 0.0, &tokens);
      if (!tokens_asked) {
        args.base.token_loss = args.base.token_lse = nullptr;
        args.base.token_argmax = nullptr;
        args.token_logprob = args.token_entropy = args.token_ratio = nullptr;
        args.token_clipped = nullptr;
      }
      std::vector<PostTrainingRowTotals> totals(rows);
      PostTrainingPlan plan;
      PostTrainingResult result;
      double collect[21], planned[21], reduced[21];
      for (int run = 0; run < 21; ++run) {
        const auto t0 = std::chrono::steady_clock::now();
        CollectPostTrainingCudaRows(args, records.data(), totals.data());
        const auto t1 = std::chrono::steady_clock::now();
        plan = PlanPostTraining(args);
        const auto t2 = std::chrono::steady_clock::now();
        result = ReducePostTrainingRows(args, plan, totals);
        const auto t3 = std::chrono::steady_clock::now();
        collect[run] = std::chrono::duration<double>(t1 - t0).count();
        planned[run] = std::chrono::duration<double>(t2 - t1).count();
        reduced[run] = std::chrono::duration<double>(t3 - t2).count();
      }
      const auto median = [](double* t) {
        std::sort(t, t + 21);
        return t[10] * 1e3;
      };
      const double c = median(collect), p = median(planned),
                   r = median(reduced);
      std::printf(
          "bench: host reduction %lld rows, per-token outputs %s: collect "
          "%.3f ms, plan %.3f ms, reduce %.3f ms, total %.3f ms (loss %g)\n",
          static_cast<long long>(rows), tokens_asked ? "all" : "none", c, p, r,
          c + p + r, result.base.loss);
    }
  }
}

}  // namespace
}  // namespace lossd
