// LossdService: request validation, protobuf <-> store/device mapping, and the
// reactors of the streaming RPCs (Upload, Download, Evaluate).
#include "server/service.h"

#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <deque>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/status_macros.h"
#include "server/data_plane.h"
#include "server/validation.h"

namespace lossd {

namespace pb = ::lossd::v1;

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  // absl and gRPC share the canonical code numbering.
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()),
                      std::string(status.message()));
}

namespace {

absl::Status DrainingError() {
  return absl::UnavailableError("lossd is draining; retry on another instance");
}

void ToProtoTime(absl::Time time, google::protobuf::Timestamp* out) {
  const int64_t nanos = absl::ToUnixNanos(time);
  int64_t seconds = nanos / 1000000000;
  int64_t rest = nanos % 1000000000;
  if (rest < 0) {
    rest += 1000000000;
    --seconds;
  }
  out->set_seconds(seconds);
  out->set_nanos(static_cast<int32_t>(rest));
}

void ToProto(const TensorRecord& info, pb::TensorInfo* out) {
  out->set_handle(info.handle);
  out->set_dtype(static_cast<pb::DType>(info.dtype));
  for (int64_t dim : info.shape) out->add_shape(dim);
  out->set_bytes(info.bytes);
  out->set_device(info.device);
  out->set_state(static_cast<pb::TensorState>(info.state));
  out->set_tenant(info.tenant);
  out->set_label(info.label);
  ToProtoTime(info.created, out->mutable_created());
  ToProtoTime(info.last_used, out->mutable_last_used());
  out->set_pending_scale(info.pending_scale);
  out->set_pending_token_scale(info.pending_token_scale);
}

// Host bytes made visible to the device: the bytes themselves on a
// host-accessible device, else a device copy freed on destruction.
class Staged {
 public:
  Staged() = default;
  Staged(const Staged&) = delete;
  Staged& operator=(const Staged&) = delete;
  ~Staged() {
    if (device_ != nullptr) device_->Free(owned_, bytes_);
  }

  absl::Status Stage(Device* device, const void* host, size_t bytes) {
    if (device->host_accessible() || bytes == 0) {
      pointer_ = host;
      return absl::OkStatus();
    }
    ASSIGN_OR_RETURN(owned_, device->Allocate(bytes));
    device_ = device;
    bytes_ = bytes;
    pointer_ = owned_;
    return device->CopyFromHost(owned_, 0, host, bytes);
  }
  const void* get() const { return pointer_; }

 private:
  Device* device_ = nullptr;
  void* owned_ = nullptr;
  size_t bytes_ = 0;
  const void* pointer_ = nullptr;
};

// A stored fp32 [vocab] class-weights tensor, leased for one computation.
absl::StatusOr<ReadLease> LeaseClassWeights(TensorStore* store,
                                            const std::string& tenant,
                                            const std::string& handle,
                                            int64_t vocab) {
  ASSIGN_OR_RETURN(std::shared_ptr<Tensor> weights, store->Get(tenant, handle));
  if (weights->dtype() != DType::kFloat32 || weights->shape().size() != 1 ||
      weights->shape()[0] != vocab) {
    return absl::InvalidArgumentError(absl::StrCat(
        "class_weights must be float32 [", vocab, "], got ",
        DTypeName(weights->dtype()), " ", ShapeString(weights->shape())));
  }
  if (weights->state() != TensorState::kLogits) {
    return absl::InvalidArgumentError("class_weights holds a gradient");
  }
  return store->BeginRead(std::move(weights));
}

// Finishes a unary RPC with `status`, and leaves the drain count.
grpc::ServerUnaryReactor* FinishUnary(grpc::CallbackServerContext* context,
                                      const absl::Status& status) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

// Serializes the response of a raw (ByteBuffer) reactor into `out`.
template <typename Message>
absl::Status SerializeResponse(const Message& message, grpc::ByteBuffer* out) {
  bool own_buffer = false;
  if (!grpc::SerializationTraits<Message>::Serialize(message, out, &own_buffer)
           .ok()) {
    return absl::InternalError(
        absl::StrCat("cannot serialize the ", Message::descriptor()->name()));
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------- Upload

// Upload is served on raw ByteBuffers rather than parsed UploadRequests (the
// constructor of LossdService installs the handler): a chunk's bytes then go
// from gRPC's receive slices straight to the device, one copy, where the
// generated handler would first copy each chunk into a std::string.

// The tag of UploadRequest.chunk (field 2, length-delimited).
constexpr uint8_t kChunkTag = (2 << 3) | 2;
// The tag plus the longest varint.
constexpr size_t kMaxChunkPrefix = 11;
// The most varint bytes protobuf accepts in a tag or a length (a longer one,
// even a padded small value, fails its parse).
constexpr size_t kMaxVarint32Bytes = 5;

// Where the data of a serialized UploadRequest of `size` bytes starts, when the
// message is exactly one `chunk` field (what every client sends after the
// header); nullopt for anything else. `head` holds its first
// min(size, kMaxChunkPrefix) bytes. Pure.
std::optional<size_t> ChunkPrefixBytes(const uint8_t* head, size_t head_size,
                                       size_t size) {
  if (head_size < 2 || head[0] != kChunkTag) return std::nullopt;
  uint64_t length = 0;
  // Protobuf rejects a length of more than 5 varint bytes; the parse judges.
  for (size_t i = 1; i < head_size && i <= kMaxVarint32Bytes; ++i) {
    length |= static_cast<uint64_t>(head[i] & 0x7f) << (7 * (i - 1));
    if ((head[i] & 0x80) == 0) {
      const size_t prefix = i + 1;
      if (size - prefix != length) return std::nullopt;
      return prefix;
    }
  }
  return std::nullopt;
}

// The admission of a streaming RPC (LossdService::Admit) and its undoing,
// which every reactor needs alike: admitted while the reactor is built,
// released in its OnDone. Reactor threads only; one reaction at a time.
class Admission {
 public:
  // Admits the RPC of `context` to `service` (borrowed; it outlives the RPC).
  // With `allow_draining`, a draining service admits it too and draining()
  // says so (an Upload stripe may still join an upload already started).
  Admission(LossdService* service, const grpc::ServerContextBase& context,
            bool allow_draining = false)
      : service_(service),
        status_(service->Admit(context, &tenant_, &slot_,
                               allow_draining ? &draining_ : nullptr)) {}
  Admission(const Admission&) = delete;
  Admission& operator=(const Admission&) = delete;

  // OK when admitted; otherwise Admit's error, to finish the RPC with.
  const absl::Status& status() const { return status_; }
  // The caller's tenant; empty when not admitted.
  const std::string& tenant() const { return tenant_; }
  // Admitted although the service drains (allow_draining only).
  bool draining() const { return draining_; }

  // Returns the tenant's in-flight slot, then leaves the drain count, if the
  // RPC was admitted. Call once, from OnDone, after what must go before the
  // drain completes (pending tensors, leases) is gone.
  void Release() {
    slot_ = InFlightSlot();
    if (status_.ok()) service_->Leave();
  }

 private:
  LossdService* const service_;
  std::string tenant_;
  InFlightSlot slot_;
  bool draining_ = false;
  const absl::Status status_;
};

// The pipelined read loop of the client-streaming RPCs (Upload, Evaluate):
// while one message is consumed, the next is already being received into the
// other of two buffers. Subclasses supply what a message, the stream's clean
// end and a cancelled or failed stream mean; reads complete on gRPC's threads,
// so every hook runs under mu_, one reaction at a time.
template <typename Message>
class PipelinedReadReactor : public grpc::ServerReadReactor<Message> {
 public:
  // An RPC waiting after DeferEnd has no read in flight: its cancellation
  // only shows here. A reading RPC learns it from its read.
  void OnCancel() final {
    absl::MutexLock lock(&mu_);
    if (!waiting_) return;
    waiting_ = false;
    const absl::Status cause = CancelledWhileWaiting();
    Abandon(cause);
    End(ToGrpcStatus(cause));
  }

  void OnReadDone(bool ok) final {
    absl::MutexLock lock(&mu_);
    if (finished_) return;  // an earlier message failed; this read is moot
    if (!ok) {
      // End of the client's stream, or a cancelled / broken one.
      finished_ = true;
      if (context_->IsCancelled()) {
        Abandon(absl::CancelledError("the RPC was cancelled"));
        End(grpc::Status::CANCELLED);
        return;
      }
      const absl::Status status = Complete();
      if (end_deferred_) return;
      if (!status.ok()) Abandon(status);
      End(ToGrpcStatus(status));
      return;
    }
    Message* message = &messages_[current_];
    current_ ^= 1;
    this->StartRead(&messages_[current_]);
    const absl::Status status = Consume(message);
    if (!status.ok()) {
      finished_ = true;
      Abandon(status);
      End(ToGrpcStatus(status));
    }
  }

 protected:
  // `context` is borrowed; gRPC keeps it alive until OnDone.
  explicit PipelinedReadReactor(grpc::CallbackServerContext* context)
      : context_(context) {}

  // Starts the first read. Once, from the subclass's constructor, when the RPC
  // was admitted (otherwise End instead).
  void StartReading() {
    absl::MutexLock lock(&mu_);
    this->StartRead(&messages_[current_]);
  }

  // One message of the stream; an error ends the RPC with it (after Abandon).
  // `message` may be modified; it is read into again afterwards.
  virtual absl::Status Consume(Message* message)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) = 0;
  // The client ended the stream cleanly: the RPC's status, its response filled
  // on OK; an error ends the RPC with it (after Abandon). A subclass that sets
  // end_deferred_ here ends the RPC itself, later.
  virtual absl::Status Complete() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) = 0;
  // The stream was cancelled or failed with `cause`: drop partial work early.
  virtual void Abandon(const absl::Status& /*cause*/)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {}
  // Finishes the RPC with `status` (and records it).
  virtual void End(const grpc::Status& status) = 0;

  // Makes later reads moot: the RPC is being ended from outside a read
  // reaction.
  void MarkFinished() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { finished_ = true; }

  // For Complete: the stream ended cleanly but the RPC's outcome comes from
  // elsewhere (the other stripes, or the data connections), which end it
  // later (calling EndWaiting first), unless OnCancel does. Returns
  // CancelledWhileWaiting() when the RPC was cancelled already (OnCancel ran
  // before this and saw nothing to do), to end it with.
  absl::Status DeferEnd() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    waiting_ = true;
    end_deferred_ = true;
    if (context_->IsCancelled()) {
      waiting_ = false;
      end_deferred_ = false;
      return CancelledWhileWaiting();
    }
    return absl::OkStatus();
  }
  // The RPC is being ended by whoever decided its outcome.
  void EndWaiting() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    MarkFinished();
    waiting_ = false;
  }
  // The status of an RPC cancelled (by the client or its deadline) while it
  // waited after DeferEnd.
  virtual absl::Status CancelledWhileWaiting()
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return absl::CancelledError("the RPC was cancelled");
  }

  grpc::CallbackServerContext* const context_;
  absl::Mutex mu_;
  bool end_deferred_ ABSL_GUARDED_BY(mu_) = false;

 private:
  Message messages_[2] ABSL_GUARDED_BY(mu_);
  int current_ ABSL_GUARDED_BY(mu_) = 0;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  bool waiting_ ABSL_GUARDED_BY(mu_) = false;  // after DeferEnd
};

// ------------------------------------------------------ striped Upload state

// A striped upload is assembled by several UploadReactors (one per stripe);
// the classes below are what they share. Lock order: a reactor's mu_ ->
// StripedUploads::mu_ -> StripeAssembly::mu_ -> the store's locks. Whoever
// decides an upload's fate (the stripe that commits it, the stripe that fails
// it, or the sweeper that abandons it) ends the other stripes' RPCs only after
// releasing StripedUploads::mu_ and StripeAssembly::mu_; it may hold its own
// reactor's mu_ then, and takes the others' one at a time (only one party ever
// decides an upload's fate, so two reactors never wait for each other).

class UploadReactor;

// The link between a party that may end an RPC from outside its reactor (a
// striped upload's assembly, a data transfer) and the reactor. Shared, so
// that the first party to claim it is the only one to end the RPC and nobody
// touches the reactor after it ended (gRPC deletes it in OnDone).
template <typename Reactor>
struct EndLink {
  explicit EndLink(Reactor* owner) : reactor(owner) {}
  // The right to end the RPC; false when another party has it.
  bool Claim() ABSL_LOCKS_EXCLUDED(mu) {
    absl::MutexLock lock(&mu);
    if (claimed) return false;
    claimed = true;
    return true;
  }
  Reactor* const reactor;  // alive until its RPC ends
  absl::Mutex mu;
  bool claimed ABSL_GUARDED_BY(mu) = false;
};
using StripeLink = EndLink<UploadReactor>;

// A refused request that named data connections: they are closed as they
// come, instead of waiting for a registration that will not come.
void RefuseDataToken(LossdService* service, const std::string& token) {
  if (!token.empty() && service->options().data_plane != nullptr) {
    service->options().data_plane->Refuse(token);
  }
}

// The data_token and data_connections of an Upload header or a Download
// request: OK when there is no token (and no count), or a token the data
// plane can take; `otherwise` says what the client can do instead.
absl::Status CheckDataConnections(const LossdService* service,
                                  const std::string& token, int connections,
                                  const char* otherwise) {
  if (token.empty()) {
    if (connections != 0) {
      return absl::InvalidArgumentError(
          "data_connections without a data_token");
    }
    return absl::OkStatus();
  }
  if (service->options().data_plane == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("this server offers no data connections "
                     "(ServerInfo.data_port is 0); ",
                     otherwise));
  }
  if (token.size() != kDataTokenBytes) {
    return absl::InvalidArgumentError(
        absl::StrFormat("a data_token must be %d bytes, got %d",
                        kDataTokenBytes, token.size()));
  }
  if (connections < 0 || connections > kMaxDataConnections) {
    return absl::InvalidArgumentError(
        absl::StrFormat("data_connections must be in [0, %d], got %d",
                        kMaxDataConnections, connections));
  }
  return absl::OkStatus();
}

// The byte ranges of `connections` data connections carrying `elements`
// elements of `element_bytes` each: connection i the elements of stripe i.
std::vector<DataTransfer::Range> DataRanges(int64_t elements,
                                            int64_t element_bytes,
                                            int connections) {
  std::vector<DataTransfer::Range> ranges;
  for (int i = 0; i < connections; ++i) {
    const ElementRange range = StripeElements(elements, i, connections);
    ranges.push_back({range.first * element_bytes,
                      (range.end - range.first) * element_bytes});
  }
  return ranges;
}

// Ends the RPC of each link not claimed yet: with `status`, and on OK with a
// response describing `info`. Call holding no assembly or registry lock.
void EndStripes(const std::vector<std::shared_ptr<StripeLink>>& links,
                const absl::Status& status, const TensorRecord* info);

// "stripe 3: INVALID_ARGUMENT: ...": why an upload failed, for the others.
std::string StripeCause(int index, const absl::Status& status) {
  return absl::StrCat("stripe ", index, ": ",
                      absl::StatusCodeToString(status.code()), ": ",
                      status.message());
}

// What every stripe of one upload must agree on.
struct StripeHeader {
  DType dtype = DType::kInvalid;
  std::vector<int64_t> shape;
  std::string label;
  int count = 1;
};

// One striped upload being assembled: the reserved tensor and its stripes.
// Thread-safe.
class StripeAssembly {
 public:
  StripeAssembly(std::string key, std::string upload_id, StripeHeader header,
                 std::shared_ptr<PendingTensor> pending, absl::Time deadline)
      : key_(std::move(key)),
        upload_id_(std::move(upload_id)),
        header_(std::move(header)),
        deadline_(deadline),
        pending_(std::move(pending)),
        links_(static_cast<size_t>(header_.count)) {}
  StripeAssembly(const StripeAssembly&) = delete;
  StripeAssembly& operator=(const StripeAssembly&) = delete;

  const std::string& key() const { return key_; }
  const std::string& upload_id() const { return upload_id_; }
  const StripeHeader& header() const { return header_; }

  // Attaches stripe `index` through `link`. Success: the pending tensor to
  // write into (the caller drops it once its writes are finished).
  // INVALID_ARGUMENT when `header` differs from the upload's or `index` is
  // already attached; ABORTED when the upload already completed or failed.
  absl::StatusOr<std::shared_ptr<PendingTensor>> Join(
      const StripeHeader& header, int index, std::shared_ptr<StripeLink> link)
      ABSL_LOCKS_EXCLUDED(mu_);

  // What a stripe whose bytes are all written learns.
  struct DoneResult {
    bool wait = false;     // others are still writing: the RPC waits
    bool decided = false;  // this call decided the upload's fate
    absl::Status status;   // otherwise this stripe's status
    TensorRecord info;     // on OK: the committed tensor
    // Stripes to end (with EndStripes) with `others_status`.
    std::vector<std::shared_ptr<StripeLink>> others;
    absl::Status others_status;
  };
  // Stripe `index` has all its bytes on the device; the last one commits the
  // tensor.
  DoneResult Done(int index) ABSL_LOCKS_EXCLUDED(mu_);

  // Fails the upload because of `cause`. Returns the attached stripes but
  // `exclude` (the failing one, ended by itself; -1 = none), to end with the
  // ABORTED status put in `*aborted`. When the upload's fate was already
  // decided: none, and `*aborted` is OK.
  std::vector<std::shared_ptr<StripeLink>> Fail(int exclude,
                                                const std::string& cause,
                                                absl::Status* aborted)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Not every stripe attached and the deadline passed.
  bool Overdue(absl::Time now) const ABSL_LOCKS_EXCLUDED(mu_);
  absl::Time deadline() const { return deadline_; }
  // The stripes that have not attached, as "2, 5 of 7".
  std::string MissingStripes() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  enum class Fate { kOpen, kCommitted, kFailed };

  const std::string key_;
  const std::string upload_id_;
  const StripeHeader header_;
  const absl::Time deadline_;
  mutable absl::Mutex mu_;
  Fate fate_ ABSL_GUARDED_BY(mu_) = Fate::kOpen;
  std::string cause_ ABSL_GUARDED_BY(mu_);  // why it failed
  std::shared_ptr<PendingTensor> pending_ ABSL_GUARDED_BY(mu_);
  std::vector<std::shared_ptr<StripeLink>> links_ ABSL_GUARDED_BY(mu_);
  int attached_ ABSL_GUARDED_BY(mu_) = 0;
  int done_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace

// The striped uploads in progress of one service, by tenant and upload_id,
// and the ids recently finished. A sweeper thread abandons the uploads whose
// stripes do not all arrive in time. Thread-safe.
class StripedUploads {
 public:
  struct Attached {
    std::shared_ptr<StripeAssembly> assembly;
    std::shared_ptr<PendingTensor> pending;
  };

  StripedUploads(TensorStore* store, absl::Duration timeout)
      : store_(store), timeout_(timeout), sweeper_([this] { Sweep(); }) {}
  StripedUploads(const StripedUploads&) = delete;
  StripedUploads& operator=(const StripedUploads&) = delete;
  ~StripedUploads() {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
    }
    sweeper_.join();
  }

  // Attaches stripe `stripe` of `tenant` with `header` through `link`,
  // creating the upload (reserving the whole tensor in the store) when it is
  // the first stripe and `may_create`. Errors: INVALID_ARGUMENT (a header
  // differing from the upload's, an index already attached: the upload then
  // fails), ABORTED (the id recently completed or failed), UNAVAILABLE (no
  // such upload and !may_create: draining), and the store's Create errors.
  absl::StatusOr<Attached> Attach(const std::string& tenant,
                                  const StripeSpec& stripe,
                                  const StripeHeader& header,
                                  std::shared_ptr<StripeLink> link,
                                  bool may_create) ABSL_LOCKS_EXCLUDED(mu_);

  // Fails the upload `upload_id` of `tenant`, if one is open, with `cause`
  // (a stripe whose header was rejected before it could attach).
  void FailIfOpen(const std::string& tenant, const std::string& upload_id,
                  const std::string& cause) ABSL_LOCKS_EXCLUDED(mu_);

  // Forgets an upload whose fate is decided; `what` ("completed", "failed:
  // ...") explains later stripes naming its id.
  void Finished(const StripeAssembly& assembly, std::string what)
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  static std::string Key(const std::string& tenant, const std::string& id) {
    // upload_ids never hold '/', tenants may: the id goes first.
    return absl::StrCat(id, "/", tenant);
  }
  void RememberLocked(const std::string& key, std::string what)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Sweep() ABSL_LOCKS_EXCLUDED(mu_);

  static constexpr size_t kRememberedIds = 4096;

  TensorStore* const store_;
  const absl::Duration timeout_;
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<StripeAssembly>> open_
      ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, std::string> finished_ ABSL_GUARDED_BY(mu_);
  std::deque<std::string> finished_order_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool changed_ ABSL_GUARDED_BY(mu_) = false;
  std::thread sweeper_;  // last: starts once the rest is built
};

namespace {

// ---------------------------------------------------------- UploadReactor

class UploadReactor final : public PipelinedReadReactor<grpc::ByteBuffer> {
 public:
  UploadReactor(LossdService* service, grpc::CallbackServerContext* context,
                grpc::ByteBuffer* response)
      : PipelinedReadReactor(context),
        service_(service),
        response_(response),
        admission_(service, *context, /*allow_draining=*/true) {
    if (!admission_.status().ok()) {
      End(ToGrpcStatus(admission_.status()));
      return;
    }
    StartReading();
  }

  void OnDone() override {
    // No connection writes into the pending tensor any more; then it (and
    // its reservation) goes before the drain count.
    if (transfer_ != nullptr) transfer_->Cancel();
    pending_.reset();
    {
      absl::MutexLock lock(&mu_);
      StopStripeWrites();
    }
    // A deadline or cancellation that raced the reply: the client never got
    // the handle, so the tensor must not stay behind.
    if (!committed_.empty() && context_->IsCancelled()) {
      service_->store()->Release(admission_.tenant(), committed_).IgnoreError();
    }
    assembly_.reset();
    admission_.Release();
    delete this;
  }

  // A stripe that waits for the others, or an upload for its data
  // connections, was cancelled.
  absl::Status CancelledWhileWaiting() override
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return absl::CancelledError(
        transfer_ != nullptr
            ? std::string("the upload was cancelled")
            : absl::StrCat("stripe ", stripe_index_, " was cancelled"));
  }

  // Ends this stripe's RPC on behalf of the party that decided the upload's
  // fate, which claimed the stripe's link: with `status`, and on OK with the
  // committed tensor `info`.
  void EndFromAssembly(const absl::Status& status, const TensorRecord* info)
      ABSL_LOCKS_EXCLUDED(mu_) {
    grpc::Status result = ToGrpcStatus(status);
    {
      absl::MutexLock lock(&mu_);
      EndWaiting();
      StopStripeWrites();
      if (status.ok()) {
        committed_ = info->handle;
        result = ToGrpcStatus(Respond(*info));
      }
    }
    // Outside mu_: once finished, gRPC may delete this reactor at any time.
    FinishRpc(result);
  }

  // The data connection's outcome, from its thread (or the data plane's
  // sweeper), by the party that claimed the link: commits the tensor on OK
  // and ends the RPC.
  void EndFromTransfer(const absl::Status& status) ABSL_LOCKS_EXCLUDED(mu_) {
    grpc::Status result;
    {
      absl::MutexLock lock(&mu_);
      EndWaiting();
      absl::Status outcome = status;
      if (outcome.ok() && pending_ == nullptr) {
        // The stream failed first (Abandon), and could not end the RPC.
        outcome = abandoned_.ok() ? absl::CancelledError("the upload ended")
                                  : abandoned_;
      }
      if (outcome.ok()) {
        pending_->MarkFilled();
        outcome = CommitPending();
      }
      pending_.reset();
      result = ToGrpcStatus(outcome);
    }
    FinishRpc(result);
  }

 private:
  // The next message is received into the other buffer while this one's bytes
  // are copied towards the device.
  absl::Status Consume(grpc::ByteBuffer* buffer) override
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const absl::Status status = ConsumeBytes(buffer);
    buffer->Clear();
    return status;
  }

  void Abandon(const absl::Status& cause) override
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    abandoned_ = cause;
    if (transfer_ != nullptr) transfer_->Cancel();
    pending_.reset();
    StopStripeWrites();
    if (assembly_ == nullptr) return;
    absl::Status aborted;
    std::vector<std::shared_ptr<StripeLink>> others = assembly_->Fail(
        stripe_index_, StripeCause(stripe_index_, cause), &aborted);
    if (aborted.ok()) return;  // already decided
    service_->stripes()->Finished(*assembly_,
                                  absl::StrCat("failed: ", aborted.message()));
    EndStripes(others, aborted, nullptr);
  }

  // Waits for this stripe's device copies and lets go of the shared pending
  // tensor (whose memory goes when no stripe and no assembly holds it).
  void StopStripeWrites() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (stripe_pending_ == nullptr) return;
    // A stripe without bytes never wrote; its address may be another
    // stripe's, whose writes are not this stripe's to finish.
    if (stripe_bytes_ > 0) {
      service_->store()->device()->FinishWrites(stripe_base_).IgnoreError();
    }
    stripe_pending_.reset();
  }

  absl::Status ConsumeBytes(grpc::ByteBuffer* buffer)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::vector<grpc::Slice> slices;
    if (!buffer->Dump(&slices).ok()) {
      return absl::InternalError("cannot read an UploadRequest's bytes");
    }
    const size_t size = buffer->Length();
    uint8_t head[kMaxChunkPrefix];
    size_t head_size = 0;
    for (const grpc::Slice& slice : slices) {
      const size_t n = std::min(slice.size(), kMaxChunkPrefix - head_size);
      std::memcpy(head + head_size, slice.begin(), n);
      head_size += n;
      if (head_size == kMaxChunkPrefix) break;
    }
    const std::optional<size_t> prefix =
        ChunkPrefixBytes(head, head_size, size);
    if (prefix.has_value()) return AppendChunk(slices, *prefix, size);
    // The header, or a chunk in an unusual encoding: the protobuf way.
    pb::UploadRequest request;
    if (!grpc::SerializationTraits<pb::UploadRequest>::Deserialize(buffer,
                                                                   &request)
             .ok()) {
      return absl::InvalidArgumentError("a malformed UploadRequest");
    }
    switch (request.kind_case()) {
      case pb::UploadRequest::kHeader: {
        if (pending_ != nullptr || link_ != nullptr) {
          return absl::InvalidArgumentError("a second header");
        }
        const absl::Status started = StartUpload(request.header());
        if (!started.ok()) {
          RefuseDataToken(service_, request.header().data_token());
        }
        return started;
      }
      case pb::UploadRequest::kChunk: {
        const grpc::Slice whole(request.chunk().data(), request.chunk().size(),
                                grpc::Slice::STATIC_SLICE);
        return AppendChunk({whole}, 0, request.chunk().size());
      }
      default:
        return absl::InvalidArgumentError(
            "an UploadRequest with neither header nor chunk");
    }
  }

  // The first header: a stripe's, or the tensor's to receive as chunks or
  // over data connections.
  absl::Status StartUpload(const pb::TensorHeader& header)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (header.has_stripe()) {
      if (!header.data_token().empty()) {
        return absl::InvalidArgumentError(
            "a striped upload cannot use a data connection");
      }
      return StartStripe(header);
    }
    if (admission_.draining()) return DrainingError();
    ASSIGN_OR_RETURN(TensorSpec spec, ValidateTensorHeader(header));
    RETURN_IF_ERROR(CheckDataConnections(service_, header.data_token(),
                                         header.data_connections(),
                                         "send the bytes as chunks"));
    ASSIGN_OR_RETURN(pending_, service_->store()->Create(
                                   admission_.tenant(), spec.dtype,
                                   std::move(spec.shape), header.label()));
    if (!header.data_token().empty()) return ExpectData(header);
    return absl::OkStatus();
  }

  // A header with a data_token: registers the transfer of the tensor's bytes
  // with the data plane, whose outcome ends the RPC (EndFromTransfer).
  absl::Status ExpectData(const pb::TensorHeader& header)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    int64_t elements = 1;
    for (int64_t dim : header.shape()) elements *= dim;
    std::vector<DataTransfer::Range> ranges =
        DataRanges(elements, pending_->bytes() / elements,
                   std::max(1, header.data_connections()));
    auto link = std::make_shared<StripeLink>(this);
    ASSIGN_OR_RETURN(
        transfer_,
        service_->options().data_plane->Expect(
            header.data_token(), std::move(ranges),
            ReceiveIntoDevice(service_->store()->device(), pending_->data(),
                              service_->metrics(), admission_.tenant()),
            [link](const absl::Status& status) {
              if (link->Claim()) link->reactor->EndFromTransfer(status);
            }));
    link_ = std::move(link);
    return absl::OkStatus();
  }

  // The header of one stripe of a striped upload: attaches to (or starts) the
  // assembly and finds this stripe's byte range.
  absl::Status StartStripe(const pb::TensorHeader& header)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    ASSIGN_OR_RETURN(const StripeSpec stripe,
                     ValidateUploadStripe(header.stripe()));
    StripedUploads* const stripes = service_->stripes();
    absl::StatusOr<TensorSpec> spec = ValidateTensorHeader(header);
    if (!spec.ok()) {
      stripes->FailIfOpen(admission_.tenant(), stripe.upload_id,
                          StripeCause(stripe.index, spec.status()));
      return spec.status();
    }
    StripeHeader shared;
    shared.dtype = spec->dtype;
    shared.shape = std::move(spec->shape);
    shared.label = header.label();
    shared.count = stripe.count;
    link_ = std::make_shared<StripeLink>(this);
    ASSIGN_OR_RETURN(StripedUploads::Attached attached,
                     stripes->Attach(admission_.tenant(), stripe, shared, link_,
                                     !admission_.draining()));
    assembly_ = std::move(attached.assembly);
    stripe_pending_ = std::move(attached.pending);
    stripe_index_ = stripe.index;
    int64_t elements = 1;
    for (int64_t dim : assembly_->header().shape) elements *= dim;
    const ElementRange range =
        StripeElements(elements, stripe.index, stripe.count);
    const int64_t element_bytes =
        static_cast<int64_t>(DTypeSize(assembly_->header().dtype));
    stripe_bytes_ = (range.end - range.first) * element_bytes;
    stripe_base_ = static_cast<char*>(stripe_pending_->data()) +
                   range.first * element_bytes;
    return absl::OkStatus();
  }

  // Appends bytes [prefix, size) of the concatenated `slices`.
  absl::Status AppendChunk(const std::vector<grpc::Slice>& slices,
                           size_t prefix, size_t size)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const int64_t length = static_cast<int64_t>(size - prefix);
    if (transfer_ != nullptr) {
      return absl::InvalidArgumentError(
          "a chunk on the stream of an upload over a data connection");
    }
    if (link_ != nullptr) return AppendStripeChunk(slices, prefix, length);
    if (pending_ == nullptr) {
      return absl::InvalidArgumentError("data before the header");
    }
    if (length > pending_->bytes() - pending_->received_bytes()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "more bytes than the header says: %d expected, at least %d received",
          pending_->bytes(), pending_->received_bytes() + length));
    }
    size_t skip = prefix;
    for (const grpc::Slice& slice : slices) {
      if (skip >= slice.size()) {
        skip -= slice.size();
        continue;
      }
      RETURN_IF_ERROR(
          pending_->Append(slice.begin() + skip, slice.size() - skip));
      skip = 0;
    }
    if (service_->metrics() != nullptr) {
      service_->metrics()->AddTransferBytes(TransferDirection::kUpload, length,
                                            admission_.tenant());
    }
    return absl::OkStatus();
  }

  // A stripe writes straight into its range of the shared buffer, its device
  // copies keyed by the range's start (Device::CopyFromHostAsync), so that
  // stripes on different threads never share a staging pipeline.
  absl::Status AppendStripeChunk(const std::vector<grpc::Slice>& slices,
                                 size_t prefix, int64_t length)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (stripe_pending_ == nullptr) {
      return absl::AbortedError(
          absl::StrCat("striped upload ", assembly_->upload_id(), " ended"));
    }
    if (length > stripe_bytes_ - stripe_received_) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "more bytes than stripe %d of %d carries: %d expected, at least %d "
          "received",
          stripe_index_, assembly_->header().count, stripe_bytes_,
          stripe_received_ + length));
    }
    Device* device = service_->store()->device();
    size_t skip = prefix;
    for (const grpc::Slice& slice : slices) {
      if (skip >= slice.size()) {
        skip -= slice.size();
        continue;
      }
      const size_t piece = slice.size() - skip;
      RETURN_IF_ERROR(device->CopyFromHostAsync(
          stripe_base_, static_cast<size_t>(stripe_received_),
          slice.begin() + skip, piece));
      stripe_received_ += static_cast<int64_t>(piece);
      skip = 0;
    }
    if (service_->metrics() != nullptr) {
      service_->metrics()->AddTransferBytes(TransferDirection::kUpload, length,
                                            admission_.tenant());
    }
    return absl::OkStatus();
  }

  absl::Status Complete() override ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (transfer_ != nullptr) {
      return DeferEnd();
    }
    if (link_ != nullptr) return CompleteStripe();
    if (pending_ == nullptr) {
      return absl::InvalidArgumentError("the stream ended before a header");
    }
    return CommitPending();
  }

  // Publishes the pending tensor and fills the response.
  absl::Status CommitPending() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    absl::StatusOr<std::shared_ptr<Tensor>> tensor = pending_->Commit();
    pending_.reset();
    if (!tensor.ok()) return tensor.status();
    committed_ = (*tensor)->handle();
    return Respond((*tensor)->Info());
  }

  // This stripe's stream ended cleanly: its bytes are checked and flushed to
  // the device; then it waits for the others, or (the last) commits for all.
  absl::Status CompleteStripe() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (stripe_received_ != stripe_bytes_) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "fewer bytes than stripe %d of %d carries: %d expected, %d received",
          stripe_index_, assembly_->header().count, stripe_bytes_,
          stripe_received_));
    }
    if (stripe_pending_ != nullptr && stripe_bytes_ > 0) {
      RETURN_IF_ERROR(service_->store()->device()->FinishWrites(stripe_base_));
    }
    stripe_pending_.reset();
    StripeAssembly::DoneResult done = assembly_->Done(stripe_index_);
    if (done.wait) {
      return DeferEnd();
    }
    if (done.decided) {
      service_->stripes()->Finished(
          *assembly_, done.status.ok()
                          ? std::string("completed")
                          : absl::StrCat("failed: ", done.status.message()));
    }
    EndStripes(done.others, done.others_status,
               done.others_status.ok() ? &done.info : nullptr);
    if (!done.status.ok()) return done.status;
    committed_ = done.info.handle;
    return Respond(done.info);
  }

  absl::Status Respond(const TensorRecord& info) {
    pb::UploadResponse response;
    ToProto(info, response.mutable_tensor());
    return SerializeResponse(response, response_);
  }

  // Finishes the RPC with `status`, unless (a stripe) another party claimed
  // that right.
  void End(const grpc::Status& status) override {
    if (link_ != nullptr && !link_->Claim()) return;
    FinishRpc(status);
  }

  // Recorded before Finish, so that a client that has its status also sees it
  // counted.
  void FinishRpc(const grpc::Status& status) {
    service_->RecordRpc("Upload", status.error_code(), start_,
                        admission_.tenant());
    Finish(status);
  }

  LossdService* const service_;
  const absl::Time start_ = absl::Now();
  grpc::ByteBuffer* const response_;
  std::unique_ptr<PendingTensor> pending_;
  std::string committed_;  // the handle, once published
  // An upload over a data connection: its transfer (the link_ then ties the
  // transfer's outcome to this RPC), and why the stream failed, if it did.
  std::shared_ptr<DataTransfer> transfer_;
  absl::Status abandoned_;
  Admission admission_;
  // A stripe of a striped upload: its link, assembly and byte range.
  std::shared_ptr<StripeLink> link_;
  std::shared_ptr<StripeAssembly> assembly_;
  std::shared_ptr<PendingTensor> stripe_pending_ ABSL_GUARDED_BY(mu_);
  char* stripe_base_ = nullptr;
  int64_t stripe_bytes_ = 0;
  int64_t stripe_received_ = 0;
  int stripe_index_ = -1;
};

// ------------------------------------------------------ striped Upload logic

void EndStripes(const std::vector<std::shared_ptr<StripeLink>>& links,
                const absl::Status& status, const TensorRecord* info) {
  for (const std::shared_ptr<StripeLink>& link : links) {
    if (link->Claim()) link->reactor->EndFromAssembly(status, info);
  }
}

absl::StatusOr<std::shared_ptr<PendingTensor>> StripeAssembly::Join(
    const StripeHeader& header, int index, std::shared_ptr<StripeLink> link) {
  absl::MutexLock lock(&mu_);
  if (fate_ != Fate::kOpen) {
    return absl::AbortedError(absl::StrCat(
        "striped upload ", upload_id_,
        fate_ == Fate::kCommitted ? " already completed" : " failed: ", cause_,
        "; a new upload needs a new upload_id"));
  }
  if (header.dtype != header_.dtype || header.shape != header_.shape ||
      header.label != header_.label || header.count != header_.count) {
    return absl::InvalidArgumentError(absl::StrCat(
        "stripe ", index, " of striped upload ", upload_id_, " says ",
        DTypeName(header.dtype), " ", ShapeString(header.shape), " label '",
        header.label, "' in ", header.count, " stripes; the upload is ",
        DTypeName(header_.dtype), " ", ShapeString(header_.shape), " label '",
        header_.label, "' in ", header_.count, " stripes"));
  }
  if (links_[static_cast<size_t>(index)] != nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "stripe ", index, " of striped upload ", upload_id_, " arrived twice"));
  }
  links_[static_cast<size_t>(index)] = std::move(link);
  ++attached_;
  return pending_;
}

StripeAssembly::DoneResult StripeAssembly::Done(int index) {
  DoneResult result;
  absl::MutexLock lock(&mu_);
  if (fate_ != Fate::kOpen) {
    result.status = absl::AbortedError(
        absl::StrCat("striped upload ", upload_id_, " failed: ", cause_));
    return result;
  }
  if (++done_ < header_.count) {
    result.wait = true;
    return result;
  }
  for (int i = 0; i < header_.count; ++i) {
    if (i != index) result.others.push_back(links_[static_cast<size_t>(i)]);
  }
  links_.clear();
  result.decided = true;
  pending_->MarkFilled();
  absl::StatusOr<std::shared_ptr<Tensor>> tensor = pending_->Commit();
  pending_.reset();
  if (!tensor.ok()) {
    fate_ = Fate::kFailed;
    cause_ = std::string(tensor.status().message());
    result.status = tensor.status();
    result.others_status = absl::AbortedError(
        absl::StrCat("striped upload ", upload_id_, " failed: ", cause_));
    return result;
  }
  fate_ = Fate::kCommitted;
  result.info = (*tensor)->Info();
  return result;
}

std::vector<std::shared_ptr<StripeLink>> StripeAssembly::Fail(
    int exclude, const std::string& cause, absl::Status* aborted) {
  std::vector<std::shared_ptr<StripeLink>> others;
  absl::MutexLock lock(&mu_);
  if (fate_ != Fate::kOpen) {
    *aborted = absl::OkStatus();
    return others;
  }
  fate_ = Fate::kFailed;
  cause_ = cause;
  *aborted = absl::AbortedError(
      absl::StrCat("striped upload ", upload_id_, " failed: ", cause_));
  for (int i = 0; i < static_cast<int>(links_.size()); ++i) {
    if (i != exclude && links_[static_cast<size_t>(i)] != nullptr) {
      others.push_back(links_[static_cast<size_t>(i)]);
    }
  }
  links_.clear();
  // The memory goes once the stripes still writing let go of it too.
  pending_.reset();
  return others;
}

bool StripeAssembly::Overdue(absl::Time now) const {
  absl::MutexLock lock(&mu_);
  return fate_ == Fate::kOpen && attached_ < header_.count && now >= deadline_;
}

std::string StripeAssembly::MissingStripes() const {
  absl::MutexLock lock(&mu_);
  std::string missing;
  for (int i = 0; i < static_cast<int>(links_.size()); ++i) {
    if (links_[static_cast<size_t>(i)] == nullptr) {
      absl::StrAppend(&missing, missing.empty() ? "" : ", ", i);
    }
  }
  return absl::StrCat(missing, " of ", header_.count);
}

}  // namespace

absl::StatusOr<StripedUploads::Attached> StripedUploads::Attach(
    const std::string& tenant, const StripeSpec& stripe,
    const StripeHeader& header, std::shared_ptr<StripeLink> link,
    bool may_create) {
  const std::string key = Key(tenant, stripe.upload_id);
  std::vector<std::shared_ptr<StripeLink>> others;
  absl::Status aborted;
  absl::Status status;
  {
    absl::MutexLock lock(&mu_);
    auto found = open_.find(key);
    if (found == open_.end()) {
      auto gone = finished_.find(key);
      if (gone != finished_.end()) {
        return absl::AbortedError(
            absl::StrCat("striped upload ", stripe.upload_id, " already ",
                         gone->second, "; a new upload needs a new upload_id"));
      }
      if (!may_create) return DrainingError();
      ASSIGN_OR_RETURN(
          std::unique_ptr<PendingTensor> pending,
          store_->Create(tenant, header.dtype, header.shape, header.label));
      auto assembly = std::make_shared<StripeAssembly>(
          key, stripe.upload_id, header,
          std::shared_ptr<PendingTensor>(std::move(pending)),
          absl::Now() + timeout_);
      ASSIGN_OR_RETURN(std::shared_ptr<PendingTensor> shared,
                       assembly->Join(header, stripe.index, std::move(link)));
      open_[key] = assembly;
      changed_ = true;
      return Attached{std::move(assembly), std::move(shared)};
    }
    std::shared_ptr<StripeAssembly> assembly = found->second;
    absl::StatusOr<std::shared_ptr<PendingTensor>> shared =
        assembly->Join(header, stripe.index, std::move(link));
    if (shared.ok()) return Attached{std::move(assembly), *std::move(shared)};
    status = shared.status();
    if (status.code() != absl::StatusCode::kInvalidArgument) return status;
    // A stripe that contradicts the upload fails all of it.
    others = assembly->Fail(-1, StripeCause(stripe.index, status), &aborted);
    open_.erase(found);
    RememberLocked(key, absl::StrCat("failed: ", aborted.message()));
  }
  EndStripes(others, aborted, nullptr);
  return status;
}

void StripedUploads::FailIfOpen(const std::string& tenant,
                                const std::string& upload_id,
                                const std::string& cause) {
  const std::string key = Key(tenant, upload_id);
  std::vector<std::shared_ptr<StripeLink>> others;
  absl::Status aborted;
  {
    absl::MutexLock lock(&mu_);
    auto found = open_.find(key);
    if (found == open_.end()) return;
    others = found->second->Fail(-1, cause, &aborted);
    open_.erase(found);
    RememberLocked(key, absl::StrCat("failed: ", aborted.message()));
  }
  EndStripes(others, aborted, nullptr);
}

void StripedUploads::Finished(const StripeAssembly& assembly,
                              std::string what) {
  absl::MutexLock lock(&mu_);
  auto found = open_.find(assembly.key());
  if (found != open_.end() && found->second.get() == &assembly) {
    open_.erase(found);
  }
  RememberLocked(assembly.key(), std::move(what));
}

void StripedUploads::RememberLocked(const std::string& key, std::string what) {
  if (finished_.insert_or_assign(key, std::move(what)).second) {
    finished_order_.push_back(key);
  }
  while (finished_order_.size() > kRememberedIds) {
    finished_.erase(finished_order_.front());
    finished_order_.pop_front();
  }
}

void StripedUploads::Sweep() {
  absl::MutexLock lock(&mu_);
  while (!stop_) {
    absl::Time next = absl::InfiniteFuture();
    for (const auto& [key, assembly] : open_) {
      next = std::min(next, assembly->deadline());
    }
    auto wake = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
      return stop_ || changed_;
    };
    mu_.AwaitWithDeadline(absl::Condition(&wake), next);
    changed_ = false;
    if (stop_) break;
    const absl::Time now = absl::Now();
    std::vector<std::shared_ptr<StripeAssembly>> overdue;
    for (auto it = open_.begin(); it != open_.end();) {
      if (it->second->Overdue(now)) {
        overdue.push_back(it->second);
        open_.erase(it++);
      } else {
        ++it;
      }
    }
    for (const std::shared_ptr<StripeAssembly>& assembly : overdue) {
      const std::string cause = absl::StrCat(
          "stripes ", assembly->MissingStripes(), " did not arrive within ",
          absl::FormatDuration(timeout_));
      absl::Status aborted;
      std::vector<std::shared_ptr<StripeLink>> others =
          assembly->Fail(-1, cause, &aborted);
      RememberLocked(assembly->key(),
                     absl::StrCat("failed: ", aborted.message()));
      // Ending RPCs takes reactor locks: not under mu_ (a reactor may be
      // waiting for mu_ in Attach while holding its own).
      mu_.Unlock();
      EndStripes(others, aborted, nullptr);
      mu_.Lock();
    }
  }
}

namespace {

// The generated (parsing) Upload and Evaluate handlers are replaced by raw
// ones; this reactor only answers if that ever stops being so.
template <typename Request>
class UnreachableReadReactor final : public grpc::ServerReadReactor<Request> {
 public:
  UnreachableReadReactor() {
    this->Finish(
        grpc::Status(grpc::StatusCode::INTERNAL, "served by the raw handler"));
  }
  void OnDone() override { delete this; }
};

// ---------------------------------------------------------------- Download

class DownloadReactor;
using DownloadLink = EndLink<DownloadReactor>;

class DownloadReactor final
    : public grpc::ServerWriteReactor<pb::DownloadResponse> {
 public:
  DownloadReactor(LossdService* service, grpc::CallbackServerContext* context,
                  const pb::DownloadRequest& request)
      : service_(service), admission_(service, *context) {
    if (!admission_.status().ok()) {
      End(ToGrpcStatus(admission_.status()));
      return;
    }
    // Held from here: a transfer over data connections may end as soon as
    // Start registers it (on a connection's thread); its outcome then waits
    // here and finds the header being written.
    absl::MutexLock lock(&mu_);
    const absl::Status status = Start(context, request);
    if (!status.ok()) {
      RefuseDataToken(service_, request.data_token());
      End(ToGrpcStatus(status));
      return;
    }
    StartWrite(&response_);
    if (transfer_ != nullptr) {
      writing_header_ = true;
    } else {
      Prefetch();
    }
  }

  void OnWriteDone(bool ok) override {
    absl::MutexLock lock(&mu_);
    if (transfer_ != nullptr) {
      // The header of a download over data connections: the RPC ends when
      // the transfer does (or now, if it already did).
      writing_header_ = false;
      if (deferred_.has_value()) {
        End(ok ? ToGrpcStatus(*deferred_)
               : grpc::Status(grpc::StatusCode::CANCELLED, "the stream broke"));
      } else if ((!ok || cancelled_) && link_->Claim()) {
        End(grpc::Status(
            grpc::StatusCode::CANCELLED,
            ok ? "the download was cancelled" : "the stream broke"));
      }
      return;
    }
    if (!ok) {
      End(grpc::Status(grpc::StatusCode::CANCELLED, "the stream broke"));
      return;
    }
    if (!spare_status_.ok()) {
      End(ToGrpcStatus(spare_status_));
      return;
    }
    if (!spare_ready_) {
      End(grpc::Status::OK);
      return;
    }
    response_.Swap(&spare_);
    spare_ready_ = false;
    StartWrite(&response_);
    Prefetch();
  }

  // A download over data connections has no write in flight while its
  // transfer runs: cancellation (or the deadline) only shows here.
  void OnCancel() override {
    absl::MutexLock lock(&mu_);
    if (transfer_ == nullptr) return;
    if (writing_header_) {
      cancelled_ = true;  // OnWriteDone ends the RPC
      return;
    }
    if (!link_->Claim()) return;
    End(grpc::Status(grpc::StatusCode::CANCELLED,
                     "the download was cancelled"));
  }

  void OnDone() override {
    lease_ = ReadLease();
    admission_.Release();
    delete this;
  }

  // The data connections' outcome, from the transfer's last connection (or
  // the data plane's sweeper), by the party that claimed the link.
  void EndFromTransfer(const absl::Status& status) ABSL_LOCKS_EXCLUDED(mu_) {
    {
      absl::MutexLock lock(&mu_);
      if (writing_header_) {
        deferred_ = status;  // OnWriteDone ends the RPC
        return;
      }
    }
    // Outside mu_: once finished, gRPC may delete this reactor at any time.
    End(ToGrpcStatus(status));
  }

 private:
  absl::Status Start(grpc::CallbackServerContext* context,
                     const pb::DownloadRequest& request) {
    ASSIGN_OR_RETURN(
        DownloadSpec spec,
        ValidateDownloadRequest(request, service_->options().max_chunk_bytes));
    RETURN_IF_ERROR(CheckDataConnections(service_, request.data_token(),
                                         request.data_connections(),
                                         "download without a data_token"));
    DType as_dtype = spec.dtype;
    ASSIGN_OR_RETURN(
        std::shared_ptr<Tensor> tensor,
        service_->store()->Get(admission_.tenant(), request.handle()));
    const DType stored = tensor->dtype();
    if (as_dtype == DType::kInvalid) as_dtype = stored;
    const int64_t out_size = static_cast<int64_t>(DTypeSize(as_dtype));
    ASSIGN_OR_RETURN(
        chunk_elements_,
        DownloadChunkElements(stored, as_dtype,
                              spec.chunk_bytes == 0
                                  ? service_->options().default_chunk_bytes
                                  : spec.chunk_bytes));
    ASSIGN_OR_RETURN(const ElementRange range,
                     DownloadElements(spec, as_dtype, tensor->elements()));
    lease_ = service_->store()->BeginRead(std::move(tensor));
    dtype_ = as_dtype;
    next_element_ = range.first;
    elements_ = range.end;
    TensorRecord info = lease_.tensor()->Info();
    // The header describes what is sent: converted, with the factor applied,
    // and only the range asked for.
    info.dtype = as_dtype;
    info.bytes = (range.end - range.first) * out_size;
    info.pending_scale = lease_.view().scale;
    info.pending_token_scale = !lease_.view().row_scale.empty();
    ToProto(info, response_.mutable_header());
    if (request.data_token().empty()) return absl::OkStatus();
    auto link = std::make_shared<DownloadLink>(this);
    ASSIGN_OR_RETURN(transfer_,
                     service_->options().data_plane->Expect(
                         request.data_token(),
                         DataRanges(range.end - range.first, out_size,
                                    std::max(1, request.data_connections())),
                         SendWork(range.first, out_size),
                         [link](const absl::Status& status) {
                           if (link->Claim())
                             link->reactor->EndFromTransfer(status);
                         }));
    link_ = std::move(link);
    return absl::OkStatus();
  }

  // The work of one data connection: its elements, converted and scaled on
  // the device in pieces of at least kDataPieceBytes, sent as they come. Two
  // host buffers: the next piece is read (on a helper thread) while this one
  // is sent. Runs while the lease is held (End cancels the transfer, which
  // waits for every connection's work to stop, before it lets the lease go).
  DataTransfer::Work SendWork(int64_t first, int64_t out_size) {
    const Tensor* const tensor = lease_.tensor().get();
    const ReadView* const view = &lease_.view();
    const int64_t piece = std::max(chunk_elements_, kDataPieceBytes / out_size);
    return [tensor, view, first, out_size, piece, dtype = dtype_,
            metrics = service_->metrics(), tenant = admission_.tenant()](
               int index, int fd,
               const DataTransfer::Range& range) -> absl::Status {
      const int64_t count = range.bytes / out_size;
      const int64_t start = first + range.offset / out_size;
      auto read = [&](int64_t at, int64_t n, char* into) {
        return tensor->device()->ReadConverted(
            tensor->data(), tensor->dtype(), start + at, n,
            tensor->row_length(), static_cast<float>(view->scale),
            view->row_scale.empty() ? nullptr : view->row_scale.data(), into,
            dtype);
      };
      const size_t buffer_bytes =
          static_cast<size_t>(std::min(count, piece) * out_size);
      std::vector<char> host[2];
      host[0].resize(buffer_bytes);
      if (count > piece) host[1].resize(buffer_bytes);
      RETURN_IF_ERROR(read(0, std::min(piece, count), host[0].data()));
      int64_t sent = 0;
      for (int64_t done = 0, k = 0; done < count; ++k) {
        const int64_t n = std::min(piece, count - done);
        const int64_t next = std::min(piece, count - done - n);
        // Joined before anything returns: no read outlives the work.
        std::future<absl::Status> reading;
        if (next > 0) {
          try {
            reading = std::async(std::launch::async, read, done + n, next,
                                 host[(k + 1) % 2].data());
          } catch (const std::system_error&) {
            // No thread to be had: the next piece is read after this one.
          }
        }
        const size_t bytes = static_cast<size_t>(n * out_size);
        const absl::Status sending = SendOnDataConnection(
            fd, index, host[k % 2].data(), bytes, sent, range.bytes);
        absl::Status read_next;
        if (reading.valid()) {
          read_next = reading.get();
        } else if (next > 0 && sending.ok()) {
          read_next = read(done + n, next, host[(k + 1) % 2].data());
        }
        RETURN_IF_ERROR(sending);
        RETURN_IF_ERROR(read_next);
        sent += static_cast<int64_t>(bytes);
        done += n;
        if (metrics != nullptr) {
          metrics->AddTransferBytes(TransferDirection::kDownload,
                                    static_cast<int64_t>(bytes), tenant);
        }
      }
      return absl::OkStatus();
    };
  }

  // Reads the next chunk into spare_ while response_ is being sent, so that
  // the device's conversion and copy overlap the network.
  void Prefetch() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (next_element_ >= elements_) return;
    spare_status_ = FillChunk(&spare_);
    spare_ready_ = spare_status_.ok();
  }

  absl::Status FillChunk(pb::DownloadResponse* out) {
    const Tensor& tensor = *lease_.tensor();
    const int64_t count = std::min(chunk_elements_, elements_ - next_element_);
    std::string* chunk = out->mutable_chunk();
    chunk->resize(static_cast<size_t>(count) * DTypeSize(dtype_));
    const ReadView& view = lease_.view();
    RETURN_IF_ERROR(tensor.device()->ReadConverted(
        tensor.data(), tensor.dtype(), next_element_, count,
        tensor.row_length(), static_cast<float>(view.scale),
        view.row_scale.empty() ? nullptr : view.row_scale.data(), chunk->data(),
        dtype_));
    next_element_ += count;
    if (service_->metrics() != nullptr) {
      service_->metrics()->AddTransferBytes(TransferDirection::kDownload,
                                            static_cast<int64_t>(chunk->size()),
                                            admission_.tenant());
    }
    return absl::OkStatus();
  }

  // Finishes the RPC with `status`. Recorded before Finish, so that a client
  // that has its status also sees it counted.
  void End(const grpc::Status& status) {
    // No data connection reads the tensor any more.
    if (transfer_ != nullptr) transfer_->Cancel();
    service_->RecordRpc("Download", status.error_code(), start_,
                        admission_.tenant());
    // The read lease ends before the client can see the status, so that an
    // RPC it sends next (Backward with materialize) does not find the tensor
    // still in use.
    lease_ = ReadLease();
    Finish(status);
  }

  // What a data connection's piece of the download is at least.
  static constexpr int64_t kDataPieceBytes = int64_t{4} << 20;

  LossdService* const service_;
  const absl::Time start_ = absl::Now();
  // Writes complete on gRPC's threads: one reaction at a time here.
  absl::Mutex mu_;
  pb::DownloadResponse response_;
  pb::DownloadResponse spare_ ABSL_GUARDED_BY(mu_);
  bool spare_ready_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status spare_status_ ABSL_GUARDED_BY(mu_);
  ReadLease lease_;
  DType dtype_ = DType::kInvalid;
  int64_t elements_ = 0;
  int64_t chunk_elements_ = 0;
  int64_t next_element_ = 0;
  Admission admission_;
  // A download over data connections: its transfer, the link that ties the
  // transfer's outcome to this RPC, and that outcome when it came while the
  // header was still being written.
  std::shared_ptr<DataTransfer> transfer_;
  std::shared_ptr<DownloadLink> link_;
  bool writing_header_ ABSL_GUARDED_BY(mu_) = false;
  std::optional<absl::Status> deferred_ ABSL_GUARDED_BY(mu_);
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;  // while writing the header
};

// ---------------------------------------------------------------- Evaluate

// Evaluate is served on raw ByteBuffers too (the constructor of LossdService
// installs the handler): a block's logits go from gRPC's receive slices to the
// device in one copy (pinned staging on CUDA), where parsing would first copy
// the whole block into a std::string.

// A byte range of a message held in slices: [offset, offset + size).
struct ByteRange {
  size_t offset = 0;
  size_t size = 0;
};

// A forward-only reader of the concatenation of `slices` (borrowed).
class SliceReader {
 public:
  explicit SliceReader(const std::vector<grpc::Slice>& slices)
      : slices_(slices) {}

  size_t position() const { return position_; }

  // False at the end of the bytes.
  bool ReadByte(uint8_t* byte) {
    while (slice_ < slices_.size() && in_slice_ == slices_[slice_].size()) {
      ++slice_;
      in_slice_ = 0;
    }
    if (slice_ == slices_.size()) return false;
    *byte = slices_[slice_].begin()[in_slice_++];
    ++position_;
    return true;
  }

  // A base-128 varint of at most `max_bytes` bytes; false when cut short or
  // longer.
  bool ReadVarint(uint64_t* value, size_t max_bytes = 10) {
    *value = 0;
    for (size_t i = 0; i < max_bytes; ++i) {
      uint8_t byte;
      if (!ReadByte(&byte)) return false;
      *value |= static_cast<uint64_t>(byte & 0x7f) << (7 * i);
      if ((byte & 0x80) == 0) return true;
    }
    return false;
  }

  // Skips `bytes`; false when fewer remain than `limit - position()` allows.
  bool Skip(uint64_t bytes, size_t limit) {
    if (bytes > limit - position_) return false;
    size_t left = static_cast<size_t>(bytes);
    position_ += left;
    while (left > 0) {
      const size_t here = slices_[slice_].size() - in_slice_;
      const size_t step = std::min(here, left);
      in_slice_ += step;
      left -= step;
      if (in_slice_ == slices_[slice_].size() && left > 0) {
        ++slice_;
        in_slice_ = 0;
      }
    }
    return true;
  }

 private:
  const std::vector<grpc::Slice>& slices_;
  size_t slice_ = 0;
  size_t in_slice_ = 0;
  size_t position_ = 0;
};

// Calls `consume(pointer, size)` for the pieces of `range` of `slices` in
// order; stops at (and returns) the first error.
template <typename Consume>
absl::Status ForEachPiece(const std::vector<grpc::Slice>& slices,
                          ByteRange range, Consume consume) {
  size_t skip = range.offset;
  size_t left = range.size;
  for (const grpc::Slice& slice : slices) {
    if (left == 0) break;
    if (skip >= slice.size()) {
      skip -= slice.size();
      continue;
    }
    const size_t piece = std::min(slice.size() - skip, left);
    RETURN_IF_ERROR(consume(slice.begin() + skip, piece));
    left -= piece;
    skip = 0;
  }
  return absl::OkStatus();
}

// The tag of EvaluateRequest.block (field 2, length-delimited).
constexpr uint8_t kBlockTag = (2 << 3) | 2;

// Where the logits and targets of a serialized EvaluateRequest of `size` bytes
// lie, when the message is exactly one `block` field (what every client sends
// after the header) and well formed; false for anything else (the caller then
// parses it the protobuf way, which also judges malformed bytes). As protobuf
// does, the last occurrence of a field wins and unknown fields are skipped.
bool FindRowBlock(const std::vector<grpc::Slice>& slices, size_t size,
                  ByteRange* logits, ByteRange* targets) {
  SliceReader reader(slices);
  uint8_t tag;
  uint64_t length;
  if (!reader.ReadByte(&tag) || tag != kBlockTag ||
      !reader.ReadVarint(&length, kMaxVarint32Bytes) ||
      length != size - reader.position()) {
    return false;
  }
  *logits = ByteRange();
  *targets = ByteRange();
  while (reader.position() < size) {
    uint64_t key;
    // Keys and lengths that protobuf would reject (or, for a 5-byte key past
    // 32 bits, truncate) are left to its parse.
    if (!reader.ReadVarint(&key, kMaxVarint32Bytes) || key > UINT32_MAX) {
      return false;
    }
    const uint64_t field = key >> 3;
    uint64_t value;
    switch (key & 7) {
      case 0:  // varint
        if (!reader.ReadVarint(&value)) return false;
        break;
      case 1:  // fixed64
        if (!reader.Skip(8, size)) return false;
        break;
      case 2: {  // length-delimited
        if (!reader.ReadVarint(&value, kMaxVarint32Bytes) ||
            value > size - reader.position()) {
          return false;
        }
        const ByteRange range{reader.position(), static_cast<size_t>(value)};
        if (field == 1) *logits = range;
        if (field == 2) *targets = range;
        if (!reader.Skip(value, size)) return false;
        break;
      }
      case 5:  // fixed32
        if (!reader.Skip(4, size)) return false;
        break;
      default:  // groups, invalid wire types
        return false;
    }
    if (field == 0) return false;
  }
  return true;
}

// What an evaluation's blocks need besides their bytes: set from the header,
// read-only afterwards (shared by the lanes).
struct EvaluationConfig {
  EvaluateSpec spec;
  CrossEntropyOptions options;
  int64_t vocab = 0;
  DType logits_dtype = DType::kInvalid;
  DType targets_dtype = DType::kInvalid;
  const float* class_weights = nullptr;  // device memory, or null
  std::vector<float> host_weights;       // the same on the host, or empty
  std::string tenant;                    // the caller's (metrics)
};

// What an evaluation's blocks add up to.
struct EvaluationSums {
  double loss = 0.0;
  double z_loss = 0.0;
  double weight = 0.0;  // of the valid targets (1 each without weights)
  double copy_seconds = 0.0;
  double kernel_seconds = 0.0;
  int64_t rows = 0;
  int64_t valid_tokens = 0;
  int64_t correct_tokens = 0;
  int64_t nonfinite_rows = 0;

  void Add(const EvaluationSums& other) {
    loss += other.loss;
    z_loss += other.z_loss;
    weight += other.weight;
    copy_seconds += other.copy_seconds;
    kernel_seconds += other.kernel_seconds;
    rows += other.rows;
    valid_tokens += other.valid_tokens;
    correct_tokens += other.correct_tokens;
    nonfinite_rows += other.nonfinite_rows;
  }
};

// The error of data connection `index` that ended after `got` of the `total`
// bytes of frame `frame`'s `what`.
absl::Status FrameEndedError(int index, int64_t got, size_t total,
                             int64_t frame, const char* what) {
  return absl::InvalidArgumentError(absl::StrFormat(
      "data connection %d ended after %d of the %d bytes of frame %d's %s",
      index, got, total, frame, what));
}

// Exactly `bytes` bytes from data connection `index` into `out`: the rest of
// frame `frame`'s `what`, of which `already` bytes came before (for the
// error of a connection that ends first).
absl::Status ReadFrameBytes(int fd, int index, char* out, size_t bytes,
                            int64_t frame, const char* what,
                            size_t already = 0) {
  for (size_t got = 0; got < bytes;) {
    const ssize_t n = recv(fd, out + got, bytes - got, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n == 0) {
      return FrameEndedError(index, static_cast<int64_t>(already + got),
                             already + bytes, frame, what);
    }
    if (n < 0) {
      return DataConnectionError(index, static_cast<int64_t>(got),
                                 static_cast<int64_t>(bytes), n);
    }
    got += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

// The most block sums BlockOrderSum holds for blocks that came before a
// block of a lower number (a client that keeps its connections in step holds
// a few).
constexpr size_t kMaxWaitingBlocks = size_t{1} << 16;

// The sums of an evaluation's blocks, added in block order: block b is frame
// j = b / K of lane i = b mod K (K lanes; on the stream, one lane whose
// blocks come in order). So the result is the same bits for the same blocks
// however many lanes carried them. Blocks that come ahead of their turn wait
// (at most kMaxWaitingBlocks); Total() adds those still waiting (a lane that
// ended early) in their order. Thread-safe.
class BlockOrderSum {
 public:
  explicit BlockOrderSum(int lanes) : lanes_(lanes) {}

  absl::Status Add(int lane, int64_t frame, const EvaluationSums& block) {
    const int64_t number = frame * lanes_ + lane;
    absl::MutexLock lock(&mu_);
    if (number != next_) {
      if (waiting_.size() >= kMaxWaitingBlocks) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "data connection %d is %d frames ahead of the others; send block "
            "b over connection b mod %d, in order",
            lane, waiting_.size(), lanes_));
      }
      waiting_.emplace(number, block);
      return absl::OkStatus();
    }
    total_.Add(block);
    ++next_;
    for (auto it = waiting_.begin(); it != waiting_.end() && it->first == next_;
         it = waiting_.erase(it)) {
      total_.Add(it->second);
      ++next_;
    }
    return absl::OkStatus();
  }

  EvaluationSums Total() {
    absl::MutexLock lock(&mu_);
    EvaluationSums total = total_;
    for (const auto& [number, block] : waiting_) total.Add(block);
    return total;
  }

 private:
  const int lanes_;
  absl::Mutex mu_;
  int64_t next_ ABSL_GUARDED_BY(mu_) = 0;
  EvaluationSums total_ ABSL_GUARDED_BY(mu_);
  std::map<int64_t, EvaluationSums> waiting_ ABSL_GUARDED_BY(mu_);
};

// One ordered stream of row blocks (the gRPC stream's, or one data
// connection's frames): lane `index` of those whose sums `order` adds. Its
// block buffers on the device are reused from block to block, so device
// memory stays O(block). One thread at a time.
class EvaluationLane {
 public:
  EvaluationLane(LossdService* service, const EvaluationConfig* config,
                 BlockOrderSum* order, int index)
      : service_(service), config_(config), order_(order), index_(index) {}
  EvaluationLane(const EvaluationLane&) = delete;
  EvaluationLane& operator=(const EvaluationLane&) = delete;
  ~EvaluationLane() { FreeBuffers(); }

  // One block, whose logits and targets are `logits` and `targets` of the
  // concatenated `slices`.
  absl::Status Evaluate(const std::vector<grpc::Slice>& slices,
                        ByteRange logits, ByteRange targets) {
    ASSIGN_OR_RETURN(const int64_t rows, Begin(logits.size, targets.size));
    if (rows == 0) return absl::OkStatus();

    Device* device = service_->store()->device();
    const absl::Time copy_start = absl::Now();
    // Targets are small and read on the host too (the weight sum): gathered.
    host_targets_.resize(targets.size);
    char* gathered = host_targets_.data();
    RETURN_IF_ERROR(
        ForEachPiece(slices, targets, [&](const uint8_t* piece, size_t size) {
          std::memcpy(gathered, piece, size);
          gathered += size;
          return absl::OkStatus();
        }));
    // Logits: slice by slice into the block buffer; on CUDA through double
    // buffered pinned staging, so gathering one piece overlaps copying the
    // previous one.
    RETURN_IF_ERROR(Reserve(&logits_buffer_, logits.size));
    size_t written = 0;
    RETURN_IF_ERROR(
        ForEachPiece(slices, logits, [&](const uint8_t* piece, size_t size) {
          const absl::Status status = device->CopyFromHostAsync(
              logits_buffer_.data(), written, piece, size);
          written += size;
          return status;
        }));
    RETURN_IF_ERROR(device->FinishWrites(logits_buffer_.data()));
    block_.copy_seconds += absl::ToDoubleSeconds(absl::Now() - copy_start);
    return Run(rows);
  }

  // Frame `frame` of data connection `index` (`fd`), whose row count `rows`
  // has been read: its logits are received straight into the block buffer
  // through the device's host windows (the copy of one window overlapping
  // the receipt of the next), then its targets.
  absl::Status EvaluateFrame(int fd, int index, int64_t frame, int64_t rows) {
    const size_t logits = static_cast<size_t>(rows * config_->spec.row_bytes);
    const size_t targets =
        static_cast<size_t>(rows) * DTypeSize(config_->targets_dtype);
    RETURN_IF_ERROR(Begin(logits, targets).status());
    Device* device = service_->store()->device();
    RETURN_IF_ERROR(Reserve(&logits_buffer_, logits));
    char* const base = static_cast<char*>(logits_buffer_.data());
    double waited = 0.0;
    const absl::Status received = ReceiveThroughWindows(
        device, base, static_cast<int64_t>(logits), fd,
        [&](int64_t got, ssize_t n) {
          return n == 0 ? FrameEndedError(index, got, logits + targets, frame,
                                          "rows")
                        : DataConnectionError(index, got,
                                              static_cast<int64_t>(logits), n);
        },
        nullptr, &waited);
    const absl::Time finish_start = absl::Now();
    const absl::Status finished = device->FinishWrites(base);
    block_.copy_seconds +=
        waited + absl::ToDoubleSeconds(absl::Now() - finish_start);
    RETURN_IF_ERROR(received);
    RETURN_IF_ERROR(finished);
    host_targets_.resize(targets);
    RETURN_IF_ERROR(ReadFrameBytes(fd, index, host_targets_.data(), targets,
                                   frame, "rows", logits));
    return Run(rows);
  }

  void FreeBuffers() {
    logits_buffer_ = ScratchBuffer();
    targets_buffer_ = ScratchBuffer();
  }

 private:
  // A block of `logits` and `targets` bytes: checked and counted. Its rows.
  absl::StatusOr<int64_t> Begin(size_t logits, size_t targets) {
    block_ = EvaluationSums();
    ASSIGN_OR_RETURN(
        const int64_t rows,
        ValidateRowBlockSizes(config_->spec, static_cast<int64_t>(logits),
                              static_cast<int64_t>(targets), blocks_));
    ++blocks_;
    Metrics* const metrics = service_->metrics();
    if (metrics != nullptr) {
      metrics->AddTransferBytes(TransferDirection::kEvaluate,
                                static_cast<int64_t>(logits + targets),
                                config_->tenant);
    }
    return rows;
  }

  // The loss of the block of `rows` rows whose logits are in the block
  // buffer and whose targets are in host_targets_: its sums, to `order_`.
  absl::Status Run(int64_t rows) {
    Device* device = service_->store()->device();
    Metrics* const metrics = service_->metrics();
    const void* device_targets = host_targets_.data();
    if (!device->host_accessible()) {
      const absl::Time copy_start = absl::Now();
      RETURN_IF_ERROR(Reserve(&targets_buffer_, host_targets_.size()));
      RETURN_IF_ERROR(device->CopyFromHost(targets_buffer_.data(), 0,
                                           host_targets_.data(),
                                           host_targets_.size()));
      device_targets = targets_buffer_.data();
      block_.copy_seconds += absl::ToDoubleSeconds(absl::Now() - copy_start);
    }
    CrossEntropyArgs args;
    args.rows = rows;
    args.vocab = config_->vocab;
    args.row_stride = config_->vocab;
    args.logits_dtype = config_->logits_dtype;
    args.logits = logits_buffer_.data();
    args.targets_dtype = config_->targets_dtype;
    args.targets = device_targets;
    args.class_weights = config_->class_weights;
    args.options = config_->options;
    // Each block's sum; order_ adds them in block order.
    args.options.reduction = Reduction::kSum;
    args.mode = GradientMode::kNone;
    CrossEntropyResult result;
    const absl::Time start = absl::Now();
    RETURN_IF_ERROR(device->CrossEntropy(args, &result));
    const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
    block_.kernel_seconds += seconds;
    if (metrics != nullptr) {
      metrics->ObserveKernel(device->name(), "cross_entropy", seconds);
    }

    block_.loss = result.loss;
    block_.z_loss = result.z_loss;
    block_.rows = rows;
    block_.valid_tokens = result.valid_tokens;
    block_.correct_tokens = result.correct_tokens;
    block_.nonfinite_rows = result.nonfinite_rows;
    // Targets were checked by the kernel: valid ones index the weights.
    for (int64_t row = 0; row < rows; ++row) {
      int64_t target;
      if (config_->targets_dtype == DType::kInt32) {
        int32_t value;
        std::memcpy(&value, host_targets_.data() + row * 4, 4);
        target = value;
      } else {
        std::memcpy(&target, host_targets_.data() + row * 8, 8);
      }
      if (target == config_->options.ignore_index) continue;
      block_.weight += config_->host_weights.empty()
                           ? 1.0
                           : static_cast<double>(config_->host_weights[target]);
    }
    return order_->Add(index_, frames_++, block_);
  }

  // Grows the device buffer `*buffer` to hold `bytes`: the largest block so
  // far, charged to the memory budget.
  absl::Status Reserve(ScratchBuffer* buffer, size_t bytes) {
    if (bytes <= buffer->bytes()) return absl::OkStatus();
    *buffer = ScratchBuffer();  // its bytes go back first
    ASSIGN_OR_RETURN(*buffer, service_->store()->AllocateScratch(
                                  static_cast<int64_t>(bytes)));
    return absl::OkStatus();
  }

  LossdService* const service_;
  const EvaluationConfig* const config_;
  ScratchBuffer logits_buffer_;
  ScratchBuffer targets_buffer_;
  std::string host_targets_;
  BlockOrderSum* const order_;
  const int index_;
  int64_t blocks_ = 0;    // every block, empty ones too (for messages)
  int64_t frames_ = 0;    // the blocks with rows: their order's frame numbers
  EvaluationSums block_;  // of the block under way
};

// The most bytes (logits and targets) one frame on a data connection may
// carry, as one block message on the stream (its lane's host and device
// buffers grow to it).
constexpr int64_t kMaxFrameBytes = int64_t{64} << 20;

class EvaluateReactor;
using EvaluateLink = EndLink<EvaluateReactor>;

class EvaluateReactor final : public PipelinedReadReactor<grpc::ByteBuffer> {
 public:
  EvaluateReactor(LossdService* service, grpc::CallbackServerContext* context,
                  grpc::ByteBuffer* response)
      : PipelinedReadReactor(context),
        service_(service),
        response_(response),
        admission_(service, *context) {
    if (!admission_.status().ok()) {
      End(ToGrpcStatus(admission_.status()));
      return;
    }
    StartReading();
  }

  void OnDone() override {
    // No data connection evaluates any more; then the lanes' buffers go.
    if (transfer_ != nullptr) transfer_->Cancel();
    {
      absl::MutexLock lock(&mu_);
      lanes_.clear();
    }
    weights_ = ReadLease();
    admission_.Release();
    delete this;
  }

  // An evaluation waiting for its data connections was cancelled.
  absl::Status CancelledWhileWaiting() override
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return absl::CancelledError("the evaluation was cancelled");
  }

  // The data connections' outcome, from the last one's thread (or the data
  // plane's sweeper), by the party that claimed the link: the result of all
  // lanes, or the failure.
  void EndFromTransfer(const absl::Status& status) ABSL_LOCKS_EXCLUDED(mu_) {
    grpc::Status result;
    {
      absl::MutexLock lock(&mu_);
      EndWaiting();
      absl::Status outcome = status;
      if (outcome.ok() && !abandoned_.ok()) outcome = abandoned_;
      if (outcome.ok()) outcome = Respond();
      lanes_.clear();
      result = ToGrpcStatus(outcome);
    }
    FinishRpc(result);
  }

 private:
  // The next block is received into the other buffer while this one is copied
  // to the device and evaluated.
  absl::Status Consume(grpc::ByteBuffer* buffer) override
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const absl::Status status = ConsumeBytes(buffer);
    buffer->Clear();
    return status;
  }

  // The device buffers go as soon as the stream fails (the data connections
  // stop first).
  void Abandon(const absl::Status& cause) override
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    abandoned_ = cause;
    if (transfer_ != nullptr) transfer_->Cancel();
    for (const std::unique_ptr<EvaluationLane>& lane : lanes_) {
      lane->FreeBuffers();
    }
  }

  absl::Status ConsumeBytes(grpc::ByteBuffer* buffer)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::vector<grpc::Slice> slices;
    if (!buffer->Dump(&slices).ok()) {
      return absl::InternalError("cannot read an EvaluateRequest's bytes");
    }
    ByteRange logits;
    ByteRange targets;
    if (FindRowBlock(slices, buffer->Length(), &logits, &targets)) {
      RETURN_IF_ERROR(CheckStreamBlock());
      return lanes_[0]->Evaluate(slices, logits, targets);
    }
    // The header, or a block in an unusual encoding: the protobuf way.
    pb::EvaluateRequest request;
    if (!grpc::SerializationTraits<pb::EvaluateRequest>::Deserialize(buffer,
                                                                     &request)
             .ok()) {
      return absl::InvalidArgumentError("a malformed EvaluateRequest");
    }
    switch (request.kind_case()) {
      case pb::EvaluateRequest::kHeader:
        if (have_header_) {
          return absl::InvalidArgumentError("a second header");
        }
        have_header_ = true;
        if (const absl::Status started = StartEvaluation(request.header());
            !started.ok()) {
          RefuseDataToken(service_, request.header().data_token());
          return started;
        }
        return absl::OkStatus();
      case pb::EvaluateRequest::kBlock: {
        RETURN_IF_ERROR(CheckStreamBlock());
        const std::string& logits_bytes = request.block().logits();
        const std::string& targets_bytes = request.block().targets();
        const std::vector<grpc::Slice> parsed = {
            grpc::Slice(logits_bytes.data(), logits_bytes.size(),
                        grpc::Slice::STATIC_SLICE),
            grpc::Slice(targets_bytes.data(), targets_bytes.size(),
                        grpc::Slice::STATIC_SLICE)};
        return lanes_[0]->Evaluate(
            parsed, ByteRange{0, logits_bytes.size()},
            ByteRange{logits_bytes.size(), targets_bytes.size()});
      }
      default:
        return absl::InvalidArgumentError(
            "an EvaluateRequest with neither header nor block");
    }
  }

  // A block on the stream: after the header, unless the blocks come over
  // data connections.
  absl::Status CheckStreamBlock() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!have_header_) {
      return absl::InvalidArgumentError("data before the header");
    }
    if (transfer_ != nullptr) {
      return absl::InvalidArgumentError(
          "a block on the stream of an evaluation over data connections");
    }
    return absl::OkStatus();
  }

  absl::Status StartEvaluation(const pb::EvaluateHeader& header)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    ASSIGN_OR_RETURN(config_.spec, ValidateEvaluateHeader(header));
    RETURN_IF_ERROR(CheckDataConnections(service_, header.data_token(),
                                         header.data_connections(),
                                         "send the blocks on the stream"));
    config_.options = config_.spec.options;
    config_.vocab = config_.spec.vocab;
    config_.tenant = admission_.tenant();
    config_.logits_dtype = config_.spec.logits_dtype;
    config_.targets_dtype = config_.spec.targets_dtype;
    if (!header.options().class_weights().empty()) {
      ASSIGN_OR_RETURN(
          weights_,
          LeaseClassWeights(service_->store(), admission_.tenant(),
                            header.options().class_weights(), config_.vocab));
      const Tensor& weights = *weights_.tensor();
      config_.class_weights = static_cast<const float*>(weights.data());
      // The mean's denominator sums w[target] on the host.
      config_.host_weights.resize(static_cast<size_t>(config_.vocab));
      RETURN_IF_ERROR(weights.device()->ReadConverted(
          weights.data(), DType::kFloat32, 0, config_.vocab, config_.vocab,
          1.0f, nullptr, config_.host_weights.data(), DType::kFloat32));
    }
    const int lanes = header.data_token().empty()
                          ? 1
                          : std::max(1, header.data_connections());
    order_ = std::make_unique<BlockOrderSum>(lanes);
    for (int i = 0; i < lanes; ++i) {
      lanes_.push_back(std::make_unique<EvaluationLane>(service_, &config_,
                                                        order_.get(), i));
    }
    if (header.data_token().empty()) return absl::OkStatus();
    // Connection i's frames go to lane i; the ranges only count the parts.
    auto link = std::make_shared<EvaluateLink>(this);
    ASSIGN_OR_RETURN(
        transfer_,
        service_->options().data_plane->Expect(
            header.data_token(),
            std::vector<DataTransfer::Range>(static_cast<size_t>(lanes)),
            FrameWork(), [link](const absl::Status& status) {
              if (link->Claim()) link->reactor->EndFromTransfer(status);
            }));
    link_ = std::move(link);
    return absl::OkStatus();
  }

  // The work of data connection i: frames (an 8-byte little-endian row count
  // R >= 1, then R rows of logits and R targets) evaluated into lane i, in
  // order, until the client ends its side between two frames. Runs while the
  // lanes exist (they go only after Cancel, or after the transfer ended).
  DataTransfer::Work FrameWork() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::vector<EvaluationLane*> lanes;
    for (const std::unique_ptr<EvaluationLane>& lane : lanes_) {
      lanes.push_back(lane.get());
    }
    const int64_t row_bytes = config_.spec.row_bytes;
    const int64_t target_bytes =
        static_cast<int64_t>(DTypeSize(config_.targets_dtype));
    return [lanes, row_bytes, target_bytes](
               int index, int fd, const DataTransfer::Range&) -> absl::Status {
      EvaluationLane* const lane = lanes[static_cast<size_t>(index)];
      for (int64_t number = 0;; ++number) {
        unsigned char head[8];
        // The end of the connection before a frame is the clean end.
        ssize_t n;
        do {
          n = recv(fd, head, 1, 0);
        } while (n < 0 && errno == EINTR);
        if (n == 0) return absl::OkStatus();
        if (n < 0) return DataConnectionError(index, 0, 8, n);
        RETURN_IF_ERROR(ReadFrameBytes(fd, index,
                                       reinterpret_cast<char*>(head) + 1, 7,
                                       number, "row count", 1));
        uint64_t rows = 0;
        for (int i = 7; i >= 0; --i) rows = (rows << 8) | head[i];
        const int64_t max_rows = kMaxFrameBytes / (row_bytes + target_bytes);
        if (rows < 1 || rows > static_cast<uint64_t>(max_rows)) {
          return absl::InvalidArgumentError(
              max_rows < 1
                  ? absl::StrFormat("data connection %d: a row of %d bytes is "
                                    "more than a frame may hold (%d MiB); "
                                    "send the blocks on the stream",
                                    index, row_bytes + target_bytes,
                                    kMaxFrameBytes >> 20)
                  : absl::StrFormat("data connection %d, frame %d: %d rows; a "
                                    "frame holds 1 to %d rows (%d MiB)",
                                    index, number, static_cast<int64_t>(rows),
                                    max_rows, kMaxFrameBytes >> 20));
        }
        RETURN_IF_ERROR(
            lane->EvaluateFrame(fd, index, number, static_cast<int64_t>(rows)));
      }
    };
  }

  absl::Status Complete() override ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!have_header_) {
      return absl::InvalidArgumentError("the stream ended before a header");
    }
    if (transfer_ != nullptr) {
      // The RPC ends when the data connections do (EndFromTransfer), or on
      // cancellation (OnCancel).
      return DeferEnd();
    }
    const absl::Status status = Respond();
    lanes_.clear();
    return status;
  }

  // The response: the lanes' sums, added in lane order (the same bits for
  // the same blocks on the same lanes).
  absl::Status Respond() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const EvaluationSums total =
        order_ != nullptr ? order_->Total() : EvaluationSums();
    if (total.rows == 0) return absl::InvalidArgumentError("no rows at all");
    const CrossEntropyOptions& options = config_.options;
    double loss = total.loss;
    double z_loss = total.z_loss;
    double denominator = 0.0;
    if (options.reduction == Reduction::kMean) {
      denominator = options.normalizer > 0.0
                        ? options.normalizer
                        : (total.valid_tokens > 0 ? total.weight : 0.0);
      loss = denominator != 0.0 ? total.loss / denominator : 0.0;
      z_loss = denominator != 0.0 ? total.z_loss / denominator : 0.0;
    }
    pb::EvaluateResponse response;
    response.set_loss(loss);
    response.set_z_loss(z_loss);
    response.set_rows(total.rows);
    response.set_valid_tokens(total.valid_tokens);
    response.set_correct_tokens(total.correct_tokens);
    response.set_nonfinite_rows(total.nonfinite_rows);
    response.set_denominator(denominator);
    response.set_copy_seconds(total.copy_seconds);
    response.set_kernel_seconds(total.kernel_seconds);
    return SerializeResponse(response, response_);
  }

  // Finishes the RPC with `status`, unless the data connections' outcome
  // claimed that already.
  void End(const grpc::Status& status) override {
    if (link_ != nullptr && !link_->Claim()) return;
    FinishRpc(status);
  }

  // Recorded before Finish, so that a client that has its status also sees it
  // counted.
  void FinishRpc(const grpc::Status& status) {
    service_->RecordRpc("Evaluate", status.error_code(), start_,
                        admission_.tenant());
    Finish(status);
  }

  LossdService* const service_;
  const absl::Time start_ = absl::Now();
  grpc::ByteBuffer* const response_;
  Admission admission_;
  bool have_header_ ABSL_GUARDED_BY(mu_) = false;
  // Set from the header under mu_; read-only afterwards (the lanes read it
  // on the data connections' threads).
  EvaluationConfig config_;
  ReadLease weights_;
  // One lane for the stream's blocks, or one per data connection.
  // The lanes' sums, in block order; outlives them (declared first).
  std::unique_ptr<BlockOrderSum> order_ ABSL_GUARDED_BY(mu_);
  std::vector<std::unique_ptr<EvaluationLane>> lanes_ ABSL_GUARDED_BY(mu_);
  // An evaluation over data connections: its transfer and the link that ties
  // the transfer's outcome to this RPC; why the stream failed, if it did.
  std::shared_ptr<DataTransfer> transfer_;
  std::shared_ptr<EvaluateLink> link_;
  absl::Status abandoned_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

// ---------------------------------------------------------------- service

LossdService::LossdService(TensorStore* store, ServiceOptions options,
                           Metrics* metrics)
    : store_(store),
      options_(std::move(options)),
      metrics_(metrics),
      stripes_(
          std::make_unique<StripedUploads>(store_, options_.stripe_timeout)) {
  // Upload is method 0 of lossd.v1.Lossd (its first rpc). The raw handler
  // skips the protobuf copy of every chunk (see UploadReactor).
  MarkMethodRawCallback(
      0, new grpc::internal::CallbackClientStreamingHandler<grpc::ByteBuffer,
                                                            grpc::ByteBuffer>(
             [this](grpc::CallbackServerContext* context,
                    grpc::ByteBuffer* response) {
               return new UploadReactor(this, context, response);
             }));
  // Evaluate is method 7: blocks go from the receive slices to the device
  // without a parse (see EvaluateReactor).
  MarkMethodRawCallback(
      7, new grpc::internal::CallbackClientStreamingHandler<grpc::ByteBuffer,
                                                            grpc::ByteBuffer>(
             [this](grpc::CallbackServerContext* context,
                    grpc::ByteBuffer* response) {
               return new EvaluateReactor(this, context, response);
             }));
}

void LossdService::RecordRpc(const char* method, grpc::StatusCode code,
                             absl::Time start,
                             const std::string& tenant) const {
  if (metrics_ == nullptr) return;
  metrics_->ObserveRpc(method, static_cast<absl::StatusCode>(code),
                       absl::Now() - start, tenant);
}

LossdService::~LossdService() = default;

void LossdService::StartDraining() {
  absl::MutexLock lock(&mu_);
  draining_ = true;
}

bool LossdService::WaitForIdle(absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto idle = [this]()
                  ABSL_SHARED_LOCKS_REQUIRED(mu_) { return in_flight_ == 0; };
  return mu_.AwaitWithTimeout(absl::Condition(&idle), timeout);
}

int64_t LossdService::in_flight() const {
  absl::MutexLock lock(&mu_);
  return in_flight_;
}

bool LossdService::Enter(bool* draining) {
  absl::MutexLock lock(&mu_);
  if (draining_ && draining == nullptr) return false;
  if (draining != nullptr) *draining = draining_;
  ++in_flight_;
  return true;
}

void LossdService::Leave() {
  absl::MutexLock lock(&mu_);
  --in_flight_;
}

absl::Status LossdService::Admit(const grpc::ServerContextBase& context,
                                 std::string* tenant, InFlightSlot* slot,
                                 bool* draining) {
  if (!Enter(draining)) return DrainingError();
  absl::StatusOr<std::string> caller =
      options_.authenticator == nullptr
          ? std::string(kDefaultTenant)
          : options_.authenticator->Authenticate(context);
  if (!caller.ok()) {
    Leave();
    return caller.status();
  }
  if (options_.quotas != nullptr) {
    absl::StatusOr<InFlightSlot> taken = options_.quotas->EnterRpc(*caller);
    if (!taken.ok()) {
      Leave();
      return taken.status();
    }
    *slot = std::move(*taken);
  }
  *tenant = *std::move(caller);
  return absl::OkStatus();
}

void LossdService::FillServerInfo(pb::ServerInfo* info) const {
  const StoreStats stats = store_->Stats();
  info->set_instance_id(store_->instance_id());
  info->set_device(store_->device()->name());
  info->set_budget_bytes(stats.budget_bytes);
  info->set_used_bytes(stats.used_bytes);
  info->set_free_bytes(stats.budget_bytes - stats.used_bytes);
  info->set_tensors(stats.tensors);
  info->set_version(options_.version);
  if (options_.data_plane != nullptr) {
    info->set_data_port(options_.data_plane->port());
  }
}

// Runs `body` as one admitted (drain, authentication, tenant quota) and
// recorded (metrics) unary RPC; `body` sees the caller's `tenant`.
#define LOSSD_UNARY(method, context, body)                                     \
  do {                                                                         \
    const absl::Time lossd_rpc_start_ = absl::Now();                           \
    absl::Status lossd_rpc_status_;                                            \
    std::string tenant;                                                        \
    {                                                                          \
      InFlightSlot lossd_rpc_slot_;                                            \
      lossd_rpc_status_ = Admit(*(context), &tenant, &lossd_rpc_slot_);        \
      if (!lossd_rpc_status_.ok()) {                                           \
        RecordRpc(method,                                                      \
                  static_cast<grpc::StatusCode>(lossd_rpc_status_.code()),     \
                  lossd_rpc_start_, tenant);                                   \
        return FinishUnary(context, lossd_rpc_status_);                        \
      }                                                                        \
      lossd_rpc_status_ = (body);                                              \
    }                                                                          \
    RecordRpc(method, static_cast<grpc::StatusCode>(lossd_rpc_status_.code()), \
              lossd_rpc_start_, tenant);                                       \
    Leave();                                                                   \
    return FinishUnary(context, lossd_rpc_status_);                            \
  } while (0)

grpc::ServerReadReactor<pb::UploadRequest>* LossdService::Upload(
    grpc::CallbackServerContext* /*context*/,
    pb::UploadResponse* /*response*/) {
  return new UnreachableReadReactor<pb::UploadRequest>();
}

grpc::ServerWriteReactor<pb::DownloadResponse>* LossdService::Download(
    grpc::CallbackServerContext* context, const pb::DownloadRequest* request) {
  return new DownloadReactor(this, context, *request);
}

grpc::ServerReadReactor<pb::EvaluateRequest>* LossdService::Evaluate(
    grpc::CallbackServerContext* /*context*/,
    pb::EvaluateResponse* /*response*/) {
  return new UnreachableReadReactor<pb::EvaluateRequest>();
}

grpc::ServerUnaryReactor* LossdService::Describe(
    grpc::CallbackServerContext* context, const pb::DescribeRequest* request,
    pb::TensorInfo* response) {
  LOSSD_UNARY("Describe", context, DoDescribe(tenant, *request, response));
}

grpc::ServerUnaryReactor* LossdService::List(
    grpc::CallbackServerContext* context, const pb::ListRequest* /*request*/,
    pb::ListResponse* response) {
  LOSSD_UNARY("List", context, DoList(tenant, response));
}

grpc::ServerUnaryReactor* LossdService::Release(
    grpc::CallbackServerContext* context, const pb::ReleaseRequest* request,
    pb::ReleaseResponse* response) {
  LOSSD_UNARY("Release", context, DoRelease(tenant, *request, response));
}

grpc::ServerUnaryReactor* LossdService::Forward(
    grpc::CallbackServerContext* context, const pb::ForwardRequest* request,
    pb::ForwardResponse* response) {
  LOSSD_UNARY("Forward", context, DoForward(tenant, *request, response));
}

grpc::ServerUnaryReactor* LossdService::Backward(
    grpc::CallbackServerContext* context, const pb::BackwardRequest* request,
    pb::BackwardResponse* response) {
  LOSSD_UNARY("Backward", context, DoBackward(tenant, *request, response));
}

grpc::ServerUnaryReactor* LossdService::GetServerInfo(
    grpc::CallbackServerContext* context,
    const pb::GetServerInfoRequest* /*request*/, pb::ServerInfo* response) {
  LOSSD_UNARY("GetServerInfo", context,
              ((void)tenant, FillServerInfo(response), absl::OkStatus()));
}

#undef LOSSD_UNARY

absl::Status LossdService::DoDescribe(const std::string& tenant,
                                      const pb::DescribeRequest& request,
                                      pb::TensorInfo* response) {
  ASSIGN_OR_RETURN(std::shared_ptr<Tensor> tensor,
                   store_->Get(tenant, request.handle()));
  ToProto(tensor->Info(), response);
  return absl::OkStatus();
}

absl::Status LossdService::DoList(const std::string& tenant,
                                  pb::ListResponse* response) {
  for (const TensorRecord& info : store_->List(tenant)) {
    ToProto(info, response->add_tensors());
  }
  FillServerInfo(response->mutable_server());
  return absl::OkStatus();
}

absl::Status LossdService::DoRelease(const std::string& tenant,
                                     const pb::ReleaseRequest& request,
                                     pb::ReleaseResponse* response) {
  ASSIGN_OR_RETURN(const int64_t bytes,
                   store_->Release(tenant, request.handle()));
  response->set_released_bytes(bytes);
  return absl::OkStatus();
}

absl::Status LossdService::DoForward(const std::string& tenant,
                                     const pb::ForwardRequest& request,
                                     pb::ForwardResponse* response) {
  // Request-only checks first: nothing is looked up for a malformed request.
  ASSIGN_OR_RETURN(const ForwardSpec spec, ValidateForwardRequest(request));
  const CrossEntropyOptions& options = spec.options;
  const GradientMode mode = spec.mode;
  const DType inline_dtype = spec.inline_targets_dtype;

  ASSIGN_OR_RETURN(std::shared_ptr<Tensor> logits,
                   store_->Get(tenant, request.logits()));
  if (!IsLogitsDType(logits->dtype()) || logits->shape().size() != 2) {
    return absl::InvalidArgumentError(absl::StrCat(
        "logits must be a 2-D float tensor, got ", DTypeName(logits->dtype()),
        " ", ShapeString(logits->shape())));
  }
  const int64_t rows = logits->shape()[0];
  const int64_t vocab = logits->shape()[1];

  Device* device = store_->device();
  ReadLease targets_lease;
  Staged inline_targets;
  const void* targets = nullptr;
  DType targets_dtype = inline_dtype;
  if (request.targets_case() == pb::ForwardRequest::kTargetsHandle) {
    ASSIGN_OR_RETURN(std::shared_ptr<Tensor> tensor,
                     store_->Get(tenant, request.targets_handle()));
    if (!IsTargetsDType(tensor->dtype()) || tensor->shape().size() != 1 ||
        tensor->shape()[0] != rows) {
      return absl::InvalidArgumentError(absl::StrCat(
          "targets must be int32 or int64 [", rows, "], got ",
          DTypeName(tensor->dtype()), " ", ShapeString(tensor->shape())));
    }
    targets_dtype = tensor->dtype();
    targets_lease = store_->BeginRead(std::move(tensor));
    targets = targets_lease.tensor()->data();
  } else {
    const std::string& data = request.targets_inline().data();
    RETURN_IF_ERROR(
        CheckInlineTargets(request.targets_inline(), inline_dtype, rows));
    RETURN_IF_ERROR(inline_targets.Stage(device, data.data(), data.size()));
    targets = inline_targets.get();
  }

  ReadLease weights_lease;
  if (!request.options().class_weights().empty()) {
    ASSIGN_OR_RETURN(
        weights_lease,
        LeaseClassWeights(store_, tenant, request.options().class_weights(),
                          vocab));
  }

  ASSIGN_OR_RETURN(
      ForwardLease lease,
      store_->BeginForward(logits, mode == GradientMode::kInPlace));
  std::unique_ptr<PendingTensor> gradient;
  if (mode == GradientMode::kOutOfPlace) {
    ASSIGN_OR_RETURN(
        gradient,
        store_->Create(tenant, logits->dtype(), logits->shape(),
                       request.gradient_label(), TensorState::kGradient));
  }

  std::vector<float> token_loss(request.outputs().token_loss() ? rows : 0);
  std::vector<float> token_lse(request.outputs().token_lse() ? rows : 0);
  std::vector<int32_t> token_argmax(request.outputs().token_argmax() ? rows
                                                                     : 0);
  CrossEntropyArgs args;
  args.rows = rows;
  args.vocab = vocab;
  args.row_stride = vocab;
  args.logits_dtype = logits->dtype();
  args.logits = logits->data();
  args.targets_dtype = targets_dtype;
  args.targets = targets;
  args.class_weights =
      weights_lease.tensor() == nullptr
          ? nullptr
          : static_cast<const float*>(weights_lease.tensor()->data());
  args.options = options;
  args.mode = mode;
  switch (mode) {
    case GradientMode::kInPlace:
      args.gradient = logits->data();
      break;
    case GradientMode::kOutOfPlace:
      args.gradient = gradient->data();
      break;
    case GradientMode::kNone:
      args.gradient = nullptr;
      break;
  }
  args.token_loss = token_loss.empty() ? nullptr : token_loss.data();
  args.token_lse = token_lse.empty() ? nullptr : token_lse.data();
  args.token_argmax = token_argmax.empty() ? nullptr : token_argmax.data();

  CrossEntropyResult result;
  const auto start = std::chrono::steady_clock::now();
  RETURN_IF_ERROR(device->CrossEntropy(args, &result));
  const std::chrono::duration<double> elapsed =
      std::chrono::steady_clock::now() - start;
  if (metrics_ != nullptr) {
    metrics_->ObserveKernel(device->name(), "cross_entropy", elapsed.count());
  }

  switch (mode) {
    case GradientMode::kInPlace:
      lease.FinishInPlace(options.reduction);
      response->set_gradient(logits->handle());
      break;
    case GradientMode::kOutOfPlace: {
      gradient->MarkFilled();
      ASSIGN_OR_RETURN(std::shared_ptr<Tensor> out,
                       gradient->Commit(options.reduction));
      response->set_gradient(out->handle());
      break;
    }
    case GradientMode::kNone:
      break;
  }
  response->set_loss(result.loss);
  response->set_z_loss(result.z_loss);
  response->set_valid_tokens(result.valid_tokens);
  response->set_correct_tokens(result.correct_tokens);
  response->set_nonfinite_rows(result.nonfinite_rows);
  response->set_denominator(result.denominator);
  response->set_kernel_seconds(elapsed.count());
  response->mutable_token_loss()->Add(token_loss.begin(), token_loss.end());
  response->mutable_token_lse()->Add(token_lse.begin(), token_lse.end());
  response->mutable_token_argmax()->Add(token_argmax.begin(),
                                        token_argmax.end());
  return absl::OkStatus();
}

absl::Status LossdService::DoBackward(const std::string& tenant,
                                      const pb::BackwardRequest& request,
                                      pb::BackwardResponse* response) {
  ASSIGN_OR_RETURN(GradOutput grad_output, ValidateBackwardRequest(request));
  const double scale = grad_output.scale;
  std::vector<float> token_scale = std::move(grad_output.token_scale);
  ASSIGN_OR_RETURN(std::shared_ptr<Tensor> tensor,
                   store_->Get(tenant, request.gradient()));
  bool kernel_launched = false;
  const auto start = std::chrono::steady_clock::now();
  RETURN_IF_ERROR(
      store_->RecordGradOutput(tensor, scale, std::move(token_scale),
                               request.materialize(), &kernel_launched));
  if (kernel_launched && metrics_ != nullptr) {
    // Includes the store's bookkeeping around the pass, which is tiny next to
    // a pass over N·V elements.
    const std::chrono::duration<double> elapsed =
        std::chrono::steady_clock::now() - start;
    metrics_->ObserveKernel(tensor->device()->name(), "scale", elapsed.count());
  }
  ToProto(tensor->Info(), response->mutable_tensor());
  response->set_kernel_launched(kernel_launched);
  return absl::OkStatus();
}

}  // namespace lossd
