// The linear cross-entropy with the loss in the GEMM's epilogue: Z = X W^T
// (+ b) on lossd's Hopper GEMM, each tile's per-row softmax statistics taken
// from the fp32 accumulator; the forward never stores Z, the gradient path
// stores it once for the 16-bit split of G. CUDA headers only; the caller
// (linear_cross_entropy_cuda.cc) falls back to cuBLASLt and the fused
// cross-entropy where these return cudaErrorNotSupported.
#ifndef LOSSD_KERNELS_CUDA_FUSED_LINEAR_FORWARD_H_
#define LOSSD_KERNELS_CUDA_FUSED_LINEAR_FORWARD_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cross_entropy.h"
#include "kernels/cuda/cross_entropy_cuda.h"
#include "kernels/cuda/gemm_sm90_policy.h"

namespace lossd {

struct FusedLinearForwardArgs {
  const void* x = nullptr;       // bf16 [loss.rows, hidden], 16-byte aligned
  const void* weight = nullptr;  // bf16 [loss.vocab, hidden], 16-byte aligned
  const float* bias = nullptr;   // fp32 [loss.vocab], 8-byte aligned, or null
  int64_t hidden = 0;            // a multiple of 8 (TMA's 16-byte strides)
  // The cross-entropy of Z: rows, vocab, targets, class weights, options and
  // the per-token outputs. logits and gradient are unused (mode kNone).
  CrossEntropyArgs loss;
  // The GEMM's schedule (kPolicy: GemmSm90ScheduleFor); the bench and the
  // tests pin one to compare them.
  cuda_gemm::GemmSm90Schedule gemm_schedule =
      cuda_gemm::GemmSm90Schedule::kPolicy;
};

// Device workspace FusedLinearForwardLaunch needs: the cross-entropy's
// (CrossEntropyCudaWorkspaceBytes) and a 16-byte record a row and column
// tile of 256. Pure.
std::size_t FusedLinearForwardWorkspaceBytes(int64_t rows, int64_t vocab);

// Enqueues on `stream`: the cross-entropy's prepare (target check, D, the
// class weights' total), the GEMM with the statistics epilogue (each tile's
// max, first argmax, sum of exponentials relative to the max, sum of w_c z_c
// for label smoothing, and the target's z, softcap applied to z first), a
// merge of each row's tiles in column order (one warp a row, a fixed
// butterfly) into the row's lse, loss, z-loss and argmax, and the
// cross-entropy's fixed-order finalize into *device_result: the same outputs
// as CrossEntropyCudaLaunch on Z in fp32, and the same bits on every run.
// cudaErrorNotSupported (nothing enqueued) where the Hopper GEMM does not
// take the product (GemmSm90Eligibility on the current device);
// cudaErrorInvalidValue for a short workspace or a null result; else the
// launches' error. A bad target is reported in device_result->error.
cudaError_t FusedLinearForwardLaunch(const FusedLinearForwardArgs& args,
                                     CrossEntropyCudaResult* device_result,
                                     void* workspace,
                                     std::size_t workspace_bytes,
                                     cudaStream_t stream);

struct SparseResidualSlots;  // kernels/cuda/sparse_residual.h

struct FusedLinearGradientArgs {
  // X, W, bias and the cross-entropy as for the forward (options without a
  // softcap; grad_scale the gradient's, with its power of two).
  FusedLinearForwardArgs forward;
  float* z = nullptr;  // fp32 [rows, vocab], 16-byte aligned: Z, then read
  const float* row_scale = nullptr;  // fp32 [rows] (grad_output), or null
  void* hi = nullptr;                // bf16 [rows, vocab], 8-byte aligned
  const SparseResidualSlots* sparse = nullptr;  // large entries, or null
};

// FusedLinearForwardWorkspaceBytes and each row's RowMath. Pure.
std::size_t FusedLinearGradientWorkspaceBytes(int64_t rows, int64_t vocab);

// The gradient path's first half for a chunk: as FusedLinearForwardLaunch,
// with the epilogue also storing z (fp32, bias added) to args.z by TMA, and
// the merge keeping each row's RowMath; then one pass over z writes
// hi = bf16(G * row_scale) with G the cross-entropy's gradient as its
// kernels compute it (target, z-loss, label smoothing, class weights), and
// records the large entries' exact residuals in *args.sparse: what
// SplitGradientLaunch makes of the fused cross-entropy's fp32 G, without G
// in memory. cudaErrorNotSupported (nothing enqueued) where the GEMM does
// not take the product with a TMA store of fp32 Z, or for a softcap;
// cudaErrorInvalidValue for a short workspace, a null result or z, or a
// vocabulary not a multiple of 4; else the launches' error.
cudaError_t FusedLinearGradientLaunch(const FusedLinearGradientArgs& args,
                                      CrossEntropyCudaResult* device_result,
                                      void* workspace,
                                      std::size_t workspace_bytes,
                                      cudaStream_t stream);

}  // namespace lossd

#endif  // LOSSD_KERNELS_CUDA_FUSED_LINEAR_FORWARD_H_
