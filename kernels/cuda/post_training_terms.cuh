// The per-row and per-bucket terms of the post-training losses in fp32, one
// definition for both CUDA schedules (the row kernel, post_training_rows.cu,
// and the smem row pieces' RowTerms, row_terms.cuh), so that they agree.
#ifndef LOSSD_KERNELS_CUDA_POST_TRAINING_TERMS_CUH_
#define LOSSD_KERNELS_CUDA_POST_TRAINING_TERMS_CUH_

#include <cuda_runtime.h>

#include <cmath>

#include "kernels/post_training.h"

namespace lossd {
namespace cuda_pt {

// A bucket's divergence term d and h = P dD/dP from log P and log Q
// (kernels/post_training.h; post_training_cpu.cc's BucketDivergence).
__device__ __forceinline__ void DivergenceTerm(int divergence, float beta,
                                               float log_p, float log_q,
                                               float* d, float* h) {
  const float p = expf(log_p);
  const float q = expf(log_q);
  const float p_log = p > 0.0f ? p * (log_p - log_q) : 0.0f;
  if (divergence == static_cast<int>(Divergence::kForwardKl)) {
    *d = q > 0.0f ? q * (log_q - log_p) : 0.0f;
    *h = -q;
  } else if (divergence == static_cast<int>(Divergence::kReverseKl)) {
    // dD/dP is log P - log Q + 1; the 1 drops out of g - gbar (the P sum to
    // 1) and in fp32 would cancel the digits of small differences.
    *d = p_log;
    *h = p_log;
  } else {
    const float a = logf(beta) + log_q;
    const float b = log1pf(-beta) + log_p;
    const float mx = fmaxf(a, b);
    const float log_m =
        mx == -INFINITY ? -INFINITY : mx + logf(expf(a - mx) + expf(b - mx));
    const float pm = p > 0.0f ? p * (log_p - log_m) : 0.0f;
    *d = beta * (q > 0.0f ? q * (log_q - log_m) : 0.0f) + (1.0f - beta) * pm;
    *h = (1.0f - beta) * pm;
  }
}

// A policy row's loss, reference KL (without kl_coef), dl/dlogp, ratio and
// clip decision from its logp, all from the same fp32 logp as the gradient.
struct PolicyRow {
  double loss;
  double kl;
  float dlogp;
  float ratio;
  bool clipped;
};
struct PolicyInputs {
  int loss;       // PolicyLossKind
  int estimator;  // KlEstimator
  float eps_low;
  float eps_high;
  float kl_coef;
  bool has_reference;
};
__device__ __forceinline__ PolicyInputs PolicyInputsOf(const PolicyArgs& pg) {
  return {static_cast<int>(pg.loss),
          static_cast<int>(pg.kl_estimator),
          pg.epsilon_low,
          pg.epsilon_high,
          pg.kl_coef,
          pg.reference_logprobs != nullptr};
}
__device__ __forceinline__ PolicyRow MakePolicyRow(const PolicyInputs& in,
                                                   float advantage,
                                                   float sampling,
                                                   float reference,
                                                   float logp) {
  PolicyRow r = {0.0, 0.0, 0.0f, 0.0f, false};
  r.ratio = expf(logp - sampling);
  const float held =
      fminf(fmaxf(r.ratio, 1.0f - in.eps_low), 1.0f + in.eps_high);
  if (in.loss == static_cast<int>(PolicyLossKind::kImportanceSampling)) {
    r.loss = -r.ratio * advantage;
    r.dlogp = -r.ratio * advantage;
  } else if (in.loss == static_cast<int>(PolicyLossKind::kPpoClip)) {
    // At the clip's edge both branches are equal and the gradient flows.
    r.clipped = -held * advantage > -r.ratio * advantage;
    r.loss = fmaxf(-r.ratio * advantage, -held * advantage);
    r.dlogp = r.clipped ? 0.0f : -r.ratio * advantage;
  } else {
    r.clipped = held != r.ratio;
    r.loss = -static_cast<double>(held) * advantage * logp;
    r.dlogp = -held * advantage;
  }
  if (in.has_reference) {
    const float d = reference - logp;
    float kl, dkl;
    if (in.estimator == static_cast<int>(KlEstimator::kK1)) {
      kl = -d;
      dkl = 1.0f;
    } else if (in.estimator == static_cast<int>(KlEstimator::kK2)) {
      kl = 0.5f * d * d;
      dkl = -d;
    } else {
      kl = expm1f(d) - d;
      dkl = -expm1f(d);
    }
    r.kl = kl;
    if (in.kl_coef > 0.0f) {
      r.loss += static_cast<double>(in.kl_coef) * kl;
      r.dlogp += in.kl_coef * dkl;
    }
  }
  return r;
}

}  // namespace cuda_pt
}  // namespace lossd

#endif  // LOSSD_KERNELS_CUDA_POST_TRAINING_TERMS_CUH_
