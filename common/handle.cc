// CheckHandle: the handle shape of handle.h.
#include "common/handle.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/echo.h"

namespace lossd {
namespace {

bool IsLowerHex(absl::string_view text) {
  return std::all_of(text.begin(), text.end(), [](char c) {
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
  });
}

}  // namespace

bool IsWellFormedHandle(absl::string_view handle) {
  return handle.size() == kHandleLength &&
         handle[kHandleInstanceHexDigits] == '-' &&
         IsLowerHex(handle.substr(0, kHandleInstanceHexDigits)) &&
         IsLowerHex(handle.substr(kHandleInstanceHexDigits + 1));
}

absl::Status CheckHandle(absl::string_view handle, absl::string_view field) {
  if (IsWellFormedHandle(handle)) return absl::OkStatus();
  const std::string expected = absl::StrCat(
      "a handle is ", kHandleInstanceHexDigits, " lower-case hex digits, '-', ",
      kHandleRandomHexDigits, " lower-case hex digits (", kHandleLength,
      " characters), as Upload returns it");
  if (handle.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": empty handle; ", expected));
  }
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": malformed handle ", Echo(handle), "; ", expected));
}

}  // namespace lossd
