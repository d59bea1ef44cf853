// The shape of a tensor handle, "<instance id>-<random>", in one place: the
// server makes handles of it and refuses anything else before a lookup, and
// the routing client reads the instance id out of it.
#ifndef LOSSD_COMMON_HANDLE_H_
#define LOSSD_COMMON_HANDLE_H_

#include <cstddef>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace lossd {

// A handle is kHandleInstanceHexDigits lower-case hex digits (the instance
// id), '-', kHandleRandomHexDigits lower-case hex digits (128 random bits).
inline constexpr std::size_t kHandleInstanceHexDigits = 8;
inline constexpr std::size_t kHandleRandomHexDigits = 32;
inline constexpr std::size_t kHandleLength =
    kHandleInstanceHexDigits + 1 + kHandleRandomHexDigits;

// Whether `handle` has the shape above. Pure; thread-safe.
bool IsWellFormedHandle(absl::string_view handle);

// OK for a well-formed handle. INVALID_ARGUMENT naming `field`, the expected
// shape and (cut to a prefix, common/echo.h) what was received: "empty
// handle" for an empty one, "malformed handle" for any other. Pure;
// thread-safe.
absl::Status CheckHandle(absl::string_view handle, absl::string_view field);

}  // namespace lossd

#endif  // LOSSD_COMMON_HANDLE_H_
