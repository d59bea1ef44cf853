// The wire format of data connections (lossd.v1 Upload, Download and Evaluate
// with a data_token; docs/design.md §3): the 28-byte preamble every connection
// opens with and the frames of an Evaluate. Client and server both speak it
// through these functions; no sockets here.
#ifndef LOSSD_COMMON_DATA_WIRE_H_
#define LOSSD_COMMON_DATA_WIRE_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "absl/strings/string_view.h"

namespace lossd {

// A data connection starts with these 8 bytes, the 16-byte token and its
// index among the transfer's connections (4 bytes, little-endian). An
// upload's connection then carries exactly its part's bytes and closes its
// sending side (shutdown SHUT_WR): the server reads past the last byte to
// know that no more follow, and a byte more fails the upload like a byte
// less.
inline constexpr char kDataConnectionMagic[] = "LOSSDDC1";
inline constexpr size_t kDataMagicBytes = sizeof(kDataConnectionMagic) - 1;
inline constexpr size_t kDataTokenBytes = 16;
inline constexpr size_t kDataPreambleBytes =
    kDataMagicBytes + kDataTokenBytes + 4;
// The most connections of one transfer (TensorHeader.data_connections).
inline constexpr int kMaxDataConnections = 64;

// The preamble of connection `index` of the transfer of `token`. Requires a
// token of kDataTokenBytes and 0 <= index. Pure.
std::string EncodeDataPreamble(absl::string_view token, int index);

// What a preamble names.
struct DataPreamble {
  std::string token;
  uint32_t index = 0;  // as sent: the caller checks the range
};

// The token and index of the kDataPreambleBytes at `bytes`; nullopt when they
// do not start with kDataConnectionMagic. Pure.
std::optional<DataPreamble> ParseDataPreamble(const char* bytes);

// An Evaluate frame on a data connection: its row count R >= 1 as 8 bytes
// little-endian, then R rows of logits and R targets, then the per-row
// inputs the header declares (EvaluateFrameLayout).
inline constexpr size_t kFrameHeaderBytes = 8;
// The most bytes (all of its parts: logits, targets and the other inputs)
// one frame may carry, as one block message on the stream.
inline constexpr int64_t kMaxFrameBytes = int64_t{64} << 20;

// The parts of an Evaluate frame after its row count, in the order the frame
// carries them: each is R entries of its bytes a row, or absent (0 bytes a
// row) where the header declares none. They are the fields of a RowBlock on
// the stream, so a frame holds exactly what a block would.
enum FramePart : int {
  kFrameRows = 0,           // logits [R, V] (or hidden states [R, H])
  kFrameTargets,            // [R] of targets_dtype; absent when UNSPECIFIED
  kFrameTeacherLogits,      // [R, V] of teacher_logits_dtype
  kFrameTeacherIndices,     // [R, k] of teacher_indices_dtype
  kFrameTeacherLogprobs,    // [R, k] fp32
  kFrameSegmentIds,         // [R] int32
  kFrameAdvantages,         // [R] fp32
  kFrameSamplingLogprobs,   // [R] fp32
  kFrameReferenceLogprobs,  // [R] fp32, with policy_reference_logprobs
  kFrameParts
};

// The RowBlock field name of `part` ("logits", "teacher_indices", ...), for
// messages. Pure.
const char* FramePartName(FramePart part);

// What an Evaluate header declares beyond the rows and their targets.
struct FrameInputs {
  int64_t teacher_row_bytes = 0;  // a dense teacher: V * its dtype's size
  int64_t top_k = 0;              // a top-k teacher: k ...
  int64_t index_bytes = 0;        // ... and the size of one index (4 or 8)
  bool segments = false;
  bool policy = false;
  bool reference_logprobs = false;  // with a policy
};

// The bytes a row of each part of an Evaluate's frames.
struct EvaluateFrameLayout {
  std::array<int64_t, kFrameParts> row_bytes{};

  // The bytes of one row, all parts together; nullopt beyond int64.
  std::optional<int64_t> TotalRowBytes() const;
};

// The layout of frames of rows of `row_bytes` (logits or hidden states) and
// targets of `target_bytes` (0: none) with `inputs`. Pure.
EvaluateFrameLayout MakeEvaluateFrameLayout(int64_t row_bytes,
                                            int64_t target_bytes,
                                            const FrameInputs& inputs);

// The frame header of `rows` rows into `out`. Pure.
void EncodeFrameRows(int64_t rows, char out[kFrameHeaderBytes]);
// The row count of the frame header at `header`, as sent (unchecked). Pure.
uint64_t DecodeFrameRows(const unsigned char header[kFrameHeaderBytes]);
// The most rows a frame may carry when a row is `row_bytes` of logits and its
// target `target_bytes` (both > 0): 0 when not even one row fits (their sum
// beyond int64 included). Pure.
int64_t MaxFrameRows(int64_t row_bytes, int64_t target_bytes);
// The same for rows of every part of `layout` (at least one byte a row).
int64_t MaxFrameRows(const EvaluateFrameLayout& layout);

}  // namespace lossd

#endif  // LOSSD_COMMON_DATA_WIRE_H_
