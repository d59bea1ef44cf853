// Echo: the one way a client value appears in an error message.
#include "common/echo.h"

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace lossd {

std::string Echo(absl::string_view value) {
  if (value.size() <= kEchoPrefixBytes) {
    return absl::StrCat("'", absl::CHexEscape(value), "'");
  }
  return absl::StrCat("'", absl::CHexEscape(value.substr(0, kEchoPrefixBytes)),
                      "...' (", value.size(), " bytes)");
}

}  // namespace lossd
