// Client values (handles, labels, ids) quoted in error messages: a long one
// would make the message, and the status metadata carrying it, as long as the
// value itself, so only a short prefix of it is ever echoed.
#ifndef LOSSD_COMMON_ECHO_H_
#define LOSSD_COMMON_ECHO_H_

#include <cstddef>
#include <string>

#include "absl/strings/string_view.h"

namespace lossd {

// The most bytes of a client value that an error message quotes.
inline constexpr std::size_t kEchoPrefixBytes = 48;

// `value` quoted for an error message, C-escaped (so control bytes and broken
// UTF-8 stay printable): 'value' whole when it has at most kEchoPrefixBytes
// bytes, else its first kEchoPrefixBytes bytes, "..." and its size, as in
// 'abcd...' (7000 bytes). At most 4 * kEchoPrefixBytes + 32 characters.
// Pure; thread-safe.
std::string Echo(absl::string_view value);

}  // namespace lossd

#endif  // LOSSD_COMMON_ECHO_H_
