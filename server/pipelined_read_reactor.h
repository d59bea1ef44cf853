// The pipelined read loop of the client-streaming RPCs (Upload, Evaluate),
// shared by their reactors.
#ifndef LOSSD_SERVER_PIPELINED_READ_REACTOR_H_
#define LOSSD_SERVER_PIPELINED_READ_REACTOR_H_

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/grpcpp.h"
#include "server/grpc_status.h"

namespace lossd {

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

}  // namespace lossd

#endif  // LOSSD_SERVER_PIPELINED_READ_REACTOR_H_
