// Data connections (data_plane.h): a listener thread, one thread per
// connection, and the registry of transfers announced by Upload headers.
#include "server/data_plane.h"

#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "server/metrics.h"

namespace lossd {

namespace {

// How often the listener looks for overdue transfers.
constexpr int kSweepMillis = 250;
// The most one host window takes (a host-accessible device lends the
// destination itself): progress reaches the metrics at least this often.
constexpr int64_t kMaxWindowBytes = int64_t{16} << 20;
// How long a refused token is remembered: its connections are closed at once
// meanwhile, rather than waiting for a registration that will not come.
constexpr absl::Duration kRegistrationWait = absl::Seconds(10);
constexpr size_t kMaxRefusedTokens = 4096;
// What AwaitEndOfSending reads at once when more bytes come: enough to say
// how many at least, without reading an unbounded amount.
constexpr size_t kOverrunProbeBytes = 4096;

absl::Status ErrnoStatus(const std::string& what) {
  return absl::UnavailableError(absl::StrCat(what, ": ", std::strerror(errno)));
}

// Reads exactly `bytes` into `out` (a preamble) by `deadline`, however the
// peer spreads them: DEADLINE_EXCEEDED when they do not all come in time,
// INVALID_ARGUMENT when the connection ends or fails first.
absl::Status ReadBy(int fd, char* out, size_t bytes, absl::Time deadline) {
  size_t got = 0;
  while (got < bytes) {
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      return absl::DeadlineExceededError(absl::StrFormat(
          "%d of the %d preamble bytes came in time", got, bytes));
    }
    pollfd ready = {fd, POLLIN, 0};
    const int polled =
        poll(&ready, 1,
             static_cast<int>(absl::ToInt64Milliseconds(absl::Ceil(
                 std::min(left, absl::Seconds(60)), absl::Milliseconds(1)))));
    if (polled <= 0) {
      if (polled == 0 || errno == EINTR) continue;
      return ErrnoStatus("data connection poll");
    }
    const ssize_t n = recv(fd, out + got, bytes - got, MSG_DONTWAIT);
    if (n > 0) {
      got += static_cast<size_t>(n);
    } else if (n < 0 &&
               (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) {
      continue;
    } else {
      return absl::InvalidArgumentError(absl::StrFormat(
          "the connection ended after %d of the %d preamble bytes", got,
          bytes));
    }
  }
  return absl::OkStatus();
}

// The peer address `address` counts under for the unauthenticated
// connections' cap: an IPv4 address (mapped into IPv6 or not), or an IPv6
// address's /64, which one host usually holds whole.
std::string PeerKey(const sockaddr_storage& address) {
  if (address.ss_family == AF_INET) {
    const auto& in = reinterpret_cast<const sockaddr_in&>(address);
    return std::string(reinterpret_cast<const char*>(&in.sin_addr), 4);
  }
  if (address.ss_family == AF_INET6) {
    const auto& in6 = reinterpret_cast<const sockaddr_in6&>(address);
    const char* bytes = reinterpret_cast<const char*>(&in6.sin6_addr);
    if (IN6_IS_ADDR_V4MAPPED(&in6.sin6_addr)) return std::string(bytes + 12, 4);
    return std::string(bytes, 8);
  }
  return std::string();  // a Unix socket or the like: one peer for all
}

}  // namespace

absl::Status DataConnectionError(int index, int64_t done, int64_t bytes,
                                 ssize_t result) {
  if (result == 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("data connection %d ended after %d of its %d bytes",
                        index, done, bytes));
  }
  if (errno == EAGAIN || errno == EWOULDBLOCK) {
    return absl::DeadlineExceededError(absl::StrFormat(
        "data connection %d stalled after %d of %d bytes", index, done, bytes));
  }
  return absl::UnavailableError(
      absl::StrFormat("data connection %d failed after %d of %d bytes: %s",
                      index, done, bytes, std::strerror(errno)));
}

absl::Status AwaitEndOfSending(int fd, int index, int64_t bytes) {
  char extra[kOverrunProbeBytes];
  for (;;) {
    const ssize_t n = recv(fd, extra, sizeof(extra), 0);
    if (n == 0) return absl::OkStatus();
    if (n > 0) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "data connection %d carries %d bytes, but more arrived (at least "
          "%d); send exactly the part's bytes, then close the sending side",
          index, bytes, bytes + static_cast<int64_t>(n)));
    }
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      return absl::DeadlineExceededError(absl::StrFormat(
          "data connection %d sent its %d bytes but did not close its "
          "sending side",
          index, bytes));
    }
    return DataConnectionError(index, bytes, bytes, n);
  }
}

absl::Status SendOnDataConnection(int fd, int index, const char* data,
                                  size_t bytes, int64_t done, int64_t total) {
  for (size_t at = 0; at < bytes;) {
    const ssize_t n = send(fd, data + at, bytes - at, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      return DataConnectionError(index, done + static_cast<int64_t>(at), total,
                                 n < 0 ? n : -1);
    }
    at += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

// ------------------------------------------------------------- DataTransfer

DataTransfer::DataTransfer(std::vector<Range> ranges, Work work, Done done)
    : work_(std::move(work)), done_(std::move(done)) {
  for (const Range& range : ranges) parts_.push_back(Part{range});
  remaining_ = static_cast<int>(parts_.size());
}

void DataTransfer::Cancel() {
  absl::MutexLock lock(&mu_);
  cancelled_ = true;
  for (const Part& part : parts_) {
    if (part.fd >= 0) shutdown(part.fd, SHUT_RDWR);
  }
  mu_.Await(absl::Condition(
      +[](int* writing) { return *writing == 0; }, &writing_));
}

bool DataTransfer::Claim(int index, int fd) {
  absl::MutexLock lock(&mu_);
  if (index < 0 || index >= parts() || cancelled_ || !failure_.ok() ||
      parts_[index].claimed) {
    return false;
  }
  Part& part = parts_[index];
  part.claimed = true;
  part.writing = true;
  part.fd = fd;
  ++writing_;
  return true;
}

bool DataTransfer::cancelled() const {
  absl::MutexLock lock(&mu_);
  return cancelled_;
}

bool DataTransfer::AllClaimed() const {
  absl::MutexLock lock(&mu_);
  for (const Part& part : parts_) {
    if (!part.claimed) return false;
  }
  return true;
}

absl::Status DataTransfer::Run(int index, int fd) {
  Range range;
  {
    absl::MutexLock lock(&mu_);
    range = parts_[index].range;
  }
  return work_(index, fd, range);
}

absl::Status ReceiveThroughWindows(
    Device* device, char* base, int64_t bytes, int fd,
    const std::function<absl::Status(int64_t received, ssize_t n)>& error,
    const std::function<void(int64_t)>& on_received, double* device_seconds) {
  int64_t received = 0;
  absl::Status status;
  while (received < bytes && status.ok()) {
    absl::Time waited = absl::Now();
    absl::StatusOr<Device::HostWindow> window = device->BeginHostWrite(
        base, static_cast<size_t>(received),
        static_cast<size_t>(std::min(bytes - received, kMaxWindowBytes)));
    if (device_seconds != nullptr) {
      *device_seconds += absl::ToDoubleSeconds(absl::Now() - waited);
    }
    if (!window.ok()) return window.status();
    char* const to = static_cast<char*>(window->host);
    size_t got = 0;
    while (got < window->bytes) {
      const ssize_t n = recv(fd, to + got, window->bytes - got, MSG_WAITALL);
      if (n > 0) {
        got += static_cast<size_t>(n);
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      status = error(received + static_cast<int64_t>(got), n);
      break;
    }
    waited = absl::Now();
    const absl::Status committed = device->CommitHostWrite(base, got);
    if (device_seconds != nullptr) {
      *device_seconds += absl::ToDoubleSeconds(absl::Now() - waited);
    }
    if (status.ok()) status = committed;
    received += static_cast<int64_t>(got);
    if (on_received && got > 0) on_received(static_cast<int64_t>(got));
  }
  return status;
}

DataTransfer::Work ReceiveIntoDevice(Device* device, void* buffer,
                                     Metrics* metrics,
                                     const std::string& tenant) {
  return [device, buffer = static_cast<char*>(buffer), metrics, tenant](
             int index, int fd, const DataTransfer::Range& range) {
    // The part's own write pipeline, keyed by its first byte (a part without
    // bytes never writes: its address may be the next part's).
    char* const base = buffer + range.offset;
    if (range.bytes == 0) return AwaitEndOfSending(fd, index, 0);
    absl::Status status = ReceiveThroughWindows(
        device, base, range.bytes, fd,
        [index, &range](int64_t received, ssize_t n) {
          return DataConnectionError(index, received, range.bytes, n);
        },
        [metrics, &tenant](int64_t n) {
          if (metrics != nullptr) {
            metrics->AddTransferBytes(TransferDirection::kUpload, n, tenant);
          }
        });
    // The end of sending overlaps the device's last copies; a byte more fails
    // the upload like a byte less.
    if (status.ok()) status = AwaitEndOfSending(fd, index, range.bytes);
    // Every copy is done (or failed) before the buffer is anyone else's.
    const absl::Status finished = device->FinishWrites(base);
    return status.ok() ? finished : status;
  };
}

void DataTransfer::PartDone(int index, const absl::Status& status) {
  mu_.Lock();
  Part& part = parts_[index];
  part.writing = false;
  part.fd = -1;
  --writing_;
  if (status.ok()) {
    --remaining_;
  } else if (failure_.ok()) {
    failure_ = status;
    // The other parts stop; the outcome waits for their writes to end.
    for (const Part& other : parts_) {
      if (other.fd >= 0) shutdown(other.fd, SHUT_RDWR);
    }
  }
  DeliverAndUnlock();
}

void DataTransfer::Fail(const absl::Status& status) {
  mu_.Lock();
  if (failure_.ok() && remaining_ > 0) {
    failure_ = status;
    for (const Part& part : parts_) {
      if (part.fd >= 0) shutdown(part.fd, SHUT_RDWR);
    }
  }
  DeliverAndUnlock();
}

void DataTransfer::DeliverAndUnlock() {
  const bool decided = !failure_.ok() || remaining_ == 0;
  if (delivered_ || cancelled_ || writing_ > 0 || !decided) {
    mu_.Unlock();
    return;
  }
  delivered_ = true;
  const absl::Status outcome = failure_;
  mu_.Unlock();
  done_(outcome);
}

// ---------------------------------------------------------------- DataPlane

absl::StatusOr<std::unique_ptr<DataPlane>> DataPlane::Start(Options options) {
  std::unique_ptr<DataPlane> plane(new DataPlane(std::move(options)));
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string port = std::to_string(plane->options_.port);
  const int resolved = getaddrinfo(
      plane->options_.host.empty() ? nullptr : plane->options_.host.c_str(),
      port.c_str(), &hints, &found);
  if (resolved != 0) {
    return absl::UnavailableError(absl::StrCat("data port: cannot resolve ",
                                               plane->options_.host, ": ",
                                               gai_strerror(resolved)));
  }
  const std::string where =
      absl::StrCat("data port ", plane->options_.host, ":", port);
  absl::Status status =
      absl::UnavailableError(absl::StrCat(where, ": no address"));
  for (addrinfo* at = found; at != nullptr; at = at->ai_next) {
    const int fd =
        socket(at->ai_family, at->ai_socktype | SOCK_CLOEXEC, at->ai_protocol);
    if (fd < 0) {
      status = ErrnoStatus(where);
      continue;
    }
    const int on = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof(on));
    if (bind(fd, at->ai_addr, at->ai_addrlen) != 0 || listen(fd, 128) != 0) {
      status = ErrnoStatus(where);
      close(fd);
      continue;
    }
    plane->listen_fd_ = fd;
    break;
  }
  freeaddrinfo(found);
  if (plane->listen_fd_ < 0) return status;
  sockaddr_storage bound{};
  socklen_t length = sizeof(bound);
  if (getsockname(plane->listen_fd_, reinterpret_cast<sockaddr*>(&bound),
                  &length) != 0) {
    return ErrnoStatus(where);
  }
  plane->port_ = ntohs(bound.ss_family == AF_INET6
                           ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                           : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  plane->wake_fd_ = eventfd(0, EFD_CLOEXEC);
  if (plane->wake_fd_ < 0) return ErrnoStatus("data port: eventfd");
  plane->acceptor_ = std::thread(&DataPlane::AcceptLoop, plane.get());
  return plane;
}

void DataPlane::Stop() {
  absl::MutexLock stopping(&stop_mu_);
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    for (const auto& [fd, unused] : open_fds_) shutdown(fd, SHUT_RDWR);
  }
  if (acceptor_.joinable()) {
    const uint64_t one = 1;
    if (write(wake_fd_, &one, sizeof(one)) < 0) {
      // The listener still ends at its next sweep tick.
    }
    acceptor_.join();
  }
  Expire(/*all=*/true);
  {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(
        +[](int* threads) { return *threads == 0; }, &threads_));
  }
  if (listen_fd_ >= 0) close(listen_fd_);
  if (wake_fd_ >= 0) close(wake_fd_);
  listen_fd_ = -1;
  wake_fd_ = -1;
}

absl::StatusOr<std::shared_ptr<DataTransfer>> DataPlane::Expect(
    const std::string& token, std::vector<DataTransfer::Range> ranges,
    DataTransfer::Work work, DataTransfer::Done done) {
  if (token.size() != kDataTokenBytes) {
    return absl::InvalidArgumentError(
        absl::StrFormat("a data_token must be %d bytes, got %d",
                        kDataTokenBytes, token.size()));
  }
  if (ranges.empty() || ranges.size() > kMaxDataConnections) {
    return absl::InvalidArgumentError(
        absl::StrFormat("data connections must be in [1, %d], got %d",
                        kMaxDataConnections, ranges.size()));
  }
  auto transfer = std::make_shared<DataTransfer>(
      std::move(ranges), std::move(work), std::move(done));
  absl::MutexLock lock(&mu_);
  if (stopping_) {
    return absl::UnavailableError("lossd is stopping its data connections");
  }
  if (!expected_
           .try_emplace(token,
                        Expected{transfer, absl::Now() + options_.timeout})
           .second) {
    return absl::InvalidArgumentError(
        "this data_token is already registered; use a fresh random one for "
        "every transfer");
  }
  return transfer;
}

absl::StatusOr<DataPreamble> DataPlane::Authenticate(int fd,
                                                     absl::Time deadline) {
  char bytes[kDataPreambleBytes];
  RETURN_IF_ERROR(ReadBy(fd, bytes, sizeof(bytes), deadline));
  std::optional<DataPreamble> preamble = ParseDataPreamble(bytes);
  if (!preamble.has_value() ||
      preamble->index >= static_cast<uint32_t>(kMaxDataConnections)) {
    return absl::InvalidArgumentError("not a data connection preamble");
  }
  absl::MutexLock lock(&mu_);
  const std::string& token = preamble->token;
  auto registered = [this, &token]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return stopping_ || expected_.contains(token) || refused_.contains(token);
  };
  if (!mu_.AwaitWithDeadline(absl::Condition(&registered), deadline)) {
    return absl::DeadlineExceededError("the token was not registered in time");
  }
  if (stopping_ || !expected_.contains(token)) {
    return absl::InvalidArgumentError("the token's request was refused");
  }
  return *std::move(preamble);
}

void DataPlane::EndUnauthenticated(const std::string& peer) {
  absl::MutexLock lock(&mu_);
  auto it = unauthenticated_by_peer_.find(peer);
  if (it != unauthenticated_by_peer_.end() && --it->second <= 0) {
    unauthenticated_by_peer_.erase(it);
  }
  if (unauthenticated_-- == options_.max_unauthenticated) {
    // The listener accepts again. Under mu_, so that Stop has not closed it.
    const uint64_t one = 1;
    if (write(wake_fd_, &one, sizeof(one)) < 0) {
      // The listener still looks again at its next sweep tick.
    }
  }
}

int DataPlane::unauthenticated() const {
  absl::MutexLock lock(&mu_);
  return unauthenticated_;
}

std::shared_ptr<DataTransfer> DataPlane::Claim(const std::string& token,
                                               int index, int fd) {
  auto it = expected_.find(token);
  if (stopping_ || it == expected_.end()) return nullptr;
  std::shared_ptr<DataTransfer> transfer = it->second.transfer;
  if (!transfer->Claim(index, fd)) return nullptr;
  if (transfer->AllClaimed()) expected_.erase(it);
  return transfer;
}

void DataPlane::Refuse(const std::string& token) {
  absl::MutexLock lock(&mu_);
  if (expected_.contains(token) || refused_.size() >= kMaxRefusedTokens) {
    return;
  }
  refused_[token] = absl::Now() + kRegistrationWait;
}

int DataPlane::registered() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(expected_.size());
}

void DataPlane::Expire(bool all) {
  std::vector<std::shared_ptr<DataTransfer>> overdue;
  {
    absl::MutexLock lock(&mu_);
    const absl::Time now = absl::Now();
    for (auto it = refused_.begin(); it != refused_.end();) {
      if (all || it->second <= now) {
        refused_.erase(it++);
      } else {
        ++it;
      }
    }
    for (auto it = expected_.begin(); it != expected_.end();) {
      if (all || it->second.deadline <= now) {
        overdue.push_back(std::move(it->second.transfer));
        expected_.erase(it++);
      } else if (it->second.transfer->cancelled()) {
        expected_.erase(it++);  // its RPC ended: no connection is awaited
      } else {
        ++it;
      }
    }
  }
  const absl::Status status =
      all ? absl::UnavailableError("lossd stopped its data connections")
          : absl::DeadlineExceededError(absl::StrCat(
                "not every data connection of this transfer came within ",
                absl::FormatDuration(options_.timeout)));
  for (const std::shared_ptr<DataTransfer>& transfer : overdue) {
    transfer->Fail(status);
  }
}

void DataPlane::AcceptLoop() {
  pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) return;
      // At the cap of unauthenticated connections, new ones wait in the
      // listen backlog until one of those is authenticated or closed (within
      // the auth timeout).
      fds[0].events =
          unauthenticated_ < options_.max_unauthenticated ? POLLIN : short{0};
    }
    const int ready = poll(fds, 2, kSweepMillis);
    Expire(/*all=*/false);
    if (ready < 0 && errno != EINTR) return;
    if ((fds[1].revents & POLLIN) != 0) {
      // Stop, or an unauthenticated connection ended at the cap: the loop's
      // head says.
      uint64_t count = 0;
      if (read(wake_fd_, &count, sizeof(count)) < 0) {
        // Nothing to drain: the head of the loop decides either way.
      }
      continue;
    }
    if (ready <= 0 || (fds[0].revents & POLLIN) == 0) continue;
    sockaddr_storage from{};
    socklen_t from_length = sizeof(from);
    const int fd = accept4(listen_fd_, reinterpret_cast<sockaddr*>(&from),
                           &from_length, SOCK_CLOEXEC);
    if (fd < 0) continue;
    std::string peer = PeerKey(from);
    bool over_peer_limit = false;
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) {
        close(fd);
        continue;
      }
      int& count = unauthenticated_by_peer_[peer];
      if (count >= options_.max_unauthenticated_per_peer) {
        over_peer_limit = true;
      } else {
        ++count;
        ++unauthenticated_;
        ++threads_;
        open_fds_[fd] = true;
      }
    }
    if (over_peer_limit) {
      // Closed at once: waiting in the backlog would let one peer's idle
      // connections delay everyone else's.
      close(fd);
      if (options_.metrics != nullptr) {
        options_.metrics->CountRefusedDataConnection(
            DataConnectionRefusal::kPeerLimit);
      }
      continue;
    }
    std::thread(&DataPlane::Serve, this, fd, std::move(peer)).detach();
  }
}

void DataPlane::Serve(int fd, std::string peer) {
  const absl::Duration timeout = std::min(options_.timeout, absl::Hours(24));
  // Until it names a registered token, the connection is a stranger's: it
  // gets the auth timeout, counts against its peer's cap and holds no slot.
  const absl::StatusOr<DataPreamble> preamble =
      Authenticate(fd, absl::Now() + std::min(timeout, options_.auth_timeout));
  EndUnauthenticated(peer);
  if (!preamble.ok() && options_.metrics != nullptr) {
    options_.metrics->CountRefusedDataConnection(
        preamble.status().code() == absl::StatusCode::kDeadlineExceeded
            ? DataConnectionRefusal::kAuthTimeout
            : DataConnectionRefusal::kInvalid);
  }
  if (preamble.ok()) {
    const timeval limit = absl::ToTimeval(timeout);
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &limit, sizeof(limit));
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &limit, sizeof(limit));
    const int index = static_cast<int>(preamble->index);
    std::shared_ptr<DataTransfer> transfer;
    {
      // At the cap, an authenticated connection waits for a served one to
      // end (its transfer's data_timeout still runs).
      absl::MutexLock lock(&mu_);
      auto slot = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stopping_ || connections_ < options_.max_connections;
      };
      mu_.Await(absl::Condition(&slot));
      transfer = Claim(preamble->token, index, fd);
      if (transfer != nullptr) ++connections_;
    }
    if (transfer != nullptr) {
      const absl::Status status = transfer->Run(index, fd);
      if (status.ok()) completed_.fetch_add(1);
      transfer->PartDone(index, status);
      absl::MutexLock lock(&mu_);
      --connections_;
    }
  }
  absl::MutexLock lock(&mu_);
  open_fds_.erase(fd);
  close(fd);
  --threads_;
}

}  // namespace lossd
