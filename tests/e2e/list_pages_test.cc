// List pages and what a tensor charges its tenant's quota, against a real
// in-process server on 127.0.0.1:0: paging sees every tensor once, and labels
// count against --tenant_max_bytes so they cannot grow the host's memory
// past it.
#include <memory>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "lossd/v1/lossd.grpc.pb.h"
#include "server/server.h"
#include "server/validation.h"

namespace lossd {
namespace {

namespace pb = ::lossd::v1;
using ::testing::HasSubstr;
using Code = grpc::StatusCode;

class ListPagesTest : public ::testing::Test {
 protected:
  void Start(int64_t tenant_max_bytes) {
    ServerConfig config;
    config.host = "127.0.0.1";
    config.port = 0;
    config.device = "cpu";
    config.memory_budget = 1 << 20;
    config.threads = 2;
    config.tenant_limits.max_bytes = tenant_max_bytes;
    auto server = LossdServer::Start(config);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    stub_ = pb::Lossd::NewStub(grpc::CreateChannel(
        server_->address(), grpc::InsecureChannelCredentials()));
  }

  // One float32 element labelled `label`.
  grpc::Status Upload(const std::string& label,
                      pb::UploadResponse* response = nullptr) {
    grpc::ClientContext context;
    pb::UploadResponse ignored;
    auto writer =
        stub_->Upload(&context, response != nullptr ? response : &ignored);
    pb::UploadRequest header;
    header.mutable_header()->set_dtype(pb::DTYPE_FLOAT32);
    header.mutable_header()->add_shape(1);
    header.mutable_header()->set_label(label);
    pb::UploadRequest chunk;
    chunk.set_chunk(std::string(4, '\0'));
    if (writer->Write(header)) writer->Write(chunk);
    writer->WritesDone();
    return writer->Finish();
  }

  grpc::Status List(const pb::ListRequest& request,
                    pb::ListResponse* response) {
    grpc::ClientContext context;
    return stub_->List(&context, request, response);
  }

  std::unique_ptr<LossdServer> server_;
  std::unique_ptr<pb::Lossd::Stub> stub_;
};

// 13 tensors in pages of 5: every tensor once, in the order of one page of
// 1000, with a token on every page but the last.
TEST_F(ListPagesTest, PagingSeesEveryTensorOnce) {
  Start(0);
  std::vector<std::string> uploaded;
  for (int i = 0; i < 13; ++i) {
    pb::UploadResponse response;
    ASSERT_TRUE(Upload("t" + std::to_string(i), &response).ok());
    uploaded.push_back(response.tensor().handle());
  }
  pb::ListRequest whole;
  whole.set_page_size(1000);
  pb::ListResponse all;
  ASSERT_TRUE(List(whole, &all).ok());
  ASSERT_EQ(all.tensors_size(), 13);
  EXPECT_EQ(all.next_page_token(), "");
  pb::ListRequest request;
  request.set_page_size(5);
  std::vector<std::string> handles;
  int pages = 0;
  do {
    pb::ListResponse page;
    const grpc::Status status = List(request, &page);
    ASSERT_TRUE(status.ok()) << status.error_message();
    ++pages;
    EXPECT_LE(page.tensors_size(), 5);
    EXPECT_EQ(page.server().tensors(), 13);
    for (const pb::TensorInfo& info : page.tensors()) {
      handles.push_back(info.handle());
    }
    request.set_page_token(page.next_page_token());
  } while (!request.page_token().empty() && pages < 10);
  EXPECT_EQ(pages, 3);
  ASSERT_EQ(handles.size(), 13u);
  for (int i = 0; i < 13; ++i) EXPECT_EQ(handles[i], all.tensors(i).handle());
  EXPECT_THAT(handles, ::testing::UnorderedElementsAreArray(uploaded));
  // Page size 0 is the default (100): all 13 at once.
  pb::ListResponse defaulted;
  ASSERT_TRUE(List(pb::ListRequest(), &defaulted).ok());
  EXPECT_EQ(defaulted.tensors_size(), 13);
  EXPECT_EQ(defaulted.next_page_token(), "");
}

// The memory attack in miniature: under a 64 KiB tenant quota, one-element
// uploads with labels of the largest size are refused RESOURCE_EXHAUSTED
// once their labels and bookkeeping fill the quota (a tensor used to count
// its 4 bytes only, whatever its label), and a 16 MiB label is refused
// outright.
TEST_F(ListPagesTest, LabelsCountAgainstTheTenantQuota) {
  Start(64 << 10);
  EXPECT_EQ(Upload(std::string(16 << 20, 'L')).error_code(),
            Code::INVALID_ARGUMENT);
  const std::string label(kMaxLabelBytes, 'L');
  const int64_t per_tensor = 4 + kMaxLabelBytes + kTensorBookkeepingBytes;
  const int64_t fit = (64 << 10) / per_tensor;
  for (int64_t i = 0; i < fit; ++i) {
    const grpc::Status status = Upload(label);
    ASSERT_TRUE(status.ok()) << i << ": " << status.error_message();
  }
  const grpc::Status over = Upload(label);
  EXPECT_EQ(over.error_code(), Code::RESOURCE_EXHAUSTED);
  EXPECT_THAT(over.error_message(), HasSubstr("byte quota exceeded"));
  EXPECT_THAT(over.error_message(), HasSubstr("its label's (1024)"));
  EXPECT_EQ(server_->quotas()->UsageOf(kDefaultTenant).bytes, fit * per_tensor);
  // The device budget counts tensor bytes only.
  EXPECT_EQ(server_->store()->Stats().used_bytes, fit * 4);
}

}  // namespace
}  // namespace lossd
