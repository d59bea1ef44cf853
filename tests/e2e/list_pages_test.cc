// List pages and what a tensor charges its tenant's quota, against a real
// in-process server on 127.0.0.1:0: paging sees every tensor once, a page
// token opens only where it was made (instance, tenant, page_size) and not
// altered, and labels count against --tenant_max_bytes so they cannot grow
// the host's memory past it.
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
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
  static ServerConfig Config() {
    ServerConfig config;
    config.host = "127.0.0.1";
    config.port = 0;
    config.device = "cpu";
    config.memory_budget = 1 << 20;
    config.threads = 2;
    return config;
  }

  void Start(int64_t tenant_max_bytes) {
    ServerConfig config = Config();
    config.tenant_limits.max_bytes = tenant_max_bytes;
    Start(config);
  }

  void Start(const ServerConfig& config) {
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
    if (!token_.empty())
      context.AddMetadata("authorization", "Bearer " + token_);
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
    if (!token_.empty())
      context.AddMetadata("authorization", "Bearer " + token_);
    return stub_->List(&context, request, response);
  }

  // A List of `page_size` from `page_token`.
  grpc::Status List(int32_t page_size, const std::string& page_token,
                    pb::ListResponse* response = nullptr) {
    pb::ListRequest request;
    request.set_page_size(page_size);
    request.set_page_token(page_token);
    pb::ListResponse ignored;
    return List(request, response != nullptr ? response : &ignored);
  }

  // `count` one-element tensors, then the token after the first of them
  // (a page of one).
  std::string UploadAndTakeAToken(int count) {
    for (int i = 0; i < count; ++i) {
      EXPECT_TRUE(Upload("t" + std::to_string(i)).ok());
    }
    pb::ListResponse first;
    const grpc::Status status = List(1, "", &first);
    EXPECT_TRUE(status.ok()) << status.error_message();
    EXPECT_EQ(first.tensors_size(), 1);
    EXPECT_NE(first.next_page_token(), "");
    return first.next_page_token();
  }

  std::unique_ptr<LossdServer> server_;
  std::unique_ptr<pb::Lossd::Stub> stub_;
  // The bearer token sent, if any.
  std::string token_;
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

// Issue 31: a page token is sealed. Every one-bit change of it, in its text
// or in the bytes it encodes, is refused (an unsigned token let most flips
// through, each read as another place to resume), and the token itself still
// works afterwards. Flipping a character's top bit makes the text invalid
// UTF-8, which no proto3 string holds: that request does not parse, which is
// INTERNAL (api.md) before List sees it.
TEST_F(ListPagesTest, EveryOneBitFlipOfATokenIsRefused) {
  Start(0);
  const std::string token = UploadAndTakeAToken(3);
  ASSERT_FALSE(token.empty());
  std::string raw;
  ASSERT_TRUE(absl::WebSafeBase64Unescape(token, &raw));
  struct Flip {
    std::string token;
    Code code;
  };
  std::vector<Flip> flips;
  for (size_t i = 0; i < token.size(); ++i) {
    for (int bit = 0; bit < 8; ++bit) {
      std::string text = token;
      text[i] = static_cast<char>(text[i] ^ (1 << bit));
      flips.push_back(
          {text, bit == 7 ? Code::INTERNAL : Code::INVALID_ARGUMENT});
    }
  }
  for (size_t i = 0; i < raw.size(); ++i) {
    for (int bit = 0; bit < 8; ++bit) {
      std::string bytes = raw;
      bytes[i] = static_cast<char>(bytes[i] ^ (1 << bit));
      flips.push_back(
          {absl::WebSafeBase64Escape(bytes), Code::INVALID_ARGUMENT});
    }
  }
  int accepted = 0;
  for (const Flip& flip : flips) {
    const grpc::Status status = List(1, flip.token);
    if (status.error_code() != flip.code) {
      ++accepted;
      ADD_FAILURE() << "a flipped token gave " << status.error_code() << " "
                    << status.error_message();
      if (accepted > 5) break;
    } else if (flip.code == Code::INVALID_ARGUMENT) {
      EXPECT_THAT(status.error_message(),
                  HasSubstr("is not a next_page_token of this server's List"));
    } else {
      EXPECT_THAT(status.error_message(), HasSubstr("do not parse"));
    }
  }
  EXPECT_EQ(accepted, 0) << "of " << flips.size();
  pb::ListResponse second;
  ASSERT_TRUE(List(1, token, &second).ok());
  EXPECT_EQ(second.tensors_size(), 1);
  EXPECT_EQ(server_->store()->Stats().tensors, 3);
}

// Cut, padded, doubled or re-encoded tokens are refused too; a token's text
// is opaque and taken only as it was given.
TEST_F(ListPagesTest, AlteredTokenTextIsRefused) {
  Start(0);
  const std::string token = UploadAndTakeAToken(3);
  std::string raw;
  ASSERT_TRUE(absl::WebSafeBase64Unescape(token, &raw));
  const std::vector<std::string> altered = {
      token.substr(0, token.size() - 1),
      token.substr(0, token.size() - 4),
      token.substr(4),
      token + "=",
      token + "AAAA",
      token + token,
      absl::Base64Escape(raw) + "x",
      absl::WebSafeBase64Escape(raw.substr(0, raw.size() - 1)),
      absl::WebSafeBase64Escape(raw + std::string(3, '\0')),
      std::string(token.size(), 'A'),
  };
  for (const std::string& text : altered) {
    EXPECT_EQ(List(1, text).error_code(), Code::INVALID_ARGUMENT) << text;
  }
  EXPECT_TRUE(List(1, token).ok());
}

// A token binds the request's page parameters: the same token with another
// page_size is refused, with its own page_size it works.
TEST_F(ListPagesTest, TokenWithOtherPageSizeIsRefused) {
  Start(0);
  const std::string token = UploadAndTakeAToken(4);
  for (int32_t page_size : {0, 2, 1000, 1001}) {
    const grpc::Status status = List(page_size, token);
    EXPECT_EQ(status.error_code(), Code::INVALID_ARGUMENT) << page_size;
    EXPECT_THAT(status.error_message(), HasSubstr("page_size")) << page_size;
  }
  pb::ListResponse next;
  ASSERT_TRUE(List(1, token, &next).ok());
  EXPECT_EQ(next.tensors_size(), 1);
}

// A token of another lossd instance is refused, naming both instances (an
// unsigned token was accepted there and the listing looked finished, with 0
// tensors); the instance that made it still accepts it.
TEST_F(ListPagesTest, TokenOfAnotherInstanceIsRefused) {
  Start(0);
  const std::string token = UploadAndTakeAToken(3);
  std::unique_ptr<LossdServer> first = std::move(server_);
  std::unique_ptr<pb::Lossd::Stub> first_stub = std::move(stub_);
  Start(0);
  UploadAndTakeAToken(3);
  const grpc::Status status = List(1, token);
  EXPECT_EQ(status.error_code(), Code::INVALID_ARGUMENT);
  EXPECT_THAT(
      status.error_message(),
      HasSubstr("it comes from instance " + first->store()->instance_id() +
                ", this is instance " + server_->store()->instance_id()));
  EXPECT_EQ(server_->store()->Stats().tensors, 3);
  grpc::ClientContext context;
  pb::ListRequest request;
  request.set_page_size(1);
  request.set_page_token(token);
  pb::ListResponse response;
  EXPECT_TRUE(first_stub->List(&context, request, &response).ok());
}

// A token made for one tenant is refused to another, who has tensors of its
// own on the same instance; its own tenant pages on with it.
TEST_F(ListPagesTest, TokenOfAnotherTenantIsRefused) {
  const std::string tokens_file = ::testing::TempDir() + "/list-pages-tokens";
  std::ofstream(tokens_file) << "tok-a alpha\ntok-b beta\n";
  ServerConfig config = Config();
  config.auth.tokens_file = tokens_file;
  Start(config);
  token_ = "tok-a";
  const std::string alphas = UploadAndTakeAToken(3);
  token_ = "tok-b";
  const std::string betas = UploadAndTakeAToken(3);
  const grpc::Status status = List(1, alphas);
  EXPECT_EQ(status.error_code(), Code::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), ::testing::Not(HasSubstr("alpha")));
  pb::ListResponse page;
  ASSERT_TRUE(List(1, betas, &page).ok());
  ASSERT_EQ(page.tensors_size(), 1);
  EXPECT_EQ(page.tensors(0).tenant(), "beta");
  token_ = "tok-a";
  EXPECT_EQ(List(1, betas).error_code(), Code::INVALID_ARGUMENT);
  ASSERT_TRUE(List(1, alphas, &page).ok());
  EXPECT_EQ(page.tensors(0).tenant(), "alpha");
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
