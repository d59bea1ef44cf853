// The protobuf wire format of the two messages lossd moves without parsing:
// UploadRequest chunks and EvaluateRequest row blocks. The client writes a
// chunk's prefix by hand in front of a view of the caller's bytes; the server
// finds a chunk's or a block's bytes inside the received pieces, so that they
// go to the device in one copy. Anything else (a header, an unusual encoding)
// is left to protobuf. No gRPC or protobuf headers here.
#ifndef LOSSD_COMMON_RAW_MESSAGES_H_
#define LOSSD_COMMON_RAW_MESSAGES_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace lossd {

// A message's bytes as the pieces they arrived in (gRPC slices, or one
// string): their concatenation is the message.
using BytePieces = absl::Span<const absl::string_view>;

// A byte range of a message: [offset, offset + size).
struct ByteRange {
  size_t offset = 0;
  size_t size = 0;
};

// The tag of UploadRequest.chunk and of EvaluateRequest.block (field 2,
// length-delimited).
inline constexpr uint8_t kUploadChunkTag = (2 << 3) | 2;
inline constexpr uint8_t kEvaluateBlockTag = (2 << 3) | 2;
// A chunk's tag plus the longest varint.
inline constexpr size_t kMaxChunkPrefixBytes = 11;
// The most varint bytes protobuf accepts in a tag or a length (a longer one,
// even a padded small value, fails its parse).
inline constexpr size_t kMaxVarint32Bytes = 5;

// Writes the prefix of an UploadRequest that is one chunk of `length` bytes
// (the tag, then the length as a varint) to `out`; returns its size. Pure.
size_t EncodeChunkPrefix(uint64_t length, uint8_t out[kMaxChunkPrefixBytes]);

// Where the data of a serialized UploadRequest of `size` bytes starts, when the
// message is exactly one `chunk` field (what every client sends after the
// header); nullopt for anything else. `head` holds its first
// min(size, kMaxChunkPrefixBytes) bytes. Pure.
std::optional<size_t> ChunkPrefixBytes(const uint8_t* head, size_t head_size,
                                       size_t size);

// The total bytes of `pieces`. Pure.
size_t TotalBytes(BytePieces pieces);

// ChunkPrefixBytes of the serialized UploadRequest in `pieces`. Pure.
std::optional<size_t> FindUploadChunk(BytePieces pieces);

// Where the logits and targets of the serialized EvaluateRequest in `pieces`
// lie, when the message is exactly one `block` field (what every
// client sends after the header) and well formed; false for anything else
// (the caller then parses it the protobuf way, which also judges malformed
// bytes). As protobuf does, the last occurrence of a field wins and unknown
// fields are skipped. Pure.
bool FindRowBlock(BytePieces pieces, ByteRange* logits, ByteRange* targets);

// Calls `consume(pointer, size)` (pointer: const uint8_t*) for the parts of
// `range` of `pieces` in order; stops at (and returns) the first error.
template <typename Consume>
absl::Status ForEachPiece(BytePieces pieces, ByteRange range, Consume consume) {
  size_t skip = range.offset;
  size_t left = range.size;
  for (const absl::string_view piece : pieces) {
    if (left == 0) break;
    if (skip >= piece.size()) {
      skip -= piece.size();
      continue;
    }
    const size_t part = std::min(piece.size() - skip, left);
    const absl::Status status =
        consume(reinterpret_cast<const uint8_t*>(piece.data()) + skip, part);
    if (!status.ok()) return status;
    left -= part;
    skip = 0;
  }
  return absl::OkStatus();
}

}  // namespace lossd

#endif  // LOSSD_COMMON_RAW_MESSAGES_H_
