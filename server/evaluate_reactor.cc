// The Evaluate reactor (evaluate_reactor.h).
#include "server/evaluate_reactor.h"

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/raw_messages.h"
#include "common/status_macros.h"
#include "server/cancellation.h"
#include "server/data_connection_checks.h"
#include "server/data_plane.h"
#include "server/end_link.h"
#include "server/evaluation.h"
#include "server/grpc_status.h"
#include "server/linear_head.h"
#include "server/pipelined_read_reactor.h"
#include "server/post_training_evaluation.h"
#include "server/post_training_forward.h"
#include "server/quota.h"
#include "server/raw_bytes.h"
#include "server/tensor_lookup.h"
#include "server/unparsed_request.h"
#include "server/validation.h"

namespace lossd {

namespace pb = ::lossd::v1;

namespace {

class EvaluateReactor;
using EvaluateLink = EndLink<EvaluateReactor>;

class EvaluateReactor final : public PipelinedReadReactor<grpc::ByteBuffer> {
 public:
  EvaluateReactor(RpcSupport* rpc, grpc::CallbackServerContext* context,
                  grpc::ByteBuffer* response)
      : PipelinedReadReactor(context),
        rpc_(rpc),
        response_(response),
        admission_(rpc, *context) {
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
    // The message (a block of up to the 64 MiB gRPC limit) counts against the
    // tenant's byte quota while it is evaluated, as a data connection's frame
    // buffer does.
    absl::StatusOr<QuotaCharge> held = rpc_->store()->ChargeTenantBytes(
        admission_.tenant(), static_cast<int64_t>(buffer->Length()));
    if (!held.ok()) {
      return absl::Status(
          held.status().code(),
          absl::StrCat("an Evaluate message of ", buffer->Length(),
                       " bytes: ", held.status().message()));
    }
    ReceivedBytes bytes;
    RETURN_IF_ERROR(DumpBytes(buffer, "EvaluateRequest", &bytes));
    ByteRange logits;
    ByteRange targets;
    // A post-training block carries more fields: always the protobuf way.
    if (!config_.post_training &&
        FindRowBlock(bytes.pieces, &logits, &targets)) {
      RETURN_IF_ERROR(CheckStreamBlock());
      return lanes_[0]->Evaluate(bytes.pieces, logits, targets);
    }
    // The header, or a block in an unusual encoding: the protobuf way.
    pb::EvaluateRequest request;
    if (!grpc::SerializationTraits<pb::EvaluateRequest>::Deserialize(buffer,
                                                                     &request)
             .ok()) {
      return UnparsedRequestError(
          "Evaluate", pb::EvaluateRequest::descriptor()->full_name());
    }
    switch (request.kind_case()) {
      case pb::EvaluateRequest::kHeader:
        if (have_header_) {
          return absl::InvalidArgumentError("a second header");
        }
        have_header_ = true;
        if (const absl::Status started = StartEvaluation(request.header());
            !started.ok()) {
          RefuseDataToken(*rpc_, request.header().data_token());
          return started;
        }
        return absl::OkStatus();
      case pb::EvaluateRequest::kBlock: {
        RETURN_IF_ERROR(CheckStreamBlock());
        if (config_.post_training) {
          const pb::RowBlock& block = request.block();
          return lanes_[0]->EvaluatePostTraining(
              {block.logits(), block.targets(), block.teacher_logits(),
               block.teacher_indices(), block.teacher_logprobs(),
               block.segment_ids(), block.advantages(),
               block.sampling_logprobs(), block.reference_logprobs()});
        }
        const std::string& logits_bytes = request.block().logits();
        const std::string& targets_bytes = request.block().targets();
        const absl::string_view parsed[] = {logits_bytes, targets_bytes};
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
    const bool post_training = IsPostTrainingEvaluation(header);
    RETURN_IF_ERROR(CheckDataConnections(*rpc_, header.data_token(),
                                         header.data_connections(),
                                         "send the blocks on the stream"));
    if (!header.weight().empty()) {
      ASSIGN_OR_RETURN(
          head_, LeaseLinearHead(rpc_->store(), admission_.tenant(), header,
                                 &config_.spec));
      config_.weight = head_.weight.tensor()->data();
      if (head_.bias.tensor() != nullptr) {
        config_.bias = head_.bias.tensor()->data();
      }
    }
    // After the head: over hidden states, V is the weight's.
    if (post_training) {
      ASSIGN_OR_RETURN(config_.post,
                       ParsePostTrainingEvaluation(header, config_.spec.vocab,
                                                   config_.spec.options));
      config_.post_training = true;
    }
    config_.options = config_.spec.options;
    config_.tenant = admission_.tenant();
    config_.cancelled = CancellationOf(context_);
    config_.vocab = config_.spec.vocab;
    config_.logits_dtype = config_.spec.logits_dtype;
    config_.targets_dtype = config_.spec.targets_dtype;
    if (!header.options().class_weights().empty()) {
      ASSIGN_OR_RETURN(
          weights_,
          LeaseClassWeights(rpc_->store(), admission_.tenant(),
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
      lanes_.push_back(std::make_unique<EvaluationLane>(
          rpc_->store(), rpc_->metrics(), &config_, order_.get(), i));
    }
    if (header.data_token().empty()) return absl::OkStatus();
    // Connection i's frames go to lane i; the ranges only count the parts.
    auto link = std::make_shared<EvaluateLink>(this);
    ASSIGN_OR_RETURN(
        transfer_,
        rpc_->data_plane()->Expect(
            header.data_token(),
            std::vector<DataTransfer::Range>(static_cast<size_t>(lanes)),
            FrameWork(), [link](const absl::Status& status) {
              if (link->Claim()) link->reactor->EndFromTransfer(status);
            }));
    link_ = std::move(link);
    return absl::OkStatus();
  }

  // The work of data connection i: its frames, evaluated into lane i. Runs
  // while the lanes exist (they go only after Cancel, or after the transfer
  // ended).
  DataTransfer::Work FrameWork() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::vector<EvaluationLane*> lanes;
    for (const std::unique_ptr<EvaluationLane>& lane : lanes_) {
      lanes.push_back(lane.get());
    }
    return EvaluationFrameWork(
        std::move(lanes), EvaluationFrameLayout(config_),
        config_.weight != nullptr ? "hidden states" : "logits",
        config_.post_training);
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
    const EvaluationLoss reduced =
        config_.post_training
            ? ReducePostTrainingEvaluation(total, config_.options, config_.post)
            : ReduceEvaluation(total, config_.options);
    pb::EvaluateResponse response;
    response.set_loss(reduced.loss);
    response.set_z_loss(reduced.z_loss);
    response.set_rows(total.rows);
    response.set_valid_tokens(total.valid_tokens);
    response.set_correct_tokens(total.correct_tokens);
    response.set_nonfinite_rows(total.nonfinite_rows);
    response.set_denominator(reduced.denominator);
    response.set_copy_seconds(total.copy_seconds);
    response.set_kernel_seconds(total.kernel_seconds);
    if (config_.post_training) {
      response.set_distillation_loss(reduced.distillation);
      if (config_.post.policy) {
        FillPolicyStats(total.policy, response.mutable_policy_stats());
      }
      if (config_.post.segmented) {
        const size_t count = static_cast<size_t>(config_.post.segment_count);
        std::vector<double> loss = total.segment_loss;
        std::vector<int64_t> tokens = total.segment_tokens;
        loss.resize(count, 0.0);
        tokens.resize(count, 0);
        response.mutable_segment_loss()->Add(loss.begin(), loss.end());
        response.mutable_segment_tokens()->Add(tokens.begin(), tokens.end());
      }
    }
    return SerializeResponse(response, response_);
  }

  // Finishes the RPC with `status`, unless the data connections' outcome
  // claimed that already.
  void End(const grpc::Status& status) override {
    if (link_ != nullptr && !link_->Claim()) return;
    FinishRpc(status);
  }

  // Recorded before Finish, so that a client that has its status also sees it
  // counted. The leases on the class weights and the LM head end before the
  // client can see the status too: a Release it sends next frees their
  // memory at once, instead of when gRPC gets round to OnDone. (Every path here
  // has stopped the lanes' work: Complete and EndFromTransfer cleared them,
  // Abandon cancelled the transfer first.)
  void FinishRpc(const grpc::Status& status) {
    rpc_->RecordRpc("Evaluate", status.error_code(), start_,
                    admission_.tenant());
    weights_ = ReadLease();
    head_ = LinearHead();
    Finish(status);
  }

  RpcSupport* const rpc_;
  const absl::Time start_ = absl::Now();
  grpc::ByteBuffer* const response_;
  Admission admission_;
  bool have_header_ ABSL_GUARDED_BY(mu_) = false;
  // Set from the header under mu_; read-only afterwards (the lanes read it
  // on the data connections' threads).
  EvaluationConfig config_;
  ReadLease weights_;
  LinearHead head_;  // the weight and bias of an evaluation over hidden states
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

grpc::ServerReadReactor<grpc::ByteBuffer>* NewEvaluateReactor(
    RpcSupport* rpc, grpc::CallbackServerContext* context,
    grpc::ByteBuffer* response) {
  return new EvaluateReactor(rpc, context, response);
}

}  // namespace lossd
