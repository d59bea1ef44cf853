// The steps of one chunked linear call on the GPU (workspace layout, the
// chunks' products, their enqueueing, the call's end) that the linear cross
// entropy and the linear post-training losses share. Internal to the two.
#ifndef LOSSD_KERNELS_CUDA_LINEAR_CROSS_ENTROPY_CALL_H_
#define LOSSD_KERNELS_CUDA_LINEAR_CROSS_ENTROPY_CALL_H_

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "kernels/cross_entropy.h"
#include "kernels/cuda/gemm_sm90_policy.h"
#include "kernels/cuda/linear_cross_entropy_cuda.h"
#include "kernels/cuda/linear_cross_entropy_kernels.h"
#include "kernels/cuda/linear_cross_entropy_lab.h"
#include "kernels/cuda/post_training_cuda.h"
#include "kernels/cuda/unique_handle.h"
#include "kernels/linear_cross_entropy.h"
#include "kernels/post_training.h"

namespace lossd {
namespace linear_cuda {

// The cuBLASLt products of one chunk size (linear_cross_entropy_cuda.cc).
struct ChunkGemms;

// How a call holds Z and G and which paths it takes; the bytes a row of a
// chunk needs.
struct Layout {
  LinearPrecision precision;
  bool logits_fp32;  // Z (and G) held in fp32
  bool split;        // G copied to 16 bits (hi) for the products
  bool lo;           // ... and its remainder (lo) too, for dW
  bool sparse;       // ... or the large entries' residuals only
  float sparse_threshold;
  int sparse_slots;
  bool dx_fp32_temp;  // dX accumulated in fp32, then converted
  // Forward-only work with the loss in the Hopper GEMM's epilogue
  // (fused_linear_forward.h): no logits, no cuBLASLt. Decided per call on
  // the device (UseFusedForward); row_bytes is the cuBLASLt path's, which
  // takes more.
  bool fused = false;
  // A gradient with the statistics and Z's fp32 store in the Hopper GEMM's
  // epilogue and G split to bf16 straight from Z (FusedLinearGradientLaunch),
  // then cuBLASLt's dX and dW: the sparse residual's layout without the
  // cross-entropy's fp32 pass over Z. Decided per call (UseFusedGradient).
  bool fused_gradient = false;
  cuda_gemm::GemmSm90Schedule gemm_schedule =  // the fused paths' GEMM's
      cuda_gemm::GemmSm90Schedule::kPolicy;
  std::size_t row_bytes;
};

// Offsets of the workspace block's parts.
struct Parts {
  std::size_t prepare, results, ce, bias, logits, hi, x2, dx, sparse, colsum,
      lt, total;
};

// One call: its arguments, layout and workspace block, and what its steps
// find out for the ones after them.
struct LinearCudaCall {
  const LinearCrossEntropyArgs& args;
  const Layout& l;
  const Parts& parts;
  char* block;  // the workspace, parts.total bytes
  cudaStream_t stream;
  int64_t chunk_rows;
  int64_t chunks;

  // The products of a full chunk, and of a shorter last one.
  std::shared_ptr<const ChunkGemms> full = nullptr, tail = nullptr;
  // From the target check: the bad row, if any, and the targets' weight.
  LinearPrepareResult host_prepare = {};
  // Each chunk's loss options; the gradient's scale s and the power of two
  // (2^exponent, undone by alpha in the products) that brings it near 1 for
  // 16-bit copies of G.
  CrossEntropyOptions chunk_options = {};
  float s = 1.0f;
  int exponent = 0;
  float alpha = 1.0f;
  DType z_dtype = DType::kFloat32;  // Z's (and G's)
  const void* bias_z = nullptr;     // the bias in Z's dtype, or null
  // Set when the call may be cancelled: each chunk waits for the one before.
  UniqueHandle<cudaEvent_t, cudaEventDestroy> chunk_done = {};
  // A post-training loss instead of cross entropy (LinearPostTrainingCuda):
  // the whole call's arguments, each row's factor (times 2^exponent) and
  // where the row kernel writes each row's totals, all on the device.
  const PostTrainingArgs* post_training = nullptr;
  const float* row_scale = nullptr;
  PostTrainingCudaRow* rows_out = nullptr;
};

// The layout `config` asks of `args` (the fused paths decided per call).
Layout MakeLayout(const LinearCrossEntropyArgs& args,
                  const LinearCrossEntropyLabConfig& config);

// The workspace block's parts for `chunks` chunks of `chunk_rows` rows.
Parts MakeParts(const LinearCrossEntropyArgs& args, const Layout& l,
                int64_t chunk_rows, int64_t chunks);

// Power of two k with |s| * 2^k in [1, 2): the gradient is formed scaled by
// 2^k so that its 16-bit copies keep their precision far from fp16's
// underflow (s = 1/D is ~1e-4), and the products take alpha = 2^-k back
// (exact).
int GradientExponent(float s);

// A caller's settings (null: all chosen) with the lab's knobs chosen.
LinearCrossEntropyLabConfig LabConfig(
    const LinearCrossEntropyCudaConfig* config);

// The products of the call's chunk sizes, planned (or found planned) before
// anything is enqueued, while the GPU has nothing of ours to wait on.
absl::Status PlanChunkGemms(cublasLtHandle_t handle, LinearCudaCall* call);

// What comes before the first chunk: accumulators to overwrite cleared when
// no chunk will write them, the bias converted to Z's dtype, and the event
// a cancellable call waits on.
absl::Status PrepareChunks(LinearCudaCall* call);

// Every chunk in row order: its loss, then its gradients.
absl::Status RunChunks(const LinearCudaCall& call);

// The end of a call, whatever its steps returned (`status`): frees the
// workspace block and `rows_block` (if not null) in stream order, waits for
// the stream, destroys the chunks' event. Returns the first error of
// `status`, the free and the wait, the last two named after `what`.
absl::Status FinishLinearCall(absl::Status status, LinearCudaCall* call,
                              void* rows_block, const char* what);

}  // namespace linear_cuda
}  // namespace lossd

#endif  // LOSSD_KERNELS_CUDA_LINEAR_CROSS_ENTROPY_CALL_H_
