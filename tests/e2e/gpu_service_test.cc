// The CUDA device behind the real gRPC service: every RPC, option, mode and
// logits dtype against an in-process server on 127.0.0.1:0 with --device=cuda,
// compared with a second in-process server on the CPU device (the reference
// backend). Skipped, with the reason, where no GPU is visible.
#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/float16.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kernels/cpu/convert.h"
#include "lossd/v1/lossd.grpc.pb.h"
#include "server/cuda_device.h"
#include "server/server.h"
#include "tests/e2e/bytes.h"
#include "tests/e2e/test_server.h"

namespace lossd {
namespace {

namespace pb = ::lossd::v1;
using ::lossd::e2e_test::Bytes;
using ::lossd::e2e_test::FromBytes;
using ::lossd::e2e_test::LargeMessageChannel;
using ::lossd::e2e_test::LoopbackConfig;
using ::testing::HasSubstr;

// Host floats of a stored buffer of `dtype`.
std::vector<float> ToFloats(const std::string& bytes, DType dtype) {
  const size_t count = bytes.size() / DTypeSize(dtype);
  std::vector<float> out(count);
  EXPECT_TRUE(ConvertAndScale(bytes.data(), dtype, out.data(), DType::kFloat32,
                              0, static_cast<int64_t>(count), 1, 1.0f, nullptr)
                  .ok());
  return out;
}

// Logits of `dtype` drawn from N(0, 2), as bytes.
std::string RandomLogits(std::mt19937_64& rng, DType dtype, int64_t count) {
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::vector<float> values(static_cast<size_t>(count));
  for (float& value : values) value = normal(rng);
  std::string out(static_cast<size_t>(count) * DTypeSize(dtype), '\0');
  EXPECT_TRUE(ConvertAndScale(values.data(), DType::kFloat32, out.data(), dtype,
                              0, count, 1, 1.0f, nullptr)
                  .ok());
  return out;
}

// Relative size of one rounding of `dtype`.
double Ulp(DType dtype) {
  switch (dtype) {
    case DType::kBFloat16:
      return std::ldexp(1.0, -7);
    case DType::kFloat16:
      return std::ldexp(1.0, -10);
    default:
      return std::ldexp(1.0, -23);
  }
}

struct Downloaded {
  grpc::Status status;
  pb::TensorInfo header;
  std::string bytes;
};

// One in-process server and its stub.
class Endpoint {
 public:
  absl::Status Start(const std::string& device, int64_t budget) {
    absl::StatusOr<std::unique_ptr<LossdServer>> server =
        LossdServer::Start(LoopbackConfig(device, budget, absl::Seconds(5)));
    if (!server.ok()) return server.status();
    server_ = std::move(*server);
    stub_ = pb::Lossd::NewStub(LargeMessageChannel(server_->address()));
    return absl::OkStatus();
  }

  LossdServer* server() { return server_.get(); }
  pb::Lossd::Stub* stub() { return stub_.get(); }

  grpc::Status Upload(DType dtype, std::vector<int64_t> shape,
                      const std::string& bytes, size_t chunk,
                      pb::TensorInfo* info) {
    grpc::ClientContext context;
    pb::UploadResponse response;
    auto writer = stub_->Upload(&context, &response);
    pb::UploadRequest request;
    request.mutable_header()->set_dtype(static_cast<pb::DType>(dtype));
    for (int64_t dim : shape) request.mutable_header()->add_shape(dim);
    if (!writer->Write(request)) return writer->Finish();
    for (size_t at = 0; at < bytes.size(); at += chunk) {
      request.set_chunk(bytes.substr(at, chunk));
      if (!writer->Write(request)) break;
    }
    writer->WritesDone();
    grpc::Status status = writer->Finish();
    if (info != nullptr) *info = response.tensor();
    return status;
  }

  std::string MustUpload(DType dtype, std::vector<int64_t> shape,
                         const std::string& bytes, size_t chunk = 1 << 20) {
    pb::TensorInfo info;
    const grpc::Status status =
        Upload(dtype, std::move(shape), bytes, chunk, &info);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return info.handle();
  }

  Downloaded Download(const std::string& handle, DType as = DType::kInvalid,
                      int64_t chunk_bytes = 0) {
    grpc::ClientContext context;
    pb::DownloadRequest request;
    request.set_handle(handle);
    request.set_dtype(static_cast<pb::DType>(as));
    request.set_chunk_bytes(chunk_bytes);
    auto reader = stub_->Download(&context, request);
    Downloaded out;
    pb::DownloadResponse response;
    while (reader->Read(&response)) {
      if (response.has_header()) {
        out.header = response.header();
      } else {
        out.bytes += response.chunk();
      }
    }
    out.status = reader->Finish();
    return out;
  }

  grpc::Status Forward(const pb::ForwardRequest& request,
                       pb::ForwardResponse* response) {
    grpc::ClientContext context;
    return stub_->Forward(&context, request, response);
  }

  grpc::Status Backward(const pb::BackwardRequest& request,
                        pb::BackwardResponse* response) {
    grpc::ClientContext context;
    return stub_->Backward(&context, request, response);
  }

 private:
  std::unique_ptr<LossdServer> server_;
  std::unique_ptr<pb::Lossd::Stub> stub_;
};

// One random Forward configuration.
struct Case {
  DType dtype = DType::kFloat32;
  int64_t rows = 0;
  int64_t vocab = 0;
  pb::GradientMode mode = pb::GRADIENT_MODE_IN_PLACE;
  pb::Reduction reduction = pb::REDUCTION_MEAN;
  float label_smoothing = 0.0f;
  float z_loss_scale = 0.0f;
  float softcap = 0.0f;
  bool weights = false;
  bool int32_targets = false;
  bool inline_targets = false;
};

std::string Describe(const Case& c, uint64_t seed) {
  return absl::StrCat("seed ", seed, " dtype ", static_cast<int>(c.dtype), " [",
                      c.rows, ", ", c.vocab, "] mode ", c.mode, " reduction ",
                      c.reduction, " eps ", c.label_smoothing, " z ",
                      c.z_loss_scale, " softcap ", c.softcap, " weights ",
                      c.weights, " int32 ", c.int32_targets, " inline ",
                      c.inline_targets);
}

class GpuServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (CudaDeviceCount() == 0) {
      GTEST_SKIP() << "no CUDA device visible: the GPU service tests need one";
    }
    ASSERT_TRUE(gpu_.Start("cuda", int64_t{8} << 30).ok());
    ASSERT_TRUE(cpu_.Start("cpu", int64_t{2} << 30).ok());
    seed_ = std::random_device()();
    rng_.seed(seed_);
  }

  // Uploads the same inputs to both servers, runs Forward, compares every
  // output, then Backward + Download, and returns the GPU's gradient handle.
  void RunCase(const Case& c) {
    SCOPED_TRACE(Describe(c, seed_));
    const std::string logits = RandomLogits(rng_, c.dtype, c.rows * c.vocab);
    std::uniform_int_distribution<int64_t> target(0, c.vocab - 1);
    std::vector<int64_t> targets64(static_cast<size_t>(c.rows));
    for (int64_t& t : targets64) {
      t = rng_() % 7 == 0 ? -100 : target(rng_);
    }
    std::vector<int32_t> targets32(targets64.begin(), targets64.end());
    const DType targets_dtype = c.int32_targets ? DType::kInt32 : DType::kInt64;
    const std::string targets =
        c.int32_targets ? Bytes(targets32) : Bytes(targets64);
    std::vector<float> weights(static_cast<size_t>(c.vocab));
    std::uniform_real_distribution<float> weight(0.1f, 2.0f);
    for (float& w : weights) w = weight(rng_);

    pb::ForwardResponse responses[2];
    std::string gradients[2];
    Endpoint* endpoints[2] = {&gpu_, &cpu_};
    for (int side = 0; side < 2; ++side) {
      Endpoint& e = *endpoints[side];
      // Odd chunk sizes: pieces straddle the staging buffers.
      const std::string logits_handle =
          e.MustUpload(c.dtype, {c.rows, c.vocab}, logits, (3 << 20) + 7);
      pb::ForwardRequest request;
      request.set_logits(logits_handle);
      if (c.inline_targets) {
        request.mutable_targets_inline()->set_dtype(
            static_cast<pb::DType>(targets_dtype));
        request.mutable_targets_inline()->set_data(targets);
      } else {
        request.set_targets_handle(
            e.MustUpload(targets_dtype, {c.rows}, targets));
      }
      pb::LossOptions* options = request.mutable_options();
      options->set_reduction(c.reduction);
      options->set_label_smoothing(c.label_smoothing);
      options->set_z_loss_scale(c.z_loss_scale);
      options->set_softcap(c.softcap);
      if (c.weights) {
        options->set_class_weights(
            e.MustUpload(DType::kFloat32, {c.vocab}, Bytes(weights)));
      }
      request.set_mode(c.mode);
      request.mutable_outputs()->set_token_loss(true);
      request.mutable_outputs()->set_token_lse(true);
      request.mutable_outputs()->set_token_argmax(true);
      const grpc::Status status = e.Forward(request, &responses[side]);
      ASSERT_TRUE(status.ok()) << status.error_message();
      if (c.mode != pb::GRADIENT_MODE_NONE) {
        const Downloaded gradient = e.Download(responses[side].gradient());
        ASSERT_TRUE(gradient.status.ok()) << gradient.status.error_message();
        gradients[side] = gradient.bytes;
      }
      if (c.mode == pb::GRADIENT_MODE_OUT_OF_PLACE ||
          c.mode == pb::GRADIENT_MODE_NONE) {
        // The logits are untouched.
        EXPECT_EQ(e.Download(logits_handle).bytes, logits);
      }
    }
    const pb::ForwardResponse& gpu = responses[0];
    const pb::ForwardResponse& cpu = responses[1];
    EXPECT_NEAR(gpu.loss(), cpu.loss(), 2e-5 * std::abs(cpu.loss()) + 1e-6);
    EXPECT_NEAR(gpu.z_loss(), cpu.z_loss(),
                2e-5 * std::abs(cpu.z_loss()) + 1e-6);
    EXPECT_EQ(gpu.valid_tokens(), cpu.valid_tokens());
    EXPECT_EQ(gpu.correct_tokens(), cpu.correct_tokens());
    EXPECT_EQ(gpu.nonfinite_rows(), cpu.nonfinite_rows());
    EXPECT_NEAR(gpu.denominator(), cpu.denominator(),
                1e-9 * std::abs(cpu.denominator()));
    ASSERT_EQ(gpu.token_loss_size(), c.rows);
    ASSERT_EQ(gpu.token_lse_size(), c.rows);
    ASSERT_EQ(gpu.token_argmax_size(), c.rows);
    for (int64_t row = 0; row < c.rows; ++row) {
      ASSERT_NEAR(gpu.token_loss(row), cpu.token_loss(row),
                  2e-5 * std::abs(cpu.token_loss(row)) + 2e-6)
          << "row " << row;
      ASSERT_NEAR(gpu.token_lse(row), cpu.token_lse(row),
                  2e-5 * std::abs(cpu.token_lse(row)) + 2e-6)
          << "row " << row;
      ASSERT_EQ(gpu.token_argmax(row), cpu.token_argmax(row)) << "row " << row;
    }
    if (c.mode == pb::GRADIENT_MODE_NONE) return;
    ExpectGradientsClose(gradients[0], gradients[1], c.dtype);

    // Backward: nothing runs; the factor comes out with the download, and
    // repeating it does not compound.
    const double factor = 0.5;
    for (int repeat = 0; repeat < 2; ++repeat) {
      pb::BackwardRequest backward;
      backward.set_gradient(gpu.gradient());
      backward.set_scalar(factor);
      pb::BackwardResponse response;
      ASSERT_TRUE(gpu_.Backward(backward, &response).ok());
      EXPECT_FALSE(response.kernel_launched());
    }
    // On the way out, converted to bf16 on the device: bitwise the host
    // conversion of the unscaled gradient.
    const Downloaded scaled = gpu_.Download(gpu.gradient(), DType::kBFloat16);
    ASSERT_TRUE(scaled.status.ok()) << scaled.status.error_message();
    const int64_t elements = c.rows * c.vocab;
    std::string expected(static_cast<size_t>(elements) * 2, '\0');
    ASSERT_TRUE(ConvertAndScale(gradients[0].data(), c.dtype, expected.data(),
                                DType::kBFloat16, 0, elements, c.vocab,
                                static_cast<float>(factor), nullptr)
                    .ok());
    EXPECT_TRUE(scaled.bytes == expected) << "scaled bf16 download differs";

    // Materialize: one pass on the device, then the stored bytes are scaled.
    pb::BackwardRequest materialize;
    materialize.set_gradient(gpu.gradient());
    materialize.set_scalar(factor);
    materialize.set_materialize(true);
    pb::BackwardResponse response;
    ASSERT_TRUE(gpu_.Backward(materialize, &response).ok());
    EXPECT_TRUE(response.kernel_launched());
    const Downloaded materialized = gpu_.Download(gpu.gradient());
    std::string in_place = gradients[0];
    ASSERT_TRUE(ConvertAndScale(in_place.data(), c.dtype, in_place.data(),
                                c.dtype, 0, elements, c.vocab,
                                static_cast<float>(factor), nullptr)
                    .ok());
    EXPECT_TRUE(materialized.bytes == in_place)
        << "materialized gradient differs";
  }

  void ExpectGradientsClose(const std::string& gpu_bytes,
                            const std::string& cpu_bytes, DType dtype) {
    ASSERT_EQ(gpu_bytes.size(), cpu_bytes.size());
    const std::vector<float> gpu = ToFloats(gpu_bytes, dtype);
    const std::vector<float> cpu = ToFloats(cpu_bytes, dtype);
    // One rounding of the output dtype apart (the two backends may round an
    // fp32-close value to neighbours), plus fp32-level slack.
    const double ulp = Ulp(dtype);
    for (size_t i = 0; i < gpu.size(); ++i) {
      const double tolerance =
          ulp * std::max(std::abs(gpu[i]), std::abs(cpu[i])) + 1e-6;
      ASSERT_NEAR(gpu[i], cpu[i], tolerance) << "element " << i;
    }
  }

  Endpoint gpu_;
  Endpoint cpu_;
  uint64_t seed_ = 0;
  std::mt19937_64 rng_;
};

TEST_F(GpuServiceTest, ReportsTheCudaDevice) {
  grpc::ClientContext context;
  pb::ServerInfo info;
  ASSERT_TRUE(gpu_.stub()
                  ->GetServerInfo(&context, pb::GetServerInfoRequest(), &info)
                  .ok());
  EXPECT_EQ(info.device(), "cuda:0");
  EXPECT_EQ(info.budget_bytes(), int64_t{8} << 30);
}

TEST_F(GpuServiceTest, UploadDownloadRoundTripsEveryDtype) {
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    SCOPED_TRACE(
        absl::StrCat("seed ", seed_, " dtype ", static_cast<int>(dtype)));
    // 40 MiB of fp32: many staging pieces, chunks that straddle them.
    const int64_t rows = 80;
    const int64_t vocab = 131072;
    const std::string logits = RandomLogits(rng_, dtype, rows * vocab);
    const std::string handle =
        gpu_.MustUpload(dtype, {rows, vocab}, logits, (1 << 20) + 3);
    for (int64_t chunk : {int64_t{0}, int64_t{(5 << 20) + 2}}) {
      const Downloaded out = gpu_.Download(handle, DType::kInvalid, chunk);
      ASSERT_TRUE(out.status.ok()) << out.status.error_message();
      EXPECT_EQ(out.header.device(), "cuda:0");
      EXPECT_TRUE(out.bytes == logits) << "chunk " << chunk;
    }
    // Converted on the device: bitwise the host conversion.
    const Downloaded as_fp32 = gpu_.Download(handle, DType::kFloat32);
    ASSERT_TRUE(as_fp32.status.ok());
    EXPECT_TRUE(FromBytes<float>(as_fp32.bytes) == ToFloats(logits, dtype));
  }
  std::vector<int64_t> targets = {1, 2, -100, 7};
  const std::string handle =
      gpu_.MustUpload(DType::kInt64, {4}, Bytes(targets));
  EXPECT_EQ(gpu_.Download(handle).bytes, Bytes(targets));
}

TEST_F(GpuServiceTest, ForwardMatchesTheCpuDeviceForEveryModeAndDtype) {
  const pb::GradientMode modes[] = {pb::GRADIENT_MODE_IN_PLACE,
                                    pb::GRADIENT_MODE_OUT_OF_PLACE,
                                    pb::GRADIENT_MODE_NONE};
  const pb::Reduction reductions[] = {pb::REDUCTION_MEAN, pb::REDUCTION_SUM,
                                      pb::REDUCTION_NONE};
  int index = 0;
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    for (pb::GradientMode mode : modes) {
      for (pb::Reduction reduction : reductions) {
        Case c;
        c.dtype = dtype;
        c.mode = mode;
        c.reduction = reduction;
        c.rows = 1 + static_cast<int64_t>(rng_() % 40);
        // Awkward vocabularies: 1, odd, GPT-2's, and a cluster-sized one.
        const int64_t vocabs[] = {1, 1003, 50257, 131072};
        c.vocab = vocabs[index % 4];
        c.label_smoothing = index % 3 == 1 ? 0.1f : 0.0f;
        c.z_loss_scale = index % 4 == 2 ? 1e-4f : 0.0f;
        c.softcap = index % 5 == 3 ? 30.0f : 0.0f;
        c.weights = index % 3 == 2;
        c.int32_targets = index % 2 == 1;
        c.inline_targets = index % 4 == 1;
        ++index;
        RunCase(c);
        if (HasFatalFailure()) return;
      }
    }
  }
}

TEST_F(GpuServiceTest, PerTokenBackwardAppliesRowFactors) {
  const int64_t rows = 17;
  const int64_t vocab = 2049;
  const std::string logits = RandomLogits(rng_, DType::kFloat32, rows * vocab);
  std::vector<int64_t> targets(rows);
  for (int64_t& t : targets) t = static_cast<int64_t>(rng_() % vocab);
  const std::string handle =
      gpu_.MustUpload(DType::kFloat32, {rows, vocab}, logits);
  pb::ForwardRequest request;
  request.set_logits(handle);
  request.set_targets_handle(
      gpu_.MustUpload(DType::kInt64, {rows}, Bytes(targets)));
  request.mutable_options()->set_reduction(pb::REDUCTION_NONE);
  pb::ForwardResponse forward;
  ASSERT_TRUE(gpu_.Forward(request, &forward).ok());
  const std::string raw = gpu_.Download(handle).bytes;

  std::vector<float> factors(rows);
  std::uniform_real_distribution<float> factor(-2.0f, 2.0f);
  for (float& f : factors) f = factor(rng_);
  pb::BackwardRequest backward;
  backward.set_gradient(handle);
  for (float f : factors) backward.mutable_per_token()->add_values(f);
  pb::BackwardResponse response;
  ASSERT_TRUE(gpu_.Backward(backward, &response).ok());
  EXPECT_FALSE(response.kernel_launched());
  // Chunks that start mid-row exercise the row-relative factor indexing.
  const Downloaded scaled =
      gpu_.Download(handle, DType::kFloat16, /*chunk_bytes=*/1000);
  ASSERT_TRUE(scaled.status.ok()) << scaled.status.error_message();
  std::string expected(static_cast<size_t>(rows * vocab) * 2, '\0');
  ASSERT_TRUE(ConvertAndScale(raw.data(), DType::kFloat32, expected.data(),
                              DType::kFloat16, 0, rows * vocab, vocab, 1.0f,
                              factors.data())
                  .ok());
  EXPECT_TRUE(scaled.bytes == expected) << "seed " << seed_;

  backward.set_materialize(true);
  ASSERT_TRUE(gpu_.Backward(backward, &response).ok());
  EXPECT_TRUE(response.kernel_launched());
  std::string in_place = raw;
  ASSERT_TRUE(ConvertAndScale(in_place.data(), DType::kFloat32, in_place.data(),
                              DType::kFloat32, 0, rows * vocab, vocab, 1.0f,
                              factors.data())
                  .ok());
  EXPECT_TRUE(gpu_.Download(handle).bytes == in_place) << "seed " << seed_;
}

TEST_F(GpuServiceTest, BadTargetChangesNothing) {
  const int64_t rows = 8;
  const int64_t vocab = 300;
  const std::string logits = RandomLogits(rng_, DType::kBFloat16, rows * vocab);
  std::vector<int64_t> targets(rows, 3);
  targets[5] = vocab;  // out of range
  const std::string handle =
      gpu_.MustUpload(DType::kBFloat16, {rows, vocab}, logits);
  pb::ForwardRequest request;
  request.set_logits(handle);
  request.set_targets_handle(
      gpu_.MustUpload(DType::kInt64, {rows}, Bytes(targets)));
  pb::ForwardResponse response;
  const grpc::Status status = gpu_.Forward(request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("row 5"));
  EXPECT_TRUE(gpu_.Download(handle).bytes == logits);
  // Still logits: a Forward with good targets now works.
  targets[5] = 0;
  request.set_targets_handle(
      gpu_.MustUpload(DType::kInt64, {rows}, Bytes(targets)));
  EXPECT_TRUE(gpu_.Forward(request, &response).ok());
}

TEST_F(GpuServiceTest, EvaluateMatchesTheCpuDevice) {
  const int64_t vocab = 32000;
  const DType dtype = DType::kBFloat16;
  std::vector<std::string> blocks;
  std::vector<std::string> block_targets;
  for (int block = 0; block < 5; ++block) {
    const int64_t rows = 1 + static_cast<int64_t>(rng_() % 50);
    blocks.push_back(RandomLogits(rng_, dtype, rows * vocab));
    std::vector<int32_t> targets(rows);
    for (int32_t& t : targets) t = static_cast<int32_t>(rng_() % vocab);
    block_targets.push_back(Bytes(targets));
  }
  pb::EvaluateResponse responses[2];
  Endpoint* endpoints[2] = {&gpu_, &cpu_};
  for (int side = 0; side < 2; ++side) {
    grpc::ClientContext context;
    auto writer = endpoints[side]->stub()->Evaluate(&context, &responses[side]);
    pb::EvaluateRequest request;
    request.mutable_header()->set_vocab(vocab);
    request.mutable_header()->set_logits_dtype(pb::DTYPE_BFLOAT16);
    request.mutable_header()->set_targets_dtype(pb::DTYPE_INT32);
    request.mutable_header()->mutable_options()->set_label_smoothing(0.05f);
    ASSERT_TRUE(writer->Write(request));
    for (size_t i = 0; i < blocks.size(); ++i) {
      request.mutable_block()->set_logits(blocks[i]);
      request.mutable_block()->set_targets(block_targets[i]);
      ASSERT_TRUE(writer->Write(request));
    }
    writer->WritesDone();
    const grpc::Status status = writer->Finish();
    ASSERT_TRUE(status.ok()) << status.error_message();
  }
  EXPECT_NEAR(responses[0].loss(), responses[1].loss(),
              2e-5 * std::abs(responses[1].loss()));
  EXPECT_EQ(responses[0].rows(), responses[1].rows());
  EXPECT_EQ(responses[0].valid_tokens(), responses[1].valid_tokens());
  EXPECT_EQ(responses[0].correct_tokens(), responses[1].correct_tokens());
  // Evaluate holds no tensor and returns its block memory.
  EXPECT_TRUE(gpu_.server()->store()->AwaitUsedBytes(0, absl::Seconds(5)));
}

// One row's NaN, +inf or -inf, or every logit of +-1e30: Evaluate's loss and
// non-finite count agree with the CPU device's on the short rows' schedules
// and the long rows' (forward only), with and without options.
TEST_F(GpuServiceTest, EvaluateCountsNonFiniteRowsAsTheCpuDeviceDoes) {
  const float specials[] = {NAN, INFINITY, -INFINITY, 1e30f};
  for (int64_t vocab : {7, 8192, 50257, 128256}) {
    for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
      for (float special : specials) {
        for (bool options : {false, true}) {
          SCOPED_TRACE(absl::StrCat("vocab ", vocab, " ", DTypeName(dtype),
                                    " special ", special, " options ",
                                    options));
          const int64_t rows = 8;
          std::normal_distribution<float> normal(0.0f, 2.0f);
          std::vector<float> values(rows * vocab);
          for (int64_t i = 0; i < rows * vocab; ++i) {
            values[i] = std::isfinite(special)
                            ? (i % 2 == 0 ? special : -special)
                            : normal(rng_);
          }
          if (!std::isfinite(special)) values[3 * vocab + vocab / 2] = special;
          std::string logits(values.size() * DTypeSize(dtype), '\0');
          ASSERT_TRUE(ConvertAndScale(values.data(), DType::kFloat32,
                                      logits.data(), dtype, 0, rows * vocab, 1,
                                      1.0f, nullptr)
                          .ok());
          std::vector<int32_t> targets(rows);
          for (int64_t r = 0; r < rows; ++r) {
            targets[r] = static_cast<int32_t>((r * 7919) % vocab);
          }
          pb::EvaluateResponse responses[2];
          Endpoint* endpoints[2] = {&gpu_, &cpu_};
          for (int side = 0; side < 2; ++side) {
            grpc::ClientContext context;
            auto writer =
                endpoints[side]->stub()->Evaluate(&context, &responses[side]);
            pb::EvaluateRequest request;
            request.mutable_header()->set_vocab(vocab);
            request.mutable_header()->set_logits_dtype(
                dtype == DType::kFloat32 ? pb::DTYPE_FLOAT32
                                         : pb::DTYPE_BFLOAT16);
            request.mutable_header()->set_targets_dtype(pb::DTYPE_INT32);
            if (options) {
              auto* o = request.mutable_header()->mutable_options();
              o->set_label_smoothing(0.1f);
              o->set_softcap(30.0f);
            }
            ASSERT_TRUE(writer->Write(request));
            request.mutable_block()->set_logits(logits);
            request.mutable_block()->set_targets(Bytes(targets));
            ASSERT_TRUE(writer->Write(request));
            writer->WritesDone();
            const grpc::Status status = writer->Finish();
            ASSERT_TRUE(status.ok()) << status.error_message();
          }
          EXPECT_EQ(responses[0].nonfinite_rows(),
                    responses[1].nonfinite_rows());
          const double gpu = responses[0].loss(), cpu = responses[1].loss();
          EXPECT_EQ(std::isnan(gpu), std::isnan(cpu)) << gpu << " vs " << cpu;
          EXPECT_EQ(std::isinf(gpu), std::isinf(cpu)) << gpu << " vs " << cpu;
          if (std::isfinite(cpu)) {
            EXPECT_NEAR(gpu, cpu, 1e-4 * std::abs(cpu) + 1e-4);
          }
        }
      }
    }
  }
}

TEST_F(GpuServiceTest, DeviceOutOfMemoryIsResourceExhaustedAndServingGoesOn) {
  // A budget far above the device: the allocation itself fails.
  Endpoint huge;
  ASSERT_TRUE(huge.Start("cuda", int64_t{1} << 50).ok());
  pb::TensorInfo info;
  grpc::Status status =
      huge.Upload(DType::kFloat32, {int64_t{1} << 20, int64_t{1} << 20},
                  std::string(), 1 << 20, &info);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << status.error_message();
  // The device still works.
  const std::string logits = RandomLogits(rng_, DType::kFloat32, 4 * 10);
  const std::string handle = huge.MustUpload(DType::kFloat32, {4, 10}, logits);
  EXPECT_EQ(huge.Download(handle).bytes, logits);
}

TEST_F(GpuServiceTest, ConcurrentRequestsEachGetTheirOwnResults) {
  constexpr int kThreads = 6;
  const int64_t rows = 64;
  const int64_t vocab = 32768;
  std::vector<std::string> logits;
  std::vector<std::string> targets;
  for (int i = 0; i < kThreads; ++i) {
    logits.push_back(RandomLogits(rng_, DType::kFloat32, rows * vocab));
    std::vector<int64_t> t(rows);
    for (int64_t& v : t) v = static_cast<int64_t>(rng_() % vocab);
    targets.push_back(Bytes(t));
  }
  // Reference: each one alone, in the same (in-place) mode as below: the
  // forward-only and the gradient kernels may sum a row in different orders.
  std::vector<double> alone(kThreads);
  for (int i = 0; i < kThreads; ++i) {
    pb::ForwardRequest request;
    request.set_logits(
        gpu_.MustUpload(DType::kFloat32, {rows, vocab}, logits[i]));
    request.mutable_targets_inline()->set_dtype(pb::DTYPE_INT64);
    request.mutable_targets_inline()->set_data(targets[i]);
    pb::ForwardResponse response;
    ASSERT_TRUE(gpu_.Forward(request, &response).ok());
    alone[i] = response.loss();
  }
  std::vector<double> together(kThreads);
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&, i] {
      for (int repeat = 0; repeat < 3; ++repeat) {
        pb::ForwardRequest request;
        request.set_logits(gpu_.MustUpload(DType::kFloat32, {rows, vocab},
                                           logits[i], 1 << 20));
        request.mutable_targets_inline()->set_dtype(pb::DTYPE_INT64);
        request.mutable_targets_inline()->set_data(targets[i]);
        pb::ForwardResponse response;
        if (gpu_.Forward(request, &response).ok()) {
          together[i] = response.loss();
        }
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  // Deterministic kernel: the same bits whatever runs beside it.
  for (int i = 0; i < kThreads; ++i) {
    EXPECT_EQ(alone[i], together[i]) << "request " << i << " seed " << seed_;
  }
}

}  // namespace
}  // namespace lossd
