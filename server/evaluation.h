// The evaluation engine of Evaluate (forward-only losses of streamed row
// blocks): the lanes that evaluate blocks on the device with O(block) memory,
// the block-order sum that makes the result independent of how many lanes
// carried the blocks, and the reading of data-connection frames into lanes.
// No gRPC here: the Evaluate reactor (evaluate_reactor.h) feeds it.
#ifndef LOSSD_SERVER_EVALUATION_H_
#define LOSSD_SERVER_EVALUATION_H_

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "common/data_wire.h"
#include "common/dtype.h"
#include "common/loss_options.h"
#include "common/raw_messages.h"
#include "kernels/linear_cross_entropy.h"
#include "kernels/linear_post_training.h"
#include "kernels/post_training.h"
#include "server/data_plane.h"
#include "server/evaluate_spec.h"
#include "server/metrics.h"
#include "server/post_training_evaluation.h"
#include "server/tensor_store.h"

namespace lossd {

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
  // Set for an evaluation over hidden states: each row holds spec.hidden
  // values of logits_dtype, evaluated against this weight [vocab, hidden]
  // (and bias [vocab], or null); device memory the reactor's leases hold.
  const void* weight = nullptr;
  const void* bias = nullptr;
  // The RPC's cancellation (or passed deadline): asked between the chunks of
  // rows of a block over hidden states, whose kernel may run long. Empty:
  // never asked.
  std::function<bool()> cancelled;
  // Set for a post-training evaluation (distillation, policy or segments):
  // the blocks carry the teacher's rows, the policy's inputs and segment ids
  // (EvaluatePostTraining).
  bool post_training = false;
  PostTrainingEvaluation post;
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
  // Post-training evaluations: the divergence term's sum, and per segment
  // (global ids) the loss, divergence and valid-token sums.
  double distillation = 0.0;
  std::vector<double> segment_loss;
  std::vector<double> segment_distillation;
  std::vector<int64_t> segment_tokens;
  PolicyStatsResult policy;  // a policy loss's sums over the valid tokens

  void Add(const EvaluationSums& other) {
    distillation += other.distillation;
    policy.clipped_tokens += other.policy.clipped_tokens;
    policy.ratio_sum += other.policy.ratio_sum;
    policy.approx_kl_sum += other.policy.approx_kl_sum;
    policy.kl_sum += other.policy.kl_sum;
    policy.entropy_sum += other.policy.entropy_sum;
    AddVector(other.segment_loss, &segment_loss);
    AddVector(other.segment_distillation, &segment_distillation);
    AddVector(other.segment_tokens, &segment_tokens);
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

 private:
  template <typename T>
  static void AddVector(const std::vector<T>& from, std::vector<T>* into) {
    if (into->size() < from.size()) into->resize(from.size());
    for (size_t i = 0; i < from.size(); ++i) (*into)[i] += from[i];
  }
};

// The loss an evaluation's sums reduce to, as the options' reduction says.
struct EvaluationLoss {
  double loss = 0.0;
  double z_loss = 0.0;
  double denominator = 0.0;   // of a mean; 0 otherwise
  double distillation = 0.0;  // a post-training evaluation's divergence term
};
// The sums' mean (by the normalizer, or the weight of the valid targets; 0
// without any) for Reduction::kMean, else the sums themselves. Pure.
EvaluationLoss ReduceEvaluation(const EvaluationSums& total,
                                const CrossEntropyOptions& options);
// The same for a post-training evaluation: over tokens as ReduceEvaluation
// (the weight being the valid-token count), or over segments as `post`'s
// segment reduction says (docs/api.md, "Segments"). Pure; defined in
// post_training_evaluation.cc.
EvaluationLoss ReducePostTrainingEvaluation(const EvaluationSums& total,
                                            const CrossEntropyOptions& options,
                                            const PostTrainingEvaluation& post);

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
  // `store` (its device and scratch memory), `metrics` (nullable), `config`
  // and `order` are borrowed and outlive the lane.
  EvaluationLane(TensorStore* store, Metrics* metrics,
                 const EvaluationConfig* config, BlockOrderSum* order,
                 int index)
      : store_(store),
        metrics_(metrics),
        config_(config),
        order_(order),
        index_(index) {}
  EvaluationLane(const EvaluationLane&) = delete;
  EvaluationLane& operator=(const EvaluationLane&) = delete;
  ~EvaluationLane() { FreeBuffers(); }

  // One block, whose logits (or hidden states) and targets are `logits` and
  // `targets` of the concatenated `pieces`.
  absl::Status Evaluate(BytePieces pieces, ByteRange logits, ByteRange targets);

  // Frame `frame` of data connection `index` (`fd`), whose row count `rows`
  // has been read: its logits are received straight into the block buffer
  // through the device's host windows (the copy of one window overlapping
  // the receipt of the next), then its targets.
  absl::Status EvaluateFrame(int fd, int index, int64_t frame, int64_t rows);

  // One block of a post-training evaluation (config->post_training): its
  // logits, targets (empty: none, for a distillation with alpha 0), the
  // teacher's rows (dense logits, or top-k indices and logprobs), segment
  // ids, and a policy's advantages, sampling and reference logprobs (empty
  // without one), each one entry per row. Defined in
  // post_training_evaluation.cc.
  struct PostTrainingBlock {
    absl::string_view logits, targets, teacher_logits, teacher_indices,
        teacher_logprobs, segment_ids, advantages, sampling_logprobs,
        reference_logprobs;
  };
  absl::Status EvaluatePostTraining(const PostTrainingBlock& block);

  // Frame `frame` of data connection `index` (`fd`) of a post-training
  // evaluation, whose row count `rows` has been read: the rest of the frame,
  // its parts as `layout` says, is read into a host buffer (grown to the
  // largest frame and reused) and evaluated as the block of the same bytes
  // on the stream would be.
  absl::Status EvaluatePostTrainingFrame(int fd, int index, int64_t frame,
                                         int64_t rows,
                                         const EvaluateFrameLayout& layout);

  // Lets go of the block buffers (they grow again for a next block).
  void FreeBuffers();

 private:
  // A block of `logits` and `targets` bytes: checked and counted. Its rows.
  absl::StatusOr<int64_t> Begin(size_t logits, size_t targets);
  // The loss of the block of `rows` rows whose logits (or hidden states)
  // are in the block buffer and whose targets are in host_targets_: its
  // sums, to `order_`.
  absl::Status Run(int64_t rows);
  // The device's loss of that block into `result`: of its logits, or of its
  // hidden states against the config's weight. `targets` on the device.
  absl::Status RunLogits(int64_t rows, const void* targets,
                         CrossEntropyResult* result);
  absl::Status RunLinear(int64_t rows, const void* targets,
                         CrossEntropyResult* result);
  // The arguments of the linear cross entropy of `rows` hidden states in the
  // block buffer against the config's weight, without a gradient, summed.
  LinearCrossEntropyArgs LinearArgs(int64_t rows, const void* targets) const;
  // The working memory of a linear call with `args`, charged to the budget.
  absl::StatusOr<ScratchBuffer> LinearWorkspace(
      const LinearCrossEntropyArgs& args) const;
  // The post-training loss of `args` (its logits the block buffer's hidden
  // states, its inputs on the device) against the config's weight.
  absl::Status RunLinearPostTraining(const PostTrainingArgs& args,
                                     PostTrainingResult* result);
  // Grows the device buffer `*buffer` to hold `bytes`: the largest block so
  // far, charged to the memory budget.
  absl::Status Reserve(ScratchBuffer* buffer, size_t bytes);

  TensorStore* const store_;
  Metrics* const metrics_;
  const EvaluationConfig* const config_;
  ScratchBuffer logits_buffer_;
  ScratchBuffer targets_buffer_;
  ScratchBuffer teacher_buffer_;  // a dense teacher's rows
  std::string host_targets_;
  std::string frame_bytes_;  // a post-training frame's parts
  // frame_bytes_'s growths, charged to the tenant's byte quota while held.
  std::vector<QuotaCharge> frame_charges_;
  size_t frame_charged_ = 0;
  BlockOrderSum* const order_;
  const int index_;
  int64_t blocks_ = 0;    // every block, empty ones too (for messages)
  int64_t frames_ = 0;    // the blocks with rows: their order's frame numbers
  EvaluationSums block_;  // of the block under way
};

// The parts of the frames of an evaluation with `config`
// (common/data_wire.h): its rows and targets, and a post-training
// evaluation's teacher rows, segment ids and policy inputs.
EvaluateFrameLayout EvaluationFrameLayout(const EvaluationConfig& config);

// The work of data connection i of an evaluation over `lanes.size()`
// connections: frames (an 8-byte little-endian row count R >= 1, then the R
// rows of each part of `layout`; `row_name`, "logits" or "hidden states", a
// static string, names its rows) evaluated into lane i, in order, until the
// client ends its side between two frames; with `post_training`, each frame
// as a post-training block. The lanes are borrowed: they must exist while the
// transfer runs (free them only after DataTransfer::Cancel, or after the
// transfer ended).
DataTransfer::Work EvaluationFrameWork(std::vector<EvaluationLane*> lanes,
                                       const EvaluateFrameLayout& layout,
                                       const char* row_name,
                                       bool post_training);

}  // namespace lossd

#endif  // LOSSD_SERVER_EVALUATION_H_
