// Evaluate's post-training losses over data connections: frames carrying the
// teacher's rows, segment ids and the policy's inputs after the targets give
// the stream's result bit for bit over any number of connections, and a frame
// whose inputs are bad is refused as the stream's block is, leaving nothing.
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "client/client.h"
#include "common/data_wire.h"
#include "gtest/gtest.h"
#include "lossd/v1/lossd.grpc.pb.h"
#include "tests/e2e/bytes.h"
#include "tests/e2e/data_connection_fixture.h"

namespace lossd {
namespace data_connection_test {
namespace {

using e2e_test::Bytes;

constexpr int64_t kRows = 37;
constexpr int64_t kVocab = 29;
constexpr int64_t kHidden = 6;
constexpr int64_t kTopK = 4;
constexpr int64_t kBlockRows = 5;  // 8 blocks: uneven over 3 connections
constexpr int32_t kSegments = 9;   // the last one empty

// Every per-row input an evaluation may carry, for kRows rows.
struct Inputs {
  std::vector<float> logits;  // [kRows, kVocab]
  std::vector<float> hidden;  // [kRows, kHidden]
  std::vector<float> weight;  // [kVocab, kHidden]
  std::vector<int64_t> targets;
  std::vector<float> teacher;  // [kRows, kVocab]
  std::vector<int64_t> indices;
  std::vector<float> logprobs;  // [kRows, kTopK]
  std::vector<int32_t> segments;
  std::vector<float> advantages, sampling, reference;
};

Inputs MakeInputs() {
  std::mt19937 random(28);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  Inputs in;
  RandomRows rows = MakeRandomRows(kRows, kVocab, 6, random);
  in.logits = rows.logits;
  in.targets = rows.targets;
  for (int64_t i = 0; i < kRows * kHidden; ++i)
    in.hidden.push_back(normal(random));
  for (int64_t i = 0; i < kVocab * kHidden; ++i) {
    in.weight.push_back(0.5f * normal(random));
  }
  for (int64_t i = 0; i < kRows * kVocab; ++i)
    in.teacher.push_back(normal(random));
  std::vector<int64_t> order(static_cast<size_t>(kVocab));
  for (int64_t row = 0; row < kRows; ++row) {
    // k distinct classes, and their teacher logprobs (a tail stays).
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), random);
    const float* t = &in.teacher[static_cast<size_t>(row * kVocab)];
    double sum = 0.0;
    for (int64_t c = 0; c < kVocab; ++c) sum += std::exp(t[c]);
    for (int64_t j = 0; j < kTopK; ++j) {
      const int64_t c = order[static_cast<size_t>(j)];
      in.indices.push_back(c);
      in.logprobs.push_back(static_cast<float>(t[c] - std::log(sum)));
    }
    // Segments of 5 rows; the last one (8) has none.
    in.segments.push_back(static_cast<int32_t>(row / 5));
    in.advantages.push_back(normal(random));
    in.sampling.push_back(-1.0f - std::abs(normal(random)));
    in.reference.push_back(-1.0f - std::abs(normal(random)));
  }
  return in;
}

// Rows [first, first + count) of `values`, `width` of them a row.
template <typename T>
std::string RowsOf(const std::vector<T>& values, int64_t width, int64_t first,
                   int64_t count) {
  return std::string(
      reinterpret_cast<const char*>(values.data() + first * width),
      static_cast<size_t>(count * width) * sizeof(T));
}

// One kind of evaluation: its options and whether its blocks carry each
// input.
struct Kind {
  const char* name;
  EvaluateOptions options = {};
  bool hidden_states = false;
  bool targets = true;
  bool dense = false, top_k = false, segments = false, policy = false,
       reference = false;
};

SegmentOptions Segments(SegmentReduction reduction) {
  SegmentOptions segments;
  segments.count = kSegments;
  segments.reduction = reduction;
  return segments;
}

std::vector<Kind> Kinds(const std::string& weight) {
  std::vector<Kind> kinds;
  {
    Kind kind{"dense forward KL without targets"};
    DistillationOptions kd;
    kd.evaluate_teacher_dtype = DType::kFloat32;
    kd.temperature = 1.5f;
    kind.options.distillation = kd;
    kind.targets = false;
    kind.dense = true;
    kinds.push_back(kind);
  }
  {
    Kind kind{"top-k reverse KL with a tail bucket and segments"};
    DistillationOptions kd;
    kd.top_k = kTopK;
    kd.top_k_indices_dtype = DType::kInt64;
    kd.tail = TopKTail::kBucket;
    kd.alpha = 0.25f;
    kd.divergence = Divergence::kReverseKl;
    kind.options.distillation = kd;
    kind.options.segments = Segments(SegmentReduction::kNone);
    kind.top_k = kind.segments = true;
    kinds.push_back(kind);
  }
  {
    Kind kind{"cross entropy per segment, seq-mean-token-mean"};
    kind.options.segments = Segments(SegmentReduction::kSeqMeanTokenMean);
    kind.options.loss.z_loss_scale = 1e-3;
    kind.segments = true;
    kinds.push_back(kind);
  }
  {
    Kind kind{"PPO with reference logprobs"};
    PolicyGradientOptions pg;
    pg.loss = PolicyLossKind::kPpoClip;
    pg.epsilon_high = 0.28f;
    pg.kl_coef = 0.05f;
    pg.evaluate_reference_logprobs = true;
    kind.options.policy = pg;
    kind.policy = kind.reference = true;
    kinds.push_back(kind);
  }
  {
    Kind kind{"dense JSD over hidden states with segments"};
    DistillationOptions kd;
    kd.evaluate_teacher_dtype = DType::kFloat32;
    kd.alpha = 0.5f;
    kd.divergence = Divergence::kJsd;
    kd.beta = 0.3f;
    kind.options.distillation = kd;
    kind.options.segments = Segments(SegmentReduction::kSeqMeanTokenSum);
    kind.options.weight = weight;
    kind.hidden_states = kind.dense = kind.segments = true;
    kinds.push_back(kind);
  }
  return kinds;
}

// `kind` over `in` through `client`, kBlockRows rows a block.
absl::StatusOr<EvaluateResult> EvaluateKind(Client* client, const Kind& kind,
                                            const Inputs& in) {
  EvaluateOptions options = kind.options;
  options.total_rows = kRows;
  int64_t next = 0;
  return client->Evaluate(
      kind.hidden_states ? kHidden : kVocab, DType::kFloat32,
      kind.targets ? DType::kInt64 : DType::kInvalid, options,
      [&](RowBlock* block) -> absl::StatusOr<bool> {
        if (next >= kRows) return false;
        const int64_t n = std::min(kBlockRows, kRows - next);
        block->logits = kind.hidden_states ? RowsOf(in.hidden, kHidden, next, n)
                                           : RowsOf(in.logits, kVocab, next, n);
        if (kind.targets) block->targets = RowsOf(in.targets, 1, next, n);
        if (kind.dense)
          block->teacher_logits = RowsOf(in.teacher, kVocab, next, n);
        if (kind.top_k) {
          block->teacher_indices = RowsOf(in.indices, kTopK, next, n);
          block->teacher_logprobs = RowsOf(in.logprobs, kTopK, next, n);
        }
        if (kind.segments) block->segment_ids = RowsOf(in.segments, 1, next, n);
        if (kind.policy) {
          block->advantages = RowsOf(in.advantages, 1, next, n);
          block->sampling_logprobs = RowsOf(in.sampling, 1, next, n);
        }
        if (kind.reference) {
          block->reference_logprobs = RowsOf(in.reference, 1, next, n);
        }
        next += n;
        return true;
      });
}

// Every number of a result, to compare results bit for bit.
std::vector<double> Numbers(const EvaluateResult& r) {
  std::vector<double> numbers = {
      r.loss,
      r.z_loss,
      static_cast<double>(r.rows),
      static_cast<double>(r.valid_tokens),
      static_cast<double>(r.correct_tokens),
      static_cast<double>(r.nonfinite_rows),
      r.denominator,
      r.distillation_loss,
      static_cast<double>(r.policy_stats.clipped_tokens),
      r.policy_stats.ratio_sum,
      r.policy_stats.approx_kl_sum,
      r.policy_stats.kl_sum,
      r.policy_stats.entropy_sum};
  numbers.insert(numbers.end(), r.segment_loss.begin(), r.segment_loss.end());
  for (const int64_t tokens : r.segment_tokens) {
    numbers.push_back(static_cast<double>(tokens));
  }
  return numbers;
}

// Each kind over 1 and 3 data connections gives the stream's bits.
TEST_F(DataConnectionTest, PostTrainingEvaluateMatchesTheStream) {
  Start();
  const Inputs in = MakeInputs();
  absl::StatusOr<TensorInfo> weight =
      MakeClient(false)->Upload(DType::kFloat32, {kVocab, kHidden},
                                in.weight.data(), in.weight.size() * 4);
  ASSERT_TRUE(weight.ok()) << weight.status();
  for (const Kind& kind : Kinds(weight->handle)) {
    SCOPED_TRACE(kind.name);
    absl::StatusOr<EvaluateResult> streamed =
        EvaluateKind(MakeClient(false).get(), kind, in);
    ASSERT_TRUE(streamed.ok()) << streamed.status();
    EXPECT_EQ(streamed->rows, kRows);
    EXPECT_NE(streamed->loss, 0.0);
    if (kind.dense || kind.top_k) {
      EXPECT_GT(streamed->distillation_loss, 0.0);
    }
    if (kind.policy) {
      EXPECT_GT(streamed->policy_stats.ratio_sum, 0.0);
    }
    if (kind.segments) {
      ASSERT_EQ(streamed->segment_tokens.size(), size_t{kSegments});
      EXPECT_EQ(streamed->segment_tokens.back(), 0);
    }
    for (int connections : {1, 3}) {
      SCOPED_TRACE(connections);
      const int64_t before = Completed();
      absl::StatusOr<EvaluateResult> over =
          EvaluateKind(MakeClient(true, connections).get(), kind, in);
      ASSERT_TRUE(over.ok()) << over.status();
      EXPECT_EQ(Completed(), before + connections);
      EXPECT_EQ(Numbers(*over), Numbers(*streamed));
    }
  }
  ASSERT_TRUE(MakeClient(false)->Release(weight->handle).ok());
  ExpectEmptyStore();
}

// lossd::Client checks that every block carries what the options declare
// before it sends it: a frame cannot tell the server where a part ends.
TEST_F(DataConnectionTest, PostTrainingEvaluateClientChecksBlocks) {
  Start();
  const Inputs in = MakeInputs();
  Kind kind = Kinds("")[3];  // PPO with reference logprobs
  kind.reference = false;    // declared, but not sent
  absl::StatusOr<EvaluateResult> result =
      EvaluateKind(MakeClient(true, 2).get(), kind, in);
  EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument)
      << result.status();
  EXPECT_NE(result.status().message().find(
                "block 0: reference_logprobs has 0 bytes; 5 rows need 20"),
            std::string::npos)
      << result.status();
  ExpectEmptyStore();
}

// A post-training Evaluate header with a data token, and its frames sent by
// hand.
class RawPostTrainingEvaluate {
 public:
  RawPostTrainingEvaluate(pb::Lossd::Stub* stub, const std::string& token,
                          const std::function<void(pb::EvaluateHeader*)>& set,
                          int connections = 1) {
    writer_ = stub->Evaluate(&context_, &response_);
    pb::EvaluateRequest request;
    pb::EvaluateHeader* header = request.mutable_header();
    header->set_vocab(kVocab);
    header->set_logits_dtype(pb::DTYPE_FLOAT32);
    header->set_targets_dtype(pb::DTYPE_INT32);
    header->set_data_token(token);
    header->set_data_connections(connections);
    set(header);
    sent_ = writer_->Write(request) && writer_->WritesDone();
  }
  bool sent() const { return sent_; }
  grpc::Status Finish() { return writer_->Finish(); }
  const pb::EvaluateResponse& response() const { return response_; }

 private:
  grpc::ClientContext context_;
  pb::EvaluateResponse response_;
  std::unique_ptr<grpc::ClientWriter<pb::EvaluateRequest>> writer_;
  bool sent_ = false;
};

// A frame of `rows` rows: the row count, then `parts` as they are.
std::string FrameOf(int64_t rows, const std::vector<std::string>& parts) {
  char head[kFrameHeaderBytes];
  EncodeFrameRows(rows, head);
  std::string frame(head, kFrameHeaderBytes);
  for (const std::string& part : parts) frame += part;
  return frame;
}

// Frames whose post-training inputs are bad: INVALID_ARGUMENT as the stream's
// block, nothing retained.
TEST_F(DataConnectionTest, PostTrainingEvaluateFrameErrors) {
  Start(0, absl::Seconds(5));
  const std::string logits(2 * kVocab * 4, '\0');
  const std::string targets = Bytes(std::vector<int32_t>{1, 2});
  const std::string logprobs = Bytes(std::vector<float>(2 * 2, -1.0f));
  auto top_k = [](pb::EvaluateHeader* header) {
    header->mutable_distillation()->set_alpha(0.5f);
    header->set_teacher_top_k(2);
    header->set_teacher_indices_dtype(pb::DTYPE_INT32);
  };
  auto policy = [](pb::EvaluateHeader* header) {
    header->mutable_policy()->set_loss(pb::POLICY_LOSS_PPO_CLIP);
  };
  auto segments = [](pb::EvaluateHeader* header) {
    header->mutable_segments()->set_count(2);
  };
  const std::string fine = Bytes(std::vector<float>{0.5f, -0.5f});
  struct Case {
    const char* what;
    std::function<void(pb::EvaluateHeader*)> header;
    std::string sent;  // after the preamble
    const char* says;
  };
  const Case cases[] = {
      {"a frame ending inside its teacher part", top_k,
       FrameOf(2, {logits, targets, std::string(5, '\0')}),
       "ended after 245 of the 272 bytes of frame 0's rows (inside its "
       "teacher_indices)"},
      {"a teacher index out of range", top_k,
       FrameOf(2, {logits, targets, Bytes(std::vector<int32_t>{0, 1, 2, 29}),
                   logprobs}),
       "data connection 0, frame 0: post_training: top-k index [1, 1] = 29 is "
       "outside [0, 29)"},
      {"NaN advantages", policy,
       FrameOf(2, {logits, targets,
                   Bytes(std::vector<float>{
                       0.5f, std::numeric_limits<float>::quiet_NaN()}),
                   fine}),
       "policy advantages[1] = nan is not finite"},
      {"a segment id out of range", segments,
       FrameOf(2, {logits, targets, Bytes(std::vector<int32_t>{0, 2})}),
       "segment id [1] = 2 is outside [0, 2)"},
      {"more rows than 64 MiB hold, the teacher's bytes counted",
       [](pb::EvaluateHeader* header) {
         header->mutable_distillation();
         header->set_teacher_logits_dtype(pb::DTYPE_FLOAT32);
       },
       // A row: 29 * 4 of logits, 4 of target, 29 * 4 of teacher.
       FrameOf((int64_t{64} << 20) / 236 + 1, {}),
       "a frame holds 1 to 284359 rows (64 MiB)"},
  };
  char fill = 'a';
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    const std::string token = Token(fill++);
    RawPostTrainingEvaluate evaluate(stub_.get(), token, c.header);
    ASSERT_TRUE(evaluate.sent());
    const int fd = ConnectData();
    SendAll(fd, Preamble(token) + c.sent);  // the server may close it first
    shutdown(fd, SHUT_WR);
    const grpc::Status status = evaluate.Finish();
    close(fd);
    EXPECT_EQ(status.error_code(), StatusCode::INVALID_ARGUMENT)
        << status.error_message();
    EXPECT_NE(status.error_message().find(c.says), std::string::npos)
        << status.error_message();
  }
  ExpectEmptyStore();
  EXPECT_TRUE(AwaitRegistered(0, absl::Seconds(5)));
}

// Each connection's frame buffer, and its block buffers on the device (the
// logits and the dense teacher: about a frame more), count against the
// tenant's byte quota while the evaluation holds them: three connections at
// once, whose buffers together pass a quota that two fit, fail
// RESOURCE_EXHAUSTED and leave nothing charged; two then fit.
TEST_F(DataConnectionTest, PostTrainingFramesAreChargedToTheTenantsQuota) {
  // A row: 29 * 4 of logits, 4 of target, 29 * 4 of a dense teacher.
  constexpr int64_t kFrameRows = 1000;
  constexpr int64_t kFrameBytes = kFrameRows * 236;
  tenant_limits_.max_bytes = 5 * kFrameBytes;
  Start(0, absl::Seconds(5));
  const std::string frame =
      FrameOf(kFrameRows, {std::string(kFrameRows * kVocab * 4, '\0'),
                           std::string(kFrameRows * 4, '\0'),
                           std::string(kFrameRows * kVocab * 4, '\0')});
  auto dense = [](pb::EvaluateHeader* header) {
    header->mutable_distillation()->set_alpha(0.5f);
    header->set_teacher_logits_dtype(pb::DTYPE_FLOAT32);
  };
  char fill = 'q';
  for (int connections : {3, 2}) {
    SCOPED_TRACE(connections);
    const std::string token = Token(fill++);
    RawPostTrainingEvaluate evaluate(stub_.get(), token, dense, connections);
    ASSERT_TRUE(evaluate.sent());
    std::vector<int> fds;
    for (int i = 0; i < connections; ++i) fds.push_back(ConnectData());
    for (int i = 0; i < connections; ++i) {
      SendAll(fds[i], Preamble(token, i) + frame);  // (may be closed first)
      shutdown(fds[i], SHUT_WR);
    }
    const grpc::Status status = evaluate.Finish();
    for (int fd : fds) close(fd);
    if (connections == 3) {
      EXPECT_EQ(status.error_code(), StatusCode::RESOURCE_EXHAUSTED)
          << status.error_message();
      EXPECT_NE(status.error_message().find("byte quota exceeded"),
                std::string::npos)
          << status.error_message();
    } else {
      EXPECT_TRUE(status.ok()) << status.error_message();
      EXPECT_EQ(evaluate.response().rows(), 2 * kFrameRows);
    }
    ExpectEmptyStore();
    EXPECT_TRUE(AwaitRegistered(0, absl::Seconds(5)));
  }
}

}  // namespace
}  // namespace data_connection_test
}  // namespace lossd
