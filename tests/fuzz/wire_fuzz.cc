// libFuzzer target for the hand-written parsers of common/ (raw_messages.h,
// data_wire.h): the server runs them on every Upload chunk, Evaluate block and
// data connection, straight from the network. The first byte picks the parser
// and how the rest is cut into pieces; what they find must be what protobuf
// parses, and the preamble and frame encodings must round-trip.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "common/data_wire.h"
#include "common/raw_messages.h"
#include "lossd/v1/lossd.pb.h"

namespace {

namespace pb = ::lossd::v1;

void Require(bool condition) {
  if (!condition) __builtin_trap();
}

// `bytes` as pieces of at most `piece` bytes (each a heap copy, so that ASan
// sees reads past any piece).
std::vector<std::string> Cut(const std::string& bytes, size_t piece) {
  std::vector<std::string> pieces;
  for (size_t at = 0; at < bytes.size(); at += piece) {
    pieces.push_back(bytes.substr(at, piece));
  }
  return pieces;
}

std::vector<absl::string_view> Views(const std::vector<std::string>& pieces) {
  return std::vector<absl::string_view>(pieces.begin(), pieces.end());
}

std::string Concat(lossd::BytePieces pieces, lossd::ByteRange range) {
  std::string out;
  Require(
      lossd::ForEachPiece(pieces, range, [&](const uint8_t* data, size_t size) {
        out.append(reinterpret_cast<const char*>(data), size);
        return absl::OkStatus();
      }).ok());
  return out;
}

void FuzzUploadChunk(const std::string& bytes, size_t piece) {
  const std::vector<std::string> owned = Cut(bytes, piece);
  const std::vector<absl::string_view> pieces = Views(owned);
  const std::optional<size_t> prefix = lossd::FindUploadChunk(pieces);
  if (!prefix.has_value()) return;
  // Found: protobuf parses the same message as exactly that chunk.
  pb::UploadRequest request;
  Require(request.ParseFromString(bytes));
  Require(request.kind_case() == pb::UploadRequest::kChunk);
  Require(*prefix <= bytes.size());
  Require(request.chunk() == bytes.substr(*prefix));
  // The prefix the client writes for that length is found again (the
  // received one may be a longer, padded encoding of it).
  const size_t length = bytes.size() - *prefix;
  uint8_t encoded[lossd::kMaxChunkPrefixBytes];
  const size_t encoded_bytes = lossd::EncodeChunkPrefix(length, encoded);
  Require(encoded_bytes <= *prefix);
  Require(lossd::ChunkPrefixBytes(encoded, encoded_bytes,
                                  encoded_bytes + length) == encoded_bytes);
}

void FuzzRowBlock(const std::string& bytes, size_t piece) {
  const std::vector<std::string> owned = Cut(bytes, piece);
  const std::vector<absl::string_view> pieces = Views(owned);
  lossd::ByteRange logits;
  lossd::ByteRange targets;
  if (!lossd::FindRowBlock(pieces, &logits, &targets)) return;
  pb::EvaluateRequest request;
  Require(request.ParseFromString(bytes));
  Require(request.kind_case() == pb::EvaluateRequest::kBlock);
  Require(logits.offset + logits.size <= bytes.size());
  Require(targets.offset + targets.size <= bytes.size());
  Require(Concat(pieces, logits) == request.block().logits());
  Require(Concat(pieces, targets) == request.block().targets());
}

void FuzzPreamble(const std::string& bytes) {
  if (bytes.size() < lossd::kDataPreambleBytes) return;
  const std::optional<lossd::DataPreamble> preamble =
      lossd::ParseDataPreamble(bytes.data());
  Require(preamble.has_value() ==
          (bytes.compare(0, lossd::kDataMagicBytes, "LOSSDDC1") == 0));
  if (!preamble.has_value()) return;
  Require(preamble->token.size() == lossd::kDataTokenBytes);
  Require(lossd::EncodeDataPreamble(preamble->token,
                                    static_cast<int>(preamble->index)) ==
          bytes.substr(0, lossd::kDataPreambleBytes));
}

void FuzzFrameRows(const std::string& bytes) {
  if (bytes.size() < lossd::kFrameHeaderBytes) return;
  const uint64_t rows = lossd::DecodeFrameRows(
      reinterpret_cast<const unsigned char*>(bytes.data()));
  char encoded[lossd::kFrameHeaderBytes];
  lossd::EncodeFrameRows(static_cast<int64_t>(rows), encoded);
  Require(bytes.compare(0, lossd::kFrameHeaderBytes, encoded,
                        lossd::kFrameHeaderBytes) == 0);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint8_t selector = data[0];
  const std::string bytes(reinterpret_cast<const char*>(data + 1), size - 1);
  // Pieces of 1 to 63 bytes, or whole.
  const size_t piece = (selector >> 2) == 0 ? bytes.size() + 1 : selector >> 2;
  switch (selector & 3) {
    case 0:
      FuzzUploadChunk(bytes, piece);
      break;
    case 1:
      FuzzRowBlock(bytes, piece);
      break;
    case 2:
      FuzzPreamble(bytes);
      break;
    default:
      FuzzFrameRows(bytes);
      break;
  }
  return 0;
}
