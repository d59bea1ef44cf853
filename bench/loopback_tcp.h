// Raw TCP over loopback, the ceiling of any transport that the service
// benchmarks compare with: connected pairs of sockets, set up untimed.
#ifndef LOSSD_BENCH_LOOPBACK_TCP_H_
#define LOSSD_BENCH_LOOPBACK_TCP_H_

#include <vector>

#include "absl/status/statusor.h"

namespace loopback_tcp {

// `count` TCP connections over 127.0.0.1: senders[i] is connected to
// receivers[i]. The caller closes every socket.
struct Connections {
  std::vector<int> senders;
  std::vector<int> receivers;
};

// UNAVAILABLE naming the step that failed (listen, connect, accept).
absl::StatusOr<Connections> Connect(int count);

}  // namespace loopback_tcp

#endif  // LOSSD_BENCH_LOOPBACK_TCP_H_
