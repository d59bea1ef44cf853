// The client end of a data connection (data_connection.h).
#include "client/data_connection.h"

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/data_wire.h"
#include "common/status_macros.h"

namespace lossd {

namespace {

// What one send() is given: progress is reported at this granularity.
constexpr std::size_t kSendPiece = std::size_t{4} << 20;

// UNAVAILABLE, or DEADLINE_EXCEEDED when the socket's timeout ran out (no
// progress for the io_timeout of ConnectDataPort).
absl::Status Errno(const std::string& what) {
  if (errno == EAGAIN || errno == EWOULDBLOCK) {
    return absl::DeadlineExceededError(
        absl::StrCat(what, ": no progress within the data connection timeout"));
  }
  return absl::UnavailableError(absl::StrCat(what, ": ", std::strerror(errno)));
}

absl::Status SendAll(int fd, const char* data, std::size_t bytes) {
  while (bytes > 0) {
    const ssize_t n = send(fd, data, bytes, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      return Errno("data connection send");
    }
    data += n;
    bytes -= static_cast<std::size_t>(n);
  }
  return absl::OkStatus();
}

}  // namespace

std::optional<std::string> TargetHost(absl::string_view target) {
  if (absl::ConsumePrefix(&target, "dns:")) {
    // dns:[//authority/]host[:port]
    if (absl::ConsumePrefix(&target, "//")) {
      const size_t slash = target.find('/');
      if (slash == absl::string_view::npos) return std::nullopt;
      target.remove_prefix(slash + 1);
    }
  } else if (absl::ConsumePrefix(&target, "ipv4:") ||
             absl::ConsumePrefix(&target, "ipv6:")) {
    if (target.find(',') != absl::string_view::npos) return std::nullopt;
  } else if (target.find("://") != absl::string_view::npos ||
             absl::StartsWith(target, "unix:") ||
             absl::StartsWith(target, "unix-abstract:") ||
             absl::StartsWith(target, "vsock:")) {
    return std::nullopt;
  }
  if (target.empty()) return std::nullopt;
  if (target.front() == '[') {
    const size_t close = target.find(']');
    if (close == absl::string_view::npos || close == 1) return std::nullopt;
    return std::string(target.substr(1, close - 1));
  }
  const size_t colon = target.rfind(':');
  if (colon != absl::string_view::npos && target.find(':') != colon) {
    return std::string(target);  // a bare IPv6 address without a port
  }
  const absl::string_view host =
      colon == absl::string_view::npos ? target : target.substr(0, colon);
  if (host.empty()) return std::nullopt;
  return std::string(host);
}

absl::StatusOr<std::string> RandomDataToken() {
  std::string token(kDataTokenBytes, '\0');
  std::size_t got = 0;
  while (got < token.size()) {
    const ssize_t n = getrandom(token.data() + got, token.size() - got, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      return absl::InternalError(
          absl::StrCat("getrandom: ", std::strerror(errno)));
    }
    got += static_cast<std::size_t>(n);
  }
  return token;
}

absl::StatusOr<int> ConnectDataPort(const std::string& host, int port,
                                    absl::Duration connect_timeout,
                                    absl::Duration io_timeout) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  const int resolved =
      getaddrinfo(host.c_str(), service.c_str(), &hints, &found);
  if (resolved != 0) {
    return absl::UnavailableError(
        absl::StrCat("data connection: cannot resolve ", host, ": ",
                     gai_strerror(resolved)));
  }
  const absl::Time deadline = absl::Now() + connect_timeout;
  absl::Status status = absl::UnavailableError(
      absl::StrCat("data connection: no address for ", host));
  int connected = -1;
  for (addrinfo* at = found; at != nullptr && connected < 0; at = at->ai_next) {
    const int fd =
        socket(at->ai_family, at->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK,
               at->ai_protocol);
    if (fd < 0) {
      status = Errno("data connection socket");
      continue;
    }
    int result = connect(fd, at->ai_addr, at->ai_addrlen);
    if (result != 0 && errno == EINPROGRESS) {
      pollfd wait = {fd, POLLOUT, 0};
      const int64_t millis = std::max<int64_t>(
          0, absl::ToInt64Milliseconds(deadline - absl::Now()));
      int error = ETIMEDOUT;
      if (poll(&wait, 1, static_cast<int>(millis)) == 1) {
        socklen_t length = sizeof(error);
        getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &length);
      }
      errno = error;
      result = error == 0 ? 0 : -1;
    }
    if (result != 0) {
      status = Errno(absl::StrCat("data connection to ", host, ":", port));
      close(fd);
      continue;
    }
    // Blocking from here on: the sender has nothing else to do.
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
    const timeval limit = absl::ToTimeval(io_timeout);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &limit, sizeof(limit));
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &limit, sizeof(limit));
    connected = fd;
  }
  freeaddrinfo(found);
  if (connected < 0) return status;
  return connected;
}

absl::Status SendDataPreamble(int fd, const std::string& token, int index) {
  const std::string preamble = EncodeDataPreamble(token, index);
  return SendAll(fd, preamble.data(), preamble.size());
}

absl::Status SendEvaluateFrame(int fd, int64_t rows,
                               absl::Span<const absl::string_view> parts) {
  char head[kFrameHeaderBytes];
  EncodeFrameRows(rows, head);
  RETURN_IF_ERROR(SendAll(fd, head, sizeof(head)));
  for (const absl::string_view part : parts) {
    RETURN_IF_ERROR(SendAll(fd, part.data(), part.size()));
  }
  return absl::OkStatus();
}

absl::Status SendDataBytes(int fd, const char* data, std::size_t bytes) {
  return SendAll(fd, data, bytes);
}

absl::Status EndDataSending(int fd) {
  if (shutdown(fd, SHUT_WR) != 0) return Errno("data connection shutdown");
  return absl::OkStatus();
}

absl::Status SendOverDataConnection(
    int fd, const std::string& token, int index, const char* data,
    std::size_t bytes, const std::function<void(std::size_t)>& on_sent) {
  RETURN_IF_ERROR(SendDataPreamble(fd, token, index));
  for (std::size_t sent = 0; sent < bytes;) {
    const std::size_t n = std::min(kSendPiece, bytes - sent);
    if (const absl::Status status = SendAll(fd, data + sent, n); !status.ok()) {
      return status;
    }
    sent += n;
    if (on_sent) on_sent(n);
  }
  return EndDataSending(fd);
}

absl::Status ReceiveOverDataConnection(
    int fd, char* out, std::size_t bytes,
    const std::function<void(std::size_t)>& on_received) {
  for (std::size_t got = 0; got < bytes;) {
    const std::size_t want = std::min(kSendPiece, bytes - got);
    const ssize_t n = recv(fd, out + got, want, MSG_WAITALL);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return Errno("data connection receive");
    if (n == 0) {
      return absl::UnavailableError(absl::StrCat(
          "the data connection ended after ", got, " of ", bytes, " bytes"));
    }
    got += static_cast<std::size_t>(n);
    if (on_received) on_received(static_cast<std::size_t>(n));
  }
  return absl::OkStatus();
}

}  // namespace lossd
