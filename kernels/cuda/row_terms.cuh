// Device side of RowTerms (row_terms.h): a post-training row's factor and
// record from its merged statistics, and the gradient loop that also sums the
// row's entropy, for the smem row pieces schedule.
#ifndef LOSSD_KERNELS_CUDA_ROW_TERMS_CUH_
#define LOSSD_KERNELS_CUDA_ROW_TERMS_CUH_

#include <cuda_runtime.h>

#include <cmath>

#include "kernels/cuda/element_traits.cuh"
#include "kernels/cuda/post_training_terms.cuh"
#include "kernels/cuda/ptx.cuh"
#include "kernels/cuda/row_math.cuh"
#include "kernels/cuda/row_terms.h"
#include "kernels/cuda/slice_stats.cuh"
#include "kernels/post_training.h"

namespace lossd {
namespace cuda_ce {

// A row's small inputs in shared memory (`in`, kRowInputs floats): its factor
// and its policy inputs, copied there by one thread when a piece of the row
// is taken (cp.async: nothing held in registers across the statistics) and
// read after the merge. Loaded there instead, they would add a round trip to
// DRAM to the row's chain, which every piece of the row waits for.
constexpr int kInScale = 0;
constexpr int kInAdvantage = 1;
constexpr int kInSampling = 2;
constexpr int kInReference = 3;
constexpr int kRowInputs = 4;
__device__ __forceinline__ void CopyFloatAsync(float* smem, const float* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(SmemAddr(smem)),
               "l"(src)
               : "memory");
}
__device__ __forceinline__ void FetchRowInputs(const RowTerms& terms,
                                               long long row, float* in) {
  if (terms.row_scale != nullptr) {
    CopyFloatAsync(in + kInScale, terms.row_scale + row);
  }
  if (terms.policy) {
    CopyFloatAsync(in + kInAdvantage, terms.pg.advantages + row);
    CopyFloatAsync(in + kInSampling, terms.pg.sampling_logprobs + row);
    if (terms.pg.reference_logprobs != nullptr) {
      CopyFloatAsync(in + kInReference, terms.pg.reference_logprobs + row);
    }
  }
}
// By the thread that fetched them.
__device__ __forceinline__ void AwaitRowInputs() {
  asm volatile("cp.async.wait_all;" ::: "memory");
}

// A policy row's values from its logp (post_training_terms.cuh).
using cuda_pt::PolicyRow;
__device__ __forceinline__ PolicyRow MakePolicyRow(const RowTerms& terms,
                                                   const float* in,
                                                   float logp) {
  const cuda_pt::PolicyInputs inputs = cuda_pt::PolicyInputsOf(terms.pg);
  return cuda_pt::MakePolicyRow(inputs, in[kInAdvantage], in[kInSampling],
                                inputs.has_reference ? in[kInReference] : 0.0f,
                                logp);
}
using cuda_pt::DivergenceTerm;

template <typename F>
__device__ __forceinline__ F WarpSum(F v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float WarpMax(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  }
  return v;
}

// A top-k row's divergence at temperature 1, from its gathered support:
// log P_j = z_j - log_norm_p, log Q_j = logprob_j - log_norm_q (the
// renormalised support's, or lse and 0 with the tail bucket), D, gbar =
// sum_b h_b, and g_tail = h_tail / P_tail (the tail's P as 1 - the support's:
// the statistics do not keep the tail's own sum).
struct TopKRow {
  float log_norm_p;
  float log_norm_q;
  float gbar;
  float tail_g;
  float d;
};
// Warp-collective (every lane of the warp, the same bits in each).
__device__ __forceinline__ TopKRow MakeTopKRow(const RowTerms& terms,
                                               long long row, float lse,
                                               int lane) {
  const int k = terms.top_k;
  const float* z = terms.support_z + row * k;
  const float* lq = terms.logprobs + row * k;
  TopKRow r = {lse, 0.0f, 0.0f, 0.0f, 0.0f};
  if (terms.renormalize) {
    float mz = -INFINITY, mq = -INFINITY;
    for (int j = lane; j < k; j += 32) {
      mz = fmaxf(mz, z[j]);
      mq = fmaxf(mq, lq[j]);
    }
    mz = WarpMax(mz);
    mq = WarpMax(mq);
    float sz = 0.0f, sq = 0.0f;
    for (int j = lane; j < k; j += 32) {
      sz += expf(z[j] - mz);
      sq += lq[j] == -INFINITY ? 0.0f : expf(lq[j] - mq);
    }
    r.log_norm_p = mz + logf(WarpSum(sz));
    r.log_norm_q = mq + logf(WarpSum(sq));
  }
  float d = 0.0f, h = 0.0f, mass_p = 0.0f;
  // The teacher's tail is 1 - its support's mass, exact logprobs summed in
  // fp64: in fp32 the difference keeps ~1e-7 absolute, a relative error of
  // 1e-4 in a tail of 1e-3 of the mass.
  double mass_q = 0.0;
  for (int j = lane; j < k; j += 32) {
    float dj, hj;
    const float log_p = z[j] - r.log_norm_p;
    DivergenceTerm(terms.divergence, terms.beta, log_p, lq[j] - r.log_norm_q,
                   &dj, &hj);
    d += dj;
    h += hj;
    mass_p += expf(log_p);
    mass_q += exp(static_cast<double>(lq[j]));
  }
  d = WarpSum(d);
  h = WarpSum(h);
  if (!terms.renormalize) {
    const float p_tail = fmaxf(0.0f, 1.0f - WarpSum(mass_p));
    const double q_tail = fmax(0.0, 1.0 - WarpSum(mass_q));
    float dt, ht;
    DivergenceTerm(terms.divergence, terms.beta, logf(p_tail),
                   static_cast<float>(log(q_tail)), &dt, &ht);
    d += dt;
    h += ht;
    r.tail_g = p_tail > 0.0f ? ht / p_tail : 0.0f;
  }
  r.gbar = h;
  r.d = d;
  return r;
}

// The RowMath of a post-training row, the factor that its entropy share
// needs (p_c = 2^(...) * corr: corr restores the digits of lse's split) and
// a top-k row's divergence.
struct TermsRow {
  RowMath rm;
  float corr;
  float scale;  // s: the row's row_scale, or the prepare kernel's scale
  TopKRow top_k;
};

// The row's math with a and gy for s (F p - G onehot(y)) (RowTerms), and,
// where `record`, its PostTrainingCudaRow (entropy 0: LaunchRowTermsEntropy
// adds it). Options other than the softcap are off (RowTerms), so
// MakeRowMath's A is 1, its a at scale 1 is corr and its gy p_y - 1.
// Warp-collective with a top-k teacher.
__device__ __forceinline__ TermsRow
MakeTermsRow(const Params& p, WorkspaceHeader h, const Stats& st, bool valid,
             long long y, float zy, const RowTerms& terms, const float* in,
             long long row, int lane, bool record) {
  TermsRow out;
  out.scale = terms.row_scale != nullptr ? in[kInScale] : h.scale;
  h.scale = 1.0f;
  out.rm = MakeRowMath(p, h, st, true, zy, 1.0f);
  out.corr = out.rm.a;
  out.top_k = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  const float logp = valid ? (zy - st.m) - out.rm.l1p : 0.0f;
  PolicyRow policy = {0.0, 0.0, 0.0f, 0.0f, false};
  double loss = 0.0;
  // (an ignored row's factors 0 are never used: its gradient is zeros)
  float f = 0.0f, g = 0.0f;
  if (valid && terms.policy) {
    policy = MakePolicyRow(terms, in, logp);
    loss = policy.loss;
    f = g = -policy.dlogp;
  } else if (valid && terms.kd) {
    out.top_k = MakeTopKRow(terms, row, out.rm.lse, lane);
    const float alpha = terms.alpha;
    loss = alpha * static_cast<double>(-logp) + (1.0 - alpha) * out.top_k.d;
    g = alpha;
    f = terms.renormalize
            ? alpha
            : alpha + (1.0f - alpha) * (out.top_k.tail_g - out.top_k.gbar);
  } else if (valid) {
    loss = -static_cast<double>(logp);
    f = g = 1.0f;
  }
  const float s = out.scale;
  out.rm.a *= f * s;
  out.rm.gy = s * fmaf(f, out.rm.gy, f - g);
  if (record) {
    int flags = 0;
    if (valid) {
      flags = kPostTrainingRowValid;
      // (st.arg: the row's first argmax, as the row kernel's)
      if (static_cast<long long>(st.arg) == y) {
        flags |= kPostTrainingRowCorrect;
      }
      if (policy.clipped) flags |= kPostTrainingRowClipped;
    }
    PostTrainingCudaRow& r = terms.rows_out[row];
    r.loss = loss;
    r.distillation = out.top_k.d;
    r.ratio = policy.ratio;
    r.approx_kl = valid && terms.policy ? in[kInSampling] - logp : 0.0f;
    r.kl = policy.kl;
    r.entropy = 0.0;
    r.lse = out.rm.lse;
    r.logprob = logp;
    r.argmax = st.arg;
    r.flags = flags;
  }
  return out;
}

// Warp-collective: the gradient of the top-k support's entries that lie in
// [start, start + n) written again over the cross-entropy form there (after
// a barrier that orders them after it): s (alpha (p_c - [c == y]) + (1 -
// alpha) (h_c - P_c gbar)), times the softcap's factor.
template <typename T, int kOpts>
__device__ __forceinline__ void FixSupport(const RowTerms& terms, long long row,
                                           long long y, int start, int n,
                                           T* out_row, const TopKRow& kr,
                                           float lse, float s,
                                           const ElementOptions& opts,
                                           int lane) {
  const int k = terms.top_k;
  for (int j = lane; j < k; j += 32) {
    const long long at = row * k + j;
    const long long c = terms.indices64
                            ? static_cast<const long long*>(terms.indices)[at]
                            : static_cast<const int*>(terms.indices)[at];
    if (c < start || c >= start + n) continue;
    const float z = terms.support_z[at];
    const float log_p = z - kr.log_norm_p;
    float d, h;
    DivergenceTerm(terms.divergence, terms.beta, log_p,
                   terms.logprobs[at] - kr.log_norm_q, &d, &h);
    const float residual = c == y ? expm1f(z - lse) : expf(z - lse);
    float grad = s * (terms.alpha * residual +
                      (1.0f - terms.alpha) * (h - expf(log_p) * kr.gbar));
    if (kOpts & kOptSoftcap) {
      const float t = z * opts.inv_cap;
      grad *= fmaf(-t, t, 1.0f);
    }
    Traits<T>::Store(out_row + c, grad);
  }
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
  ForSliceVectors<kBlock>(sv, nvec, tid, [&](int q, const uint4& v) {
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
    if (kWrite) StoreGradVector<T>(out, q, gr);
  });
  return h[0] + h[1];
}

}  // namespace cuda_ce
}  // namespace lossd

#endif  // LOSSD_KERNELS_CUDA_ROW_TERMS_CUH_
