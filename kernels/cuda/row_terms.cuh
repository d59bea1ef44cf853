// Device side of RowTerms (row_terms.h): a post-training row's factor and
// record from its merged statistics, and the gradient loop that also sums the
// row's entropy, for the smem row pieces schedule.
#ifndef LOSSD_KERNELS_CUDA_ROW_TERMS_CUH_
#define LOSSD_KERNELS_CUDA_ROW_TERMS_CUH_

#include <cuda_runtime.h>

#include <cmath>

#include "kernels/cuda/element_traits.cuh"
#include "kernels/cuda/row_math.cuh"
#include "kernels/cuda/row_terms.h"
#include "kernels/post_training.h"

namespace lossd {
namespace cuda_ce {

// The RowMath of a post-training row and the factor that its entropy share
// needs: p_c = 2^(...) * corr (corr restores the digits of lse's split).
struct TermsRow {
  RowMath rm;
  float corr;
};

// The row's math, with a and gy scaled by the row's factor (RowTerms), and,
// where `record`, its PostTrainingCudaRow (entropy 0: LaunchRowTermsEntropy
// adds it). The policy's formulas are the row kernel's (post_training_rows.cu)
// in fp32: the loss and the clip decision come from the same logp as the
// gradient. Options other than the softcap are off (RowTerms), so
// MakeRowMath's A is 1 and its a at scale 1 is corr.
__device__ __forceinline__ TermsRow
MakeTermsRow(const Params& p, WorkspaceHeader h, const Stats& st, bool valid,
             float zy, const RowTerms& terms, long long row, bool record) {
  h.scale = 1.0f;
  TermsRow out;
  out.rm = MakeRowMath(p, h, st, true, zy, 1.0f);
  out.corr = out.rm.a;
  const float logp = valid ? (zy - st.m) - out.rm.l1p : 0.0f;
  double loss = 0.0, kl_out = 0.0;
  float factor = 0.0f, ratio = 0.0f;
  bool clipped = false;
  if (valid && terms.policy) {
    const float advantage = terms.advantages[row];
    const float sampling = terms.sampling[row];
    ratio = expf(logp - sampling);
    const float held =
        fminf(fmaxf(ratio, 1.0f - terms.eps_low), 1.0f + terms.eps_high);
    float dlogp;
    if (terms.loss == static_cast<int>(PolicyLossKind::kImportanceSampling)) {
      loss = -ratio * advantage;
      dlogp = -ratio * advantage;
    } else if (terms.loss == static_cast<int>(PolicyLossKind::kPpoClip)) {
      // At the clip's edge both branches are equal and the gradient flows.
      clipped = -held * advantage > -ratio * advantage;
      loss = fmaxf(-ratio * advantage, -held * advantage);
      dlogp = clipped ? 0.0f : -ratio * advantage;
    } else {
      clipped = held != ratio;
      loss = -static_cast<double>(held) * advantage * logp;
      dlogp = -held * advantage;
    }
    if (terms.reference != nullptr) {
      const float d = terms.reference[row] - logp;
      float kl, dkl;
      if (terms.estimator == static_cast<int>(KlEstimator::kK1)) {
        kl = -d;
        dkl = 1.0f;
      } else if (terms.estimator == static_cast<int>(KlEstimator::kK2)) {
        kl = 0.5f * d * d;
        dkl = -d;
      } else {
        kl = expm1f(d) - d;
        dkl = -expm1f(d);
      }
      kl_out = kl;
      if (terms.kl_coef > 0.0f) {
        loss += static_cast<double>(terms.kl_coef) * kl;
        dlogp += terms.kl_coef * dkl;
      }
    }
    factor = -dlogp;
  } else if (valid) {
    loss = -static_cast<double>(logp);
    factor = 1.0f;
  }
  // (an ignored row's factor 0 is never used: its gradient is zeros)
  factor *= terms.row_scale[row];
  out.rm.a *= factor;
  out.rm.gy *= factor;
  if (record) {
    int flags = 0;
    if (valid) {
      flags = kPostTrainingRowValid;
      // (st.arg: the row's first argmax, as the row kernel's)
      if (static_cast<long long>(st.arg) == LoadTarget(p, row)) {
        flags |= kPostTrainingRowCorrect;
      }
      if (clipped) flags |= kPostTrainingRowClipped;
    }
    PostTrainingCudaRow& r = terms.rows_out[row];
    r.loss = loss;
    r.distillation = 0.0;
    r.ratio = ratio;
    r.approx_kl = valid && terms.policy ? terms.sampling[row] - logp : 0.0f;
    r.kl = kl_out;
    r.entropy = 0.0;
    r.lse = out.rm.lse;
    r.logprob = logp;
    r.argmax = st.arg;
    r.flags = flags;
  }
  return out;
}

// GradientSlice (slice_stats.cuh) without label smoothing, which also returns
// this thread's share of sum_c 2^(...) (lse - z_c), the row's entropy before
// its factor corr; kWrite false: the sum alone (an ignored row, whose
// gradient is zeros).
template <typename T, int kBlock, int kOpts, bool kWrite>
__device__ __forceinline__ float EntropyGradientSlice(
    const uint4* sv, T* out, int nvec, int tid, const RowMath& rm,
    const ElementOptions& opts) {
  static_assert(!(kOpts & kOptSmoothing), "post-training rows: no smoothing");
  using Tr = Traits<T>;
  constexpr int kVec = Tr::kVec;
  float h[2] = {0.0f, 0.0f};  // two chains of adds, not one
#pragma unroll 4
  for (int q = tid; q < nvec; q += kBlock) {
    const uint4 v = sv[q];
    float gr[kVec];
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      float dfac;
      const float z = OptionZ<T, kOpts>(opts, Tr::Get(v, j), &dfac);
      const float e = Exp2(fmaf(z - rm.shift, kLog2e, -rm.lse_l2));
      // (a masked class, z = -inf: e = 0 and no 0 * inf)
      h[j % 2] += e > 0.0f ? e * (rm.lse - z) : 0.0f;
      gr[j] = fmaf(e, rm.a, rm.b) * dfac;
    }
    if (kWrite) {
      uint4 o;
      Tr::Pack(gr, &o);
      __stcs(reinterpret_cast<uint4*>(out) + q, o);
    }
  }
  return h[0] + h[1];
}

}  // namespace cuda_ce
}  // namespace lossd

#endif  // LOSSD_KERNELS_CUDA_ROW_TERMS_CUH_
