// CancellationOf (cancellation.h).
#include "server/cancellation.h"

#include <chrono>

namespace lossd {

std::function<bool()> CancellationOf(grpc::CallbackServerContext* context) {
  return [context] {
    return context->IsCancelled() ||
           std::chrono::system_clock::now() > context->deadline();
  };
}

}  // namespace lossd
