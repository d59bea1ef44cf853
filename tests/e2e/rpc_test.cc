// Every lossd.v1 RPC and its documented error codes, against a real
// in-process server on 127.0.0.1:0, through the generated stub only.
#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "common/float16.h"
#include "gmock/gmock.h"
#include "grpc/health/v1/health_subset.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cross_entropy_cpu.h"
#include "lossd/v1/lossd.grpc.pb.h"
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

constexpr int64_t kBudget = 64 << 20;

struct Downloaded {
  grpc::Status status;
  pb::TensorInfo header;
  std::string bytes;
  int chunks = 0;
};

class RpcTest : public ::testing::Test {
 protected:
  void SetUp() override { StartServer(kBudget); }

  void StartServer(int64_t budget) {
    stub_.reset();
    server_.reset();
    auto server =
        LossdServer::Start(LoopbackConfig("cpu", budget, absl::Seconds(20)));
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    channel_ = LargeMessageChannel(server_->address());
    stub_ = pb::Lossd::NewStub(channel_);
  }

  // Uploads header + bytes in `chunk`-byte messages.
  grpc::Status Upload(pb::DType dtype, std::vector<int64_t> shape,
                      const std::string& bytes, pb::TensorInfo* info,
                      size_t chunk = 1000, const std::string& label = "") {
    grpc::ClientContext context;
    pb::UploadResponse response;
    auto writer = stub_->Upload(&context, &response);
    pb::UploadRequest request;
    request.mutable_header()->set_dtype(dtype);
    for (int64_t dim : shape) request.mutable_header()->add_shape(dim);
    request.mutable_header()->set_label(label);
    writer->Write(request);
    for (size_t offset = 0; offset < bytes.size(); offset += chunk) {
      request.set_chunk(bytes.substr(offset, chunk));
      if (!writer->Write(request)) break;
    }
    writer->WritesDone();
    grpc::Status status = writer->Finish();
    if (info != nullptr) *info = response.tensor();
    return status;
  }

  // Uploads fp32 logits and returns the handle (fails the test otherwise).
  std::string UploadFloats(const std::vector<float>& values, int64_t rows,
                           int64_t cols) {
    pb::TensorInfo info;
    grpc::Status status =
        Upload(pb::DTYPE_FLOAT32, {rows, cols}, Bytes(values), &info);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return info.handle();
  }

  std::string UploadTargets(const std::vector<int64_t>& targets) {
    pb::TensorInfo info;
    grpc::Status status =
        Upload(pb::DTYPE_INT64, {static_cast<int64_t>(targets.size())},
               Bytes(targets), &info);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return info.handle();
  }

  Downloaded Download(const std::string& handle,
                      pb::DType dtype = pb::DTYPE_UNSPECIFIED,
                      int64_t chunk_bytes = 0) {
    grpc::ClientContext context;
    pb::DownloadRequest request;
    request.set_handle(handle);
    request.set_dtype(dtype);
    request.set_chunk_bytes(chunk_bytes);
    auto reader = stub_->Download(&context, request);
    Downloaded out;
    pb::DownloadResponse response;
    while (reader->Read(&response)) {
      if (response.has_header()) {
        out.header = response.header();
      } else {
        out.bytes += response.chunk();
        ++out.chunks;
      }
    }
    out.status = reader->Finish();
    return out;
  }

  pb::ServerInfo Info() {
    grpc::ClientContext context;
    pb::ServerInfo info;
    EXPECT_TRUE(
        stub_->GetServerInfo(&context, pb::GetServerInfoRequest(), &info).ok());
    return info;
  }

  grpc::Status Forward(const pb::ForwardRequest& request,
                       pb::ForwardResponse* response) {
    grpc::ClientContext context;
    return stub_->Forward(&context, request, response);
  }

  grpc::Status Backward(const pb::BackwardRequest& request,
                        pb::BackwardResponse* response = nullptr) {
    grpc::ClientContext context;
    pb::BackwardResponse ignored;
    return stub_->Backward(&context, request, response ? response : &ignored);
  }

  grpc::Status Describe(const std::string& handle, pb::TensorInfo* info) {
    grpc::ClientContext context;
    pb::DescribeRequest request;
    request.set_handle(handle);
    return stub_->Describe(&context, request, info);
  }

  // Expects the store to hold nothing at all (after an error or a cancel).
  void ExpectEmpty() {
    ASSERT_TRUE(server_->store()->AwaitUsedBytes(0, absl::Seconds(10)));
    grpc::ClientContext context;
    pb::ListResponse list;
    ASSERT_TRUE(stub_->List(&context, pb::ListRequest(), &list).ok());
    EXPECT_EQ(list.tensors_size(), 0);
    EXPECT_EQ(list.server().used_bytes(), 0);
    EXPECT_EQ(list.server().tensors(), 0);
  }

  std::unique_ptr<LossdServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<pb::Lossd::Stub> stub_;
};

// Random logits / targets with the seed printed by the caller's trace.
struct Problem {
  int64_t rows;
  int64_t vocab;
  std::vector<float> logits;
  std::vector<int64_t> targets;
};

Problem RandomProblem(unsigned seed, int64_t rows, int64_t vocab) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 3.0f);
  Problem problem{rows, vocab, std::vector<float>(rows * vocab),
                  std::vector<int64_t>(rows)};
  for (float& x : problem.logits) x = dist(rng);
  for (int64_t& y : problem.targets) y = rng() % vocab;
  problem.targets[0] = -100;  // one ignored row
  return problem;
}

// The CPU backend on local copies: what the server must reproduce exactly.
CrossEntropyResult Expected(const Problem& problem,
                            const CrossEntropyOptions& options,
                            std::vector<float>* gradient,
                            const std::vector<float>* weights = nullptr) {
  *gradient = problem.logits;
  CrossEntropyArgs args;
  args.rows = problem.rows;
  args.vocab = problem.vocab;
  args.row_stride = problem.vocab;
  args.logits = gradient->data();
  args.targets = problem.targets.data();
  args.class_weights = weights ? weights->data() : nullptr;
  args.options = options;
  args.mode = GradientMode::kInPlace;
  args.gradient = gradient->data();
  CrossEntropyResult result;
  EXPECT_TRUE(CrossEntropyCpu(args, &result, 1).ok());
  return result;
}

// ---------------------------------------------------------------- tensors

TEST_F(RpcTest, UploadDownloadRoundTripIsBitExact) {
  const unsigned seed = std::random_device{}();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  Problem problem = RandomProblem(seed, 37, 101);
  pb::TensorInfo info;
  ASSERT_TRUE(Upload(pb::DTYPE_FLOAT32, {37, 101}, Bytes(problem.logits), &info,
                     999, "my logits")
                  .ok());
  EXPECT_EQ(info.dtype(), pb::DTYPE_FLOAT32);
  EXPECT_EQ(info.bytes(), 37 * 101 * 4);
  EXPECT_EQ(info.state(), pb::TENSOR_STATE_LOGITS);
  EXPECT_EQ(info.device(), "cpu");
  EXPECT_EQ(info.tenant(), "default");
  EXPECT_EQ(info.label(), "my logits");
  EXPECT_EQ(info.handle().substr(0, 8), Info().instance_id());

  // Default chunks, and 1 KB chunks that do not divide the size.
  for (int64_t chunk : {0, 1024}) {
    Downloaded got = Download(info.handle(), pb::DTYPE_UNSPECIFIED, chunk);
    ASSERT_TRUE(got.status.ok()) << got.status.error_message();
    EXPECT_EQ(got.bytes, Bytes(problem.logits));
    EXPECT_EQ(got.header.bytes(), info.bytes());
    if (chunk == 1024) {
      EXPECT_EQ(got.chunks, (37 * 101 * 4 + 1023) / 1024);
    }
  }
  // int64 targets round trip too.
  const std::string targets = UploadTargets(problem.targets);
  EXPECT_EQ(FromBytes<int64_t>(Download(targets).bytes), problem.targets);
}

TEST_F(RpcTest, DownloadConvertsToBf16AndHalf) {
  const std::vector<float> values = {1.0f,  -2.5f,    3.14159f,
                                     1e-3f, 65504.0f, 0.0f};
  const std::string handle = UploadFloats(values, 2, 3);
  Downloaded bf16 = Download(handle, pb::DTYPE_BFLOAT16);
  ASSERT_TRUE(bf16.status.ok()) << bf16.status.error_message();
  EXPECT_EQ(bf16.header.dtype(), pb::DTYPE_BFLOAT16);
  EXPECT_EQ(bf16.header.bytes(), 12);
  std::vector<uint16_t> got = FromBytes<uint16_t>(bf16.bytes);
  ASSERT_EQ(got.size(), values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    EXPECT_EQ(got[i], FloatToBF16(values[i])) << i;
  }
  Downloaded half = Download(handle, pb::DTYPE_FLOAT16, 4);
  ASSERT_TRUE(half.status.ok());
  got = FromBytes<uint16_t>(half.bytes);
  for (size_t i = 0; i < values.size(); ++i) {
    EXPECT_EQ(got[i], FloatToHalf(values[i])) << i;
  }
}

TEST_F(RpcTest, DownloadErrors) {
  const std::string logits = UploadFloats({1, 2}, 1, 2);
  const std::string targets = UploadTargets({1, 0});
  EXPECT_EQ(Download(logits, pb::DTYPE_INT32).status.error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Download(targets, pb::DTYPE_FLOAT32).status.error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Download(targets, pb::DTYPE_INT32).status.error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Download(logits, static_cast<pb::DType>(42)).status.error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Download(logits, pb::DTYPE_FLOAT32, -1).status.error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Download(logits, pb::DTYPE_FLOAT32, 2).status.error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);  // < one element
  EXPECT_EQ(
      Download(logits, pb::DTYPE_FLOAT32, int64_t{1} << 40).status.error_code(),
      grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Download("nope").status.error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);  // not a handle's shape
}

TEST_F(RpcTest, UploadErrorsLeaveNothingBehind) {
  struct Case {
    const char* name;
    std::vector<pb::UploadRequest> messages;
    grpc::StatusCode code;
  };
  auto header = [](pb::DType dtype, std::vector<int64_t> shape) {
    pb::UploadRequest request;
    request.mutable_header()->set_dtype(dtype);
    for (int64_t dim : shape) request.mutable_header()->add_shape(dim);
    return request;
  };
  auto chunk = [](size_t bytes) {
    pb::UploadRequest request;
    request.set_chunk(std::string(bytes, '\1'));
    return request;
  };
  const std::vector<Case> cases = {
      {"no header", {}, grpc::StatusCode::INVALID_ARGUMENT},
      {"data first", {chunk(8)}, grpc::StatusCode::INVALID_ARGUMENT},
      {"no dtype",
       {header(pb::DTYPE_UNSPECIFIED, {2})},
       grpc::StatusCode::INVALID_ARGUMENT},
      {"unknown dtype",
       {header(static_cast<pb::DType>(9), {2})},
       grpc::StatusCode::INVALID_ARGUMENT},
      {"no dims",
       {header(pb::DTYPE_FLOAT32, {})},
       grpc::StatusCode::INVALID_ARGUMENT},
      {"3 dims",
       {header(pb::DTYPE_FLOAT32, {1, 1, 1})},
       grpc::StatusCode::INVALID_ARGUMENT},
      {"zero dim",
       {header(pb::DTYPE_FLOAT32, {0, 4})},
       grpc::StatusCode::INVALID_ARGUMENT},
      {"overflow",
       {header(pb::DTYPE_FLOAT32, {int64_t{1} << 40, int64_t{1} << 40})},
       grpc::StatusCode::INVALID_ARGUMENT},
      {"second header",
       {header(pb::DTYPE_FLOAT32, {2}), header(pb::DTYPE_FLOAT32, {2})},
       grpc::StatusCode::INVALID_ARGUMENT},
      {"too many bytes",
       {header(pb::DTYPE_FLOAT32, {2}), chunk(4), chunk(8)},
       grpc::StatusCode::INVALID_ARGUMENT},
      {"too few bytes",
       {header(pb::DTYPE_FLOAT32, {2}), chunk(7)},
       grpc::StatusCode::INVALID_ARGUMENT},
      {"over budget",
       {header(pb::DTYPE_FLOAT32, {kBudget / 4 + 1})},
       grpc::StatusCode::RESOURCE_EXHAUSTED},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    grpc::ClientContext context;
    pb::UploadResponse response;
    auto writer = stub_->Upload(&context, &response);
    for (const auto& message : c.messages) {
      if (!writer->Write(message)) break;
    }
    writer->WritesDone();
    const grpc::Status status = writer->Finish();
    EXPECT_EQ(status.error_code(), c.code) << status.error_message();
    if (c.code == grpc::StatusCode::RESOURCE_EXHAUSTED) {
      EXPECT_THAT(status.error_message(),
                  HasSubstr(std::to_string(kBudget + 4)));  // requested
      EXPECT_THAT(status.error_message(), HasSubstr(std::to_string(kBudget)));
    }
    ExpectEmpty();
  }
}

TEST_F(RpcTest, CancelledUploadLeavesNoTensorAndNoReservedBytes) {
  constexpr int64_t kElements = 1 << 20;  // 4 MiB reserved at the header
  grpc::ClientContext context;
  pb::UploadResponse response;
  auto writer = stub_->Upload(&context, &response);
  pb::UploadRequest request;
  request.mutable_header()->set_dtype(pb::DTYPE_FLOAT32);
  request.mutable_header()->add_shape(kElements);
  ASSERT_TRUE(writer->Write(request));
  request.set_chunk(std::string(kElements * 2, '\0'));  // half of it
  ASSERT_TRUE(writer->Write(request));
  // The full size is reserved once the header is read.
  ASSERT_TRUE(
      server_->store()->AwaitUsedBytes(kElements * 4, absl::Seconds(10)));
  EXPECT_EQ(Info().used_bytes(), kElements * 4);
  context.TryCancel();
  EXPECT_EQ(writer->Finish().error_code(), grpc::StatusCode::CANCELLED);
  ExpectEmpty();
}

TEST_F(RpcTest, DescribeListReleaseAndNotFound) {
  const std::string handle = UploadFloats({1, 2, 3, 4}, 2, 2);
  pb::TensorInfo info;
  ASSERT_TRUE(Describe(handle, &info).ok());
  EXPECT_EQ(info.handle(), handle);
  EXPECT_EQ(info.shape_size(), 2);
  EXPECT_EQ(info.pending_scale(), 1.0);
  EXPECT_GT(info.created().seconds(), 0);

  {
    grpc::ClientContext context;
    pb::ListResponse list;
    ASSERT_TRUE(stub_->List(&context, pb::ListRequest(), &list).ok());
    ASSERT_EQ(list.tensors_size(), 1);
    EXPECT_EQ(list.tensors(0).handle(), handle);
    EXPECT_EQ(list.server().used_bytes(), 16);
    EXPECT_EQ(list.server().tensors(), 1);
  }
  const std::string foreign =
      std::string(handle.substr(0, 8) == "00000000" ? "11111111" : "00000000") +
      handle.substr(8);
  grpc::Status status = Describe(foreign, &info);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(status.error_message(), HasSubstr("belongs to instance"));
  EXPECT_EQ(Describe("", &info).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Describe(handle + "0", &info).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);

  pb::ReleaseRequest release;
  release.set_handle(handle);
  pb::ReleaseResponse released;
  {
    grpc::ClientContext context;
    ASSERT_TRUE(stub_->Release(&context, release, &released).ok());
    EXPECT_EQ(released.released_bytes(), 16);
  }
  {
    grpc::ClientContext context;
    status = stub_->Release(&context, release, &released);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
    EXPECT_THAT(status.error_message(), HasSubstr("released"));
  }
  status = Describe(handle, &info);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(status.error_message(), HasSubstr("released"));
  ExpectEmpty();
}

TEST_F(RpcTest, ReleaseDuringADownloadIsSafe) {
  const unsigned seed = std::random_device{}();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  Problem problem = RandomProblem(seed, 512, 512);  // 1 MiB
  const std::string handle = UploadFloats(problem.logits, 512, 512);

  grpc::ClientContext context;
  pb::DownloadRequest request;
  request.set_handle(handle);
  request.set_chunk_bytes(4096);
  auto reader = stub_->Download(&context, request);
  pb::DownloadResponse response;
  ASSERT_TRUE(reader->Read(&response));
  ASSERT_TRUE(response.has_header());
  ASSERT_TRUE(reader->Read(&response));
  std::string bytes = response.chunk();

  grpc::ClientContext release_context;
  pb::ReleaseRequest release;
  release.set_handle(handle);
  pb::ReleaseResponse released;
  ASSERT_TRUE(stub_->Release(&release_context, release, &released).ok());

  while (reader->Read(&response)) bytes += response.chunk();
  ASSERT_TRUE(reader->Finish().ok());
  EXPECT_EQ(bytes, Bytes(problem.logits));
  ExpectEmpty();
}

// ---------------------------------------------------------------- loss

TEST_F(RpcTest, ForwardInPlaceMatchesTheCpuBackendAndConsumesTheLogits) {
  const unsigned seed = std::random_device{}();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  Problem problem = RandomProblem(seed, 33, 257);
  const std::string logits = UploadFloats(problem.logits, 33, 257);
  const std::string targets = UploadTargets(problem.targets);

  pb::ForwardRequest request;
  request.set_logits(logits);
  request.set_targets_handle(targets);
  request.mutable_options()->set_label_smoothing(0.1f);
  request.mutable_options()->set_z_loss_scale(1e-4f);
  request.mutable_outputs()->set_token_loss(true);
  request.mutable_outputs()->set_token_lse(true);
  request.mutable_outputs()->set_token_argmax(true);
  pb::ForwardResponse response;
  grpc::Status status = Forward(request, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();

  CrossEntropyOptions options;
  options.label_smoothing = 0.1f;
  options.z_loss_scale = 1e-4f;
  std::vector<float> gradient;
  const CrossEntropyResult expected = Expected(problem, options, &gradient);
  EXPECT_EQ(response.loss(), expected.loss);
  EXPECT_EQ(response.z_loss(), expected.z_loss);
  EXPECT_EQ(response.valid_tokens(), 32);
  EXPECT_EQ(response.correct_tokens(), expected.correct_tokens);
  EXPECT_EQ(response.denominator(), expected.denominator);
  EXPECT_EQ(response.gradient(), logits);
  EXPECT_EQ(response.token_loss_size(), 33);
  EXPECT_EQ(response.token_lse_size(), 33);
  EXPECT_EQ(response.token_argmax_size(), 33);
  EXPECT_EQ(response.token_loss(0), 0.0f);  // the ignored row

  pb::TensorInfo info;
  ASSERT_TRUE(Describe(logits, &info).ok());
  EXPECT_EQ(info.state(), pb::TENSOR_STATE_GRADIENT);
  EXPECT_EQ(Download(logits).bytes, Bytes(gradient));

  // The logits are gone: a second Forward says why, and changes nothing.
  status = Forward(request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(status.error_message(), HasSubstr("holds a gradient"));
  EXPECT_EQ(Download(logits).bytes, Bytes(gradient));
}

TEST_F(RpcTest, ForwardOutOfPlaceAndNoGradientKeepTheLogits) {
  const unsigned seed = std::random_device{}();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  Problem problem = RandomProblem(seed, 16, 50);
  const std::string logits = UploadFloats(problem.logits, 16, 50);
  std::vector<float> weights(50);
  for (int i = 0; i < 50; ++i) weights[i] = 0.5f + 0.01f * i;
  pb::TensorInfo weights_info;
  ASSERT_TRUE(
      Upload(pb::DTYPE_FLOAT32, {50}, Bytes(weights), &weights_info).ok());

  CrossEntropyOptions options;
  options.reduction = Reduction::kSum;
  options.grad_scale = 0.5f;
  std::vector<float> gradient;
  const CrossEntropyResult expected =
      Expected(problem, options, &gradient, &weights);

  pb::ForwardRequest request;
  request.set_logits(logits);
  request.mutable_targets_inline()->set_dtype(pb::DTYPE_INT64);
  request.mutable_targets_inline()->set_data(Bytes(problem.targets));
  request.mutable_options()->set_reduction(pb::REDUCTION_SUM);
  request.mutable_options()->set_grad_scale(0.5f);
  request.mutable_options()->set_class_weights(weights_info.handle());
  request.set_mode(pb::GRADIENT_MODE_OUT_OF_PLACE);
  request.set_gradient_label("grad");
  pb::ForwardResponse response;
  grpc::Status status = Forward(request, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(response.loss(), expected.loss);
  ASSERT_FALSE(response.gradient().empty());
  EXPECT_NE(response.gradient(), logits);
  EXPECT_EQ(Download(response.gradient()).bytes, Bytes(gradient));
  EXPECT_EQ(Download(logits).bytes, Bytes(problem.logits));
  pb::TensorInfo info;
  ASSERT_TRUE(Describe(response.gradient(), &info).ok());
  EXPECT_EQ(info.state(), pb::TENSOR_STATE_GRADIENT);
  EXPECT_EQ(info.label(), "grad");

  // NO_GRADIENT with int32 inline targets: the same loss, nothing written.
  std::vector<int32_t> targets32(problem.targets.begin(),
                                 problem.targets.end());
  request.mutable_targets_inline()->set_dtype(pb::DTYPE_INT32);
  request.mutable_targets_inline()->set_data(Bytes(targets32));
  request.set_mode(pb::GRADIENT_MODE_NONE);
  ASSERT_TRUE(Forward(request, &response).ok());
  EXPECT_EQ(response.loss(), expected.loss);
  EXPECT_TRUE(response.gradient().empty());
  EXPECT_EQ(Download(logits).bytes, Bytes(problem.logits));
  EXPECT_EQ(Info().tensors(), 3);
}

TEST_F(RpcTest, ForwardValidatesEverythingAndChangesNothing) {
  Problem problem = RandomProblem(7, 4, 5);
  const std::string logits = UploadFloats(problem.logits, 4, 5);
  const std::string targets = UploadTargets(problem.targets);
  const std::string short_targets = UploadTargets({1, 2});
  const std::string weights_bad = UploadFloats({1, 1, 1, 1}, 1, 4);

  auto base = [&] {
    pb::ForwardRequest request;
    request.set_logits(logits);
    request.set_targets_handle(targets);
    return request;
  };
  struct Case {
    const char* name;
    pb::ForwardRequest request;
    grpc::StatusCode code;
  };
  std::vector<Case> cases;
  auto add = [&](const char* name, grpc::StatusCode code, auto mutate) {
    pb::ForwardRequest request = base();
    mutate(&request);
    cases.push_back({name, request, code});
  };
  using C = grpc::StatusCode;
  add("label_smoothing > 1", C::INVALID_ARGUMENT,
      [](auto* r) { r->mutable_options()->set_label_smoothing(1.5f); });
  add("label_smoothing nan", C::INVALID_ARGUMENT, [](auto* r) {
    r->mutable_options()->set_label_smoothing(std::nanf(""));
  });
  add("softcap < 0", C::INVALID_ARGUMENT,
      [](auto* r) { r->mutable_options()->set_softcap(-1.0f); });
  add("z_loss < 0", C::INVALID_ARGUMENT,
      [](auto* r) { r->mutable_options()->set_z_loss_scale(-1.0f); });
  add("normalizer < 0", C::INVALID_ARGUMENT,
      [](auto* r) { r->mutable_options()->set_normalizer(-2.0); });
  add("grad_scale inf", C::INVALID_ARGUMENT,
      [](auto* r) { r->mutable_options()->set_grad_scale(INFINITY); });
  add("unknown reduction", C::INVALID_ARGUMENT, [](auto* r) {
    r->mutable_options()->set_reduction(static_cast<pb::Reduction>(7));
  });
  add("unknown mode", C::INVALID_ARGUMENT,
      [](auto* r) { r->set_mode(static_cast<pb::GradientMode>(9)); });
  add("no targets", C::INVALID_ARGUMENT,
      [](auto* r) { r->clear_targets_handle(); });
  add("short targets", C::INVALID_ARGUMENT,
      [&](auto* r) { r->set_targets_handle(short_targets); });
  add("targets are floats", C::INVALID_ARGUMENT,
      [&](auto* r) { r->set_targets_handle(weights_bad); });
  add("inline float targets", C::INVALID_ARGUMENT, [](auto* r) {
    r->mutable_targets_inline()->set_dtype(pb::DTYPE_FLOAT32);
    r->mutable_targets_inline()->set_data(std::string(16, '\0'));
  });
  add("inline wrong length", C::INVALID_ARGUMENT, [](auto* r) {
    r->mutable_targets_inline()->set_dtype(pb::DTYPE_INT64);
    r->mutable_targets_inline()->set_data(std::string(24, '\0'));
  });
  add("target out of range", C::INVALID_ARGUMENT, [](auto* r) {
    std::vector<int64_t> bad = {0, 1, 5, 2};
    r->mutable_targets_inline()->set_dtype(pb::DTYPE_INT64);
    r->mutable_targets_inline()->set_data(Bytes(bad));
  });
  add("logits are targets", C::INVALID_ARGUMENT,
      [&](auto* r) { r->set_logits(targets); });
  add("weights wrong shape", C::INVALID_ARGUMENT,
      [&](auto* r) { r->mutable_options()->set_class_weights(weights_bad); });
  add("weights unknown", C::NOT_FOUND, [&](auto* r) {
    r->mutable_options()->set_class_weights(logits.substr(0, 9) +
                                            std::string(32, 'a'));
  });
  add("targets malformed", C::INVALID_ARGUMENT,
      [&](auto* r) { r->set_targets_handle("x"); });
  add("logits empty", C::INVALID_ARGUMENT, [&](auto* r) { r->set_logits(""); });

  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    pb::ForwardResponse response;
    EXPECT_EQ(Forward(c.request, &response).error_code(), c.code);
    pb::TensorInfo info;
    ASSERT_TRUE(Describe(logits, &info).ok());
    EXPECT_EQ(info.state(), pb::TENSOR_STATE_LOGITS);
    EXPECT_EQ(Download(logits).bytes, Bytes(problem.logits));
  }
}

TEST_F(RpcTest, OutOfPlaceGradientNeedsRoom) {
  StartServer(3000);
  Problem problem = RandomProblem(3, 10, 50);  // 2000 bytes
  const std::string logits = UploadFloats(problem.logits, 10, 50);
  pb::ForwardRequest request;
  request.set_logits(logits);
  request.mutable_targets_inline()->set_dtype(pb::DTYPE_INT64);
  request.mutable_targets_inline()->set_data(Bytes(problem.targets));
  request.set_mode(pb::GRADIENT_MODE_OUT_OF_PLACE);
  pb::ForwardResponse response;
  EXPECT_EQ(Forward(request, &response).error_code(),
            grpc::StatusCode::RESOURCE_EXHAUSTED);
  pb::TensorInfo info;
  ASSERT_TRUE(Describe(logits, &info).ok());
  EXPECT_EQ(info.state(), pb::TENSOR_STATE_LOGITS);
  EXPECT_EQ(Info().used_bytes(), 2000);
}

TEST_F(RpcTest, BackwardRecordsTheFactorAndDownloadAppliesIt) {
  const unsigned seed = std::random_device{}();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  Problem problem = RandomProblem(seed, 8, 30);
  const std::string logits = UploadFloats(problem.logits, 8, 30);

  pb::BackwardRequest backward;
  backward.set_gradient(logits);
  backward.set_scalar(2.0);
  grpc::Status status = Backward(backward);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(status.error_message(), HasSubstr("holds logits"));

  pb::ForwardRequest request;
  request.set_logits(logits);
  request.mutable_targets_inline()->set_dtype(pb::DTYPE_INT64);
  request.mutable_targets_inline()->set_data(Bytes(problem.targets));
  pb::ForwardResponse response;
  ASSERT_TRUE(Forward(request, &response).ok());
  std::vector<float> gradient;
  Expected(problem, CrossEntropyOptions(), &gradient);

  // Twice with 2: the factor is 2, not 4.
  pb::BackwardResponse backward_response;
  ASSERT_TRUE(Backward(backward, &backward_response).ok());
  ASSERT_TRUE(Backward(backward, &backward_response).ok());
  EXPECT_FALSE(backward_response.kernel_launched());
  EXPECT_EQ(backward_response.tensor().pending_scale(), 2.0);
  Downloaded got = Download(logits);
  EXPECT_EQ(got.header.pending_scale(), 2.0);
  std::vector<float> scaled = FromBytes<float>(got.bytes);
  ASSERT_EQ(scaled.size(), gradient.size());
  for (size_t i = 0; i < gradient.size(); ++i) {
    ASSERT_EQ(scaled[i], gradient[i] * 2.0f) << i;
  }
  // Converted on the way out as well.
  std::vector<uint16_t> bf16 =
      FromBytes<uint16_t>(Download(logits, pb::DTYPE_BFLOAT16).bytes);
  for (size_t i = 0; i < gradient.size(); ++i) {
    ASSERT_EQ(bf16[i], FloatToBF16(gradient[i] * 2.0f)) << i;
  }

  // Errors: no factor, non-finite, per-token for a mean gradient, unknown.
  pb::BackwardRequest bad = backward;
  bad.clear_scalar();
  EXPECT_EQ(Backward(bad).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  bad.set_scalar(NAN);
  EXPECT_EQ(Backward(bad).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  bad.mutable_per_token()->add_values(1.0f);
  EXPECT_EQ(Backward(bad).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  bad.set_gradient("unknown");
  bad.set_scalar(1.0);
  EXPECT_EQ(Backward(bad).error_code(), grpc::StatusCode::INVALID_ARGUMENT);

  // Materialize: applied in place; the download then applies nothing more.
  backward.set_scalar(-3.0);
  backward.set_materialize(true);
  ASSERT_TRUE(Backward(backward, &backward_response).ok());
  EXPECT_TRUE(backward_response.kernel_launched());
  EXPECT_EQ(backward_response.tensor().pending_scale(), 1.0);
  scaled = FromBytes<float>(Download(logits).bytes);
  for (size_t i = 0; i < gradient.size(); ++i) {
    ASSERT_EQ(scaled[i], gradient[i] * -3.0f) << i;
  }
}

TEST_F(RpcTest, PerTokenBackwardForReductionNone) {
  Problem problem = RandomProblem(11, 4, 6);
  const std::string logits = UploadFloats(problem.logits, 4, 6);
  pb::ForwardRequest request;
  request.set_logits(logits);
  request.mutable_targets_inline()->set_dtype(pb::DTYPE_INT64);
  request.mutable_targets_inline()->set_data(Bytes(problem.targets));
  request.mutable_options()->set_reduction(pb::REDUCTION_NONE);
  pb::ForwardResponse response;
  ASSERT_TRUE(Forward(request, &response).ok());
  CrossEntropyOptions options;
  options.reduction = Reduction::kNone;
  std::vector<float> gradient;
  Expected(problem, options, &gradient);

  pb::BackwardRequest backward;
  backward.set_gradient(logits);
  for (float g : {1.0f, 2.0f, 3.0f})
    backward.mutable_per_token()->add_values(g);
  EXPECT_EQ(Backward(backward).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);  // 3 values, 4 rows
  backward.mutable_per_token()->add_values(-1.0f);
  pb::BackwardResponse backward_response;
  ASSERT_TRUE(Backward(backward, &backward_response).ok());
  EXPECT_TRUE(backward_response.tensor().pending_token_scale());
  const std::vector<float> scaled = FromBytes<float>(Download(logits).bytes);
  const float factors[4] = {1, 2, 3, -1};
  for (size_t i = 0; i < gradient.size(); ++i) {
    ASSERT_EQ(scaled[i], gradient[i] * factors[i / 6]) << i;
  }
}

TEST_F(RpcTest, EvaluateEqualsForwardWithoutGradient) {
  const unsigned seed = std::random_device{}();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  Problem problem = RandomProblem(seed, 100, 64);
  std::vector<float> weights(64);
  for (int i = 0; i < 64; ++i) weights[i] = 0.25f + 0.05f * (i % 7);
  pb::TensorInfo weights_info;
  ASSERT_TRUE(
      Upload(pb::DTYPE_FLOAT32, {64}, Bytes(weights), &weights_info).ok());
  CrossEntropyOptions options;
  options.label_smoothing = 0.05f;
  std::vector<float> gradient;
  const CrossEntropyResult expected =
      Expected(problem, options, &gradient, &weights);

  grpc::ClientContext context;
  pb::EvaluateResponse response;
  auto writer = stub_->Evaluate(&context, &response);
  pb::EvaluateRequest request;
  pb::EvaluateHeader* header = request.mutable_header();
  header->set_vocab(64);
  header->set_logits_dtype(pb::DTYPE_FLOAT32);
  header->set_targets_dtype(pb::DTYPE_INT64);
  header->mutable_options()->set_label_smoothing(0.05f);
  header->mutable_options()->set_class_weights(weights_info.handle());
  ASSERT_TRUE(writer->Write(request));
  for (int64_t first = 0; first < 100; first += 23) {
    const int64_t rows = std::min<int64_t>(23, 100 - first);
    pb::EvaluateRequest block;
    block.mutable_block()->set_logits(std::string(
        reinterpret_cast<const char*>(problem.logits.data() + first * 64),
        rows * 64 * 4));
    block.mutable_block()->set_targets(std::string(
        reinterpret_cast<const char*>(problem.targets.data() + first),
        rows * 8));
    ASSERT_TRUE(writer->Write(block));
  }
  writer->WritesDone();
  const grpc::Status status = writer->Finish();
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_NEAR(response.loss(), expected.loss, 1e-12 * std::abs(expected.loss));
  EXPECT_NEAR(response.denominator(), expected.denominator, 1e-9);
  EXPECT_EQ(response.rows(), 100);
  EXPECT_EQ(response.valid_tokens(), expected.valid_tokens);
  EXPECT_EQ(response.correct_tokens(), expected.correct_tokens);
  // Server-side time: every block ran the kernel; copies take no less than 0.
  EXPECT_GT(response.kernel_seconds(), 0.0);
  EXPECT_GE(response.copy_seconds(), 0.0);
  EXPECT_LT(response.copy_seconds() + response.kernel_seconds(), 60.0);
  EXPECT_EQ(Info().tensors(), 1);  // nothing retained
  EXPECT_EQ(Info().used_bytes(), 64 * 4);
}

TEST_F(RpcTest, EvaluateErrors) {
  auto header = [](pb::Reduction reduction) {
    pb::EvaluateRequest request;
    request.mutable_header()->set_vocab(4);
    request.mutable_header()->set_logits_dtype(pb::DTYPE_FLOAT32);
    request.mutable_header()->set_targets_dtype(pb::DTYPE_INT32);
    request.mutable_header()->mutable_options()->set_reduction(reduction);
    return request;
  };
  auto block = [](size_t logits_bytes, size_t target_bytes) {
    pb::EvaluateRequest request;
    request.mutable_block()->set_logits(std::string(logits_bytes, '\0'));
    request.mutable_block()->set_targets(std::string(target_bytes, '\0'));
    return request;
  };
  pb::EvaluateRequest bad_vocab = header(pb::REDUCTION_MEAN);
  bad_vocab.mutable_header()->set_vocab(0);
  pb::EvaluateRequest float_targets = header(pb::REDUCTION_MEAN);
  float_targets.mutable_header()->set_targets_dtype(pb::DTYPE_FLOAT32);
  const std::vector<std::pair<const char*, std::vector<pb::EvaluateRequest>>>
      cases = {
          {"no header", {}},
          {"data first", {block(16, 4)}},
          {"second header",
           {header(pb::REDUCTION_MEAN), header(pb::REDUCTION_MEAN)}},
          {"reduction none", {header(pb::REDUCTION_NONE)}},
          {"vocab 0", {bad_vocab}},
          {"float targets", {float_targets}},
          {"partial row", {header(pb::REDUCTION_MEAN), block(20, 4)}},
          {"target count", {header(pb::REDUCTION_MEAN), block(32, 4)}},
          {"no rows", {header(pb::REDUCTION_SUM)}},
      };
  for (const auto& [name, messages] : cases) {
    SCOPED_TRACE(name);
    grpc::ClientContext context;
    pb::EvaluateResponse response;
    auto writer = stub_->Evaluate(&context, &response);
    for (const auto& message : messages) {
      if (!writer->Write(message)) break;
    }
    writer->WritesDone();
    EXPECT_EQ(writer->Finish().error_code(),
              grpc::StatusCode::INVALID_ARGUMENT);
  }
}

// ---------------------------------------------------------------- server

TEST_F(RpcTest, GetServerInfoReportsTheInstance) {
  const pb::ServerInfo info = Info();
  EXPECT_EQ(info.instance_id().size(), 8u);
  EXPECT_EQ(info.device(), "cpu");
  EXPECT_EQ(info.budget_bytes(), kBudget);
  EXPECT_EQ(info.used_bytes(), 0);
  EXPECT_EQ(info.free_bytes(), kBudget);
  EXPECT_EQ(info.tensors(), 0);
  EXPECT_FALSE(info.version().empty());
}

TEST_F(RpcTest, HealthCheckingReportsLivenessAndReadiness) {
  auto health = grpc::health::v1::Health::NewStub(channel_);
  for (const char* service : {"", "lossd.v1.Lossd"}) {
    grpc::ClientContext context;
    grpc::health::v1::HealthCheckRequest request;
    request.set_service(service);
    grpc::health::v1::HealthCheckResponse response;
    ASSERT_TRUE(health->Check(&context, request, &response).ok()) << service;
    EXPECT_EQ(response.status(),
              grpc::health::v1::HealthCheckResponse::SERVING);
  }
}

TEST_F(RpcTest, DrainRefusesNewRpcsAndFinishesRunningOnes) {
  // An upload in flight across the drain.
  grpc::ClientContext upload_context;
  pb::UploadResponse upload_response;
  auto writer = stub_->Upload(&upload_context, &upload_response);
  pb::UploadRequest request;
  request.mutable_header()->set_dtype(pb::DTYPE_FLOAT32);
  request.mutable_header()->add_shape(4);
  ASSERT_TRUE(writer->Write(request));
  ASSERT_TRUE(server_->store()->AwaitUsedBytes(16, absl::Seconds(10)));

  // Readiness is watched: NOT_SERVING means new RPCs are already refused.
  auto health = grpc::health::v1::Health::NewStub(channel_);
  grpc::ClientContext watch_context;
  grpc::health::v1::HealthCheckRequest watch_request;
  watch_request.set_service(kReadinessService);
  auto watch = health->Watch(&watch_context, watch_request);
  grpc::health::v1::HealthCheckResponse status;
  ASSERT_TRUE(watch->Read(&status));
  EXPECT_EQ(status.status(), grpc::health::v1::HealthCheckResponse::SERVING);

  bool drained_cleanly = false;
  std::thread drain([&] { drained_cleanly = server_->Drain(); });
  ASSERT_TRUE(watch->Read(&status));
  EXPECT_EQ(status.status(),
            grpc::health::v1::HealthCheckResponse::NOT_SERVING);

  grpc::ClientContext info_context;
  pb::ServerInfo info;
  EXPECT_EQ(
      stub_->GetServerInfo(&info_context, pb::GetServerInfoRequest(), &info)
          .error_code(),
      grpc::StatusCode::UNAVAILABLE);

  request.set_chunk(std::string(16, '\0'));
  ASSERT_TRUE(writer->Write(request));
  writer->WritesDone();
  const grpc::Status upload_status = writer->Finish();
  EXPECT_TRUE(upload_status.ok()) << upload_status.error_message();
  EXPECT_EQ(upload_response.tensor().bytes(), 16);
  watch_context.TryCancel();
  drain.join();
  EXPECT_TRUE(drained_cleanly);
}

}  // namespace
}  // namespace lossd
