// Implementation of lossd::Client over the generated lossd.v1 stubs: the one
// place where gRPC status codes become absl ones, and where plain C++ structs
// are translated to and from the protobuf messages.
#include "client/client.h"

#include <grpcpp/grpcpp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <deque>
#include <fstream>
#include <limits>
#include <optional>
#include <random>
#include <sstream>
#include <thread>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "client/data_connection.h"
#include "common/files.h"
#include "common/raw_messages.h"
#include "common/status_macros.h"
#include "common/tensor_math.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "lossd/v1/lossd.grpc.pb.h"

namespace lossd {

namespace v1 = ::lossd::v1;
namespace health = ::grpc::health::v1;

struct Client::Channel {
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Lossd::Stub> lossd;
  std::unique_ptr<health::Health::Stub> health;
  // What made `channel`, for the extra connections of striped uploads.
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  bool tls = false;
  grpc::ChannelArguments args;

  // Connection `index` (>= 1) of a striped upload to `target`, made on first
  // use and kept; connection 0 is `channel`. Thread-safe.
  std::shared_ptr<grpc::Channel> StripeChannel(const std::string& target,
                                               int index)
      ABSL_LOCKS_EXCLUDED(mu) {
    absl::MutexLock lock(&mu);
    while (static_cast<int>(stripe_channels.size()) < index) {
      grpc::ChannelArguments stripe_args = args;
      // Each channel has its own subchannel pool (the arguments say so), so
      // each is its own TCP connection; the distinct argument keeps that
      // true should the pool ever be shared again.
      stripe_args.SetInt("lossd.upload_stripe",
                         static_cast<int>(stripe_channels.size()) + 1);
      stripe_channels.push_back(
          grpc::CreateCustomChannel(target, credentials, stripe_args));
    }
    return stripe_channels[static_cast<std::size_t>(index - 1)];
  }

  absl::Mutex mu;
  std::vector<std::shared_ptr<grpc::Channel>> stripe_channels
      ABSL_GUARDED_BY(mu);
  // The server's data port as learnt from GetServerInfo; 0 = none, or not
  // reachable from here. Unset until the first large upload asks.
  std::optional<int> data_port ABSL_GUARDED_BY(mu);

  // The dtype and shape of handles this client uploaded or described (they
  // never change on the server), so that a ranged Download needs no Describe
  // first. At most kKnownShapes, the oldest forgotten first. Thread-safe.
  struct Shape {
    DType dtype = DType::kInvalid;
    std::vector<int64_t> dims;
  };
  static constexpr std::size_t kKnownShapes = 4096;
  void Remember(const TensorInfo& info) ABSL_LOCKS_EXCLUDED(mu) {
    if (info.handle.empty()) return;
    absl::MutexLock lock(&mu);
    auto [it, added] = known.try_emplace(info.handle);
    it->second = Shape{info.dtype, info.shape};
    if (!added) return;
    known_order.push_back(info.handle);
    if (known_order.size() > kKnownShapes) {
      known.erase(known_order.front());
      known_order.pop_front();
    }
  }
  std::optional<Shape> Known(const std::string& handle)
      ABSL_LOCKS_EXCLUDED(mu) {
    absl::MutexLock lock(&mu);
    auto it = known.find(handle);
    if (it == known.end()) return std::nullopt;
    return it->second;
  }
  void Forget(const std::string& handle) ABSL_LOCKS_EXCLUDED(mu) {
    absl::MutexLock lock(&mu);
    known.erase(handle);  // its place in known_order goes with eviction
  }
  absl::flat_hash_map<std::string, Shape> known ABSL_GUARDED_BY(mu);
  std::deque<std::string> known_order ABSL_GUARDED_BY(mu);

  // The scratch buffers of piece-wise transfers (piece_bytes each): a
  // transfer takes what it needs and gives it back, so a Client reuses the
  // same few buffers for its life (callers may register them, e.g. pin
  // them). Pages are touched only by a source or a receive that fills them.
  struct FreeDeleter {
    void operator()(char* p) const { std::free(p); }
  };
  using Scratch = std::unique_ptr<char, FreeDeleter>;
  std::vector<Scratch> TakeScratch(int count, std::size_t bytes)
      ABSL_LOCKS_EXCLUDED(mu) {
    std::vector<Scratch> taken;
    {
      absl::MutexLock lock(&mu);
      while (static_cast<int>(taken.size()) < count && !free_scratch.empty()) {
        taken.push_back(std::move(free_scratch.back()));
        free_scratch.pop_back();
      }
    }
    // Page-aligned, so device copies and registration cover whole pages.
    const std::size_t rounded = (bytes + 4095) / 4096 * 4096;
    while (static_cast<int>(taken.size()) < count) {
      taken.emplace_back(static_cast<char*>(std::aligned_alloc(4096, rounded)));
      if (taken.back() == nullptr) std::abort();  // as operator new would
    }
    return taken;
  }
  void GiveScratch(std::vector<Scratch> buffers) ABSL_LOCKS_EXCLUDED(mu) {
    absl::MutexLock lock(&mu);
    for (Scratch& buffer : buffers) free_scratch.push_back(std::move(buffer));
  }
  std::vector<Scratch> free_scratch ABSL_GUARDED_BY(mu);

  // The scratch buffers one transfer holds, given back when it ends.
  class Lease {
   public:
    Lease(Channel* channel, int count, std::size_t bytes)
        : channel_(channel), buffers_(channel->TakeScratch(count, bytes)) {}
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    ~Lease() { channel_->GiveScratch(std::move(buffers_)); }
    char* operator[](int i) const {
      return buffers_[static_cast<std::size_t>(i)].get();
    }

   private:
    Channel* const channel_;
    std::vector<Scratch> buffers_;
  };
};

namespace {

// Room left in a message for everything but the payload bytes.
constexpr std::size_t kMessageOverheadBytes = 4096;
// How long a data connection may take to connect before the upload goes over
// gRPC instead.
constexpr absl::Duration kDataConnectTimeout = absl::Seconds(5);
// A data connection that moves nothing for this long fails its transfer.
constexpr absl::Duration kDataIoTimeout = absl::Seconds(60);
// How long a failed data connection waits for the RPC to say why.
constexpr absl::Duration kDataFailureGrace = absl::Seconds(5);

// The single grpc::Status -> absl::Status conversion. Both use the canonical
// code numbering (google.rpc.Code), so the value carries over unchanged.
absl::Status ToAbsl(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  const int code = static_cast<int>(status.error_code());
  if (code < 0 || code > static_cast<int>(absl::StatusCode::kUnauthenticated)) {
    return absl::UnknownError(
        absl::StrCat("gRPC status code ", code, ": ", status.error_message()));
  }
  return absl::Status(static_cast<absl::StatusCode>(code),
                      status.error_message());
}

// Prepares `context` for a call on `channel` with `options`' deadline and
// credentials. When `channel` (nullptr = the caller waits itself) is not
// connected, first waits up to options.connect_wait, within the deadline, for
// it to connect: a first connection attempt that fails must not fail the call
// while a reconnect 100 ms later would succeed. The call then runs either way
// and fails fast (UNAVAILABLE) if the channel is still down.
void PrepareContext(const ClientOptions& options, grpc::Channel* channel,
                    grpc::ClientContext* context) {
  const absl::Time start = absl::Now();
  if (channel != nullptr && options.connect_wait > absl::ZeroDuration() &&
      channel->GetState(/*try_to_connect=*/true) != GRPC_CHANNEL_READY) {
    channel->WaitForConnected(absl::ToChronoTime(
        start + std::min(options.connect_wait, options.deadline)));
  }
  if (options.deadline != absl::InfiniteDuration()) {
    context->set_deadline(absl::ToChronoTime(start + options.deadline));
  }
  if (!options.bearer_token.empty()) {
    context->AddMetadata("authorization",
                         absl::StrCat("Bearer ", options.bearer_token));
  }
}

// Whether the options ask for TLS.
bool UsesTls(const ClientOptions& options) {
  return options.tls || !options.tls_ca_file.empty() ||
         !options.tls_cert_file.empty() || !options.tls_key_file.empty();
}

// Plaintext, or TLS from the PEM files the options name.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentials(
    const ClientOptions& options, grpc::ChannelArguments* args) {
  if (!UsesTls(options)) return grpc::InsecureChannelCredentials();
  if (options.tls_cert_file.empty() != options.tls_key_file.empty()) {
    return absl::InvalidArgumentError(
        "tls_cert_file and tls_key_file go together (mutual TLS needs both)");
  }
  grpc::SslCredentialsOptions ssl;
  if (!options.tls_ca_file.empty()) {
    ASSIGN_OR_RETURN(ssl.pem_root_certs,
                     ReadNonEmptyFile("tls_ca_file", options.tls_ca_file));
  }
  if (!options.tls_cert_file.empty()) {
    ASSIGN_OR_RETURN(ssl.pem_cert_chain,
                     ReadNonEmptyFile("tls_cert_file", options.tls_cert_file));
    ASSIGN_OR_RETURN(ssl.pem_private_key,
                     ReadNonEmptyFile("tls_key_file", options.tls_key_file));
  }
  if (!options.tls_server_name.empty()) {
    args->SetSslTargetNameOverride(options.tls_server_name);
  }
  return grpc::SslCredentials(ssl);
}

// Runs produce(k, scratch) for pieces k = 0 .. count - 1 on a helper thread,
// one piece ahead of consume(k, data) on the calling thread, alternating
// between the scratch buffers `a` and `b`: producing piece k + 1 (a dtype
// conversion, a device copy, a receive) overlaps consuming piece k (a send,
// a write). Returns the first error of either side; after one, neither is
// called again.
absl::Status PipelinePieces(
    int64_t count, char* a, char* b,
    const std::function<absl::StatusOr<const void*>(int64_t, char*)>& produce,
    const std::function<absl::Status(int64_t, const void*)>& consume) {
  if (count <= 0) return absl::OkStatus();
  struct Slot {
    bool full = false;
    absl::StatusOr<const void*> data;
  };
  absl::Mutex mu;
  Slot slots[2];
  bool stop = false;
  std::thread producer([&] {
    for (int64_t k = 0; k < count; ++k) {
      Slot& slot = slots[k % 2];
      {
        absl::MutexLock lock(&mu);
        auto free_or_stopped = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu) {
          return !slot.full || stop;
        };
        mu.Await(absl::Condition(&free_or_stopped));
        if (stop) return;
      }
      absl::StatusOr<const void*> data = produce(k, k % 2 == 0 ? a : b);
      const bool failed = !data.ok();
      absl::MutexLock lock(&mu);
      slot.data = std::move(data);
      slot.full = true;
      if (failed) return;
    }
  });
  absl::Status result;
  for (int64_t k = 0; k < count && result.ok(); ++k) {
    Slot& slot = slots[k % 2];
    absl::StatusOr<const void*> data;
    {
      absl::MutexLock lock(&mu);
      mu.Await(absl::Condition(&slot.full));
      data = slot.data;
    }
    result = data.ok() ? consume(k, *data) : data.status();
    absl::MutexLock lock(&mu);
    slot.full = false;
  }
  {
    absl::MutexLock lock(&mu);
    stop = true;
  }
  producer.join();
  return result;
}

// Bytes of the pieces of a transfer of `element_bytes`-byte elements: whole
// elements, at most options.piece_bytes (at least one element).
int64_t PieceBytes(const ClientOptions& options, int64_t element_bytes) {
  const int64_t piece = static_cast<int64_t>(options.piece_bytes);
  return std::max<int64_t>(1, piece / element_bytes) * element_bytes;
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

// Sends one Upload stream on `channel` under `context`: `header`, then bytes
// [begin, end) of the tensor from `source` in pieces of `piece` bytes (see
// ForEachSourcePiece; scratch `a` and `b`), each in messages of at most
// `chunk_bytes`, calling `on_sent` with each message's size once it is
// written. Success: the stored tensor's metadata. Errors: the server's
// status; the source's; DATA_LOSS when the server ended the stream OK before
// taking every byte.
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
  if (sent != end - begin) {
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

absl::Time FromTimestamp(const google::protobuf::Timestamp& ts) {
  return absl::FromUnixSeconds(ts.seconds()) + absl::Nanoseconds(ts.nanos());
}

TensorInfo FromProto(const v1::TensorInfo& proto) {
  TensorInfo info;
  info.handle = proto.handle();
  info.dtype = static_cast<DType>(proto.dtype());
  info.shape.assign(proto.shape().begin(), proto.shape().end());
  info.bytes = proto.bytes();
  info.device = proto.device();
  info.state = static_cast<TensorState>(proto.state());
  info.tenant = proto.tenant();
  info.label = proto.label();
  if (proto.has_created()) info.created = FromTimestamp(proto.created());
  if (proto.has_last_used()) info.last_used = FromTimestamp(proto.last_used());
  info.pending_scale = proto.pending_scale();
  info.pending_token_scale = proto.pending_token_scale();
  return info;
}

EvaluateResult FromProto(const v1::EvaluateResponse& proto) {
  EvaluateResult result;
  result.loss = proto.loss();
  result.z_loss = proto.z_loss();
  result.rows = proto.rows();
  result.valid_tokens = proto.valid_tokens();
  result.correct_tokens = proto.correct_tokens();
  result.nonfinite_rows = proto.nonfinite_rows();
  result.denominator = proto.denominator();
  return result;
}

ServerInfo FromProto(const v1::ServerInfo& proto) {
  ServerInfo info;
  info.instance_id = proto.instance_id();
  info.device = proto.device();
  info.budget_bytes = proto.budget_bytes();
  info.used_bytes = proto.used_bytes();
  info.free_bytes = proto.free_bytes();
  info.tensors = proto.tensors();
  info.version = proto.version();
  info.data_port = proto.data_port();
  return info;
}

void ToProto(const CrossEntropyOptions& loss, const std::string& class_weights,
             v1::LossOptions* proto) {
  proto->set_ignore_index(loss.ignore_index);
  proto->set_label_smoothing(loss.label_smoothing);
  proto->set_reduction(static_cast<v1::Reduction>(loss.reduction));
  proto->set_z_loss_scale(loss.z_loss_scale);
  proto->set_softcap(loss.softcap);
  proto->set_class_weights(class_weights);
  proto->set_normalizer(loss.normalizer);
  proto->set_grad_scale(loss.grad_scale);
}

v1::EvaluateHeader EvaluateHeaderFor(int64_t vocab, DType logits_dtype,
                                     DType targets_dtype,
                                     const EvaluateOptions& options) {
  v1::EvaluateHeader header;
  header.set_vocab(vocab);
  header.set_logits_dtype(static_cast<v1::DType>(logits_dtype));
  header.set_targets_dtype(static_cast<v1::DType>(targets_dtype));
  ToProto(options.loss, options.class_weights, header.mutable_options());
  return header;
}

absl::StatusOr<BackwardResult> FinishBackward(const ClientOptions& options,
                                              grpc::Channel* channel,
                                              v1::Lossd::Stub* stub,
                                              const v1::BackwardRequest& req) {
  grpc::ClientContext context;
  PrepareContext(options, channel, &context);
  v1::BackwardResponse response;
  RETURN_IF_ERROR(ToAbsl(stub->Backward(&context, req, &response)));
  BackwardResult result;
  result.tensor = FromProto(response.tensor());
  result.kernel_launched = response.kernel_launched();
  return result;
}

// Hands row blocks from the producer thread to the sending thread, at most
// kDepth at a time, so reading the next block overlaps sending this one.
class BlockQueue {
 public:
  static constexpr std::size_t kDepth = 2;

  // Producer side. Returns false when the consumer stopped.
  bool Push(RowBlock block) {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(this, &BlockQueue::HasRoomOrStopped));
    if (stopped_) return false;
    blocks_.push_back(std::move(block));
    return true;
  }
  // Producer side: no more blocks; `status` is the producer's outcome.
  void Close(absl::Status status) {
    absl::MutexLock lock(&mu_);
    closed_ = true;
    producer_status_ = std::move(status);
  }
  // Consumer side. False when closed and drained.
  bool Pop(RowBlock* block) {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(this, &BlockQueue::HasBlockOrClosed));
    if (blocks_.empty()) return false;
    *block = std::move(blocks_.front());
    blocks_.pop_front();
    return true;
  }
  // Consumer side: stop early; a waiting producer returns.
  void Stop() {
    absl::MutexLock lock(&mu_);
    stopped_ = true;
  }
  absl::Status producer_status() {
    absl::MutexLock lock(&mu_);
    return producer_status_;
  }

 private:
  bool HasRoomOrStopped() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return stopped_ || blocks_.size() < kDepth;
  }
  bool HasBlockOrClosed() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return closed_ || !blocks_.empty();
  }

  absl::Mutex mu_;
  std::deque<RowBlock> blocks_ ABSL_GUARDED_BY(mu_);
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status producer_status_ ABSL_GUARDED_BY(mu_);
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

// A stripe's extra connection may fail its first attempt (seen on loopback
// under load), and an RPC on a fresh channel fails at once rather than wait:
// wait for it to connect, through gRPC's reconnect backoff, for up to 20 s.
absl::Status AwaitConnected(grpc::Channel* channel, int index) {
  if (channel->WaitForConnected(std::chrono::system_clock::now() +
                                std::chrono::seconds(20))) {
    return absl::OkStatus();
  }
  return absl::UnavailableError(absl::StrCat("stripe connection ", index,
                                             " did not connect within 20 s"));
}

// Runs work(i, context, count) for i in [0, n) on n threads, each with its
// own ClientContext prepared from `options`. When one fails, the others'
// contexts are cancelled: a stripe that failed may never have reached the
// server, so the others must not wait for it. `count(bytes)` adds to the
// progress this (the calling) thread reports as progress(done, total).
// Returns each worker's status, in order.
std::vector<absl::Status> RunParallel(
    int n, const ClientOptions& options, int64_t total,
    const ProgressCallback& progress,
    const std::function<absl::Status(int, grpc::ClientContext*,
                                     const std::function<void(int64_t)>&)>&
        work) {
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
  for (int i = 0; i < n; ++i) {
    contexts.push_back(std::make_unique<grpc::ClientContext>());
    PrepareContext(options, /*channel=*/nullptr, contexts.back().get());
  }
  absl::Mutex mu;
  int64_t done = 0;
  int finished = 0;
  std::vector<absl::Status> results(static_cast<std::size_t>(n));
  const std::function<void(int64_t)> count = [&](int64_t bytes) {
    absl::MutexLock lock(&mu);
    done += bytes;
  };
  std::vector<std::thread> threads;
  for (int i = 0; i < n; ++i) {
    threads.emplace_back([&, i] {
      absl::Status status =
          work(i, contexts[static_cast<std::size_t>(i)].get(), count);
      if (!status.ok()) {
        for (int j = 0; j < n; ++j) {
          if (j != i) contexts[static_cast<std::size_t>(j)]->TryCancel();
        }
      }
      absl::MutexLock lock(&mu);
      results[static_cast<std::size_t>(i)] = std::move(status);
      ++finished;
    });
  }
  int64_t reported = -1;
  for (bool all = false; !all;) {
    int64_t now;
    {
      absl::MutexLock lock(&mu);
      auto moved = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu) {
        return done != reported || finished == n;
      };
      mu.Await(absl::Condition(&moved));
      now = done;
      all = finished == n;
    }
    if (progress && now != reported) progress(now, total);
    reported = now;
  }
  for (std::thread& thread : threads) thread.join();
  return results;
}

}  // namespace

Client::Client(std::string target, ClientOptions options,
               std::unique_ptr<Channel> channel)
    : target_(std::move(target)),
      options_(std::move(options)),
      channel_(std::move(channel)) {}

Client::~Client() = default;

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(std::string target,
                                                        ClientOptions options) {
  if (target.empty()) return absl::InvalidArgumentError("empty server target");
  if (options.max_message_bytes <= static_cast<int>(kMessageOverheadBytes)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_message_bytes ", options.max_message_bytes, " is too small"));
  }
  if (options.chunk_bytes == 0 ||
      options.chunk_bytes >
          static_cast<std::size_t>(options.max_message_bytes) -
              kMessageOverheadBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk_bytes ", options.chunk_bytes, " must be in [1, ",
                     options.max_message_bytes - kMessageOverheadBytes, "]"));
  }
  if (options.deadline <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("deadline must be positive");
  }
  if (options.connect_wait < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("connect_wait must not be negative");
  }
  if (options.piece_bytes < (std::size_t{64} << 10) ||
      options.piece_bytes > (std::size_t{1} << 30)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "piece_bytes ", options.piece_bytes, " must be in [64 KiB, 1 GiB]"));
  }
  if (options.upload_streams < 1 || options.upload_streams > 64) {
    return absl::InvalidArgumentError(absl::StrCat(
        "upload_streams ", options.upload_streams, " must be in [1, 64]"));
  }
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(options.max_message_bytes);
  args.SetMaxSendMessageSize(options.max_message_bytes);
  // The connection belongs to this Client (not gRPC's process-wide pool), so
  // destroying the Client closes it instead of leaving it open for reuse.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  // Reconnect 100 ms after a failed attempt (gRPC's default is 1 s), so that
  // connect_wait rides over a failed attempt; at most 5 s apart while the
  // server stays away (default 120 s), so a restarted server is found soon.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 5000);
  ASSIGN_OR_RETURN(std::shared_ptr<grpc::ChannelCredentials> credentials,
                   ChannelCredentials(options, &args));
  auto channel = std::make_unique<Channel>();
  channel->channel = grpc::CreateCustomChannel(target, credentials, args);
  channel->credentials = credentials;
  channel->tls = UsesTls(options);
  channel->args = args;
  channel->lossd = v1::Lossd::NewStub(channel->channel);
  channel->health = health::Health::NewStub(channel->channel);
  return std::unique_ptr<Client>(
      new Client(std::move(target), std::move(options), std::move(channel)));
}

absl::StatusOr<TensorInfo> Client::Upload(DType dtype,
                                          absl::Span<const int64_t> shape,
                                          const void* data, std::size_t bytes,
                                          const std::string& label,
                                          const ProgressCallback& progress) {
  ASSIGN_OR_RETURN(const int64_t expected, TensorBytes(dtype, shape));
  if (static_cast<uint64_t>(expected) != bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(bytes, " bytes given; dtype ", DTypeString(dtype),
                     " and the shape need ", expected));
  }
  if (data == nullptr && bytes > 0) {
    return absl::InvalidArgumentError("null data");
  }
  // The caller's memory is the source: every piece is sent from where it
  // lies, uncopied.
  const char* base = static_cast<const char*>(data);
  return UploadPieces(
      dtype, shape, bytes,
      [base](int64_t offset, std::size_t,
             void*) -> absl::StatusOr<const void*> { return base + offset; },
      label, progress);
}

absl::StatusOr<TensorInfo> Client::UploadFrom(
    DType dtype, absl::Span<const int64_t> shape, const UploadSource& source,
    const std::string& label, const ProgressCallback& progress) {
  ASSIGN_OR_RETURN(const int64_t bytes, TensorBytes(dtype, shape));
  if (!source) return absl::InvalidArgumentError("no upload source");
  return UploadPieces(dtype, shape, static_cast<std::size_t>(bytes), source,
                      label, progress);
}

absl::StatusOr<TensorInfo> Client::UploadPieces(
    DType dtype, absl::Span<const int64_t> shape, std::size_t bytes,
    const UploadSource& source, const std::string& label,
    const ProgressCallback& progress) {
  if (options_.data_connection && bytes >= options_.stripe_min_bytes &&
      bytes > 0) {
    std::optional<absl::StatusOr<TensorInfo>> uploaded =
        UploadOverDataConnection(dtype, shape, source, bytes, label, progress);
    if (uploaded.has_value()) return *std::move(uploaded);
  }
  if (options_.upload_streams > 1 && bytes >= options_.stripe_min_bytes &&
      bytes > 0) {
    return UploadStriped(dtype, shape, source, bytes, label,
                         options_.upload_streams, progress);
  }
  grpc::ClientContext context;
  PrepareContext(options_, channel_->channel.get(), &context);
  v1::TensorHeader header;
  header.set_dtype(static_cast<v1::DType>(dtype));
  header.mutable_shape()->Add(shape.begin(), shape.end());
  header.set_label(label);
  std::size_t sent = 0;
  Channel::Lease scratch(channel_.get(), 2, options_.piece_bytes);
  ASSIGN_OR_RETURN(
      const v1::TensorInfo info,
      SendUpload(
          channel_->channel.get(), &context, header, source, 0,
          static_cast<int64_t>(bytes),
          PieceBytes(options_, static_cast<int64_t>(DTypeSize(dtype))),
          scratch[0], scratch[1], options_.chunk_bytes, [&](std::size_t n) {
            sent += n;
            if (progress) {
              progress(static_cast<int64_t>(sent), static_cast<int64_t>(bytes));
            }
          }));
  TensorInfo uploaded = FromProto(info);
  channel_->Remember(uploaded);
  return uploaded;
}

std::optional<Client::DataTarget> Client::FindDataTarget() {
  if (channel_->tls) return std::nullopt;
  std::optional<std::string> host = TargetHost(target_);
  if (!host.has_value()) return std::nullopt;
  std::optional<int> port;
  {
    absl::MutexLock lock(&channel_->mu);
    port = channel_->data_port;
  }
  if (!port.has_value()) {
    absl::StatusOr<ServerInfo> info = GetServerInfo();
    // Not cached: the gRPC path reports what is wrong, the next transfer asks
    // again.
    if (!info.ok()) return std::nullopt;
    port = info->data_port;
    absl::MutexLock lock(&channel_->mu);
    channel_->data_port = port;
  }
  if (*port == 0) return std::nullopt;
  return DataTarget{*std::move(host), *port};
}

std::optional<std::vector<int>> Client::ConnectData(const DataTarget& target,
                                                    int count) {
  std::vector<int> fds;
  for (int i = 0; i < count; ++i) {
    absl::StatusOr<int> fd = ConnectDataPort(
        target.host, target.port, kDataConnectTimeout, kDataIoTimeout);
    if (!fd.ok()) {
      for (int open : fds) close(open);
      // A port the server offers that cannot be reached from here (a
      // firewall, a Service without it): gRPC it is, from now on.
      absl::MutexLock lock(&channel_->mu);
      channel_->data_port = 0;
      return std::nullopt;
    }
    fds.push_back(*fd);
  }
  return fds;
}

namespace {

// Data connections of one transfer: as many as a striped transfer takes (one
// TCP stream is capped below what loopback and fast networks carry).
int DataConnectionCount(const ClientOptions& options) {
  return std::clamp(options.upload_streams, 1, 64);
}

}  // namespace

std::optional<absl::StatusOr<Client::DataConnections>>
Client::OpenDataConnections() {
  const std::optional<DataTarget> target = FindDataTarget();
  if (!target.has_value()) return std::nullopt;
  std::optional<std::vector<int>> fds =
      ConnectData(*target, DataConnectionCount(options_));
  if (!fds.has_value()) return std::nullopt;
  absl::StatusOr<std::string> token = RandomDataToken();
  if (!token.ok()) {
    for (int fd : *fds) close(fd);
    return absl::StatusOr<DataConnections>(token.status());
  }
  return absl::StatusOr<DataConnections>(
      DataConnections{*std::move(fds), *std::move(token)});
}

namespace {

// Closes a transfer's data connections when it goes, or at Close.
class ConnectionCloser {
 public:
  explicit ConnectionCloser(std::vector<int>* fds) : fds_(fds) {}
  ConnectionCloser(const ConnectionCloser&) = delete;
  ConnectionCloser& operator=(const ConnectionCloser&) = delete;
  ~ConnectionCloser() { Close(); }
  void Close() {
    for (int fd : *fds_) close(fd);
    fds_->clear();
  }

 private:
  std::vector<int>* const fds_;
};

// Ends the RPC of a transfer over data connections with `finish`. The RPC's
// status says why a transfer failed: the server ends the RPC before it closes
// the connections. When a connection failed without that (one the server
// never took), the RPC gets a short grace and is then cancelled rather than
// left to the server's --data_timeout.
grpc::Status FinishAfterData(grpc::ClientContext* context, bool failed,
                             const std::function<grpc::Status()>& finish) {
  absl::Notification finished_rpc;
  std::thread canceller;
  if (failed) {
    canceller = std::thread([&] {
      if (!finished_rpc.WaitForNotificationWithTimeout(kDataFailureGrace)) {
        context->TryCancel();
      }
    });
  }
  const grpc::Status status = finish();
  finished_rpc.Notify();
  if (canceller.joinable()) canceller.join();
  return status;
}

}  // namespace

std::optional<absl::StatusOr<TensorInfo>> Client::UploadOverDataConnection(
    DType dtype, absl::Span<const int64_t> shape, const UploadSource& source,
    std::size_t bytes, const std::string& label,
    const ProgressCallback& progress) {
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
  v1::TensorHeader* header = request.mutable_header();
  header->set_dtype(static_cast<v1::DType>(dtype));
  header->mutable_shape()->Add(shape.begin(), shape.end());
  header->set_label(label);
  header->set_data_token(token);
  header->set_data_connections(connections);
  v1::UploadResponse response;
  std::unique_ptr<grpc::ClientWriter<v1::UploadRequest>> writer =
      channel_->lossd->Upload(&context, &response);
  absl::Status sent = absl::OkStatus();
  if (writer->Write(request) && writer->WritesDone()) {
    const int64_t element_bytes = static_cast<int64_t>(DTypeSize(dtype));
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
  if (!sent.ok() &&
      (finished.ok() || finished.error_code() == grpc::StatusCode::CANCELLED)) {
    return absl::StatusOr<TensorInfo>(sent);
  }
  if (!finished.ok()) return absl::StatusOr<TensorInfo>(ToAbsl(finished));
  TensorInfo uploaded = FromProto(response.tensor());
  channel_->Remember(uploaded);
  return absl::StatusOr<TensorInfo>(std::move(uploaded));
}

absl::StatusOr<TensorInfo> Client::UploadStriped(
    DType dtype, absl::Span<const int64_t> shape, const UploadSource& source,
    std::size_t bytes, const std::string& label, int stripes,
    const ProgressCallback& progress) {
  const int64_t element_bytes = static_cast<int64_t>(DTypeSize(dtype));
  const int64_t elements = static_cast<int64_t>(bytes) / element_bytes;
  const int64_t piece = PieceBytes(options_, element_bytes);
  Channel::Lease scratch(channel_.get(), 2 * stripes, options_.piece_bytes);
  v1::TensorHeader header;
  header.set_dtype(static_cast<v1::DType>(dtype));
  header.mutable_shape()->Add(shape.begin(), shape.end());
  header.set_label(label);
  header.mutable_stripe()->set_upload_id(RandomUploadId());
  header.mutable_stripe()->set_count(stripes);

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
        v1::TensorHeader stripe_header = header;
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
  // the reply): the tensor must not stay behind.
  if (!handle.empty()) Release(handle).IgnoreError();
  return root_cause != nullptr ? *root_cause : *first_error;
}

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
  bool mismatch = false;     // the client's own finding, not the server's
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
      const int64_t elements = total / element_bytes;
      const int64_t piece = PieceBytes(options_, element_bytes);
      std::optional<Channel::Lease> scratch;
      if (base == nullptr) {
        scratch.emplace(channel_.get(), 2 * connections, options_.piece_bytes);
      }
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
          // Receiving piece k + 1 overlaps the sink's work on piece k.
          auto size_of = [&](int64_t k) {
            return static_cast<std::size_t>(
                std::min(piece, end - begin - k * piece));
          };
          result = PipelinePieces(
              (end - begin + piece - 1) / piece, (*scratch)[2 * i],
              (*scratch)[2 * i + 1],
              [&](int64_t k, char* buffer) -> absl::StatusOr<const void*> {
                RETURN_IF_ERROR(
                    ReceiveOverDataConnection(fd, buffer, size_of(k), count));
                return buffer;
              },
              [&](int64_t k, const void* data) {
                absl::Status sunk =
                    (*destination.sink)(begin + k * piece, data, size_of(k));
                if (!sunk.ok()) {
                  // The sink's error is the download's; the other
                  // connections stop at once (their receives then fail).
                  absl::MutexLock lock(&mu);
                  if (sink_error.ok()) sink_error = sunk;
                  for (int open : fds) shutdown(open, SHUT_RDWR);
                }
                return sunk;
              });
        });
      }
      for (std::thread& receiver : receivers) receiver.join();
      received = true;
      absl::MutexLock lock(&mu);
      failed = sink_error;
      for (const absl::Status& result : results) {
        if (!result.ok() && failed.ok()) failed = result;
      }
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
  const int64_t piece = PieceBytes(options_, element_bytes);
  std::optional<Channel::Lease> scratch;
  if (base == nullptr) {
    scratch.emplace(channel_.get(), streams, options_.piece_bytes);
  }
  absl::Mutex mu;
  TensorInfo first_header;
  // A server older than ranged Download ignores offset and length and
  // announces the whole tensor: then fetch it as one stream instead.
  std::atomic<bool> no_ranges{false};
  const std::vector<absl::Status> results = RunParallel(
      streams, options_, total, progress,
      [&](int i, grpc::ClientContext* context,
          const std::function<void(int64_t)>& count) {
        const ElementRange range = StripeElements(elements, i, streams);
        const int64_t offset = range.first * element_bytes;
        const int64_t length = (range.end - range.first) * element_bytes;
        // An empty range is nothing to fetch (length 0 would mean "to the
        // end").
        if (length == 0) return absl::OkStatus();
        const std::shared_ptr<grpc::Channel> channel =
            i == 0 ? channel_->channel : channel_->StripeChannel(target_, i);
        if (i > 0) RETURN_IF_ERROR(AwaitConnected(channel.get(), i));
        std::unique_ptr<v1::Lossd::Stub> stub = v1::Lossd::NewStub(channel);
        v1::DownloadRequest request;
        request.set_handle(handle);
        request.set_dtype(static_cast<v1::DType>(as_dtype));
        request.set_chunk_bytes(static_cast<int64_t>(options_.chunk_bytes));
        request.set_offset(offset);
        request.set_length(length);
        int64_t written = 0;
        std::optional<PieceAssembler> pieces;
        if (base == nullptr) {
          pieces.emplace(*destination.sink, offset, (*scratch)[i], piece);
        }
        RETURN_IF_ERROR(StreamDownload(
            stub.get(), context, request,
            [&](const TensorInfo& header) {
              if (header.bytes == total) {
                no_ranges = true;
                return absl::FailedPreconditionError(
                    "the server has no ranged Download");
              }
              if (header.bytes != length) {
                return absl::DataLossError(absl::StrCat(
                    "asked for bytes [", offset, ", ", offset + length,
                    "), the server announced ", header.bytes));
              }
              if (i == 0) {
                absl::MutexLock lock(&mu);
                first_header = header;
              }
              return absl::OkStatus();
            },
            [&](const void* data, std::size_t bytes) {
              // StreamDownload never passes more than the header's count.
              if (pieces.has_value()) {
                RETURN_IF_ERROR(pieces->Add(data, bytes));
              } else {
                std::memcpy(base + offset + written, data, bytes);
              }
              written += static_cast<int64_t>(bytes);
              count(static_cast<int64_t>(bytes));
              return absl::OkStatus();
            },
            nullptr));
        return pieces.has_value() ? pieces->Flush() : absl::OkStatus();
      });
  if (no_ranges) {
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
  *info = first_header;
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

absl::StatusOr<TensorInfo> Client::Describe(const std::string& handle) {
  grpc::ClientContext context;
  PrepareContext(options_, channel_->channel.get(), &context);
  v1::DescribeRequest request;
  request.set_handle(handle);
  v1::TensorInfo response;
  RETURN_IF_ERROR(
      ToAbsl(channel_->lossd->Describe(&context, request, &response)));
  TensorInfo info = FromProto(response);
  channel_->Remember(info);
  return info;
}

absl::StatusOr<ListResult> Client::List() {
  grpc::ClientContext context;
  PrepareContext(options_, channel_->channel.get(), &context);
  v1::ListResponse response;
  RETURN_IF_ERROR(
      ToAbsl(channel_->lossd->List(&context, v1::ListRequest(), &response)));
  ListResult result;
  for (const v1::TensorInfo& tensor : response.tensors()) {
    result.tensors.push_back(FromProto(tensor));
  }
  result.server = FromProto(response.server());
  return result;
}

absl::StatusOr<int64_t> Client::Release(const std::string& handle) {
  grpc::ClientContext context;
  PrepareContext(options_, channel_->channel.get(), &context);
  v1::ReleaseRequest request;
  request.set_handle(handle);
  v1::ReleaseResponse response;
  channel_->Forget(handle);
  RETURN_IF_ERROR(
      ToAbsl(channel_->lossd->Release(&context, request, &response)));
  return response.released_bytes();
}

absl::StatusOr<ForwardResult> Client::Forward(const std::string& logits,
                                              const Targets& targets,
                                              const ForwardOptions& options) {
  v1::ForwardRequest request;
  request.set_logits(logits);
  if (!targets.handle.empty()) {
    request.set_targets_handle(targets.handle);
  } else {
    if (!IsTargetsDType(targets.inline_dtype)) {
      return absl::InvalidArgumentError(
          "targets: neither a handle nor inline int32/int64 data");
    }
    if (targets.inline_data == nullptr && targets.inline_bytes > 0) {
      return absl::InvalidArgumentError("inline targets: null data");
    }
    v1::InlineTensor* inline_targets = request.mutable_targets_inline();
    inline_targets->set_dtype(static_cast<v1::DType>(targets.inline_dtype));
    inline_targets->set_data(static_cast<const char*>(targets.inline_data),
                             targets.inline_bytes);
  }
  ToProto(options.loss, options.class_weights, request.mutable_options());
  request.set_mode(static_cast<v1::GradientMode>(options.mode));
  request.mutable_outputs()->set_token_loss(options.token_loss);
  request.mutable_outputs()->set_token_lse(options.token_lse);
  request.mutable_outputs()->set_token_argmax(options.token_argmax);
  request.set_gradient_label(options.gradient_label);

  grpc::ClientContext context;
  PrepareContext(options_, channel_->channel.get(), &context);
  v1::ForwardResponse response;
  RETURN_IF_ERROR(
      ToAbsl(channel_->lossd->Forward(&context, request, &response)));
  ForwardResult result;
  result.loss = response.loss();
  result.z_loss = response.z_loss();
  result.valid_tokens = response.valid_tokens();
  result.correct_tokens = response.correct_tokens();
  result.nonfinite_rows = response.nonfinite_rows();
  result.gradient = response.gradient();
  result.token_loss.assign(response.token_loss().begin(),
                           response.token_loss().end());
  result.token_lse.assign(response.token_lse().begin(),
                          response.token_lse().end());
  result.token_argmax.assign(response.token_argmax().begin(),
                             response.token_argmax().end());
  result.kernel_seconds = response.kernel_seconds();
  result.denominator = response.denominator();
  return result;
}

absl::StatusOr<BackwardResult> Client::Backward(const std::string& gradient,
                                                double grad_output,
                                                bool materialize) {
  v1::BackwardRequest request;
  request.set_gradient(gradient);
  request.set_scalar(grad_output);
  request.set_materialize(materialize);
  return FinishBackward(options_, channel_->channel.get(),
                        channel_->lossd.get(), request);
}

absl::StatusOr<BackwardResult> Client::Backward(
    const std::string& gradient, absl::Span<const float> token_grad_output,
    bool materialize) {
  v1::BackwardRequest request;
  request.set_gradient(gradient);
  request.mutable_per_token()->mutable_values()->Add(token_grad_output.begin(),
                                                     token_grad_output.end());
  request.set_materialize(materialize);
  return FinishBackward(options_, channel_->channel.get(),
                        channel_->lossd.get(), request);
}

absl::StatusOr<EvaluateResult> Client::Evaluate(
    int64_t vocab, DType logits_dtype, DType targets_dtype,
    const EvaluateOptions& options, const RowBlockProducer& next_block,
    const ProgressCallback& progress) {
  if (vocab < 1) {
    return absl::InvalidArgumentError(absl::StrCat("vocab ", vocab, " < 1"));
  }
  if (!IsLogitsDType(logits_dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "logits dtype ", DTypeString(logits_dtype), " is not floating point"));
  }
  if (!IsTargetsDType(targets_dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "targets dtype ", DTypeString(targets_dtype), " is not int32/int64"));
  }
  // Data connections for an evaluation of a known size of at least
  // stripe_min_bytes of logits: a smaller one is not worth their set-up, and
  // one of unknown size may come from a slow producer (a connection idle for
  // the server's --data_timeout between two of its blocks fails).
  const bool large = options.total_rows >= 0 &&
                     options.total_rows * vocab *
                             static_cast<int64_t>(DTypeSize(logits_dtype)) >=
                         static_cast<int64_t>(options_.stripe_min_bytes);
  if (options_.data_connection && large) {
    std::optional<absl::StatusOr<EvaluateResult>> over_data =
        EvaluateOverDataConnections(vocab, logits_dtype, targets_dtype, options,
                                    next_block, progress);
    if (over_data.has_value()) return *std::move(over_data);
  }
  v1::EvaluateRequest request;
  *request.mutable_header() =
      EvaluateHeaderFor(vocab, logits_dtype, targets_dtype, options);
  grpc::ClientContext context;
  PrepareContext(options_, channel_->channel.get(), &context);
  v1::EvaluateResponse response;
  std::unique_ptr<grpc::ClientWriter<v1::EvaluateRequest>> writer =
      channel_->lossd->Evaluate(&context, &response);
  bool sending = writer->Write(request);

  BlockQueue queue;
  std::thread producer([&queue, &next_block] {
    while (true) {
      RowBlock block;
      absl::StatusOr<bool> more = next_block(&block);
      if (!more.ok()) {
        queue.Close(more.status());
        return;
      }
      if (block.logits_view.data() != nullptr) {
        // Copied here, overlapping the sending of the block before, into the
        // strings the request takes.
        block.logits.assign(block.logits_view.data(), block.logits_view.size());
        block.targets.assign(block.targets_view.data(),
                             block.targets_view.size());
        block.logits_view = block.targets_view = absl::string_view();
      }
      if (!*more || !queue.Push(std::move(block))) break;
    }
    queue.Close(absl::OkStatus());
  });
  const std::size_t target_bytes = DTypeSize(targets_dtype);
  int64_t rows_sent = 0;
  RowBlock block;
  while (sending && queue.Pop(&block)) {
    const int64_t rows =
        static_cast<int64_t>(block.Targets().size() / target_bytes);
    request.mutable_block()->set_logits(std::move(block.logits));
    request.mutable_block()->set_targets(std::move(block.targets));
    sending = writer->Write(request);
    if (sending) {
      rows_sent += rows;
      if (progress) progress(rows_sent, options.total_rows);
    }
  }
  queue.Stop();
  producer.join();
  const absl::Status produced = queue.producer_status();
  if (!produced.ok()) {
    context.TryCancel();
    writer->Finish().ok();  // the producer's error is what matters
    return produced;
  }
  if (sending) writer->WritesDone();
  RETURN_IF_ERROR(ToAbsl(writer->Finish()));
  return FromProto(response);
}

std::optional<absl::StatusOr<EvaluateResult>>
Client::EvaluateOverDataConnections(int64_t vocab, DType logits_dtype,
                                    DType targets_dtype,
                                    const EvaluateOptions& options,
                                    const RowBlockProducer& next_block,
                                    const ProgressCallback& progress) {
  const int64_t total_rows = options.total_rows;
  std::optional<absl::StatusOr<DataConnections>> opened = OpenDataConnections();
  if (!opened.has_value()) return std::nullopt;
  if (!opened->ok()) return absl::StatusOr<EvaluateResult>(opened->status());
  std::vector<int>& fds = (*opened)->fds;
  const std::string& token = (*opened)->token;
  ConnectionCloser closer(&fds);
  const int connections = static_cast<int>(fds.size());
  grpc::ClientContext context;
  PrepareContext(options_, channel_->channel.get(), &context);
  v1::EvaluateResponse response;
  std::unique_ptr<grpc::ClientWriter<v1::EvaluateRequest>> writer =
      channel_->lossd->Evaluate(&context, &response);
  v1::EvaluateRequest request;
  *request.mutable_header() =
      EvaluateHeaderFor(vocab, logits_dtype, targets_dtype, options);
  request.mutable_header()->set_data_token(token);
  request.mutable_header()->set_data_connections(connections);
  absl::Status sent;
  absl::Status produced;
  if (writer->Write(request) && writer->WritesDone()) {
    // Block b goes over connection b mod K, in order: the server's sum is
    // the same bits for the same blocks and K. At most kDepth blocks wait
    // per connection.
    std::vector<BlockQueue> queues(static_cast<std::size_t>(connections));
    const std::size_t target_bytes = DTypeSize(targets_dtype);
    const std::size_t row_bytes =
        static_cast<std::size_t>(vocab) * DTypeSize(logits_dtype);
    std::thread producer([&] {
      absl::Status status;
      for (std::size_t b = 0, number = 0;; ++number) {
        RowBlock block;
        absl::StatusOr<bool> more = next_block(&block);
        if (!more.ok()) {
          status = more.status();
          break;
        }
        if (!*more) break;
        // A frame carries its row count: the block must be whole rows, as
        // the server checks a block on the stream.
        const absl::string_view logits = block.Logits();
        const absl::string_view targets = block.Targets();
        const std::size_t rows = targets.size() / target_bytes;
        if (targets.size() % target_bytes != 0 ||
            logits.size() != rows * row_bytes) {
          status = absl::InvalidArgumentError(absl::StrFormat(
              "block %d: %d logits bytes and %d targets bytes are not whole "
              "rows of %d and %d bytes",
              number, logits.size(), targets.size(), row_bytes, target_bytes));
          break;
        }
        if (rows == 0) continue;  // nothing to evaluate
        if (!queues[b++ % queues.size()].Push(std::move(block))) break;
      }
      for (BlockQueue& queue : queues) queue.Close(status);
    });
    absl::Mutex mu;
    int64_t rows_sent = 0;
    std::vector<absl::Status> results(fds.size());
    std::vector<std::thread> senders;
    for (int i = 0; i < connections; ++i) {
      senders.emplace_back([&, i] {
        const int fd = fds[static_cast<std::size_t>(i)];
        BlockQueue& queue = queues[static_cast<std::size_t>(i)];
        absl::Status status = SendDataPreamble(fd, token, i);
        RowBlock block;
        while (status.ok() && queue.Pop(&block)) {
          const int64_t rows =
              static_cast<int64_t>(block.Targets().size() / target_bytes);
          status = SendEvaluateFrame(fd, rows, block.Logits(), block.Targets());
          if (status.ok()) {
            absl::MutexLock lock(&mu);
            rows_sent += rows;
            if (progress) progress(rows_sent, total_rows);
          }
        }
        // A failed connection stops the producer; the others then end.
        if (!status.ok()) {
          for (BlockQueue& each : queues) each.Stop();
        } else if (queue.producer_status().ok()) {
          status = EndDataSending(fd);
        }
        results[static_cast<std::size_t>(i)] = status;
      });
    }
    for (std::thread& sender : senders) sender.join();
    producer.join();
    produced = queues[0].producer_status();
    for (const absl::Status& result : results) {
      if (!result.ok() && sent.ok()) sent = result;
    }
  }
  if (!produced.ok()) {
    context.TryCancel();
    closer.Close();
    writer->Finish().ok();  // the producer's error is what matters
    return absl::StatusOr<EvaluateResult>(produced);
  }
  if (!sent.ok()) closer.Close();
  const grpc::Status finished =
      FinishAfterData(&context, !sent.ok(), [&] { return writer->Finish(); });
  closer.Close();
  if (!sent.ok() &&
      (finished.ok() || finished.error_code() == grpc::StatusCode::CANCELLED)) {
    return absl::StatusOr<EvaluateResult>(sent);
  }
  if (!finished.ok()) return absl::StatusOr<EvaluateResult>(ToAbsl(finished));
  return absl::StatusOr<EvaluateResult>(FromProto(response));
}

absl::StatusOr<EvaluateResult> Client::Evaluate(
    int64_t rows, int64_t vocab, DType logits_dtype, const void* logits,
    DType targets_dtype, const void* targets, const EvaluateOptions& options,
    int64_t block_rows, const ProgressCallback& progress) {
  if (rows < 0 || vocab < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("bad shape [", rows, ", ", vocab, "]"));
  }
  const std::size_t row_bytes =
      static_cast<std::size_t>(vocab) * DTypeSize(logits_dtype);
  const std::size_t target_bytes = DTypeSize(targets_dtype);
  if (block_rows <= 0) {
    block_rows = std::max<int64_t>(
        1, static_cast<int64_t>(options_.chunk_bytes /
                                std::max<std::size_t>(row_bytes, 1)));
  }
  EvaluateOptions with_total = options;
  with_total.total_rows = rows;
  int64_t next_row = 0;
  const char* logits_bytes = static_cast<const char*>(logits);
  const char* targets_bytes = static_cast<const char*>(targets);
  return Evaluate(
      vocab, logits_dtype, targets_dtype, with_total,
      [&](RowBlock* block) -> absl::StatusOr<bool> {
        if (next_row >= rows) return false;
        const int64_t n = std::min(block_rows, rows - next_row);
        // The caller's memory, uncopied until the request or the socket.
        block->logits_view = absl::string_view(
            logits_bytes + next_row * row_bytes, n * row_bytes);
        block->targets_view = absl::string_view(
            targets_bytes + next_row * target_bytes, n * target_bytes);
        next_row += n;
        return true;
      },
      progress);
}

absl::StatusOr<bool> Client::Health(const std::string& service) {
  grpc::ClientContext context;
  PrepareContext(options_, channel_->channel.get(), &context);
  health::HealthCheckRequest request;
  request.set_service(service);
  health::HealthCheckResponse response;
  RETURN_IF_ERROR(
      ToAbsl(channel_->health->Check(&context, request, &response)));
  return response.status() == health::HealthCheckResponse::SERVING;
}

absl::StatusOr<ServerInfo> Client::GetServerInfo() {
  grpc::ClientContext context;
  PrepareContext(options_, channel_->channel.get(), &context);
  v1::ServerInfo response;
  RETURN_IF_ERROR(ToAbsl(channel_->lossd->GetServerInfo(
      &context, v1::GetServerInfoRequest(), &response)));
  return FromProto(response);
}

const char* DTypeString(DType dtype) {
  // The CLI's short spelling of bf16; every other name is the canonical one.
  return dtype == DType::kBFloat16 ? "bf16" : DTypeName(dtype);
}

absl::StatusOr<DType> DTypeFromString(const std::string& name) {
  const std::string lower = absl::AsciiStrToLower(name);
  if (lower == "float32" || lower == "fp32" || lower == "f32") {
    return DType::kFloat32;
  }
  if (lower == "bfloat16" || lower == "bf16") return DType::kBFloat16;
  if (lower == "float16" || lower == "fp16" || lower == "f16" ||
      lower == "half") {
    return DType::kFloat16;
  }
  if (lower == "int32" || lower == "i32") return DType::kInt32;
  if (lower == "int64" || lower == "i64") return DType::kInt64;
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown dtype '", name, "' (float32, bf16, float16, int32, int64)"));
}

// ---------------------------------------------------------------- linear

namespace {

absl::Status SetTargets(const Targets& targets,
                        v1::LinearForwardRequest* request) {
  if (!targets.handle.empty()) {
    request->set_targets_handle(targets.handle);
    return absl::OkStatus();
  }
  if (!IsTargetsDType(targets.inline_dtype)) {
    return absl::InvalidArgumentError(
        "targets: neither a handle nor inline int32/int64 data");
  }
  if (targets.inline_data == nullptr && targets.inline_bytes > 0) {
    return absl::InvalidArgumentError("inline targets: null data");
  }
  v1::InlineTensor* inline_targets = request->mutable_targets_inline();
  inline_targets->set_dtype(static_cast<v1::DType>(targets.inline_dtype));
  inline_targets->set_data(static_cast<const char*>(targets.inline_data),
                           targets.inline_bytes);
  return absl::OkStatus();
}

ForwardResult FromProto(const v1::ForwardResponse& response) {
  ForwardResult result;
  result.loss = response.loss();
  result.z_loss = response.z_loss();
  result.valid_tokens = response.valid_tokens();
  result.correct_tokens = response.correct_tokens();
  result.nonfinite_rows = response.nonfinite_rows();
  result.gradient = response.gradient();
  result.token_loss.assign(response.token_loss().begin(),
                           response.token_loss().end());
  result.token_lse.assign(response.token_lse().begin(),
                          response.token_lse().end());
  result.token_argmax.assign(response.token_argmax().begin(),
                             response.token_argmax().end());
  result.kernel_seconds = response.kernel_seconds();
  result.denominator = response.denominator();
  return result;
}

}  // namespace

absl::StatusOr<LinearForwardResult> Client::LinearForward(
    const std::string& hidden, const std::string& weight,
    const Targets& targets, const LinearForwardOptions& options) {
  v1::LinearForwardRequest request;
  request.set_hidden(hidden);
  request.set_weight(weight);
  request.set_bias(options.bias);
  RETURN_IF_ERROR(SetTargets(targets, &request));
  ToProto(options.loss, options.class_weights, request.mutable_options());
  request.set_mode(static_cast<v1::GradientMode>(options.mode));
  request.mutable_outputs()->set_token_loss(options.token_loss);
  request.mutable_outputs()->set_token_lse(options.token_lse);
  request.mutable_outputs()->set_token_argmax(options.token_argmax);
  request.set_gradient_label(options.gradient_label);
  request.set_accumulate(static_cast<v1::AccumulateMode>(options.accumulate));
  request.set_weight_grad(options.weight_grad);
  request.set_bias_grad(options.bias_grad);
  request.set_weight_grad_label(options.weight_grad_label);
  request.set_bias_grad_label(options.bias_grad_label);
  request.mutable_token_grad_output()->Add(options.token_grad_output.begin(),
                                           options.token_grad_output.end());

  grpc::ClientContext context;
  PrepareContext(options_, channel_->channel.get(), &context);
  v1::LinearForwardResponse response;
  RETURN_IF_ERROR(
      ToAbsl(channel_->lossd->LinearForward(&context, request, &response)));
  LinearForwardResult result;
  result.forward = FromProto(response.result());
  result.weight_grad = response.weight_grad();
  result.bias_grad = response.bias_grad();
  return result;
}

absl::StatusOr<TensorInfo> Client::Overwrite(
    const std::string& handle, DType dtype, absl::Span<const int64_t> shape,
    const void* data, std::size_t bytes, const ProgressCallback& progress) {
  ASSIGN_OR_RETURN(const int64_t expected, TensorBytes(dtype, shape));
  if (static_cast<uint64_t>(expected) != bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(bytes, " bytes given; dtype ", DTypeString(dtype),
                     " and the shape need ", expected));
  }
  if (data == nullptr && bytes > 0) {
    return absl::InvalidArgumentError("null data");
  }
  if (handle.empty()) {
    return absl::InvalidArgumentError("overwrite: empty handle");
  }
  v1::TensorHeader header;
  header.set_dtype(static_cast<v1::DType>(dtype));
  header.mutable_shape()->Add(shape.begin(), shape.end());
  header.set_overwrite_handle(handle);
  const char* base = static_cast<const char*>(data);
  const UploadSource source = [base](int64_t offset, std::size_t,
                                     void*) -> absl::StatusOr<const void*> {
    return base + offset;
  };
  grpc::ClientContext context;
  PrepareContext(options_, channel_->channel.get(), &context);
  Channel::Lease scratch(channel_.get(), 2, options_.piece_bytes);
  int64_t done = 0;
  ASSIGN_OR_RETURN(
      const v1::TensorInfo info,
      SendUpload(channel_->channel.get(), &context, header, source, 0,
                 static_cast<int64_t>(bytes),
                 PieceBytes(options_, static_cast<int64_t>(DTypeSize(dtype))),
                 scratch[0], scratch[1], options_.chunk_bytes,
                 [&](std::size_t n) {
                   done += static_cast<int64_t>(n);
                   if (progress) progress(done, static_cast<int64_t>(bytes));
                 }));
  return FromProto(info);
}

}  // namespace lossd
