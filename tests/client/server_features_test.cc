// lossd::Client against servers that do not serve the post-training losses:
// one that lists no features (lossd --advertise_features=, as a server from
// before ServerInfo.features) is refused before anything is sent, and one that
// claims them but answers plain cross entropy is caught in its answer.
#include "common/server_features.h"

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "client/client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "lossd/v1/lossd.grpc.pb.h"
#include "tests/client/lossd_process.h"

namespace lossd {
namespace {

using ::lossd::client_test::LossdProcess;
using ::testing::Contains;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

constexpr int64_t kRows = 4;
constexpr int64_t kVocab = 6;

// The bytes a stored fp32 tensor of `values` holds.
std::vector<uint8_t> BytesOf(const std::vector<float>& values) {
  const auto* data = reinterpret_cast<const uint8_t*>(values.data());
  return std::vector<uint8_t>(data, data + values.size() * sizeof(float));
}

// A lossd started with `extra_args`, a client of it, and small inputs.
class ServerFeaturesTest : public ::testing::Test {
 protected:
  void Start(const std::vector<std::string>& extra_args,
             ClientOptions options = {}) {
    absl::StatusOr<std::unique_ptr<LossdProcess>> server =
        LossdProcess::Start(LOSSD_BINARY_PATH, extra_args);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    absl::StatusOr<std::unique_ptr<Client>> client =
        Client::Connect(server_->address(), options);
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = *std::move(client);
  }

  std::string Upload(const std::vector<float>& values,
                     std::vector<int64_t> shape) {
    absl::StatusOr<TensorInfo> info = client_->Upload(
        DType::kFloat32, shape, values.data(), values.size() * sizeof(float));
    EXPECT_TRUE(info.ok()) << info.status();
    return info.ok() ? info->handle : "";
  }

  std::vector<uint8_t> Contents(const std::string& handle) {
    absl::StatusOr<DownloadedTensor> got = client_->Download(handle);
    EXPECT_TRUE(got.ok()) << got.status();
    return got.ok() ? got->data : std::vector<uint8_t>();
  }

  // A top-k teacher (k = 2) and a PPO policy over kRows rows, inline.
  DistillationOptions TopKTeacher() {
    DistillationOptions distillation;
    distillation.top_k = 2;
    distillation.top_k_indices = LossInput::Inline(indices_);
    distillation.top_k_logprobs = LossInput::Inline(logprobs_);
    return distillation;
  }
  PolicyGradientOptions Policy() {
    PolicyGradientOptions policy;
    policy.advantages = LossInput::Inline(advantages_);
    policy.sampling_logprobs = LossInput::Inline(sampling_);
    return policy;
  }

  void ExpectRefused(const absl::Status& status, const char* call) {
    EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
    EXPECT_THAT(status.message(), HasSubstr(server_->address()));
    EXPECT_THAT(status.message(),
                HasSubstr("does not serve post-training losses"));
    EXPECT_THAT(status.message(), HasSubstr(call));
    EXPECT_THAT(status.message(), HasSubstr("Upgrade lossd"));
  }

  std::unique_ptr<LossdProcess> server_;
  std::unique_ptr<Client> client_;
  const std::vector<float> logits_ = {
      0.5f,   -1.0f, 2.0f, 0.0f, 1.5f,  -0.5f, 1.0f, 0.25f,
      -2.0f,  0.75f, 0.0f, 3.0f, -1.5f, 0.5f,  0.5f, 2.5f,
      -0.25f, 1.0f,  0.0f, 1.0f, -1.0f, 2.0f,  0.5f, -3.0f};
  const std::vector<int32_t> targets_ = {0, 5, 3, 1};
  const std::vector<int32_t> indices_ = {2, 4, 5, 0, 3, 1, 5, 2};
  const std::vector<float> logprobs_ = {-0.3f, -1.5f, -0.2f, -2.0f,
                                        -0.4f, -1.2f, -0.1f, -2.5f};
  const std::vector<float> advantages_ = {1.0f, -0.5f, 0.25f, 2.0f};
  const std::vector<float> sampling_ = {-1.0f, -2.0f, -1.5f, -0.5f};
  const std::vector<int32_t> ids_ = {0, 0, 1, 1};
  const Targets inline_targets_ =
      Targets::Inline(DType::kInt32, targets_.data(), kRows * 4);
};

TEST_F(ServerFeaturesTest, ServerInfoListsWhatTheBuildServes) {
  ASSERT_NO_FATAL_FAILURE(Start({}));
  absl::StatusOr<ServerInfo> info = client_->GetServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_THAT(info->features, Contains(kFeaturePostTraining));
  EXPECT_EQ(info->features.size(), std::size(kServedFeatures));
}

TEST_F(ServerFeaturesTest, OlderServerIsRefusedBeforeAnythingIsSent) {
  ClientOptions options;
  options.stripe_min_bytes = 1;  // a known-size Evaluate over data connections
  ASSERT_NO_FATAL_FAILURE(Start({"--advertise_features="}, options));
  absl::StatusOr<ServerInfo> info = client_->GetServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_THAT(info->features, IsEmpty());
  const std::string logits = Upload(logits_, {kRows, kVocab});
  const std::vector<float> identity = {1, 0, 0, 0, 0, 1, 0, 0,
                                       0, 0, 1, 0, 0, 0, 0, 1};
  const std::string hidden = Upload(identity, {kRows, kRows});
  std::vector<float> weight(kVocab * kRows);
  for (int64_t v = 0; v < kVocab; ++v) {
    for (int64_t r = 0; r < kRows; ++r) {
      weight[v * kRows + r] = logits_[r * kVocab + v];
    }
  }
  const std::string weight_handle = Upload(weight, {kVocab, kRows});

  // In place: a server that took the request would leave a gradient.
  ForwardOptions distill;
  distill.distillation = TopKTeacher();
  ExpectRefused(client_->Forward(logits, inline_targets_, distill).status(),
                "Forward");
  ForwardOptions logprob_only;
  logprob_only.token_logprob = true;
  ExpectRefused(
      client_->Forward(logits, inline_targets_, logprob_only).status(),
      "Forward");
  LinearForwardOptions linear;
  linear.policy = Policy();
  linear.mode = GradientMode::kInPlace;
  ExpectRefused(
      client_->LinearForward(hidden, weight_handle, inline_targets_, linear)
          .status(),
      "LinearForward");
  EXPECT_EQ(Contents(logits), BytesOf(logits_));
  EXPECT_EQ(Contents(hidden), BytesOf(identity));
  absl::StatusOr<ListResult> listed = client_->List();
  ASSERT_TRUE(listed.ok()) << listed.status();
  EXPECT_EQ(listed->tensors.size(), 3u);  // no gradient was made

  // Evaluate, on the stream and over data connections alike: the producer
  // is never asked for a block.
  for (bool data_connections : {false, true}) {
    EvaluateOptions evaluate;
    evaluate.segments = SegmentOptions();
    evaluate.segments->count = 2;
    evaluate.total_rows = data_connections ? kRows : -1;
    int produced = 0;
    absl::StatusOr<EvaluateResult> evaluated =
        client_->Evaluate(kVocab, DType::kFloat32, DType::kInt32, evaluate,
                          [&](RowBlock* /*block*/) -> absl::StatusOr<bool> {
                            ++produced;
                            return false;
                          });
    ExpectRefused(evaluated.status(), "Evaluate");
    EXPECT_EQ(produced, 0);
  }

  // Plain cross entropy needs no feature.
  ForwardOptions plain;
  plain.mode = GradientMode::kNone;
  EXPECT_TRUE(client_->Forward(logits, inline_targets_, plain).ok());
}

TEST_F(ServerFeaturesTest, CheckCanBeTurnedOff) {
  // A server built with the losses but before the list serves them.
  ClientOptions options;
  options.check_server_features = false;
  ASSERT_NO_FATAL_FAILURE(Start({"--advertise_features="}, options));
  const std::string logits = Upload(logits_, {kRows, kVocab});
  ForwardOptions forward;
  forward.mode = GradientMode::kNone;
  forward.policy = Policy();
  forward.segments = SegmentOptions();
  forward.segments->ids = LossInput::Inline(ids_);
  forward.segments->count = 2;
  absl::StatusOr<ForwardResult> result =
      client_->Forward(logits, inline_targets_, forward);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->segment_loss.size(), 2u);
}

TEST_F(ServerFeaturesTest, LossctlPrintsTheRefusal) {
  ASSERT_NO_FATAL_FAILURE(Start({"--advertise_features="}));
  auto lossctl = [&](std::vector<std::string> args) {
    args.insert(args.begin(),
                {LOSSCTL_BINARY_PATH, "--server=" + server_->address()});
    absl::StatusOr<client_test::CommandResult> result =
        client_test::RunCommand(args);
    EXPECT_TRUE(result.ok()) << result.status();
    return result.ok() ? *result : client_test::CommandResult();
  };
  client_test::CommandResult info = lossctl({"info"});
  EXPECT_EQ(info.exit_code, 0) << info.err;
  EXPECT_THAT(info.out, HasSubstr("\nfeatures \n"));

  const std::string logits = Upload(logits_, {kRows, kVocab});
  absl::StatusOr<TensorInfo> indices = client_->Upload(
      DType::kInt32, {kRows, 2}, indices_.data(), indices_.size() * 4);
  ASSERT_TRUE(indices.ok()) << indices.status();
  const std::string logprobs = Upload(logprobs_, {kRows, 2});
  client_test::CommandResult forward = lossctl(
      {"forward", logits, "none", "--teacher_indices=" + indices->handle,
       "--teacher_logprobs=" + logprobs});
  EXPECT_NE(forward.exit_code, 0);
  EXPECT_THAT(forward.err, HasSubstr("FAILED_PRECONDITION"));
  EXPECT_THAT(forward.err, HasSubstr("does not serve post-training losses"));
  EXPECT_EQ(Contents(logits), BytesOf(logits_));
}

TEST_F(ServerFeaturesTest, UnknownFeatureFlagIsRefused) {
  EXPECT_FALSE(
      LossdProcess::Start(LOSSD_BINARY_PATH, {"--advertise_features=warp"})
          .ok());
}

// A server that lists post_training yet answers as one from before it: plain
// cross entropy, no policy statistics, no segment sums.
class PlainCrossEntropyService final : public lossd::v1::Lossd::Service {
 public:
  grpc::Status GetServerInfo(grpc::ServerContext* /*context*/,
                             const lossd::v1::GetServerInfoRequest* /*request*/,
                             lossd::v1::ServerInfo* response) override {
    response->add_features(kFeaturePostTraining);
    return grpc::Status::OK;
  }
  grpc::Status Forward(grpc::ServerContext* /*context*/,
                       const lossd::v1::ForwardRequest* /*request*/,
                       lossd::v1::ForwardResponse* response) override {
    response->set_loss(1.0);
    return grpc::Status::OK;
  }
  grpc::Status Evaluate(grpc::ServerContext* /*context*/,
                        grpc::ServerReader<lossd::v1::EvaluateRequest>* reader,
                        lossd::v1::EvaluateResponse* response) override {
    lossd::v1::EvaluateRequest request;
    while (reader->Read(&request)) {
    }
    response->set_loss(1.0);
    return grpc::Status::OK;
  }
};

TEST(PlainAnswerTest, AnswerWithoutPostTrainingFieldsIsAnError) {
  PlainCrossEntropyService service;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(),
                           &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  absl::StatusOr<std::unique_ptr<Client>> client =
      Client::Connect("127.0.0.1:" + std::to_string(port));
  ASSERT_TRUE(client.ok()) << client.status();

  const std::vector<float> advantages = {1.0f}, sampling = {-1.0f};
  ForwardOptions policy;
  policy.policy = PolicyGradientOptions();
  policy.policy->advantages = LossInput::Inline(advantages);
  policy.policy->sampling_logprobs = LossInput::Inline(sampling);
  // Well-formed handles the fake never looks up.
  const std::string logits = std::string(8, '0') + "-" + std::string(32, '1');
  const std::string targets = std::string(8, '0') + "-" + std::string(32, '2');
  absl::Status status =
      (*client)->Forward(logits, Targets::Handle(targets), policy).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kUnimplemented) << status;
  EXPECT_THAT(status.message(), HasSubstr("no policy_stats"));

  EvaluateOptions segments;
  segments.segments = SegmentOptions();
  segments.segments->count = 3;
  bool sent = false;
  status = (*client)
               ->Evaluate(2, DType::kFloat32, DType::kInt32, segments,
                          [&](RowBlock* block) -> absl::StatusOr<bool> {
                            if (sent) return false;
                            sent = true;
                            block->logits.assign(8, '\0');
                            block->targets.assign(4, '\0');
                            block->segment_ids.assign(4, '\0');
                            return true;
                          })
               .status();
  EXPECT_EQ(status.code(), absl::StatusCode::kUnimplemented) << status;
  EXPECT_THAT(status.message(), HasSubstr("0 segment sums for 3 segments"));
  server->Shutdown();
}

}  // namespace
}  // namespace lossd
