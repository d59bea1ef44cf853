// Byte counts as lossd's flags and quota file write them.
#ifndef LOSSD_SERVER_BYTE_SIZE_H_
#define LOSSD_SERVER_BYTE_SIZE_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace lossd {

// Parses a byte count: digits with an optional binary suffix K, M, G or T
// (also Ki/KiB/KB..., all powers of 1024), e.g. "8G", "512MiB", "1048576".
// "auto" and "0" give 0. INVALID_ARGUMENT for anything else or an overflow.
// Pure; thread-safe.
absl::StatusOr<int64_t> ParseByteSize(absl::string_view text);

}  // namespace lossd

#endif  // LOSSD_SERVER_BYTE_SIZE_H_
