// Upload idempotency keys over real gRPC (127.0.0.1:0, two tenants by bearer
// token): a retry gets the tensor its first attempt stored, on a plain,
// striped or data-connection upload; keys are per tenant and live as long as
// their tensor.
#include <cstdint>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "lossd/v1/lossd.grpc.pb.h"
#include "server/server.h"
#include "tests/e2e/bytes.h"

namespace lossd {
namespace {

namespace pb = ::lossd::v1;
using ::lossd::e2e_test::Bytes;
using ::testing::HasSubstr;
using ::testing::Not;
using Code = grpc::StatusCode;

constexpr char kAlpha[] = "token-alpha";
constexpr char kBeta[] = "token-beta";

struct Header {
  std::vector<int64_t> shape = {2, 3};
  std::string label = "logits";
  std::string key;
  std::string upload_id;  // set: a stripe
  int index = 0;
  int count = 1;
  std::string data_token;  // set: over data connections
};

class UploadKeyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string tokens = ::testing::TempDir() + "/upload_key_tokens";
    std::ofstream(tokens) << kAlpha << " alpha\n" << kBeta << " beta\n";
    ServerConfig config;
    config.host = "127.0.0.1";
    config.port = 0;
    config.device = "cpu";
    config.memory_budget = 1 << 20;
    config.threads = 2;
    config.drain_timeout = absl::Seconds(20);
    config.data_port = 0;
    config.auth.tokens_file = tokens;
    auto server = LossdServer::Start(config);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    stub_ = pb::Lossd::NewStub(grpc::CreateChannel(
        server_->address(), grpc::InsecureChannelCredentials()));
  }

  static void Authorize(grpc::ClientContext* context, const char* token) {
    context->AddMetadata("authorization", std::string("Bearer ") + token);
  }

  static pb::UploadRequest HeaderMessage(const Header& header) {
    pb::UploadRequest request;
    pb::TensorHeader* out = request.mutable_header();
    out->set_dtype(pb::DTYPE_FLOAT32);
    for (int64_t dim : header.shape) out->add_shape(dim);
    out->set_label(header.label);
    out->set_idempotency_key(header.key);
    if (!header.upload_id.empty()) {
      out->mutable_stripe()->set_upload_id(header.upload_id);
      out->mutable_stripe()->set_index(header.index);
      out->mutable_stripe()->set_count(header.count);
    }
    if (!header.data_token.empty()) {
      out->set_data_token(header.data_token);
      out->set_data_connections(1);
    }
    return request;
  }

  static int64_t Elements(const Header& header) {
    int64_t elements = 1;
    for (int64_t dim : header.shape) elements *= dim;
    return elements;
  }

  // An upload of `token`'s tenant: the header, then (unless `header_only`)
  // the tensor's bytes (a stripe: its share) as one chunk.
  grpc::Status Upload(const char* token, const Header& header,
                      pb::TensorInfo* info = nullptr,
                      bool header_only = false) {
    grpc::ClientContext context;
    Authorize(&context, token);
    pb::UploadResponse response;
    auto writer = stub_->Upload(&context, &response);
    bool sending = writer->Write(HeaderMessage(header));
    if (sending && !header_only) {
      const int64_t elements = Elements(header);
      const int64_t first = header.index * elements / header.count;
      const int64_t end = (header.index + 1) * elements / header.count;
      pb::UploadRequest chunk;
      chunk.set_chunk(Bytes(std::vector<float>(end - first, 1.5f)));
      sending = writer->Write(chunk);
    }
    if (sending) writer->WritesDone();
    const grpc::Status status = writer->Finish();
    if (info != nullptr) *info = response.tensor();
    return status;
  }

  pb::ListResponse List(const char* token) {
    grpc::ClientContext context;
    Authorize(&context, token);
    pb::ListResponse list;
    EXPECT_TRUE(stub_->List(&context, pb::ListRequest(), &list).ok());
    return list;
  }

  grpc::Status Release(const char* token, const std::string& handle) {
    grpc::ClientContext context;
    Authorize(&context, token);
    pb::ReleaseRequest request;
    request.set_handle(handle);
    pb::ReleaseResponse response;
    return stub_->Release(&context, request, &response);
  }

  std::unique_ptr<LossdServer> server_;
  std::unique_ptr<pb::Lossd::Stub> stub_;
};

TEST_F(UploadKeyTest, ARetryGetsTheFirstTensorAndIsNotCharged) {
  Header header;
  header.key = "3f2a-retry_1";
  pb::TensorInfo first;
  ASSERT_TRUE(Upload(kAlpha, header, &first).ok());
  const int64_t used = server_->store()->Stats().used_bytes;
  pb::TensorInfo again;
  const grpc::Status status = Upload(kAlpha, header, &again);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(again.handle(), first.handle());
  EXPECT_EQ(again.bytes(), first.bytes());
  // Answered at the header: the bytes are not needed again.
  pb::TensorInfo header_only;
  ASSERT_TRUE(Upload(kAlpha, header, &header_only, /*header_only=*/true).ok());
  EXPECT_EQ(header_only.handle(), first.handle());
  EXPECT_EQ(server_->store()->Stats().used_bytes, used);
  EXPECT_EQ(List(kAlpha).tensors_size(), 1);
  // Without a key every upload is a new tensor.
  Header plain;
  pb::TensorInfo one, two;
  ASSERT_TRUE(Upload(kAlpha, plain, &one).ok());
  ASSERT_TRUE(Upload(kAlpha, plain, &two).ok());
  EXPECT_NE(one.handle(), two.handle());
}

TEST_F(UploadKeyTest, TheSameKeyWithAnotherHeaderIsAlreadyExists) {
  Header header;
  header.key = "k";
  pb::TensorInfo first;
  ASSERT_TRUE(Upload(kAlpha, header, &first).ok());
  const int64_t used = server_->store()->Stats().used_bytes;
  Header shape = header;
  shape.shape = {3, 2};
  grpc::Status status = Upload(kAlpha, shape);
  EXPECT_EQ(status.error_code(), Code::ALREADY_EXISTS);
  EXPECT_THAT(status.error_message(), HasSubstr(first.handle()));
  EXPECT_THAT(status.error_message(), HasSubstr("float32 [3, 2]"));
  Header label = header;
  label.label = "other";
  status = Upload(kAlpha, label);
  EXPECT_EQ(status.error_code(), Code::ALREADY_EXISTS);
  EXPECT_THAT(status.error_message(), HasSubstr("label 'other'"));
  EXPECT_EQ(server_->store()->Stats().used_bytes, used);
  EXPECT_EQ(List(kAlpha).tensors_size(), 1);
}

TEST_F(UploadKeyTest, TwoTenantsWithTheSameKeyGetTheirOwnTensors) {
  Header header;
  header.key = "shared-key";
  pb::TensorInfo alpha, beta;
  ASSERT_TRUE(Upload(kAlpha, header, &alpha).ok());
  ASSERT_TRUE(Upload(kBeta, header, &beta).ok());
  EXPECT_NE(alpha.handle(), beta.handle());
  EXPECT_EQ(alpha.tenant(), "alpha");
  EXPECT_EQ(beta.tenant(), "beta");
  // Another header under beta's key conflicts with beta's tensor only.
  Header other = header;
  other.label = "beta's";
  const grpc::Status status = Upload(kBeta, other);
  EXPECT_EQ(status.error_code(), Code::ALREADY_EXISTS);
  EXPECT_THAT(status.error_message(), HasSubstr(beta.handle()));
  EXPECT_THAT(status.error_message(), Not(HasSubstr(alpha.handle())));
  pb::TensorInfo alpha_again;
  ASSERT_TRUE(Upload(kAlpha, header, &alpha_again).ok());
  EXPECT_EQ(alpha_again.handle(), alpha.handle());
  // Beta releasing its tensor leaves alpha's key alone.
  ASSERT_TRUE(Release(kBeta, beta.handle()).ok());
  ASSERT_TRUE(Upload(kAlpha, header, &alpha_again).ok());
  EXPECT_EQ(alpha_again.handle(), alpha.handle());
}

TEST_F(UploadKeyTest, AReleasedTensorTakesItsKeyWithIt) {
  Header header;
  header.key = "k";
  pb::TensorInfo first, second;
  ASSERT_TRUE(Upload(kAlpha, header, &first).ok());
  ASSERT_TRUE(Release(kAlpha, first.handle()).ok());
  ASSERT_TRUE(Upload(kAlpha, header, &second).ok());
  EXPECT_NE(second.handle(), first.handle());
}

TEST_F(UploadKeyTest, AnUploadInFlightHoldsItsKey) {
  Header header;
  header.key = "in-flight";
  grpc::ClientContext context;
  Authorize(&context, kAlpha);
  pb::UploadResponse response;
  auto writer = stub_->Upload(&context, &response);
  ASSERT_TRUE(writer->Write(HeaderMessage(header)));
  // The header has reserved the tensor once used_bytes shows it.
  ASSERT_TRUE(server_->store()->AwaitUsedBytes(
      Elements(header) * static_cast<int64_t>(sizeof(float)),
      absl::Seconds(10)));
  const grpc::Status second = Upload(kAlpha, header);
  EXPECT_EQ(second.error_code(), Code::ABORTED);
  EXPECT_THAT(second.error_message(), HasSubstr("in flight"));
  pb::UploadRequest chunk;
  chunk.set_chunk(Bytes(std::vector<float>(Elements(header), 1.5f)));
  ASSERT_TRUE(writer->Write(chunk));
  writer->WritesDone();
  ASSERT_TRUE(writer->Finish().ok());
  pb::TensorInfo retry;
  ASSERT_TRUE(Upload(kAlpha, header, &retry).ok());
  EXPECT_EQ(retry.handle(), response.tensor().handle());
}

TEST_F(UploadKeyTest, StripedUploadsUseTheKeyToo) {
  Header stripe;
  stripe.key = "striped";
  stripe.upload_id = "first-try";
  stripe.count = 2;
  pb::TensorInfo infos[2];
  {
    // Both stripes at once: the first waits for the second.
    grpc::ClientContext context;
    Authorize(&context, kAlpha);
    pb::UploadResponse response;
    auto writer = stub_->Upload(&context, &response);
    ASSERT_TRUE(writer->Write(HeaderMessage(stripe)));
    const int64_t half = Elements(stripe) / 2;
    pb::UploadRequest chunk;
    chunk.set_chunk(Bytes(std::vector<float>(half, 1.5f)));
    ASSERT_TRUE(writer->Write(chunk));
    writer->WritesDone();
    Header second = stripe;
    second.index = 1;
    ASSERT_TRUE(Upload(kAlpha, second, &infos[1]).ok());
    ASSERT_TRUE(writer->Finish().ok());
    infos[0] = response.tensor();
  }
  EXPECT_EQ(infos[0].handle(), infos[1].handle());
  const int64_t used = server_->store()->Stats().used_bytes;
  // The retry (a new upload_id) gets the same tensor on every stripe.
  Header retry = stripe;
  retry.upload_id = "second-try";
  for (int index = 0; index < 2; ++index) {
    retry.index = index;
    pb::TensorInfo info;
    const grpc::Status status = Upload(kAlpha, retry, &info);
    ASSERT_TRUE(status.ok()) << status.error_message();
    EXPECT_EQ(info.handle(), infos[0].handle());
  }
  EXPECT_EQ(server_->store()->Stats().used_bytes, used);
  EXPECT_EQ(List(kAlpha).tensors_size(), 1);
}

TEST_F(UploadKeyTest, StripesWithDifferentKeysFail) {
  Header stripe;
  stripe.key = "one";
  stripe.upload_id = "mixed";
  stripe.count = 2;
  grpc::ClientContext context;
  Authorize(&context, kAlpha);
  pb::UploadResponse response;
  auto writer = stub_->Upload(&context, &response);
  ASSERT_TRUE(writer->Write(HeaderMessage(stripe)));
  ASSERT_TRUE(server_->store()->AwaitUsedBytes(
      Elements(stripe) * static_cast<int64_t>(sizeof(float)),
      absl::Seconds(10)));
  Header other = stripe;
  other.index = 1;
  other.key = "two";
  const grpc::Status status = Upload(kAlpha, other);
  EXPECT_EQ(status.error_code(), Code::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("idempotency_key 'two'"));
  writer->WritesDone();
  EXPECT_EQ(writer->Finish().error_code(), Code::ABORTED);
  EXPECT_TRUE(server_->store()->AwaitUsedBytes(0, absl::Seconds(10)));
}

TEST_F(UploadKeyTest, ADataConnectionRetryIsAnsweredWithoutItsBytes) {
  Header header;
  header.key = "over-data";
  pb::TensorInfo first;
  ASSERT_TRUE(Upload(kAlpha, header, &first).ok());
  // The retry names data connections but never opens one: the answer comes
  // from the header alone.
  Header retry = header;
  retry.data_token = std::string(16, '\x5a');
  pb::TensorInfo again;
  const grpc::Status status =
      Upload(kAlpha, retry, &again, /*header_only=*/true);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(again.handle(), first.handle());
  EXPECT_EQ(List(kAlpha).tensors_size(), 1);
}

}  // namespace
}  // namespace lossd
