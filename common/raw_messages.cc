// Chunk prefixes and row blocks in protobuf's wire format (raw_messages.h).
#include "common/raw_messages.h"

#include <cstring>

namespace lossd {

namespace {

// A forward-only reader of the concatenation of `pieces` (borrowed).
class PieceReader {
 public:
  explicit PieceReader(BytePieces pieces) : pieces_(pieces) {}

  size_t position() const { return position_; }

  // False at the end of the bytes.
  bool ReadByte(uint8_t* byte) {
    while (piece_ < pieces_.size() && in_piece_ == pieces_[piece_].size()) {
      ++piece_;
      in_piece_ = 0;
    }
    if (piece_ == pieces_.size()) return false;
    *byte = static_cast<uint8_t>(pieces_[piece_][in_piece_++]);
    ++position_;
    return true;
  }

  // A base-128 varint of at most `max_bytes` bytes; false when cut short or
  // longer.
  bool ReadVarint(uint64_t* value, size_t max_bytes = 10) {
    *value = 0;
    for (size_t i = 0; i < max_bytes; ++i) {
      uint8_t byte;
      if (!ReadByte(&byte)) return false;
      *value |= static_cast<uint64_t>(byte & 0x7f) << (7 * i);
      if ((byte & 0x80) == 0) return true;
    }
    return false;
  }

  // Skips `bytes`; false when fewer remain than `limit - position()` allows.
  bool Skip(uint64_t bytes, size_t limit) {
    if (bytes > limit - position_) return false;
    size_t left = static_cast<size_t>(bytes);
    position_ += left;
    while (left > 0) {
      const size_t here = pieces_[piece_].size() - in_piece_;
      const size_t step = std::min(here, left);
      in_piece_ += step;
      left -= step;
      if (in_piece_ == pieces_[piece_].size() && left > 0) {
        ++piece_;
        in_piece_ = 0;
      }
    }
    return true;
  }

 private:
  const BytePieces pieces_;
  size_t piece_ = 0;
  size_t in_piece_ = 0;
  size_t position_ = 0;
};

}  // namespace

size_t EncodeChunkPrefix(uint64_t length, uint8_t out[kMaxChunkPrefixBytes]) {
  out[0] = kUploadChunkTag;
  size_t bytes = 1;
  for (uint64_t left = length;; left >>= 7) {
    out[bytes++] =
        static_cast<uint8_t>((left & 0x7f) | (left > 0x7f ? 0x80 : 0));
    if (left <= 0x7f) break;
  }
  return bytes;
}

std::optional<size_t> ChunkPrefixBytes(const uint8_t* head, size_t head_size,
                                       size_t size) {
  if (head_size < 2 || head[0] != kUploadChunkTag) return std::nullopt;
  uint64_t length = 0;
  // Protobuf rejects a length of more than 5 varint bytes; the parse judges.
  for (size_t i = 1; i < head_size && i <= kMaxVarint32Bytes; ++i) {
    length |= static_cast<uint64_t>(head[i] & 0x7f) << (7 * (i - 1));
    if ((head[i] & 0x80) == 0) {
      const size_t prefix = i + 1;
      if (size - prefix != length) return std::nullopt;
      return prefix;
    }
  }
  return std::nullopt;
}

size_t TotalBytes(BytePieces pieces) {
  size_t total = 0;
  for (const absl::string_view piece : pieces) total += piece.size();
  return total;
}

std::optional<size_t> FindUploadChunk(BytePieces pieces) {
  const size_t size = TotalBytes(pieces);
  uint8_t head[kMaxChunkPrefixBytes];
  size_t head_size = 0;
  for (const absl::string_view piece : pieces) {
    const size_t n = std::min(piece.size(), kMaxChunkPrefixBytes - head_size);
    if (n == 0) continue;  // an empty piece's data may be null
    std::memcpy(head + head_size, piece.data(), n);
    head_size += n;
    if (head_size == kMaxChunkPrefixBytes) break;
  }
  return ChunkPrefixBytes(head, head_size, size);
}

bool FindRowBlock(BytePieces pieces, ByteRange* logits, ByteRange* targets) {
  const size_t size = TotalBytes(pieces);
  PieceReader reader(pieces);
  uint8_t tag;
  uint64_t length;
  if (!reader.ReadByte(&tag) || tag != kEvaluateBlockTag ||
      !reader.ReadVarint(&length, kMaxVarint32Bytes) ||
      length != size - reader.position()) {
    return false;
  }
  *logits = ByteRange();
  *targets = ByteRange();
  while (reader.position() < size) {
    uint64_t key;
    // Keys and lengths that protobuf would reject (or, for a 5-byte key past
    // 32 bits, truncate) are left to its parse.
    if (!reader.ReadVarint(&key, kMaxVarint32Bytes) || key > UINT32_MAX) {
      return false;
    }
    const uint64_t field = key >> 3;
    uint64_t value;
    switch (key & 7) {
      case 0:  // varint
        if (!reader.ReadVarint(&value)) return false;
        break;
      case 1:  // fixed64
        if (!reader.Skip(8, size)) return false;
        break;
      case 2: {  // length-delimited
        if (!reader.ReadVarint(&value, kMaxVarint32Bytes) ||
            value > size - reader.position()) {
          return false;
        }
        const ByteRange range{reader.position(), static_cast<size_t>(value)};
        if (field == 1) *logits = range;
        if (field == 2) *targets = range;
        if (!reader.Skip(value, size)) return false;
        break;
      }
      case 5:  // fixed32
        if (!reader.Skip(4, size)) return false;
        break;
      default:  // groups, invalid wire types
        return false;
    }
    if (field == 0) return false;
  }
  return true;
}

}  // namespace lossd
