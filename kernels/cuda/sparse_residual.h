// The large gradient entries' rounding residual, added to dW exactly.
//
// A 16-bit copy of the gradient G loses up to 2^-9 of each entry. Across a
// row, the entries that matter to dW are few: sum_v |G[r, v]| is at most 2
// (times the row's scale) for the cross-entropy, so at most 2/T entries
// reach T, and the many small entries' residuals add little to dW's norm.
// The split records, for every entry of at least `threshold` (times the
// row's scale), its column and its exact fp32 residual t - hi(t); the apply
// step adds alpha * residual * X[r, :] to dW[v, :] for each, in fp32.
//
// Determinism: slots are claimed by atomics, so their order within a row
// varies run to run; the apply step sorts the records by (column, row) and
// adds each column's records in that order, with no atomics, so dW's bits
// repeat. A row with more records than `slots` keeps none (which rows
// overflow does not depend on timing), and its dW share is hi's alone.
// CUDA headers only; each launch returns cudaError_t.
#ifndef LOSSD_KERNELS_CUDA_SPARSE_RESIDUAL_H_
#define LOSSD_KERNELS_CUDA_SPARSE_RESIDUAL_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "common/dtype.h"

namespace lossd {

// Where the split writes its records: `slots` a row, [rows, slots] each.
struct SparseResidualSlots {
  // |t| >= threshold * |row scale| is recorded; the row scale is the row's
  // grad_output times, with class weights, its target's weight.
  float threshold = 0.0f;
  int slots = 0;
  const void* targets = nullptr;  // the chunk's, for class_weights
  DType targets_dtype = DType::kInt64;
  const float* class_weights = nullptr;  // [vocab] or nullptr
  int* row_count = nullptr;   // [rows], zeroed by SparseResidualResetLaunch
  int* column = nullptr;      // [rows * slots]
  float* residual = nullptr;  // [rows * slots], t - hi(t), exact in fp32
};

// Device bytes of the slots and of the sort, for a chunk of `rows`.
std::size_t SparseResidualWorkspaceBytes(int64_t rows, int slots,
                                         int64_t vocab);

// Carves `workspace` (SparseResidualWorkspaceBytes of it, 256-byte aligned)
// into the slots; the rest is the sort's.
SparseResidualSlots SparseResidualCarve(void* workspace, int64_t rows,
                                        int slots, float threshold);

// Zeroes the row counts before a chunk's split.
cudaError_t SparseResidualResetLaunch(const SparseResidualSlots& s,
                                      int64_t rows, cudaStream_t stream);

// dW[v, :] += alpha * sum over the records (r, v, e) of e * X[r, :], X
// [rows, hidden] of x_dtype, dW [vocab, hidden] fp32; records sorted by
// (v, r) first. `workspace` as carved above.
cudaError_t SparseResidualApplyLaunch(const SparseResidualSlots& s,
                                      void* workspace, int64_t rows,
                                      int64_t vocab, const void* x,
                                      DType x_dtype, int64_t hidden,
                                      float alpha, float* grad_weight,
                                      cudaStream_t stream);

}  // namespace lossd

#endif  // LOSSD_KERNELS_CUDA_SPARSE_RESIDUAL_H_
