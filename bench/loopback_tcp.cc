// The sockets of bench/loopback_tcp.h.
#include "bench/loopback_tcp.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace loopback_tcp {

namespace {

absl::Status Failed(const char* step) {
  return absl::UnavailableError(
      absl::StrCat("raw TCP ", step, ": ", std::strerror(errno)));
}

}  // namespace

absl::StatusOr<Connections> Connect(int count) {
  const int listener = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(address);
  if (listener < 0 ||
      bind(listener, reinterpret_cast<sockaddr*>(&address), length) != 0 ||
      listen(listener, count) != 0 ||
      getsockname(listener, reinterpret_cast<sockaddr*>(&address), &length) !=
          0) {
    const absl::Status status = Failed("listen");
    if (listener >= 0) close(listener);
    return status;
  }
  Connections connections;
  absl::Status status;
  for (int i = 0; i < count && status.ok(); ++i) {
    const int sender = socket(AF_INET, SOCK_STREAM, 0);
    if (sender < 0 ||
        connect(sender, reinterpret_cast<sockaddr*>(&address), length) != 0) {
      status = Failed("connect");
      if (sender >= 0) close(sender);
      break;
    }
    connections.senders.push_back(sender);
    const int receiver = accept(listener, nullptr, nullptr);
    if (receiver < 0) {
      status = Failed("accept");
      break;
    }
    connections.receivers.push_back(receiver);
  }
  close(listener);
  if (!status.ok()) {
    for (int fd : connections.senders) close(fd);
    for (int fd : connections.receivers) close(fd);
    return status;
  }
  return connections;
}

}  // namespace loopback_tcp
