// An in-process lossd for tests that use lossd::Client: client/client.h and
// server/server.h cannot meet in one file (both define lossd::TensorState),
// so the server hides behind this header.
#ifndef LOSSD_TESTS_E2E_STRIPE_SERVER_H_
#define LOSSD_TESTS_E2E_STRIPE_SERVER_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace lossd {
namespace e2e_test {

// A CPU lossd on 127.0.0.1:0. Not copyable; stops when destroyed.
class StripeServer {
 public:
  // Starts one with a `budget` bytes store and `stripe_timeout`. Errors: the
  // server's start errors.
  static absl::StatusOr<std::unique_ptr<StripeServer>> Start(
      int64_t budget, absl::Duration stripe_timeout);
  virtual ~StripeServer() = default;

  virtual std::string address() const = 0;
  // Waits until the store's used (reserved + held) bytes are `bytes`, at most
  // `timeout`; returns whether they are.
  virtual bool AwaitUsedBytes(int64_t bytes, absl::Duration timeout) const = 0;
  virtual int64_t tensors() const = 0;
};

}  // namespace e2e_test
}  // namespace lossd

#endif  // LOSSD_TESTS_E2E_STRIPE_SERVER_H_
