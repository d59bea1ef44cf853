// The post-training losses on the smem row pieces schedule: what a row adds
// to cross entropy's statistics and gradient passes (RowTerms), and the
// launchers that take it. Host-side declarations; the device code is in
// row_terms.cuh and smem_row_pieces.cu.
#ifndef LOSSD_KERNELS_CUDA_ROW_TERMS_H_
#define LOSSD_KERNELS_CUDA_ROW_TERMS_H_

#include <cuda_runtime_api.h>

#include "common/dtype.h"
#include "kernels/cuda/launch_params.h"
#include "kernels/cuda/post_training_cuda.h"

namespace lossd {
namespace cuda_ce {

// A post-training row is cross entropy with a per-row factor: its gradient is
// c_row (p - onehot(y)), c_row = row_scale[row] times, for a policy loss,
// -dl/dlogp, which the row's logp = z_y - lse gives once its statistics are
// merged (PostTrainingArgs' PolicyArgs). Device pointers, [rows] each.
struct RowTerms {
  const float* row_scale;  // the reduction's factor of the row, grad_scale in
  bool policy;             // else plain cross entropy (l = -logp)
  int loss;                // PolicyLossKind
  int estimator;           // KlEstimator
  const float* advantages;
  const float* sampling;
  const float* reference;  // or nullptr
  float eps_low;
  float eps_high;
  float kl_coef;
  // Each row's record as the row kernel writes it (post_training_cuda.h),
  // its entropy once LaunchRowTermsEntropy has summed the pieces'.
  PostTrainingCudaRow* rows_out;
  // [rows * pieces]: each piece's share of its row's entropy, by item.
  float* piece_entropy;
};

// smem_row_pieces.cu: the schedule with `terms`, on 16-byte aligned rows of
// whole vectors (p.chunk and `pieces` as the policy sizes it, `bulk` as it
// chooses); p.eps, p.zls and p.weights must be off, p.header->scale is not
// used. cudaErrorInvalidConfiguration where the pieces do not fit this
// device (as LaunchSmemRowPieces), cudaErrorInvalidValue for another dtype.
cudaError_t LaunchSmemRowPiecesTerms(const Params& p, const RowTerms& terms,
                                     DType dtype, bool bulk, int pieces,
                                     cudaStream_t stream);

// row_terms.cu: each row's entropy into terms.rows_out, the sum of its
// `pieces` shares in piece order.
cudaError_t LaunchRowTermsEntropy(const RowTerms& terms, long long rows,
                                  int pieces, cudaStream_t stream);

}  // namespace cuda_ce
}  // namespace lossd

#endif  // LOSSD_KERNELS_CUDA_ROW_TERMS_H_
