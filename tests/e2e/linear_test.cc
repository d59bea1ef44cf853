// LinearForward over loopback through lossd::Client on the CPU device: loss,
// dX, dW and dbias against a float64 reference computed here; the dX modes;
// micro-batch accumulation; overwrite uploads; and bad requests, each with its
// code and nothing changed.
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "client/data_connection.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "lossd/v1/lossd.grpc.pb.h"
#include "server/server.h"
#include "tests/e2e/linear_reference.h"
#include "tests/e2e/test_server.h"

namespace lossd {
namespace {

constexpr int64_t kBudget = 64 << 20;
using linear_reference::Compute;
using linear_reference::ExpectNear;
using linear_reference::kIgnore;
using linear_reference::MakeProblem;
using linear_reference::Problem;
using linear_reference::Reference;

class LinearTest : public ::testing::Test {
 protected:
  void SetUp() override { Start(""); }

  // (Re)starts the server; with `tokens` ("token tenant" lines) it
  // authenticates callers.
  void Start(const std::string& tokens) {
    client_.reset();
    server_.reset();
    ServerConfig config =
        e2e_test::LoopbackConfig("cpu", kBudget, absl::Seconds(10));
    config.data_port = 0;  // a free port: overwrites over data connections
    if (!tokens.empty()) {
      const std::string path = absl::StrCat(
          ::testing::TempDir(), "linear-tokens-",
          ::testing::UnitTest::GetInstance()->current_test_info()->name());
      std::ofstream(path) << tokens;
      config.auth.tokens_file = path;
    }
    absl::StatusOr<std::unique_ptr<LossdServer>> server =
        LossdServer::Start(config);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    client_ = Connect("");
  }

  std::unique_ptr<Client> Connect(const std::string& token) {
    ClientOptions options;
    options.bearer_token = token;
    absl::StatusOr<std::unique_ptr<Client>> client =
        Client::Connect(server_->address(), options);
    EXPECT_TRUE(client.ok()) << client.status();
    return client.ok() ? *std::move(client) : nullptr;
  }

  std::string Put(const std::vector<float>& values, std::vector<int64_t> shape,
                  Client* client = nullptr) {
    absl::StatusOr<TensorInfo> info =
        (client != nullptr ? client : client_.get())
            ->Upload(DType::kFloat32, shape, values.data(),
                     values.size() * sizeof(float));
    EXPECT_TRUE(info.ok()) << info.status();
    return info.ok() ? info->handle : "";
  }
  std::string PutTargets(const std::vector<int64_t>& targets) {
    const std::vector<int64_t> shape = {static_cast<int64_t>(targets.size())};
    absl::StatusOr<TensorInfo> info = client_->Upload(
        DType::kInt64, shape, targets.data(), targets.size() * 8);
    EXPECT_TRUE(info.ok()) << info.status();
    return info.ok() ? info->handle : "";
  }
  std::vector<float> Get(const std::string& handle) {
    absl::StatusOr<DownloadedTensor> got =
        client_->Download(handle, DType::kFloat32);
    EXPECT_TRUE(got.ok()) << got.status();
    if (!got.ok()) return {};
    std::vector<float> values(got->data.size() / sizeof(float));
    std::memcpy(values.data(), got->data.data(), got->data.size());
    return values;
  }

  // The problem's tensors on the server.
  struct Stored {
    std::string x, weight, bias, targets;
  };
  Stored Store(const Problem& p) {
    return {Put(p.x, {p.rows, p.width}), Put(p.weight, {p.vocab, p.width}),
            Put(p.bias, {p.vocab}), PutTargets(p.targets)};
  }

  std::unique_ptr<LossdServer> server_;
  std::unique_ptr<Client> client_;
};

TEST_F(LinearTest, InPlaceMatchesFloat64Reference) {
  const Problem p = MakeProblem(13, 8, 11, 1);
  const Stored s = Store(p);
  LinearForwardOptions options;
  options.bias = s.bias;
  options.loss.grad_scale = 0.5f;
  absl::StatusOr<LinearForwardResult> result = client_->LinearForward(
      s.x, s.weight, Targets::Handle(s.targets), options);
  ASSERT_TRUE(result.ok()) << result.status();
  const Reference want = Compute(p, true, true, 0.0, 0.5);
  EXPECT_NEAR(result->forward.loss, want.loss, 1e-5);
  EXPECT_EQ(result->forward.valid_tokens, 11);
  EXPECT_EQ(result->forward.gradient, s.x);
  ASSERT_FALSE(result->weight_grad.empty());
  ASSERT_FALSE(result->bias_grad.empty());

  absl::StatusOr<TensorInfo> x_info = client_->Describe(s.x);
  ASSERT_TRUE(x_info.ok());
  EXPECT_EQ(x_info->state, TensorState::kGradient);
  ExpectNear(Get(s.x), want.dx, 1e-5, "dX");
  ExpectNear(Get(result->weight_grad), want.dw, 1e-5, "dW");
  ExpectNear(Get(result->bias_grad), want.db, 1e-5, "dbias");
  absl::StatusOr<TensorInfo> dw_info = client_->Describe(result->weight_grad);
  ASSERT_TRUE(dw_info.ok());
  EXPECT_EQ(dw_info->dtype, DType::kFloat32);
  EXPECT_EQ(dw_info->shape, (std::vector<int64_t>{p.vocab, p.width}));

  // Backward scales dX lazily, as for logits; the accumulators stay.
  ASSERT_TRUE(client_->Backward(s.x, 0.25).ok());
  std::vector<double> scaled = want.dx;
  for (double& value : scaled) value *= 0.25;
  ExpectNear(Get(s.x), scaled, 1e-5, "dX after Backward");
  ExpectNear(Get(result->weight_grad), want.dw, 1e-5, "dW after Backward");

  // The weight gradient as bf16 (Download's conversion).
  absl::StatusOr<DownloadedTensor> bf16 =
      client_->Download(result->weight_grad, DType::kBFloat16);
  ASSERT_TRUE(bf16.ok()) << bf16.status();
  EXPECT_EQ(bf16->data.size(), static_cast<size_t>(p.vocab * p.width * 2));
}

// The CPU computes in fp32 under every precision: FAST gives the default's
// results (within fp32 rounding).
TEST_F(LinearTest, FastPrecisionIsTheDefaultOnTheCpu) {
  const Problem p = MakeProblem(13, 8, 11, 9);
  const Reference want = Compute(p, true, true, 0.0, 1.0);
  for (LinearForwardPrecision precision :
       {LinearForwardPrecision::kExact, LinearForwardPrecision::kFast}) {
    const Stored s = Store(p);
    LinearForwardOptions options;
    options.bias = s.bias;
    options.precision = precision;
    absl::StatusOr<LinearForwardResult> result = client_->LinearForward(
        s.x, s.weight, Targets::Handle(s.targets), options);
    ASSERT_TRUE(result.ok()) << result.status();
    EXPECT_NEAR(result->forward.loss, want.loss, 1e-5);
    ExpectNear(Get(s.x), want.dx, 1e-5, "dX");
    ExpectNear(Get(result->weight_grad), want.dw, 1e-5, "dW");
    ExpectNear(Get(result->bias_grad), want.db, 1e-5, "dbias");
  }

  // An unknown value names the field, the allowed values and what came.
  const Stored s = Store(p);
  LinearForwardOptions options;
  options.precision = static_cast<LinearForwardPrecision>(7);
  const absl::Status status =
      client_->LinearForward(s.x, s.weight, Targets::Handle(s.targets), options)
          .status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_NE(status.message().find("precision"), absl::string_view::npos);
  EXPECT_NE(status.message().find("7"), absl::string_view::npos);
  EXPECT_NE(status.message().find("FAST"), absl::string_view::npos);
}

TEST_F(LinearTest, OutOfPlaceAndNone) {
  const Problem p = MakeProblem(9, 6, 7, 2);
  const Stored s = Store(p);
  const Reference want = Compute(p, false, true, 0.0, 1.0);

  LinearForwardOptions options;
  options.mode = GradientMode::kOutOfPlace;
  options.token_loss = true;
  absl::StatusOr<LinearForwardResult> result = client_->LinearForward(
      s.x, s.weight, Targets::Handle(s.targets), options);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_NEAR(result->forward.loss, want.loss, 1e-5);
  EXPECT_NE(result->forward.gradient, s.x);
  EXPECT_EQ(result->forward.token_loss.size(), 9u);
  EXPECT_TRUE(result->bias_grad.empty());
  ExpectNear(Get(result->forward.gradient), want.dx, 1e-5, "dX");
  ExpectNear(Get(result->weight_grad), want.dw, 1e-5, "dW");
  EXPECT_EQ(Get(s.x), p.x);  // the hidden states are only read
  EXPECT_EQ(client_->Describe(s.x)->state, TensorState::kLogits);

  // NONE: the loss only; nothing written, nothing made.
  const int64_t tensors = server_->store()->Stats().tensors;
  options = LinearForwardOptions();
  options.mode = GradientMode::kNone;
  std::vector<int32_t> targets32(p.targets.begin(), p.targets.end());
  result = client_->LinearForward(
      s.x, s.weight,
      Targets::Inline(DType::kInt32, targets32.data(), targets32.size() * 4),
      options);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_NEAR(result->forward.loss, want.loss, 1e-5);
  EXPECT_TRUE(result->forward.gradient.empty());
  EXPECT_TRUE(result->weight_grad.empty());
  EXPECT_EQ(server_->store()->Stats().tensors, tensors);
  EXPECT_EQ(Get(s.x), p.x);
}

// Four micro-batches ADDed into one accumulator give one batch of four times
// the rows (the batch's normalizer passed explicitly); OVERWRITE restarts it.
TEST_F(LinearTest, AddOverMicroBatchesIsOneBatch) {
  const Problem whole = MakeProblem(4 * 6, 8, 10, 3);
  int64_t valid = 0;
  for (int64_t t : whole.targets) valid += t != kIgnore;
  const Reference want = Compute(whole, true, true, valid, 1.0);
  const std::string weight = Put(whole.weight, {whole.vocab, whole.width});
  const std::string bias = Put(whole.bias, {whole.vocab});
  LinearForwardOptions options;
  options.bias = bias;
  options.loss.normalizer = static_cast<double>(valid);
  options.accumulate = LinearAccumulate::kAdd;
  std::vector<double> dx;
  double loss = 0.0;
  std::string dw, db;
  for (int micro = 0; micro < 4; ++micro) {
    Problem part = whole;
    part.rows = 6;
    part.x.assign(whole.x.begin() + micro * 6 * whole.width,
                  whole.x.begin() + (micro + 1) * 6 * whole.width);
    part.targets.assign(whole.targets.begin() + micro * 6,
                        whole.targets.begin() + (micro + 1) * 6);
    const std::string x = Put(part.x, {6, whole.width});
    options.weight_grad = dw;
    options.bias_grad = db;
    absl::StatusOr<LinearForwardResult> result = client_->LinearForward(
        x, weight, Targets::Handle(PutTargets(part.targets)), options);
    ASSERT_TRUE(result.ok()) << result.status();
    if (micro > 0) {
      EXPECT_EQ(result->weight_grad, dw);  // the same accumulator
      EXPECT_EQ(result->bias_grad, db);
    }
    dw = result->weight_grad;
    db = result->bias_grad;
    loss += result->forward.loss;
    for (float value : Get(x)) dx.push_back(value);
  }
  EXPECT_NEAR(loss, want.loss, 1e-5);
  ExpectNear(std::vector<float>(dx.begin(), dx.end()), want.dx, 1e-5, "dX");
  ExpectNear(Get(dw), want.dw, 1e-5, "dW");
  ExpectNear(Get(db), want.db, 1e-5, "dbias");

  // OVERWRITE: the accumulator holds this call's gradient alone.
  Problem first = MakeProblem(5, 8, 10, 4);
  first.weight = whole.weight;
  first.bias = whole.bias;
  options.accumulate = LinearAccumulate::kOverwrite;
  options.loss.normalizer = 0.0;
  options.weight_grad = dw;
  options.bias_grad = db;
  const std::string x = Put(first.x, {5, 8});
  absl::StatusOr<LinearForwardResult> result = client_->LinearForward(
      x, weight, Targets::Handle(PutTargets(first.targets)), options);
  ASSERT_TRUE(result.ok()) << result.status();
  const Reference alone = Compute(first, true, true, 0.0, 1.0);
  ExpectNear(Get(dw), alone.dw, 1e-5, "dW overwritten");
  ExpectNear(Get(db), alone.db, 1e-5, "dbias overwritten");
}

// A new accumulator next to an existing one starts from zero.
TEST_F(LinearTest, NewBiasAccumulatorBesideExistingWeightAccumulator) {
  const Problem p = MakeProblem(7, 5, 6, 5);
  const Stored s = Store(p);
  const std::vector<float> start(p.vocab * p.width, 1.0f);
  const std::string dw = Put(start, {p.vocab, p.width});
  LinearForwardOptions options;
  options.bias = s.bias;
  options.weight_grad = dw;
  absl::StatusOr<LinearForwardResult> result = client_->LinearForward(
      s.x, s.weight, Targets::Handle(s.targets), options);
  ASSERT_TRUE(result.ok()) << result.status();
  Reference want = Compute(p, true, true, 0.0, 1.0);
  ExpectNear(Get(result->bias_grad), want.db, 1e-5, "new dbias");
  for (double& value : want.dw) value += 1.0;
  ExpectNear(Get(dw), want.dw, 1e-5, "dW added to 1");
}

TEST_F(LinearTest, OverwriteKeepsHandleAndMemory) {
  const Problem p = MakeProblem(6, 4, 5, 6);
  const Stored s = Store(p);
  const StoreStats before = server_->store()->Stats();
  Problem updated = MakeProblem(6, 4, 5, 7);
  updated.x = p.x;
  updated.targets = p.targets;
  absl::StatusOr<TensorInfo> info =
      client_->Overwrite(s.weight, DType::kFloat32, {p.vocab, p.width},
                         updated.weight.data(), updated.weight.size() * 4);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->handle, s.weight);
  EXPECT_EQ(server_->store()->Stats().used_bytes, before.used_bytes);
  EXPECT_EQ(server_->store()->Stats().tensors, before.tensors);
  EXPECT_EQ(Get(s.weight), updated.weight);

  LinearForwardOptions options;
  options.mode = GradientMode::kNone;
  absl::StatusOr<LinearForwardResult> result = client_->LinearForward(
      s.x, s.weight, Targets::Handle(s.targets), options);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_NEAR(result->forward.loss, Compute(updated, false, true, 0, 1).loss,
              1e-5);

  // A gradient overwritten is new hidden states again (state LOGITS).
  options.mode = GradientMode::kInPlace;
  ASSERT_TRUE(
      client_->LinearForward(s.x, s.weight, Targets::Handle(s.targets), options)
          .ok());
  ASSERT_TRUE(client_->Backward(s.x, 3.0).ok());
  info = client_->Overwrite(s.x, DType::kFloat32, {p.rows, p.width}, p.x.data(),
                            p.x.size() * 4);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->state, TensorState::kLogits);
  EXPECT_EQ(info->pending_scale, 1.0);
  EXPECT_EQ(Get(s.x), p.x);

  // Another dtype or shape, or an unknown handle: refused, nothing changed.
  const std::vector<float> wrong(p.vocab * p.width + p.vocab, 0.0f);
  EXPECT_EQ(client_
                ->Overwrite(s.weight, DType::kFloat32, {p.vocab + 1, p.width},
                            wrong.data(), (p.vocab + 1) * p.width * 4)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  const std::vector<uint16_t> half(p.vocab * p.width, 0);
  EXPECT_EQ(client_
                ->Overwrite(s.weight, DType::kBFloat16, {p.vocab, p.width},
                            half.data(), half.size() * 2)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(client_->Release(s.bias).ok());
  EXPECT_EQ(client_
                ->Overwrite(s.bias, DType::kFloat32, {p.vocab}, p.bias.data(),
                            p.bias.size() * 4)
                .status()
                .code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(Get(s.weight), updated.weight);
}

// The server's striped path overwrites too: two raw stripes naming the
// tensor replace its contents under the same handle.
TEST_F(LinearTest, StripedOverwrite) {
  namespace pb = ::lossd::v1;
  const Problem p = MakeProblem(4, 6, 8, 11);
  const std::string weight = Put(p.weight, {p.vocab, p.width});
  const Problem q = MakeProblem(4, 6, 8, 12);
  const int64_t elements = p.vocab * p.width;
  const StoreStats before = server_->store()->Stats();
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
  std::vector<pb::UploadResponse> responses(2);
  std::vector<std::unique_ptr<grpc::ClientWriter<pb::UploadRequest>>> writers;
  std::vector<std::unique_ptr<pb::Lossd::Stub>> stubs;
  for (int index = 0; index < 2; ++index) {
    stubs.push_back(
        pb::Lossd::NewStub(e2e_test::LargeMessageChannel(server_->address())));
    contexts.push_back(std::make_unique<grpc::ClientContext>());
    writers.push_back(
        stubs.back()->Upload(contexts.back().get(), &responses[index]));
    pb::UploadRequest request;
    pb::TensorHeader* header = request.mutable_header();
    header->set_dtype(pb::DTYPE_FLOAT32);
    header->add_shape(p.vocab);
    header->add_shape(p.width);
    header->set_overwrite_handle(weight);
    header->mutable_stripe()->set_upload_id("overwrite-1");
    header->mutable_stripe()->set_index(index);
    header->mutable_stripe()->set_count(2);
    ASSERT_TRUE(writers.back()->Write(request));
    const int64_t first = index * elements / 2;
    const int64_t end = (index + 1) * elements / 2;
    pb::UploadRequest chunk;
    chunk.set_chunk(
        std::string(reinterpret_cast<const char*>(q.weight.data() + first),
                    (end - first) * sizeof(float)));
    ASSERT_TRUE(writers.back()->Write(chunk));
    writers.back()->WritesDone();
  }
  for (int index = 0; index < 2; ++index) {
    const grpc::Status status = writers[index]->Finish();
    ASSERT_TRUE(status.ok()) << status.error_message();
    EXPECT_EQ(responses[index].tensor().handle(), weight);
  }
  EXPECT_EQ(Get(weight), q.weight);
  EXPECT_EQ(server_->store()->Stats().used_bytes, before.used_bytes);
  EXPECT_EQ(server_->store()->Stats().tensors, before.tensors);
}

// An overwrite whose bytes come over a data connection lands in the same
// tensor too.
TEST_F(LinearTest, OverwriteOverADataConnection) {
  namespace pb = ::lossd::v1;
  const Problem p = MakeProblem(4, 6, 8, 13);
  const std::string weight = Put(p.weight, {p.vocab, p.width});
  const Problem q = MakeProblem(4, 6, 8, 14);
  const StoreStats before = server_->store()->Stats();
  const std::string token(16, 'o');
  std::unique_ptr<pb::Lossd::Stub> stub =
      pb::Lossd::NewStub(e2e_test::LargeMessageChannel(server_->address()));
  grpc::ClientContext context;
  pb::UploadResponse response;
  std::unique_ptr<grpc::ClientWriter<pb::UploadRequest>> writer =
      stub->Upload(&context, &response);
  pb::UploadRequest request;
  pb::TensorHeader* header = request.mutable_header();
  header->set_dtype(pb::DTYPE_FLOAT32);
  header->add_shape(p.vocab);
  header->add_shape(p.width);
  header->set_overwrite_handle(weight);
  header->set_data_token(token);
  header->set_data_connections(1);
  ASSERT_TRUE(writer->Write(request));
  ASSERT_TRUE(writer->WritesDone());
  absl::StatusOr<int> fd =
      ConnectDataPort("127.0.0.1", server_->data_port(), absl::Seconds(5));
  ASSERT_TRUE(fd.ok()) << fd.status();
  ASSERT_TRUE(SendDataPreamble(*fd, token, 0).ok());
  ASSERT_TRUE(SendDataBytes(*fd, reinterpret_cast<const char*>(q.weight.data()),
                            q.weight.size() * sizeof(float))
                  .ok());
  ASSERT_TRUE(EndDataSending(*fd).ok());
  const grpc::Status status = writer->Finish();
  close(*fd);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(response.tensor().handle(), weight);
  EXPECT_EQ(Get(weight), q.weight);
  EXPECT_EQ(server_->store()->Stats().used_bytes, before.used_bytes);
  EXPECT_EQ(server_->store()->Stats().tensors, before.tensors);
}

TEST_F(LinearTest, BadRequestsChangeNothing) {
  const Problem p = MakeProblem(6, 4, 5, 8);
  const Stored s = Store(p);
  const std::string wide =
      Put(std::vector<float>(p.vocab * (p.width + 1), 0.5f),
          {p.vocab, p.width + 1});
  std::vector<uint16_t> bf16_weight(p.vocab * p.width, 0);
  absl::StatusOr<TensorInfo> bf16 =
      client_->Upload(DType::kBFloat16, {p.vocab, p.width}, bf16_weight.data(),
                      bf16_weight.size() * 2);
  ASSERT_TRUE(bf16.ok());
  const std::string gone = Put(p.weight, {p.vocab, p.width});
  ASSERT_TRUE(client_->Release(gone).ok());
  const std::string small_dw =
      Put(std::vector<float>(p.vocab, 0.0f), {p.vocab});
  std::vector<uint16_t> bf16_dw(p.vocab * p.width, 0);
  absl::StatusOr<TensorInfo> bf16_acc = client_->Upload(
      DType::kBFloat16, {p.vocab, p.width}, bf16_dw.data(), bf16_dw.size() * 2);
  ASSERT_TRUE(bf16_acc.ok());
  std::vector<int64_t> far = p.targets;
  far[2] = p.vocab;
  const std::string far_targets = PutTargets(far);
  // An existing accumulator whose contents must survive every failure.
  const std::vector<float> ones(p.vocab * p.width, 1.0f);
  const std::string dw = Put(ones, {p.vocab, p.width});

  struct Bad {
    const char* name;
    std::string hidden, weight, targets;
    LinearForwardOptions options;
    absl::StatusCode code;
  };
  auto with = [&](auto edit) {
    LinearForwardOptions options;
    options.weight_grad = dw;
    edit(options);
    return options;
  };
  const LinearForwardOptions plain = with([](LinearForwardOptions&) {});
  using Code = absl::StatusCode;
  const std::vector<Bad> cases = {
      {"H mismatch", s.x, wide, s.targets, plain, Code::kInvalidArgument},
      {"dtype mismatch", s.x, bf16->handle, s.targets, plain,
       Code::kInvalidArgument},
      {"weight released", s.x, gone, s.targets, plain, Code::kNotFound},
      {"hidden == weight", s.x, s.x, s.targets, plain, Code::kInvalidArgument},
      {"accumulator is the weight", s.x, s.weight, s.targets,
       with([&](LinearForwardOptions& o) { o.weight_grad = s.weight; }),
       Code::kInvalidArgument},
      {"accumulator of a wrong shape", s.x, s.weight, s.targets,
       with([&](LinearForwardOptions& o) { o.weight_grad = small_dw; }),
       Code::kInvalidArgument},
      {"accumulator of a wrong dtype", s.x, s.weight, s.targets,
       with([&](LinearForwardOptions& o) { o.weight_grad = bf16_acc->handle; }),
       Code::kInvalidArgument},
      {"bias of a wrong shape", s.x, s.weight, s.targets,
       with([&](LinearForwardOptions& o) { o.bias = wide; }),
       Code::kInvalidArgument},
      {"bias_grad without bias", s.x, s.weight, s.targets,
       with([&](LinearForwardOptions& o) { o.bias_grad = small_dw; }),
       Code::kInvalidArgument},
      {"target out of range", s.x, s.weight, far_targets, plain,
       Code::kInvalidArgument},
      {"unknown accumulate", s.x, s.weight, s.targets,
       with([&](LinearForwardOptions& o) {
         o.accumulate = static_cast<LinearAccumulate>(7);
       }),
       Code::kInvalidArgument},
      {"unknown precision", s.x, s.weight, s.targets,
       with([&](LinearForwardOptions& o) {
         o.precision = static_cast<LinearForwardPrecision>(7);
       }),
       Code::kInvalidArgument},
      {"reduction NONE without token_grad_output", s.x, s.weight, s.targets,
       with([&](LinearForwardOptions& o) {
         o.loss.reduction = Reduction::kNone;
       }),
       Code::kInvalidArgument},
      {"token_grad_output with MEAN", s.x, s.weight, s.targets,
       with([&](LinearForwardOptions& o) {
         o.token_grad_output.assign(p.rows, 1.0f);
       }),
       Code::kInvalidArgument},
      {"label_smoothing > 1", s.x, s.weight, s.targets,
       with([&](LinearForwardOptions& o) { o.loss.label_smoothing = 2.0f; }),
       Code::kInvalidArgument},
      {"empty hidden", "", s.weight, s.targets, plain, Code::kInvalidArgument},
      {"malformed weight", s.x, "not-a-handle", s.targets, plain,
       Code::kInvalidArgument},
      {"unknown hidden", "0123abcd-0123456789abcdef0123456789abcdef", s.weight,
       s.targets, plain, Code::kNotFound},
  };
  const StoreStats before = server_->store()->Stats();
  for (const Bad& bad : cases) {
    absl::StatusOr<LinearForwardResult> result = client_->LinearForward(
        bad.hidden, bad.weight, Targets::Handle(bad.targets), bad.options);
    EXPECT_EQ(result.status().code(), bad.code)
        << bad.name << ": " << result.status();
    const StoreStats after = server_->store()->Stats();
    EXPECT_EQ(after.used_bytes, before.used_bytes) << bad.name;
    EXPECT_EQ(after.tensors, before.tensors) << bad.name;
    EXPECT_EQ(client_->Describe(s.x)->state, TensorState::kLogits) << bad.name;
  }
  EXPECT_EQ(Get(s.x), p.x);
  EXPECT_EQ(Get(s.weight), p.weight);
  EXPECT_EQ(Get(dw), ones);

  // A consumed hidden handle: FAILED_PRECONDITION, the gradient kept.
  ASSERT_TRUE(
      client_->LinearForward(s.x, s.weight, Targets::Handle(s.targets), plain)
          .ok());
  const std::vector<float> dx = Get(s.x);
  const std::vector<float> dw_now = Get(dw);
  EXPECT_EQ(
      client_->LinearForward(s.x, s.weight, Targets::Handle(s.targets), plain)
          .status()
          .code(),
      absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(Get(s.x), dx);
  EXPECT_EQ(Get(dw), dw_now);
}

// Accumulators are the tenant's own: another tenant's handle is unknown.
TEST_F(LinearTest, AccumulatorOfAnotherTenantIsNotFound) {
  Start("secret-a alpha\nsecret-b beta\n");
  std::unique_ptr<Client> alpha = Connect("secret-a");
  std::unique_ptr<Client> beta = Connect("secret-b");
  client_ = std::move(alpha);
  const Problem p = MakeProblem(5, 4, 3, 9);
  const Stored s = Store(p);
  const std::string theirs = Put(std::vector<float>(p.vocab * p.width, 2.0f),
                                 {p.vocab, p.width}, beta.get());
  const StoreStats before = server_->store()->Stats();
  LinearForwardOptions options;
  options.weight_grad = theirs;
  EXPECT_EQ(
      client_->LinearForward(s.x, s.weight, Targets::Handle(s.targets), options)
          .status()
          .code(),
      absl::StatusCode::kNotFound);
  EXPECT_EQ(server_->store()->Stats().used_bytes, before.used_bytes);
  EXPECT_EQ(client_->Describe(s.x)->state, TensorState::kLogits);
  absl::StatusOr<DownloadedTensor> kept = beta->Download(theirs);
  ASSERT_TRUE(kept.ok());
  std::vector<float> values(p.vocab * p.width);
  std::memcpy(values.data(), kept->data.data(), kept->data.size());
  EXPECT_EQ(values, std::vector<float>(p.vocab * p.width, 2.0f));
}

// A new accumulator is charged to the memory budget: without room the call
// fails RESOURCE_EXHAUSTED and the hidden states keep their values.
TEST_F(LinearTest, NoRoomForAnAccumulator) {
  const int64_t width = 64, vocab = 4096;  // W 1 MiB, dW 1 MiB
  Problem p = MakeProblem(4, width, vocab, 10);
  const Stored s = Store(p);
  // Fill the budget but for less than dW needs.
  const int64_t free_bytes =
      kBudget - server_->store()->Stats().used_bytes - (512 << 10);
  const std::string filler =
      Put(std::vector<float>(free_bytes / 4, 0.0f), {free_bytes / 4});
  ASSERT_FALSE(filler.empty());
  const StoreStats before = server_->store()->Stats();
  EXPECT_EQ(client_->LinearForward(s.x, s.weight, Targets::Handle(s.targets))
                .status()
                .code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(server_->store()->Stats().used_bytes, before.used_bytes);
  EXPECT_EQ(client_->Describe(s.x)->state, TensorState::kLogits);
  EXPECT_EQ(Get(s.x), p.x);
}

}  // namespace
}  // namespace lossd
