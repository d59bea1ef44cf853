// ToGrpcStatus (server/grpc_status.h), the one absl -> gRPC status mapping of
// the RPC edge: every code a client sees passes through it, so a code or a
// message lost here would reach every RPC's caller.
#include "server/grpc_status.h"

#include "absl/status/status.h"
#include "gtest/gtest.h"

namespace lossd {
namespace {

TEST(GrpcStatusTest, OkIsOkWithNoMessage) {
  const grpc::Status status = ToGrpcStatus(absl::OkStatus());
  EXPECT_TRUE(status.ok());
  EXPECT_EQ(status.error_message(), "");
}

// The codes the service returns, each with its message kept to the letter.
TEST(GrpcStatusTest, EachCodeAndItsMessageCarryOver) {
  const struct {
    absl::Status in;
    grpc::StatusCode code;
  } cases[] = {
      {absl::InvalidArgumentError("bad shape"), grpc::INVALID_ARGUMENT},
      {absl::NotFoundError("no such handle"), grpc::NOT_FOUND},
      {absl::AlreadyExistsError("label taken"), grpc::ALREADY_EXISTS},
      {absl::PermissionDeniedError("other tenant"), grpc::PERMISSION_DENIED},
      {absl::ResourceExhaustedError("quota"), grpc::RESOURCE_EXHAUSTED},
      {absl::FailedPreconditionError("leased"), grpc::FAILED_PRECONDITION},
      {absl::AbortedError("stripe abandoned"), grpc::ABORTED},
      {absl::OutOfRangeError("past the end"), grpc::OUT_OF_RANGE},
      {absl::UnimplementedError("not served"), grpc::UNIMPLEMENTED},
      {absl::InternalError("cuda: illegal address"), grpc::INTERNAL},
      {absl::UnavailableError("draining"), grpc::UNAVAILABLE},
      {absl::DeadlineExceededError("too slow"), grpc::DEADLINE_EXCEEDED},
      {absl::CancelledError("cancelled"), grpc::CANCELLED},
      {absl::UnauthenticatedError("no token"), grpc::UNAUTHENTICATED},
      {absl::DataLossError("torn write"), grpc::DATA_LOSS},
      {absl::UnknownError("?"), grpc::UNKNOWN},
  };
  for (const auto& c : cases) {
    const grpc::Status status = ToGrpcStatus(c.in);
    EXPECT_EQ(status.error_code(), c.code) << c.in;
    EXPECT_EQ(status.error_message(), c.in.message()) << c.in;
  }
}

}  // namespace
}  // namespace lossd
