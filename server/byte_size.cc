// Byte counts as the flags and the quota file write them ("8G", "512MiB").
// Apart from flags.cc, so that the library parts that read them (quota files)
// do not pull lossd's flag definitions into every binary that links them.
#include "server/byte_size.h"

#include <cstdint>
#include <limits>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace lossd {

absl::StatusOr<int64_t> ParseByteSize(absl::string_view text) {
  const std::string lower =
      absl::AsciiStrToLower(absl::StripAsciiWhitespace(text));
  if (lower == "auto") return 0;
  size_t digits = 0;
  while (digits < lower.size() && absl::ascii_isdigit(lower[digits])) ++digits;
  int64_t value;
  if (digits == 0 || !absl::SimpleAtoi(lower.substr(0, digits), &value)) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", text, "' is not a byte count (e.g. 8G, 512M)"));
  }
  std::string suffix = lower.substr(digits);
  if (!suffix.empty() && suffix.back() == 'b') suffix.pop_back();
  if (suffix.size() == 2 && suffix[1] == 'i') suffix.pop_back();
  int shift;
  if (suffix.empty()) {
    shift = 0;
  } else if (suffix == "k") {
    shift = 10;
  } else if (suffix == "m") {
    shift = 20;
  } else if (suffix == "g") {
    shift = 30;
  } else if (suffix == "t") {
    shift = 40;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("'", text, "': unknown suffix (K, M, G or T)"));
  }
  if (value > (std::numeric_limits<int64_t>::max() >> shift)) {
    return absl::InvalidArgumentError(absl::StrCat("'", text, "' overflows"));
  }
  return value << shift;
}

}  // namespace lossd
