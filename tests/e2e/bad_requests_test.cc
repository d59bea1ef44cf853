// Every kind of bad request, against a real in-process server on 127.0.0.1:0
// (the table: bad_request_rpc_cases.cc and bad_request_limit_cases.cc). Each
// gets its documented code and message, and leaves the store exactly as it
// was: same bytes, same tensors, same states, same contents.
#include "tests/e2e/bad_requests.h"

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

namespace lossd {
namespace bad_requests {

std::vector<BadRequestsTest::Case> BadRequestsTest::Cases() {
  std::vector<Case> cases;
  AddRpcCases(&cases);
  AddLimitCases(&cases);
  AddPostTrainingCases(&cases);
  return cases;
}

TEST_F(BadRequestsTest, EachGetsItsCodeAndChangesNothing) {
  SCOPED_TRACE(::testing::Message() << "seed " << seed_);
  const std::vector<Case> cases = Cases();
  EXPECT_GE(cases.size(), 40u);
  const Snapshot initial = Take();
  ASSERT_EQ(initial.tensors, 15);
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const Snapshot before = Take();
    const grpc::Status status = c.run();
    EXPECT_EQ(status.error_code(), c.code) << status.error_message();
    EXPECT_THAT(status.error_message(), HasSubstr(c.message));
    // Uploads are torn down when the server sees the stream end.
    EXPECT_TRUE(
        server_->store()->AwaitUsedBytes(before.used_bytes, absl::Seconds(10)));
    const Snapshot after = Take();
    EXPECT_EQ(after.used_bytes, before.used_bytes);
    EXPECT_EQ(after.tensors, before.tensors);
    // Bitwise: the logits of a failed in-place Forward are untouched.
    EXPECT_EQ(Diff(before, after), "");
  }
  EXPECT_EQ(Diff(initial, Take()), "");
}

// Non-finite logits are data, not errors: the loss is NaN (or inf) exactly
// where torch.nn.functional.cross_entropy gives NaN (or inf), the rows are
// counted, ignored rows stay out of it, and nothing crashes. The expected
// values come from torch 1.13 on the same inputs.
TEST_F(BadRequestsTest, NonFiniteLogitsGiveTorchsLossAndAreCounted) {
  const float kNaN = std::numeric_limits<float>::quiet_NaN();
  const float kInf = std::numeric_limits<float>::infinity();
  constexpr int64_t kN = 8;
  constexpr int64_t kV = 4;
  const std::vector<float> logits = {
      1,     2, 3,    0.5,    // finite: 1.4608
      kNaN,  0, 0,    0,      // NaN
      kInf,  0, 0,    0,      // +inf off the target: NaN (inf - inf)
      kInf,  0, 0,    0,      // +inf on the target: NaN
      -kInf, 0, 1,    0,      // -inf off the target: finite, 0.5514
      -kInf, 0, 1,    0,      // -inf on the target: +inf
      kNaN,  1, 1,    1,      // NaN in an ignored row: 0, not counted
      1,     2, kInf, -kInf,  // NaN
  };
  const std::vector<int64_t> targets = {1, 2, 1, 0, 2, 0, -100, 3};
  // torch: reduction='none'; 0 = NaN, 1 = +inf, else the value.
  const std::vector<double> torch_loss = {1.4608, 0, 0, 0, 0.5514, 1, 0, 0};
  const std::vector<bool> finite = {true, false, false, false,
                                    true, false, true,  false};
  const std::vector<bool> nan = {false, true,  true,  true,
                                 false, false, false, true};

  std::vector<uint16_t> bf16(logits.size());
  for (size_t i = 0; i < logits.size(); ++i) bf16[i] = FloatToBF16(logits[i]);
  const std::vector<std::pair<pb::DType, std::string>> inputs = {
      {pb::DTYPE_FLOAT32, Bytes(logits)}, {pb::DTYPE_BFLOAT16, Bytes(bf16)}};
  for (const auto& [dtype, bytes] : inputs) {
    SCOPED_TRACE(pb::DType_Name(dtype));
    for (pb::Reduction reduction :
         {pb::REDUCTION_NONE, pb::REDUCTION_SUM, pb::REDUCTION_MEAN}) {
      for (pb::GradientMode mode :
           {pb::GRADIENT_MODE_IN_PLACE, pb::GRADIENT_MODE_OUT_OF_PLACE,
            pb::GRADIENT_MODE_NONE}) {
        SCOPED_TRACE(::testing::Message()
                     << pb::Reduction_Name(reduction) << " "
                     << pb::GradientMode_Name(mode));
        const std::string handle = Put(dtype, {kN, kV}, bytes);
        pb::ForwardRequest request;
        request.set_logits(handle);
        request.mutable_targets_inline()->set_dtype(pb::DTYPE_INT64);
        request.mutable_targets_inline()->set_data(Bytes(targets));
        request.mutable_options()->set_reduction(reduction);
        request.set_mode(mode);
        request.mutable_outputs()->set_token_loss(true);
        pb::ForwardResponse response;
        const grpc::Status status = Forward(request, &response);
        ASSERT_TRUE(status.ok()) << status.error_message();
        EXPECT_EQ(response.nonfinite_rows(), 5);
        EXPECT_EQ(response.valid_tokens(), 7);
        EXPECT_TRUE(std::isnan(response.loss())) << response.loss();
        ASSERT_EQ(response.token_loss_size(), kN);
        for (int64_t row = 0; row < kN; ++row) {
          SCOPED_TRACE(row);
          const float got = response.token_loss(row);
          if (nan[row]) {
            EXPECT_TRUE(std::isnan(got)) << got;
          } else if (!finite[row]) {
            EXPECT_EQ(got, kInf);
          } else if (dtype == pb::DTYPE_FLOAT32) {
            EXPECT_NEAR(got, torch_loss[row], 1e-4);
          } else {
            EXPECT_TRUE(std::isfinite(got)) << got;
          }
        }
        // The gradient downloads; the finite rows' are finite and the
        // ignored row's is zero.
        if (mode != pb::GRADIENT_MODE_NONE) {
          std::string gradient;
          ASSERT_TRUE(
              Download(response.gradient(), pb::DTYPE_FLOAT32, 0, &gradient)
                  .ok());
          std::vector<float> values(kN * kV);
          ASSERT_EQ(gradient.size(), values.size() * 4);
          std::memcpy(values.data(), gradient.data(), gradient.size());
          for (int64_t row : {0, 4, 6}) {
            for (int64_t c = 0; c < kV; ++c) {
              const float g = values[row * kV + c];
              EXPECT_TRUE(std::isfinite(g)) << row << "," << c << ": " << g;
              if (row == 6) {
                EXPECT_EQ(g, 0.0f);
              }
            }
          }
          if (mode == pb::GRADIENT_MODE_OUT_OF_PLACE) {
            ASSERT_TRUE(Release(response.gradient()).ok());
          }
        }
        ASSERT_TRUE(Release(handle).ok());
      }
    }

    // Evaluate: the same numbers, streamed in two blocks.
    grpc::ClientContext context;
    pb::EvaluateResponse response;
    auto writer = stub_->Evaluate(&context, &response);
    pb::EvaluateRequest header = EvalHeader(kV, dtype, pb::DTYPE_INT64);
    ASSERT_TRUE(writer->Write(header));
    const size_t half = bytes.size() / 2;
    const std::string target_bytes = Bytes(targets);
    ASSERT_TRUE(writer->Write(
        EvalBlock(bytes.substr(0, half), target_bytes.substr(0, 32))));
    ASSERT_TRUE(
        writer->Write(EvalBlock(bytes.substr(half), target_bytes.substr(32))));
    writer->WritesDone();
    const grpc::Status status = writer->Finish();
    ASSERT_TRUE(status.ok()) << status.error_message();
    EXPECT_TRUE(std::isnan(response.loss())) << response.loss();
    EXPECT_EQ(response.nonfinite_rows(), 5);
    EXPECT_EQ(response.rows(), kN);
    EXPECT_EQ(response.valid_tokens(), 7);
  }

  // Only the finite rows and the ignored NaN row: a finite mean, as torch.
  const std::vector<float> subset = {1, 2, 3,    0.5, -kInf, 0,
                                     1, 0, kNaN, 1,   1,     1};
  const std::string handle = Put(pb::DTYPE_FLOAT32, {3, kV}, Bytes(subset));
  pb::ForwardRequest request;
  request.set_logits(handle);
  request.mutable_targets_inline()->set_dtype(pb::DTYPE_INT32);
  request.mutable_targets_inline()->set_data(
      Bytes(std::vector<int32_t>{1, 2, -100}));
  pb::ForwardResponse response;
  ASSERT_TRUE(Forward(request, &response).ok());
  EXPECT_NEAR(response.loss(), 1.0061, 1e-4);
  EXPECT_EQ(response.nonfinite_rows(), 0);
  EXPECT_EQ(response.valid_tokens(), 2);
}

}  // namespace bad_requests
}  // namespace lossd
