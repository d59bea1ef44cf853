// The bad-request table's fixture: a real in-process server on 127.0.0.1:0
// holding one tensor of every kind, the RPC helpers the cases use, and a
// snapshot of the store that each case must leave exactly as it found it.
#ifndef LOSSD_TESTS_E2E_BAD_REQUESTS_H_
#define LOSSD_TESTS_E2E_BAD_REQUESTS_H_
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
namespace bad_requests {

namespace pb = ::lossd::v1;
using ::lossd::e2e_test::Bytes;
using ::testing::HasSubstr;
using Code = grpc::StatusCode;

// Small enough that an out-of-place gradient of big_ does not fit.
constexpr int64_t kBudget = 1 << 20;
constexpr int64_t kRows = 4;
constexpr int64_t kVocab = 5;
constexpr int64_t kHidden = 3;  // of hidden_ and head_ (LinearForward)

inline unsigned TestSeed() {
  const char* text = std::getenv("LOSSD_TEST_SEED");
  return text != nullptr ? static_cast<unsigned>(std::strtoul(text, nullptr, 0))
                         : 20240601u;
}

inline pb::UploadRequest Header(pb::DType dtype, std::vector<int64_t> shape) {
  pb::UploadRequest request;
  request.mutable_header()->set_dtype(dtype);
  for (int64_t dim : shape) request.mutable_header()->add_shape(dim);
  return request;
}

inline pb::UploadRequest Chunk(size_t bytes) {
  pb::UploadRequest request;
  request.set_chunk(std::string(bytes, '\1'));
  return request;
}

inline pb::EvaluateRequest EvalHeader(int64_t vocab, pb::DType logits_dtype,
                                      pb::DType targets_dtype) {
  pb::EvaluateRequest request;
  request.mutable_header()->set_vocab(vocab);
  request.mutable_header()->set_logits_dtype(logits_dtype);
  request.mutable_header()->set_targets_dtype(targets_dtype);
  return request;
}

inline pb::EvaluateRequest EvalBlock(std::string logits, std::string targets) {
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
inline std::string Diff(const Snapshot& before, const Snapshot& after) {
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
    hidden_ = Put(pb::DTYPE_FLOAT32, {kRows, kHidden},
                  Bytes(random_logits(kRows * kHidden)));
    head_ = Put(pb::DTYPE_FLOAT32, {kVocab, kHidden},
                Bytes(random_logits(kVocab * kHidden)));
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

  // LinearForward on hidden_ and head_ with targets64_, reduction NONE, in
  // place with a new weight accumulator, every token_grad_output 1 unless
  // `mutate` changes it.
  std::function<grpc::Status()> LinearForwardWith(
      std::function<void(pb::LinearForwardRequest*)> mutate) {
    return [this, mutate] {
      pb::LinearForwardRequest request;
      request.set_hidden(hidden_);
      request.set_weight(head_);
      request.set_targets_handle(targets64_);
      request.mutable_options()->set_reduction(pb::REDUCTION_NONE);
      request.set_accumulate(pb::ACCUMULATE_MODE_ADD);
      for (int64_t i = 0; i < kRows; ++i) request.add_token_grad_output(1.0f);
      mutate(&request);
      grpc::ClientContext context;
      pb::LinearForwardResponse response;
      return stub_->LinearForward(&context, request, &response);
    };
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

  // Every case: AddRpcCases (bad_request_rpc_cases.cc), AddLimitCases
  // (bad_request_limit_cases.cc), then AddPostTrainingCases
  // (bad_request_post_training_cases.cc).
  std::vector<Case> Cases();
  // The checks of each RPC's fields, RPC by RPC.
  void AddRpcCases(std::vector<Case>* cases);
  // Values at the limits: labels, handles, List pages, idempotency keys,
  // unparsable messages and int64 ranges.
  void AddLimitCases(std::vector<Case>* cases);
  // Distillation, policy losses and segments in Forward.
  void AddPostTrainingCases(std::vector<Case>* cases);

  const unsigned seed_ = TestSeed();
  std::unique_ptr<LossdServer> server_;
  std::unique_ptr<pb::Lossd::Stub> stub_;
  std::string instance_;
  std::vector<int64_t> targets_values_;
  std::string logits_, big_, targets64_, targets32_, short_targets_,
      float_targets_, weights_, short_weights_, int_weights_, weights_2d_,
      hidden_, head_, gradient_mean_, gradient_none_, gradient_materialized_,
      released_, foreign_, unknown_, malformed_;
};

}  // namespace bad_requests
}  // namespace lossd

#endif  // LOSSD_TESTS_E2E_BAD_REQUESTS_H_
