// The bad-request table at the limits: oversized labels and handles, List
// pages, idempotency keys, unparsable messages, int64 ranges.
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "tests/e2e/bad_requests.h"

namespace lossd {
namespace bad_requests {

void BadRequestsTest::AddLimitCases(std::vector<Case>* cases) {
  auto add = [cases](std::string name, Code code, std::string message,
                     std::function<grpc::Status()> run) {
    cases->push_back(
        {std::move(name), code, std::move(message), std::move(run)});
  };
  const int64_t kMax = std::numeric_limits<int64_t>::max();
  const std::string row(kVocab * 4, '\0');  // one fp32 row of zeros
  const std::string target32(4, '\0');

  // ------------------------------------------ Labels, handles, List pages
  // Labels are bounded on every way into the store; handles
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
      "header.options.class_weights: malformed handle", Short([this, huge] {
        pb::EvaluateRequest request =
            EvalHeader(kVocab, pb::DTYPE_FLOAT32, pb::DTYPE_INT32);
        request.mutable_header()->mutable_options()->set_class_weights(huge);
        return Evaluate({request});
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
  // Issue 31: a page token is sealed to its instance, tenant and page_size
  // (an HMAC); these start from a real one. A flipped bit, a cut, another
  // page_size and the unsigned format of old are all refused.
  auto page_token = [this](int32_t page_size) {
    pb::ListRequest request;
    request.set_page_size(page_size);
    pb::ListResponse response;
    EXPECT_TRUE(List(request, &response).ok());
    EXPECT_NE(response.next_page_token(), "");
    return response.next_page_token();
  };
  auto list_from = [this](int32_t page_size, std::string token) {
    pb::ListRequest request;
    request.set_page_size(page_size);
    request.set_page_token(std::move(token));
    return List(request);
  };
  add("list: page_token with one bit of its position flipped",
      Code::INVALID_ARGUMENT, "is not a next_page_token",
      [page_token, list_from] {
        std::string raw;
        EXPECT_TRUE(absl::WebSafeBase64Unescape(page_token(1), &raw));
        raw[4] = static_cast<char>(raw[4] ^ 0x01);  // the creation time
        return list_from(1, absl::WebSafeBase64Escape(raw));
      });
  add("list: page_token with one bit of its MAC flipped",
      Code::INVALID_ARGUMENT, "is not a next_page_token",
      [page_token, list_from] {
        std::string raw;
        EXPECT_TRUE(absl::WebSafeBase64Unescape(page_token(1), &raw));
        raw.back() = static_cast<char>(raw.back() ^ 0x80);
        return list_from(1, absl::WebSafeBase64Escape(raw));
      });
  add("list: page_token cut by one character", Code::INVALID_ARGUMENT,
      "is not a next_page_token", [page_token, list_from] {
        const std::string token = page_token(1);
        return list_from(1, token.substr(0, token.size() - 1));
      });
  add("list: page_token sent with another page_size", Code::INVALID_ARGUMENT,
      "for this caller and page_size",
      [page_token, list_from] { return list_from(2, page_token(1)); });
  add("list: page_token sent with the default page_size",
      Code::INVALID_ARGUMENT, "for this caller and page_size",
      [page_token, list_from] { return list_from(0, page_token(1)); });
  add("list: unsigned page_token of the old format", Code::INVALID_ARGUMENT,
      "is not a next_page_token", [this, list_from] {
        // "lossd.List.v1:", 8 bytes of creation time, a handle of this
        // instance: what a client could forge before tokens were sealed.
        std::string raw = "lossd.List.v1:" + std::string(8, '\0') + logits_;
        return list_from(1, absl::WebSafeBase64Escape(raw));
      });

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
}

}  // namespace bad_requests
}  // namespace lossd
