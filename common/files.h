// Reading the small files lossd's flags and options name (PEM certificates
// and keys, the tokens file), with errors that name the flag or option.
#ifndef LOSSD_COMMON_FILES_H_
#define LOSSD_COMMON_FILES_H_

#include <string>

#include "absl/status/statusor.h"

namespace lossd {

// The whole contents of the file at `path`. INVALID_ARGUMENT naming `what`
// (the flag or option that named the file) when it cannot be read or is
// empty. Thread-safe.
absl::StatusOr<std::string> ReadNonEmptyFile(const char* what,
                                             const std::string& path);

}  // namespace lossd

#endif  // LOSSD_COMMON_FILES_H_
