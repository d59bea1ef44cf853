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
  // A row of a vocab near the int64 limit: its bytes and the target's may
  // not add up in int64, and such a row fits no frame either way.
  const std::optional<int64_t> row = CheckedAdd(row_bytes, target_bytes);
  if (!row.has_value() || *row > kMaxFrameBytes) return 0;
  return kMaxFrameBytes / *row;
}

}  // namespace lossd
