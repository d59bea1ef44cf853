// lossd::Client::PostTrainingForward against a real lossd: each family gives
// the CPU backend's numbers on the same values; client-side errors come first.
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "client/client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/post_training_cpu.h"
#include "tests/client/lossd_process.h"

namespace lossd {
namespace {

using ::lossd::client_test::LossdProcess;
using ::testing::HasSubstr;

constexpr int64_t kRows = 6;
constexpr int64_t kVocab = 9;

class PostTrainingClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<LossdProcess>> server =
        LossdProcess::Start(LOSSD_BINARY_PATH);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    absl::StatusOr<std::unique_ptr<Client>> client =
        Client::Connect(server_->address(), ClientOptions());
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = *std::move(client);
    std::mt19937 rng(7);
    std::normal_distribution<float> normal(0.0f, 2.0f);
    logits_.resize(kRows * kVocab);
    teacher_.resize(kRows * kVocab);
    for (float& v : logits_) v = normal(rng);
    for (float& v : teacher_) v = normal(rng);
    targets_ = {0, 3, -100, 8, 2, 5};
  }

  std::string Upload(DType dtype, std::vector<int64_t> shape, const void* data,
                     size_t bytes) {
    absl::StatusOr<TensorInfo> info =
        client_->Upload(dtype, shape, data, bytes);
    EXPECT_TRUE(info.ok()) << info.status();
    return info.ok() ? info->handle : "";
  }

  std::vector<float> DownloadFloats(const std::string& handle) {
    absl::StatusOr<DownloadedTensor> tensor = client_->Download(handle);
    EXPECT_TRUE(tensor.ok()) << tensor.status();
    std::vector<float> out(tensor.ok() ? tensor->data.size() / 4 : 0);
    if (!out.empty())
      std::memcpy(out.data(), tensor->data.data(), out.size() * 4);
    return out;
  }

  // The CPU backend on the same values, out of place.
  PostTrainingResult Expected(PostTrainingArgs args, std::vector<float>* grad) {
    grad->assign(kRows * kVocab, 0.0f);
    args.base.rows = kRows;
    args.base.vocab = kVocab;
    args.base.row_stride = kVocab;
    args.base.logits = logits_.data();
    args.base.mode = GradientMode::kOutOfPlace;
    args.base.gradient = grad->data();
    PostTrainingResult result;
    EXPECT_TRUE(PostTrainingCpu(args, &result).ok());
    return result;
  }

  std::unique_ptr<LossdProcess> server_;
  std::unique_ptr<Client> client_;
  std::vector<float> logits_, teacher_;
  std::vector<int64_t> targets_;
};

TEST_F(PostTrainingClientTest, TopKDistillationInlineWithoutTargets) {
  const std::vector<int32_t> indices = {0, 1, 2, 3, 4, 5, 6, 7, 8, 0, 1, 2};
  const std::vector<float> logprobs = {-0.5f, -1.5f, -0.7f, -1.0f,
                                       -2.0f, -0.3f, -0.4f, -3.0f,
                                       -1.2f, -0.9f, -0.6f, -2.5f};
  const std::string logits = Upload(DType::kFloat32, {kRows, kVocab},
                                    logits_.data(), logits_.size() * 4);
  PostTrainingOptions options;
  options.forward.mode = GradientMode::kOutOfPlace;
  DistillationOptions kd;
  kd.top_k = 2;
  kd.top_k_indices =
      TensorInput::Inline(DType::kInt32, indices.data(), indices.size() * 4);
  kd.top_k_logprobs = TensorInput::Inline(DType::kFloat32, logprobs.data(),
                                          logprobs.size() * 4);
  kd.tail = TopKTail::kBucket;
  kd.temperature = 2.0f;
  kd.divergence = Divergence::kJsd;
  kd.beta = 0.25f;
  options.distillation = kd;
  absl::StatusOr<PostTrainingForwardResult> got =
      client_->PostTrainingForward(logits, Targets(), options);
  ASSERT_TRUE(got.ok()) << got.status();

  PostTrainingArgs args;
  DistillationArgs want_kd;
  want_kd.top_k = 2;
  want_kd.top_k_indices = indices.data();
  want_kd.top_k_indices_dtype = DType::kInt32;
  want_kd.top_k_logprobs = logprobs.data();
  want_kd.tail = TopKTail::kBucket;
  want_kd.temperature = 2.0f;
  want_kd.divergence = Divergence::kJsd;
  want_kd.beta = 0.25f;
  args.distillation = &want_kd;
  std::vector<float> grad;
  const PostTrainingResult want = Expected(args, &grad);
  EXPECT_DOUBLE_EQ(got->forward.loss, want.base.loss);
  EXPECT_DOUBLE_EQ(got->distillation_loss, want.distillation_loss);
  EXPECT_EQ(got->forward.valid_tokens, kRows);
  EXPECT_EQ(DownloadFloats(got->forward.gradient), grad);
}

TEST_F(PostTrainingClientTest, DenseTeacherPolicyAndSegmentsByHandle) {
  const std::string logits = Upload(DType::kFloat32, {kRows, kVocab},
                                    logits_.data(), logits_.size() * 4);
  const std::string teacher = Upload(DType::kFloat32, {kRows, kVocab},
                                     teacher_.data(), teacher_.size() * 4);
  const std::string targets =
      Upload(DType::kInt64, {kRows}, targets_.data(), targets_.size() * 8);
  const std::vector<int32_t> ids = {0, 0, 0, 2, 2, 2};
  const std::string ids_handle =
      Upload(DType::kInt32, {kRows}, ids.data(), ids.size() * 4);

  // A dense teacher with alpha, segments reduced per sequence, in place.
  PostTrainingOptions options;
  DistillationOptions kd;
  kd.teacher_logits = teacher;
  kd.alpha = 0.3f;
  kd.divergence = Divergence::kReverseKl;
  options.distillation = kd;
  SegmentOptions segments;
  segments.ids = TensorInput::Handle(ids_handle);
  segments.count = 3;
  segments.reduction = SegmentReduction::kSeqMeanTokenMean;
  options.segments = segments;
  absl::StatusOr<PostTrainingForwardResult> got =
      client_->PostTrainingForward(logits, Targets::Handle(targets), options);
  ASSERT_TRUE(got.ok()) << got.status();
  PostTrainingArgs args;
  args.base.targets = targets_.data();
  args.base.targets_dtype = DType::kInt64;
  DistillationArgs want_kd;
  want_kd.teacher_logits = teacher_.data();
  want_kd.teacher_dtype = DType::kFloat32;
  want_kd.teacher_row_stride = kVocab;
  want_kd.alpha = 0.3f;
  want_kd.divergence = Divergence::kReverseKl;
  args.distillation = &want_kd;
  SegmentArgs want_segments;
  want_segments.ids = ids.data();
  want_segments.count = 3;
  want_segments.reduction = SegmentReduction::kSeqMeanTokenMean;
  args.segments = &want_segments;
  std::vector<float> grad;
  const PostTrainingResult want = Expected(args, &grad);
  EXPECT_DOUBLE_EQ(got->forward.loss, want.base.loss);
  EXPECT_EQ(got->segment_tokens, (std::vector<int64_t>{2, 0, 3}));
  EXPECT_EQ(got->segment_loss, want.segment_loss);
  EXPECT_EQ(got->forward.gradient, logits);
  EXPECT_EQ(DownloadFloats(logits), grad);

  // PPO on fresh logits with advantages and sampling logprobs by handle.
  const std::string fresh = Upload(DType::kFloat32, {kRows, kVocab},
                                   logits_.data(), logits_.size() * 4);
  const std::vector<float> advantages = {1.0f, -0.5f, 2.0f, 0.25f, -1.0f, 0.5f};
  const std::vector<float> sampling = {-2.0f, -2.5f, -1.0f,
                                       -3.0f, -2.2f, -1.8f};
  PostTrainingOptions policy_options;
  policy_options.forward.mode = GradientMode::kNone;
  policy_options.token_logprob = true;
  PolicyOptions pg;
  pg.loss = PolicyLossKind::kPpoClip;
  pg.advantages = TensorInput::Handle(Upload(
      DType::kFloat32, {kRows}, advantages.data(), advantages.size() * 4));
  pg.sampling_logprobs = TensorInput::Handle(
      Upload(DType::kFloat32, {kRows}, sampling.data(), sampling.size() * 4));
  pg.epsilon_high = 0.28f;
  policy_options.policy = pg;
  got = client_->PostTrainingForward(fresh, Targets::Handle(targets),
                                     policy_options);
  ASSERT_TRUE(got.ok()) << got.status();
  PostTrainingArgs policy_args;
  policy_args.base.targets = targets_.data();
  policy_args.base.targets_dtype = DType::kInt64;
  PolicyArgs want_pg;
  want_pg.loss = PolicyLossKind::kPpoClip;
  want_pg.advantages = advantages.data();
  want_pg.sampling_logprobs = sampling.data();
  want_pg.epsilon_high = 0.28f;
  policy_args.policy = &want_pg;
  const PostTrainingResult want_policy = Expected(policy_args, &grad);
  EXPECT_DOUBLE_EQ(got->forward.loss, want_policy.base.loss);
  EXPECT_EQ(got->clipped_tokens, want_policy.policy.clipped_tokens);
  EXPECT_DOUBLE_EQ(got->ratio_sum, want_policy.policy.ratio_sum);
  EXPECT_EQ(got->token_logprob.size(), static_cast<size_t>(kRows));
  EXPECT_TRUE(got->forward.gradient.empty());
}

TEST_F(PostTrainingClientTest, ClientSideErrors) {
  PostTrainingOptions options;
  options.distillation = DistillationOptions();
  options.policy = PolicyOptions();
  absl::StatusOr<PostTrainingForwardResult> got =
      client_->PostTrainingForward("x", Targets(), options);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(got.status().message(), HasSubstr("cannot be combined"));
  options.distillation.reset();
  got = client_->PostTrainingForward("x", Targets(), options);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(got.status().message(),
              HasSubstr("policy advantages: neither a handle nor inline data"));
}

}  // namespace
}  // namespace lossd
