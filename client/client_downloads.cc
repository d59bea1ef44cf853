// lossd::Client's downloads: whole tensors or row ranges, over the server's
// data connections or gRPC streams, delivered as chunks, into a caller's
// buffer or in pieces to a DownloadSink.
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
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
using client_internal::DataConnectionCount;
using client_internal::FinishAfterData;
using client_internal::FromProto;
using client_internal::PieceBytes;
using client_internal::PipelinePieces;
using client_internal::PrepareContext;
using client_internal::RunParallel;
using client_internal::ToAbsl;

namespace {

// Gathers a download's chunks, which need not end on element boundaries,
// into pieces of `piece` bytes for a DownloadSink: the gRPC paths deliver
// what the data connections do. Not thread-safe; one per stream.
class PieceAssembler {
 public:
  PieceAssembler(const DownloadSink& sink, int64_t begin, char* scratch,
                 int64_t piece)
      : sink_(sink), offset_(begin), scratch_(scratch), piece_(piece) {}

  absl::Status Add(const void* data, std::size_t bytes) {
    const char* p = static_cast<const char*>(data);
    while (bytes > 0) {
      const std::size_t n =
          std::min(bytes, static_cast<std::size_t>(piece_ - filled_));
      std::memcpy(scratch_ + filled_, p, n);
      filled_ += static_cast<int64_t>(n);
      p += n;
      bytes -= n;
      if (filled_ == piece_) RETURN_IF_ERROR(Flush());
    }
    return absl::OkStatus();
  }
  absl::Status Flush() {
    if (filled_ == 0) return absl::OkStatus();
    RETURN_IF_ERROR(
        sink_(offset_, scratch_, static_cast<std::size_t>(filled_)));
    offset_ += filled_;
    filled_ = 0;
    return absl::OkStatus();
  }

 private:
  const DownloadSink& sink_;
  int64_t offset_;
  char* const scratch_;
  const int64_t piece_;
  int64_t filled_ = 0;
};

// Runs one Download RPC of `request` on `stub` under `context` (see
// Client::DownloadStream for the callbacks and errors).
absl::Status StreamDownload(
    v1::Lossd::Stub* stub, grpc::ClientContext* context,
    const v1::DownloadRequest& request,
    const std::function<absl::Status(const TensorInfo&)>& on_header,
    const std::function<absl::Status(const void*, std::size_t)>& on_chunk,
    const ProgressCallback& progress) {
  std::unique_ptr<grpc::ClientReader<v1::DownloadResponse>> reader =
      stub->Download(context, request);

  // The first error seen locally; the RPC is cancelled and drained after it.
  absl::Status local;
  bool have_header = false;
  int64_t expected = 0;
  int64_t received = 0;
  v1::DownloadResponse response;
  while (local.ok() && reader->Read(&response)) {
    if (response.has_header()) {
      if (have_header) {
        local = absl::DataLossError("the server sent a second header");
        break;
      }
      have_header = true;
      expected = response.header().bytes();
      local = on_header(FromProto(response.header()));
      continue;
    }
    if (!have_header) {
      local = absl::DataLossError("the server sent data before the header");
      break;
    }
    const std::string& chunk = response.chunk();
    if (static_cast<int64_t>(chunk.size()) > expected - received) {
      local = absl::DataLossError(absl::StrCat("the server sent more than the ",
                                               expected,
                                               " bytes its header announced"));
      break;
    }
    local = on_chunk(chunk.data(), chunk.size());
    received += static_cast<int64_t>(chunk.size());
    if (local.ok() && progress) progress(received, expected);
  }
  if (!local.ok()) {
    context->TryCancel();
    while (reader->Read(&response)) {
    }
    reader->Finish().ok();  // the local error is what matters now
    return local;
  }
  RETURN_IF_ERROR(ToAbsl(reader->Finish()));
  if (!have_header) {
    return absl::DataLossError("the server sent no header");
  }
  if (received != expected) {
    return absl::DataLossError(
        absl::StrCat("the server sent ", received, " of ", expected, " bytes"));
  }
  return absl::OkStatus();
}

// Receives stripe i of `elements` elements of `element_bytes` over
// connection fds[i] of `connections`: straight into `base`, or (base null)
// piece by piece through `*sink`, connection i using scratch(2i) and
// scratch(2i + 1) (`piece` bytes each) so that receiving piece k + 1
// overlaps the sink's work on piece k. The sink's error (then
// *sink_failed is set), else the first connection's; a sink error stops
// every connection at once.
absl::Status ReceiveStripes(const std::vector<int>& fds, int connections,
                            int64_t elements, int64_t element_bytes,
                            int64_t piece, uint8_t* base,
                            const DownloadSink* sink,
                            const std::function<char*(int)>& scratch,
                            int64_t total, const ProgressCallback& progress,
                            bool* sink_failed) {
  absl::Mutex mu;
  int64_t done = 0;
  absl::Status sink_error;  // guarded by mu
  const std::function<void(std::size_t)> count = [&](std::size_t n) {
    absl::MutexLock lock(&mu);
    done += static_cast<int64_t>(n);
    if (progress) progress(done, total);
  };
  std::vector<absl::Status> results(fds.size());
  std::vector<std::thread> receivers;
  for (int i = 0; i < connections; ++i) {
    receivers.emplace_back([&, i] {
      const int fd = fds[static_cast<std::size_t>(i)];
      const ElementRange range = StripeElements(elements, i, connections);
      const int64_t begin = range.first * element_bytes;
      const int64_t end = range.end * element_bytes;
      absl::Status& result = results[static_cast<std::size_t>(i)];
      if (base != nullptr) {
        result = ReceiveOverDataConnection(
            fd, reinterpret_cast<char*>(base) + begin,
            static_cast<std::size_t>(end - begin), count);
        return;
      }
      auto size_of = [&](int64_t k) {
        return static_cast<std::size_t>(
            std::min(piece, end - begin - k * piece));
      };
      result = PipelinePieces(
          (end - begin + piece - 1) / piece, scratch(2 * i), scratch(2 * i + 1),
          [&](int64_t k, char* buffer) -> absl::StatusOr<const void*> {
            RETURN_IF_ERROR(
                ReceiveOverDataConnection(fd, buffer, size_of(k), count));
            return buffer;
          },
          [&](int64_t k, const void* data) {
            absl::Status sunk = (*sink)(begin + k * piece, data, size_of(k));
            if (!sunk.ok()) {
              // The sink's error is the download's; the other connections
              // stop at once (their receives then fail).
              absl::MutexLock lock(&mu);
              if (sink_error.ok()) sink_error = sunk;
              for (int open : fds) shutdown(open, SHUT_RDWR);
            }
            return sunk;
          });
    });
  }
  for (std::thread& receiver : receivers) receiver.join();
  absl::MutexLock lock(&mu);
  absl::Status failed = sink_error;
  *sink_failed = !sink_error.ok();
  for (const absl::Status& result : results) {
    if (!result.ok() && failed.ok()) failed = result;
  }
  return failed;
}

// What the streams of a ranged download share: the request's fields, where
// the bytes go, and what the streams report back.
struct RangedDownload {
  const std::string& handle;
  DType as_dtype;
  int64_t chunk_bytes;
  int64_t elements;
  int64_t element_bytes;
  int streams;
  int64_t total;
  uint8_t* base;             // null: through sink
  const DownloadSink* sink;  // with a scratch buffer of `piece` bytes each
  std::function<char*(int)> scratch;
  int64_t piece;

  absl::Mutex mu = {};
  TensorInfo first_header = {};  // guarded by mu
  // A server older than ranged Download ignores offset and length and
  // announces the whole tensor: then fetch it as one stream instead.
  std::atomic<bool> no_ranges{false};
};

// Range i (not empty) of `download`'s streams, on `stub` under `context`;
// `count` is told of each chunk's bytes.
absl::Status DownloadRange(RangedDownload* download, int i,
                           v1::Lossd::Stub* stub, grpc::ClientContext* context,
                           const std::function<void(int64_t)>& count) {
  const ElementRange range =
      StripeElements(download->elements, i, download->streams);
  const int64_t offset = range.first * download->element_bytes;
  const int64_t length = (range.end - range.first) * download->element_bytes;
  v1::DownloadRequest request;
  request.set_handle(download->handle);
  request.set_dtype(static_cast<v1::DType>(download->as_dtype));
  request.set_chunk_bytes(download->chunk_bytes);
  request.set_offset(offset);
  request.set_length(length);
  int64_t written = 0;
  std::optional<PieceAssembler> pieces;
  if (download->base == nullptr) {
    pieces.emplace(*download->sink, offset, download->scratch(i),
                   download->piece);
  }
  RETURN_IF_ERROR(StreamDownload(
      stub, context, request,
      [&](const TensorInfo& header) {
        if (header.bytes == download->total) {
          download->no_ranges = true;
          return absl::FailedPreconditionError(
              "the server has no ranged Download");
        }
        if (header.bytes != length) {
          return absl::DataLossError(
              absl::StrCat("asked for bytes [", offset, ", ", offset + length,
                           "), the server announced ", header.bytes));
        }
        if (i == 0) {
          absl::MutexLock lock(&download->mu);
          download->first_header = header;
        }
        return absl::OkStatus();
      },
      [&](const void* data, std::size_t bytes) {
        // StreamDownload never passes more than the header's count.
        if (pieces.has_value()) {
          RETURN_IF_ERROR(pieces->Add(data, bytes));
        } else {
          std::memcpy(download->base + offset + written, data, bytes);
        }
        written += static_cast<int64_t>(bytes);
        count(static_cast<int64_t>(bytes));
        return absl::OkStatus();
      },
      nullptr));
  return pieces.has_value() ? pieces->Flush() : absl::OkStatus();
}

}  // namespace

absl::Status Client::DownloadStream(
    const std::string& handle, DType as_dtype,
    const std::function<absl::Status(const TensorInfo&)>& on_header,
    const std::function<absl::Status(const void*, std::size_t)>& on_chunk,
    const ProgressCallback& progress) {
  grpc::ClientContext context;
  PrepareContext(options_, channel_->channel.get(), &context);
  v1::DownloadRequest request;
  request.set_handle(handle);
  request.set_dtype(static_cast<v1::DType>(as_dtype));
  request.set_chunk_bytes(static_cast<int64_t>(options_.chunk_bytes));
  return StreamDownload(channel_->lossd.get(), &context, request, on_header,
                        on_chunk, progress);
}

std::optional<absl::StatusOr<TensorInfo>> Client::DownloadOverDataConnections(
    const std::string& handle, DType as_dtype, const Destination& destination,
    uint8_t* base, int64_t total, int64_t element_bytes,
    const ProgressCallback& progress) {
  const std::optional<DataTarget> target = FindDataTarget();
  if (!target.has_value()) return std::nullopt;
  const absl::StatusOr<std::string> drawn = RandomDataToken();
  if (!drawn.ok()) return absl::StatusOr<TensorInfo>(drawn.status());
  const std::string& token = *drawn;
  const int connections = DataConnectionCount(options_);
  grpc::ClientContext context;
  PrepareContext(options_, channel_->channel.get(), &context);
  v1::DownloadRequest request;
  request.set_handle(handle);
  request.set_dtype(static_cast<v1::DType>(as_dtype));
  request.set_data_token(token);
  request.set_data_connections(connections);
  std::unique_ptr<grpc::ClientReader<v1::DownloadResponse>> reader =
      channel_->lossd->Download(&context, request);
  // The header comes once the server registered the transfer; only then are
  // the connections made, and they announce themselves at once (the server
  // gives a silent connection little time).
  v1::DownloadResponse header;
  std::vector<int> fds;
  ConnectionCloser closer(&fds);
  absl::Status failed;
  bool received = false;
  // The client's own finding, not the server's: a header that is not what
  // was asked for, or the caller's refusal of it or of a piece (the server
  // then reports the connections the client closed).
  bool mismatch = false;
  bool unreachable = false;  // no data connection: ranges over gRPC instead
  if (reader->Read(&header) && header.has_header()) {
    if (header.header().bytes() != total) {
      mismatch = true;
      failed = absl::DataLossError(absl::StrCat("the server announced ",
                                                header.header().bytes(),
                                                " bytes; expected ", total));
    } else if (destination.on_header != nullptr &&
               !(failed = (*destination.on_header)(FromProto(header.header())))
                    .ok()) {
      mismatch = true;  // the caller's refusal ends the transfer here too
    } else if (std::optional<std::vector<int>> opened =
                   ConnectData(*target, connections);
               opened.has_value()) {
      fds = *std::move(opened);
    } else {
      unreachable = true;
    }
    for (int i = 0; i < static_cast<int>(fds.size()) && failed.ok(); ++i) {
      failed = SendOverDataConnection(fds[static_cast<std::size_t>(i)], token,
                                      i, nullptr, 0, nullptr);
    }
    if (failed.ok() && !unreachable) {
      std::optional<Channel::Lease> scratch;
      if (base == nullptr) {
        scratch.emplace(channel_.get(), 2 * connections, options_.piece_bytes);
      }
      failed = ReceiveStripes(
          fds, connections, total / element_bytes, element_bytes,
          PieceBytes(options_, element_bytes), base, destination.sink,
          [&scratch](int i) { return (*scratch)[i]; }, total, progress,
          &mismatch);
      received = true;
    }
  }
  // A failed transfer's connections go first: a server still sending on
  // them stops at once. A transfer that cannot go on (a header that is not
  // what was asked for, no connection to be had) ends its RPC here.
  if (!failed.ok()) closer.Close();
  if (mismatch || unreachable) context.TryCancel();
  const grpc::Status finished = FinishAfterData(&context, !failed.ok(), [&] {
    v1::DownloadResponse rest;
    while (reader->Read(&rest)) {
    }
    return reader->Finish();
  });
  closer.Close();
  if (unreachable) return std::nullopt;
  if (mismatch) return absl::StatusOr<TensorInfo>(failed);
  if (!finished.ok() &&
      !(finished.error_code() == grpc::StatusCode::CANCELLED && !failed.ok())) {
    return absl::StatusOr<TensorInfo>(ToAbsl(finished));
  }
  if (!failed.ok()) return absl::StatusOr<TensorInfo>(failed);
  if (!received) {
    return absl::StatusOr<TensorInfo>(
        absl::InternalError("the download ended without its header"));
  }
  TensorInfo info = FromProto(header.header());
  return absl::StatusOr<TensorInfo>(std::move(info));
}

absl::StatusOr<bool> Client::DownloadInRanges(
    const std::string& handle, DType as_dtype, const Destination& destination,
    TensorInfo* info, const ProgressCallback& progress) {
  std::vector<uint8_t>* const vector = destination.vector;
  const int streams = options_.upload_streams;
  if (streams < 2 && !options_.data_connection) return false;
  std::optional<Channel::Shape> known = channel_->Known(handle);
  if (!known.has_value()) {
    ASSIGN_OR_RETURN(const TensorInfo described, Describe(handle));
    known = Channel::Shape{described.dtype, described.shape};
  }
  const DType sent = as_dtype == DType::kInvalid ? known->dtype : as_dtype;
  const int64_t element_bytes = static_cast<int64_t>(DTypeSize(sent));
  int64_t elements = 1;
  for (int64_t dim : known->dims) elements *= dim;
  const int64_t total = elements * element_bytes;
  if (element_bytes <= 0 || elements < 2 ||
      static_cast<uint64_t>(total) < options_.stripe_min_bytes) {
    return false;
  }
  uint8_t* base = nullptr;  // null: through destination.sink
  if (vector != nullptr) {
    vector->resize(static_cast<std::size_t>(total));
    base = vector->data();
  } else if (destination.sink == nullptr) {
    if (static_cast<uint64_t>(total) > destination.capacity) {
      return absl::OutOfRangeError(absl::StrCat("the tensor has ", total,
                                                " bytes; the buffer holds ",
                                                destination.capacity));
    }
    base = static_cast<uint8_t*>(destination.buffer);
  }
  if (options_.data_connection) {
    std::optional<absl::StatusOr<TensorInfo>> fetched =
        DownloadOverDataConnections(handle, as_dtype, destination, base, total,
                                    element_bytes, progress);
    if (fetched.has_value()) {
      if (!fetched->ok()) return fetched->status();
      *info = **fetched;
      return true;
    }
  }
  if (streams < 2) {
    // One stream after all: the caller fills the vector from empty.
    if (vector != nullptr) vector->clear();
    return false;
  }

  if (destination.on_header != nullptr) {
    // The ranges' headers announce their own lengths: the caller is told of
    // the whole tensor as this client knows it.
    TensorInfo whole;
    whole.handle = handle;
    whole.dtype = sent;
    whole.shape = known->dims;
    whole.bytes = total;
    RETURN_IF_ERROR((*destination.on_header)(whole));
  }
  std::optional<Channel::Lease> scratch;
  if (base == nullptr) {
    scratch.emplace(channel_.get(), streams, options_.piece_bytes);
  }
  RangedDownload download{handle,
                          as_dtype,
                          static_cast<int64_t>(options_.chunk_bytes),
                          elements,
                          element_bytes,
                          streams,
                          total,
                          base,
                          destination.sink,
                          [&scratch](int i) { return (*scratch)[i]; },
                          PieceBytes(options_, element_bytes)};
  const std::vector<absl::Status> results = RunParallel(
      streams, options_, total, progress,
      [&](int i, grpc::ClientContext* context,
          const std::function<void(int64_t)>& count) {
        const ElementRange range = StripeElements(elements, i, streams);
        // An empty range is nothing to fetch (length 0 would mean "to the
        // end").
        if (range.end == range.first) return absl::OkStatus();
        const std::shared_ptr<grpc::Channel> channel =
            i == 0 ? channel_->channel : channel_->StripeChannel(target_, i);
        if (i > 0) RETURN_IF_ERROR(AwaitConnected(channel.get(), i));
        std::unique_ptr<v1::Lossd::Stub> stub = v1::Lossd::NewStub(channel);
        return DownloadRange(&download, i, stub.get(), context, count);
      });
  if (download.no_ranges) {
    if (vector != nullptr) vector->clear();
    return false;
  }
  const absl::Status* first_error = nullptr;
  for (const absl::Status& status : results) {
    if (status.ok()) continue;
    if (first_error == nullptr) first_error = &status;
    if (status.code() != absl::StatusCode::kCancelled) return status;
  }
  if (first_error != nullptr) return *first_error;
  absl::MutexLock lock(&download.mu);
  *info = download.first_header;
  info->bytes = total;
  return true;
}

absl::StatusOr<DownloadedTensor> Client::Download(
    const std::string& handle, DType as_dtype,
    const ProgressCallback& progress) {
  DownloadedTensor out;
  Destination destination;
  destination.vector = &out.data;
  ASSIGN_OR_RETURN(
      const bool ranged,
      DownloadInRanges(handle, as_dtype, destination, &out.info, progress));
  if (ranged) return out;
  RETURN_IF_ERROR(DownloadStream(
      handle, as_dtype,
      [&out](const TensorInfo& info) {
        if (info.bytes < 0) {
          return absl::DataLossError("negative byte count in header");
        }
        out.info = info;
        out.data.reserve(static_cast<std::size_t>(info.bytes));
        return absl::OkStatus();
      },
      [&out](const void* data, std::size_t bytes) {
        const uint8_t* p = static_cast<const uint8_t*>(data);
        out.data.insert(out.data.end(), p, p + bytes);
        return absl::OkStatus();
      },
      progress));
  return out;
}

absl::StatusOr<TensorInfo> Client::DownloadInto(
    const std::string& handle, DType as_dtype, void* buffer,
    std::size_t capacity, const ProgressCallback& progress) {
  TensorInfo ranged_info;
  Destination destination;
  destination.buffer = buffer;
  destination.capacity = capacity;
  ASSIGN_OR_RETURN(
      const bool ranged,
      DownloadInRanges(handle, as_dtype, destination, &ranged_info, progress));
  if (ranged) return ranged_info;
  TensorInfo info;
  std::size_t written = 0;
  RETURN_IF_ERROR(DownloadStream(
      handle, as_dtype,
      [&info, capacity](const TensorInfo& header) {
        if (header.bytes < 0 ||
            static_cast<uint64_t>(header.bytes) > capacity) {
          return absl::OutOfRangeError(
              absl::StrCat("the tensor has ", header.bytes,
                           " bytes; the buffer holds ", capacity));
        }
        info = header;
        return absl::OkStatus();
      },
      [buffer, &written](const void* data, std::size_t bytes) {
        // DownloadStream never passes more than the header's byte count.
        std::copy_n(static_cast<const uint8_t*>(data), bytes,
                    static_cast<uint8_t*>(buffer) + written);
        written += bytes;
        return absl::OkStatus();
      },
      progress));
  return info;
}

absl::StatusOr<TensorInfo> Client::DownloadTo(
    const std::string& handle, DType as_dtype,
    const std::function<absl::Status(const TensorInfo&)>& on_header,
    const DownloadSink& sink, const ProgressCallback& progress) {
  if (!sink) return absl::InvalidArgumentError("no download sink");
  // Once only, also when the ranges fall back to one stream.
  bool announced = false;
  const std::function<absl::Status(const TensorInfo&)> announce =
      [&](const TensorInfo& info) {
        if (announced || !on_header) return absl::OkStatus();
        announced = true;
        return on_header(info);
      };
  TensorInfo info;
  Destination destination;
  destination.sink = &sink;
  destination.on_header = &announce;
  ASSIGN_OR_RETURN(
      const bool ranged,
      DownloadInRanges(handle, as_dtype, destination, &info, progress));
  if (ranged) return info;
  Channel::Lease scratch(channel_.get(), 1, options_.piece_bytes);
  std::optional<PieceAssembler> pieces;
  RETURN_IF_ERROR(DownloadStream(
      handle, as_dtype,
      [&](const TensorInfo& header) {
        info = header;
        const int64_t element_bytes =
            std::max<int64_t>(1, DTypeSize(header.dtype));
        pieces.emplace(sink, 0, scratch[0],
                       PieceBytes(options_, element_bytes));
        return announce(header);
      },
      [&](const void* data, std::size_t bytes) {
        return pieces->Add(data, bytes);
      },
      progress));
  if (pieces.has_value()) RETURN_IF_ERROR(pieces->Flush());
  return info;
}

}  // namespace lossd
