// The Forward pieces that need no store: TokenOutputs (the per-row outputs a
// request asks for, pointed at by the kernel's arguments, then answered).
#include "server/forward.h"

#include "gtest/gtest.h"
#include "kernels/linear_cross_entropy.h"

namespace lossd {
namespace {

namespace pb = ::lossd::v1;

TEST(TokenOutputsTest, OnlyTheAskedOutputsGetBuffers) {
  pb::Outputs asked;
  asked.set_token_lse(true);
  TokenOutputs outputs(asked, 3);
  CrossEntropyArgs args;
  outputs.FillArgs(&args);
  EXPECT_EQ(args.token_loss, nullptr);
  ASSERT_NE(args.token_lse, nullptr);
  EXPECT_EQ(args.token_argmax, nullptr);
  for (int row = 0; row < 3; ++row) args.token_lse[row] = 0.5f * row;

  pb::ForwardResponse response;
  outputs.AddTo(&response);
  EXPECT_EQ(response.token_loss_size(), 0);
  ASSERT_EQ(response.token_lse_size(), 3);
  EXPECT_EQ(response.token_lse(2), 1.0f);
  EXPECT_EQ(response.token_argmax_size(), 0);
}

TEST(TokenOutputsTest, LinearArgumentsPointAtTheSameBuffers) {
  pb::Outputs asked;
  asked.set_token_loss(true);
  asked.set_token_argmax(true);
  TokenOutputs outputs(asked, 2);
  LinearCrossEntropyArgs args;
  outputs.FillArgs(&args);
  ASSERT_NE(args.token_loss, nullptr);
  EXPECT_EQ(args.token_lse, nullptr);
  ASSERT_NE(args.token_argmax, nullptr);
  args.token_loss[1] = 2.5f;
  args.token_argmax[0] = 7;

  pb::ForwardResponse response;
  outputs.AddTo(&response);
  ASSERT_EQ(response.token_loss_size(), 2);
  EXPECT_EQ(response.token_loss(1), 2.5f);
  ASSERT_EQ(response.token_argmax_size(), 2);
  EXPECT_EQ(response.token_argmax(0), 7);
}

TEST(TokenOutputsTest, NoRowsNoValues) {
  pb::Outputs asked;
  asked.set_token_loss(true);
  TokenOutputs outputs(asked, 0);
  CrossEntropyArgs args;
  outputs.FillArgs(&args);
  EXPECT_EQ(args.token_loss, nullptr);
  pb::ForwardResponse response;
  outputs.AddTo(&response);
  EXPECT_EQ(response.token_loss_size(), 0);
}

}  // namespace
}  // namespace lossd
