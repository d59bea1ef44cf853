// Reading small named files (files.h).
#include "common/files.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace lossd {

absl::StatusOr<std::string> ReadNonEmptyFile(const char* what,
                                             const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": cannot read '", path, "': ", std::strerror(errno)));
  }
  std::ostringstream contents;
  contents << in.rdbuf();
  if (contents.str().empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": '", path, "' is empty"));
  }
  return contents.str();
}

}  // namespace lossd
