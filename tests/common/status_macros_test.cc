// common/status_macros.h: RETURN_IF_ERROR and ASSIGN_OR_RETURN.
#include "common/status_macros.h"

#include <gtest/gtest.h>

#include <memory>
#include <string>

namespace lossd {
namespace {

absl::Status Fails(bool fail) {
  return fail ? absl::NotFoundError("gone") : absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<int>> MakeInt(bool fail, int value) {
  if (fail) return absl::InvalidArgumentError("no int");
  return std::make_unique<int>(value);
}

absl::Status Chain(bool first, bool second, int* out) {
  RETURN_IF_ERROR(Fails(first));
  ASSIGN_OR_RETURN(std::unique_ptr<int> value, MakeInt(second, 7));
  ASSIGN_OR_RETURN(*out, absl::StatusOr<int>(*value + 1));
  return absl::OkStatus();
}

TEST(StatusMacrosTest, ReturnsTheFirstError) {
  int out = 0;
  EXPECT_EQ(Chain(true, true, &out).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(Chain(false, true, &out).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(out, 0);
  EXPECT_TRUE(Chain(false, false, &out).ok());
  EXPECT_EQ(out, 8);
}

}  // namespace
}  // namespace lossd
