// Data-connection checks and ranges (data_connection_checks.h).
#include "server/data_connection_checks.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/data_wire.h"
#include "common/tensor_math.h"

namespace lossd {

void RefuseDataToken(const RpcSupport& rpc, const std::string& token) {
  if (!token.empty() && rpc.data_plane() != nullptr) {
    rpc.data_plane()->Refuse(token);
  }
}

absl::Status CheckDataConnections(const RpcSupport& rpc,
                                  const std::string& token, int connections,
                                  const char* otherwise) {
  if (token.empty()) {
    if (connections != 0) {
      return absl::InvalidArgumentError(
          "data_connections without a data_token");
    }
    return absl::OkStatus();
  }
  if (rpc.data_plane() == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("this server offers no data connections "
                     "(ServerInfo.data_port is 0); ",
                     otherwise));
  }
  if (token.size() != kDataTokenBytes) {
    return absl::InvalidArgumentError(
        absl::StrFormat("a data_token must be %d bytes, got %d",
                        kDataTokenBytes, token.size()));
  }
  if (connections < 0 || connections > kMaxDataConnections) {
    return absl::InvalidArgumentError(
        absl::StrFormat("data_connections must be in [0, %d], got %d",
                        kMaxDataConnections, connections));
  }
  return absl::OkStatus();
}

std::vector<DataTransfer::Range> DataRanges(int64_t elements,
                                            int64_t element_bytes,
                                            int connections) {
  std::vector<DataTransfer::Range> ranges;
  for (int i = 0; i < connections; ++i) {
    const ElementRange range = StripeElements(elements, i, connections);
    ranges.push_back({range.first * element_bytes,
                      (range.end - range.first) * element_bytes});
  }
  return ranges;
}

}  // namespace lossd
