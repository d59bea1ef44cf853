// The data connections' wire format (data_wire.h).
#include "common/data_wire.h"

#include <cstring>

#include "common/checked_math.h"

namespace lossd {

std::string EncodeDataPreamble(absl::string_view token, int index) {
  std::string preamble(kDataConnectionMagic, kDataMagicBytes);
  preamble.append(token.data(), token.size());
  for (int shift = 0; shift < 32; shift += 8) {
    preamble.push_back(
        static_cast<char>((static_cast<uint32_t>(index) >> shift) & 0xff));
  }
  return preamble;
}

std::optional<DataPreamble> ParseDataPreamble(const char* bytes) {
  if (std::memcmp(bytes, kDataConnectionMagic, kDataMagicBytes) != 0) {
    return std::nullopt;
  }
  DataPreamble preamble;
  preamble.token.assign(bytes + kDataMagicBytes, kDataTokenBytes);
  const unsigned char* at = reinterpret_cast<const unsigned char*>(
      bytes + kDataMagicBytes + kDataTokenBytes);
  preamble.index = at[0] | (at[1] << 8) | (at[2] << 16) |
                   (static_cast<uint32_t>(at[3]) << 24);
  return preamble;
}

void EncodeFrameRows(int64_t rows, char out[kFrameHeaderBytes]) {
  for (size_t i = 0; i < kFrameHeaderBytes; ++i) {
    out[i] = static_cast<char>((static_cast<uint64_t>(rows) >> (8 * i)) & 0xff);
  }
}

uint64_t DecodeFrameRows(const unsigned char header[kFrameHeaderBytes]) {
  uint64_t rows = 0;
  for (int i = kFrameHeaderBytes - 1; i >= 0; --i) {
    rows = (rows << 8) | header[i];
  }
  return rows;
}

int64_t MaxFrameRows(int64_t row_bytes, int64_t target_bytes) {
  EvaluateFrameLayout layout;
  layout.row_bytes[kFrameRows] = row_bytes;
  layout.row_bytes[kFrameTargets] = target_bytes;
  return MaxFrameRows(layout);
}

int64_t MaxFrameRows(const EvaluateFrameLayout& layout) {
  // A row of a vocab near the int64 limit: its parts may not add up in
  // int64, and such a row fits no frame either way.
  const std::optional<int64_t> row = layout.TotalRowBytes();
  if (!row.has_value() || *row < 1 || *row > kMaxFrameBytes) return 0;
  return kMaxFrameBytes / *row;
}

const char* FramePartName(FramePart part) {
  switch (part) {
    case kFrameRows:
      return "logits";
    case kFrameTargets:
      return "targets";
    case kFrameTeacherLogits:
      return "teacher_logits";
    case kFrameTeacherIndices:
      return "teacher_indices";
    case kFrameTeacherLogprobs:
      return "teacher_logprobs";
    case kFrameSegmentIds:
      return "segment_ids";
    case kFrameAdvantages:
      return "advantages";
    case kFrameSamplingLogprobs:
      return "sampling_logprobs";
    case kFrameReferenceLogprobs:
      return "reference_logprobs";
    case kFrameParts:
      break;
  }
  return "?";
}

std::optional<int64_t> EvaluateFrameLayout::TotalRowBytes() const {
  std::optional<int64_t> total = 0;
  for (const int64_t bytes : row_bytes) {
    total = CheckedAdd(*total, bytes);
    if (!total.has_value()) return std::nullopt;
  }
  return total;
}

EvaluateFrameLayout MakeEvaluateFrameLayout(int64_t row_bytes,
                                            int64_t target_bytes,
                                            const FrameInputs& inputs) {
  EvaluateFrameLayout layout;
  std::array<int64_t, kFrameParts>& parts = layout.row_bytes;
  parts[kFrameRows] = row_bytes;
  parts[kFrameTargets] = target_bytes;
  parts[kFrameTeacherLogits] = inputs.teacher_row_bytes;
  // k <= 512 and an index of at most 8 bytes: no overflow.
  parts[kFrameTeacherIndices] = inputs.top_k * inputs.index_bytes;
  parts[kFrameTeacherLogprobs] = inputs.top_k * 4;
  parts[kFrameSegmentIds] = inputs.segments ? 4 : 0;
  parts[kFrameAdvantages] = inputs.policy ? 4 : 0;
  parts[kFrameSamplingLogprobs] = inputs.policy ? 4 : 0;
  parts[kFrameReferenceLogprobs] =
      inputs.policy && inputs.reference_logprobs ? 4 : 0;
  return layout;
}

}  // namespace lossd
