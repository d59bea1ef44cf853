// LinearForward on the CUDA device behind the real service, through
// lossd::Client, against the float64 reference of linear_reference.h: fp32
// and bf16, in place with a bias and accumulation, inline targets and
// per-token outputs (the device's staging), reduction NONE with per-row
// grad_output, bf16 under FAST precision, a bad target changing nothing, and
// Evaluate over hidden states against a stored weight. Skips without a GPU.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "client/client.h"
#include "common/float16.h"
#include "gtest/gtest.h"
#include "server/server.h"
#include "tests/e2e/linear_reference.h"
#include "tests/e2e/test_server.h"

namespace lossd {
namespace {

using linear_reference::Compute;
using linear_reference::MakeProblem;
using linear_reference::Problem;
using linear_reference::Reference;

// Largest |got - want| over the largest |want|.
double RelativeError(const std::vector<float>& got,
                     const std::vector<double>& want) {
  double error = 0.0, scale = 1e-12;
  for (size_t i = 0; i < want.size() && i < got.size(); ++i) {
    error = std::max(error, std::fabs(got[i] - want[i]));
    scale = std::max(scale, std::fabs(want[i]));
  }
  return got.size() == want.size() ? error / scale : INFINITY;
}

class GpuLinearTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const absl::Status available = e2e_test::CudaServerAvailable();
    if (!available.ok()) GTEST_SKIP() << "no CUDA device: " << available;
    absl::StatusOr<std::unique_ptr<LossdServer>> server = LossdServer::Start(
        e2e_test::LoopbackConfig("cuda", int64_t{1} << 30, absl::Seconds(10)));
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    absl::StatusOr<std::unique_ptr<Client>> client =
        Client::Connect(server_->address());
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = *std::move(client);
  }

  // Uploads `values` as `dtype` (rounded for bf16).
  std::string Put(const std::vector<float>& values, std::vector<int64_t> shape,
                  DType dtype) {
    absl::StatusOr<TensorInfo> info;
    if (dtype == DType::kFloat32) {
      info = client_->Upload(dtype, shape, values.data(), values.size() * 4);
    } else {
      std::vector<uint16_t> bits;
      for (float value : values) bits.push_back(FloatToBF16(value));
      info = client_->Upload(dtype, shape, bits.data(), bits.size() * 2);
    }
    EXPECT_TRUE(info.ok()) << info.status();
    return info.ok() ? info->handle : "";
  }
  std::vector<float> Get(const std::string& handle) {
    absl::StatusOr<DownloadedTensor> got =
        client_->Download(handle, DType::kFloat32);
    EXPECT_TRUE(got.ok()) << got.status();
    if (!got.ok()) return {};
    std::vector<float> values(got->data.size() / 4);
    std::memcpy(values.data(), got->data.data(), got->data.size());
    return values;
  }

  std::unique_ptr<LossdServer> server_;
  std::unique_ptr<Client> client_;
};

// The problem's values as the device sees them in `dtype`.
Problem Rounded(Problem p, DType dtype) {
  if (dtype == DType::kFloat32) return p;
  for (std::vector<float>* values : {&p.x, &p.weight, &p.bias}) {
    for (float& value : *values) value = BF16ToFloat(FloatToBF16(value));
  }
  return p;
}

TEST_F(GpuLinearTest, InPlaceWithBiasAndAccumulation) {
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    SCOPED_TRACE(DTypeName(dtype));
    const double tolerance = dtype == DType::kFloat32 ? 1e-4 : 2e-2;
    const Problem p = Rounded(MakeProblem(300, 64, 1001, 11), dtype);
    const std::string weight = Put(p.weight, {p.vocab, p.width}, dtype);
    const std::string bias = Put(p.bias, {p.vocab}, dtype);
    LinearForwardOptions options;
    options.bias = bias;
    options.token_loss = true;
    std::vector<int32_t> targets(p.targets.begin(), p.targets.end());
    // Twice, ADD: the accumulators hold twice one call's gradient.
    std::string dw, db;
    std::string x;
    absl::StatusOr<LinearForwardResult> result;
    for (int call = 0; call < 2; ++call) {
      x = Put(p.x, {p.rows, p.width}, dtype);
      options.weight_grad = dw;
      options.bias_grad = db;
      result = client_->LinearForward(
          x, weight,
          Targets::Inline(DType::kInt32, targets.data(), targets.size() * 4),
          options);
      ASSERT_TRUE(result.ok()) << result.status();
      dw = result->weight_grad;
      db = result->bias_grad;
    }
    const Reference want = Compute(p, true, true, 0.0, 1.0);
    EXPECT_NEAR(result->forward.loss, want.loss, tolerance * want.loss);
    EXPECT_EQ(result->forward.token_loss.size(), static_cast<size_t>(p.rows));
    EXPECT_LT(RelativeError(Get(x), want.dx), tolerance);
    std::vector<double> twice_dw = want.dw, twice_db = want.db;
    for (double& value : twice_dw) value *= 2;
    for (double& value : twice_db) value *= 2;
    EXPECT_LT(RelativeError(Get(dw), twice_dw), tolerance);
    EXPECT_LT(RelativeError(Get(db), twice_db), tolerance);
    absl::StatusOr<DownloadedTensor> bf16 =
        client_->Download(dw, DType::kBFloat16);
    ASSERT_TRUE(bf16.ok()) << bf16.status();
    EXPECT_EQ(bf16->data.size(), static_cast<size_t>(p.vocab * p.width * 2));
  }
}

TEST_F(GpuLinearTest, ReductionNoneWithPerRowGradOutput) {
  const Problem p = MakeProblem(77, 32, 513, 12);
  const std::string x = Put(p.x, {p.rows, p.width}, DType::kFloat32);
  const std::string weight = Put(p.weight, {p.vocab, p.width}, DType::kFloat32);
  std::vector<float> row_grad;
  for (int64_t i = 0; i < p.rows; ++i) row_grad.push_back(0.5f + 0.01f * i);
  LinearForwardOptions options;
  options.loss.reduction = Reduction::kNone;
  options.token_grad_output = row_grad;
  options.token_lse = true;
  absl::StatusOr<LinearForwardResult> result = client_->LinearForward(
      x, weight,
      Targets::Inline(DType::kInt64, p.targets.data(), p.targets.size() * 8),
      options);
  ASSERT_TRUE(result.ok()) << result.status();
  const Reference want = Compute(p, false, false, 0.0, 1.0, row_grad);
  EXPECT_NEAR(result->forward.loss, want.loss, 1e-4 * want.loss);
  EXPECT_EQ(result->forward.token_lse.size(), static_cast<size_t>(p.rows));
  EXPECT_LT(RelativeError(Get(x), want.dx), 1e-4);
  EXPECT_LT(RelativeError(Get(result->weight_grad), want.dw), 1e-4);
}

// FAST runs the three products in bf16 as the peers do: the logits are
// rounded to bf16 before the loss, so an element's error is a few bf16 ulps
// of the logits against the gradient's largest magnitude (on the H200: dX
// 2.7e-2, dW 2.3e-2, dbias 1.2e-2 of the largest element on this case),
// looser than the default's, but still the reference's gradient.
TEST_F(GpuLinearTest, FastPrecisionBf16) {
  const Problem p = Rounded(MakeProblem(300, 64, 1001, 17), DType::kBFloat16);
  const std::string x = Put(p.x, {p.rows, p.width}, DType::kBFloat16);
  const std::string weight =
      Put(p.weight, {p.vocab, p.width}, DType::kBFloat16);
  const std::string bias = Put(p.bias, {p.vocab}, DType::kBFloat16);
  LinearForwardOptions options;
  options.bias = bias;
  options.precision = LinearForwardPrecision::kFast;
  std::vector<int32_t> targets(p.targets.begin(), p.targets.end());
  absl::StatusOr<LinearForwardResult> result = client_->LinearForward(
      x, weight,
      Targets::Inline(DType::kInt32, targets.data(), targets.size() * 4),
      options);
  ASSERT_TRUE(result.ok()) << result.status();
  const Reference want = Compute(p, true, true, 0.0, 1.0);
  EXPECT_NEAR(result->forward.loss, want.loss, 2e-2 * want.loss);
  EXPECT_LT(RelativeError(Get(x), want.dx), 5e-2);
  EXPECT_LT(RelativeError(Get(result->weight_grad), want.dw), 5e-2);
  EXPECT_LT(RelativeError(Get(result->bias_grad), want.db), 5e-2);
}

TEST_F(GpuLinearTest, BadTargetChangesNothing) {
  Problem p = MakeProblem(40, 16, 100, 13);
  p.targets[7] = p.vocab + 3;
  const std::string x = Put(p.x, {p.rows, p.width}, DType::kFloat32);
  const std::string weight = Put(p.weight, {p.vocab, p.width}, DType::kFloat32);
  const StoreStats before = server_->store()->Stats();
  EXPECT_EQ(client_
                ->LinearForward(x, weight,
                                Targets::Inline(DType::kInt64, p.targets.data(),
                                                p.targets.size() * 8))
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(server_->store()->Stats().used_bytes, before.used_bytes);
  EXPECT_EQ(server_->store()->Stats().tensors, before.tensors);
  EXPECT_EQ(client_->Describe(x)->state, TensorState::kLogits);
  EXPECT_EQ(Get(x), p.x);
}

// Evaluate over hidden states on the CUDA device (the same device call with
// no gradient, its rows staged into device block buffers): the float64
// loss for fp32 and bf16, with and without a bias, in blocks whose last is
// short; LinearForward's loss on the same rows stored; nothing left charged.
TEST_F(GpuLinearTest, EvaluateOverHiddenStates) {
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    for (bool with_bias : {false, true}) {
      SCOPED_TRACE(std::string(DTypeName(dtype)) +
                   (with_bias ? " with bias" : " without bias"));
      // As the LinearForward cases above: the products may round differently
      // from the float64 reference, per block and per algorithm.
      const double tolerance = dtype == DType::kFloat32 ? 1e-4 : 5e-3;
      const Problem p = Rounded(MakeProblem(301, 64, 50257, 17), dtype);
      const std::string weight = Put(p.weight, {p.vocab, p.width}, dtype);
      const std::string bias = Put(p.bias, {p.vocab}, dtype);
      const int64_t baseline = server_->store()->Stats().used_bytes;
      std::vector<uint16_t> bits;
      for (float value : p.x) bits.push_back(FloatToBF16(value));
      const void* rows = dtype == DType::kFloat32
                             ? static_cast<const void*>(p.x.data())
                             : static_cast<const void*>(bits.data());
      EvaluateOptions options;
      options.weight = weight;
      if (with_bias) options.bias = bias;
      absl::StatusOr<EvaluateResult> result =
          client_->Evaluate(p.rows, p.width, dtype, rows, DType::kInt64,
                            p.targets.data(), options, /*block_rows=*/64);
      ASSERT_TRUE(result.ok()) << result.status();
      const Reference want = Compute(p, with_bias, true, 0.0, 1.0);
      EXPECT_NEAR(result->loss, want.loss, tolerance * want.loss);
      EXPECT_EQ(result->rows, p.rows);
      EXPECT_EQ(server_->store()->Stats().used_bytes, baseline);

      const std::string x = Put(p.x, {p.rows, p.width}, dtype);
      LinearForwardOptions forward;
      forward.mode = GradientMode::kNone;
      if (with_bias) forward.bias = bias;
      absl::StatusOr<LinearForwardResult> stored = client_->LinearForward(
          x, weight,
          Targets::Inline(DType::kInt64, p.targets.data(),
                          p.targets.size() * 8),
          forward);
      ASSERT_TRUE(stored.ok()) << stored.status();
      EXPECT_NEAR(result->loss, stored->forward.loss,
                  1e-4 * stored->forward.loss);
      EXPECT_EQ(result->valid_tokens, stored->forward.valid_tokens);
      EXPECT_EQ(result->correct_tokens, stored->forward.correct_tokens);
      for (const std::string& handle : {weight, bias, x}) {
        ASSERT_TRUE(client_->Release(handle).ok());
      }
    }
  }
}

}  // namespace
}  // namespace lossd
