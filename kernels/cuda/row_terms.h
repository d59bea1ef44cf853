// The post-training losses on the smem row pieces schedule: what a row adds
// to cross entropy's passes (RowTerms) and the launchers that take it (host
// declarations; the device code is in row_terms.cuh and smem_row_pieces.cu).
#ifndef LOSSD_KERNELS_CUDA_ROW_TERMS_H_
#define LOSSD_KERNELS_CUDA_ROW_TERMS_H_

#include <cuda_runtime_api.h>

#include "common/dtype.h"
#include "kernels/cuda/launch_params.h"
#include "kernels/cuda/post_training_cuda.h"

namespace lossd {
namespace cuda_ce {

// A post-training row is cross entropy with a per-row factor: its gradient is
// s (F p - G onehot(y) + F_tau p^tau) off a top-k teacher's support, s =
// row_scale[row], p^tau = softmax(z / tau), with F, G and F_tau from the
// row's statistics once they are merged: G = F = 1 for plain cross entropy,
// -dl/dlogp for a policy loss (PostTrainingArgs' PolicyArgs, logp = z_y -
// lse); for top-k distillation (DistillationArgs) G = F = alpha and F_tau =
// (1 - alpha)(g_tail - gbar) / tau (tail bucket) or 0 (renormalised), and the
// k support entries are written again after the gradient pass (their
// divergence term). At temperature 1 F_tau p^tau folds into F p; at another
// the tail bucket needs lse(z / tau), a second sum of the statistics pass
// (the kTau builds). Device pointers, [rows] each unless said.
struct RowTerms {
  // The reduction's factor of each row, grad_scale in; nullptr: the prepare
  // kernel's (Params::header->scale), which is every row's without segments.
  const float* row_scale;
  bool policy;  // a policy loss, as `pg` says (device pointers)
  bool kd;      // top-k distillation (else plain cross entropy)
  PolicyArgs pg;
  // Top-k distillation: [rows, top_k] indices (int64 where indices64, else
  // int32) and teacher log-probabilities, and the support's z (the
  // softcapped logits) gathered before the schedule (LaunchGatherSupport).
  int top_k;
  bool indices64;
  bool renormalize;  // else the tail bucket
  int divergence;    // Divergence (JSD at beta 0 / 1 given as FKL / RKL)
  float beta;
  float alpha;
  const void* indices;
  const float* logprobs;
  float* support_z;
  float inv_tau;  // 1 / temperature
  // The tail bucket at temperature != 1: [rows * pieces] each piece's sum of
  // exp((z - m) / tau) about its max m, by item (the kTau builds).
  float* piece_tau;
  // No gradient (forward only): the statistics, the records and the entropy.
  bool forward_only;
  // The rows' entropy (piece_entropy, then LaunchRowTermsEntropy); else the
  // records' entropy is 0.
  bool entropy;
  // Each row's record as the row kernel writes it (post_training_cuda.h),
  // its entropy once LaunchRowTermsEntropy has summed the pieces'.
  PostTrainingCudaRow* rows_out;
  // [rows * pieces]: each piece's share of its row's entropy, by item.
  float* piece_entropy;
};

// Whether `terms` need the kTau builds: the tail bucket at temperature != 1
// (constexpr: device code calls it too, --expt-relaxed-constexpr).
constexpr bool NeedsTauSums(const RowTerms& terms) {
  return terms.kd && !terms.renormalize && terms.inv_tau != 1.0f;
}

// smem_row_pieces.cu: the schedule with `terms` (terms.kd: after
// LaunchGatherSupport), on 16-byte aligned rows of whole vectors (p.chunk and
// `pieces` as the policy sizes it, `bulk` as it chooses); p.eps, p.zls and
// p.weights must be off; terms.piece_tau set where NeedsTauSums.
// cudaErrorInvalidConfiguration where the pieces do not fit this device (as
// LaunchSmemRowPieces), cudaErrorInvalidValue for another dtype.
cudaError_t LaunchSmemRowPiecesTerms(const Params& p, const RowTerms& terms,
                                     DType dtype, bool bulk, int pieces,
                                     cudaStream_t stream);

// row_terms.cu: terms.support_z from the logits `p.logits` (dtype `dtype`,
// p.softcap applied) at terms.indices, before the schedule overwrites them.
cudaError_t LaunchGatherSupport(const Params& p, const RowTerms& terms,
                                DType dtype, cudaStream_t stream);

// row_terms.cu: each row's entropy into terms.rows_out, the sum of its
// `pieces` shares in piece order.
cudaError_t LaunchRowTermsEntropy(const RowTerms& terms, long long rows,
                                  int pieces, cudaStream_t stream);

}  // namespace cuda_ce
}  // namespace lossd

#endif  // LOSSD_KERNELS_CUDA_ROW_TERMS_H_
