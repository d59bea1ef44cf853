// Linear cross-entropy on the CPU: OpenBLAS sgemm around the existing CPU
// cross-entropy (or the post-training losses' rows), chunked over rows so
// that only one chunk of fp32 logits is ever held.
#include "kernels/cpu/linear_cross_entropy_cpu.h"

#include <cblas.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cpu/cross_entropy_cpu.h"
#include "kernels/cpu/cross_entropy_internal.h"
#include "kernels/cpu/post_training_cpu.h"

namespace lossd {
namespace {

using cpu_internal::LoadLogit;

absl::Status Invalid(const std::string& message) {
  return absl::InvalidArgumentError(
      absl::StrCat("linear_cross_entropy: ", message));
}

// Chunk sizes: one chunk of fp32 logits of at most kChunkBytes (the memory the
// call holds beyond its outputs), W converted in blocks of kBlockBytes.
constexpr int64_t kChunkBytes = int64_t{32} << 20;
constexpr int64_t kBlockBytes = int64_t{8} << 20;

// Fills out[0, count) with elements [first, first + count) of `src` as fp32.
void ToFloat(const void* src, DType dtype, int64_t first, int64_t count,
             float* out) {
  for (int64_t i = 0; i < count; ++i) out[i] = LoadLogit(src, dtype, first + i);
}

// Rows [row0, row0 + count) of a [*, hidden] tensor as fp32: a pointer into it
// for fp32, else converted into `scratch`.
const float* RowsAsFloat(const void* tensor, DType dtype, int64_t hidden,
                         int64_t row0, int64_t count,
                         std::vector<float>* scratch) {
  if (dtype == DType::kFloat32)
    return static_cast<const float*>(tensor) + row0 * hidden;
  scratch->resize(static_cast<size_t>(count * hidden));
  ToFloat(tensor, dtype, row0 * hidden, count * hidden, scratch->data());
  return scratch->data();
}

// The chunk of rows and the block of W's rows the call works in.
int64_t ChunkRows(const LinearCrossEntropyArgs& args) {
  return std::clamp<int64_t>(kChunkBytes / (args.vocab * 4), 1,
                             std::max<int64_t>(args.rows, 1));
}
int64_t BlockRows(const LinearCrossEntropyArgs& args) {
  return std::clamp<int64_t>(kBlockBytes / (args.hidden * 4), 1, args.vocab);
}

// Sum over the valid rows of the target's class weight (1 without weights):
// a mean's denominator, which every chunk divides by.
double TargetWeightSum(const LinearCrossEntropyArgs& args) {
  double sum = 0.0;
  for (int64_t row = 0; row < args.rows; ++row) {
    const int64_t target = LoadTarget(args.targets, args.targets_dtype, row);
    if (target == args.options.ignore_index) continue;
    sum += args.class_weights == nullptr ? 1.0 : args.class_weights[target];
  }
  return sum;
}

// The fp32 buffers of one call, reused by every chunk.
struct ChunkBuffers {
  std::vector<float> logits;     // [chunk_rows, vocab]: Z, then dL/dZ
  std::vector<float> x_scratch;  // X's rows as fp32 (16-bit X only)
  std::vector<float> w_scratch;  // a block of W's rows as fp32 (16-bit W)
  std::vector<float> dx;         // [chunk_rows, hidden]
  std::vector<float> bias;       // [vocab] as fp32
  std::vector<float> column;     // [vocab]: one chunk's column sums for dbias
};

absl::Status AllocateChunkBuffers(const LinearCrossEntropyArgs& args,
                                  int64_t chunk_rows, ChunkBuffers* buffers) {
  try {
    buffers->logits.resize(static_cast<size_t>(chunk_rows * args.vocab));
    if (args.dx_mode != GradientMode::kNone) {
      buffers->dx.resize(static_cast<size_t>(chunk_rows * args.hidden));
    }
    if (args.bias != nullptr) {
      buffers->bias.resize(static_cast<size_t>(args.vocab));
      ToFloat(args.bias, args.dtype, 0, args.vocab, buffers->bias.data());
    }
    if (args.grad_bias != nullptr) {
      buffers->column.resize(static_cast<size_t>(args.vocab));
    }
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(
        "linear_cross_entropy: scratch allocation failed");
  }
  return absl::OkStatus();
}

// Z = X W^T (+ b) for the `count` rows of `x` (fp32), block by block of W's
// rows, into buffers->logits.
void ChunkLogits(const LinearCrossEntropyArgs& args, const float* x,
                 int64_t count, ChunkBuffers* buffers) {
  const int64_t hidden = args.hidden;
  const int64_t vocab = args.vocab;
  const int64_t block_rows = BlockRows(args);
  for (int64_t v0 = 0; v0 < vocab; v0 += block_rows) {
    const int64_t vb = std::min(block_rows, vocab - v0);
    const float* w = RowsAsFloat(args.weight, args.dtype, hidden, v0, vb,
                                 &buffers->w_scratch);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans,
                static_cast<int>(count), static_cast<int>(vb),
                static_cast<int>(hidden), 1.0f, x, static_cast<int>(hidden), w,
                static_cast<int>(hidden), 0.0f, buffers->logits.data() + v0,
                static_cast<int>(vocab));
  }
  if (args.bias != nullptr) {
    for (int64_t r = 0; r < count; ++r) {
      float* z = buffers->logits.data() + r * vocab;
      for (int64_t v = 0; v < vocab; ++v) z[v] += buffers->bias[v];
    }
  }
}

// The cross-entropy of rows [row0, row0 + count) on their logits, the
// gradient (when the call wants one) replacing them.
CrossEntropyArgs ChunkLossArgs(const LinearCrossEntropyArgs& args,
                               const CrossEntropyOptions& chunk_options,
                               int64_t row0, int64_t count, float* logits) {
  const bool gradient = LinearCrossEntropyWantsGradient(args);
  CrossEntropyArgs ce;
  ce.rows = count;
  ce.vocab = args.vocab;
  ce.row_stride = args.vocab;
  ce.logits_dtype = DType::kFloat32;
  ce.logits = logits;
  ce.targets_dtype = args.targets_dtype;
  ce.targets = static_cast<const char*>(args.targets) +
               row0 * static_cast<int64_t>(DTypeSize(args.targets_dtype));
  ce.class_weights = args.class_weights;
  ce.options = chunk_options;
  ce.mode = gradient ? GradientMode::kInPlace : GradientMode::kNone;
  ce.gradient = gradient ? logits : nullptr;
  if (args.token_loss != nullptr) ce.token_loss = args.token_loss + row0;
  if (args.token_lse != nullptr) ce.token_lse = args.token_lse + row0;
  if (args.token_argmax != nullptr) ce.token_argmax = args.token_argmax + row0;
  return ce;
}

// From G = dL/dZ of rows [row0, row0 + count) (in buffers->logits) and their
// X (`x`, fp32): the per-row factors applied, dbias += column sums of G,
// dW += G^T X and dX = G W.
void ChunkGradients(const LinearCrossEntropyArgs& args, int64_t row0,
                    int64_t count, const float* x, ChunkBuffers* buffers) {
  const int64_t hidden = args.hidden;
  const int64_t vocab = args.vocab;
  const int c = static_cast<int>(count);
  float* g = buffers->logits.data();
  if (args.token_grad_output != nullptr) {
    for (int64_t r = 0; r < count; ++r) {
      const float factor = args.token_grad_output[row0 + r];
      for (int64_t v = 0; v < vocab; ++v) g[r * vocab + v] *= factor;
    }
  }
  if (args.grad_bias != nullptr) {
    // Column sums in row order, fp32, then one add into the accumulator.
    std::vector<float>& column = buffers->column;
    std::fill(column.begin(), column.end(), 0.0f);
    for (int64_t r = 0; r < count; ++r) {
      for (int64_t v = 0; v < vocab; ++v) column[v] += g[r * vocab + v];
    }
    for (int64_t v = 0; v < vocab; ++v) args.grad_bias[v] += column[v];
  }
  const bool want_dw = args.accumulate != AccumulateMode::kNone;
  const bool want_dx = args.dx_mode != GradientMode::kNone;
  const int64_t block_rows = BlockRows(args);
  for (int64_t v0 = 0; v0 < vocab; v0 += block_rows) {
    const int64_t vb = std::min(block_rows, vocab - v0);
    if (want_dw) {
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, static_cast<int>(vb),
                  static_cast<int>(hidden), c, 1.0f, g + v0,
                  static_cast<int>(vocab), x, static_cast<int>(hidden), 1.0f,
                  args.grad_weight + v0 * hidden, static_cast<int>(hidden));
    }
    if (want_dx) {
      const float* w = RowsAsFloat(args.weight, args.dtype, hidden, v0, vb,
                                   &buffers->w_scratch);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, c,
                  static_cast<int>(hidden), static_cast<int>(vb), 1.0f, g + v0,
                  static_cast<int>(vocab), w, static_cast<int>(hidden),
                  v0 == 0 ? 0.0f : 1.0f, buffers->dx.data(),
                  static_cast<int>(hidden));
    }
  }
  if (want_dx) {
    // X of this chunk is no longer read (dW above used it): in place is safe.
    for (int64_t i = 0; i < count * hidden; ++i) {
      cpu_internal::StoreDouble(
          args.dx, args.dtype, row0 * hidden + i,
          static_cast<double>(buffers->dx[static_cast<size_t>(i)]));
    }
  }
}

}  // namespace

int64_t LinearCrossEntropyCpuWorkspaceBytes(
    const LinearCrossEntropyArgs& args) {
  if (args.vocab < 1 || args.hidden < 1) return 0;
  const int64_t chunk_rows = ChunkRows(args);
  int64_t floats = chunk_rows * args.vocab;  // the logits
  if (args.dx_mode != GradientMode::kNone) floats += chunk_rows * args.hidden;
  if (args.dtype != DType::kFloat32) {
    floats += chunk_rows * args.hidden;       // X's rows as fp32
    floats += BlockRows(args) * args.hidden;  // W's rows as fp32
  }
  if (args.bias != nullptr) floats += args.vocab;
  if (args.grad_bias != nullptr) floats += args.vocab;
  return floats * static_cast<int64_t>(sizeof(float));
}

namespace {

// Computes the loss of rows [row0, row0 + count) on their fp32 logits, the
// gradient G replacing them when the call wants one.
using ChunkLoss =
    std::function<absl::Status(int64_t row0, int64_t count, float* logits)>;

// Every chunk of rows in order: Z, `chunk_loss` on it, then dbias, dW and dX
// from G. The accumulators are cleared first for kOverwrite.
absl::Status RunLinearChunks(const LinearCrossEntropyArgs& args,
                             const ChunkLoss& chunk_loss) {
  const int64_t rows = args.rows;
  const int64_t chunk_rows = ChunkRows(args);
  ChunkBuffers buffers;
  RETURN_IF_ERROR(AllocateChunkBuffers(args, chunk_rows, &buffers));
  if (args.accumulate == AccumulateMode::kOverwrite) {
    std::memset(args.grad_weight, 0,
                static_cast<size_t>(args.vocab * args.hidden) * sizeof(float));
    if (args.grad_bias != nullptr)
      std::memset(args.grad_bias, 0,
                  static_cast<size_t>(args.vocab) * sizeof(float));
  }
  for (int64_t row0 = 0; row0 < rows; row0 += chunk_rows) {
    if (args.cancelled && args.cancelled()) {
      return absl::CancelledError(
          absl::StrCat("linear_cross_entropy: cancelled after ", row0, " of ",
                       rows, " rows"));
    }
    const int64_t count = std::min(chunk_rows, rows - row0);
    const float* x = RowsAsFloat(args.x, args.dtype, args.hidden, row0, count,
                                 &buffers.x_scratch);
    ChunkLogits(args, x, count, &buffers);
    RETURN_IF_ERROR(chunk_loss(row0, count, buffers.logits.data()));
    if (LinearCrossEntropyWantsGradient(args)) {
      ChunkGradients(args, row0, count, x, &buffers);
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status LinearCrossEntropyCpu(const LinearCrossEntropyArgs& args,
                                   CrossEntropyResult* result) {
  if (result == nullptr) return Invalid("result is nullptr");
  absl::Status status = ValidateLinearCrossEntropyArgs(args);
  if (!status.ok()) return status;
  status = CheckTargets(args.targets, args.targets_dtype, args.rows, args.vocab,
                        args.options.ignore_index);
  if (!status.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("linear_cross_entropy: ", status.message()));
  }
  const double target_weight_sum = TargetWeightSum(args);
  const CrossEntropyOptions chunk_options =
      LinearChunkOptions(args.options, target_weight_sum);
  CrossEntropyResult total;
  RETURN_IF_ERROR(
      RunLinearChunks(args, [&](int64_t row0, int64_t count, float* logits) {
        CrossEntropyResult chunk;
        RETURN_IF_ERROR(CrossEntropyCpu(
            ChunkLossArgs(args, chunk_options, row0, count, logits), &chunk));
        AddChunkResult(chunk, &total);
        return absl::OkStatus();
      }));
  if (args.options.reduction == Reduction::kMean &&
      (total.valid_tokens > 0 || args.options.normalizer > 0.0) &&
      total.denominator == 0.0) {
    total.denominator = args.options.normalizer > 0.0 ? args.options.normalizer
                                                      : target_weight_sum;
  }
  *result = total;
  return absl::OkStatus();
}

absl::Status LinearPostTrainingCpu(const LinearPostTrainingArgs& args,
                                   PostTrainingResult* result,
                                   int num_threads) {
  if (result == nullptr) return Invalid("result is nullptr");
  const LinearCrossEntropyArgs& linear = args.linear;
  // Without targets (a distillation with alpha 0) the linear checks see a
  // stand-in; the post-training checks decide whether that is allowed.
  LinearCrossEntropyArgs checked = linear;
  if (checked.targets == nullptr) {
    checked.targets = linear.x;
    checked.targets_dtype = DType::kInt32;
  }
  RETURN_IF_ERROR(ValidateLinearCrossEntropyArgs(checked));
  const PostTrainingArgs whole = WholePostTrainingView(args);
  RETURN_IF_ERROR(ValidatePostTrainingArgs(whole));
  RETURN_IF_ERROR(CheckPostTrainingData(whole));
  // The reduction's factors are the whole call's (a mean over every chunk's
  // rows, segments that span chunks), known before any chunk runs.
  const PostTrainingPlan plan = PlanPostTraining(whole);
  std::vector<double> row_scale = plan.row_scale;
  for (double& scale : row_scale) scale *= linear.options.grad_scale;
  std::vector<PostTrainingRowTotals> totals(
      static_cast<size_t>(std::max<int64_t>(linear.rows, 0)));
  const bool gradient = LinearCrossEntropyWantsGradient(linear);
  RETURN_IF_ERROR(
      RunLinearChunks(linear, [&](int64_t row0, int64_t count, float* logits) {
        PostTrainingChunk chunk;
        SlicePostTrainingRows(whole, row0, count, logits, DType::kFloat32,
                              gradient, &chunk);
        PostTrainingCpuRows(chunk.args, row_scale.data() + row0,
                            totals.data() + row0, num_threads);
        return absl::OkStatus();
      }));
  *result = ReducePostTrainingRows(whole, plan, totals);
  return absl::OkStatus();
}

}  // namespace lossd
