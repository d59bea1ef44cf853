// What the uploads and downloads of lossd::Client share: pieces produced one
// ahead of their consumer into scratch buffers, stripes run in parallel, and
// the data connections (the server's raw TCP data port) found and opened.
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "client/client.h"
#include "client/client_internal.h"
#include "client/data_connection.h"

namespace lossd {

using client_internal::DataConnectionCount;
using client_internal::kDataConnectTimeout;
using client_internal::kDataFailureGrace;
using client_internal::kDataIoTimeout;
using client_internal::PrepareContext;

namespace client_internal {

absl::Status PipelinePieces(
    int64_t count, char* a, char* b,
    const std::function<absl::StatusOr<const void*>(int64_t, char*)>& produce,
    const std::function<absl::Status(int64_t, const void*)>& consume) {
  if (count <= 0) return absl::OkStatus();
  struct Slot {
    bool full = false;
    absl::StatusOr<const void*> data;
  };
  absl::Mutex mu;
  Slot slots[2];
  bool stop = false;
  std::thread producer([&] {
    for (int64_t k = 0; k < count; ++k) {
      Slot& slot = slots[k % 2];
      {
        absl::MutexLock lock(&mu);
        auto free_or_stopped = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu) {
          return !slot.full || stop;
        };
        mu.Await(absl::Condition(&free_or_stopped));
        if (stop) return;
      }
      absl::StatusOr<const void*> data = produce(k, k % 2 == 0 ? a : b);
      const bool failed = !data.ok();
      absl::MutexLock lock(&mu);
      slot.data = std::move(data);
      slot.full = true;
      if (failed) return;
    }
  });
  absl::Status result;
  for (int64_t k = 0; k < count && result.ok(); ++k) {
    Slot& slot = slots[k % 2];
    absl::StatusOr<const void*> data;
    {
      absl::MutexLock lock(&mu);
      mu.Await(absl::Condition(&slot.full));
      data = slot.data;
    }
    result = data.ok() ? consume(k, *data) : data.status();
    absl::MutexLock lock(&mu);
    slot.full = false;
  }
  {
    absl::MutexLock lock(&mu);
    stop = true;
  }
  producer.join();
  return result;
}

int64_t PieceBytes(const ClientOptions& options, int64_t element_bytes) {
  const int64_t piece = static_cast<int64_t>(options.piece_bytes);
  return std::max<int64_t>(1, piece / element_bytes) * element_bytes;
}

absl::Status AwaitConnected(grpc::Channel* channel, int index) {
  if (channel->WaitForConnected(std::chrono::system_clock::now() +
                                std::chrono::seconds(20))) {
    return absl::OkStatus();
  }
  return absl::UnavailableError(absl::StrCat("stripe connection ", index,
                                             " did not connect within 20 s"));
}

std::vector<absl::Status> RunParallel(
    int n, const ClientOptions& options, int64_t total,
    const ProgressCallback& progress,
    const std::function<absl::Status(int, grpc::ClientContext*,
                                     const std::function<void(int64_t)>&)>&
        work) {
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
  for (int i = 0; i < n; ++i) {
    contexts.push_back(std::make_unique<grpc::ClientContext>());
    PrepareContext(options, /*channel=*/nullptr, contexts.back().get());
  }
  absl::Mutex mu;
  int64_t done = 0;
  int finished = 0;
  std::vector<absl::Status> results(static_cast<std::size_t>(n));
  const std::function<void(int64_t)> count = [&](int64_t bytes) {
    absl::MutexLock lock(&mu);
    done += bytes;
  };
  std::vector<std::thread> threads;
  for (int i = 0; i < n; ++i) {
    threads.emplace_back([&, i] {
      absl::Status status =
          work(i, contexts[static_cast<std::size_t>(i)].get(), count);
      if (!status.ok()) {
        for (int j = 0; j < n; ++j) {
          if (j != i) contexts[static_cast<std::size_t>(j)]->TryCancel();
        }
      }
      absl::MutexLock lock(&mu);
      results[static_cast<std::size_t>(i)] = std::move(status);
      ++finished;
    });
  }
  int64_t reported = -1;
  for (bool all = false; !all;) {
    int64_t now;
    {
      absl::MutexLock lock(&mu);
      auto moved = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu) {
        return done != reported || finished == n;
      };
      mu.Await(absl::Condition(&moved));
      now = done;
      all = finished == n;
    }
    if (progress && now != reported) progress(now, total);
    reported = now;
  }
  for (std::thread& thread : threads) thread.join();
  return results;
}

int DataConnectionCount(const ClientOptions& options) {
  return std::clamp(options.upload_streams, 1, 64);
}

grpc::Status FinishAfterData(grpc::ClientContext* context, bool failed,
                             const std::function<grpc::Status()>& finish) {
  absl::Notification finished_rpc;
  std::thread canceller;
  if (failed) {
    canceller = std::thread([&] {
      if (!finished_rpc.WaitForNotificationWithTimeout(kDataFailureGrace)) {
        context->TryCancel();
      }
    });
  }
  const grpc::Status status = finish();
  finished_rpc.Notify();
  if (canceller.joinable()) canceller.join();
  return status;
}

}  // namespace client_internal

std::optional<Client::DataTarget> Client::FindDataTarget() {
  if (channel_->tls) return std::nullopt;
  std::optional<std::string> host = TargetHost(target_);
  if (!host.has_value()) return std::nullopt;
  std::optional<int> port;
  {
    absl::MutexLock lock(&channel_->mu);
    port = channel_->data_port;
  }
  if (!port.has_value()) {
    absl::StatusOr<ServerInfo> info = GetServerInfo();
    // Not cached: the gRPC path reports what is wrong, the next transfer asks
    // again.
    if (!info.ok()) return std::nullopt;
    port = info->data_port;
    absl::MutexLock lock(&channel_->mu);
    channel_->data_port = port;
  }
  if (*port == 0) return std::nullopt;
  return DataTarget{*std::move(host), *port};
}

std::optional<std::vector<int>> Client::ConnectData(const DataTarget& target,
                                                    int count) {
  std::vector<int> fds;
  for (int i = 0; i < count; ++i) {
    absl::StatusOr<int> fd = ConnectDataPort(
        target.host, target.port, kDataConnectTimeout, kDataIoTimeout);
    if (!fd.ok()) {
      for (int open : fds) close(open);
      // A port the server offers that cannot be reached from here (a
      // firewall, a Service without it): gRPC it is, from now on.
      absl::MutexLock lock(&channel_->mu);
      channel_->data_port = 0;
      return std::nullopt;
    }
    fds.push_back(*fd);
  }
  return fds;
}

std::optional<absl::StatusOr<Client::DataConnections>>
Client::OpenDataConnections() {
  const std::optional<DataTarget> target = FindDataTarget();
  if (!target.has_value()) return std::nullopt;
  std::optional<std::vector<int>> fds =
      ConnectData(*target, DataConnectionCount(options_));
  if (!fds.has_value()) return std::nullopt;
  absl::StatusOr<std::string> token = RandomDataToken();
  if (!token.ok()) {
    for (int fd : *fds) close(fd);
    return absl::StatusOr<DataConnections>(token.status());
  }
  return absl::StatusOr<DataConnections>(
      DataConnections{*std::move(fds), *std::move(token)});
}

}  // namespace lossd
