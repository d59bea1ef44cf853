// The split's record of one large gradient entry (sparse_residual.h), shared
// by the split of an fp32 G (linear_cross_entropy_kernels.cu) and the fused
// gradient's split of Z (fused_linear_forward.cu).
#ifndef LOSSD_KERNELS_CUDA_SPARSE_RESIDUAL_RECORD_CUH_
#define LOSSD_KERNELS_CUDA_SPARSE_RESIDUAL_RECORD_CUH_

#include <cstdint>

#include "kernels/cuda/sparse_residual.h"

namespace lossd {

// Records a large entry's exact residual e = t - hi(t) (sparse_residual.h);
// entries hi holds exactly need none.
__device__ __forceinline__ void RecordResidual(const SparseResidualSlots& s,
                                               int64_t i, int64_t vocab,
                                               float t, float e, float scale) {
  if (s.slots == 0 || e == 0.0f) return;
  const int64_t r = i / vocab;
  if (s.class_weights != nullptr) {
    const int64_t target = s.targets_dtype == DType::kInt32
                               ? static_cast<const int32_t*>(s.targets)[r]
                               : static_cast<const int64_t*>(s.targets)[r];
    // An ignored row's G is 0 (e == 0 above), so the target is in range.
    if (target >= 0 && target < vocab) scale *= s.class_weights[target];
  }
  if (fabsf(t) < s.threshold * fabsf(scale)) return;
  const int k = atomicAdd(s.row_count + r, 1);
  if (k < s.slots) {
    s.column[r * s.slots + k] = static_cast<int>(i % vocab);
    s.residual[r * s.slots + k] = e;
  }
}

}  // namespace lossd

#endif  // LOSSD_KERNELS_CUDA_SPARSE_RESIDUAL_RECORD_CUH_
