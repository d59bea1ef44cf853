// A call's cancellation as a question that long work asks between its steps,
// so that the work itself knows nothing of gRPC.
#ifndef LOSSD_SERVER_CANCELLATION_H_
#define LOSSD_SERVER_CANCELLATION_H_

#include <functional>

#include "grpcpp/grpcpp.h"

namespace lossd {

// Whether the RPC of `context` is cancelled or past its deadline, for work
// to ask between its steps. The deadline is read from the server's own clock
// as well: gRPC marks the call cancelled only once a thread of its own gets
// to it, which a long step on the thread serving the call may hold up.
// `context` must outlive the function. Thread-safe.
std::function<bool()> CancellationOf(grpc::CallbackServerContext* context);

}  // namespace lossd

#endif  // LOSSD_SERVER_CANCELLATION_H_
