// The CUDA backend of the linear cross-entropy contract
// (kernels/linear_cross_entropy.h): cuBLASLt products around the fused
// cross-entropy, chunked over rows, stream-ordered; the absl::Status face.
#ifndef LOSSD_KERNELS_CUDA_LINEAR_CROSS_ENTROPY_CUDA_H_
#define LOSSD_KERNELS_CUDA_LINEAR_CROSS_ENTROPY_CUDA_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cross_entropy.h"
#include "kernels/linear_cross_entropy.h"
#include "kernels/linear_post_training.h"
#include "kernels/post_training.h"

namespace lossd {

// How the gradient G = dL/dZ of a chunk of 16-bit rows meets the dX and dW
// products (fp32 X and W always run fp32 products, CUBLAS_COMPUTE_32F).
enum class LinearPrecision : int {
  kAuto = 0,  // kSparseResidual from V = 50000 on, else kSplitWeight
  // Z in fp32 (cuBLASLt, fp32 out), the cross-entropy in place on fp32, G
  // split into 16-bit hi + lo: dW = [hi; lo]^T [X; X] (one bf16 product of
  // twice the depth, fp32 accumulator: 3e-6 to 1e-5 from an fp32 reference),
  // dX = hi W (one product; G rounded to 16 bits as the peers do, ~2e-3).
  kSplitWeight = 1,
  // (2 and 4 are measured against these in bench/ and tests/:
  // linear_cross_entropy_lab.h.)
  // Z in the input dtype, the cross-entropy in place on it, G in that dtype:
  // the three products alone (the peers' precision, dW ~1e-3).
  kFast = 3,
  // Z and the cross-entropy in fp32 as kSplitWeight, G rounded once to 16
  // bits (hi only); and for every entry of G of at least 2^-6 of its row's
  // scale, its exact residual t - hi(t) is added to dW in fp32
  // (kernels/cuda/sparse_residual.h): the three products plus a few records
  // a row, dW near kSplitWeight's precision.
  kSparseResidual = 5,
};

// Tuning and precision; 0 fields mean "choose".
struct LinearCrossEntropyCudaConfig {
  LinearPrecision precision = LinearPrecision::kAuto;
  int64_t chunk_rows = 0;  // rows of logits a chunk (0: from memory, below)
};

// The chunk the call will use, and the device memory it takes beyond its
// inputs and outputs (logits chunk, split gradient, cuBLASLt and
// cross-entropy workspaces): the cuBLASLt path's, an upper bound for a
// forward-only call that the fused forward takes (no logits). Pure.
struct LinearCrossEntropyCudaPlan {
  int64_t chunk_rows = 0;
  LinearPrecision precision = LinearPrecision::kSparseResidual;
  std::size_t workspace_bytes = 0;
};
LinearCrossEntropyCudaPlan PlanLinearCrossEntropyCuda(
    const LinearCrossEntropyArgs& args,
    const LinearCrossEntropyCudaConfig* config = nullptr);

// Runs the linear cross-entropy on `stream` for `device_args` (every pointer a
// device pointer, the per-token outputs too): one target check and
// denominator up front (one host synchronisation, so that a bad target
// changes nothing and every chunk's mean uses the whole call's D), then per
// chunk of rows with no host synchronisation: forward-only bf16 work where
// the policy takes it (FusedLinearForwardTakes on the current device) with
// the loss in the Hopper GEMM's epilogue (fused_linear_forward.h: no logits
// in memory); otherwise Z = X W^T (+ b) with cuBLASLt,
// the fused cross-entropy in place on Z (CrossEntropyCudaLaunch), dbias
// (+)= column sums of G, dW (+)= G^T X with fp32 output and beta = 1, dX = G W
// (in place over X once the chunk's dW has read it); chunk results summed on
// the host in chunk order. Bitwise deterministic: fixed chunks, fixed
// cuBLASLt algorithms per shape (no in-place split-K reductions), fixed-order
// reductions. Allocates its workspace stream-ordered (cudaMallocAsync).
//
// With args.cancelled set, the host waits before enqueueing a chunk until the
// one before is done and asks it then, so that a cancellation stops the GPU
// after the chunk it is running.
//
// Returns OK; INVALID_ARGUMENT when ValidateLinearCrossEntropyArgs fails,
// result is nullptr, or a target is out of range (the message names the first
// such row and value; nothing is written); RESOURCE_EXHAUSTED when device
// memory runs out (outputs may then be partly written); CANCELLED when
// args.cancelled said so (outputs partly written); INTERNAL for other
// CUDA or cuBLASLt errors. Synchronizes `stream` twice (after the target
// check, and at the end). Borrows every buffer until it returns. Thread
// safety: reentrant for distinct outputs (a cuBLASLt handle per thread and
// device).
absl::Status LinearCrossEntropyCuda(
    const LinearCrossEntropyArgs& device_args, CrossEntropyResult* result,
    cudaStream_t stream, const LinearCrossEntropyCudaConfig* config = nullptr);

// LinearForward with a post-training loss (kernels/linear_post_training.h)
// on `stream`: the chunks, products and precision of LinearCrossEntropyCuda,
// each chunk's Z through the post-training row kernel (PostTrainingCudaLaunch,
// fp32 row math) instead of the cross-entropy; the plan (row factors, segment
// counts, from the targets and segment ids copied to the host first) and the
// reduction are the whole call's, and the per-token outputs are HOST
// pointers. The small inputs' values must have been checked already
// (CheckPostTrainingData on host copies). Beyond PlanLinearCrossEntropyCuda's
// workspace it allocates 4 + sizeof(PostTrainingCudaRow) bytes a row.
//
// Returns OK; INVALID_ARGUMENT as ValidateLinearCrossEntropyArgs (targets may
// be nullptr for a distillation with alpha 0) and ValidatePostTrainingArgs;
// UNIMPLEMENTED for a top-k teacher over more than
// kPostTrainingCudaMaxTopKVocab classes; RESOURCE_EXHAUSTED, CANCELLED and
// INTERNAL as LinearCrossEntropyCuda. Synchronizes `stream`. Thread safety as
// LinearCrossEntropyCuda.
absl::Status LinearPostTrainingCuda(
    const LinearPostTrainingArgs& device_args, PostTrainingResult* result,
    cudaStream_t stream, const LinearCrossEntropyCudaConfig* config = nullptr);

}  // namespace lossd

#endif  // LOSSD_KERNELS_CUDA_LINEAR_CROSS_ENTROPY_CUDA_H_
