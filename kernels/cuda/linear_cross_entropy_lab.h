// The linear cross-entropy's lab settings: precisions and knobs that bench/
// and tests/ measure against the ones a caller chooses
// (linear_cross_entropy_cuda.h). Not for the service.
#ifndef LOSSD_KERNELS_CUDA_LINEAR_CROSS_ENTROPY_LAB_H_
#define LOSSD_KERNELS_CUDA_LINEAR_CROSS_ENTROPY_LAB_H_

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "kernels/cross_entropy.h"
#include "kernels/cuda/gemm_sm90_policy.h"
#include "kernels/cuda/linear_cross_entropy_cuda.h"
#include "kernels/linear_cross_entropy.h"

namespace lossd {

// As kSplitWeight, and dX = hi W + lo W too (fp32 intermediate, one rounding
// to the dtype at the end).
inline constexpr LinearPrecision kLinearSplitBoth =
    static_cast<LinearPrecision>(2);
// Z and the cross-entropy in fp32 as kSplitWeight, G rounded once to 16 bits
// (hi only): the three products, the logits kept exact (kSparseResidual
// without its residuals).
inline constexpr LinearPrecision kLinearFp32Logits =
    static_cast<LinearPrecision>(4);

// Where forward-only work goes: the policy's choice (the fused forward,
// fused_linear_forward.h, where FusedLinearForwardTakes says so on the
// device), cuBLASLt and the fused cross-entropy always, or the fused forward
// required (FAILED_PRECONDITION where the policy says no).
enum class LinearFusedForward : int { kAuto = 0, kOff = 1, kRequire = 2 };

// The public settings, and kSparseResidual's knobs; 0 fields mean "choose".
struct LinearCrossEntropyLabConfig : LinearCrossEntropyCudaConfig {
  // The fraction of a row's scale from which an entry's residual is kept,
  // and the records a row may keep (a row with more keeps none). The
  // cross-entropy's |G| sums to at most 2 a row, so slots >= 2 / threshold
  // never overflow without class weights or z-loss.
  float sparse_threshold = 0.0f;  // 0: 2^-6
  int sparse_slots = 0;           // 0: 128
  LinearFusedForward fused_forward = LinearFusedForward::kAuto;
  // Where the gradient goes, with the same three choices: the fused gradient
  // path (FusedLinearGradientLaunch) where FusedLinearGradientRefusal says
  // nothing on the device, the cuBLASLt path, or the fused one required.
  // Off unless asked for: on the H100 it measured at parity with the
  // cuBLASLt path (bench/NOTES.md, the fused gradient), not ahead of it.
  LinearFusedForward fused_gradient = LinearFusedForward::kOff;
  // The Hopper GEMM's schedule on the fused paths (kPolicy: the policy's).
  cuda_gemm::GemmSm90Schedule gemm_schedule =
      cuda_gemm::GemmSm90Schedule::kPolicy;
};

// PlanLinearCrossEntropyCuda and LinearCrossEntropyCuda with lab settings.
LinearCrossEntropyCudaPlan PlanLinearCrossEntropyCudaLab(
    const LinearCrossEntropyArgs& args,
    const LinearCrossEntropyLabConfig& config);
absl::Status LinearCrossEntropyCudaLab(
    const LinearCrossEntropyArgs& device_args, CrossEntropyResult* result,
    cudaStream_t stream, const LinearCrossEntropyLabConfig& config);

}  // namespace lossd

#endif  // LOSSD_KERNELS_CUDA_LINEAR_CROSS_ENTROPY_LAB_H_
