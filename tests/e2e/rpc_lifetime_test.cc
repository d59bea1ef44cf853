// What an RPC holds ends when the RPC returns: once a client has an RPC's
// status, the tensors and memory that RPC used are free for its next RPC
// (a Release frees their bytes at once, used_bytes is back where it was).
// Against a real in-process server on 127.0.0.1:0.
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "lossd/v1/lossd.grpc.pb.h"
#include "server/server.h"
#include "tests/e2e/bytes.h"
#include "tests/e2e/test_server.h"

namespace lossd {
namespace {

namespace pb = ::lossd::v1;
using ::lossd::e2e_test::Bytes;

constexpr int64_t kRows = 64;
constexpr int64_t kVocab = 1000;
// Enough rounds that a lease released late (after the status, in OnDone)
// shows: 33 of 200 did on a loaded machine before it was released early.
constexpr int kRounds = 200;

class RpcLifetimeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* device = std::getenv("LOSSD_TEST_DEVICE");
    auto server = LossdServer::Start(
        e2e_test::LoopbackConfig(device != nullptr ? device : "cpu",
                                 int64_t{64} << 20, absl::Seconds(20)));
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    stub_ =
        pb::Lossd::NewStub(e2e_test::LargeMessageChannel(server_->address()));
  }

  int64_t UsedBytes() {
    grpc::ClientContext context;
    pb::ServerInfo info;
    const grpc::Status status =
        stub_->GetServerInfo(&context, pb::GetServerInfoRequest(), &info);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return info.used_bytes();
  }

  std::string Put(pb::DType dtype, std::vector<int64_t> shape,
                  const std::string& bytes) {
    grpc::ClientContext context;
    pb::UploadResponse response;
    auto writer = stub_->Upload(&context, &response);
    pb::UploadRequest header;
    header.mutable_header()->set_dtype(dtype);
    for (int64_t dim : shape) header.mutable_header()->add_shape(dim);
    writer->Write(header);
    pb::UploadRequest chunk;
    chunk.set_chunk(bytes);
    writer->Write(chunk);
    writer->WritesDone();
    const grpc::Status status = writer->Finish();
    EXPECT_TRUE(status.ok()) << status.error_message();
    return response.tensor().handle();
  }

  grpc::Status Release(const std::string& handle) {
    grpc::ClientContext context;
    pb::ReleaseRequest request;
    request.set_handle(handle);
    pb::ReleaseResponse response;
    return stub_->Release(&context, request, &response);
  }

  std::unique_ptr<LossdServer> server_;
  std::unique_ptr<pb::Lossd::Stub> stub_;
};

TEST_F(RpcLifetimeTest, EvaluateReleasesItsClassWeightsBeforeItReturns) {
  const std::string logits(kRows * kVocab * sizeof(float), '\0');
  std::vector<int32_t> targets(kRows);
  for (int64_t row = 0; row < kRows; ++row) targets[row] = row % kVocab;
  const std::string weights_bytes = Bytes(std::vector<float>(kVocab, 0.5f));
  const int64_t baseline = UsedBytes();
  int late = 0;
  for (int round = 0; round < kRounds; ++round) {
    const std::string weights = Put(pb::DTYPE_FLOAT32, {kVocab}, weights_bytes);
    {
      grpc::ClientContext context;
      pb::EvaluateResponse response;
      auto writer = stub_->Evaluate(&context, &response);
      pb::EvaluateRequest header;
      header.mutable_header()->set_vocab(kVocab);
      header.mutable_header()->set_logits_dtype(pb::DTYPE_FLOAT32);
      header.mutable_header()->set_targets_dtype(pb::DTYPE_INT32);
      header.mutable_header()->mutable_options()->set_class_weights(weights);
      writer->Write(header);
      pb::EvaluateRequest block;
      block.mutable_block()->set_logits(logits);
      block.mutable_block()->set_targets(Bytes(targets));
      writer->Write(block);
      writer->WritesDone();
      const grpc::Status status = writer->Finish();
      ASSERT_TRUE(status.ok()) << status.error_message();
    }
    ASSERT_TRUE(Release(weights).ok());
    if (UsedBytes() != baseline) ++late;
  }
  EXPECT_EQ(late, 0) << late << " of " << kRounds
                     << " rounds still held bytes after both RPCs returned";
  EXPECT_EQ(UsedBytes(), baseline);
}

TEST_F(RpcLifetimeTest, DownloadReleasesItsTensorBeforeItReturns) {
  const std::string bytes = Bytes(std::vector<float>(kRows * kVocab, 1.0f));
  const int64_t baseline = UsedBytes();
  int late = 0;
  for (int round = 0; round < kRounds; ++round) {
    const std::string handle = Put(pb::DTYPE_FLOAT32, {kRows, kVocab}, bytes);
    {
      grpc::ClientContext context;
      pb::DownloadRequest request;
      request.set_handle(handle);
      auto reader = stub_->Download(&context, request);
      pb::DownloadResponse response;
      while (reader->Read(&response)) {
      }
      const grpc::Status status = reader->Finish();
      ASSERT_TRUE(status.ok()) << status.error_message();
    }
    ASSERT_TRUE(Release(handle).ok());
    if (UsedBytes() != baseline) ++late;
  }
  EXPECT_EQ(late, 0) << late << " of " << kRounds
                     << " rounds still held bytes after both RPCs returned";
}

}  // namespace
}  // namespace lossd
