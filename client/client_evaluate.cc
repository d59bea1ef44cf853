// lossd::Client's Evaluate: row blocks produced on a helper thread and sent
// on the gRPC stream, or as frames (common/data_wire.h) over data
// connections, block b over connection b mod K.
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <array>
#include <deque>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "client/client.h"
#include "client/client_internal.h"
#include "client/data_connection.h"
#include "common/data_wire.h"
#include "common/status_macros.h"
#include "lossd/v1/lossd.grpc.pb.h"

namespace lossd {

using client_internal::CheckPostTrainingAnswered;
using client_internal::ConnectionCloser;
using client_internal::EvaluateHeaderFor;
using client_internal::FinishAfterData;
using client_internal::FromProto;
using client_internal::PrepareContext;
using client_internal::ToAbsl;

namespace {

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

// Whether the blocks of an Evaluate with `options` may come without targets
// (targets dtype kInvalid): a distillation with alpha 0 only.
bool TargetsOptional(const EvaluateOptions& options) {
  return options.distillation.has_value() &&
         options.distillation->alpha == 0.0f;
}

// The frame layout of an Evaluate's blocks: rows of `vocab` values of
// `logits_dtype` (H with a weight), targets unless `targets_dtype` is
// kInvalid, and the per-row inputs `options` declares, a dense teacher's
// rows `teacher_vocab` wide.
EvaluateFrameLayout FrameLayoutFor(int64_t vocab, DType logits_dtype,
                                   DType targets_dtype,
                                   const EvaluateOptions& options,
                                   int64_t teacher_vocab) {
  FrameInputs inputs;
  if (options.distillation.has_value()) {
    const DistillationOptions& distillation = *options.distillation;
    if (distillation.evaluate_teacher_dtype != DType::kInvalid) {
      inputs.teacher_row_bytes =
          teacher_vocab *
          static_cast<int64_t>(DTypeSize(distillation.evaluate_teacher_dtype));
    } else {
      inputs.top_k = distillation.top_k;
      inputs.index_bytes =
          static_cast<int64_t>(DTypeSize(distillation.top_k_indices_dtype));
    }
  }
  inputs.segments = options.segments.has_value();
  inputs.policy = options.policy.has_value();
  inputs.reference_logprobs =
      inputs.policy && options.policy->evaluate_reference_logprobs;
  return MakeEvaluateFrameLayout(
      vocab * static_cast<int64_t>(DTypeSize(logits_dtype)),
      targets_dtype == DType::kInvalid
          ? 0
          : static_cast<int64_t>(DTypeSize(targets_dtype)),
      inputs);
}

// The parts of `block` in the order a frame carries them.
std::array<absl::string_view, kFrameParts> FrameParts(const RowBlock& block) {
  std::array<absl::string_view, kFrameParts> parts;
  parts[kFrameRows] = block.Logits();
  parts[kFrameTargets] = block.Targets();
  parts[kFrameTeacherLogits] = block.teacher_logits;
  parts[kFrameTeacherIndices] = block.teacher_indices;
  parts[kFrameTeacherLogprobs] = block.teacher_logprobs;
  parts[kFrameSegmentIds] = block.segment_ids;
  parts[kFrameAdvantages] = block.advantages;
  parts[kFrameSamplingLogprobs] = block.sampling_logprobs;
  parts[kFrameReferenceLogprobs] = block.reference_logprobs;
  return parts;
}

// The rows of block `number`, whose every part must hold `layout`'s bytes
// for them (a frame carries its row count, so the server cannot tell a
// short part from the next one): INVALID_ARGUMENT naming the block
// otherwise, before anything of it is sent.
absl::StatusOr<int64_t> FrameRowsOf(const RowBlock& block,
                                    const EvaluateFrameLayout& layout,
                                    std::size_t number, bool hidden_states) {
  const std::array<absl::string_view, kFrameParts> parts = FrameParts(block);
  const std::size_t row_bytes =
      static_cast<std::size_t>(layout.row_bytes[kFrameRows]);
  const std::size_t target_bytes =
      static_cast<std::size_t>(layout.row_bytes[kFrameTargets]);
  const absl::string_view logits = parts[kFrameRows];
  const absl::string_view targets = parts[kFrameTargets];
  const std::size_t rows = logits.size() / row_bytes;
  if (logits.size() % row_bytes != 0 || targets.size() != rows * target_bytes) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "block %d: %d %s bytes and %d targets bytes are not whole rows of %d "
        "and %d bytes",
        number, logits.size(), hidden_states ? "hidden-state" : "logits",
        targets.size(), row_bytes, target_bytes));
  }
  for (int part = kFrameTargets + 1; part < kFrameParts; ++part) {
    const std::size_t need =
        rows * static_cast<std::size_t>(layout.row_bytes[part]);
    if (parts[part].size() != need) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "block %d: %s has %d bytes; %d rows need %d (the options declare "
          "what every block carries)",
          number, FramePartName(static_cast<FramePart>(part)),
          parts[part].size(), rows, need));
    }
  }
  return static_cast<int64_t>(rows);
}

// Produces the blocks of `next_block` into `queues`, block b (of those with
// rows) into queue b mod K, each checked against `layout`; then closes every
// queue with the outcome.
void ProduceFrames(const RowBlockProducer& next_block,
                   const EvaluateFrameLayout& layout, bool hidden_states,
                   std::vector<BlockQueue>* queues) {
  absl::Status status;
  for (std::size_t b = 0, number = 0;; ++number) {
    RowBlock block;
    absl::StatusOr<bool> more = next_block(&block);
    if (!more.ok()) {
      status = more.status();
      break;
    }
    if (!*more) break;
    absl::StatusOr<int64_t> rows =
        FrameRowsOf(block, layout, number, hidden_states);
    if (!rows.ok()) {
      status = rows.status();
      break;
    }
    if (*rows == 0) continue;  // nothing to evaluate
    if (!(*queues)[b++ % queues->size()].Push(std::move(block))) break;
  }
  for (BlockQueue& queue : *queues) queue.Close(status);
}

}  // namespace

absl::StatusOr<EvaluateResult> Client::Evaluate(
    int64_t vocab, DType logits_dtype, DType targets_dtype,
    const EvaluateOptions& options, const RowBlockProducer& next_block,
    const ProgressCallback& progress) {
  if (vocab < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        options.weight.empty() ? "vocab " : "hidden width ", vocab, " < 1"));
  }
  if (!options.bias.empty() && options.weight.empty()) {
    return absl::InvalidArgumentError(
        "EvaluateOptions.bias is set but weight is not: a bias needs the "
        "weight it is added to");
  }
  if (!IsLogitsDType(logits_dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "logits dtype ", DTypeString(logits_dtype), " is not floating point"));
  }
  if (!IsTargetsDType(targets_dtype) &&
      !(targets_dtype == DType::kInvalid && TargetsOptional(options))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "targets dtype ", DTypeString(targets_dtype),
        " is not int32/int64 (kInvalid, no targets, only for a distillation "
        "with alpha 0)"));
  }
  // Before any block is produced or sent, on either path: an older server
  // would evaluate plain cross entropy on the stream and misread the frames.
  if (options.distillation.has_value() || options.policy.has_value() ||
      options.segments.has_value()) {
    RETURN_IF_ERROR(RequirePostTraining("Evaluate"));
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
  // Blocks without targets on the stream under a targets dtype, as servers
  // from before DTYPE_UNSPECIFIED there take them.
  *request.mutable_header() = EvaluateHeaderFor(
      vocab, logits_dtype,
      targets_dtype == DType::kInvalid ? DType::kInt32 : targets_dtype,
      options);
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
  // Rows counted from the logits: a block may carry no targets.
  const std::size_t row_bytes =
      static_cast<std::size_t>(vocab) * DTypeSize(logits_dtype);
  int64_t rows_sent = 0;
  RowBlock block;
  while (sending && queue.Pop(&block)) {
    const int64_t rows =
        static_cast<int64_t>(block.Logits().size() / row_bytes);
    v1::RowBlock* proto = request.mutable_block();
    proto->set_logits(std::move(block.logits));
    proto->set_targets(std::move(block.targets));
    proto->set_teacher_logits(std::move(block.teacher_logits));
    proto->set_teacher_indices(std::move(block.teacher_indices));
    proto->set_teacher_logprobs(std::move(block.teacher_logprobs));
    proto->set_segment_ids(std::move(block.segment_ids));
    proto->set_advantages(std::move(block.advantages));
    proto->set_sampling_logprobs(std::move(block.sampling_logprobs));
    proto->set_reference_logprobs(std::move(block.reference_logprobs));
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
  RETURN_IF_ERROR(CheckPostTrainingAnswered(target_, options, response));
  return FromProto(response);
}

std::optional<absl::StatusOr<EvaluateResult>>
Client::EvaluateOverDataConnections(int64_t vocab, DType logits_dtype,
                                    DType targets_dtype,
                                    const EvaluateOptions& options,
                                    const RowBlockProducer& next_block,
                                    const ProgressCallback& progress) {
  using Result = absl::StatusOr<EvaluateResult>;
  // A dense teacher's rows over hidden states are V wide, the weight's rows.
  int64_t teacher_vocab = vocab;
  if (!options.weight.empty() && options.distillation.has_value() &&
      options.distillation->evaluate_teacher_dtype != DType::kInvalid) {
    absl::StatusOr<TensorInfo> weight = Describe(options.weight);
    if (!weight.ok()) return Result(weight.status());
    if (weight->shape.size() != 2) {
      return Result(absl::InvalidArgumentError(absl::StrCat(
          "EvaluateOptions.weight ", options.weight, " is not [V, H]")));
    }
    teacher_vocab = weight->shape[0];
  }
  const EvaluateFrameLayout layout = FrameLayoutFor(
      vocab, logits_dtype, targets_dtype, options, teacher_vocab);
  std::optional<absl::StatusOr<DataConnections>> opened = OpenDataConnections();
  if (!opened.has_value()) return std::nullopt;
  if (!opened->ok()) return Result(opened->status());
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
    std::thread producer([&] {
      ProduceFrames(next_block, layout, !options.weight.empty(), &queues);
    });
    absl::Mutex mu;
    int64_t rows_sent = 0;
    std::vector<absl::Status> results(fds.size());
    std::vector<std::thread> senders;
    const std::size_t row_bytes =
        static_cast<std::size_t>(layout.row_bytes[kFrameRows]);
    for (int i = 0; i < connections; ++i) {
      senders.emplace_back([&, i] {
        const int fd = fds[static_cast<std::size_t>(i)];
        BlockQueue& queue = queues[static_cast<std::size_t>(i)];
        absl::Status status = SendDataPreamble(fd, token, i);
        RowBlock block;
        while (status.ok() && queue.Pop(&block)) {
          const int64_t rows =
              static_cast<int64_t>(block.Logits().size() / row_bytes);
          status = SendEvaluateFrame(fd, rows, FrameParts(block));
          if (status.ok()) {
            absl::MutexLock lock(&mu);
            rows_sent += rows;
            if (progress) progress(rows_sent, options.total_rows);
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
    return Result(produced);
  }
  if (!sent.ok()) closer.Close();
  const grpc::Status finished =
      FinishAfterData(&context, !sent.ok(), [&] { return writer->Finish(); });
  closer.Close();
  if (!sent.ok() &&
      (finished.ok() || finished.error_code() == grpc::StatusCode::CANCELLED)) {
    return Result(sent);
  }
  if (!finished.ok()) return Result(ToAbsl(finished));
  if (absl::Status answered =
          CheckPostTrainingAnswered(target_, options, response);
      !answered.ok()) {
    return Result(answered);
  }
  return Result(FromProto(response));
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

}  // namespace lossd
