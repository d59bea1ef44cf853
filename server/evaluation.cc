// The evaluation engine of Evaluate (evaluation.h).
#include "server/evaluation.h"

#include <sys/socket.h>

#include <array>
#include <cerrno>
#include <cstring>
#include <limits>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/checked_math.h"
#include "common/data_wire.h"
#include "common/status_macros.h"

namespace lossd {

namespace {

// The error of data connection `index` that ended after `got` of the `total`
// bytes of frame `frame`'s `what`.
absl::Status FrameEndedError(int index, int64_t got, size_t total,
                             int64_t frame, const char* what) {
  return absl::InvalidArgumentError(absl::StrFormat(
      "data connection %d ended after %d of the %d bytes of frame %d's %s",
      index, got, total, frame, what));
}

// Exactly `bytes` bytes from data connection `index` into `out`: the rest of
// frame `frame`'s `what`, of which `already` bytes came before and which
// holds `total` bytes (0: already + bytes), for the error of a connection
// that ends first.
absl::Status ReadFrameBytes(int fd, int index, char* out, size_t bytes,
                            int64_t frame, const char* what, size_t already = 0,
                            size_t total = 0) {
  for (size_t got = 0; got < bytes;) {
    const ssize_t n = recv(fd, out + got, bytes - got, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n == 0) {
      return FrameEndedError(index, static_cast<int64_t>(already + got),
                             total > 0 ? total : already + bytes, frame, what);
    }
    if (n < 0) {
      return DataConnectionError(index, static_cast<int64_t>(got),
                                 static_cast<int64_t>(bytes), n);
    }
    got += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

// The refusal of data connection `index` whose row of `layout` fits no
// frame.
std::string TooLargeRowMessage(int index, const EvaluateFrameLayout& layout,
                               const char* row_name) {
  const int64_t rows = layout.row_bytes[kFrameRows];
  const int64_t targets = layout.row_bytes[kFrameTargets];
  int64_t others = 0;
  for (int part = kFrameTargets + 1; part < kFrameParts; ++part) {
    others = CheckedAdd(others, layout.row_bytes[part])
                 .value_or(std::numeric_limits<int64_t>::max());
  }
  return absl::StrFormat(
      "data connection %d: a row of %d bytes of %s and %d of target%s is more "
      "than a frame may hold (%d MiB); send the blocks on the stream",
      index, rows, row_name, targets,
      others > 0 ? absl::StrFormat(" and %d of its other inputs", others)
                 : std::string(),
      kMaxFrameBytes >> 20);
}

}  // namespace

EvaluationLoss ReduceEvaluation(const EvaluationSums& total,
                                const CrossEntropyOptions& options) {
  EvaluationLoss result;
  result.loss = total.loss;
  result.z_loss = total.z_loss;
  if (options.reduction == Reduction::kMean) {
    result.denominator = options.normalizer > 0.0
                             ? options.normalizer
                             : (total.valid_tokens > 0 ? total.weight : 0.0);
    result.loss =
        result.denominator != 0.0 ? total.loss / result.denominator : 0.0;
    result.z_loss =
        result.denominator != 0.0 ? total.z_loss / result.denominator : 0.0;
  }
  return result;
}

absl::Status EvaluationLane::Evaluate(BytePieces pieces, ByteRange logits,
                                      ByteRange targets) {
  ASSIGN_OR_RETURN(const int64_t rows, Begin(logits.size, targets.size));
  if (rows == 0) return absl::OkStatus();

  Device* device = store_->device();
  const absl::Time copy_start = absl::Now();
  // Targets are small and read on the host too (the weight sum): gathered.
  host_targets_.resize(targets.size);
  char* gathered = host_targets_.data();
  RETURN_IF_ERROR(
      ForEachPiece(pieces, targets, [&](const uint8_t* piece, size_t size) {
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
      ForEachPiece(pieces, logits, [&](const uint8_t* piece, size_t size) {
        const absl::Status status = device->CopyFromHostAsync(
            logits_buffer_.data(), written, piece, size);
        written += size;
        return status;
      }));
  RETURN_IF_ERROR(device->FinishWrites(logits_buffer_.data()));
  block_.copy_seconds += absl::ToDoubleSeconds(absl::Now() - copy_start);
  return Run(rows);
}

absl::Status EvaluationLane::EvaluateFrame(int fd, int index, int64_t frame,
                                           int64_t rows) {
  const size_t logits = static_cast<size_t>(rows * config_->spec.row_bytes);
  const size_t targets =
      static_cast<size_t>(rows) * DTypeSize(config_->targets_dtype);
  RETURN_IF_ERROR(Begin(logits, targets).status());
  Device* device = store_->device();
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

absl::Status EvaluationLane::EvaluatePostTrainingFrame(
    int fd, int index, int64_t frame, int64_t rows,
    const EvaluateFrameLayout& layout) {
  // rows <= MaxFrameRows(layout): the frame's bytes fit kMaxFrameBytes.
  const size_t total =
      static_cast<size_t>(rows * layout.TotalRowBytes().value_or(0));
  if (total > frame_charged_) {
    // The host buffer (up to 64 MiB a connection) counts against the
    // tenant's byte quota as its tensors do, each growth while it is held.
    absl::StatusOr<QuotaCharge> charge = store_->ChargeTenantBytes(
        config_->tenant, static_cast<int64_t>(total - frame_charged_));
    if (!charge.ok()) {
      return absl::Status(
          charge.status().code(),
          absl::StrFormat("data connection %d, frame %d: its host buffer: %s",
                          index, frame, charge.status().message()));
    }
    frame_charges_.push_back(*std::move(charge));
    frame_charged_ = total;
  }
  frame_bytes_.resize(total);
  std::array<absl::string_view, kFrameParts> parts;
  size_t offset = 0;
  for (int part = 0; part < kFrameParts; ++part) {
    const size_t bytes = static_cast<size_t>(rows * layout.row_bytes[part]);
    if (bytes == 0) continue;
    // The error of a connection that ends here names the part it ended in.
    const std::string what = absl::StrCat(
        "rows (inside its ", FramePartName(static_cast<FramePart>(part)), ")");
    RETURN_IF_ERROR(ReadFrameBytes(fd, index, frame_bytes_.data() + offset,
                                   bytes, frame, what.c_str(), offset, total));
    parts[part] = absl::string_view(frame_bytes_.data() + offset, bytes);
    offset += bytes;
  }
  const absl::Status status = EvaluatePostTraining(
      {parts[kFrameRows], parts[kFrameTargets], parts[kFrameTeacherLogits],
       parts[kFrameTeacherIndices], parts[kFrameTeacherLogprobs],
       parts[kFrameSegmentIds], parts[kFrameAdvantages],
       parts[kFrameSamplingLogprobs], parts[kFrameReferenceLogprobs]});
  if (status.ok()) return status;
  return absl::Status(status.code(),
                      absl::StrFormat("data connection %d, frame %d: %s", index,
                                      frame, status.message()));
}

void EvaluationLane::FreeBuffers() {
  logits_buffer_ = ScratchBuffer();
  targets_buffer_ = ScratchBuffer();
  teacher_buffer_ = ScratchBuffer();
  frame_bytes_ = std::string();
  frame_charges_.clear();
  frame_charged_ = 0;
}

absl::StatusOr<int64_t> EvaluationLane::Begin(size_t logits, size_t targets) {
  block_ = EvaluationSums();
  ASSIGN_OR_RETURN(
      const int64_t rows,
      ValidateRowBlockSizes(config_->spec, static_cast<int64_t>(logits),
                            static_cast<int64_t>(targets), blocks_));
  ++blocks_;
  Metrics* const metrics = metrics_;
  if (metrics != nullptr) {
    metrics->AddTransferBytes(TransferDirection::kEvaluate,
                              static_cast<int64_t>(logits + targets),
                              config_->tenant);
  }
  return rows;
}

absl::Status EvaluationLane::Run(int64_t rows) {
  Device* device = store_->device();
  Metrics* const metrics = metrics_;
  const void* device_targets = host_targets_.data();
  if (!device->host_accessible()) {
    const absl::Time copy_start = absl::Now();
    RETURN_IF_ERROR(Reserve(&targets_buffer_, host_targets_.size()));
    RETURN_IF_ERROR(device->CopyFromHost(
        targets_buffer_.data(), 0, host_targets_.data(), host_targets_.size()));
    device_targets = targets_buffer_.data();
    block_.copy_seconds += absl::ToDoubleSeconds(absl::Now() - copy_start);
  }
  CrossEntropyResult result;
  const absl::Time start = absl::Now();
  RETURN_IF_ERROR(config_->weight != nullptr
                      ? RunLinear(rows, device_targets, &result)
                      : RunLogits(rows, device_targets, &result));
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  block_.kernel_seconds += seconds;
  if (metrics != nullptr) {
    metrics->ObserveKernel(
        device->name(),
        config_->weight != nullptr ? "linear_cross_entropy" : "cross_entropy",
        seconds);
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

absl::Status EvaluationLane::RunLogits(int64_t rows, const void* targets,
                                       CrossEntropyResult* result) {
  CrossEntropyArgs args;
  args.rows = rows;
  args.vocab = config_->vocab;
  args.row_stride = config_->vocab;
  args.logits_dtype = config_->logits_dtype;
  args.logits = logits_buffer_.data();
  args.targets_dtype = config_->targets_dtype;
  args.targets = targets;
  args.class_weights = config_->class_weights;
  args.options = config_->options;
  // Each block's sum; order_ adds them in block order.
  args.options.reduction = Reduction::kSum;
  args.mode = GradientMode::kNone;
  return store_->device()->CrossEntropy(args, result);
}

absl::Status EvaluationLane::RunLinear(int64_t rows, const void* targets,
                                       CrossEntropyResult* result) {
  const LinearCrossEntropyArgs args = LinearArgs(rows, targets);
  ASSIGN_OR_RETURN(const ScratchBuffer workspace, LinearWorkspace(args));
  return store_->device()->LinearCrossEntropy(args, result);
}

LinearCrossEntropyArgs EvaluationLane::LinearArgs(int64_t rows,
                                                  const void* targets) const {
  // LinearForward's device call with no gradient at all: the logits exist
  // only chunk by chunk inside it.
  LinearCrossEntropyArgs args;
  args.rows = rows;
  args.hidden = config_->spec.hidden;
  args.vocab = config_->vocab;
  args.dtype = config_->logits_dtype;
  args.x = logits_buffer_.data();
  args.weight = config_->weight;
  args.bias = config_->bias;
  args.targets_dtype = config_->targets_dtype;
  args.targets = targets;
  args.class_weights = config_->class_weights;
  args.options = config_->options;
  // Each block's sum; order_ adds them in block order.
  args.options.reduction = Reduction::kSum;
  args.dx_mode = GradientMode::kNone;
  args.accumulate = AccumulateMode::kNone;
  args.weight_hidden = config_->spec.hidden;
  args.weight_dtype = config_->logits_dtype;
  if (config_->bias != nullptr) args.bias_dtype = config_->logits_dtype;
  args.cancelled = config_->cancelled;
  return args;
}

absl::StatusOr<ScratchBuffer> EvaluationLane::LinearWorkspace(
    const LinearCrossEntropyArgs& args) const {
  return store_->ChargeWorkspace(
      config_->tenant, store_->device()->LinearCrossEntropyWorkspaceBytes(args),
      "the evaluation's working memory over hidden states");
}

absl::Status EvaluationLane::Reserve(ScratchBuffer* buffer, size_t bytes) {
  if (bytes <= buffer->bytes()) return absl::OkStatus();
  *buffer = ScratchBuffer();  // its bytes go back first
  absl::StatusOr<ScratchBuffer> grown =
      store_->AllocateScratch(config_->tenant, static_cast<int64_t>(bytes));
  if (!grown.ok()) {
    return absl::Status(grown.status().code(),
                        absl::StrCat("a block buffer on the device: ",
                                     grown.status().message()));
  }
  *buffer = *std::move(grown);
  return absl::OkStatus();
}

EvaluateFrameLayout EvaluationFrameLayout(const EvaluationConfig& config) {
  const EvaluateSpec& spec = config.spec;
  const int64_t targets =
      spec.has_targets ? static_cast<int64_t>(DTypeSize(spec.targets_dtype))
                       : 0;
  FrameInputs inputs;
  if (config.post_training) {
    const PostTrainingEvaluation& post = config.post;
    if (post.distill && post.distillation.top_k == 0) {
      // Beyond int64 (a teacher wider than the logits' dtype): a row that
      // fits no frame.
      inputs.teacher_row_bytes =
          CheckedMul(spec.vocab,
                     static_cast<int64_t>(DTypeSize(post.teacher_dtype)))
              .value_or(std::numeric_limits<int64_t>::max());
    } else if (post.distill) {
      inputs.top_k = post.distillation.top_k;
      inputs.index_bytes =
          static_cast<int64_t>(DTypeSize(post.teacher_indices_dtype));
    }
    inputs.segments = post.segmented;
    inputs.policy = post.policy;
    inputs.reference_logprobs = post.policy_reference;
  }
  return MakeEvaluateFrameLayout(spec.row_bytes, targets, inputs);
}

DataTransfer::Work EvaluationFrameWork(std::vector<EvaluationLane*> lanes,
                                       const EvaluateFrameLayout& layout,
                                       const char* row_name,
                                       bool post_training) {
  return [lanes, layout, row_name, post_training](
             int index, int fd, const DataTransfer::Range&) -> absl::Status {
    EvaluationLane* const lane = lanes[static_cast<size_t>(index)];
    const int64_t max_rows = MaxFrameRows(layout);
    for (int64_t number = 0;; ++number) {
      unsigned char head[kFrameHeaderBytes];
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
      const uint64_t rows = DecodeFrameRows(head);
      if (rows < 1 || rows > static_cast<uint64_t>(max_rows)) {
        return absl::InvalidArgumentError(
            max_rows < 1
                ? TooLargeRowMessage(index, layout, row_name)
                : absl::StrFormat("data connection %d, frame %d: %d rows; a "
                                  "frame holds 1 to %d rows (%d MiB)",
                                  index, number, static_cast<int64_t>(rows),
                                  max_rows, kMaxFrameBytes >> 20));
      }
      RETURN_IF_ERROR(
          post_training
              ? lane->EvaluatePostTrainingFrame(
                    fd, index, number, static_cast<int64_t>(rows), layout)
              : lane->EvaluateFrame(fd, index, number,
                                    static_cast<int64_t>(rows)));
    }
  };
}

}  // namespace lossd
