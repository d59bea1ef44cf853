// What an Upload, Evaluate or Download request says of data connections,
// checked against the server's data plane, and the byte ranges each
// connection carries.
#ifndef LOSSD_SERVER_DATA_CONNECTION_CHECKS_H_
#define LOSSD_SERVER_DATA_CONNECTION_CHECKS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "server/admission.h"
#include "server/data_plane.h"

namespace lossd {

// A refused request that named data connections: they are closed as they
// come, instead of waiting for a registration that will not come.
void RefuseDataToken(const RpcSupport& rpc, const std::string& token);

// The data_token and data_connections of an Upload or Evaluate header or a
// Download request: OK when there is no token (and no count), or a token the
// data plane can take; `otherwise` says what the client can do instead.
absl::Status CheckDataConnections(const RpcSupport& rpc,
                                  const std::string& token, int connections,
                                  const char* otherwise);

// The byte ranges of `connections` data connections carrying `elements`
// elements of `element_bytes` each: connection i the elements of stripe i.
std::vector<DataTransfer::Range> DataRanges(int64_t elements,
                                            int64_t element_bytes,
                                            int connections);

}  // namespace lossd

#endif  // LOSSD_SERVER_DATA_CONNECTION_CHECKS_H_
