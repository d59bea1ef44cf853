// Evaluate over data connections: the blocks' frames over plain TCP give the
// stream's result, lossd::Client checks the blocks it sends, and every way a
// frame, a connection or the stream can go wrong is a clear error that leaves
// nothing behind.
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/time.h"
#include "client/client.h"
#include "client/data_connection.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "lossd/v1/lossd.grpc.pb.h"
#include "server/server.h"
#include "tests/e2e/data_connection_fixture.h"
#include "tests/e2e/test_server.h"

namespace lossd {
namespace data_connection_test {
namespace {

TEST_F(DataConnectionTest, EvaluateMatchesTheStream) {
  Start();
  const int64_t rows = 53, vocab = 2053;
  std::mt19937 random(11);
  RandomRows data = MakeRandomRows(rows, vocab, 7, random);
  std::vector<float>& logits = data.logits;
  std::vector<int64_t>& targets = data.targets;
  std::vector<float> weights(static_cast<size_t>(vocab));
  std::uniform_real_distribution<float> uniform(0.3f, 3.0f);
  for (float& w : weights) w = uniform(random);
  absl::StatusOr<TensorInfo> weights_handle = MakeClient(false)->Upload(
      DType::kFloat32, {vocab}, weights.data(), weights.size() * sizeof(float));
  ASSERT_TRUE(weights_handle.ok()) << weights_handle.status();
  EvaluateOptions options;
  options.loss.label_smoothing = 0.1;
  options.loss.z_loss_scale = 1e-4;
  options.class_weights = weights_handle->handle;
  auto evaluate = [&](Client* client) {
    absl::StatusOr<EvaluateResult> result = client->Evaluate(
        rows, vocab, DType::kFloat32, logits.data(), DType::kInt64,
        targets.data(), options, /*block_rows=*/5);
    EXPECT_TRUE(result.ok()) << result.status();
    return result.ok() ? *result : EvaluateResult{};
  };
  const EvaluateResult streamed = evaluate(MakeClient(false).get());
  EXPECT_EQ(streamed.rows, rows);
  {
    SCOPED_TRACE("1 connection");
    const int64_t before = Completed();
    const EvaluateResult one = evaluate(MakeClient(true, 1).get());
    EXPECT_EQ(Completed(), before + 1);
    EXPECT_EQ(one.loss, streamed.loss);
    EXPECT_EQ(one.z_loss, streamed.z_loss);
    EXPECT_EQ(one.valid_tokens, streamed.valid_tokens);
    EXPECT_EQ(one.correct_tokens, streamed.correct_tokens);
    EXPECT_EQ(one.denominator, streamed.denominator);
  }
  {
    SCOPED_TRACE("3 connections");
    std::unique_ptr<Client> client = MakeClient(true, 3);
    const int64_t before = Completed();
    const EvaluateResult first = evaluate(client.get());
    const EvaluateResult second = evaluate(client.get());
    EXPECT_EQ(Completed(), before + 6);
    EXPECT_EQ(first.loss, second.loss);
    EXPECT_EQ(first.z_loss, second.z_loss);
    EXPECT_EQ(first.loss, streamed.loss);
    EXPECT_EQ(first.z_loss, streamed.z_loss);
    EXPECT_EQ(first.rows, rows);
    EXPECT_EQ(first.valid_tokens, streamed.valid_tokens);
    EXPECT_EQ(first.correct_tokens, streamed.correct_tokens);
    EXPECT_EQ(first.denominator, streamed.denominator);
  }
  ASSERT_TRUE(MakeClient(false)->Release(weights_handle->handle).ok());
  ExpectEmptyStore();
}

// lossd::Client frames only whole rows: an empty block is skipped (as the
// stream would evaluate nothing for it), a block of partial rows is refused
// before it is sent.
TEST_F(DataConnectionTest, EvaluateClientChecksBlocks) {
  Start();
  std::unique_ptr<Client> client = MakeClient(true, 2);
  const int64_t vocab = 8;
  // Rows the producer keeps and points its blocks at.
  const std::string kept_logits(3 * vocab * 4, '\0');
  const std::string kept_targets(3 * 8, '\0');
  int produced = 0;
  auto blocks = [&](bool partial) {
    produced = 0;
    return [&, partial](RowBlock* block) -> absl::StatusOr<bool> {
      switch (produced++) {
        case 0:  // empty
          return true;
        case 1:
          block->logits.assign(3 * vocab * 4, '\0');
          block->targets.assign(3 * 8, '\0');
          return true;
        case 2:  // views of the kept rows
          block->logits_view = kept_logits;
          block->targets_view = kept_targets;
          return true;
        case 3:
          if (!partial) return false;
          block->logits_view =
              absl::string_view(kept_logits.data(), vocab * 4 + 1);
          block->targets_view = absl::string_view(kept_targets.data(), 8);
          return true;
        default:
          return false;
      }
    };
  };
  // A known size: the blocks go over the data connections.
  EvaluateOptions known;
  known.total_rows = 6;
  const int64_t before = Completed();
  absl::StatusOr<EvaluateResult> whole = client->Evaluate(
      vocab, DType::kFloat32, DType::kInt64, known, blocks(false));
  ASSERT_TRUE(whole.ok()) << whole.status();
  EXPECT_EQ(Completed(), before + 2);
  EXPECT_EQ(whole->rows, 6);
  EXPECT_NEAR(whole->loss, std::log(8.0), 1e-6);
  known.total_rows = 7;
  absl::StatusOr<EvaluateResult> partial = client->Evaluate(
      vocab, DType::kFloat32, DType::kInt64, known, blocks(true));
  EXPECT_EQ(partial.status().code(), absl::StatusCode::kInvalidArgument)
      << partial.status();
  EXPECT_NE(partial.status().message().find("block 3"), std::string::npos)
      << partial.status();
  // An unknown size: the same blocks on the stream.
  absl::StatusOr<EvaluateResult> streamed = client->Evaluate(
      vocab, DType::kFloat32, DType::kInt64, EvaluateOptions(), blocks(false));
  ASSERT_TRUE(streamed.ok()) << streamed.status();
  EXPECT_EQ(streamed->rows, 6);
  EXPECT_EQ(streamed->loss, whole->loss);
}

// An Evaluate stream driven by hand: a header with a data token.
class RawDataEvaluate {
 public:
  RawDataEvaluate(pb::Lossd::Stub* stub, const std::string& token,
                  int connections, int64_t vocab) {
    writer_ = stub->Evaluate(&context_, &response_);
    pb::EvaluateHeader* header = request_.mutable_header();
    header->set_vocab(vocab);
    header->set_logits_dtype(pb::DTYPE_FLOAT32);
    header->set_targets_dtype(pb::DTYPE_INT64);
    header->set_data_token(token);
    header->set_data_connections(connections);
  }
  grpc::ClientContext* context() { return &context_; }
  bool SendHeader(bool writes_done = true) {
    return writer_->Write(request_) && (!writes_done || writer_->WritesDone());
  }
  bool SendBlock() {
    pb::EvaluateRequest block;
    block.mutable_block()->set_logits(std::string(8, '\0'));
    block.mutable_block()->set_targets(std::string(8, '\0'));
    return writer_->Write(block);
  }
  grpc::Status Finish() { return writer_->Finish(); }

 private:
  grpc::ClientContext context_;
  pb::EvaluateResponse response_;
  pb::EvaluateRequest request_;
  std::unique_ptr<grpc::ClientWriter<pb::EvaluateRequest>> writer_;
};

// A frame of `rows` rows of `vocab` fp32 zeros and int64 targets 0, cut to
// `keep` bytes (all when negative).
std::string Frame(int64_t rows, int64_t vocab, int64_t keep = -1) {
  std::string frame(8, '\0');
  for (int i = 0; i < 8; ++i) {
    frame[static_cast<size_t>(i)] =
        static_cast<char>((static_cast<uint64_t>(rows) >> (8 * i)) & 0xff);
  }
  int64_t payload = std::max<int64_t>(0, rows) * (vocab * 4 + 8);
  if (keep >= 0) payload = std::min(payload, std::max<int64_t>(0, keep - 8));
  frame.append(static_cast<size_t>(payload), '\0');
  if (keep >= 0 && keep < 8) frame.resize(static_cast<size_t>(keep));
  return frame;
}

// What can go wrong with an Evaluate over data connections, each a clear
// error that leaves nothing behind.
TEST_F(DataConnectionTest, EvaluateErrors) {
  Start(0, absl::Seconds(2));
  constexpr int64_t kVocab = 16;
  struct Case {
    const char* what;
    std::string sent;  // after the preamble
    StatusCode code;
    const char* says;
  };
  const Case cases[] = {
      {"a frame of 0 rows", Frame(0, kVocab), StatusCode::INVALID_ARGUMENT,
       "0 rows"},
      {"an absurd row count", Frame(int64_t{1} << 40, kVocab, 8),
       StatusCode::INVALID_ARGUMENT, "a frame holds"},
      {"a connection ending inside a frame", Frame(2, kVocab, 20),
       StatusCode::INVALID_ARGUMENT, "ended after 12 of the"},
      {"a connection ending inside a row count", Frame(2, kVocab, 3),
       StatusCode::INVALID_ARGUMENT, "row count"},
      {"no frames at all", "", StatusCode::INVALID_ARGUMENT, "no rows"},
  };
  char fill = 'A';
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    const std::string token = Token(fill++);
    RawDataEvaluate evaluate(stub_.get(), token, 1, kVocab);
    ASSERT_TRUE(evaluate.SendHeader());
    const int fd = ConnectData();
    ASSERT_TRUE(SendAll(fd, Preamble(token) + c.sent));
    shutdown(fd, SHUT_WR);
    const grpc::Status status = evaluate.Finish();
    close(fd);
    EXPECT_EQ(status.error_code(), c.code) << status.error_message();
    EXPECT_NE(status.error_message().find(c.says), std::string::npos)
        << status.error_message();
  }
  {
    SCOPED_TRACE("a block on the stream too");
    RawDataEvaluate evaluate(stub_.get(), Token('x'), 1, 1);
    ASSERT_TRUE(evaluate.SendHeader(/*writes_done=*/false));
    evaluate.SendBlock();
    const grpc::Status status = evaluate.Finish();
    EXPECT_EQ(status.error_code(), StatusCode::INVALID_ARGUMENT)
        << status.error_message();
  }
  {
    SCOPED_TRACE("cancelled while the connections run");
    RawDataEvaluate evaluate(stub_.get(), Token('y'), 2, kVocab);
    ASSERT_TRUE(evaluate.SendHeader());
    const int fd = ConnectData();
    ASSERT_TRUE(SendAll(fd, Preamble(Token('y')) + Frame(3, kVocab)));
    evaluate.context()->TryCancel();
    EXPECT_EQ(evaluate.Finish().error_code(), StatusCode::CANCELLED);
    close(fd);
  }
  {
    SCOPED_TRACE("a connection that never comes");
    RawDataEvaluate evaluate(stub_.get(), Token('z'), 2, kVocab);
    ASSERT_TRUE(evaluate.SendHeader());
    const int fd = ConnectData();
    ASSERT_TRUE(SendAll(fd, Preamble(Token('z')) + Frame(3, kVocab)));
    shutdown(fd, SHUT_WR);
    EXPECT_EQ(evaluate.Finish().error_code(), StatusCode::DEADLINE_EXCEEDED);
    close(fd);
  }
  ExpectEmptyStore();
  EXPECT_TRUE(AwaitRegistered(0, absl::Seconds(5)));
}

// Eight rows of 65536 fp32 zeros (2 MiB), targets 0, that `client`
// evaluates in blocks of `block_rows` rows.
struct ZeroRows {
  static constexpr int64_t kRows = 8, kVocab = 65536;
  std::vector<float> logits = std::vector<float>(kRows * kVocab, 0.0f);
  std::vector<int64_t> targets = std::vector<int64_t>(kRows, 0);
  absl::StatusOr<EvaluateResult> Evaluate(Client* client,
                                          int64_t block_rows) const {
    return client->Evaluate(kRows, kVocab, DType::kFloat32, logits.data(),
                            DType::kInt64, targets.data(), EvaluateOptions(),
                            block_rows);
  }
};

// `result` is RESOURCE_EXHAUSTED and its message holds `says`.
void ExpectExhausted(const absl::StatusOr<EvaluateResult>& result,
                     const char* says) {
  EXPECT_EQ(result.status().code(), absl::StatusCode::kResourceExhausted)
      << result.status();
  EXPECT_NE(result.status().message().find(says), std::string::npos)
      << result.status();
}

const char* Way(bool data_connection) {
  return data_connection ? "over data connections" : "on the stream";
}

// An Evaluate's block buffers on the device count against the memory budget
// while it runs: blocks larger than the budget leaves are RESOURCE_EXHAUSTED,
// over data connections and on the stream, and leave nothing behind.
TEST_F(DataConnectionTest, EvaluateBlocksCountAgainstTheBudget) {
  Start(0, absl::Seconds(30), absl::Seconds(10), "cpu", /*budget=*/1 << 20);
  const ZeroRows zeros;
  for (bool data_connection : {true, false}) {
    SCOPED_TRACE(Way(data_connection));
    ExpectExhausted(zeros.Evaluate(MakeClient(data_connection).get(), 8),
                    "memory budget");
  }
  // Blocks that fit it are evaluated.
  absl::StatusOr<EvaluateResult> small = zeros.Evaluate(MakeClient().get(), 1);
  ASSERT_TRUE(small.ok()) << small.status();
  EXPECT_EQ(small->rows, ZeroRows::kRows);
  ExpectEmptyStore();
}

// An Evaluate's block buffers on the device, and on the stream each message
// while it is evaluated, count against the tenant's byte quota: blocks
// larger than the quota leaves are RESOURCE_EXHAUSTED naming the quota, over
// data connections and on the stream, and every charge goes back.
TEST_F(DataConnectionTest, EvaluateBlocksCountAgainstTheTenantsQuota) {
  tenant_limits_.max_bytes = 1 << 20;
  Start();
  const ZeroRows zeros;
  const auto quota_returned = [this] {
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (server_->quotas()->UsageOf(kDefaultTenant).bytes != 0) {
      if (absl::Now() >= deadline) return false;
      absl::SleepFor(absl::Milliseconds(5));
    }
    return true;
  };
  for (bool data_connection : {true, false}) {
    SCOPED_TRACE(Way(data_connection));
    ExpectExhausted(zeros.Evaluate(MakeClient(data_connection).get(), 8),
                    "byte quota exceeded");
    EXPECT_TRUE(quota_returned());
  }
  // Blocks of 768 KiB fit it over one data connection (received straight
  // into the block buffer), not on the stream (the message counts too).
  for (bool data_connection : {true, false}) {
    SCOPED_TRACE(Way(data_connection));
    absl::StatusOr<EvaluateResult> result =
        zeros.Evaluate(MakeClient(data_connection, /*streams=*/1).get(), 3);
    if (data_connection) {
      EXPECT_TRUE(result.ok()) << result.status();
    } else {
      ExpectExhausted(result, "byte quota exceeded");
    }
    EXPECT_TRUE(quota_returned());
  }
  // Blocks of 256 KiB fit it both ways.
  for (bool data_connection : {true, false}) {
    SCOPED_TRACE(Way(data_connection));
    absl::StatusOr<EvaluateResult> small =
        zeros.Evaluate(MakeClient(data_connection).get(), 1);
    ASSERT_TRUE(small.ok()) << small.status();
    EXPECT_EQ(small->rows, ZeroRows::kRows);
    EXPECT_TRUE(quota_returned());
  }
  ExpectEmptyStore();
}

// Frames that come ahead of their turn wait for the blocks before them, up
// to 65536 of them: a connection that runs that far ahead of another fails
// the evaluation.
TEST_F(DataConnectionTest, EvaluateConnectionsKeepInStep) {
  Start();
  constexpr int64_t kVocab = 16;
  RawDataEvaluate evaluate(stub_.get(), Token('w'), 2, kVocab);
  ASSERT_TRUE(evaluate.SendHeader());
  const int idle = ConnectData();
  ASSERT_TRUE(SendAll(idle, Preamble(Token('w'), 0)));
  const int ahead = ConnectData();
  std::string frames = Preamble(Token('w'), 1);
  const std::string frame = Frame(1, kVocab);
  for (int i = 0; i <= 65536; ++i) frames += frame;
  SendAll(ahead, frames);  // the server may close it before the end
  const grpc::Status status = evaluate.Finish();
  EXPECT_EQ(status.error_code(), StatusCode::INVALID_ARGUMENT)
      << status.error_message();
  EXPECT_NE(status.error_message().find("65536 frames ahead"),
            std::string::npos)
      << status.error_message();
  close(idle);
  close(ahead);
  ExpectEmptyStore();
}

// At the cap of connections served at once, further connections wait in the
// listen backlog until a served one ends, instead of being turned away: a

}  // namespace
}  // namespace data_connection_test
}  // namespace lossd
