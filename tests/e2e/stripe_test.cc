// Striped Upload (issue 4): one tensor sent as several Upload streams over
// loopback by hand-driven stripes, with every way a stripe can fail taking the
// whole upload down and leaving the store as it was. (lossd::Client's striped
// path: stripe_client_test.cc.)
#include <cstdint>
#include <cstring>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "lossd/v1/lossd.grpc.pb.h"
#include "server/server.h"
#include "tests/e2e/bytes.h"
#include "tests/e2e/test_server.h"

namespace lossd {
namespace {

namespace pb = ::lossd::v1;
using ::grpc::StatusCode;

constexpr int64_t kBudget = 64 << 20;

using e2e_test::RandomBytes;

// Elements [first, end) of stripe `index` of `count`, as the proto defines.
std::pair<int64_t, int64_t> StripeRange(int64_t elements, int index,
                                        int count) {
  return {index * elements / count, (index + 1) * elements / count};
}

// One stripe driven by hand over its own channel: header, chunks, end.
class RawStripe {
 public:
  RawStripe(const std::string& address, const std::string& token = "")
      : channel_(e2e_test::LargeMessageChannel(address)),
        stub_(pb::Lossd::NewStub(channel_)) {
    if (!token.empty()) {
      context_.AddMetadata("authorization", absl::StrCat("Bearer ", token));
    }
    writer_ = stub_->Upload(&context_, &response_);
  }

  bool Header(pb::DType dtype, const std::vector<int64_t>& shape,
              const std::string& id, int index, int count,
              const std::string& label = "") {
    pb::UploadRequest request;
    pb::TensorHeader* header = request.mutable_header();
    header->set_dtype(dtype);
    for (int64_t dim : shape) header->add_shape(dim);
    header->set_label(label);
    header->mutable_stripe()->set_upload_id(id);
    header->mutable_stripe()->set_index(index);
    header->mutable_stripe()->set_count(count);
    return writer_->Write(request);
  }

  // Sends `bytes` in chunks of `chunk` bytes.
  bool Send(const std::string& bytes, size_t chunk = 1 << 20) {
    for (size_t at = 0; at < bytes.size(); at += chunk) {
      pb::UploadRequest request;
      request.set_chunk(bytes.substr(at, chunk));
      if (!writer_->Write(request)) return false;
    }
    return true;
  }

  void Done() { writer_->WritesDone(); }
  grpc::Status Finish() { return writer_->Finish(); }
  void Cancel() { context_.TryCancel(); }
  const pb::UploadResponse& response() const { return response_; }

 private:
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<pb::Lossd::Stub> stub_;
  grpc::ClientContext context_;
  pb::UploadResponse response_;
  std::unique_ptr<grpc::ClientWriter<pb::UploadRequest>> writer_;
};

class StripeTest : public ::testing::Test {
 protected:
  void Start(absl::Duration stripe_timeout = absl::Seconds(30),
             int64_t budget = kBudget, const std::string& tokens = "",
             const std::string& device = "cpu") {
    ServerConfig config =
        e2e_test::LoopbackConfig(device, budget, absl::Seconds(10));
    config.stripe_timeout = stripe_timeout;
    if (!tokens.empty()) {
      const std::string path = absl::StrCat(
          ::testing::TempDir(), "/stripe-tokens-",
          ::testing::UnitTest::GetInstance()->current_test_info()->name());
      std::ofstream(path) << tokens;
      config.auth.tokens_file = path;
    }
    absl::StatusOr<std::unique_ptr<LossdServer>> server =
        LossdServer::Start(config);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    stub_ =
        pb::Lossd::NewStub(e2e_test::LargeMessageChannel(server_->address()));
  }

  std::string Download(const std::string& handle) {
    grpc::ClientContext context;
    pb::DownloadRequest request;
    request.set_handle(handle);
    std::unique_ptr<grpc::ClientReader<pb::DownloadResponse>> reader =
        stub_->Download(&context, request);
    std::string bytes;
    pb::DownloadResponse response;
    while (reader->Read(&response)) {
      if (response.has_chunk()) bytes += response.chunk();
    }
    const grpc::Status status = reader->Finish();
    EXPECT_TRUE(status.ok()) << status.error_message();
    return bytes;
  }

  // The store holds exactly `tensors` tensors and `bytes` bytes, nothing
  // reserved beyond them (reservations go back as reactors finish).
  void ExpectStore(int64_t tensors, int64_t bytes) {
    EXPECT_TRUE(server_->store()->AwaitUsedBytes(bytes, absl::Seconds(10)))
        << "used " << server_->store()->Stats().used_bytes << ", expected "
        << bytes;
    EXPECT_EQ(server_->store()->Stats().tensors, tensors);
  }

  std::unique_ptr<LossdServer> server_;
  std::unique_ptr<pb::Lossd::Stub> stub_;
};

// Stripes may arrive in any order and interleave their chunks; all of them
// return the same tensor.
TEST_F(StripeTest, ReverseOrderAndInterleavedChunks) {
  Start();
  const int count = 3;
  const std::vector<int64_t> shape = {10, 333};
  const int64_t elements = 10 * 333;
  const std::string data = RandomBytes(elements * 4, 7);
  std::vector<std::unique_ptr<RawStripe>> stripes;
  for (int i = 0; i < count; ++i) {
    stripes.push_back(std::make_unique<RawStripe>(server_->address()));
  }
  for (int i = count - 1; i >= 0; --i) {
    ASSERT_TRUE(
        stripes[i]->Header(pb::DTYPE_FLOAT32, shape, "rev-1", i, count, "x"));
  }
  // 100-byte chunks round robin, so every stripe's writes interleave.
  std::vector<std::string> parts;
  for (int i = 0; i < count; ++i) {
    const auto [first, end] = StripeRange(elements, i, count);
    parts.push_back(data.substr(first * 4, (end - first) * 4));
  }
  for (size_t at = 0;; at += 100) {
    bool any = false;
    for (int i = count - 1; i >= 0; --i) {
      if (at >= parts[i].size()) continue;
      any = true;
      ASSERT_TRUE(stripes[i]->Send(parts[i].substr(at, 100)));
    }
    if (!any) break;
  }
  for (int i = count - 1; i >= 0; --i) stripes[i]->Done();
  std::string handle;
  for (int i = 0; i < count; ++i) {
    const grpc::Status status = stripes[i]->Finish();
    ASSERT_TRUE(status.ok()) << i << ": " << status.error_message();
    if (i == 0) handle = stripes[i]->response().tensor().handle();
    EXPECT_EQ(stripes[i]->response().tensor().handle(), handle);
    EXPECT_EQ(stripes[i]->response().tensor().bytes(), elements * 4);
  }
  EXPECT_EQ(Download(handle), data);
  ExpectStore(1, elements * 4);

  // One stripe of one is an upload too.
  RawStripe single(server_->address());
  ASSERT_TRUE(single.Header(pb::DTYPE_INT32, {3}, "one", 0, 1));
  ASSERT_TRUE(single.Send(data.substr(0, 12)));
  single.Done();
  const grpc::Status status = single.Finish();
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(Download(single.response().tensor().handle()), data.substr(0, 12));
}

// A stripe that never comes: after --stripe_timeout every stripe fails
// ABORTED naming the upload and the missing stripe; the store is as before,
// and a late stripe of that id is refused.
TEST_F(StripeTest, MissingStripeTimesOut) {
  Start(absl::Milliseconds(300));
  // A tensor stored before, which must stay as it is.
  const std::string kept = RandomBytes(4096, 3);
  RawStripe keep(server_->address());
  ASSERT_TRUE(keep.Header(pb::DTYPE_INT32, {1024}, "kept", 0, 1));
  ASSERT_TRUE(keep.Send(kept));
  keep.Done();
  ASSERT_TRUE(keep.Finish().ok());
  const int64_t elements = 3000;
  const std::string data = RandomBytes(elements * 2, 4);
  RawStripe s0(server_->address());
  RawStripe s2(server_->address());
  ASSERT_TRUE(s0.Header(pb::DTYPE_FLOAT16, {elements}, "lost-1", 0, 3));
  ASSERT_TRUE(s2.Header(pb::DTYPE_FLOAT16, {elements}, "lost-1", 2, 3));
  ASSERT_TRUE(s0.Send(data.substr(0, 2000)));
  ASSERT_TRUE(s2.Send(data.substr(4000)));
  s0.Done();
  s2.Done();
  for (RawStripe* stripe : {&s0, &s2}) {
    const grpc::Status status = stripe->Finish();
    EXPECT_EQ(status.error_code(), StatusCode::ABORTED)
        << status.error_message();
    EXPECT_NE(status.error_message().find("lost-1"), std::string::npos)
        << status.error_message();
    EXPECT_NE(status.error_message().find("did not arrive"), std::string::npos)
        << status.error_message();
  }
  ExpectStore(1, 4096);

  RawStripe late(server_->address());
  late.Header(pb::DTYPE_FLOAT16, {elements}, "lost-1", 1, 3);
  late.Send(data.substr(2000, 2000));
  late.Done();
  const grpc::Status status = late.Finish();
  EXPECT_EQ(status.error_code(), StatusCode::ABORTED) << status.error_message();
  EXPECT_NE(status.error_message().find("new upload_id"), std::string::npos)
      << status.error_message();
  ExpectStore(1, 4096);
}

// A stripe whose header contradicts the upload: it fails INVALID_ARGUMENT,
// the stripe already attached ABORTED naming the upload and the cause.
TEST_F(StripeTest, MismatchedShapeFailsEveryStripe) {
  Start();
  RawStripe s0(server_->address());
  RawStripe s1(server_->address());
  ASSERT_TRUE(s0.Header(pb::DTYPE_FLOAT32, {4, 8}, "mismatch", 0, 2));
  // Stripe 0 made the upload before stripe 1 comes.
  ASSERT_TRUE(server_->store()->AwaitUsedBytes(128, absl::Seconds(10)));
  ASSERT_TRUE(s0.Send(RandomBytes(64, 1)));
  s1.Header(pb::DTYPE_FLOAT32, {4, 9}, "mismatch", 1, 2);
  s1.Done();
  const grpc::Status bad = s1.Finish();
  EXPECT_EQ(bad.error_code(), StatusCode::INVALID_ARGUMENT)
      << bad.error_message();
  EXPECT_NE(bad.error_message().find("[4, 9]"), std::string::npos)
      << bad.error_message();
  s0.Done();
  const grpc::Status other = s0.Finish();
  EXPECT_EQ(other.error_code(), StatusCode::ABORTED) << other.error_message();
  EXPECT_NE(other.error_message().find("mismatch"), std::string::npos);
  EXPECT_NE(other.error_message().find("stripe 1: INVALID_ARGUMENT"),
            std::string::npos)
      << other.error_message();
  ExpectStore(0, 0);
}

// The same index twice fails the upload: the duplicate INVALID_ARGUMENT,
// the first holder of the index and the others ABORTED.
TEST_F(StripeTest, DuplicateIndexFailsEveryStripe) {
  Start();
  RawStripe first(server_->address());
  RawStripe other(server_->address());
  RawStripe duplicate(server_->address());
  ASSERT_TRUE(first.Header(pb::DTYPE_INT32, {100}, "dup", 0, 2));
  ASSERT_TRUE(server_->store()->AwaitUsedBytes(400, absl::Seconds(10)));
  ASSERT_TRUE(other.Header(pb::DTYPE_INT32, {100}, "dup", 1, 2));
  ASSERT_TRUE(first.Send(RandomBytes(200, 2)));
  first.Done();
  duplicate.Header(pb::DTYPE_INT32, {100}, "dup", 0, 2);
  duplicate.Done();
  const grpc::Status status = duplicate.Finish();
  EXPECT_EQ(status.error_code(), StatusCode::INVALID_ARGUMENT)
      << status.error_message();
  EXPECT_NE(status.error_message().find("twice"), std::string::npos)
      << status.error_message();
  other.Done();
  for (RawStripe* stripe : {&first, &other}) {
    const grpc::Status aborted = stripe->Finish();
    EXPECT_EQ(aborted.error_code(), StatusCode::ABORTED)
        << aborted.error_message();
    EXPECT_NE(aborted.error_message().find("dup"), std::string::npos);
  }
  ExpectStore(0, 0);
}

// A stripe sending fewer or more bytes than its range fails the upload.
TEST_F(StripeTest, WrongByteCountFailsEveryStripe) {
  Start();
  const int64_t elements = 1001;  // stripes of 500 and 501 elements
  for (int64_t delta : {int64_t{-8}, int64_t{8}}) {
    SCOPED_TRACE(absl::StrCat("delta ", delta));
    const std::string id = absl::StrCat("count", delta < 0 ? "-less" : "-more");
    RawStripe s0(server_->address());
    RawStripe s1(server_->address());
    ASSERT_TRUE(s0.Header(pb::DTYPE_INT64, {elements}, id, 0, 2));
    ASSERT_TRUE(s1.Header(pb::DTYPE_INT64, {elements}, id, 1, 2));
    ASSERT_TRUE(s0.Send(RandomBytes(500 * 8, 5)));
    s0.Done();
    s1.Send(RandomBytes(501 * 8 + delta, 6));
    s1.Done();
    const grpc::Status bad = s1.Finish();
    EXPECT_EQ(bad.error_code(), StatusCode::INVALID_ARGUMENT)
        << bad.error_message();
    EXPECT_NE(bad.error_message().find(delta < 0 ? "fewer" : "more"),
              std::string::npos)
        << bad.error_message();
    const grpc::Status other = s0.Finish();
    EXPECT_EQ(other.error_code(), StatusCode::ABORTED) << other.error_message();
    EXPECT_NE(other.error_message().find(id), std::string::npos);
  }
  ExpectStore(0, 0);
}

// Malformed stripe fields are INVALID_ARGUMENT before anything is reserved.
TEST_F(StripeTest, BadStripeFieldsAreInvalid) {
  Start();
  struct Case {
    std::string id;
    int index;
    int count;
  };
  for (const Case& c : std::vector<Case>{{"ok", 0, 0},
                                         {"ok", 0, 65},
                                         {"ok", 2, 2},
                                         {"ok", -1, 2},
                                         {"", 0, 2},
                                         {"bad id", 0, 2},
                                         {"x/y", 0, 2},
                                         {std::string(65, 'a'), 0, 2}}) {
    RawStripe stripe(server_->address());
    stripe.Header(pb::DTYPE_INT32, {8}, c.id, c.index, c.count);
    stripe.Done();
    const grpc::Status status = stripe.Finish();
    EXPECT_EQ(status.error_code(), StatusCode::INVALID_ARGUMENT)
        << "id '" << c.id << "' " << c.index << "/" << c.count << ": "
        << status.error_message();
  }
  // A bad tensor header in a valid stripe fails the upload it names.
  RawStripe s0(server_->address());
  RawStripe s1(server_->address());
  ASSERT_TRUE(s0.Header(pb::DTYPE_INT32, {8}, "badshape", 0, 2));
  ASSERT_TRUE(server_->store()->AwaitUsedBytes(32, absl::Seconds(10)));
  s1.Header(pb::DTYPE_INT32, {0}, "badshape", 1, 2);
  s1.Done();
  EXPECT_EQ(s1.Finish().error_code(), StatusCode::INVALID_ARGUMENT);
  s0.Done();
  const grpc::Status other = s0.Finish();
  EXPECT_EQ(other.error_code(), StatusCode::ABORTED) << other.error_message();
  ExpectStore(0, 0);
}

// Cancelling one stripe aborts the others, whether they are still sending or
// already waiting for the rest.
TEST_F(StripeTest, CancelledStripeAbortsTheOthers) {
  Start();
  const int64_t elements = 4096;
  for (bool cancel_waiting : {false, true}) {
    SCOPED_TRACE(cancel_waiting ? "cancel a waiting stripe"
                                : "cancel a sending stripe");
    const std::string id = cancel_waiting ? "cancel-w" : "cancel-s";
    RawStripe s0(server_->address());
    RawStripe s1(server_->address());
    RawStripe s2(server_->address());
    ASSERT_TRUE(s1.Header(pb::DTYPE_FLOAT32, {elements}, id, 1, 3));
    // The reservation shows once the first stripe attached.
    ASSERT_TRUE(
        server_->store()->AwaitUsedBytes(elements * 4, absl::Seconds(10)));
    ASSERT_TRUE(s0.Header(pb::DTYPE_FLOAT32, {elements}, id, 0, 3));
    ASSERT_TRUE(s2.Header(pb::DTYPE_FLOAT32, {elements}, id, 2, 3));
    ASSERT_TRUE(s0.Send(RandomBytes(1365 * 4, 8)));
    s0.Done();
    if (cancel_waiting) {
      ASSERT_TRUE(s1.Send(RandomBytes(1365 * 4, 9)));
      s1.Done();
    }
    s1.Cancel();
    EXPECT_EQ(s1.Finish().error_code(), StatusCode::CANCELLED);
    for (RawStripe* stripe : {&s0, &s2}) {
      const grpc::Status status = stripe->Finish();
      EXPECT_EQ(status.error_code(), StatusCode::ABORTED)
          << status.error_message();
      EXPECT_NE(status.error_message().find(id), std::string::npos)
          << status.error_message();
    }
    ExpectStore(0, 0);
  }
}

// The same upload_id of two tenants is two uploads: neither completes the
// other's, and each times out alone.
TEST_F(StripeTest, SameIdOfTwoTenantsDoesNotJoin) {
  Start(absl::Milliseconds(300), kBudget, "token-a alpha\ntoken-b beta\n");
  RawStripe a(server_->address(), "token-a");
  RawStripe b(server_->address(), "token-b");
  ASSERT_TRUE(a.Header(pb::DTYPE_INT32, {10}, "shared", 0, 2));
  ASSERT_TRUE(b.Header(pb::DTYPE_INT32, {10}, "shared", 1, 2));
  ASSERT_TRUE(a.Send(RandomBytes(20, 31)));
  ASSERT_TRUE(b.Send(RandomBytes(20, 32)));
  a.Done();
  b.Done();
  for (RawStripe* stripe : {&a, &b}) {
    const grpc::Status status = stripe->Finish();
    EXPECT_EQ(status.error_code(), StatusCode::ABORTED)
        << status.error_message();
    EXPECT_NE(status.error_message().find("did not arrive"), std::string::npos)
        << status.error_message();
  }
  ExpectStore(0, 0);
}

// A draining server lets stripes join an upload already started, and refuses
// new ones.
TEST_F(StripeTest, DrainingLetsStartedUploadsFinish) {
  Start();
  const std::string data = RandomBytes(800, 41);
  RawStripe s0(server_->address());
  ASSERT_TRUE(s0.Header(pb::DTYPE_INT64, {100}, "drain", 0, 2));
  ASSERT_TRUE(server_->store()->AwaitUsedBytes(800, absl::Seconds(10)));
  server_->service()->StartDraining();
  RawStripe fresh(server_->address());
  fresh.Header(pb::DTYPE_INT64, {100}, "drain-new", 0, 2);
  fresh.Done();
  EXPECT_EQ(fresh.Finish().error_code(), StatusCode::UNAVAILABLE);
  RawStripe s1(server_->address());
  ASSERT_TRUE(s1.Header(pb::DTYPE_INT64, {100}, "drain", 1, 2));
  ASSERT_TRUE(s0.Send(data.substr(0, 400)));
  ASSERT_TRUE(s1.Send(data.substr(400)));
  s0.Done();
  s1.Done();
  for (RawStripe* stripe : {&s0, &s1}) {
    const grpc::Status status = stripe->Finish();
    EXPECT_TRUE(status.ok()) << status.error_message();
  }
  EXPECT_EQ(server_->store()->Stats().tensors, 1);
}

// On the CUDA device each stripe copies into its own range of one device
// buffer through its own staging pair; stripes larger than the 4 MiB staging
// buffers, interleaved, must land intact. Skipped without a GPU.
TEST_F(StripeTest, CudaStripesLandIntact) {
  if (const absl::Status cuda = e2e_test::CudaServerAvailable(); !cuda.ok()) {
    GTEST_SKIP() << "no CUDA device: " << cuda;
  }
  Start(absl::Seconds(30), kBudget, "", "cuda");
  const int count = 3;
  const int64_t elements = (int64_t{13} << 20) / 2 + 5;  // ~13 MiB of bf16
  const std::string data = RandomBytes(elements * 2, 71);
  std::vector<std::unique_ptr<RawStripe>> stripes;
  std::vector<std::string> parts;
  for (int i = 0; i < count; ++i) {
    stripes.push_back(std::make_unique<RawStripe>(server_->address()));
    ASSERT_TRUE(
        stripes[i]->Header(pb::DTYPE_BFLOAT16, {elements}, "cuda-1", i, count));
    const auto [first, end] = StripeRange(elements, i, count);
    parts.push_back(data.substr(first * 2, (end - first) * 2));
  }
  // Odd-sized chunks round robin, so that staging buffers fill unevenly.
  const size_t chunk = (1 << 20) + 333;
  for (size_t at = 0; at < parts[0].size() + chunk; at += chunk) {
    for (int i = 0; i < count; ++i) {
      if (at < parts[i].size()) {
        ASSERT_TRUE(stripes[i]->Send(parts[i].substr(at, chunk), chunk));
      }
    }
  }
  for (int i = 0; i < count; ++i) stripes[i]->Done();
  for (int i = 0; i < count; ++i) {
    const grpc::Status status = stripes[i]->Finish();
    ASSERT_TRUE(status.ok()) << i << ": " << status.error_message();
  }
  EXPECT_EQ(Download(stripes[0]->response().tensor().handle()), data);
}

// Ranged Download: a byte range of the converted output, whole elements only,
// inside the tensor.
TEST_F(StripeTest, RangedDownload) {
  Start();
  const std::string data = RandomBytes(1000 * 4, 51);
  RawStripe upload(server_->address());
  ASSERT_TRUE(upload.Header(pb::DTYPE_INT32, {1000}, "ranged", 0, 1));
  ASSERT_TRUE(upload.Send(data));
  upload.Done();
  ASSERT_TRUE(upload.Finish().ok());
  const std::string handle = upload.response().tensor().handle();

  auto fetch = [&](int64_t offset, int64_t length, grpc::Status* status) {
    grpc::ClientContext context;
    pb::DownloadRequest request;
    request.set_handle(handle);
    request.set_offset(offset);
    request.set_length(length);
    request.set_chunk_bytes(100);
    std::unique_ptr<grpc::ClientReader<pb::DownloadResponse>> reader =
        stub_->Download(&context, request);
    std::string bytes;
    int64_t announced = -1;
    pb::DownloadResponse response;
    while (reader->Read(&response)) {
      if (response.has_header()) announced = response.header().bytes();
      if (response.has_chunk()) bytes += response.chunk();
    }
    *status = reader->Finish();
    if (status->ok()) {
      EXPECT_EQ(announced, static_cast<int64_t>(bytes.size()));
    }
    return bytes;
  };
  grpc::Status status;
  EXPECT_EQ(fetch(0, 0, &status), data);
  EXPECT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(fetch(400, 1200, &status), data.substr(400, 1200));
  EXPECT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(fetch(3996, 0, &status), data.substr(3996));
  EXPECT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(fetch(4000, 0, &status), "");
  EXPECT_TRUE(status.ok()) << status.error_message();
  for (const auto& [offset, length] : std::vector<std::pair<int64_t, int64_t>>{
           {2, 0}, {0, 6}, {-4, 0}, {0, -4}}) {
    fetch(offset, length, &status);
    EXPECT_EQ(status.error_code(), StatusCode::INVALID_ARGUMENT)
        << offset << "+" << length << ": " << status.error_message();
  }
  for (const auto& [offset, length] :
       std::vector<std::pair<int64_t, int64_t>>{{4004, 0}, {3996, 8}}) {
    fetch(offset, length, &status);
    EXPECT_EQ(status.error_code(), StatusCode::OUT_OF_RANGE)
        << offset << "+" << length << ": " << status.error_message();
  }
}

}  // namespace
}  // namespace lossd
