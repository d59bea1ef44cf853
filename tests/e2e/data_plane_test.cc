// The data plane without a lossd around it: connections beyond its cap wait
// rather than being turned away, a connection without progress times out,
// and the client finds the host of a gRPC target to connect to.
#include "server/data_plane.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "client/data_connection.h"
#include "gtest/gtest.h"
#include "tests/e2e/bytes.h"
#include "tests/e2e/data_connection_fixture.h"

namespace lossd {
namespace data_connection_test {
namespace {

TEST(DataPlaneTest, ConnectionsBeyondTheCapWait) {
  DataPlane::Options options;
  options.host = "127.0.0.1";
  options.timeout = absl::Seconds(20);
  options.max_connections = 1;
  absl::StatusOr<std::unique_ptr<DataPlane>> plane = DataPlane::Start(options);
  ASSERT_TRUE(plane.ok()) << plane.status();
  constexpr int kParts = 3;
  constexpr int64_t kPartBytes = 2 << 20;  // more than the socket buffers
  const std::string bytes = RandomBytes(kParts * kPartBytes, 7);
  std::string into(bytes.size(), '\0');
  std::vector<DataTransfer::Range> ranges;
  for (int i = 0; i < kParts; ++i)
    ranges.push_back({i * kPartBytes, kPartBytes});
  absl::Notification done;
  absl::Status outcome;
  absl::StatusOr<std::shared_ptr<DataTransfer>> transfer = (*plane)->Expect(
      Token('w'), ranges,
      [&into](int, int fd, const DataTransfer::Range& range) {
        return ReceiveOverDataConnection(fd, into.data() + range.offset,
                                         static_cast<size_t>(range.bytes),
                                         nullptr);
      },
      [&](const absl::Status& status) {
        outcome = status;
        done.Notify();
      });
  ASSERT_TRUE(transfer.ok()) << transfer.status();
  std::vector<std::thread> senders;
  for (int i = 0; i < kParts; ++i) {
    senders.emplace_back([&, i] {
      absl::StatusOr<int> fd =
          ConnectDataPort("127.0.0.1", (*plane)->port(), absl::Seconds(5));
      ASSERT_TRUE(fd.ok()) << fd.status();
      EXPECT_TRUE(SendOverDataConnection(*fd, Token('w'), i,
                                         bytes.data() + i * kPartBytes,
                                         kPartBytes, nullptr)
                      .ok());
      // Until the server closes it: the part was received.
      EXPECT_TRUE(ClosedByServer(*fd, absl::Seconds(15)));
      close(*fd);
    });
  }
  for (std::thread& sender : senders) sender.join();
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(15)));
  EXPECT_TRUE(outcome.ok()) << outcome;
  EXPECT_TRUE(into == bytes);
  EXPECT_EQ((*plane)->completed(), kParts);
}

// A data connection on which nothing arrives (or nothing is taken) for its
// io_timeout fails DEADLINE_EXCEEDED, not as a broken connection.
TEST(DataConnectionTimeoutTest, NoProgressIsDeadlineExceeded) {
  const int listener = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(listener, 0);
  sockaddr_in address = {};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(
      bind(listener, reinterpret_cast<sockaddr*>(&address), sizeof(address)),
      0);
  ASSERT_EQ(listen(listener, 4), 0);
  socklen_t length = sizeof(address);
  ASSERT_EQ(
      getsockname(listener, reinterpret_cast<sockaddr*>(&address), &length), 0);
  // The kernel completes the connection; nobody ever reads or writes it.
  absl::StatusOr<int> fd =
      ConnectDataPort("127.0.0.1", ntohs(address.sin_port), absl::Seconds(5),
                      absl::Milliseconds(200));
  ASSERT_TRUE(fd.ok()) << fd.status();
  std::string into(16, '\0');
  const absl::Status received =
      ReceiveOverDataConnection(*fd, into.data(), into.size(), nullptr);
  EXPECT_EQ(received.code(), absl::StatusCode::kDeadlineExceeded) << received;
  // Sends stall once the socket buffers are full.
  const std::string big(64 << 20, 'x');
  const absl::Status sent = SendOverDataConnection(
      *fd, std::string(16, 't'), 0, big.data(), big.size(), nullptr);
  EXPECT_EQ(sent.code(), absl::StatusCode::kDeadlineExceeded) << sent;
  close(*fd);
  close(listener);
}

TEST(TargetHostTest, ParsesTargets) {
  EXPECT_EQ(TargetHost("127.0.0.1:50051"), "127.0.0.1");
  EXPECT_EQ(TargetHost("lossd-0.lossd:50051"), "lossd-0.lossd");
  EXPECT_EQ(TargetHost("dns:///lossd.svc:50051"), "lossd.svc");
  EXPECT_EQ(TargetHost("dns://8.8.8.8/lossd.svc:50051"), "lossd.svc");
  EXPECT_EQ(TargetHost("ipv4:10.0.0.1:50051"), "10.0.0.1");
  EXPECT_EQ(TargetHost("[::1]:50051"), "::1");
  EXPECT_EQ(TargetHost("ipv6:[::1]:50051"), "::1");
  EXPECT_EQ(TargetHost("localhost"), "localhost");
  EXPECT_EQ(TargetHost("unix:/tmp/lossd.sock"), std::nullopt);
  EXPECT_EQ(TargetHost("ipv4:10.0.0.1:1,10.0.0.2:1"), std::nullopt);
  EXPECT_EQ(TargetHost("xds:///lossd"), std::nullopt);
  EXPECT_EQ(TargetHost(""), std::nullopt);
}

}  // namespace
}  // namespace data_connection_test
}  // namespace lossd
