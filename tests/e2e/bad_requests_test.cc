// Issue 6: every kind of bad request, against a real in-process server on
// 127.0.0.1:0. Each gets its documented code and message, and leaves the store
// exactly as it was: same bytes, same tensors, same states, same contents.
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/float16.h"
#include "gmock/gmock.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "lossd/v1/lossd.grpc.pb.h"
#include "server/server.h"
#include "server/validation.h"
#include "tests/e2e/bytes.h"

namespace lossd {
namespace {

namespace pb = ::lossd::v1;
using ::lossd::e2e_test::Bytes;
using ::testing::HasSubstr;
using Code = grpc::StatusCode;

// Small enough that an out-of-place gradient of big_ does not fit.
constexpr int64_t kBudget = 1 << 20;
constexpr int64_t kRows = 4;
constexpr int64_t kVocab = 5;

unsigned TestSeed() {
  const char* text = std::getenv("LOSSD_TEST_SEED");
  return text != nullptr ? static_cast<unsigned>(std::strtoul(text, nullptr, 0))
                         : 20240601u;
}

pb::UploadRequest Header(pb::DType dtype, std::vector<int64_t> shape) {
  pb::UploadRequest request;
  request.mutable_header()->set_dtype(dtype);
  for (int64_t dim : shape) request.mutable_header()->add_shape(dim);
  return request;
}

pb::UploadRequest Chunk(size_t bytes) {
  pb::UploadRequest request;
  request.set_chunk(std::string(bytes, '\1'));
  return request;
}

pb::EvaluateRequest EvalHeader(int64_t vocab, pb::DType logits_dtype,
                               pb::DType targets_dtype) {
  pb::EvaluateRequest request;
  request.mutable_header()->set_vocab(vocab);
  request.mutable_header()->set_logits_dtype(logits_dtype);
  request.mutable_header()->set_targets_dtype(targets_dtype);
  return request;
}

pb::EvaluateRequest EvalBlock(std::string logits, std::string targets) {
  pb::EvaluateRequest request;
  request.mutable_block()->set_logits(std::move(logits));
  request.mutable_block()->set_targets(std::move(targets));
  return request;
}

// Everything observable about the store: figures, and every tensor's metadata
// (without last-use times) and downloaded bytes.
struct Snapshot {
  int64_t used_bytes = 0;
  int64_t tensors = 0;
  std::map<std::string, std::string> metadata;
  std::map<std::string, std::string> contents;
};

// What differs between two snapshots' tensors, handle by handle; empty when
// nothing does.
std::string Diff(const Snapshot& before, const Snapshot& after) {
  std::string out;
  for (const auto& [handle, metadata] : before.metadata) {
    auto it = after.metadata.find(handle);
    if (it == after.metadata.end()) {
      out += handle + " disappeared\n";
    } else if (it->second != metadata) {
      out += handle + " was:\n" + metadata + "is:\n" + it->second;
    } else if (after.contents.at(handle) != before.contents.at(handle)) {
      out += handle + " changed its bytes\n";
    }
  }
  for (const auto& [handle, metadata] : after.metadata) {
    if (before.metadata.count(handle) == 0) {
      out += handle + " appeared:\n" + metadata;
    }
  }
  return out;
}

class BadRequestsTest : public ::testing::Test {
 protected:
  struct Case {
    std::string name;
    Code code;
    std::string message;  // a substring of the error message
    std::function<grpc::Status()> run;
  };

  void SetUp() override {
    ServerConfig config;
    config.host = "127.0.0.1";
    config.port = 0;
    // LOSSD_TEST_DEVICE=cuda runs the same table against the GPU backend.
    const char* device = std::getenv("LOSSD_TEST_DEVICE");
    config.device = device != nullptr ? device : "cpu";
    config.memory_budget = kBudget;
    config.threads = 2;
    config.drain_timeout = absl::Seconds(20);
    auto server = LossdServer::Start(config);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    stub_ = pb::Lossd::NewStub(grpc::CreateChannel(
        server_->address(), grpc::InsecureChannelCredentials()));
    instance_ = Info().instance_id();

    std::mt19937 rng(seed_);
    std::normal_distribution<float> normal(0.0f, 2.0f);
    auto random_logits = [&](int64_t count) {
      std::vector<float> values(count);
      for (float& x : values) x = normal(rng);
      return values;
    };
    std::vector<int64_t> targets(kRows);
    for (int64_t& y : targets) y = static_cast<int64_t>(rng() % kVocab);
    targets_values_ = targets;
    std::vector<int32_t> targets32(targets.begin(), targets.end());

    logits_ = Put(pb::DTYPE_FLOAT32, {kRows, kVocab},
                  Bytes(random_logits(kRows * kVocab)));
    big_ = Put(pb::DTYPE_FLOAT32, {256, 640}, Bytes(random_logits(256 * 640)));
    targets64_ = Put(pb::DTYPE_INT64, {kRows}, Bytes(targets));
    targets32_ = Put(pb::DTYPE_INT32, {kRows}, Bytes(targets32));
    short_targets_ =
        Put(pb::DTYPE_INT64, {2}, Bytes(std::vector<int64_t>{0, 1}));
    float_targets_ =
        Put(pb::DTYPE_FLOAT32, {kRows}, Bytes(std::vector<float>(kRows, 1.0f)));
    weights_ = Put(pb::DTYPE_FLOAT32, {kVocab},
                   Bytes(std::vector<float>(kVocab, 0.5f)));
    short_weights_ = Put(pb::DTYPE_FLOAT32, {kVocab - 1},
                         Bytes(std::vector<float>(kVocab - 1, 0.5f)));
    int_weights_ =
        Put(pb::DTYPE_INT32, {kVocab}, Bytes(std::vector<int32_t>(kVocab, 1)));
    weights_2d_ = Put(pb::DTYPE_FLOAT32, {1, kVocab},
                      Bytes(std::vector<float>(kVocab, 0.5f)));
    gradient_mean_ =
        Gradient(random_logits(kRows * kVocab), pb::REDUCTION_MEAN);
    gradient_none_ =
        Gradient(random_logits(kRows * kVocab), pb::REDUCTION_NONE);
    gradient_materialized_ =
        Gradient(random_logits(kRows * kVocab), pb::REDUCTION_SUM);
    pb::BackwardRequest materialize;
    materialize.set_gradient(gradient_materialized_);
    materialize.set_scalar(2.0);
    materialize.set_materialize(true);
    pb::BackwardResponse ignored;
    grpc::ClientContext context;
    ASSERT_TRUE(stub_->Backward(&context, materialize, &ignored).ok());

    released_ = Put(pb::DTYPE_FLOAT32, {kRows, kVocab},
                    Bytes(random_logits(kRows * kVocab)));
    grpc::ClientContext release_context;
    pb::ReleaseRequest release;
    release.set_handle(released_);
    pb::ReleaseResponse released;
    ASSERT_TRUE(stub_->Release(&release_context, release, &released).ok());

    // Well-formed handles this instance never issued.
    foreign_ = (instance_ == "00000000" ? "11111111" : "00000000") +
               logits_.substr(instance_.size());
    unknown_ = instance_ + "-" + std::string(32, 'a');
    malformed_ = instance_ + "-not-hex";
  }

  // Uploads in one chunk; fails the test when it does not succeed.
  std::string Put(pb::DType dtype, std::vector<int64_t> shape,
                  const std::string& bytes) {
    std::vector<pb::UploadRequest> messages = {Header(dtype, shape)};
    pb::UploadRequest chunk;
    chunk.set_chunk(bytes);
    messages.push_back(chunk);
    pb::UploadResponse response;
    const grpc::Status status = Upload(messages, &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return response.tensor().handle();
  }

  // A gradient in place of fresh logits, computed with `reduction`.
  std::string Gradient(const std::vector<float>& logits,
                       pb::Reduction reduction) {
    const std::string handle =
        Put(pb::DTYPE_FLOAT32, {kRows, kVocab}, Bytes(logits));
    pb::ForwardRequest request;
    request.set_logits(handle);
    request.set_targets_handle(targets64_);
    request.mutable_options()->set_reduction(reduction);
    pb::ForwardResponse response;
    const grpc::Status status = Forward(request, &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return handle;
  }

  grpc::Status Upload(const std::vector<pb::UploadRequest>& messages,
                      pb::UploadResponse* response = nullptr) {
    grpc::ClientContext context;
    pb::UploadResponse ignored;
    auto writer =
        stub_->Upload(&context, response != nullptr ? response : &ignored);
    for (const pb::UploadRequest& message : messages) {
      if (!writer->Write(message)) break;
    }
    writer->WritesDone();
    return writer->Finish();
  }

  grpc::Status Evaluate(const std::vector<pb::EvaluateRequest>& messages) {
    grpc::ClientContext context;
    pb::EvaluateResponse response;
    auto writer = stub_->Evaluate(&context, &response);
    for (const pb::EvaluateRequest& message : messages) {
      if (!writer->Write(message)) break;
    }
    writer->WritesDone();
    return writer->Finish();
  }

  grpc::Status Download(const std::string& handle, pb::DType dtype,
                        int64_t chunk_bytes, std::string* bytes = nullptr) {
    grpc::ClientContext context;
    pb::DownloadRequest request;
    request.set_handle(handle);
    request.set_dtype(dtype);
    request.set_chunk_bytes(chunk_bytes);
    auto reader = stub_->Download(&context, request);
    pb::DownloadResponse response;
    while (reader->Read(&response)) {
      if (bytes != nullptr && response.kind_case() == response.kChunk) {
        bytes->append(response.chunk());
      }
    }
    return reader->Finish();
  }

  grpc::Status Forward(const pb::ForwardRequest& request,
                       pb::ForwardResponse* response = nullptr) {
    grpc::ClientContext context;
    pb::ForwardResponse ignored;
    return stub_->Forward(&context, request,
                          response != nullptr ? response : &ignored);
  }

  grpc::Status Backward(const pb::BackwardRequest& request) {
    grpc::ClientContext context;
    pb::BackwardResponse response;
    return stub_->Backward(&context, request, &response);
  }

  grpc::Status Describe(const std::string& handle) {
    grpc::ClientContext context;
    pb::DescribeRequest request;
    request.set_handle(handle);
    pb::TensorInfo info;
    return stub_->Describe(&context, request, &info);
  }

  grpc::Status Release(const std::string& handle) {
    grpc::ClientContext context;
    pb::ReleaseRequest request;
    request.set_handle(handle);
    pb::ReleaseResponse response;
    return stub_->Release(&context, request, &response);
  }

  pb::ServerInfo Info() {
    grpc::ClientContext context;
    pb::ServerInfo info;
    EXPECT_TRUE(
        stub_->GetServerInfo(&context, pb::GetServerInfoRequest(), &info).ok());
    return info;
  }

  Snapshot Take() {
    Snapshot snapshot;
    grpc::ClientContext context;
    pb::ListResponse list;
    EXPECT_TRUE(stub_->List(&context, pb::ListRequest(), &list).ok());
    snapshot.used_bytes = list.server().used_bytes();
    snapshot.tensors = list.server().tensors();
    for (pb::TensorInfo info : list.tensors()) {
      info.clear_last_used();
      std::string bytes;
      const grpc::Status status =
          Download(info.handle(), pb::DTYPE_UNSPECIFIED, 0, &bytes);
      EXPECT_TRUE(status.ok())
          << info.handle() << ": " << status.error_message();
      snapshot.contents[info.handle()] = bytes;
      snapshot.metadata[info.handle()] = info.DebugString();
    }
    return snapshot;
  }

  // Forward on logits_ with targets64_ and `mutate` applied.
  std::function<grpc::Status()> ForwardWith(
      std::function<void(pb::ForwardRequest*)> mutate) {
    return [this, mutate] {
      pb::ForwardRequest request;
      request.set_logits(logits_);
      request.set_targets_handle(targets64_);
      mutate(&request);
      return Forward(request);
    };
  }

  // Forward with inline targets of `dtype` (int32 or int64) holding `values`.
  std::function<grpc::Status()> ForwardInline(pb::DType dtype,
                                              std::vector<int64_t> values,
                                              int64_t ignore_index = -100) {
    std::string data;
    if (dtype == pb::DTYPE_INT32) {
      data = Bytes(std::vector<int32_t>(values.begin(), values.end()));
    } else {
      data = Bytes(values);
    }
    return ForwardWith([dtype, data, ignore_index](pb::ForwardRequest* r) {
      r->mutable_targets_inline()->set_dtype(dtype);
      r->mutable_targets_inline()->set_data(data);
      r->mutable_options()->set_ignore_index(ignore_index);
    });
  }

  std::function<grpc::Status()> BackwardWith(
      std::string handle, std::function<void(pb::BackwardRequest*)> mutate) {
    return [this, handle, mutate] {
      pb::BackwardRequest request;
      request.set_gradient(handle);
      mutate(&request);
      return Backward(request);
    };
  }

  std::function<grpc::Status()> EvaluateWith(
      std::vector<pb::EvaluateRequest> messages) {
    return [this, messages] { return Evaluate(messages); };
  }

  std::function<grpc::Status()> UploadWith(
      std::vector<pb::UploadRequest> messages) {
    return [this, messages] { return Upload(messages); };
  }

  grpc::Status List(const pb::ListRequest& request,
                    pb::ListResponse* response = nullptr) {
    grpc::ClientContext context;
    pb::ListResponse ignored;
    return stub_->List(&context, request,
                       response != nullptr ? response : &ignored);
  }

  // `run`, failed as UNKNOWN when its message is long: a message quotes a
  // client's value only by a short prefix, whatever its size.
  static std::function<grpc::Status()> Short(
      std::function<grpc::Status()> run) {
    return [run] {
      const grpc::Status status = run();
      if (status.error_message().size() <= 512) return status;
      return grpc::Status(grpc::StatusCode::UNKNOWN,
                          "a message of " +
                              std::to_string(status.error_message().size()) +
                              " characters");
    };
  }

  // Sends `bytes` as the one request message of `method`
  // ("/lossd.v1.Lossd/Describe") through a generic stub, which does not
  // serialize: the server sees exactly these bytes.
  grpc::Status SendRaw(const std::string& method, const std::string& bytes) {
    grpc::GenericStub stub(grpc::CreateChannel(
        server_->address(), grpc::InsecureChannelCredentials()));
    grpc::CompletionQueue queue;
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() +
                         std::chrono::seconds(30));
    std::unique_ptr<grpc::GenericClientAsyncReaderWriter> call =
        stub.PrepareCall(&context, method, &queue);
    // One operation at a time, each awaited before the next.
    auto await = [&queue](auto start) {
      start(&queue);
      void* tag = nullptr;
      bool ok = false;
      EXPECT_TRUE(queue.Next(&tag, &ok));
      return ok;
    };
    await([&](void* tag) { call->StartCall(tag); });
    grpc::Slice slice(bytes);
    const grpc::ByteBuffer request(&slice, 1);
    await([&](void* tag) {
      call->WriteLast(request, grpc::WriteOptions(), tag);
    });
    grpc::ByteBuffer response;
    while (await([&](void* tag) { call->Read(&response, tag); })) {
    }
    grpc::Status status;
    await([&](void* tag) { call->Finish(&status, tag); });
    queue.Shutdown();
    void* tag = nullptr;
    bool ok = false;
    while (queue.Next(&tag, &ok)) {
    }
    return status;
  }

  std::vector<Case> Cases();

  const unsigned seed_ = TestSeed();
  std::unique_ptr<LossdServer> server_;
  std::unique_ptr<pb::Lossd::Stub> stub_;
  std::string instance_;
  std::vector<int64_t> targets_values_;
  std::string logits_, big_, targets64_, targets32_, short_targets_,
      float_targets_, weights_, short_weights_, int_weights_, weights_2d_,
      gradient_mean_, gradient_none_, gradient_materialized_, released_,
      foreign_, unknown_, malformed_;
};

std::vector<BadRequestsTest::Case> BadRequestsTest::Cases() {
  std::vector<Case> cases;
  auto add = [&cases](std::string name, Code code, std::string message,
                      std::function<grpc::Status()> run) {
    cases.push_back(
        {std::move(name), code, std::move(message), std::move(run)});
  };
  const float kNaN = std::numeric_limits<float>::quiet_NaN();
  const float kInf = std::numeric_limits<float>::infinity();
  const int64_t kMax = std::numeric_limits<int64_t>::max();
  const std::string row(kVocab * 4, '\0');  // one fp32 row of zeros
  const std::string target32(4, '\0');

  // ------------------------------------------------------------ Upload
  add("upload: empty stream", Code::INVALID_ARGUMENT, "ended before a header",
      UploadWith({}));
  add("upload: missing dtype", Code::INVALID_ARGUMENT,
      "header.dtype is DTYPE_UNSPECIFIED; expected one of FLOAT32, BFLOAT16, "
      "FLOAT16, INT32, INT64",
      UploadWith({Header(pb::DTYPE_UNSPECIFIED, {2}), Chunk(8)}));
  add("upload: unknown dtype", Code::INVALID_ARGUMENT,
      "header.dtype is 17, which is no DType",
      UploadWith({Header(static_cast<pb::DType>(17), {2}), Chunk(8)}));
  add("upload: negative dtype", Code::INVALID_ARGUMENT,
      "header.dtype is -1, which is no DType",
      UploadWith({Header(static_cast<pb::DType>(-1), {2})}));
  add("upload: no dims", Code::INVALID_ARGUMENT, "1 or 2 dimensions, got 0",
      UploadWith({Header(pb::DTYPE_FLOAT32, {})}));
  add("upload: 3-D", Code::INVALID_ARGUMENT, "1 or 2 dimensions, got 3",
      UploadWith({Header(pb::DTYPE_FLOAT32, {2, 2, 2}), Chunk(32)}));
  add("upload: zero dim", Code::INVALID_ARGUMENT, "dimension 0 must be > 0",
      UploadWith({Header(pb::DTYPE_FLOAT32, {0, 4})}));
  add("upload: negative dim", Code::INVALID_ARGUMENT,
      "dimension -3 must be > 0",
      UploadWith({Header(pb::DTYPE_FLOAT32, {4, -3})}));
  add("upload: min int64 dim", Code::INVALID_ARGUMENT, "must be > 0",
      UploadWith(
          {Header(pb::DTYPE_INT64, {std::numeric_limits<int64_t>::min()})}));
  add("upload: N*V overflows", Code::INVALID_ARGUMENT, "overflows int64",
      UploadWith(
          {Header(pb::DTYPE_FLOAT32, {int64_t{1} << 32, int64_t{1} << 32})}));
  add("upload: N*V*elem overflows", Code::INVALID_ARGUMENT, "overflows int64",
      UploadWith(
          {Header(pb::DTYPE_FLOAT32, {int64_t{1} << 31, int64_t{1} << 30})}));
  add("upload: int64 max elements", Code::INVALID_ARGUMENT, "overflows int64",
      UploadWith({Header(pb::DTYPE_INT64, {kMax})}));
  add("upload: 2^62 bytes over budget", Code::RESOURCE_EXHAUSTED,
      "requested 4611686018427387904 bytes",
      UploadWith({Header(pb::DTYPE_FLOAT32, {int64_t{1} << 40, 1 << 20})}));
  add("upload: over budget", Code::RESOURCE_EXHAUSTED,
      "budget exceeded: requested 1048580 bytes",
      UploadWith({Header(pb::DTYPE_FLOAT32, {kBudget / 4 + 1})}));
  add("upload: data before header", Code::INVALID_ARGUMENT,
      "data before the header",
      UploadWith({Chunk(8), Header(pb::DTYPE_FLOAT32, {2})}));
  add("upload: two headers", Code::INVALID_ARGUMENT, "a second header",
      UploadWith({Header(pb::DTYPE_FLOAT32, {2}), Chunk(8),
                  Header(pb::DTYPE_FLOAT32, {2})}));
  add("upload: more bytes (two chunks)", Code::INVALID_ARGUMENT,
      "more bytes than the header says",
      UploadWith({Header(pb::DTYPE_FLOAT32, {2}), Chunk(4), Chunk(8)}));
  add("upload: more bytes (one chunk)", Code::INVALID_ARGUMENT,
      "more bytes than the header says",
      UploadWith({Header(pb::DTYPE_INT64, {2}), Chunk(17)}));
  add("upload: fewer bytes", Code::INVALID_ARGUMENT,
      "fewer bytes than the header says: 8 expected, 7 received",
      UploadWith({Header(pb::DTYPE_FLOAT32, {2}), Chunk(7)}));
  add("upload: no bytes", Code::INVALID_ARGUMENT,
      "fewer bytes than the header says: 8 expected, 0 received",
      UploadWith({Header(pb::DTYPE_FLOAT32, {2})}));
  add("upload: empty message", Code::INVALID_ARGUMENT,
      "neither header nor chunk",
      UploadWith({Header(pb::DTYPE_FLOAT32, {2}), pb::UploadRequest()}));
  add("upload: cancelled after the header", Code::CANCELLED, "", [this] {
    grpc::ClientContext context;
    pb::UploadResponse response;
    auto writer = stub_->Upload(&context, &response);
    const int64_t before = server_->store()->Stats().used_bytes;
    writer->Write(Header(pb::DTYPE_FLOAT32, {1000}));
    writer->Write(Chunk(1000));
    // Reserved at the header; then the client goes away.
    EXPECT_TRUE(
        server_->store()->AwaitUsedBytes(before + 4000, absl::Seconds(10)));
    context.TryCancel();
    return writer->Finish();
  });

  // ------------------------------------------------------------ Download
  add("download: unknown handle", Code::NOT_FOUND, "unknown handle",
      [this] { return Download(unknown_, pb::DTYPE_UNSPECIFIED, 0); });
  add("download: malformed handle", Code::INVALID_ARGUMENT,
      "handle: malformed handle",
      [this] { return Download(malformed_, pb::DTYPE_UNSPECIFIED, 0); });
  add("download: released handle", Code::NOT_FOUND, "was released",
      [this] { return Download(released_, pb::DTYPE_UNSPECIFIED, 0); });
  add("download: foreign handle", Code::NOT_FOUND, "belongs to instance",
      [this] { return Download(foreign_, pb::DTYPE_UNSPECIFIED, 0); });
  add("download: empty handle", Code::INVALID_ARGUMENT, "handle: empty handle",
      [this] { return Download("", pb::DTYPE_UNSPECIFIED, 0); });
  add("download: int64 -> float32", Code::INVALID_ARGUMENT,
      "cannot convert int64 to float32",
      [this] { return Download(targets64_, pb::DTYPE_FLOAT32, 0); });
  add("download: int32 -> bfloat16", Code::INVALID_ARGUMENT,
      "cannot convert int32 to bfloat16",
      [this] { return Download(targets32_, pb::DTYPE_BFLOAT16, 0); });
  add("download: float32 -> int64", Code::INVALID_ARGUMENT,
      "cannot convert float32 to int64",
      [this] { return Download(logits_, pb::DTYPE_INT64, 0); });
  add("download: int64 -> int32", Code::INVALID_ARGUMENT,
      "cannot convert int64 to int32",
      [this] { return Download(targets64_, pb::DTYPE_INT32, 0); });
  add("download: unknown dtype", Code::INVALID_ARGUMENT,
      "dtype is 42, which is no DType",
      [this] { return Download(logits_, static_cast<pb::DType>(42), 0); });
  add("download: negative chunk_bytes", Code::INVALID_ARGUMENT,
      "chunk_bytes = -1 is outside",
      [this] { return Download(logits_, pb::DTYPE_UNSPECIFIED, -1); });
  add("download: chunk_bytes < one element", Code::INVALID_ARGUMENT,
      "smaller than one element",
      [this] { return Download(logits_, pb::DTYPE_FLOAT32, 3); });
  add("download: chunk_bytes < one int64", Code::INVALID_ARGUMENT,
      "smaller than one element",
      [this] { return Download(targets64_, pb::DTYPE_UNSPECIFIED, 7); });
  add("download: huge chunk_bytes", Code::INVALID_ARGUMENT, "is outside",
      [this] { return Download(logits_, pb::DTYPE_UNSPECIFIED, kMax); });

  // ------------------------------------------------------------ Describe
  add("describe: unknown", Code::NOT_FOUND, "unknown handle",
      [this] { return Describe(unknown_); });
  add("describe: malformed", Code::INVALID_ARGUMENT, "malformed handle",
      [this] { return Describe(malformed_); });
  add("describe: released", Code::NOT_FOUND, "was released",
      [this] { return Describe(released_); });
  add("describe: foreign", Code::NOT_FOUND, "belongs to instance",
      [this] { return Describe(foreign_); });
  add("describe: no dash", Code::INVALID_ARGUMENT, "malformed handle",
      [this] { return Describe("nope"); });

  // ------------------------------------------------------------ Release
  add("release: unknown", Code::NOT_FOUND, "unknown handle",
      [this] { return Release(unknown_); });
  add("release: malformed", Code::INVALID_ARGUMENT, "malformed handle",
      [this] { return Release(malformed_); });
  add("release: released twice", Code::NOT_FOUND, "was released",
      [this] { return Release(released_); });
  add("release: foreign", Code::NOT_FOUND, "belongs to instance",
      [this] { return Release(foreign_); });
  add("release: empty", Code::INVALID_ARGUMENT, "empty handle",
      [this] { return Release(""); });

  // ------------------------------------------------------------ Forward
  add("forward: unknown logits", Code::NOT_FOUND, "unknown handle",
      ForwardWith([this](auto* r) { r->set_logits(unknown_); }));
  add("forward: malformed logits", Code::INVALID_ARGUMENT,
      "logits: malformed handle",
      ForwardWith([this](auto* r) { r->set_logits(malformed_); }));
  add("forward: released logits", Code::NOT_FOUND, "was released",
      ForwardWith([this](auto* r) { r->set_logits(released_); }));
  add("forward: foreign logits", Code::NOT_FOUND, "belongs to instance",
      ForwardWith([this](auto* r) { r->set_logits(foreign_); }));
  add("forward: unknown targets", Code::NOT_FOUND, "unknown handle",
      ForwardWith([this](auto* r) { r->set_targets_handle(unknown_); }));
  add("forward: released targets", Code::NOT_FOUND, "was released",
      ForwardWith([this](auto* r) { r->set_targets_handle(released_); }));
  add("forward: foreign targets", Code::NOT_FOUND, "belongs to instance",
      ForwardWith([this](auto* r) { r->set_targets_handle(foreign_); }));
  add("forward: unknown class_weights", Code::NOT_FOUND, "unknown handle",
      ForwardWith([this](auto* r) {
        r->mutable_options()->set_class_weights(unknown_);
      }));
  add("forward: foreign class_weights", Code::NOT_FOUND, "belongs to instance",
      ForwardWith([this](auto* r) {
        r->mutable_options()->set_class_weights(foreign_);
      }));
  add("forward: malformed class_weights", Code::INVALID_ARGUMENT,
      "options.class_weights: malformed handle", ForwardWith([this](auto* r) {
        r->mutable_options()->set_class_weights("x");
      }));
  add("forward: logits are int64 targets", Code::INVALID_ARGUMENT,
      "logits must be a 2-D float tensor, got int64 [4]",
      ForwardWith([this](auto* r) { r->set_logits(targets64_); }));
  add("forward: logits are 1-D", Code::INVALID_ARGUMENT,
      "logits must be a 2-D float tensor, got float32 [5]",
      ForwardWith([this](auto* r) { r->set_logits(weights_); }));
  add("forward: no targets", Code::INVALID_ARGUMENT, "targets missing",
      ForwardWith([](auto* r) { r->clear_targets_handle(); }));
  add("forward: targets too short", Code::INVALID_ARGUMENT,
      "targets must be int32 or int64 [4], got int64 [2]",
      ForwardWith([this](auto* r) { r->set_targets_handle(short_targets_); }));
  add("forward: targets are floats", Code::INVALID_ARGUMENT, "got float32 [4]",
      ForwardWith([this](auto* r) { r->set_targets_handle(float_targets_); }));
  add("forward: targets are 2-D logits", Code::INVALID_ARGUMENT,
      "got float32 [4, 5]",
      ForwardWith([this](auto* r) { r->set_targets_handle(gradient_mean_); }));
  add("forward: inline targets without dtype", Code::INVALID_ARGUMENT,
      "targets_inline.dtype is DTYPE_UNSPECIFIED; expected one of INT32, INT64",
      ForwardWith([](auto* r) {
        r->mutable_targets_inline()->set_data(std::string(32, '\0'));
      }));
  add("forward: inline float targets", Code::INVALID_ARGUMENT,
      "targets_inline.dtype is DTYPE_FLOAT32; expected one of INT32, INT64",
      ForwardWith([](auto* r) {
        r->mutable_targets_inline()->set_dtype(pb::DTYPE_FLOAT32);
        r->mutable_targets_inline()->set_data(std::string(16, '\0'));
      }));
  add("forward: inline targets unknown dtype", Code::INVALID_ARGUMENT,
      "targets_inline.dtype is 99, which is no DType", ForwardWith([](auto* r) {
        r->mutable_targets_inline()->set_dtype(static_cast<pb::DType>(99));
      }));
  add("forward: inline int64 targets too long", Code::INVALID_ARGUMENT,
      "inline targets have 40 bytes, 4 rows of int64 need 32",
      ForwardInline(pb::DTYPE_INT64, {0, 1, 2, 3, 4}));
  add("forward: inline int32 targets too short", Code::INVALID_ARGUMENT,
      "inline targets have 12 bytes, 4 rows of int32 need 16",
      ForwardInline(pb::DTYPE_INT32, {0, 1, 2}));
  add("forward: int64 target = V", Code::INVALID_ARGUMENT,
      "targets[2] = 5 is out of range",
      ForwardInline(pb::DTYPE_INT64, {0, 1, kVocab, 2}));
  add("forward: int64 target < 0", Code::INVALID_ARGUMENT,
      "targets[1] = -1 is out of range",
      ForwardInline(pb::DTYPE_INT64, {0, -1, 1, 2}));
  add("forward: int64 target huge", Code::INVALID_ARGUMENT,
      "targets[3] = 9223372036854775807",
      ForwardInline(pb::DTYPE_INT64, {0, 1, 2, kMax}));
  add("forward: int64 target most negative", Code::INVALID_ARGUMENT,
      "targets[0] = -9223372036854775808",
      ForwardInline(pb::DTYPE_INT64,
                    {std::numeric_limits<int64_t>::min(), 1, 2, 3}));
  add("forward: int32 target = V", Code::INVALID_ARGUMENT,
      "targets[3] = 5 is out of range",
      ForwardInline(pb::DTYPE_INT32, {0, 1, 2, kVocab}));
  add("forward: int32 target < 0", Code::INVALID_ARGUMENT,
      "targets[0] = -7 is out of range",
      ForwardInline(pb::DTYPE_INT32, {-7, 1, 2, 3}));
  add("forward: int32 target int32 min", Code::INVALID_ARGUMENT,
      "targets[1] = -2147483648",
      ForwardInline(pb::DTYPE_INT32,
                    {0, std::numeric_limits<int32_t>::min(), 2, 3}));
  add("forward: -100 is not ignored with ignore_index -1",
      Code::INVALID_ARGUMENT, "targets[0] = -100 is out of range",
      ForwardInline(pb::DTYPE_INT32, {-100, 1, 2, 3}, -1));
  add("forward: label_smoothing < 0", Code::INVALID_ARGUMENT,
      "label_smoothing = -0.1 is outside [0, 1]", ForwardWith([](auto* r) {
        r->mutable_options()->set_label_smoothing(-0.1f);
      }));
  add("forward: label_smoothing > 1", Code::INVALID_ARGUMENT,
      "label_smoothing = 1.5 is outside [0, 1]", ForwardWith([](auto* r) {
        r->mutable_options()->set_label_smoothing(1.5f);
      }));
  add("forward: label_smoothing NaN", Code::INVALID_ARGUMENT,
      "label_smoothing = nan is not finite", ForwardWith([kNaN](auto* r) {
        r->mutable_options()->set_label_smoothing(kNaN);
      }));
  add("forward: softcap < 0", Code::INVALID_ARGUMENT, "softcap = -1 is < 0",
      ForwardWith([](auto* r) { r->mutable_options()->set_softcap(-1.0f); }));
  add("forward: softcap inf", Code::INVALID_ARGUMENT,
      "softcap = inf is not finite", ForwardWith([kInf](auto* r) {
        r->mutable_options()->set_softcap(kInf);
      }));
  add("forward: z_loss_scale < 0", Code::INVALID_ARGUMENT,
      "z_loss_scale = -0.5 is < 0", ForwardWith([](auto* r) {
        r->mutable_options()->set_z_loss_scale(-0.5f);
      }));
  add("forward: z_loss_scale NaN", Code::INVALID_ARGUMENT,
      "z_loss_scale = nan is not finite", ForwardWith([kNaN](auto* r) {
        r->mutable_options()->set_z_loss_scale(kNaN);
      }));
  add("forward: normalizer < 0", Code::INVALID_ARGUMENT,
      "normalizer = -2 is < 0",
      ForwardWith([](auto* r) { r->mutable_options()->set_normalizer(-2.0); }));
  add("forward: normalizer -inf", Code::INVALID_ARGUMENT,
      "normalizer = -inf is not finite", ForwardWith([](auto* r) {
        r->mutable_options()->set_normalizer(
            -std::numeric_limits<double>::infinity());
      }));
  add("forward: grad_scale NaN", Code::INVALID_ARGUMENT,
      "grad_scale = nan is not finite", ForwardWith([kNaN](auto* r) {
        r->mutable_options()->set_grad_scale(kNaN);
      }));
  add("forward: unknown reduction", Code::INVALID_ARGUMENT,
      "unknown reduction 7", ForwardWith([](auto* r) {
        r->mutable_options()->set_reduction(static_cast<pb::Reduction>(7));
      }));
  add("forward: unknown mode", Code::INVALID_ARGUMENT, "unknown gradient mode",
      ForwardWith(
          [](auto* r) { r->set_mode(static_cast<pb::GradientMode>(-4)); }));
  add("forward: weights of length V-1", Code::INVALID_ARGUMENT,
      "class_weights must be float32 [5], got float32 [4]",
      ForwardWith([this](auto* r) {
        r->mutable_options()->set_class_weights(short_weights_);
      }));
  add("forward: int32 weights", Code::INVALID_ARGUMENT,
      "class_weights must be float32 [5], got int32 [5]",
      ForwardWith([this](auto* r) {
        r->mutable_options()->set_class_weights(int_weights_);
      }));
  add("forward: 2-D weights", Code::INVALID_ARGUMENT,
      "class_weights must be float32 [5], got float32 [1, 5]",
      ForwardWith([this](auto* r) {
        r->mutable_options()->set_class_weights(weights_2d_);
      }));
  add("forward: on a consumed handle", Code::FAILED_PRECONDITION,
      "its logits were consumed",
      ForwardWith([this](auto* r) { r->set_logits(gradient_mean_); }));
  add("forward: out of place on a consumed handle", Code::FAILED_PRECONDITION,
      "its logits were consumed", ForwardWith([this](auto* r) {
        r->set_logits(gradient_none_);
        r->set_mode(pb::GRADIENT_MODE_OUT_OF_PLACE);
      }));
  add("forward: no room for an out-of-place gradient", Code::RESOURCE_EXHAUSTED,
      "requested 655360 bytes", [this] {
        pb::ForwardRequest request;
        request.set_logits(big_);
        request.mutable_targets_inline()->set_dtype(pb::DTYPE_INT32);
        request.mutable_targets_inline()->set_data(std::string(256 * 4, '\0'));
        request.set_mode(pb::GRADIENT_MODE_OUT_OF_PLACE);
        return Forward(request);
      });
  add("forward: in place while a Download reads it", Code::FAILED_PRECONDITION,
      "is being read", [this] {
        grpc::ClientContext context;
        pb::DownloadRequest download;
        download.set_handle(big_);
        download.set_chunk_bytes(4);
        auto reader = stub_->Download(&context, download);
        pb::DownloadResponse response;
        EXPECT_TRUE(reader->Read(&response));  // the header: the lease is held
        pb::ForwardRequest request;
        request.set_logits(big_);
        request.mutable_targets_inline()->set_dtype(pb::DTYPE_INT32);
        request.mutable_targets_inline()->set_data(std::string(256 * 4, '\0'));
        const grpc::Status status = Forward(request);
        context.TryCancel();
        while (reader->Read(&response)) {
        }
        reader->Finish();
        return status;
      });

  // ------------------------------------------------------------ Backward
  add("backward: on logits", Code::FAILED_PRECONDITION, "holds logits",
      BackwardWith(logits_, [](auto* r) { r->set_scalar(1.0); }));
  add("backward: on targets", Code::FAILED_PRECONDITION, "holds logits",
      BackwardWith(targets64_, [](auto* r) { r->set_scalar(1.0); }));
  add("backward: no grad_output", Code::INVALID_ARGUMENT, "no grad_output",
      BackwardWith(gradient_mean_, [](auto*) {}));
  add("backward: NaN", Code::INVALID_ARGUMENT, "not finite",
      BackwardWith(gradient_mean_, [](auto* r) { r->set_scalar(NAN); }));
  add("backward: -inf", Code::INVALID_ARGUMENT, "not finite",
      BackwardWith(gradient_mean_, [](auto* r) { r->set_scalar(-INFINITY); }));
  add("backward: beyond float32", Code::INVALID_ARGUMENT, "float32",
      BackwardWith(gradient_mean_, [](auto* r) { r->set_scalar(1e300); }));
  add("backward: empty per-token", Code::INVALID_ARGUMENT,
      "per-token grad_output is empty",
      BackwardWith(gradient_none_, [](auto* r) { r->mutable_per_token(); }));
  add("backward: per-token on a mean gradient", Code::INVALID_ARGUMENT,
      "needs a gradient computed with reduction NONE",
      BackwardWith(gradient_mean_, [](auto* r) {
        for (int i = 0; i < kRows; ++i) r->mutable_per_token()->add_values(1);
      }));
  add("backward: per-token too short", Code::INVALID_ARGUMENT,
      "per-token grad_output has 3 values, the gradient has 4 rows",
      BackwardWith(gradient_none_, [](auto* r) {
        for (int i = 0; i < 3; ++i) r->mutable_per_token()->add_values(1);
      }));
  add("backward: per-token too long", Code::INVALID_ARGUMENT,
      "per-token grad_output has 5 values",
      BackwardWith(gradient_none_, [](auto* r) {
        for (int i = 0; i < 5; ++i) r->mutable_per_token()->add_values(1);
      }));
  add("backward: per-token NaN", Code::INVALID_ARGUMENT,
      "grad_output[2] = nan is not finite",
      BackwardWith(gradient_none_, [kNaN](auto* r) {
        for (int i = 0; i < kRows; ++i) {
          r->mutable_per_token()->add_values(i == 2 ? kNaN : 1.0f);
        }
      }));
  add("backward: another factor after materialize", Code::FAILED_PRECONDITION,
      "materialized with another grad_output",
      BackwardWith(gradient_materialized_,
                   [](auto* r) { r->set_scalar(3.0); }));
  add("backward: unknown", Code::NOT_FOUND, "unknown handle",
      BackwardWith(unknown_, [](auto* r) { r->set_scalar(1.0); }));
  add("backward: malformed", Code::INVALID_ARGUMENT,
      "gradient: malformed handle",
      BackwardWith(malformed_, [](auto* r) { r->set_scalar(1.0); }));
  add("backward: released", Code::NOT_FOUND, "was released",
      BackwardWith(released_, [](auto* r) { r->set_scalar(1.0); }));
  add("backward: foreign", Code::NOT_FOUND, "belongs to instance",
      BackwardWith(foreign_, [](auto* r) { r->set_scalar(1.0); }));

  // ------------------------------------------------------------ Evaluate
  const pb::EvaluateRequest good =
      EvalHeader(kVocab, pb::DTYPE_FLOAT32, pb::DTYPE_INT32);
  auto with_options = [good](std::function<void(pb::LossOptions*)> mutate) {
    pb::EvaluateRequest request = good;
    mutate(request.mutable_header()->mutable_options());
    return request;
  };
  add("evaluate: empty stream", Code::INVALID_ARGUMENT, "ended before a header",
      EvaluateWith({}));
  add("evaluate: data before header", Code::INVALID_ARGUMENT,
      "data before the header", EvaluateWith({EvalBlock(row, target32), good}));
  add("evaluate: two headers", Code::INVALID_ARGUMENT, "a second header",
      EvaluateWith({good, EvalBlock(row, target32), good}));
  add("evaluate: empty message", Code::INVALID_ARGUMENT,
      "neither header nor block", EvaluateWith({good, pb::EvaluateRequest()}));
  add("evaluate: reduction NONE", Code::INVALID_ARGUMENT,
      "reduction NONE is not allowed", EvaluateWith({with_options([](auto* o) {
        o->set_reduction(pb::REDUCTION_NONE);
      })}));
  add("evaluate: unknown reduction", Code::INVALID_ARGUMENT,
      "unknown reduction 12", EvaluateWith({with_options([](auto* o) {
        o->set_reduction(static_cast<pb::Reduction>(12));
      })}));
  add("evaluate: label_smoothing NaN", Code::INVALID_ARGUMENT,
      "label_smoothing = nan",
      EvaluateWith(
          {with_options([kNaN](auto* o) { o->set_label_smoothing(kNaN); })}));
  add("evaluate: softcap < 0", Code::INVALID_ARGUMENT, "softcap = -3 is < 0",
      EvaluateWith({with_options([](auto* o) { o->set_softcap(-3.0f); })}));
  add("evaluate: vocab 0", Code::INVALID_ARGUMENT, "vocab = 0 must be > 0",
      EvaluateWith({EvalHeader(0, pb::DTYPE_FLOAT32, pb::DTYPE_INT32)}));
  add("evaluate: vocab < 0", Code::INVALID_ARGUMENT, "vocab = -5 must be > 0",
      EvaluateWith({EvalHeader(-5, pb::DTYPE_FLOAT32, pb::DTYPE_INT32)}));
  add("evaluate: row bytes overflow int64", Code::INVALID_ARGUMENT,
      "overflows int64",
      EvaluateWith(
          {EvalHeader(int64_t{1} << 62, pb::DTYPE_FLOAT32, pb::DTYPE_INT32),
           EvalBlock(row, target32)}));
  add("evaluate: int64 max vocab", Code::INVALID_ARGUMENT, "overflows int64",
      EvaluateWith({EvalHeader(kMax, pb::DTYPE_BFLOAT16, pb::DTYPE_INT64),
                    EvalBlock(row, target32)}));
  add("evaluate: missing logits dtype", Code::INVALID_ARGUMENT,
      "header.logits_dtype is DTYPE_UNSPECIFIED; expected one of FLOAT32, "
      "BFLOAT16, FLOAT16",
      EvaluateWith(
          {EvalHeader(kVocab, pb::DTYPE_UNSPECIFIED, pb::DTYPE_INT32)}));
  add("evaluate: int logits", Code::INVALID_ARGUMENT,
      "header.logits_dtype is DTYPE_INT64; expected one of FLOAT32, BFLOAT16, "
      "FLOAT16",
      EvaluateWith({EvalHeader(kVocab, pb::DTYPE_INT64, pb::DTYPE_INT32)}));
  add("evaluate: float targets", Code::INVALID_ARGUMENT,
      "header.targets_dtype is DTYPE_FLOAT16; expected one of INT32, INT64",
      EvaluateWith({EvalHeader(kVocab, pb::DTYPE_FLOAT32, pb::DTYPE_FLOAT16)}));
  add("evaluate: unknown targets dtype", Code::INVALID_ARGUMENT,
      "header.targets_dtype is 6, which is no DType",
      EvaluateWith(
          {EvalHeader(kVocab, pb::DTYPE_FLOAT32, static_cast<pb::DType>(6))}));
  add("evaluate: partial row", Code::INVALID_ARGUMENT,
      "not a whole number of rows",
      EvaluateWith({good, EvalBlock(row + std::string(4, '\0'), target32)}));
  add("evaluate: targets for fewer rows", Code::INVALID_ARGUMENT,
      "2 rows of logits but 4 bytes of targets",
      EvaluateWith({good, EvalBlock(row + row, target32)}));
  add("evaluate: targets without logits", Code::INVALID_ARGUMENT,
      "0 rows of logits but 4 bytes of targets",
      EvaluateWith({good, EvalBlock("", target32)}));
  add("evaluate: no rows", Code::INVALID_ARGUMENT, "no rows at all",
      EvaluateWith({good, EvalBlock("", "")}));
  add("evaluate: target out of range", Code::INVALID_ARGUMENT,
      "targets[1] = 5 is out of range", [this, row, good] {
        std::vector<int32_t> targets = {0, kVocab};
        return Evaluate({good, EvalBlock(row + row, Bytes(targets))});
      });
  add("evaluate: unknown class_weights", Code::NOT_FOUND, "unknown handle",
      [this, with_options] {
        return Evaluate({with_options(
            [this](auto* o) { o->set_class_weights(unknown_); })});
      });
  add("evaluate: class_weights of length V-1", Code::INVALID_ARGUMENT,
      "class_weights must be float32 [5]", [this, with_options] {
        return Evaluate({with_options(
            [this](auto* o) { o->set_class_weights(short_weights_); })});
      });
  // ------------------------------------------------------------ Labels,
  // handles, List pages Labels are bounded on every way into the store; handles
  // are checked for their shape before any lookup; a client's value comes back
  // in a message only as a short prefix (Short fails a row whose message is
  // long).
  const std::string long_label(kMaxLabelBytes + 1, 'L');
  const std::string huge(1 << 20, 'h');
  auto with_label = [](pb::UploadRequest header, std::string label) {
    header.mutable_header()->set_label(std::move(label));
    return header;
  };
  add("labels: 1025-byte label", Code::INVALID_ARGUMENT,
      "header.label has 1025 bytes; at most 1024 are allowed",
      Short(UploadWith(
          {with_label(Header(pb::DTYPE_FLOAT32, {1}), long_label), Chunk(4)})));
  add("labels: 2 MiB label", Code::INVALID_ARGUMENT,
      "header.label has 2097152 bytes",
      Short(UploadWith({with_label(Header(pb::DTYPE_FLOAT32, {1}),
                                   std::string(2 << 20, 'L'))})));
  add("labels: newline in a label", Code::INVALID_ARGUMENT,
      "header.label holds the control character 0x0a at byte 3",
      UploadWith(
          {with_label(Header(pb::DTYPE_FLOAT32, {1}), "abc\ndef"), Chunk(4)}));
  add("labels: a label of 1024 bytes is fine, two headers are not",
      Code::INVALID_ARGUMENT, "a second header",
      UploadWith({with_label(Header(pb::DTYPE_FLOAT32, {1}),
                             std::string(kMaxLabelBytes, 'L')),
                  Chunk(4), Header(pb::DTYPE_FLOAT32, {1})}));
  add("labels: striped upload, label too long", Code::INVALID_ARGUMENT,
      "header.label has 1025 bytes", Short([this, long_label] {
        pb::UploadRequest header = Header(pb::DTYPE_FLOAT32, {2});
        header.mutable_header()->set_label(long_label);
        header.mutable_header()->mutable_stripe()->set_upload_id("long-label");
        header.mutable_header()->mutable_stripe()->set_count(1);
        return Upload({header, Chunk(8)});
      }));
  add("labels: data-connection upload, label too long", Code::INVALID_ARGUMENT,
      "header.label has 1025 bytes", Short([this, long_label] {
        pb::UploadRequest header = Header(pb::DTYPE_FLOAT32, {2});
        header.mutable_header()->set_label(long_label);
        header.mutable_header()->set_data_token(std::string(16, 't'));
        return Upload({header});
      }));
  add("labels: stripes with different long labels", Code::INVALID_ARGUMENT,
      "label 'BBBB", Short([this] {
        auto stripe = [](int index, char fill) {
          pb::UploadRequest header = Header(pb::DTYPE_FLOAT32, {2});
          header.mutable_header()->set_label(std::string(1000, fill));
          header.mutable_header()->mutable_stripe()->set_upload_id("labels");
          header.mutable_header()->mutable_stripe()->set_index(index);
          header.mutable_header()->mutable_stripe()->set_count(2);
          return header;
        };
        grpc::ClientContext first_context;
        pb::UploadResponse first_response;
        auto first = stub_->Upload(&first_context, &first_response);
        const int64_t before = server_->store()->Stats().used_bytes;
        first->Write(stripe(0, 'A'));
        // The first stripe reserves the whole tensor when it attaches.
        EXPECT_TRUE(
            server_->store()->AwaitUsedBytes(before + 8, absl::Seconds(10)));
        const grpc::Status second = Upload({stripe(1, 'B'), Chunk(4)});
        first->WritesDone();
        const grpc::Status aborted = first->Finish();
        EXPECT_EQ(aborted.error_code(), Code::ABORTED);
        EXPECT_LT(aborted.error_message().size(), 1000u);
        return second;
      }));
  add("labels: out-of-place gradient_label too long", Code::INVALID_ARGUMENT,
      "gradient_label has 1025 bytes", Short(ForwardWith([long_label](auto* r) {
        r->set_mode(pb::GRADIENT_MODE_OUT_OF_PLACE);
        r->set_gradient_label(long_label);
      })));
  add("handles: 1 MiB handle (Describe)", Code::INVALID_ARGUMENT,
      "handle: malformed handle 'hhhh",
      Short([this, huge] { return Describe(huge); }));
  add("handles: 7000-byte handle names its size", Code::INVALID_ARGUMENT,
      "...' (7000 bytes)",
      Short([this] { return Describe(std::string(7000, 'x')); }));
  add("handles: not-a-handle is malformed, not another instance's",
      Code::INVALID_ARGUMENT,
      "handle: malformed handle 'not-a-handle'; a handle is 8 "
      "lower-case hex digits",
      [this] { return Describe("not-a-handle"); });
  add("handles: upper-case hex", Code::INVALID_ARGUMENT, "malformed handle",
      [this] {
        std::string upper = unknown_;
        for (char& c : upper) c = static_cast<char>(std::toupper(c));
        return Describe(upper);
      });
  add("handles: one character short", Code::INVALID_ARGUMENT,
      "malformed handle",
      [this] { return Describe(logits_.substr(0, logits_.size() - 1)); });
  add("handles: control bytes are escaped", Code::INVALID_ARGUMENT,
      "malformed handle '\\n\\x01'", [this] { return Describe("\n\x01"); });
  add("handles: 1 MiB handle (Download)", Code::INVALID_ARGUMENT,
      "handle: malformed handle",
      Short([this, huge] { return Download(huge, pb::DTYPE_UNSPECIFIED, 0); }));
  add("handles: 1 MiB handle (Release)", Code::INVALID_ARGUMENT,
      "handle: malformed handle",
      Short([this, huge] { return Release(huge); }));
  add("handles: 1 MiB logits (Forward)", Code::INVALID_ARGUMENT,
      "logits: malformed handle",
      Short(ForwardWith([huge](auto* r) { r->set_logits(huge); })));
  add("handles: malformed targets_handle (Forward)", Code::INVALID_ARGUMENT,
      "targets_handle: malformed handle",
      Short(ForwardWith([huge](auto* r) { r->set_targets_handle(huge); })));
  add("handles: 1 MiB class_weights (Forward)", Code::INVALID_ARGUMENT,
      "options.class_weights: malformed handle",
      Short(ForwardWith(
          [huge](auto* r) { r->mutable_options()->set_class_weights(huge); })));
  add("handles: empty logits (Forward)", Code::INVALID_ARGUMENT,
      "logits: empty handle", ForwardWith([](auto* r) { r->clear_logits(); }));
  add("handles: 1 MiB gradient (Backward)", Code::INVALID_ARGUMENT,
      "gradient: malformed handle",
      Short(BackwardWith(huge, [](auto* r) { r->set_scalar(1.0); })));
  add("handles: malformed class_weights (Evaluate)", Code::INVALID_ARGUMENT,
      "header.options.class_weights: malformed handle",
      Short([this, with_options, huge] {
        return Evaluate(
            {with_options([huge](auto* o) { o->set_class_weights(huge); })});
      }));
  add("list: negative page_size", Code::INVALID_ARGUMENT,
      "page_size = -1 is < 0", [this] {
        pb::ListRequest request;
        request.set_page_size(-1);
        return List(request);
      });
  add("list: made-up page_token", Code::INVALID_ARGUMENT,
      "page_token (12 bytes) is not a next_page_token", [this] {
        pb::ListRequest request;
        request.set_page_token("not-a-token!");
        return List(request);
      });
  add("list: page_token of valid base64 but not ours", Code::INVALID_ARGUMENT,
      "is not a next_page_token", [this] {
        pb::ListRequest request;
        request.set_page_token("bG9zc2QuTGlzdC52MTp4");
        return List(request);
      });
  add("list: 1 MiB page_token", Code::INVALID_ARGUMENT,
      "is not a next_page_token", Short([this, huge] {
        pb::ListRequest request;
        request.set_page_token(huge);
        return List(request);
      }));

  // ----------------------------------------------- upload idempotency keys
  auto keyed = [](pb::UploadRequest header, const std::string& key) {
    header.mutable_header()->set_idempotency_key(key);
    return header;
  };
  add("upload: idempotency_key too long", Code::INVALID_ARGUMENT,
      "idempotency_key must have at most 128 characters, got 129",
      UploadWith({keyed(Header(pb::DTYPE_FLOAT32, {2}), std::string(129, 'k')),
                  Chunk(8)}));
  add("upload: idempotency_key with a space", Code::INVALID_ARGUMENT,
      "idempotency_key may only hold the characters [A-Za-z0-9_-], got ' ' at "
      "position 2",
      UploadWith({keyed(Header(pb::DTYPE_FLOAT32, {2}), "my key"), Chunk(8)}));
  add("stripe: idempotency_key with a control byte", Code::INVALID_ARGUMENT,
      "got '\\x01' at position 0", [this, keyed] {
        pb::UploadRequest header =
            keyed(Header(pb::DTYPE_FLOAT32, {2}), std::string("\x01k"));
        header.mutable_header()->mutable_stripe()->set_upload_id("bad-key");
        header.mutable_header()->mutable_stripe()->set_count(2);
        return Upload({header, Chunk(4)});
      });
  add("upload: idempotency_key of a stored tensor, another shape",
      Code::ALREADY_EXISTS, "(a new upload needs a new key)", [this, keyed] {
        pb::UploadResponse stored;
        EXPECT_TRUE(
            Upload({keyed(Header(pb::DTYPE_FLOAT32, {2}), "taken"), Chunk(8)},
                   &stored)
                .ok());
        const grpc::Status status = Upload(
            {keyed(Header(pb::DTYPE_FLOAT32, {1, 2}), "taken"), Chunk(8)});
        EXPECT_TRUE(Release(stored.tensor().handle()).ok());
        return status;
      });
  add("upload: idempotency_key of an upload in flight", Code::ABORTED,
      "idempotency_key 'busy' is taken by an upload in flight", [this, keyed] {
        const int64_t before = server_->store()->Stats().used_bytes;
        grpc::ClientContext first_context;
        pb::UploadResponse ignored;
        auto first = stub_->Upload(&first_context, &ignored);
        EXPECT_TRUE(
            first->Write(keyed(Header(pb::DTYPE_FLOAT32, {2}), "busy")));
        // Its header has reserved the tensor (and claimed the key).
        EXPECT_TRUE(
            server_->store()->AwaitUsedBytes(before + 8, absl::Seconds(10)));
        const grpc::Status status =
            Upload({keyed(Header(pb::DTYPE_FLOAT32, {2}), "busy"), Chunk(8)});
        first_context.TryCancel();
        first->Finish().ok();
        return status;
      });

  // ------------------------------------------------- unparsable requests
  // Every method of the service, raw handlers included: bytes that are no
  // protobuf message (a tag whose varint never ends).
  const google::protobuf::ServiceDescriptor* service =
      pb::DescribeRequest::descriptor()->file()->FindServiceByName("Lossd");
  for (int i = 0; i < service->method_count(); ++i) {
    const google::protobuf::MethodDescriptor* method = service->method(i);
    const std::string path = "/lossd.v1.Lossd/" + method->name();
    add("unparsable request: " + method->name(), Code::INTERNAL,
        "lossd.v1.Lossd/" + method->name() + ": the request is not a valid " +
            method->input_type()->full_name(),
        [this, path] { return SendRaw(path, std::string(4, '\xff')); });
  }

  // ------------------------------------ Download ranges at the int64 limits
  // offset + length may not fit in int64: the message gives the values as
  // received, never a wrapped sum (and nothing overflows on the way).
  auto ranged = [this](int64_t offset, int64_t length,
                       int64_t chunk_bytes = 0) {
    return [this, offset, length, chunk_bytes] {
      grpc::ClientContext context;
      pb::DownloadRequest request;
      request.set_handle(logits_);
      request.set_offset(offset);
      request.set_length(length);
      request.set_chunk_bytes(chunk_bytes);
      auto reader = stub_->Download(&context, request);
      pb::DownloadResponse response;
      while (reader->Read(&response)) {
      }
      return reader->Finish();
    };
  };
  const int64_t k2p62 = int64_t{1} << 62;
  const int64_t kMin = std::numeric_limits<int64_t>::min();
  add("download: offset 2^62 and length 2^62", Code::OUT_OF_RANGE,
      "offset = 4611686018427387904 and length = 4611686018427387904 are "
      "past the end of the tensor (80 bytes",
      ranged(k2p62, k2p62));
  add("download: offset and length INT64_MAX - 3", Code::OUT_OF_RANGE,
      "offset = 9223372036854775804 and length = 9223372036854775804 are "
      "past the end",
      ranged(kMax - 3, kMax - 3));
  add("download: offset 4, length INT64_MAX - 3", Code::OUT_OF_RANGE,
      "offset = 4 and length = 9223372036854775804 are past the end",
      ranged(4, kMax - 3));
  add("download: offset 2^62 to the end", Code::OUT_OF_RANGE,
      "bytes [4611686018427387904, 4611686018427387904) are past the end",
      ranged(k2p62, 0));
  add("download: length 2^62", Code::OUT_OF_RANGE,
      "bytes [0, 4611686018427387904) are past the end", ranged(0, k2p62));
  add("download: offset INT64_MAX", Code::INVALID_ARGUMENT,
      "offset = 9223372036854775807 and length = 0 must be whole elements",
      ranged(kMax, 0));
  add("download: offset INT64_MIN", Code::INVALID_ARGUMENT,
      "offset = -9223372036854775808 and length = 0 must be >= 0",
      ranged(kMin, 0));
  add("download: length -1", Code::INVALID_ARGUMENT,
      "offset = 0 and length = -1 must be >= 0", ranged(0, -1));
  add("download: length INT64_MIN", Code::INVALID_ARGUMENT,
      "length = -9223372036854775808 must be >= 0", ranged(4, kMin));
  add("download: chunk_bytes INT64_MIN", Code::INVALID_ARGUMENT,
      "chunk_bytes = -9223372036854775808 is outside", ranged(0, 4, kMin));
  add("download: chunk_bytes 2^62", Code::INVALID_ARGUMENT,
      "chunk_bytes = 4611686018427387904 is outside", ranged(0, 4, k2p62));
  add("evaluate: vocab INT64_MAX / 4 (a row of INT64_MAX - 3 bytes)",
      Code::INVALID_ARGUMENT,
      "are not a whole number of rows of "
      "9223372036854775804 bytes",
      EvaluateWith({EvalHeader(kMax / 4, pb::DTYPE_FLOAT32, pb::DTYPE_INT64),
                    EvalBlock(row, target32)}));
  return cases;
}

TEST_F(BadRequestsTest, EachGetsItsCodeAndChangesNothing) {
  SCOPED_TRACE(::testing::Message() << "seed " << seed_);
  const std::vector<Case> cases = Cases();
  EXPECT_GE(cases.size(), 40u);
  const Snapshot initial = Take();
  ASSERT_EQ(initial.tensors, 13);
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
              if (row == 6) EXPECT_EQ(g, 0.0f);
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

}  // namespace
}  // namespace lossd
