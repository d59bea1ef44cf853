// Host side of the CUDA linear cross-entropy: plans the chunks and the
// workspace, picks fixed cuBLASLt algorithms per shape, enqueues every chunk
// with no host synchronisation, and maps errors to absl::Status once.
#include "kernels/cuda/linear_cross_entropy_cuda.h"

#include <cublasLt.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cross_entropy_validate.h"
#include "kernels/cuda/convert_cuda.h"
#include "kernels/cuda/cross_entropy_cuda.h"
#include "kernels/cuda/cross_entropy_cuda_host.h"
#include "kernels/cuda/fused_linear_forward.h"
#include "kernels/cuda/gemm_sm90_policy.h"
#include "kernels/cuda/linear_cross_entropy_call.h"
#include "kernels/cuda/linear_cross_entropy_kernels.h"
#include "kernels/cuda/linear_cross_entropy_lab.h"
#include "kernels/cuda/lt_gemm.h"
#include "kernels/cuda/post_training_cuda.h"
#include "kernels/cuda/sparse_residual.h"
#include "kernels/linear_cross_entropy_validate.h"
#include "kernels/post_training_plan.h"

namespace lossd {

// The products of one chunk size.
struct linear_cuda::ChunkGemms {
  LtGemm logits, grad_weight, grad_x;
};

using linear_cuda::ChunkGemms;
using linear_cuda::FinishLinearCall;
using linear_cuda::GradientExponent;
using linear_cuda::LabConfig;
using linear_cuda::Layout;
using linear_cuda::LinearCudaCall;
using linear_cuda::MakeLayout;
using linear_cuda::MakeParts;
using linear_cuda::Parts;
using linear_cuda::PlanChunkGemms;
using linear_cuda::PrepareChunks;
using linear_cuda::RunChunks;

namespace {

// Device memory a chunk may take (logits, split gradient, stacked X): large
// enough that the per-chunk dW read-modify-write and the launch tails stay
// small against the products (measured: bench/RESULTS.md).
constexpr int64_t kChunkBudgetBytes = int64_t{9} << 28;  // 2.25 GiB

// The sparse residual leaves the small entries of G rounded to 16 bits; their
// share of a row's norm falls as 1/V (sum p^2 ~ e^(var z) / V). Measured on
// logits of std 2 (bench/RESULTS.md): dW 2.7e-5 from fp32 at V = 128256,
// 4.1e-5 at 50257, 4.7e-5 at 32000; below this vocabulary the dense split.
constexpr int64_t kSparseResidualMinVocab = 50000;

}  // namespace

Layout linear_cuda::MakeLayout(const LinearCrossEntropyArgs& args,
                               const LinearCrossEntropyLabConfig& config) {
  Layout l;
  l.precision = config.precision;
  if (l.precision == LinearPrecision::kAuto) {
    l.precision = args.vocab >= kSparseResidualMinVocab
                      ? LinearPrecision::kSparseResidual
                      : LinearPrecision::kSplitWeight;
  }
  const bool fp32 = args.dtype == DType::kFloat32;
  l.logits_fp32 = fp32 || l.precision != LinearPrecision::kFast;
  l.split = !fp32 && l.precision != LinearPrecision::kFast;
  l.sparse = l.split && l.precision == LinearPrecision::kSparseResidual;
  l.lo = l.split && l.precision != kLinearFp32Logits && !l.sparse;
  l.sparse_threshold =
      config.sparse_threshold > 0.0f ? config.sparse_threshold : 1.0f / 64;
  l.sparse_slots = config.sparse_slots > 0 ? config.sparse_slots : 128;
  l.dx_fp32_temp = l.split && l.precision == kLinearSplitBoth;
  l.gemm_schedule = config.gemm_schedule;
  const std::size_t v = static_cast<std::size_t>(args.vocab);
  const std::size_t h = static_cast<std::size_t>(args.hidden);
  l.row_bytes = v * (l.logits_fp32 ? 4 : DTypeSize(args.dtype));
  if (l.split) l.row_bytes += (l.lo ? 2 : 1) * v * 2;
  if (l.lo) l.row_bytes += 2 * h * 2;  // X stacked twice
  if (l.dx_fp32_temp) l.row_bytes += h * 4;
  // Records, their sort keys and values (the sort's own scratch is ~linear).
  if (l.sparse) l.row_bytes += static_cast<std::size_t>(l.sparse_slots) * 40;
  return l;
}

Parts linear_cuda::MakeParts(const LinearCrossEntropyArgs& args,
                             const Layout& l, int64_t chunk_rows,
                             int64_t chunks) {
  const std::size_t c = static_cast<std::size_t>(chunk_rows);
  const std::size_t v = static_cast<std::size_t>(args.vocab);
  Parts p;
  std::size_t at = 0;
  p.prepare = at;
  at += AlignUp(sizeof(LinearPrepareResult));
  p.results = at;
  at += AlignUp(sizeof(CrossEntropyCudaResult) * std::max<int64_t>(chunks, 1));
  p.ce = at;
  if (l.fused) {
    at += AlignUp(FusedLinearForwardWorkspaceBytes(chunk_rows, v));
  } else if (l.fused_gradient) {
    at += AlignUp(FusedLinearGradientWorkspaceBytes(chunk_rows, v));
  } else {
    at += AlignUp(CrossEntropyCudaWorkspaceBytes(chunk_rows));
  }
  // The bias in Z's dtype, for the product's epilogue.
  p.bias = at;
  if (args.bias != nullptr) {
    at += AlignUp(v * (l.logits_fp32 ? 4 : DTypeSize(args.dtype)));
  }
  p.logits = at;
  if (!l.fused) {
    at += AlignUp(c * v * (l.logits_fp32 ? 4 : DTypeSize(args.dtype)));
  }
  // hi and lo of a chunk of `count` rows are one [2 count, V] matrix (lo
  // right after hi), so that dW takes both in one product of depth 2 count
  // against X stacked twice (x2, [2 count, H]).
  p.hi = at;
  if (l.split) at += AlignUp(c * v * 2 * (l.lo ? 2 : 1));
  p.x2 = at;
  if (l.lo) at += AlignUp(2 * c * args.hidden * DTypeSize(args.dtype));
  p.dx = at;
  if (l.dx_fp32_temp) at += AlignUp(c * args.hidden * 4);
  p.sparse = at;
  if (l.sparse) {
    at += AlignUp(
        SparseResidualWorkspaceBytes(chunk_rows, l.sparse_slots, args.vocab));
  }
  p.colsum = at;
  if (args.grad_bias != nullptr) {
    at += AlignUp(ColumnSumWorkspaceBytes(chunk_rows, args.vocab));
  }
  p.lt = at;
  if (!l.fused) at += kLtWorkspaceBytes;
  p.total = at;
  return p;
}

int linear_cuda::GradientExponent(float s) {
  if (!(std::isfinite(s)) || s == 0.0f) return 0;
  return -std::ilogb(s);
}

namespace {

absl::Status BuildGemms(cublasLtHandle_t handle,
                        const LinearCrossEntropyArgs& args, const Layout& l,
                        int64_t rows, ChunkGemms* g) {
  const int64_t h = args.hidden, v = args.vocab;
  const cudaDataType_t in = LtDataType(args.dtype);
  const cudaDataType_t z_type = l.logits_fp32 ? CUDA_R_32F : in;
  // Column-major views of the row-major tensors: W is [H, V] (ld H), a chunk
  // of X is [H, rows] (ld H), Z and G are [V, rows] (ld V).
  // Z^T = (W^T)^T ... i.e. Z [V, rows] = op(W)=T [V, H] x X [H, rows].
  RETURN_IF_ERROR(g->logits.Init(handle, true, false, v, rows, h, in, h, h,
                                 z_type, v, "Z = X W^T + b",
                                 args.bias != nullptr));
  const bool want_grad = LinearCrossEntropyWantsGradient(args);
  if (!want_grad) return absl::OkStatus();
  // G's operand type: the 16-bit split (or Z's own dtype), or fp32.
  const cudaDataType_t g_type = l.split ? in : z_type;
  if (args.accumulate != AccumulateMode::kNone) {
    // dW [H, V] = X [H, rows] x op(G)=T [rows, V], fp32 out; with lo, the
    // depth is 2 rows: [X X] [H, 2 rows] x [hi; lo] [2 rows, V].
    RETURN_IF_ERROR(g->grad_weight.Init(handle, false, true, h, v,
                                        l.lo ? 2 * rows : rows, g_type, h, v,
                                        CUDA_R_32F, h, "dW += G^T X"));
  }
  if (args.dx_mode != GradientMode::kNone) {
    // dX [H, rows] = W [H, V] x G [V, rows].
    RETURN_IF_ERROR(g->grad_x.Init(handle, false, false, h, rows, v, g_type, h,
                                   v, l.dx_fp32_temp ? CUDA_R_32F : g_type, h,
                                   "dX = G W"));
  }
  return absl::OkStatus();
}

// The products of a shape, planned once per thread and kept: the heuristic
// query costs host time, and a fixed algorithm per shape keeps the bits.
absl::StatusOr<std::shared_ptr<const ChunkGemms>> CachedGemms(
    cublasLtHandle_t handle, const LinearCrossEntropyArgs& args,
    const Layout& l, int64_t rows) {
  using Key = std::tuple<cublasLtHandle_t, int, int64_t, int64_t, int64_t, int,
                         bool, bool, bool>;
  thread_local std::map<Key, std::shared_ptr<const ChunkGemms>> cache;
  const Key key(handle, static_cast<int>(args.dtype), args.hidden, args.vocab,
                rows, static_cast<int>(l.precision),
                args.accumulate != AccumulateMode::kNone,
                args.dx_mode != GradientMode::kNone, args.bias != nullptr);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  // Shapes seen long ago go; a caller keeps its own products alive.
  if (cache.size() >= 64) cache.clear();
  auto gemms = std::make_shared<ChunkGemms>();
  RETURN_IF_ERROR(BuildGemms(handle, args, l, rows, gemms.get()));
  cache.emplace(key, gemms);
  return std::shared_ptr<const ChunkGemms>(gemms);
}

// The current device's compute capability, for the Hopper GEMM's policy.
absl::Status DeviceCapability(int* major, int* minor) {
  int device = 0;
  RETURN_IF_ERROR(
      CudaStatus(cudaGetDevice(&device), "linear_cross_entropy: device"));
  RETURN_IF_ERROR(CudaStatus(
      cudaDeviceGetAttribute(major, cudaDevAttrComputeCapabilityMajor, device),
      "linear_cross_entropy: device"));
  return CudaStatus(
      cudaDeviceGetAttribute(minor, cudaDevAttrComputeCapabilityMinor, device),
      "linear_cross_entropy: device");
}

// Z of the call as the fused paths see it: fp32, in the workspace (256-byte
// aligned) where the gradient path stores it.
cuda_gemm::GemmSm90Shape FusedZShape(const LinearCrossEntropyArgs& args) {
  cuda_gemm::GemmSm90Shape shape;
  shape.rows = args.rows;
  shape.cols = args.vocab;
  shape.depth = args.hidden;
  shape.z_stride = args.vocab;
  shape.z_element_bytes = 4;
  shape.operands_aligned = reinterpret_cast<uintptr_t>(args.x) % 16 == 0 &&
                           reinterpret_cast<uintptr_t>(args.weight) % 16 == 0;
  shape.z_aligned = true;
  shape.z_aligned16 = true;
  return shape;
}

// What the call asks of the fused gradient path, as far as the host knows
// it without the device.
cuda_gemm::FusedGradientCall GradientCall(const LinearCrossEntropyArgs& args,
                                          const Layout& l) {
  cuda_gemm::FusedGradientCall call;
  call.bf16 = args.dtype == DType::kBFloat16;
  call.sparse_residual = l.sparse;
  call.softcap = args.options.softcap > 0.0f;
  call.grad_bias = args.grad_bias != nullptr;
  return call;
}

// Whether the call's gradient takes the fused gradient path: the policy
// (FusedLinearGradientRefusal) on the current device, unless the lab config
// says otherwise.
absl::StatusOr<bool> UseFusedGradient(
    const LinearCrossEntropyArgs& args, const Layout& l,
    const LinearCrossEntropyLabConfig& config) {
  if (!LinearCrossEntropyWantsGradient(args) ||
      config.fused_gradient == LinearFusedForward::kOff) {
    return false;
  }
  int major = 0, minor = 0;
  RETURN_IF_ERROR(DeviceCapability(&major, &minor));
  const char* refusal = cuda_gemm::FusedLinearGradientRefusal(
      FusedZShape(args), GradientCall(args, l), major, minor);
  if (refusal != nullptr &&
      config.fused_gradient == LinearFusedForward::kRequire) {
    return absl::FailedPreconditionError(absl::StrCat(
        "linear_cross_entropy: the fused gradient does not take this call: ",
        refusal));
  }
  return refusal == nullptr;
}

// Whether the call's forward-only work takes the fused forward: the policy
// (FusedLinearForwardTakes) on the current device, unless the lab config
// says otherwise.
absl::StatusOr<bool> UseFusedForward(
    const LinearCrossEntropyArgs& args,
    const LinearCrossEntropyLabConfig& config) {
  if (config.fused_forward == LinearFusedForward::kOff) return false;
  int major = 0, minor = 0;
  RETURN_IF_ERROR(DeviceCapability(&major, &minor));
  const bool takes = cuda_gemm::FusedLinearForwardTakes(
      FusedZShape(args), args.dtype == DType::kBFloat16,
      LinearCrossEntropyWantsGradient(args), major, minor);
  if (!takes && config.fused_forward == LinearFusedForward::kRequire) {
    return absl::FailedPreconditionError(
        "linear_cross_entropy: the fused forward does not take this call "
        "(it needs forward-only bf16 work on an sm_90 device with H a "
        "multiple of 8 and 16-byte aligned X and W)");
  }
  return takes;
}

}  // namespace

LinearCrossEntropyCudaPlan PlanLinearCrossEntropyCudaLab(
    const LinearCrossEntropyArgs& args,
    const LinearCrossEntropyLabConfig& config) {
  Layout l = MakeLayout(args, config);
  // Room for the fused gradient's workspace wherever it may take the call
  // (the device decides at the call).
  l.fused_gradient = LinearCrossEntropyWantsGradient(args) &&
                     config.fused_gradient != LinearFusedForward::kOff &&
                     GradientCall(args, l).bf16 && l.sparse &&
                     args.options.softcap <= 0.0f && args.grad_bias == nullptr;
  int64_t chunk_rows = config.chunk_rows;
  if (chunk_rows <= 0) {
    // The largest power of two within the memory budget and at most half
    // the rows (measured on the H200, bench/RESULTS.md: 2048 rows for the
    // split at V = 128k, 4096-8192 for 16-bit logits).
    const int64_t by_memory =
        std::max<int64_t>(1, kChunkBudgetBytes / l.row_bytes);
    const int64_t limit =
        std::min(by_memory, std::max<int64_t>(1, args.rows / 2));
    chunk_rows = 1;
    while (chunk_rows * 2 <= limit) chunk_rows *= 2;
  }
  chunk_rows =
      std::clamp<int64_t>(chunk_rows, 1, std::max<int64_t>(args.rows, 1));
  const int64_t chunks = (args.rows + chunk_rows - 1) / chunk_rows;
  LinearCrossEntropyCudaPlan plan;
  plan.chunk_rows = chunk_rows;
  plan.precision = l.precision;
  plan.workspace_bytes = MakeParts(args, l, chunk_rows, chunks).total;
  return plan;
}

absl::Status linear_cuda::PlanChunkGemms(cublasLtHandle_t handle,
                                         LinearCudaCall* call) {
  const LinearCrossEntropyArgs& args = call->args;
  const int64_t tail_rows = args.rows - (call->chunks - 1) * call->chunk_rows;
  if (args.rows > 0) {
    ASSIGN_OR_RETURN(call->full,
                     CachedGemms(handle, args, call->l, call->chunk_rows));
    call->tail = call->full;
  }
  if (call->chunks > 1 && tail_rows != call->chunk_rows) {
    ASSIGN_OR_RETURN(call->tail, CachedGemms(handle, args, call->l, tail_rows));
  }
  return absl::OkStatus();
}

// Checks the targets on the device (the one synchronisation before the
// chunks) and sums their class weights: a mean's denominator.
absl::Status CheckTargetsOnDevice(LinearCudaCall* call) {
  const LinearCrossEntropyArgs& args = call->args;
  auto* prepare =
      reinterpret_cast<LinearPrepareResult*>(call->block + call->parts.prepare);
  RETURN_IF_ERROR(CudaStatus(
      LinearPrepareLaunch(args.targets, args.targets_dtype, args.rows,
                          args.vocab, args.options.ignore_index,
                          args.class_weights, prepare, call->stream),
      "linear_cross_entropy: target check"));
  RETURN_IF_ERROR(CudaStatus(
      cudaMemcpyAsync(&call->host_prepare, prepare, sizeof(call->host_prepare),
                      cudaMemcpyDeviceToHost, call->stream),
      "linear_cross_entropy: target check copy"));
  RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(call->stream),
                             "linear_cross_entropy: target check"));
  if (call->host_prepare.bad_row >= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("linear_cross_entropy: ",
                     BadTargetMessage(call->host_prepare.bad_row,
                                      call->host_prepare.bad_target, args.vocab,
                                      args.options.ignore_index)));
  }
  return absl::OkStatus();
}

namespace {

// The chunks' loss options and the gradient's scaling (LinearCudaCall).
void ScaleGradient(LinearCudaCall* call) {
  call->chunk_options = LinearChunkOptions(
      call->args.options, call->host_prepare.target_weight_sum);
  CrossEntropyOptions& options = call->chunk_options;
  call->s = options.grad_scale;
  if (options.reduction == Reduction::kMean && options.normalizer > 0.0) {
    call->s = static_cast<float>(options.grad_scale / options.normalizer);
  }
  const bool g16 = call->l.split || !call->l.logits_fp32;
  call->exponent = g16 ? GradientExponent(call->s) : 0;
  options.grad_scale = std::ldexp(options.grad_scale, call->exponent);
  call->alpha = std::ldexp(1.0f, -call->exponent);
}

}  // namespace

absl::Status linear_cuda::PrepareChunks(LinearCudaCall* call) {
  const LinearCrossEntropyArgs& args = call->args;
  if (args.accumulate == AccumulateMode::kOverwrite && args.rows == 0) {
    RETURN_IF_ERROR(CudaStatus(
        cudaMemsetAsync(args.grad_weight, 0,
                        sizeof(float) * args.vocab * args.hidden, call->stream),
        "linear_cross_entropy: dW zero"));
    if (args.grad_bias != nullptr) {
      RETURN_IF_ERROR(
          CudaStatus(cudaMemsetAsync(args.grad_bias, 0,
                                     sizeof(float) * args.vocab, call->stream),
                     "linear_cross_entropy: dbias zero"));
    }
  }
  call->z_dtype = call->l.logits_fp32 ? DType::kFloat32 : args.dtype;
  if (args.bias != nullptr) {
    char* bias_z = call->block + call->parts.bias;
    call->bias_z = bias_z;
    RETURN_IF_ERROR(CudaStatus(
        ConvertScaleCudaLaunch(args.bias, args.dtype, bias_z, call->z_dtype, 0,
                               args.vocab, args.vocab, 1.0f, nullptr,
                               call->stream),
        "linear_cross_entropy: bias copy"));
  }
  // A call that may be cancelled enqueues a chunk only once the one before
  // it is done, and asks first: a cancellation then stops the GPU after the
  // chunk it is running (the price: the launches of each chunk no longer
  // overlap the chunk before).
  if (args.cancelled) {
    RETURN_IF_ERROR(CudaStatus(cudaEventCreateWithFlags(call->chunk_done.put(),
                                                        cudaEventDisableTiming),
                               "linear_cross_entropy: chunk event"));
  }
  return absl::OkStatus();
}

namespace {

// A cancellable call: waits for the chunks before `chunk`, then asks
// whether to go on.
absl::Status WaitAndAskBeforeChunk(const LinearCudaCall& call, int64_t chunk) {
  if (chunk > 0) {
    RETURN_IF_ERROR(
        CudaStatus(cudaEventRecord(call.chunk_done.get(), call.stream),
                   "linear_cross_entropy: chunk event"));
    RETURN_IF_ERROR(CudaStatus(cudaEventSynchronize(call.chunk_done.get()),
                               "linear_cross_entropy: chunk wait"));
  }
  if (call.args.cancelled()) {
    return absl::CancelledError(
        absl::StrCat("linear_cross_entropy: cancelled after ",
                     chunk * call.chunk_rows, " of ", call.args.rows, " rows"));
  }
  return absl::OkStatus();
}

// The cross-entropy's arguments for the chunk of `count` rows from row0,
// without its logits: targets, class weights, options, per-token outputs.
CrossEntropyArgs ChunkLossArgs(const LinearCudaCall& call, int64_t row0,
                               int64_t count) {
  const LinearCrossEntropyArgs& args = call.args;
  CrossEntropyArgs ce;
  ce.rows = count;
  ce.vocab = args.vocab;
  ce.row_stride = args.vocab;
  ce.mode = GradientMode::kNone;
  ce.targets_dtype = args.targets_dtype;
  ce.targets = static_cast<const char*>(args.targets) +
               row0 * DTypeSize(args.targets_dtype);
  ce.class_weights = args.class_weights;
  ce.options = call.chunk_options;
  if (args.token_loss != nullptr) ce.token_loss = args.token_loss + row0;
  if (args.token_lse != nullptr) ce.token_lse = args.token_lse + row0;
  if (args.token_argmax != nullptr) ce.token_argmax = args.token_argmax + row0;
  return ce;
}

// The fused paths' product and loss for the chunk of `count` rows from row0
// (X's rows at `x`): the bias in fp32, added to the accumulator.
FusedLinearForwardArgs FusedArgs(const LinearCudaCall& call, int64_t row0,
                                 int64_t count, const char* x) {
  FusedLinearForwardArgs fused;
  fused.x = x;
  fused.weight = call.args.weight;
  fused.bias = static_cast<const float*>(call.bias_z);
  fused.hidden = call.args.hidden;
  fused.loss = ChunkLossArgs(call, row0, count);
  fused.gemm_schedule = call.l.gemm_schedule;
  return fused;
}

// The chunk's loss with the statistics in the Hopper GEMM's epilogue
// (Layout::fused): Z never reaches memory.
absl::Status RunChunkFusedLoss(const LinearCudaCall& call, int64_t chunk,
                               int64_t row0, int64_t count, const char* x) {
  const FusedLinearForwardArgs fused = FusedArgs(call, row0, count, x);
  auto* chunk_results = reinterpret_cast<CrossEntropyCudaResult*>(
      call.block + call.parts.results);
  return CudaStatus(
      FusedLinearForwardLaunch(
          fused, chunk_results + chunk, call.block + call.parts.ce,
          FusedLinearForwardWorkspaceBytes(count, call.args.vocab),
          call.stream),
      "linear_cross_entropy: fused forward");
}

// Z = X W^T (+ b) of the chunk's `count` rows from row0 (X's rows at `x`)
// and its cross-entropy, the gradient G replacing Z when one is wanted.
// Returns the cross-entropy's arguments (the chunk's targets, for the
// residuals).
absl::StatusOr<CrossEntropyArgs> RunChunkLoss(const LinearCudaCall& call,
                                              const ChunkGemms& g,
                                              int64_t chunk, int64_t row0,
                                              int64_t count, const char* x) {
  const LinearCrossEntropyArgs& args = call.args;
  const bool want_grad = LinearCrossEntropyWantsGradient(args);
  void* logits = call.block + call.parts.logits;
  RETURN_IF_ERROR(g.logits.Run(1.0f, args.weight, x, 0.0f, logits,
                               call.block + call.parts.lt, call.stream,
                               call.bias_z));
  if (call.post_training != nullptr) {
    PostTrainingChunk slice;
    SlicePostTrainingRows(*call.post_training, row0, count, logits,
                          call.z_dtype, want_grad, &slice);
    RETURN_IF_ERROR(
        CudaStatus(PostTrainingCudaLaunch(slice.args, call.row_scale + row0,
                                          call.rows_out + row0, call.stream),
                   "linear_post_training: rows"));
    return slice.args.base;
  }
  CrossEntropyArgs ce = ChunkLossArgs(call, row0, count);
  ce.logits_dtype = call.z_dtype;
  ce.logits = logits;
  ce.mode = want_grad ? GradientMode::kInPlace : GradientMode::kNone;
  ce.gradient = want_grad ? logits : nullptr;
  RETURN_IF_ERROR(ValidateCrossEntropyArgs(ce));
  auto* chunk_results = reinterpret_cast<CrossEntropyCudaResult*>(
      call.block + call.parts.results);
  RETURN_IF_ERROR(
      CudaStatus(CrossEntropyCudaLaunch(
                     ce, chunk_results + chunk, call.block + call.parts.ce,
                     CrossEntropyCudaWorkspaceBytes(count), call.stream),
                 "linear_cross_entropy: cross-entropy"));
  return ce;
}

// The chunk's records of G's large entries (sparse), carved and reset, with
// a threshold in G's scaled units (the row scale is applied in the split).
absl::Status ResetChunkResiduals(const LinearCudaCall& call,
                                 const void* chunk_targets, int64_t count,
                                 SparseResidualSlots* sparse) {
  const Layout& l = call.l;
  *sparse = SparseResidualCarve(
      call.block + call.parts.sparse, count, l.sparse_slots,
      l.sparse_threshold * std::fabs(std::ldexp(call.s, call.exponent)));
  sparse->targets = chunk_targets;
  sparse->targets_dtype = call.args.targets_dtype;
  sparse->class_weights = call.args.class_weights;
  return CudaStatus(SparseResidualResetLaunch(*sparse, count, call.stream),
                    "linear_cross_entropy: residual reset");
}

// The chunk's loss and its G's bf16 split, with the statistics and Z's fp32
// store in the Hopper GEMM's epilogue (Layout::fused_gradient): hi (and the
// large entries' residuals, for dW) ready for the products.
absl::Status RunChunkFusedGradient(const LinearCudaCall& call, int64_t chunk,
                                   int64_t row0, int64_t count, const char* x,
                                   SparseResidualSlots* sparse) {
  const LinearCrossEntropyArgs& args = call.args;
  FusedLinearGradientArgs fused;
  fused.forward = FusedArgs(call, row0, count, x);
  fused.z = reinterpret_cast<float*>(call.block + call.parts.logits);
  if (args.token_grad_output != nullptr) {
    fused.row_scale = args.token_grad_output + row0;
  }
  fused.hi = call.block + call.parts.hi;
  if (args.accumulate != AccumulateMode::kNone) {
    RETURN_IF_ERROR(
        ResetChunkResiduals(call, fused.forward.loss.targets, count, sparse));
    fused.sparse = sparse;
  }
  auto* chunk_results = reinterpret_cast<CrossEntropyCudaResult*>(
      call.block + call.parts.results);
  return CudaStatus(
      FusedLinearGradientLaunch(
          fused, chunk_results + chunk, call.block + call.parts.ce,
          FusedLinearGradientWorkspaceBytes(count, args.vocab), call.stream),
      "linear_cross_entropy: fused gradient");
}

// The chunk's G made ready for the products: the large entries' residuals
// reset (sparse), G split into 16-bit hi (and lo, with X stacked twice for
// dW) or scaled by the rows' factors. `*grad` is G as the products read it.
absl::Status PrepareChunkGradient(const LinearCudaCall& call,
                                  const CrossEntropyArgs& ce, int64_t row0,
                                  int64_t count, const char* x,
                                  SparseResidualSlots* sparse,
                                  const void** grad) {
  const LinearCrossEntropyArgs& args = call.args;
  const Layout& l = call.l;
  const bool want_dw = args.accumulate != AccumulateMode::kNone;
  const float* row_scale = args.token_grad_output != nullptr
                               ? args.token_grad_output + row0
                               : nullptr;
  void* logits = call.block + call.parts.logits;
  char* hi = call.block + call.parts.hi;
  char* lo = hi + count * args.vocab * 2;
  char* x2 = call.block + call.parts.x2;
  *grad = logits;
  const bool record = l.sparse && want_dw;
  if (record) {
    RETURN_IF_ERROR(ResetChunkResiduals(call, ce.targets, count, sparse));
  }
  if (!l.split) {
    if (row_scale == nullptr) return absl::OkStatus();
    return CudaStatus(RowScaleLaunch(logits, call.z_dtype, row_scale, count,
                                     args.vocab, call.stream),
                      "linear_cross_entropy: row scale");
  }
  RETURN_IF_ERROR(CudaStatus(
      SplitGradientLaunch(static_cast<const float*>(logits), row_scale, count,
                          args.vocab, args.dtype, hi, l.lo ? lo : nullptr,
                          record ? sparse : nullptr, call.stream),
      "linear_cross_entropy: split"));
  *grad = hi;
  if (!l.lo || !want_dw) return absl::OkStatus();
  const std::size_t x_bytes = count * args.hidden * DTypeSize(args.dtype);
  for (std::size_t copy = 0; copy < 2; ++copy) {
    RETURN_IF_ERROR(
        CudaStatus(cudaMemcpyAsync(x2 + copy * x_bytes, x, x_bytes,
                                   cudaMemcpyDeviceToDevice, call.stream),
                   "linear_cross_entropy: X stack"));
  }
  return absl::OkStatus();
}

// dbias, dW (with the residuals) and dX of the chunk from G (`grad`, as
// PrepareChunkGradient left it).
absl::Status ApplyChunkGradient(const LinearCudaCall& call, const ChunkGemms& g,
                                int64_t chunk, int64_t row0, int64_t count,
                                const char* x,
                                const SparseResidualSlots& sparse,
                                const void* grad) {
  const LinearCrossEntropyArgs& args = call.args;
  const Layout& l = call.l;
  const bool overwrite = args.accumulate == AccumulateMode::kOverwrite;
  const bool want_dw = args.accumulate != AccumulateMode::kNone;
  const float* row_scale = args.token_grad_output != nullptr
                               ? args.token_grad_output + row0
                               : nullptr;
  void* lt_workspace = call.block + call.parts.lt;
  if (args.grad_bias != nullptr) {
    // From the fp32 G where there is one (the split's row scale applied
    // again here), else from the already scaled 16-bit G.
    RETURN_IF_ERROR(
        CudaStatus(ColumnSumLaunch(
                       call.block + call.parts.logits, call.z_dtype,
                       l.split ? row_scale : nullptr, count, args.vocab,
                       call.alpha, overwrite && chunk == 0, args.grad_bias,
                       reinterpret_cast<float*>(call.block + call.parts.colsum),
                       call.stream),
                   "linear_cross_entropy: dbias"));
  }
  const float beta = overwrite && chunk == 0 ? 0.0f : 1.0f;
  if (want_dw) {
    RETURN_IF_ERROR(g.grad_weight.Run(
        call.alpha, l.lo ? call.block + call.parts.x2 : x, grad, beta,
        args.grad_weight, lt_workspace, call.stream));
  }
  if (l.sparse && want_dw) {
    RETURN_IF_ERROR(CudaStatus(
        SparseResidualApplyLaunch(sparse, call.block + call.parts.sparse, count,
                                  args.vocab, x, args.dtype, args.hidden,
                                  call.alpha, args.grad_weight, call.stream),
        "linear_cross_entropy: residual"));
  }
  if (args.dx_mode == GradientMode::kNone) return absl::OkStatus();
  // X's chunk has been read by dW above: dX may overwrite it now.
  char* dx =
      static_cast<char*>(args.dx) + row0 * args.hidden * DTypeSize(args.dtype);
  if (!l.dx_fp32_temp) {
    return g.grad_x.Run(call.alpha, args.weight, grad, 0.0f, dx, lt_workspace,
                        call.stream);
  }
  float* dx_temp = reinterpret_cast<float*>(call.block + call.parts.dx);
  const char* lo = call.block + call.parts.hi + count * args.vocab * 2;
  RETURN_IF_ERROR(g.grad_x.Run(call.alpha, args.weight, grad, 0.0f, dx_temp,
                               lt_workspace, call.stream));
  RETURN_IF_ERROR(g.grad_x.Run(call.alpha, args.weight, lo, 1.0f, dx_temp,
                               lt_workspace, call.stream));
  return CudaStatus(
      ConvertScaleCudaLaunch(dx_temp, DType::kFloat32, dx, args.dtype, 0,
                             count * args.hidden, args.hidden, 1.0f, nullptr,
                             call.stream),
      "linear_cross_entropy: dX convert");
}

}  // namespace

absl::Status linear_cuda::RunChunks(const LinearCudaCall& call) {
  const LinearCrossEntropyArgs& args = call.args;
  const std::size_t es = DTypeSize(args.dtype);
  for (int64_t chunk = 0; chunk < call.chunks; ++chunk) {
    if (call.chunk_done.get() != nullptr) {
      RETURN_IF_ERROR(WaitAndAskBeforeChunk(call, chunk));
    }
    const int64_t row0 = chunk * call.chunk_rows;
    const int64_t count = std::min(call.chunk_rows, args.rows - row0);
    const char* x = static_cast<const char*>(args.x) + row0 * args.hidden * es;
    if (call.l.fused) {
      RETURN_IF_ERROR(RunChunkFusedLoss(call, chunk, row0, count, x));
      continue;
    }
    const ChunkGemms& g = count == call.chunk_rows ? *call.full : *call.tail;
    if (call.l.fused_gradient) {
      SparseResidualSlots sparse;
      RETURN_IF_ERROR(
          RunChunkFusedGradient(call, chunk, row0, count, x, &sparse));
      RETURN_IF_ERROR(ApplyChunkGradient(call, g, chunk, row0, count, x, sparse,
                                         call.block + call.parts.hi));
      continue;
    }
    ASSIGN_OR_RETURN(const CrossEntropyArgs ce,
                     RunChunkLoss(call, g, chunk, row0, count, x));
    if (!LinearCrossEntropyWantsGradient(args)) continue;
    SparseResidualSlots sparse;
    const void* grad = nullptr;
    RETURN_IF_ERROR(
        PrepareChunkGradient(call, ce, row0, count, x, &sparse, &grad));
    RETURN_IF_ERROR(
        ApplyChunkGradient(call, g, chunk, row0, count, x, sparse, grad));
  }
  return absl::OkStatus();
}

absl::Status linear_cuda::FinishLinearCall(absl::Status status,
                                           LinearCudaCall* call,
                                           void* rows_block, const char* what) {
  const absl::Status freed = CudaStatus(
      cudaFreeAsync(call->block, call->stream), absl::StrCat(what, ": free"));
  if (rows_block != nullptr) cudaFreeAsync(rows_block, call->stream);
  const absl::Status synced = CudaStatus(cudaStreamSynchronize(call->stream),
                                         absl::StrCat(what, ": synchronize"));
  call->chunk_done.reset();
  RETURN_IF_ERROR(status);
  RETURN_IF_ERROR(freed);
  return synced;
}

namespace {

// The call's steps up to the last chunk enqueued; the first error stops
// them.
absl::Status EnqueueLinearCall(cublasLtHandle_t handle, LinearCudaCall* call) {
  if (!call->l.fused) RETURN_IF_ERROR(PlanChunkGemms(handle, call));
  RETURN_IF_ERROR(CheckTargetsOnDevice(call));
  ScaleGradient(call);
  RETURN_IF_ERROR(PrepareChunks(call));
  return RunChunks(*call);
}

// The chunks' results summed as one call's.
CrossEntropyResult SumChunkResults(
    const LinearCrossEntropyArgs& args,
    const std::vector<CrossEntropyCudaResult>& chunk_results,
    double target_weight_sum) {
  CrossEntropyResult total;
  for (const CrossEntropyCudaResult& chunk : chunk_results) {
    AddChunkResult(FromCudaResult(chunk), &total);
  }
  if (args.options.reduction == Reduction::kMean &&
      (total.valid_tokens > 0 || args.options.normalizer > 0.0) &&
      total.denominator == 0.0) {
    total.denominator = args.options.normalizer > 0.0 ? args.options.normalizer
                                                      : target_weight_sum;
  }
  return total;
}

}  // namespace

absl::Status LinearCrossEntropyCudaLab(
    const LinearCrossEntropyArgs& args, CrossEntropyResult* result,
    cudaStream_t stream, const LinearCrossEntropyLabConfig& config) {
  if (result == nullptr)
    return absl::InvalidArgumentError(
        "linear_cross_entropy: result is nullptr");
  RETURN_IF_ERROR(ValidateLinearCrossEntropyArgs(args));
  Layout l = MakeLayout(args, config);
  const LinearCrossEntropyCudaPlan plan =
      PlanLinearCrossEntropyCudaLab(args, config);
  ASSIGN_OR_RETURN(l.fused, UseFusedForward(args, config));
  ASSIGN_OR_RETURN(l.fused_gradient, UseFusedGradient(args, l, config));
  // The statistics come from the fp32 accumulator, and the bias is added
  // to it in fp32.
  if (l.fused) l.logits_fp32 = true;
  const int64_t chunk_rows = plan.chunk_rows;
  const int64_t chunks = (args.rows + chunk_rows - 1) / chunk_rows;
  const Parts parts = MakeParts(args, l, chunk_rows, chunks);
  ASSIGN_OR_RETURN(cublasLtHandle_t handle, LtThreadHandle());

  char* block = nullptr;
  RETURN_IF_ERROR(CudaStatus(
      cudaMallocAsync(reinterpret_cast<void**>(&block), parts.total, stream),
      "linear_cross_entropy: workspace allocation"));
  LinearCudaCall call{args, l, parts, block, stream, chunk_rows, chunks};
  // The steps' first error stops the enqueueing; the block is freed either
  // way, and the results copied only after a call without error.
  absl::Status status = EnqueueLinearCall(handle, &call);
  std::vector<CrossEntropyCudaResult> host_results(
      static_cast<std::size_t>(chunks));
  if (status.ok() && chunks > 0) {
    status =
        CudaStatus(cudaMemcpyAsync(host_results.data(), block + parts.results,
                                   sizeof(CrossEntropyCudaResult) * chunks,
                                   cudaMemcpyDeviceToHost, stream),
                   "linear_cross_entropy: result copy");
  }
  RETURN_IF_ERROR(FinishLinearCall(std::move(status), &call, nullptr,
                                   "linear_cross_entropy"));
  *result =
      SumChunkResults(args, host_results, call.host_prepare.target_weight_sum);
  return absl::OkStatus();
}

LinearCrossEntropyLabConfig linear_cuda::LabConfig(
    const LinearCrossEntropyCudaConfig* config) {
  LinearCrossEntropyLabConfig lab;
  if (config != nullptr) {
    static_cast<LinearCrossEntropyCudaConfig&>(lab) = *config;
  }
  return lab;
}

LinearCrossEntropyCudaPlan PlanLinearCrossEntropyCuda(
    const LinearCrossEntropyArgs& args,
    const LinearCrossEntropyCudaConfig* config) {
  return PlanLinearCrossEntropyCudaLab(args, LabConfig(config));
}

absl::Status LinearCrossEntropyCuda(
    const LinearCrossEntropyArgs& device_args, CrossEntropyResult* result,
    cudaStream_t stream, const LinearCrossEntropyCudaConfig* config) {
  return LinearCrossEntropyCudaLab(device_args, result, stream,
                                   LabConfig(config));
}

}  // namespace lossd
