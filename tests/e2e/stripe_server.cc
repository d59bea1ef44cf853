// StripeServer over LossdServer (see stripe_server.h for why it is apart).
#include "tests/e2e/stripe_server.h"

#include <utility>

#include "server/server.h"
#include "tests/e2e/test_server.h"

namespace lossd {
namespace e2e_test {
namespace {

class InProcessServer final : public StripeServer {
 public:
  explicit InProcessServer(std::unique_ptr<LossdServer> server)
      : server_(std::move(server)) {}
  std::string address() const override { return server_->address(); }
  bool AwaitUsedBytes(int64_t bytes, absl::Duration timeout) const override {
    return server_->store()->AwaitUsedBytes(bytes, timeout);
  }
  int64_t tensors() const override { return server_->store()->Stats().tensors; }

 private:
  std::unique_ptr<LossdServer> server_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<StripeServer>> StripeServer::Start(
    int64_t budget, absl::Duration stripe_timeout) {
  ServerConfig config = LoopbackConfig("cpu", budget, absl::Seconds(10));
  config.stripe_timeout = stripe_timeout;
  absl::StatusOr<std::unique_ptr<LossdServer>> server =
      LossdServer::Start(config);
  if (!server.ok()) return server.status();
  return std::unique_ptr<StripeServer>(new InProcessServer(*std::move(server)));
}

}  // namespace e2e_test
}  // namespace lossd
