// lossd::Client against a real lossd process on 127.0.0.1:0: chunked transfers
// are bit-exact, Forward/Backward/Download give the gradient the formulas say,
// Evaluate agrees with Forward, and server errors arrive as the right absl
// codes.
#include "client/client.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/float16.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/client/lossd_process.h"

namespace lossd {
namespace {

using ::lossd::client_test::LossdProcess;
using ::testing::HasSubstr;

class ClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    seed_ = std::random_device{}();
    rng_.seed(seed_);
    absl::StatusOr<std::unique_ptr<LossdProcess>> server =
        LossdProcess::Start(LOSSD_BINARY_PATH);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    client_ = Connect(ClientOptions());
  }

  void TearDown() override {
    if (HasFailure()) std::fprintf(stderr, "random seed: %u\n", seed_);
  }

  std::unique_ptr<Client> Connect(ClientOptions options) {
    absl::StatusOr<std::unique_ptr<Client>> client =
        Client::Connect(server_->address(), options);
    EXPECT_TRUE(client.ok()) << client.status();
    return client.ok() ? *std::move(client) : nullptr;
  }

  std::vector<float> RandomLogits(int64_t count, float scale = 3.0f) {
    std::normal_distribution<float> dist(0.0f, scale);
    std::vector<float> values(count);
    for (float& v : values) v = dist(rng_);
    return values;
  }

  std::vector<int64_t> RandomTargets(int64_t rows, int64_t vocab,
                                     double ignore_fraction = 0.0) {
    std::uniform_int_distribution<int64_t> dist(0, vocab - 1);
    std::bernoulli_distribution ignore(ignore_fraction);
    std::vector<int64_t> targets(rows);
    for (int64_t& t : targets) t = ignore(rng_) ? -100 : dist(rng_);
    return targets;
  }

  std::string UploadOrDie(DType dtype, std::vector<int64_t> shape,
                          const void* data, std::size_t bytes) {
    absl::StatusOr<TensorInfo> info =
        client_->Upload(dtype, shape, data, bytes);
    EXPECT_TRUE(info.ok()) << info.status();
    return info.ok() ? info->handle : "";
  }

  unsigned seed_ = 0;
  std::mt19937 rng_;
  std::unique_ptr<LossdProcess> server_;
  std::unique_ptr<Client> client_;
};

// Mean cross entropy over rows whose target is not -100, and its gradient,
// in fp64 (the formulas of kernels/cross_entropy.h without options).
struct Expected {
  double loss = 0.0;
  int64_t valid = 0;
  std::vector<double> gradient;
  std::vector<double> token_loss;
};

Expected MeanCrossEntropy(const std::vector<float>& logits,
                          const std::vector<int64_t>& targets, int64_t vocab) {
  const int64_t rows = static_cast<int64_t>(targets.size());
  Expected e;
  e.gradient.assign(logits.size(), 0.0);
  e.token_loss.assign(rows, 0.0);
  for (int64_t t : targets) e.valid += t != -100;
  for (int64_t r = 0; r < rows; ++r) {
    if (targets[r] == -100) continue;
    const float* row = logits.data() + r * vocab;
    double max = row[0];
    for (int64_t c = 1; c < vocab; ++c) max = std::max<double>(max, row[c]);
    double sum = 0.0;
    for (int64_t c = 0; c < vocab; ++c) sum += std::exp(row[c] - max);
    const double lse = max + std::log(sum);
    e.token_loss[r] = lse - row[targets[r]];
    e.loss += e.token_loss[r];
    for (int64_t c = 0; c < vocab; ++c) {
      e.gradient[r * vocab + c] =
          (std::exp(row[c] - lse) - (c == targets[r] ? 1.0 : 0.0)) / e.valid;
    }
  }
  if (e.valid > 0) e.loss /= e.valid;
  return e;
}

std::vector<float> AsFloats(const std::vector<uint8_t>& bytes) {
  std::vector<float> out(bytes.size() / sizeof(float));
  std::memcpy(out.data(), bytes.data(), out.size() * sizeof(float));
  return out;
}

TEST_F(ClientTest, UploadDownloadRoundTripIsBitExactAcrossChunkSizes) {
  ClientOptions small;
  small.chunk_bytes = 1000;  // not a multiple of any element size but 4/2/8
  std::unique_ptr<Client> chunky = Connect(small);
  ASSERT_NE(chunky, nullptr);
  struct Case {
    DType dtype;
    std::vector<int64_t> shape;
  } cases[] = {
      {DType::kFloat32, {1}},        {DType::kFloat32, {250}},
      {DType::kFloat32, {251}},      {DType::kFloat32, {7, 13}},
      {DType::kBFloat16, {3, 1001}}, {DType::kFloat16, {17, 61}},
      {DType::kInt32, {999}},        {DType::kInt64, {1001}},
  };
  for (Client* client : {chunky.get(), client_.get()}) {
    for (const Case& c : cases) {
      int64_t elements = 1;
      for (int64_t d : c.shape) elements *= d;
      std::vector<uint8_t> data(elements * DTypeSize(c.dtype));
      for (uint8_t& b : data) b = static_cast<uint8_t>(rng_());
      if (IsLogitsDType(c.dtype)) {
        // Keep floats finite: a NaN payload need not survive conversions.
        for (std::size_t i = 0; i < data.size(); i += DTypeSize(c.dtype)) {
          data[i + DTypeSize(c.dtype) - 1] &= 0x3f;
        }
      }
      std::vector<int64_t> progress;
      absl::StatusOr<TensorInfo> up =
          client->Upload(c.dtype, c.shape, data.data(), data.size(),
                         "round trip", [&](int64_t done, int64_t total) {
                           EXPECT_EQ(total, static_cast<int64_t>(data.size()));
                           progress.push_back(done);
                         });
      ASSERT_TRUE(up.ok()) << up.status();
      EXPECT_EQ(up->dtype, c.dtype);
      EXPECT_EQ(up->shape, c.shape);
      EXPECT_EQ(up->bytes, static_cast<int64_t>(data.size()));
      EXPECT_EQ(up->label, "round trip");
      ASSERT_FALSE(progress.empty());
      EXPECT_EQ(progress.back(), static_cast<int64_t>(data.size()));
      EXPECT_TRUE(std::is_sorted(progress.begin(), progress.end()));

      absl::StatusOr<DownloadedTensor> down = client->Download(up->handle);
      ASSERT_TRUE(down.ok()) << down.status();
      EXPECT_EQ(down->info.dtype, c.dtype);
      EXPECT_EQ(down->info.shape, c.shape);
      EXPECT_TRUE(down->data == data)
          << DTypeString(c.dtype) << " " << data.size() << " bytes";

      std::vector<uint8_t> buffer(data.size());
      absl::StatusOr<TensorInfo> into = client->DownloadInto(
          up->handle, DType::kInvalid, buffer.data(), buffer.size());
      ASSERT_TRUE(into.ok()) << into.status();
      EXPECT_TRUE(buffer == data);
      EXPECT_EQ(client
                    ->DownloadInto(up->handle, DType::kInvalid, buffer.data(),
                                   buffer.size() - 1)
                    .status()
                    .code(),
                absl::StatusCode::kOutOfRange);
      ASSERT_TRUE(client->Release(up->handle).ok());
    }
  }
}

TEST_F(ClientTest, LargeUploadUsesManyChunks) {
  const int64_t rows = 257, vocab = 4099;  // 4.2 MB: five 1 MiB chunks
  std::vector<float> logits = RandomLogits(rows * vocab);
  int calls = 0;
  absl::StatusOr<TensorInfo> up = client_->Upload(
      DType::kFloat32, {rows, vocab}, logits.data(),
      logits.size() * sizeof(float), "", [&](int64_t, int64_t) { ++calls; });
  ASSERT_TRUE(up.ok()) << up.status();
  EXPECT_EQ(calls, 5);
  absl::StatusOr<DownloadedTensor> down = client_->Download(up->handle);
  ASSERT_TRUE(down.ok()) << down.status();
  ASSERT_EQ(down->data.size(), logits.size() * sizeof(float));
  EXPECT_EQ(std::memcmp(down->data.data(), logits.data(), down->data.size()),
            0);
}

TEST_F(ClientTest, DownloadConvertsToBf16) {
  std::vector<float> values = RandomLogits(1000);
  const std::string handle = UploadOrDie(DType::kFloat32, {1000}, values.data(),
                                         values.size() * sizeof(float));
  absl::StatusOr<DownloadedTensor> down =
      client_->Download(handle, DType::kBFloat16);
  ASSERT_TRUE(down.ok()) << down.status();
  EXPECT_EQ(down->info.dtype, DType::kBFloat16);
  ASSERT_EQ(down->data.size(), 2000u);
  for (int i = 0; i < 1000; ++i) {
    uint16_t bits;
    std::memcpy(&bits, down->data.data() + 2 * i, 2);
    ASSERT_EQ(bits, FloatToBF16(values[i])) << i;
  }
}

TEST_F(ClientTest, DescribeListRelease) {
  std::vector<int64_t> targets = {1, 2, 3};
  absl::StatusOr<TensorInfo> up =
      client_->Upload(DType::kInt64, {3}, targets.data(), 24, "targets");
  ASSERT_TRUE(up.ok()) << up.status();
  absl::StatusOr<TensorInfo> info = client_->Describe(up->handle);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->handle, up->handle);
  EXPECT_EQ(info->dtype, DType::kInt64);
  EXPECT_EQ(info->shape, std::vector<int64_t>{3});
  EXPECT_EQ(info->bytes, 24);
  EXPECT_EQ(info->state, TensorState::kLogits);
  EXPECT_EQ(info->label, "targets");
  EXPECT_EQ(info->device, "cpu");
  EXPECT_FALSE(info->tenant.empty());
  EXPECT_LE(info->created, absl::Now());
  EXPECT_GT(info->created, absl::Now() - absl::Minutes(5));

  absl::StatusOr<ListResult> list = client_->List();
  ASSERT_TRUE(list.ok()) << list.status();
  ASSERT_EQ(list->tensors.size(), 1u);
  EXPECT_EQ(list->tensors[0].handle, up->handle);
  EXPECT_EQ(list->server.device, "cpu");
  EXPECT_GE(list->server.used_bytes, 24);

  absl::StatusOr<int64_t> released = client_->Release(up->handle);
  ASSERT_TRUE(released.ok()) << released.status();
  EXPECT_EQ(*released, 24);
  EXPECT_EQ(client_->Describe(up->handle).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(client_->Release(up->handle).status().code(),
            absl::StatusCode::kNotFound);
  list = client_->List();
  ASSERT_TRUE(list.ok());
  EXPECT_TRUE(list->tensors.empty());
}

// List gathers every page: 11 tensors in pages of 3 come back whole, oldest
// first.
TEST_F(ClientTest, ListGathersEveryPage) {
  std::vector<std::string> handles;
  for (int i = 0; i < 11; ++i) {
    const int32_t value = i;
    absl::StatusOr<TensorInfo> up = client_->Upload(
        DType::kInt32, {1}, &value, sizeof(value), "t" + std::to_string(i));
    ASSERT_TRUE(up.ok()) << up.status();
    handles.push_back(up->handle);
  }
  for (int page_size : {3, 11, kListPageSize}) {
    SCOPED_TRACE(page_size);
    absl::StatusOr<ListResult> list = client_->List(page_size);
    ASSERT_TRUE(list.ok()) << list.status();
    ASSERT_EQ(list->tensors.size(), handles.size());
    std::vector<std::string> listed;
    for (const TensorInfo& info : list->tensors) listed.push_back(info.handle);
    std::sort(listed.begin(), listed.end());
    std::vector<std::string> expected = handles;
    std::sort(expected.begin(), expected.end());
    EXPECT_EQ(listed, expected);
    for (size_t i = 1; i < list->tensors.size(); ++i) {
      EXPECT_LE(list->tensors[i - 1].created, list->tensors[i].created);
    }
    EXPECT_EQ(list->server.tensors, 11);
  }
  EXPECT_EQ(client_->List(0).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(ClientTest, ForwardInPlaceBackwardDownloadGradient) {
  const int64_t rows = 37, vocab = 101;
  std::vector<float> logits = RandomLogits(rows * vocab);
  std::vector<int64_t> targets = RandomTargets(rows, vocab, 0.2);
  const Expected expected = MeanCrossEntropy(logits, targets, vocab);
  const std::string handle =
      UploadOrDie(DType::kFloat32, {rows, vocab}, logits.data(),
                  logits.size() * sizeof(float));
  const std::string targets_handle =
      UploadOrDie(DType::kInt64, {rows}, targets.data(), rows * 8);

  absl::StatusOr<ForwardResult> fwd =
      client_->Forward(handle, Targets::Handle(targets_handle));
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  EXPECT_NEAR(fwd->loss, expected.loss, 1e-5 * expected.loss);
  EXPECT_EQ(fwd->valid_tokens, expected.valid);
  EXPECT_EQ(fwd->gradient, handle);
  EXPECT_EQ(fwd->denominator, static_cast<double>(expected.valid));

  absl::StatusOr<TensorInfo> info = client_->Describe(handle);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->state, TensorState::kGradient);

  absl::StatusOr<DownloadedTensor> grad = client_->Download(handle);
  ASSERT_TRUE(grad.ok()) << grad.status();
  std::vector<float> g = AsFloats(grad->data);
  ASSERT_EQ(g.size(), expected.gradient.size());
  for (std::size_t i = 0; i < g.size(); ++i) {
    ASSERT_NEAR(g[i], expected.gradient[i], 1e-6) << i;
  }

  // Backward is idempotent: 0.5 twice is still 0.5 * gradient.
  for (int i = 0; i < 2; ++i) {
    absl::StatusOr<BackwardResult> back = client_->Backward(handle, 0.5);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_FALSE(back->kernel_launched);
    EXPECT_EQ(back->tensor.pending_scale, 0.5);
  }
  grad = client_->Download(handle);
  ASSERT_TRUE(grad.ok()) << grad.status();
  std::vector<float> half = AsFloats(grad->data);
  for (std::size_t i = 0; i < half.size(); ++i) {
    ASSERT_EQ(half[i], g[i] * 0.5f) << i;
  }

  absl::StatusOr<BackwardResult> back =
      client_->Backward(handle, 2.0, /*materialize=*/true);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(back->kernel_launched);
  grad = client_->Download(handle);
  ASSERT_TRUE(grad.ok()) << grad.status();
  std::vector<float> doubled = AsFloats(grad->data);
  for (std::size_t i = 0; i < doubled.size(); ++i) {
    ASSERT_EQ(doubled[i], g[i] * 2.0f) << i;
  }

  // The logits are gone: a second Forward is refused and says why.
  absl::StatusOr<ForwardResult> again =
      client_->Forward(handle, Targets::Handle(targets_handle));
  EXPECT_EQ(again.status().code(), absl::StatusCode::kFailedPrecondition);
  // Backward on logits is refused too.
  EXPECT_EQ(client_->Backward(targets_handle, 1.0).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST_F(ClientTest, ForwardOutOfPlaceWithInlineTargetsAndTokenOutputs) {
  const int64_t rows = 29, vocab = 64;
  std::vector<float> logits = RandomLogits(rows * vocab);
  std::vector<int64_t> targets64 = RandomTargets(rows, vocab, 0.1);
  std::vector<int32_t> targets(targets64.begin(), targets64.end());
  const Expected expected = MeanCrossEntropy(logits, targets64, vocab);
  const std::string handle =
      UploadOrDie(DType::kFloat32, {rows, vocab}, logits.data(),
                  logits.size() * sizeof(float));

  ForwardOptions options;
  options.mode = GradientMode::kOutOfPlace;
  options.loss.reduction = Reduction::kNone;
  options.token_loss = true;
  options.token_lse = true;
  options.token_argmax = true;
  options.gradient_label = "grad";
  absl::StatusOr<ForwardResult> fwd = client_->Forward(
      handle, Targets::Inline(DType::kInt32, targets.data(), rows * 4),
      options);
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  ASSERT_NE(fwd->gradient, handle);
  ASSERT_EQ(fwd->token_loss.size(), static_cast<std::size_t>(rows));
  ASSERT_EQ(fwd->token_lse.size(), static_cast<std::size_t>(rows));
  ASSERT_EQ(fwd->token_argmax.size(), static_cast<std::size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) {
    EXPECT_NEAR(fwd->token_loss[r], expected.token_loss[r],
                1e-5 * (1 + expected.token_loss[r]))
        << r;
    const float* row = logits.data() + r * vocab;
    EXPECT_EQ(fwd->token_argmax[r], std::max_element(row, row + vocab) - row);
  }

  // The logits are unchanged and still usable.
  absl::StatusOr<DownloadedTensor> kept = client_->Download(handle);
  ASSERT_TRUE(kept.ok());
  EXPECT_EQ(std::memcmp(kept->data.data(), logits.data(), kept->data.size()),
            0);
  absl::StatusOr<TensorInfo> grad_info = client_->Describe(fwd->gradient);
  ASSERT_TRUE(grad_info.ok()) << grad_info.status();
  EXPECT_EQ(grad_info->state, TensorState::kGradient);
  EXPECT_EQ(grad_info->label, "grad");

  // Per-token grad_output for reduction none: row r scaled by factor[r].
  std::vector<float> factors(rows);
  for (int64_t r = 0; r < rows; ++r) factors[r] = 0.25f * (r + 1);
  absl::StatusOr<BackwardResult> back =
      client_->Backward(fwd->gradient, factors);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(back->tensor.pending_token_scale);
  absl::StatusOr<DownloadedTensor> grad = client_->Download(fwd->gradient);
  ASSERT_TRUE(grad.ok()) << grad.status();
  std::vector<float> g = AsFloats(grad->data);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < vocab; ++c) {
      // Unreduced gradient = the mean gradient times the valid count.
      const double want =
          expected.gradient[r * vocab + c] * expected.valid * factors[r];
      ASSERT_NEAR(g[r * vocab + c], want, 1e-5) << r << "," << c;
    }
  }
  EXPECT_EQ(client_->Backward(fwd->gradient, std::vector<float>(rows + 1, 1.0f))
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(ClientTest, EvaluateEqualsForwardWithoutGradient) {
  const int64_t rows = 203, vocab = 517;
  std::vector<float> logits = RandomLogits(rows * vocab);
  std::vector<int64_t> targets = RandomTargets(rows, vocab, 0.1);
  const std::string handle =
      UploadOrDie(DType::kFloat32, {rows, vocab}, logits.data(),
                  logits.size() * sizeof(float));
  for (const CrossEntropyOptions& loss :
       {CrossEntropyOptions{}, CrossEntropyOptions{-100, 0.1f, Reduction::kSum,
                                                   1e-4f, 30.0f, 0.0, 1.0f}}) {
    ForwardOptions forward_options;
    forward_options.mode = GradientMode::kNone;
    forward_options.loss = loss;
    absl::StatusOr<ForwardResult> fwd = client_->Forward(
        handle, Targets::Inline(DType::kInt64, targets.data(), rows * 8),
        forward_options);
    ASSERT_TRUE(fwd.ok()) << fwd.status();
    EXPECT_TRUE(fwd->gradient.empty());
    EvaluateOptions eval_options;
    eval_options.loss = loss;
    for (int64_t block_rows : {int64_t{1}, int64_t{7}, int64_t{64}, rows}) {
      int64_t last_progress = 0;
      absl::StatusOr<EvaluateResult> eval =
          client_->Evaluate(rows, vocab, DType::kFloat32, logits.data(),
                            DType::kInt64, targets.data(), eval_options,
                            block_rows, [&](int64_t done, int64_t total) {
                              EXPECT_EQ(total, rows);
                              last_progress = done;
                            });
      ASSERT_TRUE(eval.ok()) << eval.status();
      EXPECT_EQ(last_progress, rows);
      EXPECT_EQ(eval->rows, rows);
      EXPECT_EQ(eval->valid_tokens, fwd->valid_tokens);
      EXPECT_EQ(eval->correct_tokens, fwd->correct_tokens);
      EXPECT_NEAR(eval->loss, fwd->loss, 1e-12 * std::abs(fwd->loss))
          << "block_rows " << block_rows;
      EXPECT_NEAR(eval->z_loss, fwd->z_loss, 1e-12 * std::abs(fwd->z_loss));
      EXPECT_EQ(eval->denominator, fwd->denominator);
    }
  }
  // Forward without a gradient left the logits as they were.
  absl::StatusOr<TensorInfo> info = client_->Describe(handle);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->state, TensorState::kLogits);
}

TEST_F(ClientTest, EvaluateErrors) {
  const int64_t rows = 8, vocab = 16;
  std::vector<float> logits = RandomLogits(rows * vocab);
  std::vector<int64_t> targets = RandomTargets(rows, vocab);
  EvaluateOptions none;
  none.loss.reduction = Reduction::kNone;
  EXPECT_EQ(client_
                ->Evaluate(rows, vocab, DType::kFloat32, logits.data(),
                           DType::kInt64, targets.data(), none)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  targets[3] = vocab;  // out of range
  EXPECT_EQ(client_
                ->Evaluate(rows, vocab, DType::kFloat32, logits.data(),
                           DType::kInt64, targets.data(), EvaluateOptions())
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  // A block that is not a whole number of rows.
  absl::StatusOr<EvaluateResult> ragged = client_->Evaluate(
      vocab, DType::kFloat32, DType::kInt64, EvaluateOptions(),
      [&, sent = false](RowBlock* block) mutable -> absl::StatusOr<bool> {
        if (sent) return false;
        sent = true;
        block->logits.assign(reinterpret_cast<const char*>(logits.data()),
                             vocab * 4 + 4);
        block->targets.assign(8, '\0');
        return true;
      });
  EXPECT_EQ(ragged.status().code(), absl::StatusCode::kInvalidArgument);
  // The producer's own error is returned as is.
  absl::StatusOr<EvaluateResult> failed = client_->Evaluate(
      vocab, DType::kFloat32, DType::kInt64, EvaluateOptions(),
      [](RowBlock*) -> absl::StatusOr<bool> {
        return absl::DataLossError("disk on fire");
      });
  EXPECT_EQ(failed.status(), absl::DataLossError("disk on fire"));
  EXPECT_EQ(
      client_
          ->Evaluate(0, DType::kFloat32, DType::kInt64, EvaluateOptions(),
                     [](RowBlock*) -> absl::StatusOr<bool> { return false; })
          .status()
          .code(),
      absl::StatusCode::kInvalidArgument);
}

TEST_F(ClientTest, ErrorsMapToAbslCodes) {
  float one = 1.0f;
  // Client-side argument checks.
  EXPECT_EQ(client_->Upload(DType::kFloat32, {2}, &one, 4).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Client::Connect("", ClientOptions()).status().code(),
            absl::StatusCode::kInvalidArgument);
  ClientOptions zero_chunk;
  zero_chunk.chunk_bytes = 0;
  EXPECT_EQ(Client::Connect("x:1", zero_chunk).status().code(),
            absl::StatusCode::kInvalidArgument);

  // Server-side codes.
  EXPECT_EQ(client_->Upload(DType::kFloat32, {0}, nullptr, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  absl::StatusOr<TensorInfo> missing =
      client_->Describe("00000000-0123456789abcdef0123456789abcdef");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_FALSE(missing.status().message().empty());
  EXPECT_EQ(client_->Download("00000000-0123456789abcdef0123456789abcdef")
                .status()
                .code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(client_->Backward("00000000-0123456789abcdef0123456789abcdef", 1.0)
                .status()
                .code(),
            absl::StatusCode::kNotFound);
  std::vector<float> logits = RandomLogits(4 * 5);
  const std::string handle =
      UploadOrDie(DType::kFloat32, {4, 5}, logits.data(), 80);
  const int64_t bad_targets[4] = {0, 1, 5, 2};
  EXPECT_EQ(
      client_->Forward(handle, Targets::Inline(DType::kInt64, bad_targets, 32))
          .status()
          .code(),
      absl::StatusCode::kInvalidArgument);
  ForwardOptions bad_smoothing;
  bad_smoothing.loss.label_smoothing = 1.5f;
  const int64_t good_targets[4] = {0, 1, 4, 2};
  EXPECT_EQ(
      client_
          ->Forward(handle, Targets::Inline(DType::kInt64, good_targets, 32),
                    bad_smoothing)
          .status()
          .code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      client_
          ->Forward(handle, Targets::Handle(
                                "00000000-0123456789abcdef0123456789abcdef"))
          .status()
          .code(),
      absl::StatusCode::kNotFound);
  // Nothing changed: the logits are still logits.
  absl::StatusOr<TensorInfo> info = client_->Describe(handle);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->state, TensorState::kLogits);

  // A deadline that passes while the stream is open: the producer holds the
  // first block back until well after it (gRPC rounds deadlines to
  // milliseconds, so a unary call can beat a tiny one).
  ClientOptions hurried;
  hurried.deadline = absl::Milliseconds(20);
  std::unique_ptr<Client> hurried_client = Connect(hurried);
  ASSERT_NE(hurried_client, nullptr);
  int blocks = 0;
  absl::StatusOr<EvaluateResult> late = hurried_client->Evaluate(
      5, DType::kFloat32, DType::kInt64, EvaluateOptions(),
      [&](RowBlock* block) -> absl::StatusOr<bool> {
        if (blocks++ > 0) return false;
        absl::Notification never;
        never.WaitForNotificationWithTimeout(absl::Milliseconds(200));
        block->logits.assign(reinterpret_cast<const char*>(logits.data()), 20);
        block->targets.assign(reinterpret_cast<const char*>(good_targets), 8);
        return true;
      });
  EXPECT_EQ(late.status().code(), absl::StatusCode::kDeadlineExceeded)
      << late.status();
}

TEST_F(ClientTest, OverBudgetUploadIsResourceExhausted) {
  absl::StatusOr<std::unique_ptr<LossdProcess>> small =
      LossdProcess::Start(LOSSD_BINARY_PATH, {"--memory_budget=1M"});
  ASSERT_TRUE(small.ok()) << small.status();
  absl::StatusOr<std::unique_ptr<Client>> client =
      Client::Connect((*small)->address());
  ASSERT_TRUE(client.ok());
  std::vector<float> big(600000);  // 2.4 MB
  absl::StatusOr<TensorInfo> up = (*client)->Upload(
      DType::kFloat32, {600, 1000}, big.data(), big.size() * sizeof(float));
  EXPECT_EQ(up.status().code(), absl::StatusCode::kResourceExhausted);
  absl::StatusOr<ServerInfo> info = (*client)->GetServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->used_bytes, 0);
  EXPECT_EQ(info->tensors, 0);
}

TEST_F(ClientTest, UnreachableServerIsUnavailable) {
  const std::string address = server_->address();
  absl::StatusOr<int> exit_code = server_->Stop();
  ASSERT_TRUE(exit_code.ok());
  EXPECT_EQ(*exit_code, 0);
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(address);
  ASSERT_TRUE(client.ok());
  EXPECT_EQ((*client)->GetServerInfo().status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ((*client)->Health().status().code(),
            absl::StatusCode::kUnavailable);
}

// A call made while the channel is not connected waits up to connect_wait
// for the connection: a server that comes up within it is reached (as one
// whose first connection attempt failed is); with no wait the call fails
// fast.
TEST_F(ClientTest, CallsWaitUpToConnectWaitForTheConnection) {
  const int port = server_->port();
  const std::string address = server_->address();
  ASSERT_TRUE(server_->Stop().ok());
  ClientOptions fail_fast;
  fail_fast.connect_wait = absl::ZeroDuration();
  absl::StatusOr<std::unique_ptr<Client>> impatient =
      Client::Connect(address, fail_fast);
  ASSERT_TRUE(impatient.ok());
  EXPECT_EQ((*impatient)->GetServerInfo().status().code(),
            absl::StatusCode::kUnavailable);
  ClientOptions patient;
  patient.connect_wait = absl::Seconds(30);
  absl::StatusOr<std::unique_ptr<Client>> client =
      Client::Connect(address, patient);
  ASSERT_TRUE(client.ok());
  absl::StatusOr<std::unique_ptr<LossdProcess>> restarted =
      absl::UnknownError("not started");
  std::thread start([&] {
    // The call below is waiting by then: its first attempts are refused.
    absl::SleepFor(absl::Milliseconds(500));
    restarted =
        LossdProcess::Start(LOSSD_BINARY_PATH, {absl::StrCat("--port=", port)});
  });
  absl::StatusOr<ServerInfo> info = (*client)->GetServerInfo();
  start.join();
  ASSERT_TRUE(restarted.ok()) << restarted.status();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->device, "cpu");
  ClientOptions negative;
  negative.connect_wait = absl::Seconds(-1);
  EXPECT_EQ(Client::Connect(address, negative).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(ClientTest, HealthAndServerInfo) {
  absl::StatusOr<bool> live = client_->Health("");
  ASSERT_TRUE(live.ok()) << live.status();
  EXPECT_TRUE(*live);
  absl::StatusOr<bool> ready = client_->Health(kLossdService);
  ASSERT_TRUE(ready.ok()) << ready.status();
  EXPECT_TRUE(*ready);
  EXPECT_EQ(client_->Health("no.such.Service").status().code(),
            absl::StatusCode::kNotFound);
  absl::StatusOr<ServerInfo> info = client_->GetServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->device, "cpu");
  EXPECT_FALSE(info->instance_id.empty());
  EXPECT_GT(info->budget_bytes, 0);
  EXPECT_EQ(info->free_bytes, info->budget_bytes - info->used_bytes);
}

TEST_F(ClientTest, OneClientServesManyThreads) {
  constexpr int kThreads = 8;
  std::vector<std::vector<float>> data(kThreads);
  for (int t = 0; t < kThreads; ++t) data[t] = RandomLogits(10000 + 37 * t);
  std::vector<absl::Status> results(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      const std::vector<float>& values = data[t];
      for (int round = 0; round < 5 && results[t].ok(); ++round) {
        absl::StatusOr<TensorInfo> up = client_->Upload(
            DType::kFloat32, {static_cast<int64_t>(values.size())},
            values.data(), values.size() * sizeof(float));
        if (!up.ok()) {
          results[t] = up.status();
          break;
        }
        absl::StatusOr<DownloadedTensor> down = client_->Download(up->handle);
        if (!down.ok()) {
          results[t] = down.status();
        } else if (std::memcmp(down->data.data(), values.data(),
                               down->data.size()) != 0 ||
                   down->data.size() != values.size() * sizeof(float)) {
          results[t] = absl::DataLossError("mismatch");
        }
        absl::StatusOr<int64_t> released = client_->Release(up->handle);
        if (!released.ok()) results[t] = released.status();
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (int t = 0; t < kThreads; ++t) EXPECT_TRUE(results[t].ok()) << results[t];
}

// UploadFrom and DownloadTo over each transport (data connections, gRPC
// stripes, one gRPC stream): the bytes arrive intact, pieces hold whole
// elements and at most piece_bytes, together cover the tensor exactly once,
// and a source may answer from its own memory or from the scratch buffer.
TEST_F(ClientTest, PieceWiseTransfersAreBitExactOverEveryTransport) {
  struct Transport {
    const char* name;
    bool data_connection;
    int streams;
    std::size_t chunk_bytes;
  } transports[] = {{"data connections", true, 3, std::size_t{1} << 20},
                    {"gRPC stripes", false, 3, 1000},
                    {"one gRPC stream", false, 1, 1000}};
  const int64_t rows = 301, vocab = 1001;  // 1.2 MB: pieces cross stripes
  std::vector<float> logits = RandomLogits(rows * vocab);
  const std::size_t bytes = logits.size() * sizeof(float);
  const char* base = reinterpret_cast<const char*>(logits.data());
  for (const Transport& transport : transports) {
    SCOPED_TRACE(transport.name);
    ClientOptions options;
    options.data_connection = transport.data_connection;
    options.upload_streams = transport.streams;
    options.chunk_bytes = transport.chunk_bytes;
    options.stripe_min_bytes = 1;
    options.piece_bytes = 64 << 10;
    std::unique_ptr<Client> client = Connect(options);
    ASSERT_NE(client, nullptr);

    absl::Mutex mu;
    std::vector<std::pair<int64_t, std::size_t>> pieces;
    std::set<void*> scratches;
    auto record = [&](int64_t offset, std::size_t size) {
      absl::MutexLock lock(&mu);
      pieces.emplace_back(offset, size);
    };
    // Every other piece through the scratch buffer, the rest in place.
    const UploadSource source =
        [&](int64_t offset, std::size_t size,
            void* scratch) -> absl::StatusOr<const void*> {
      record(offset, size);
      {
        absl::MutexLock lock(&mu);
        scratches.insert(scratch);
      }
      if ((offset / (64 << 10)) % 2 == 0) return base + offset;
      std::memcpy(scratch, base + offset, size);
      return scratch;
    };
    absl::StatusOr<TensorInfo> up =
        client->UploadFrom(DType::kFloat32, {rows, vocab}, source, "pieces");
    ASSERT_TRUE(up.ok()) << up.status();
    EXPECT_EQ(up->bytes, static_cast<int64_t>(bytes));
    EXPECT_EQ(up->label, "pieces");

    auto check_cover = [&](std::size_t total, std::size_t element) {
      std::sort(pieces.begin(), pieces.end());
      int64_t next = 0;
      for (const auto& [offset, size] : pieces) {
        EXPECT_EQ(offset, next);
        EXPECT_GT(size, 0u);
        EXPECT_LE(size, options.piece_bytes);
        EXPECT_EQ(size % element, 0u);
        EXPECT_EQ(offset % static_cast<int64_t>(element), 0);
        next = offset + static_cast<int64_t>(size);
      }
      EXPECT_EQ(next, static_cast<int64_t>(total));
      pieces.clear();
    };
    check_cover(bytes, sizeof(float));

    // The same scratch buffers serve the next transfer.
    const std::set<void*> first_scratches = scratches;
    absl::StatusOr<TensorInfo> again =
        client->UploadFrom(DType::kFloat32, {rows, vocab}, source);
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_EQ(scratches, first_scratches);
    pieces.clear();
    ASSERT_TRUE(client->Release(again->handle).ok());

    for (DType as : {DType::kInvalid, DType::kBFloat16}) {
      absl::StatusOr<DownloadedTensor> whole = client->Download(up->handle, as);
      ASSERT_TRUE(whole.ok()) << whole.status();
      std::vector<uint8_t> received(whole->data.size() + 1, 0xee);
      int headers = 0;
      absl::StatusOr<TensorInfo> down = client->DownloadTo(
          up->handle, as,
          [&](const TensorInfo& info) {
            ++headers;
            EXPECT_EQ(info.bytes, static_cast<int64_t>(whole->data.size()));
            EXPECT_EQ(info.shape, (std::vector<int64_t>{rows, vocab}));
            return absl::OkStatus();
          },
          [&](int64_t offset, const void* data, std::size_t size) {
            record(offset, size);
            std::memcpy(received.data() + offset, data, size);
            return absl::OkStatus();
          });
      ASSERT_TRUE(down.ok()) << down.status();
      EXPECT_EQ(headers, 1);
      EXPECT_EQ(down->dtype, whole->info.dtype);
      EXPECT_EQ(received.back(), 0xee);
      received.pop_back();
      EXPECT_TRUE(received == whole->data);
      check_cover(whole->data.size(), DTypeSize(whole->info.dtype));
    }
    absl::StatusOr<DownloadedTensor> back = client->Download(up->handle);
    ASSERT_TRUE(back.ok()) << back.status();
    ASSERT_EQ(back->data.size(), bytes);
    EXPECT_EQ(std::memcmp(back->data.data(), base, bytes), 0);
    ASSERT_TRUE(client->Release(up->handle).ok());
  }
}

// A source's or a sink's error ends the transfer with that error; a failed
// upload leaves nothing on the server, a failed download leaves the tensor.
TEST_F(ClientTest, PieceWiseTransferErrorsComeBackAndLeaveNothing) {
  for (bool data_connection : {true, false}) {
    SCOPED_TRACE(data_connection ? "data connections" : "gRPC");
    ClientOptions options;
    options.data_connection = data_connection;
    options.stripe_min_bytes = 1;
    options.piece_bytes = 64 << 10;
    std::unique_ptr<Client> client = Connect(options);
    ASSERT_NE(client, nullptr);
    std::vector<float> logits = RandomLogits(300 * 1000);
    const char* base = reinterpret_cast<const char*>(logits.data());
    absl::StatusOr<TensorInfo> failed = client->UploadFrom(
        DType::kFloat32, {300, 1000},
        [&](int64_t offset, std::size_t, void*) -> absl::StatusOr<const void*> {
          if (offset >= (512 << 10)) {
            return absl::DataLossError("the source broke");
          }
          return base + offset;
        });
    EXPECT_EQ(failed.status().code(), absl::StatusCode::kDataLoss);
    EXPECT_THAT(failed.status().message(), HasSubstr("the source broke"));
    absl::StatusOr<ListResult> list = client->List();
    ASSERT_TRUE(list.ok()) << list.status();
    EXPECT_TRUE(list->tensors.empty());

    absl::StatusOr<TensorInfo> up = client->Upload(
        DType::kFloat32, {300, 1000}, logits.data(), logits.size() * 4);
    ASSERT_TRUE(up.ok()) << up.status();
    absl::StatusOr<TensorInfo> sunk = client->DownloadTo(
        up->handle, DType::kInvalid, nullptr,
        [](int64_t offset, const void*, std::size_t) {
          return offset > 0 ? absl::AbortedError("the sink is full")
                            : absl::OkStatus();
        });
    EXPECT_EQ(sunk.status().code(), absl::StatusCode::kAborted);
    absl::StatusOr<TensorInfo> refused = client->DownloadTo(
        up->handle, DType::kInvalid,
        [](const TensorInfo&) { return absl::OutOfRangeError("too big"); },
        [](int64_t, const void*, std::size_t) {
          ADD_FAILURE() << "a piece after a refused header";
          return absl::OkStatus();
        });
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kOutOfRange);
    absl::StatusOr<DownloadedTensor> still = client->Download(up->handle);
    ASSERT_TRUE(still.ok()) << still.status();
    EXPECT_EQ(std::memcmp(still->data.data(), base, still->data.size()), 0);
    ASSERT_TRUE(client->Release(up->handle).ok());
  }
  ClientOptions tiny;
  tiny.piece_bytes = 1000;
  EXPECT_EQ(Client::Connect(server_->address(), tiny).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// A sink's error on a download larger than the data connections' socket
// buffers: the server is still sending when the client closes them, and its
// report of the closed connections must not replace the sink's error (a full
// file system is RESOURCE_EXHAUSTED, not UNAVAILABLE).
TEST_F(ClientTest, SinkErrorWinsOverTheServersReportOfClosedConnections) {
  ClientOptions options;
  options.stripe_min_bytes = 1;
  std::unique_ptr<Client> client = Connect(options);
  ASSERT_NE(client, nullptr);
  std::vector<float> values(std::size_t{16} << 20, 1.0f);  // 64 MiB
  absl::StatusOr<TensorInfo> up =
      client->Upload(DType::kFloat32, {4096, 4096}, values.data(),
                     values.size() * sizeof(float));
  ASSERT_TRUE(up.ok()) << up.status();
  for (int attempt = 0; attempt < 3; ++attempt) {
    absl::StatusOr<TensorInfo> sunk = client->DownloadTo(
        up->handle, DType::kInvalid, nullptr,
        [](int64_t, const void*, std::size_t) {
          return absl::ResourceExhaustedError("the file system is full");
        });
    EXPECT_EQ(sunk.status().code(), absl::StatusCode::kResourceExhausted)
        << sunk.status();
  }
  ASSERT_TRUE(client->Release(up->handle).ok());
}

}  // namespace
}  // namespace lossd
