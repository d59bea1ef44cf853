// The Upload reactor (upload_reactor.h).
#include "server/upload_reactor.h"

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/raw_messages.h"
#include "common/status_macros.h"
#include "common/tensor_math.h"
#include "server/data_connection_checks.h"
#include "server/data_plane.h"
#include "server/grpc_status.h"
#include "server/pipelined_read_reactor.h"
#include "server/raw_bytes.h"
#include "server/striped_uploads.h"
#include "server/tensor_info_proto.h"
#include "server/unparsed_request.h"
#include "server/validation.h"

namespace lossd {

namespace pb = ::lossd::v1;

namespace {

class UploadReactor final : public PipelinedReadReactor<grpc::ByteBuffer>,
                            public StripeParticipant {
 public:
  UploadReactor(RpcSupport* rpc, grpc::CallbackServerContext* context,
                grpc::ByteBuffer* response)
      : PipelinedReadReactor(context),
        rpc_(rpc),
        response_(response),
        admission_(rpc, *context, /*allow_draining=*/true) {
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
    // the handle, so the tensor must not stay behind (an overwritten one is
    // the client's already).
    if (!committed_.empty() && !overwrite_ && context_->IsCancelled()) {
      rpc_->store()->Release(admission_.tenant(), committed_).IgnoreError();
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
  void EndFromAssembly(const absl::Status& status,
                       const TensorRecord* info) override
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
    rpc_->stripes()->Finished(*assembly_,
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
      rpc_->store()->device()->FinishWrites(stripe_base_).IgnoreError();
    }
    stripe_pending_.reset();
  }

  absl::Status ConsumeBytes(grpc::ByteBuffer* buffer)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    ReceivedBytes bytes;
    RETURN_IF_ERROR(DumpBytes(buffer, "UploadRequest", &bytes));
    const std::optional<size_t> prefix = FindUploadChunk(bytes.pieces);
    if (prefix.has_value()) {
      return AppendChunk(bytes.pieces, *prefix, TotalBytes(bytes.pieces));
    }
    // The header, or a chunk in an unusual encoding: the protobuf way.
    pb::UploadRequest request;
    if (!grpc::SerializationTraits<pb::UploadRequest>::Deserialize(buffer,
                                                                   &request)
             .ok()) {
      return UnparsedRequestError("Upload",
                                  pb::UploadRequest::descriptor()->full_name());
    }
    switch (request.kind_case()) {
      case pb::UploadRequest::kHeader: {
        if (pending_ != nullptr || link_ != nullptr) {
          return absl::InvalidArgumentError("a second header");
        }
        const absl::Status started = StartUpload(request.header());
        if (!started.ok()) {
          RefuseDataToken(*rpc_, request.header().data_token());
        }
        return started;
      }
      case pb::UploadRequest::kChunk: {
        const absl::string_view whole = request.chunk();
        return AppendChunk({&whole, 1}, 0, whole.size());
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
    RETURN_IF_ERROR(ValidateIdempotencyKey(header.idempotency_key()));
    RETURN_IF_ERROR(CheckDataConnections(*rpc_, header.data_token(),
                                         header.data_connections(),
                                         "send the bytes as chunks"));
    overwrite_ = !header.overwrite_handle().empty();
    if (overwrite_) {
      ASSIGN_OR_RETURN(pending_,
                       rpc_->store()->Overwrite(admission_.tenant(),
                                                header.overwrite_handle(),
                                                spec.dtype, spec.shape));
    } else {
      if (!header.idempotency_key().empty()) {
        ASSIGN_OR_RETURN(std::shared_ptr<Tensor> stored,
                         rpc_->store()->FindUpload(
                             admission_.tenant(), header.idempotency_key(),
                             spec.dtype, spec.shape, header.label()));
        if (stored != nullptr) return AnswerWithStored(*stored, header);
      }
      ASSIGN_OR_RETURN(
          pending_, rpc_->store()->Create(admission_.tenant(), spec.dtype,
                                          std::move(spec.shape), header.label(),
                                          TensorState::kLogits,
                                          header.idempotency_key()));
    }
    if (!header.data_token().empty()) return ExpectData(header);
    return absl::OkStatus();
  }

  // A retry of an upload that stored `stored` under the header's
  // idempotency_key: answered with that tensor at once, whatever bytes the
  // client still sends (its data connections are closed as they come).
  absl::Status AnswerWithStored(const Tensor& stored,
                                const pb::TensorHeader& header)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    RefuseDataToken(*rpc_, header.data_token());
    RETURN_IF_ERROR(Respond(stored.Info()));
    MarkFinished();
    End(grpc::Status::OK);
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
        rpc_->data_plane()->Expect(
            header.data_token(), std::move(ranges),
            ReceiveIntoDevice(rpc_->store()->device(), pending_->data(),
                              rpc_->metrics(), admission_.tenant()),
            [link, reactor = this](const absl::Status& status) {
              if (link->Claim()) reactor->EndFromTransfer(status);
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
    StripedUploads* const stripes = rpc_->stripes();
    absl::StatusOr<TensorSpec> spec = ValidateTensorHeader(header);
    if (spec.ok()) {
      if (absl::Status key = ValidateIdempotencyKey(header.idempotency_key());
          !key.ok()) {
        spec = key;
      }
    }
    if (!spec.ok()) {
      stripes->FailIfOpen(admission_.tenant(), stripe.upload_id,
                          StripeCause(stripe.index, spec.status()));
      return spec.status();
    }
    if (!header.idempotency_key().empty()) {
      // Each stripe of a retry is answered with the stored tensor alone.
      absl::StatusOr<std::shared_ptr<Tensor>> stored =
          rpc_->store()->FindUpload(admission_.tenant(),
                                    header.idempotency_key(), spec->dtype,
                                    spec->shape, header.label());
      if (!stored.ok()) {
        stripes->FailIfOpen(admission_.tenant(), stripe.upload_id,
                            StripeCause(stripe.index, stored.status()));
        return stored.status();
      }
      if (*stored != nullptr) return AnswerWithStored(**stored, header);
    }
    StripeHeader shared;
    shared.dtype = spec->dtype;
    shared.shape = std::move(spec->shape);
    shared.label = header.label();
    shared.count = stripe.count;
    shared.idempotency_key = header.idempotency_key();
    shared.overwrite_handle = header.overwrite_handle();
    overwrite_ = !shared.overwrite_handle.empty();
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

  // Appends bytes [prefix, size) of the concatenated `pieces`.
  absl::Status AppendChunk(BytePieces pieces, size_t prefix, size_t size)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const int64_t length = static_cast<int64_t>(size - prefix);
    if (transfer_ != nullptr) {
      return absl::InvalidArgumentError(
          "a chunk on the stream of an upload over a data connection");
    }
    if (link_ != nullptr) return AppendStripeChunk(pieces, prefix, length);
    if (pending_ == nullptr) {
      return absl::InvalidArgumentError("data before the header");
    }
    if (length > pending_->bytes() - pending_->received_bytes()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "more bytes than the header says: %d expected, at least %d received",
          pending_->bytes(), pending_->received_bytes() + length));
    }
    RETURN_IF_ERROR(ForEachPiece(pieces, ByteRange{prefix, size - prefix},
                                 [&](const uint8_t* piece, size_t bytes) {
                                   return pending_->Append(piece, bytes);
                                 }));
    if (rpc_->metrics() != nullptr) {
      rpc_->metrics()->AddTransferBytes(TransferDirection::kUpload, length,
                                        admission_.tenant());
    }
    return absl::OkStatus();
  }

  // A stripe writes straight into its range of the shared buffer, its device
  // copies keyed by the range's start (Device::CopyFromHostAsync), so that
  // stripes on different threads never share a staging pipeline.
  absl::Status AppendStripeChunk(BytePieces pieces, size_t prefix,
                                 int64_t length)
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
    Device* device = rpc_->store()->device();
    RETURN_IF_ERROR(
        ForEachPiece(pieces, ByteRange{prefix, static_cast<size_t>(length)},
                     [&](const uint8_t* piece, size_t bytes) {
                       RETURN_IF_ERROR(device->CopyFromHostAsync(
                           stripe_base_, static_cast<size_t>(stripe_received_),
                           piece, bytes));
                       stripe_received_ += static_cast<int64_t>(bytes);
                       return absl::OkStatus();
                     }));
    if (rpc_->metrics() != nullptr) {
      rpc_->metrics()->AddTransferBytes(TransferDirection::kUpload, length,
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
      RETURN_IF_ERROR(rpc_->store()->device()->FinishWrites(stripe_base_));
    }
    stripe_pending_.reset();
    StripeAssembly::DoneResult done = assembly_->Done(stripe_index_);
    if (done.wait) {
      return DeferEnd();
    }
    if (done.decided) {
      rpc_->stripes()->Finished(
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
    rpc_->RecordRpc("Upload", status.error_code(), start_, admission_.tenant());
    Finish(status);
  }

  RpcSupport* const rpc_;
  const absl::Time start_ = absl::Now();
  grpc::ByteBuffer* const response_;
  std::unique_ptr<PendingTensor> pending_;
  std::string committed_;   // the handle, once published
  bool overwrite_ = false;  // the header named a tensor to overwrite
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

}  // namespace

grpc::ServerReadReactor<grpc::ByteBuffer>* NewUploadReactor(
    RpcSupport* rpc, grpc::CallbackServerContext* context,
    grpc::ByteBuffer* response) {
  return new UploadReactor(rpc, context, response);
}

}  // namespace lossd
