// The small CUDA kernels the linear cross-entropy needs around cuBLASLt and the
// fused cross-entropy: the up-front target check and denominator, the fp32
// gradient split into 16-bit hi + lo, row scaling and the bias
// gradient's column sums. CUDA headers only; each returns cudaError_t.
#ifndef LOSSD_KERNELS_CUDA_LINEAR_CROSS_ENTROPY_KERNELS_H_
#define LOSSD_KERNELS_CUDA_LINEAR_CROSS_ENTROPY_KERNELS_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cross_entropy.h"

namespace lossd {

// Written by LinearPrepareLaunch: the whole call's valid-row count and target
// weight sum (fp64, summed in a fixed order), and the first bad target.
struct LinearPrepareResult {
  double target_weight_sum;
  long long valid_tokens;
  long long bad_row;  // first row whose target is outside [0, vocab) and not
                      // ignore_index, or -1
  long long bad_target;
};

// One block: checks every target and sums the class weights of the valid
// rows in a fixed order (the same bits every run).
cudaError_t LinearPrepareLaunch(const void* targets, DType targets_dtype,
                                int64_t rows, int64_t vocab,
                                int64_t ignore_index,
                                const float* class_weights,
                                LinearPrepareResult* out, cudaStream_t stream);

struct SparseResidualSlots;  // kernels/cuda/sparse_residual.h

// For an fp32 gradient g [rows, vocab]: t = g * row_scale[r] (row_scale may
// be nullptr), hi = round(t) and, when lo is not nullptr, lo = round(t - hi),
// both of dtype (bf16 or fp16), [rows, vocab] each. hi + lo carries 16-17
// significant bits of t, what the dW product needs to stay within 5e-5.
// With `sparse` (may be nullptr), the large entries' exact residuals t - hi
// are recorded there too.
cudaError_t SplitGradientLaunch(const float* g, const float* row_scale,
                                int64_t rows, int64_t vocab, DType dtype,
                                void* hi, void* lo,
                                const SparseResidualSlots* sparse,
                                cudaStream_t stream);

// g[r, :] *= row_scale[r] in place (one rounding for 16-bit g).
cudaError_t RowScaleLaunch(void* g, DType dtype, const float* row_scale,
                           int64_t rows, int64_t vocab, cudaStream_t stream);

// out[v] = (overwrite ? 0 : out[v]) + alpha * sum_r g[r, v] * row_scale[r]
// (row_scale may be nullptr), the sum in fp32 over fixed segments of rows,
// each in row order, then the segments in order: deterministic. workspace:
// ColumnSumWorkspaceBytes(rows, vocab) of device memory.
std::size_t ColumnSumWorkspaceBytes(int64_t rows, int64_t vocab);
cudaError_t ColumnSumLaunch(const void* g, DType dtype, const float* row_scale,
                            int64_t rows, int64_t vocab, float alpha,
                            bool overwrite, float* out, float* workspace,
                            cudaStream_t stream);

}  // namespace lossd

#endif  // LOSSD_KERNELS_CUDA_LINEAR_CROSS_ENTROPY_KERNELS_H_
