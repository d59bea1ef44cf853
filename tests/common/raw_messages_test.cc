// common/raw_messages.h against protobuf itself: the chunk prefix the client
// writes by hand is what protobuf would write, and the server's raw readers
// find what protobuf would parse, however the bytes are cut into pieces.
#include "common/raw_messages.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "lossd/v1/lossd.pb.h"

namespace lossd {
namespace {

namespace pb = ::lossd::v1;

// `bytes` cut at `cuts` random places (empty pieces included).
std::vector<absl::string_view> Cut(const std::string& bytes, int cuts,
                                   std::mt19937* random) {
  std::vector<size_t> at = {0, bytes.size()};
  std::uniform_int_distribution<size_t> where(0, bytes.size());
  for (int i = 0; i < cuts; ++i) at.push_back(where(*random));
  std::sort(at.begin(), at.end());
  std::vector<absl::string_view> pieces;
  for (size_t i = 0; i + 1 < at.size(); ++i) {
    pieces.push_back(absl::string_view(bytes).substr(at[i], at[i + 1] - at[i]));
  }
  return pieces;
}

std::string Concat(BytePieces pieces, ByteRange range) {
  std::string out;
  EXPECT_TRUE(
      ForEachPiece(pieces, range, [&](const uint8_t* data, size_t size) {
        out.append(reinterpret_cast<const char*>(data), size);
        return absl::OkStatus();
      }).ok());
  return out;
}

TEST(ChunkPrefixTest, EncodesWhatProtobufWrites) {
  for (uint64_t length :
       {uint64_t{0}, uint64_t{1}, uint64_t{127}, uint64_t{128}, uint64_t{16383},
        uint64_t{16384}, uint64_t{1} << 20, (uint64_t{1} << 28) + 5}) {
    uint8_t prefix[kMaxChunkPrefixBytes];
    const size_t bytes = EncodeChunkPrefix(length, prefix);
    pb::UploadRequest request;
    request.set_chunk(std::string(length < 4096 ? length : 0, 'x'));
    if (length < 4096) {
      const std::string serialized = request.SerializeAsString();
      EXPECT_EQ(std::string(reinterpret_cast<char*>(prefix), bytes),
                serialized.substr(0, serialized.size() - length));
    }
    // The prefix parses back to its length.
    EXPECT_EQ(ChunkPrefixBytes(prefix, bytes, bytes + length),
              std::optional<size_t>(bytes));
  }
}

TEST(ChunkPrefixTest, FindsChunksInAnyPieces) {
  std::mt19937 random(7);
  for (size_t size : {size_t{0}, size_t{1}, size_t{200}, size_t{70000}}) {
    pb::UploadRequest request;
    std::string data(size, '\0');
    for (char& c : data) c = static_cast<char>(random());
    request.set_chunk(data);
    const std::string serialized = request.SerializeAsString();
    for (int cuts = 0; cuts < 6; ++cuts) {
      const std::vector<absl::string_view> pieces =
          Cut(serialized, cuts, &random);
      const std::optional<size_t> prefix = FindUploadChunk(pieces);
      ASSERT_TRUE(prefix.has_value()) << size << " " << cuts;
      EXPECT_EQ(Concat(pieces, ByteRange{*prefix, serialized.size() - *prefix}),
                data);
    }
  }
}

TEST(ChunkPrefixTest, EmptyPiecesWithoutData) {
  pb::UploadRequest request;
  request.set_chunk("bytes");
  const std::string serialized = request.SerializeAsString();
  const absl::string_view pieces[] = {absl::string_view(), serialized,
                                      absl::string_view()};
  EXPECT_EQ(FindUploadChunk(pieces), std::optional<size_t>(2));
  ByteRange logits;
  ByteRange targets;
  EXPECT_FALSE(FindRowBlock(pieces, &logits, &targets));
}

TEST(ChunkPrefixTest, LeavesEverythingElseToProtobuf) {
  pb::UploadRequest header;
  header.mutable_header()->set_dtype(pb::DTYPE_FLOAT32);
  header.mutable_header()->add_shape(4);
  const std::string serialized = header.SerializeAsString();
  const absl::string_view one[] = {serialized};
  EXPECT_FALSE(FindUploadChunk(one).has_value());
  // A chunk followed by another field, or with a padded (6-byte) length.
  pb::UploadRequest chunk;
  chunk.set_chunk("abc");
  const std::string longer = chunk.SerializeAsString() + "\x08\x01";
  const absl::string_view two[] = {longer};
  EXPECT_FALSE(FindUploadChunk(two).has_value());
  const std::string padded(
      "\x12\x83\x80\x80\x80\x80\x00"
      "abc",
      10);
  const absl::string_view three[] = {padded};
  EXPECT_FALSE(FindUploadChunk(three).has_value());
  EXPECT_FALSE(FindUploadChunk({}).has_value());
}

TEST(RowBlockTest, FindsWhatProtobufParses) {
  std::mt19937 random(11);
  for (int round = 0; round < 50; ++round) {
    pb::EvaluateRequest request;
    std::string logits(random() % 3000, '\0');
    for (char& c : logits) c = static_cast<char>(random());
    std::string targets(random() % 100, '\0');
    for (char& c : targets) c = static_cast<char>(random());
    request.mutable_block()->set_logits(logits);
    request.mutable_block()->set_targets(targets);
    std::string serialized = request.SerializeAsString();
    if (round % 3 == 1) {
      // An unknown varint field inside the block: skipped, as protobuf does.
      pb::RowBlock block;
      block.set_logits(logits);
      block.set_targets(targets);
      std::string inner = block.SerializeAsString() + "\x18\x96\x01";
      pb::UploadRequest framing;  // field 2, length-delimited, as block is
      framing.set_chunk(inner);
      serialized = framing.SerializeAsString();
    }
    for (int cuts = 0; cuts < 4; ++cuts) {
      const std::vector<absl::string_view> pieces =
          Cut(serialized, cuts, &random);
      ByteRange found_logits;
      ByteRange found_targets;
      ASSERT_TRUE(FindRowBlock(pieces, &found_logits, &found_targets));
      EXPECT_EQ(Concat(pieces, found_logits), logits);
      EXPECT_EQ(Concat(pieces, found_targets), targets);
    }
  }
}

TEST(RowBlockTest, LastOccurrenceWins) {
  pb::RowBlock first;
  first.set_logits("old");
  pb::RowBlock second;
  second.set_logits("new");
  pb::UploadRequest framing;
  framing.set_chunk(first.SerializeAsString() + second.SerializeAsString());
  const std::string serialized = framing.SerializeAsString();
  const absl::string_view one[] = {serialized};
  ByteRange logits;
  ByteRange targets;
  ASSERT_TRUE(FindRowBlock(one, &logits, &targets));
  EXPECT_EQ(Concat(one, logits), "new");
  EXPECT_EQ(targets.size, 0u);
}

TEST(RowBlockTest, LeavesHeadersAndMalformedBytesToProtobuf) {
  pb::EvaluateRequest header;
  header.mutable_header()->set_vocab(10);
  const std::string serialized = header.SerializeAsString();
  ByteRange logits;
  ByteRange targets;
  const absl::string_view one[] = {serialized};
  EXPECT_FALSE(FindRowBlock(one, &logits, &targets));
  // A length past the end, a group, field 0, a cut-off varint.
  for (const std::string& bad :
       {std::string("\x12\x03\x0a\x05xy", 6), std::string("\x12\x01\x0b", 3),
        std::string("\x12\x02\x00\x00", 4), std::string("\x12\x02\x08\x80", 4),
        std::string("\x12", 1), std::string()}) {
    const absl::string_view bytes[] = {bad};
    EXPECT_FALSE(FindRowBlock(bytes, &logits, &targets));
  }
}

TEST(ForEachPieceTest, StopsAtTheFirstError) {
  const std::string bytes = "abcdefgh";
  std::mt19937 random(3);
  const std::vector<absl::string_view> pieces = Cut(bytes, 3, &random);
  EXPECT_EQ(Concat(pieces, ByteRange{2, 5}), "cdefg");
  EXPECT_EQ(Concat(pieces, ByteRange{8, 0}), "");
  int calls = 0;
  const absl::Status status =
      ForEachPiece(pieces, ByteRange{0, 8}, [&](const uint8_t*, size_t) {
        ++calls;
        return absl::DataLossError("stop");
      });
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(calls, 1);
}

}  // namespace
}  // namespace lossd
