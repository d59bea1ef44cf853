// The client end of a data connection (lossd.v1 Upload, Download or Evaluate
// with a data_token): the bytes of a large transfer over plain TCP to the
// server's data port, beside the gRPC stream that carries the header and the
// result.
#ifndef LOSSD_CLIENT_DATA_CONNECTION_H_
#define LOSSD_CLIENT_DATA_CONNECTION_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

namespace lossd {

// The host part of a gRPC target: "host:port", "dns:///host:port",
// "ipv4:1.2.3.4:port", "ipv6:[::1]:port" or "[::1]:port" give the host
// without brackets; nullopt for targets without a TCP host (unix sockets,
// several addresses, an unknown scheme). Pure.
std::optional<std::string> TargetHost(absl::string_view target);

// 16 random bytes from the kernel's generator, for TensorHeader.data_token.
absl::StatusOr<std::string> RandomDataToken();

// A TCP socket to host:port, connected within `connect_timeout`, whose
// sends and receives fail after `io_timeout` without progress; the caller
// closes it. UNAVAILABLE when it cannot connect in time.
absl::StatusOr<int> ConnectDataPort(
    const std::string& host, int port, absl::Duration connect_timeout,
    absl::Duration io_timeout = absl::Seconds(60));

// Receives exactly `bytes` bytes into `out` from data connection `fd`,
// calling on_received(n) as pieces arrive. UNAVAILABLE when the connection
// ends early or fails (the server ended the transfer: its reason is the
// RPC's status), DEADLINE_EXCEEDED when nothing came for io_timeout.
absl::Status ReceiveOverDataConnection(
    int fd, char* out, std::size_t bytes,
    const std::function<void(std::size_t)>& on_received);

// The pieces of a data connection's sending side: the preamble
// ("LOSSDDC1", the token, `index` as 4 bytes little-endian); one Evaluate
// frame (`rows` as 8 bytes little-endian, then its `parts`, the rows'
// logits, targets and further inputs in the order of common/data_wire.h's
// FramePart, absent ones empty); the end of sending. Statuses as
// SendOverDataConnection's.
absl::Status SendDataPreamble(int fd, const std::string& token, int index);
absl::Status SendEvaluateFrame(int fd, int64_t rows,
                               absl::Span<const absl::string_view> parts);
absl::Status EndDataSending(int fd);
// `bytes` bytes of `data` on a data connection whose preamble went before
// (an upload's bytes, piece by piece; EndDataSending after the last, which
// the server waits for). Statuses as SendOverDataConnection's.
absl::Status SendDataBytes(int fd, const char* data, std::size_t bytes);

// Sends the preamble ("LOSSDDC1", the token, `index` as 4 bytes
// little-endian), then `bytes` bytes of `data`, calling on_sent(n) as pieces
// go out, then closes the sending side. UNAVAILABLE when the connection
// fails (usually the server ended the transfer: its reason is the Upload
// RPC's status), DEADLINE_EXCEEDED when the server took nothing for
// io_timeout.
absl::Status SendOverDataConnection(
    int fd, const std::string& token, int index, const char* data,
    std::size_t bytes, const std::function<void(std::size_t)>& on_sent);

}  // namespace lossd

#endif  // LOSSD_CLIENT_DATA_CONNECTION_H_
