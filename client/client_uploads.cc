// lossd::Client's uploads and overwrites: over the server's data
// connections, over several gRPC streams (stripes) or over one, each sent in
// pieces from an UploadSource.
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "client/client.h"
#include "client/client_internal.h"
#include "client/data_connection.h"
#include "common/raw_messages.h"
#include "common/status_macros.h"
#include "common/tensor_math.h"

namespace lossd {

using client_internal::AwaitConnected;
using client_internal::ConnectionCloser;
using client_internal::FinishAfterData;
using client_internal::FromProto;
using client_internal::kMessageOverheadBytes;
using client_internal::PieceBytes;
using client_internal::PipelinePieces;
using client_internal::PrepareContext;
using client_internal::RunParallel;
using client_internal::ToAbsl;

namespace {

// Upload's and Overwrite's check of the caller's memory against the header.
absl::Status CheckMemory(DType dtype, absl::Span<const int64_t> shape,
                         const void* data, std::size_t bytes) {
  ASSIGN_OR_RETURN(const int64_t expected, TensorBytes(dtype, shape));
  if (static_cast<uint64_t>(expected) != bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(bytes, " bytes given; dtype ", DTypeString(dtype),
                     " and the shape need ", expected));
  }
  if (data == nullptr && bytes > 0) {
    return absl::InvalidArgumentError("null data");
  }
  return absl::OkStatus();
}

// The header of an upload of a tensor of `dtype` and `shape`.
v1::TensorHeader HeaderOf(DType dtype, absl::Span<const int64_t> shape) {
  v1::TensorHeader header;
  header.set_dtype(static_cast<v1::DType>(dtype));
  header.mutable_shape()->Add(shape.begin(), shape.end());
  return header;
}

int64_t ElementBytes(const v1::TensorHeader& header) {
  return static_cast<int64_t>(DTypeSize(static_cast<DType>(header.dtype())));
}

// The caller's memory as the source: every piece is sent from where it lies,
// uncopied.
UploadSource MemorySource(const void* data) {
  const char* base = static_cast<const char*>(data);
  return [base](int64_t offset, std::size_t,
                void*) -> absl::StatusOr<const void*> { return base + offset; };
}

// The pieces of bytes [begin, end) of a tensor from `source`, produced into
// scratch buffers `a` and `b` one ahead of consume(offset, data, bytes,
// in_scratch), where in_scratch says whether `data` lies in a scratch buffer
// (reused for a later piece) or in the source's own memory.
absl::Status ForEachSourcePiece(
    const UploadSource& source, int64_t begin, int64_t end, int64_t piece,
    char* a, char* b,
    const std::function<absl::Status(int64_t, const char*, std::size_t, bool)>&
        consume) {
  const int64_t count = end > begin ? (end - begin + piece - 1) / piece : 0;
  auto offset_of = [&](int64_t k) { return begin + k * piece; };
  auto size_of = [&](int64_t k) {
    return static_cast<std::size_t>(std::min(piece, end - offset_of(k)));
  };
  return PipelinePieces(
      count, a, b,
      [&](int64_t k, char* scratch) -> absl::StatusOr<const void*> {
        absl::StatusOr<const void*> data =
            source(offset_of(k), size_of(k), scratch);
        if (data.ok() && *data == nullptr) {
          return absl::InvalidArgumentError(
              absl::StrCat("the upload source gave no data for bytes [",
                           offset_of(k), ", ", offset_of(k) + piece, ")"));
        }
        return data;
      },
      [&](int64_t k, const void* data) {
        const char* bytes = static_cast<const char*>(data);
        const char* scratch = k % 2 == 0 ? a : b;
        const bool in_scratch =
            bytes >= scratch &&
            bytes < scratch + static_cast<std::size_t>(piece);
        return consume(offset_of(k), bytes, size_of(k), in_scratch);
      });
}

// Sends one Upload stream on `channel` under `context`: `header`, then bytes
// [begin, end) of the tensor from `source` in pieces of `piece` bytes (see
// ForEachSourcePiece; scratch `a` and `b`), each in messages of at most
// `chunk_bytes`, calling `on_sent` with each message's size once it is
// written. Success: the stored tensor's metadata. Errors: the server's
// status; the source's; DATA_LOSS when the server ended the stream OK before
// taking every byte (unless the header has an idempotency key: a retry is
// answered from its header alone).
absl::StatusOr<v1::TensorInfo> SendUpload(
    grpc::Channel* channel, grpc::ClientContext* context,
    const v1::TensorHeader& header, const UploadSource& source, int64_t begin,
    int64_t end, int64_t piece, char* a, char* b, std::size_t chunk_bytes,
    const std::function<void(std::size_t)>& on_sent) {
  // Raw messages: a chunk is sent as its UploadRequest framing followed by a
  // view of the bytes, so nothing copies bytes of the source's own memory
  // before the socket (the generated stub would copy each chunk twice: into
  // the request, then into its serialization); that memory outlives the
  // call, which ends in Finish. Bytes in a scratch buffer, reused for a later
  // piece, are copied into the message.
  const grpc::internal::RpcMethod method(
      "/lossd.v1.Lossd/Upload", grpc::internal::RpcMethod::CLIENT_STREAMING);
  grpc::ByteBuffer raw_response;
  std::unique_ptr<grpc::ClientWriter<grpc::ByteBuffer>> writer(
      grpc::internal::ClientWriterFactory<grpc::ByteBuffer>::Create(
          channel, method, context, &raw_response));
  v1::UploadRequest request;
  *request.mutable_header() = header;
  grpc::ByteBuffer message;
  bool own_buffer = false;
  if (!grpc::SerializationTraits<v1::UploadRequest>::Serialize(
           request, &message, &own_buffer)
           .ok()) {
    return absl::InternalError("cannot serialize the upload header");
  }
  bool sending = writer->Write(message);
  int64_t sent = 0;
  absl::Status produced = absl::OkStatus();
  if (sending) {
    produced = ForEachSourcePiece(
        source, begin, end, piece, a, b,
        [&](int64_t, const char* data, std::size_t bytes, bool in_scratch) {
          for (std::size_t done = 0; done < bytes;) {
            const std::size_t n = std::min(chunk_bytes, bytes - done);
            uint8_t prefix[kMaxChunkPrefixBytes];
            const std::size_t prefix_bytes = EncodeChunkPrefix(n, prefix);
            grpc::Slice slices[2] = {
                grpc::Slice(prefix, prefix_bytes),
                in_scratch
                    ? grpc::Slice(data + done, n)
                    : grpc::Slice(data + done, n, grpc::Slice::STATIC_SLICE)};
            message = grpc::ByteBuffer(slices, 2);
            sending = writer->Write(message);
            // The stream broke: Finish below says why.
            if (!sending) return absl::CancelledError("stream closed");
            done += n;
            sent += static_cast<int64_t>(n);
            on_sent(n);
          }
          return absl::OkStatus();
        });
  }
  // A source error ends the stream unfinished: the server keeps nothing.
  if (!produced.ok() && sending) context->TryCancel();
  if (sending && produced.ok()) writer->WritesDone();
  const grpc::Status finished = writer->Finish();
  if (!produced.ok() && sending) return produced;
  RETURN_IF_ERROR(ToAbsl(finished));
  // A retry under an idempotency key may be answered from its header alone.
  if (sent != end - begin && header.idempotency_key().empty()) {
    return absl::DataLossError(
        absl::StrCat("the server ended the upload after ", sent, " of ",
                     end - begin, " bytes"));
  }
  v1::UploadResponse response;
  if (!grpc::SerializationTraits<v1::UploadResponse>::Deserialize(&raw_response,
                                                                  &response)
           .ok()) {
    return absl::InternalError("a malformed UploadResponse");
  }
  return response.tensor();
}

// A fresh upload_id: 32 hex digits, unique enough that two clients of one
// tenant never pick the same.
std::string RandomUploadId() {
  std::random_device random;
  std::string id;
  static constexpr char kHex[] = "0123456789abcdef";
  for (int i = 0; i < 8; ++i) {
    uint32_t word = random();
    for (int j = 0; j < 4; ++j, word >>= 4) id.push_back(kHex[word & 15]);
  }
  return id;
}

}  // namespace

absl::StatusOr<TensorInfo> Client::Upload(DType dtype,
                                          absl::Span<const int64_t> shape,
                                          const void* data, std::size_t bytes,
                                          const std::string& label,
                                          const ProgressCallback& progress,
                                          const std::string& idempotency_key) {
  RETURN_IF_ERROR(CheckMemory(dtype, shape, data, bytes));
  v1::TensorHeader header = HeaderOf(dtype, shape);
  header.set_label(label);
  header.set_idempotency_key(idempotency_key);
  return UploadPieces(header, bytes, MemorySource(data), progress);
}

absl::StatusOr<TensorInfo> Client::UploadFrom(
    DType dtype, absl::Span<const int64_t> shape, const UploadSource& source,
    const std::string& label, const ProgressCallback& progress,
    const std::string& idempotency_key) {
  ASSIGN_OR_RETURN(const int64_t bytes, TensorBytes(dtype, shape));
  if (!source) return absl::InvalidArgumentError("no upload source");
  v1::TensorHeader header = HeaderOf(dtype, shape);
  header.set_label(label);
  header.set_idempotency_key(idempotency_key);
  return UploadPieces(header, static_cast<std::size_t>(bytes), source,
                      progress);
}

absl::StatusOr<TensorInfo> Client::Overwrite(
    const std::string& handle, DType dtype, absl::Span<const int64_t> shape,
    const void* data, std::size_t bytes, const ProgressCallback& progress) {
  RETURN_IF_ERROR(CheckMemory(dtype, shape, data, bytes));
  return OverwriteFrom(handle, dtype, shape, MemorySource(data), progress);
}

absl::StatusOr<TensorInfo> Client::OverwriteFrom(
    const std::string& handle, DType dtype, absl::Span<const int64_t> shape,
    const UploadSource& source, const ProgressCallback& progress) {
  ASSIGN_OR_RETURN(const int64_t bytes, TensorBytes(dtype, shape));
  if (!source) return absl::InvalidArgumentError("no upload source");
  if (handle.empty()) {
    return absl::InvalidArgumentError("overwrite: empty handle");
  }
  v1::TensorHeader header = HeaderOf(dtype, shape);
  header.set_overwrite_handle(handle);
  return UploadPieces(header, static_cast<std::size_t>(bytes), source,
                      progress);
}

absl::StatusOr<TensorInfo> Client::UploadPieces(
    const v1::TensorHeader& header, std::size_t bytes,
    const UploadSource& source, const ProgressCallback& progress) {
  if (options_.data_connection && bytes >= options_.stripe_min_bytes &&
      bytes > 0) {
    std::optional<absl::StatusOr<TensorInfo>> uploaded =
        UploadOverDataConnection(header, source, bytes, progress);
    if (uploaded.has_value()) return *std::move(uploaded);
  }
  if (options_.upload_streams > 1 && bytes >= options_.stripe_min_bytes &&
      bytes > 0) {
    return UploadStriped(header, source, bytes, options_.upload_streams,
                         progress);
  }
  grpc::ClientContext context;
  PrepareContext(options_, channel_->channel.get(), &context);
  std::size_t sent = 0;
  Channel::Lease scratch(channel_.get(), 2, options_.piece_bytes);
  ASSIGN_OR_RETURN(
      const v1::TensorInfo info,
      SendUpload(channel_->channel.get(), &context, header, source, 0,
                 static_cast<int64_t>(bytes),
                 PieceBytes(options_, ElementBytes(header)), scratch[0],
                 scratch[1], options_.chunk_bytes, [&](std::size_t n) {
                   sent += n;
                   if (progress) {
                     progress(static_cast<int64_t>(sent),
                              static_cast<int64_t>(bytes));
                   }
                 }));
  TensorInfo uploaded = FromProto(info);
  channel_->Remember(uploaded);
  return uploaded;
}

std::optional<absl::StatusOr<TensorInfo>> Client::UploadOverDataConnection(
    const v1::TensorHeader& header, const UploadSource& source,
    std::size_t bytes, const ProgressCallback& progress) {
  std::optional<absl::StatusOr<DataConnections>> opened = OpenDataConnections();
  if (!opened.has_value()) return std::nullopt;
  if (!opened->ok()) return absl::StatusOr<TensorInfo>(opened->status());
  std::vector<int>& fds = (*opened)->fds;
  const std::string& token = (*opened)->token;
  ConnectionCloser closer(&fds);
  const int connections = static_cast<int>(fds.size());
  grpc::ClientContext context;
  PrepareContext(options_, channel_->channel.get(), &context);
  v1::UploadRequest request;
  *request.mutable_header() = header;
  request.mutable_header()->set_data_token(token);
  request.mutable_header()->set_data_connections(connections);
  v1::UploadResponse response;
  std::unique_ptr<grpc::ClientWriter<v1::UploadRequest>> writer =
      channel_->lossd->Upload(&context, &response);
  absl::Status sent = absl::OkStatus();
  if (writer->Write(request) && writer->WritesDone()) {
    const int64_t element_bytes = ElementBytes(header);
    const int64_t elements = static_cast<int64_t>(bytes) / element_bytes;
    const int64_t piece = PieceBytes(options_, element_bytes);
    Channel::Lease scratch(channel_.get(), 2 * connections,
                           options_.piece_bytes);
    absl::Mutex mu;
    int64_t done = 0;
    // A source's error is the upload's: every connection stops at once (the
    // others' sends then fail), and the RPC is cancelled without the grace
    // that a broken connection gets.
    absl::Status source_error;  // guarded by mu
    const UploadSource guarded =
        [&](int64_t offset, std::size_t n,
            void* scratch_buffer) -> absl::StatusOr<const void*> {
      absl::StatusOr<const void*> data = source(offset, n, scratch_buffer);
      if (!data.ok()) {
        absl::MutexLock lock(&mu);
        if (source_error.ok()) source_error = data.status();
        for (int fd : fds) shutdown(fd, SHUT_RDWR);
      }
      return data;
    };
    std::vector<absl::Status> results(fds.size());
    std::vector<std::thread> senders;
    for (int i = 0; i < connections; ++i) {
      senders.emplace_back([&, i] {
        const int fd = fds[static_cast<std::size_t>(i)];
        const ElementRange range = StripeElements(elements, i, connections);
        absl::Status status = SendDataPreamble(fd, token, i);
        if (status.ok()) {
          status = ForEachSourcePiece(
              guarded, range.first * element_bytes, range.end * element_bytes,
              piece, scratch[2 * i], scratch[2 * i + 1],
              [&](int64_t, const char* data, std::size_t n, bool) {
                RETURN_IF_ERROR(SendDataBytes(fd, data, n));
                absl::MutexLock lock(&mu);
                done += static_cast<int64_t>(n);
                if (progress) progress(done, static_cast<int64_t>(bytes));
                return absl::OkStatus();
              });
        }
        if (status.ok()) status = EndDataSending(fd);
        results[static_cast<std::size_t>(i)] = std::move(status);
      });
    }
    for (std::thread& sender : senders) sender.join();
    absl::MutexLock lock(&mu);
    sent = source_error;
    for (const absl::Status& result : results) {
      if (!result.ok() && sent.ok()) sent = result;
    }
    if (!source_error.ok()) context.TryCancel();
  }
  const grpc::Status finished =
      FinishAfterData(&context, !sent.ok(), [&] { return writer->Finish(); });
  closer.Close();
  // A retry under an idempotency key may be answered OK from its header
  // alone, the data connections closed unread.
  const bool answered = finished.ok() && !header.idempotency_key().empty();
  if (!sent.ok() && !answered &&
      (finished.ok() || finished.error_code() == grpc::StatusCode::CANCELLED)) {
    return absl::StatusOr<TensorInfo>(sent);
  }
  if (!finished.ok()) return absl::StatusOr<TensorInfo>(ToAbsl(finished));
  TensorInfo uploaded = FromProto(response.tensor());
  channel_->Remember(uploaded);
  return absl::StatusOr<TensorInfo>(std::move(uploaded));
}

absl::StatusOr<TensorInfo> Client::UploadStriped(
    const v1::TensorHeader& header, const UploadSource& source,
    std::size_t bytes, int stripes, const ProgressCallback& progress) {
  const int64_t element_bytes = ElementBytes(header);
  const int64_t elements = static_cast<int64_t>(bytes) / element_bytes;
  const int64_t piece = PieceBytes(options_, element_bytes);
  Channel::Lease scratch(channel_.get(), 2 * stripes, options_.piece_bytes);
  v1::TensorHeader striped = header;
  striped.mutable_stripe()->set_upload_id(RandomUploadId());
  striped.mutable_stripe()->set_count(stripes);

  std::vector<std::shared_ptr<grpc::Channel>> channels;
  for (int i = 0; i < stripes; ++i) {
    channels.push_back(i == 0 ? channel_->channel
                              : channel_->StripeChannel(target_, i));
  }
  std::vector<absl::StatusOr<v1::TensorInfo>> results(
      static_cast<std::size_t>(stripes), absl::UnknownError("not run"));
  RunParallel(
      stripes, options_, static_cast<int64_t>(bytes), progress,
      [&](int i, grpc::ClientContext* context,
          const std::function<void(int64_t)>& count) {
        const ElementRange range = StripeElements(elements, i, stripes);
        v1::TensorHeader stripe_header = striped;
        stripe_header.mutable_stripe()->set_index(i);
        absl::StatusOr<v1::TensorInfo>& result =
            results[static_cast<std::size_t>(i)];
        if (i > 0) {
          // Not through `result`: an OK status is no StatusOr value.
          const absl::Status connected =
              AwaitConnected(channels[static_cast<std::size_t>(i)].get(), i);
          if (!connected.ok()) {
            result = connected;
            return connected;
          }
        }
        result = SendUpload(
            channels[static_cast<std::size_t>(i)].get(), context, stripe_header,
            source, range.first * element_bytes, range.end * element_bytes,
            piece, scratch[2 * i], scratch[2 * i + 1], options_.chunk_bytes,
            [&](std::size_t n) { count(static_cast<int64_t>(n)); });
        return result.status();
      });

  // The root cause: the first error that is not the others' reaction to it.
  const absl::Status* first_error = nullptr;
  const absl::Status* root_cause = nullptr;
  std::string handle;
  for (const absl::StatusOr<v1::TensorInfo>& result : results) {
    if (result.ok()) {
      if (handle.empty()) handle = result->handle();
      if (result->handle() != handle) {
        return absl::InternalError(
            "the stripes of one upload returned different handles");
      }
      continue;
    }
    if (first_error == nullptr) first_error = &result.status();
    const absl::StatusCode code = result.status().code();
    if (root_cause == nullptr && code != absl::StatusCode::kAborted &&
        code != absl::StatusCode::kCancelled) {
      root_cause = &result.status();
    }
  }
  if (first_error == nullptr) {
    TensorInfo uploaded = FromProto(*results[0]);
    channel_->Remember(uploaded);
    return uploaded;
  }
  // Some stripes finished OK before another failed (a cancellation racing
  // the reply): a new tensor must not stay behind. An overwritten one stays,
  // as any overwrite that fails late leaves it.
  if (!handle.empty() && header.overwrite_handle().empty()) {
    Release(handle).IgnoreError();
  }
  return root_cause != nullptr ? *root_cause : *first_error;
}

}  // namespace lossd
