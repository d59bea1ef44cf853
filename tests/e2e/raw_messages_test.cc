// The raw Upload and Evaluate readers (server/upload_reactor.cc and
// server/evaluate_reactor.cc over common/raw_messages.h), fed hand-built
// wire bytes (field order, unknown fields, repeated fields, slice splits,
// truncation): each must mean what protobuf's parse of the same bytes means.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "lossd/v1/lossd.grpc.pb.h"
#include "server/server.h"
#include "tests/e2e/bytes.h"
#include "tests/e2e/test_server.h"

namespace lossd {
namespace {

namespace pb = ::lossd::v1;
using ::lossd::e2e_test::Bytes;
using ::lossd::e2e_test::LargeMessageChannel;
using ::lossd::e2e_test::LoopbackConfig;

constexpr int64_t kBudget = 64 << 20;

// ------------------------------------------------------------ wire encoding

std::string Varint(uint64_t value) {
  std::string out;
  for (;; value >>= 7) {
    out.push_back(
        static_cast<char>((value & 0x7f) | (value > 0x7f ? 0x80 : 0)));
    if (value <= 0x7f) break;
  }
  return out;
}

std::string Key(uint64_t field, int wire_type) {
  return Varint((field << 3) | static_cast<uint64_t>(wire_type));
}

// A length-delimited field: key, length, bytes.
std::string LenField(uint64_t field, const std::string& bytes) {
  return Key(field, 2) + Varint(bytes.size()) + bytes;
}

std::string VarintField(uint64_t field, uint64_t value) {
  return Key(field, 0) + Varint(value);
}

std::string Fixed64Field(uint64_t field, uint64_t value) {
  std::string bytes(8, '\0');
  std::memcpy(&bytes[0], &value, 8);
  return Key(field, 1) + bytes;
}

std::string Fixed32Field(uint64_t field, uint32_t value) {
  std::string bytes(4, '\0');
  std::memcpy(&bytes[0], &value, 4);
  return Key(field, 5) + bytes;
}

// Every kind of unknown field a RowBlock or UploadRequest may carry, with
// field numbers that need one- and multi-byte keys.
std::string UnknownFields(std::mt19937* rng) {
  std::string junk(static_cast<size_t>((*rng)() % 40), '\0');
  for (char& c : junk) c = static_cast<char>((*rng)());
  return VarintField(7, (*rng)()) + VarintField(3000, ~uint64_t{0}) +
         Fixed64Field(9, (*rng)()) + LenField(12, junk) + LenField(100000, "") +
         Fixed32Field(15, (*rng)());
}

// `bytes` as a ByteBuffer whose slices end at each of `cuts` (ascending,
// within the bytes; empty slices allowed).
grpc::ByteBuffer Sliced(const std::string& bytes, std::vector<size_t> cuts) {
  cuts.push_back(bytes.size());
  std::vector<grpc::Slice> slices;
  size_t at = 0;
  for (size_t cut : cuts) {
    slices.emplace_back(bytes.data() + at, cut - at);  // copies
    at = cut;
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

grpc::ByteBuffer Whole(const std::string& bytes) { return Sliced(bytes, {}); }

template <typename Message>
grpc::ByteBuffer Serialized(const Message& message) {
  return Whole(message.SerializeAsString());
}

// --------------------------------------------------------------- the data

struct Problem {
  int64_t vocab = 0;
  std::vector<float> logits;     // [rows, vocab]
  std::vector<int64_t> targets;  // [rows], a few ignored
};

Problem RandomProblem(std::mt19937* rng, int64_t rows, int64_t vocab) {
  Problem p;
  p.vocab = vocab;
  std::normal_distribution<float> normal(0.0f, 3.0f);
  p.logits.resize(static_cast<size_t>(rows * vocab));
  for (float& x : p.logits) x = normal(*rng);
  p.targets.resize(static_cast<size_t>(rows));
  for (int64_t& t : p.targets) {
    t = (*rng)() % 10 == 0 ? -100 : static_cast<int64_t>((*rng)() % vocab);
  }
  return p;
}

// Rows [first, first + rows) of `p`: its logits and targets bytes.
std::string LogitsBytes(const Problem& p, int64_t first, int64_t rows) {
  return std::string(
      reinterpret_cast<const char*>(p.logits.data() + first * p.vocab),
      static_cast<size_t>(rows * p.vocab * 4));
}
std::string TargetsBytes(const Problem& p, int64_t first, int64_t rows) {
  return std::string(reinterpret_cast<const char*>(p.targets.data() + first),
                     static_cast<size_t>(rows * 8));
}

// An EvaluateRequest that is one `block` field holding `inner` (the RowBlock's
// bytes, built by hand).
std::string BlockMessage(const std::string& inner) {
  return LenField(2, inner);
}

uint64_t Bits(double value) {
  uint64_t bits;
  std::memcpy(&bits, &value, 8);
  return bits;
}

class RawMessagesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    seed_ = std::random_device{}();
    rng_.seed(seed_);
    auto server =
        LossdServer::Start(LoopbackConfig("cpu", kBudget, absl::Seconds(20)));
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    channel_ = LargeMessageChannel(server_->address());
    stub_ = pb::Lossd::NewStub(channel_);
  }

  // Sends `messages` on a raw client stream of `method`; the response bytes go
  // to `response`.
  grpc::Status RawStream(const char* method,
                         std::vector<grpc::ByteBuffer> messages,
                         grpc::ByteBuffer* response) {
    grpc::ClientContext context;
    const grpc::internal::RpcMethod rpc(
        method, grpc::internal::RpcMethod::CLIENT_STREAMING);
    std::unique_ptr<grpc::ClientWriter<grpc::ByteBuffer>> writer(
        grpc::internal::ClientWriterFactory<grpc::ByteBuffer>::Create(
            channel_.get(), rpc, &context, response));
    for (grpc::ByteBuffer& message : messages) {
      if (!writer->Write(message)) break;
    }
    writer->WritesDone();
    return writer->Finish();
  }

  pb::EvaluateRequest Header(int64_t vocab) {
    pb::EvaluateRequest request;
    request.mutable_header()->set_vocab(vocab);
    request.mutable_header()->set_logits_dtype(pb::DTYPE_FLOAT32);
    request.mutable_header()->set_targets_dtype(pb::DTYPE_INT64);
    request.mutable_header()->mutable_options()->set_label_smoothing(0.1f);
    return request;
  }

  // Evaluate the normal way: `p` in blocks of `block_rows` through the stub.
  pb::EvaluateResponse NormalEvaluate(const Problem& p, int64_t block_rows) {
    grpc::ClientContext context;
    pb::EvaluateResponse response;
    auto writer = stub_->Evaluate(&context, &response);
    EXPECT_TRUE(writer->Write(Header(p.vocab)));
    const int64_t rows = static_cast<int64_t>(p.targets.size());
    for (int64_t first = 0; first < rows; first += block_rows) {
      const int64_t n = std::min(block_rows, rows - first);
      pb::EvaluateRequest block;
      block.mutable_block()->set_logits(LogitsBytes(p, first, n));
      block.mutable_block()->set_targets(TargetsBytes(p, first, n));
      EXPECT_TRUE(writer->Write(block));
    }
    writer->WritesDone();
    const grpc::Status status = writer->Finish();
    EXPECT_TRUE(status.ok()) << status.error_message();
    return response;
  }

  // Evaluate with the header sent normally and each block as `blocks` bytes.
  grpc::Status RawEvaluate(int64_t vocab, std::vector<grpc::ByteBuffer> blocks,
                           pb::EvaluateResponse* response) {
    blocks.insert(blocks.begin(), Serialized(Header(vocab)));
    grpc::ByteBuffer raw;
    const grpc::Status status =
        RawStream("/lossd.v1.Lossd/Evaluate", std::move(blocks), &raw);
    if (status.ok()) {
      EXPECT_TRUE(grpc::SerializationTraits<pb::EvaluateResponse>::Deserialize(
                      &raw, response)
                      .ok());
    }
    return status;
  }

  // Upload with the header sent normally and the data as `chunks` messages.
  grpc::Status RawUpload(pb::DType dtype, std::vector<int64_t> shape,
                         std::vector<grpc::ByteBuffer> chunks,
                         pb::TensorInfo* info) {
    pb::UploadRequest header;
    header.mutable_header()->set_dtype(dtype);
    for (int64_t dim : shape) header.mutable_header()->add_shape(dim);
    chunks.insert(chunks.begin(), Serialized(header));
    grpc::ByteBuffer raw;
    const grpc::Status status =
        RawStream("/lossd.v1.Lossd/Upload", std::move(chunks), &raw);
    if (status.ok()) {
      pb::UploadResponse response;
      EXPECT_TRUE(grpc::SerializationTraits<pb::UploadResponse>::Deserialize(
                      &raw, &response)
                      .ok());
      *info = response.tensor();
    }
    return status;
  }

  std::string Download(const std::string& handle) {
    grpc::ClientContext context;
    pb::DownloadRequest request;
    request.set_handle(handle);
    auto reader = stub_->Download(&context, request);
    std::string bytes;
    pb::DownloadResponse response;
    while (reader->Read(&response)) {
      if (!response.has_header()) bytes += response.chunk();
    }
    const grpc::Status status = reader->Finish();
    EXPECT_TRUE(status.ok()) << status.error_message();
    return bytes;
  }

  pb::ServerInfo Info() {
    grpc::ClientContext context;
    pb::ServerInfo info;
    EXPECT_TRUE(
        stub_->GetServerInfo(&context, pb::GetServerInfoRequest(), &info).ok());
    return info;
  }

  int ListCount() {
    grpc::ClientContext context;
    pb::ListResponse response;
    EXPECT_TRUE(stub_->List(&context, pb::ListRequest(), &response).ok());
    return response.tensors_size();
  }

  // Bitwise equality of every field of two responses.
  static void ExpectSame(const pb::EvaluateResponse& got,
                         const pb::EvaluateResponse& want) {
    EXPECT_EQ(Bits(got.loss()), Bits(want.loss()))
        << got.loss() << " vs " << want.loss();
    EXPECT_EQ(Bits(got.z_loss()), Bits(want.z_loss()));
    EXPECT_EQ(Bits(got.denominator()), Bits(want.denominator()));
    EXPECT_EQ(got.rows(), want.rows());
    EXPECT_EQ(got.valid_tokens(), want.valid_tokens());
    EXPECT_EQ(got.correct_tokens(), want.correct_tokens());
    EXPECT_EQ(got.nonfinite_rows(), want.nonfinite_rows());
  }

  unsigned seed_ = 0;
  std::mt19937 rng_;
  std::unique_ptr<LossdServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<pb::Lossd::Stub> stub_;
};

#define LOSSD_TRACE_SEED() \
  SCOPED_TRACE(::testing::Message() << "seed " << seed_)

TEST_F(RawMessagesTest, TargetsBeforeLogits) {
  LOSSD_TRACE_SEED();
  const Problem p = RandomProblem(&rng_, 40, 37);
  const pb::EvaluateResponse want = NormalEvaluate(p, 10);
  std::vector<grpc::ByteBuffer> blocks;
  for (int64_t first = 0; first < 40; first += 10) {
    blocks.push_back(
        Whole(BlockMessage(LenField(2, TargetsBytes(p, first, 10)) +
                           LenField(1, LogitsBytes(p, first, 10)))));
  }
  pb::EvaluateResponse got;
  const grpc::Status status = RawEvaluate(37, std::move(blocks), &got);
  ASSERT_TRUE(status.ok()) << status.error_message();
  ExpectSame(got, want);
  EXPECT_EQ(got.rows(), 40);
}

TEST_F(RawMessagesTest, UnknownFieldsBeforeAndAfter) {
  LOSSD_TRACE_SEED();
  const Problem p = RandomProblem(&rng_, 40, 37);
  const pb::EvaluateResponse want = NormalEvaluate(p, 10);
  std::vector<grpc::ByteBuffer> blocks;
  for (int64_t first = 0; first < 40; first += 10) {
    const std::string logits = LenField(1, LogitsBytes(p, first, 10));
    const std::string targets = LenField(2, TargetsBytes(p, first, 10));
    std::string inner;
    switch (first / 10) {
      case 0:  // before both
        inner = UnknownFields(&rng_) + logits + targets;
        break;
      case 1:  // after both
        inner = logits + targets + UnknownFields(&rng_);
        break;
      case 2:  // between
        inner = logits + UnknownFields(&rng_) + targets;
        break;
      default:  // everywhere
        inner = UnknownFields(&rng_) + targets + UnknownFields(&rng_) + logits +
                UnknownFields(&rng_);
    }
    // The protobuf parse of the same bytes agrees (the fallback's meaning).
    pb::RowBlock parsed;
    ASSERT_TRUE(parsed.ParseFromString(inner));
    ASSERT_EQ(parsed.logits(), LogitsBytes(p, first, 10));
    blocks.push_back(Whole(BlockMessage(inner)));
  }
  pb::EvaluateResponse got;
  const grpc::Status status = RawEvaluate(37, std::move(blocks), &got);
  ASSERT_TRUE(status.ok()) << status.error_message();
  ExpectSame(got, want);
}

// Unknown fields around the block itself (outside the RowBlock) take the
// protobuf fallback; the result must not change.
TEST_F(RawMessagesTest, UnknownFieldsAroundTheBlock) {
  LOSSD_TRACE_SEED();
  const Problem p = RandomProblem(&rng_, 20, 37);
  const pb::EvaluateResponse want = NormalEvaluate(p, 10);
  const std::string first =
      LenField(1, LogitsBytes(p, 0, 10)) + LenField(2, TargetsBytes(p, 0, 10));
  const std::string second = LenField(1, LogitsBytes(p, 10, 10)) +
                             LenField(2, TargetsBytes(p, 10, 10));
  std::vector<grpc::ByteBuffer> blocks;
  blocks.push_back(
      Whole(UnknownFields(&rng_) + BlockMessage(first) + VarintField(5, 1)));
  blocks.push_back(Whole(BlockMessage(second) + Fixed64Field(20, 7)));
  pb::EvaluateResponse got;
  const grpc::Status status = RawEvaluate(37, std::move(blocks), &got);
  ASSERT_TRUE(status.ok()) << status.error_message();
  ExpectSame(got, want);
}

TEST_F(RawMessagesTest, RepeatedFieldsLastWins) {
  LOSSD_TRACE_SEED();
  const Problem p = RandomProblem(&rng_, 30, 37);
  const Problem decoy = RandomProblem(&rng_, 30, 37);
  const pb::EvaluateResponse want = NormalEvaluate(p, 10);
  const std::vector<std::string> inners = {
      // Earlier copies of another size: were one used, the block would fail
      // (rows != targets) or give another loss.
      LenField(1, LogitsBytes(decoy, 0, 7)) +
          LenField(1, LogitsBytes(p, 0, 10)) +
          LenField(2, TargetsBytes(p, 0, 10)),
      LenField(2, TargetsBytes(decoy, 10, 3)) +
          LenField(1, LogitsBytes(decoy, 10, 10)) +
          LenField(2, TargetsBytes(p, 10, 10)) +
          LenField(1, LogitsBytes(p, 10, 10)),
      // An empty copy is a copy too; a field of the wrong wire type is kept
      // as unknown by protobuf, and the previous value stands.
      LenField(1, "") + LenField(1, LogitsBytes(p, 20, 10)) +
          VarintField(1, 5) + LenField(2, TargetsBytes(p, 20, 10)) +
          Fixed32Field(2, 9),
  };
  std::vector<grpc::ByteBuffer> blocks;
  for (size_t b = 0; b < inners.size(); ++b) {
    // The protobuf parse of the same bytes agrees (the fallback's meaning).
    pb::RowBlock parsed;
    ASSERT_TRUE(parsed.ParseFromString(inners[b])) << b;
    EXPECT_EQ(parsed.logits(), LogitsBytes(p, 10 * b, 10)) << b;
    EXPECT_EQ(parsed.targets(), TargetsBytes(p, 10 * b, 10)) << b;
    blocks.push_back(Whole(BlockMessage(inners[b])));
  }
  pb::EvaluateResponse got;
  const grpc::Status status = RawEvaluate(37, std::move(blocks), &got);
  ASSERT_TRUE(status.ok()) << status.error_message();
  ExpectSame(got, want);
}

// The client's slices do not survive TCP as they are (the server's slices are
// the transport's), so both are covered: splits made by the client, including
// one inside every prefix byte, and blocks whose prefixes sweep across the
// 16 KiB HTTP/2 frame boundary, where the server's slices end.
TEST_F(RawMessagesTest, MessageSplitAcrossSlices) {
  LOSSD_TRACE_SEED();
  const int64_t vocab = 509;  // 8 rows of logits = 16288 bytes
  const int64_t rows_per_block = 8;
  const int64_t sweep = 48;
  const int64_t client_cut_blocks = 20;
  const int64_t blocks_total = client_cut_blocks + sweep;
  const Problem p = RandomProblem(&rng_, blocks_total * rows_per_block, vocab);
  const pb::EvaluateResponse want = NormalEvaluate(p, rows_per_block);
  std::vector<grpc::ByteBuffer> blocks;
  for (int64_t b = 0; b < blocks_total; ++b) {
    const int64_t first = b * rows_per_block;
    const std::string logits = LogitsBytes(p, first, rows_per_block);
    const std::string targets = TargetsBytes(p, first, rows_per_block);
    if (b < client_cut_blocks) {
      // Targets first: the outer tag and 2-byte length (bytes 0-2), the
      // targets tag/length (3-4) and data (5-68), the logits tag and 2-byte
      // length (69-71), the logits. Cuts land in each prefix; one block is
      // all one-byte slices.
      const std::string bytes =
          BlockMessage(LenField(2, targets) + LenField(1, logits));
      std::vector<size_t> cuts;
      if (b == 0) {
        for (size_t at = 1; at < bytes.size(); ++at) cuts.push_back(at);
      } else if (b == 1) {
        cuts = {1, 2, 3, 4, 5, 6, 68, 69, 70, 71, 72};
      } else {
        const size_t at = static_cast<size_t>(b - 2);     // 0..17
        cuts = {at, at, at + 1};                          // an empty slice too
        cuts.push_back(69 + static_cast<size_t>(b % 4));  // logits prefix
        cuts.push_back(bytes.size() - 1 - rng_() % 100);
      }
      blocks.push_back(Sliced(bytes, cuts));
    } else {
      // gRPC's 5-byte message header, the 4-byte outer prefix, the padding
      // field's 2 + pad bytes and the 3-byte logits prefix come before the
      // logits: the targets prefix starts at 16302 + pad.
      const size_t pad = 60 + static_cast<size_t>(b - client_cut_blocks);
      blocks.push_back(
          Whole(BlockMessage(LenField(15, std::string(pad, 'x')) +
                             LenField(1, logits) + LenField(2, targets))));
    }
  }
  pb::EvaluateResponse got;
  const grpc::Status status = RawEvaluate(vocab, std::move(blocks), &got);
  ASSERT_TRUE(status.ok()) << status.error_message();
  ExpectSame(got, want);
  EXPECT_EQ(got.rows(), blocks_total * rows_per_block);
}

TEST_F(RawMessagesTest, UploadChunkSplitOverSlices) {
  LOSSD_TRACE_SEED();
  // 3000 bytes: chunk lengths of two varint bytes, and a 200-byte chunk of
  // three one-byte-or-more pieces.
  std::vector<float> values(750);
  std::normal_distribution<float> normal;
  for (float& v : values) v = normal(rng_);
  const std::string data = Bytes(values);
  std::vector<grpc::ByteBuffer> chunks;
  size_t at = 0;
  const std::vector<size_t> sizes = {300, 1, 127, 128, 1000, 200, 1244};
  for (size_t i = 0; i < sizes.size(); ++i) {
    const std::string bytes = LenField(2, data.substr(at, sizes[i]));
    at += sizes[i];
    std::vector<size_t> cuts;
    switch (i) {
      case 0:  // between tag and length, inside the length
        cuts = {1, 2};
        break;
      case 1:  // all one-byte slices
        cuts = {1, 2};
        break;
      case 2:
        cuts = {0, 1, 1, 50};
        break;
      case 3:  // inside the two-byte length, then through the data
        cuts = {2, 3, 4, 100};
        break;
      case 4:
        for (size_t cut = 1; cut < bytes.size(); cut += 1 + rng_() % 64) {
          cuts.push_back(cut);
        }
        break;
      case 5:
        for (size_t cut = 1; cut < bytes.size(); ++cut) cuts.push_back(cut);
        break;
      default:
        cuts = {bytes.size() - 1};
    }
    chunks.push_back(Sliced(bytes, cuts));
  }
  ASSERT_EQ(at, data.size());
  pb::TensorInfo info;
  const grpc::Status status =
      RawUpload(pb::DTYPE_FLOAT32, {30, 25}, std::move(chunks), &info);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(info.bytes(), 3000);
  EXPECT_EQ(Download(info.handle()), data);
}

// Chunks in encodings the fast path does not take: unknown fields around the
// chunk and a repeated chunk field (the oneof's last copy wins).
TEST_F(RawMessagesTest, UploadChunkUnusualEncodings) {
  LOSSD_TRACE_SEED();
  std::vector<int64_t> values(100);
  for (int64_t& v : values) v = static_cast<int64_t>(rng_());
  const std::string data = Bytes(values);
  std::vector<grpc::ByteBuffer> chunks;
  chunks.push_back(
      Whole(UnknownFields(&rng_) + LenField(2, data.substr(0, 200))));
  chunks.push_back(
      Whole(LenField(2, data.substr(200, 200)) + UnknownFields(&rng_)));
  chunks.push_back(
      Whole(LenField(2, "decoy bytes") + LenField(2, data.substr(400, 400))));
  pb::TensorInfo info;
  const grpc::Status status =
      RawUpload(pb::DTYPE_INT64, {100}, std::move(chunks), &info);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(Download(info.handle()), data);
}

TEST_F(RawMessagesTest, TruncatedFieldIsInvalidAndStoresNothing) {
  LOSSD_TRACE_SEED();
  const Problem p = RandomProblem(&rng_, 10, 37);
  std::vector<float> weights(37, 1.0f);
  pb::TensorInfo kept;
  ASSERT_TRUE(RawUpload(pb::DTYPE_FLOAT32, {37},
                        {Whole(LenField(2, Bytes(weights)))}, &kept)
                  .ok());
  const pb::ServerInfo before = Info();
  ASSERT_EQ(ListCount(), 1);

  const std::string logits = LogitsBytes(p, 0, 10);
  const std::string targets = TargetsBytes(p, 0, 10);
  const std::string whole = LenField(1, logits) + LenField(2, targets);
  // Each RowBlock below is cut short inside one of its fields; the outer
  // length still matches, so only the inner bytes are wrong.
  const std::vector<std::pair<const char*, std::string>> evaluate_cases = {
      {"targets cut", whole.substr(0, whole.size() - 3)},
      {"length past the end",
       LenField(1, logits) + Key(2, 2) + Varint(targets.size() + 1) + targets},
      {"cut inside a length", LenField(1, logits) + Key(2, 2) + "\x80"},
      {"cut inside a key", LenField(1, logits) + LenField(2, targets) + "\x80"},
      {"cut fixed64", whole + Key(9, 1) + "1234567"},
      {"cut fixed32", whole + Key(9, 5) + "123"},
      {"cut varint", whole + Key(9, 0) + "\xff\xff"},
      {"field 0", whole + VarintField(0, 1)},
  };
  for (const auto& [name, inner] : evaluate_cases) {
    SCOPED_TRACE(name);
    pb::RowBlock parsed;
    ASSERT_FALSE(parsed.ParseFromString(inner));  // protobuf rejects it too
    std::vector<grpc::ByteBuffer> blocks;
    blocks.push_back(Whole(BlockMessage(inner)));
    pb::EvaluateResponse response;
    const grpc::Status status = RawEvaluate(37, std::move(blocks), &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INTERNAL)
        << status.error_message();
  }
  // The outer message cut short: its length says more than follows.
  {
    const std::string bytes = BlockMessage(whole);
    std::vector<grpc::ByteBuffer> blocks;
    blocks.push_back(Whole(bytes.substr(0, bytes.size() - 1)));
    pb::EvaluateResponse response;
    EXPECT_EQ(RawEvaluate(37, std::move(blocks), &response).error_code(),
              grpc::StatusCode::INTERNAL);
  }

  // Upload: a good first chunk, then a cut one; nothing may stay behind.
  const std::string data = Bytes(std::vector<float>(100, 0.5f));
  const std::vector<std::pair<const char*, std::string>> upload_cases = {
      {"chunk cut", LenField(2, data.substr(200)).substr(0, 150)},
      {"cut inside the length", Key(2, 2) + "\xc8"},
      {"only the tag", Key(2, 2)},
      {"cut after an unknown field", UnknownFields(&rng_) + Key(2, 2) + "\x05"},
  };
  for (const auto& [name, bytes] : upload_cases) {
    SCOPED_TRACE(name);
    pb::UploadRequest parsed;
    ASSERT_FALSE(parsed.ParseFromString(bytes));
    std::vector<grpc::ByteBuffer> chunks;
    chunks.push_back(Whole(LenField(2, data.substr(0, 200))));
    chunks.push_back(Sliced(bytes, {1}));
    pb::TensorInfo info;
    const grpc::Status status =
        RawUpload(pb::DTYPE_FLOAT32, {10, 10}, std::move(chunks), &info);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INTERNAL)
        << status.error_message();
  }

  const pb::ServerInfo after = Info();
  EXPECT_EQ(after.tensors(), before.tensors());
  EXPECT_EQ(after.used_bytes(), before.used_bytes());
  EXPECT_EQ(after.free_bytes(), before.free_bytes());
  EXPECT_EQ(ListCount(), 1);
}

// Non-minimal and over-long varints (padded keys and lengths, keys beyond 32
// bits): the raw readers must accept exactly what protobuf accepts, and mean
// the same.
TEST_F(RawMessagesTest, OverlongVarintsJudgedAsProtobufDoes) {
  LOSSD_TRACE_SEED();
  const Problem p = RandomProblem(&rng_, 10, 37);
  const pb::EvaluateResponse want = NormalEvaluate(p, 10);
  const std::string logits = LogitsBytes(p, 0, 10);
  const std::string targets = TargetsBytes(p, 0, 10);
  // `value` in `bytes` varint bytes (padded with continuation bytes).
  auto padded = [](uint64_t value, int bytes) {
    std::string out;
    for (int i = 0; i < bytes; ++i, value >>= 7) {
      out.push_back(
          static_cast<char>((value & 0x7f) | (i + 1 < bytes ? 0x80 : 0)));
    }
    return out;
  };
  const std::string targets_field = LenField(2, targets);
  std::vector<std::pair<std::string, std::string>> cases;
  for (int bytes = 2; bytes <= 10; ++bytes) {
    cases.push_back({"logits key in " + std::to_string(bytes) + " bytes",
                     padded(Key(1, 2)[0], bytes) + Varint(logits.size()) +
                         logits + targets_field});
    cases.push_back(
        {"logits length in " + std::to_string(bytes) + " bytes",
         Key(1, 2) + padded(logits.size(), bytes) + logits + targets_field});
  }
  cases.push_back({"unknown key of 33 bits",
                   Varint((uint64_t{1} << 32) | (9 << 3)) + Varint(1) +
                       LenField(1, logits) + targets_field});
  cases.push_back(
      {"unknown key of 64 bits", Varint(~uint64_t{0} - 7) + Varint(1) +
                                     LenField(1, logits) + targets_field});
  for (const auto& [name, inner] : cases) {
    SCOPED_TRACE(name);
    pb::RowBlock parsed;
    const bool protobuf_ok = parsed.ParseFromString(inner);
    std::vector<grpc::ByteBuffer> blocks;
    blocks.push_back(Whole(BlockMessage(inner)));
    pb::EvaluateResponse got;
    const grpc::Status status = RawEvaluate(37, std::move(blocks), &got);
    if (protobuf_ok && parsed.logits() == logits &&
        parsed.targets() == targets) {
      ASSERT_TRUE(status.ok()) << status.error_message();
      ExpectSame(got, want);
    } else {
      EXPECT_FALSE(protobuf_ok);  // no case is meant to parse to other data
      EXPECT_EQ(status.error_code(), grpc::StatusCode::INTERNAL)
          << status.error_message();
    }
  }

  // The same for an Upload chunk's length.
  const std::string data = Bytes(std::vector<float>(10, 0.25f));
  for (int bytes = 2; bytes <= 10; ++bytes) {
    SCOPED_TRACE(::testing::Message()
                 << "chunk length in " << bytes << " bytes");
    const std::string chunk = Key(2, 2) + padded(data.size(), bytes) + data;
    pb::UploadRequest parsed;
    const bool protobuf_ok = parsed.ParseFromString(chunk);
    pb::TensorInfo info;
    const grpc::Status status =
        RawUpload(pb::DTYPE_FLOAT32, {10}, {Whole(chunk)}, &info);
    if (protobuf_ok) {
      ASSERT_TRUE(status.ok()) << status.error_message();
      EXPECT_EQ(Download(info.handle()), data);
    } else {
      EXPECT_EQ(status.error_code(), grpc::StatusCode::INTERNAL)
          << status.error_message();
    }
  }
}

}  // namespace
}  // namespace lossd
