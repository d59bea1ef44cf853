// The link between a party that may end an RPC from outside its reactor (a
// striped upload's assembly, a data transfer) and the reactor.
#ifndef LOSSD_SERVER_END_LINK_H_
#define LOSSD_SERVER_END_LINK_H_

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace lossd {

// Shared, so that the first party to claim it is the only one to end the RPC
// and nobody touches the reactor after it ended (gRPC deletes it in OnDone).
template <typename Reactor>
struct EndLink {
  explicit EndLink(Reactor* owner) : reactor(owner) {}
  // The right to end the RPC; false when another party has it.
  bool Claim() ABSL_LOCKS_EXCLUDED(mu) {
    absl::MutexLock lock(&mu);
    if (claimed) return false;
    claimed = true;
    return true;
  }
  Reactor* const reactor;  // alive until its RPC ends
  absl::Mutex mu;
  bool claimed ABSL_GUARDED_BY(mu) = false;
};

}  // namespace lossd

#endif  // LOSSD_SERVER_END_LINK_H_
