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
// DRAM to the row's chain, which every piece of the row waits for. The
// slots, in order; kRowInputs counts them.
enum RowInput : int {
  kInScale,
  kInAdvantage,
  kInSampling,
  kInReference,
  kRowInputs,
};
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

// A sum of exp((z - m) / tau) about max m taken about `ref` >= m (tau_l2 =
// log2e / tau): the merges of TauSum's; 0 for an empty slice (m = -inf).
__device__ __forceinline__ float TauAbout(float sum, float m, float ref,
                                          float tau_l2) {
  return m == -INFINITY ? 0.0f : sum * Exp2((m - ref) * tau_l2);
}

// A top-k row's support: its gathered z, the teacher's logprobs and the
// indices, in shared memory where the piece staged them (StageSupport), else
// in global memory.
struct SupportView {
  const float* z;
  const float* lq;
  const void* indices;
  bool indices64;
  __device__ __forceinline__ long long Index(int j) const {
    return indices64 ? static_cast<const long long*>(indices)[j]
                     : static_cast<const int*>(indices)[j];
  }
};

// Supports of at most this many entries are staged in shared memory when a
// piece is taken (2 KiB a block): read after the merge from global memory,
// they added a round trip to DRAM to the row's chain and two more to the
// fix-up after the gradient, with the block's other warps idle.
constexpr int kStagedTopK = 128;
struct StagedSupport {
  float z[kStagedTopK];
  float lq[kStagedTopK];
  long long indices[kStagedTopK];  // (int32 indices: the first half)
};
__device__ __forceinline__ void CopyAsync8(void* smem, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(SmemAddr(smem)),
               "l"(src)
               : "memory");
}
// Warp-collective (the warp that merges): issues the copies of the row's
// support into `staged` where it fits (AwaitRowInputs completes them).
__device__ __forceinline__ void StageSupport(const RowTerms& terms,
                                             long long row,
                                             StagedSupport* staged, int lane) {
  const int k = terms.top_k;
  if (k > kStagedTopK) return;
  for (int j = lane; j < k; j += 32) {
    const long long at = row * k + j;
    CopyFloatAsync(staged->z + j, terms.support_z + at);
    CopyFloatAsync(staged->lq + j, terms.logprobs + at);
    if (terms.indices64) {
      CopyAsync8(staged->indices + j,
                 static_cast<const long long*>(terms.indices) + at);
    } else {
      CopyFloatAsync(reinterpret_cast<float*>(staged->indices) + j,
                     static_cast<const float*>(terms.indices) + at);
    }
  }
}
__device__ __forceinline__ SupportView SupportOf(const RowTerms& terms,
                                                 long long row,
                                                 const StagedSupport* staged) {
  const long long at = row * terms.top_k;
  if (terms.top_k <= kStagedTopK) {
    return {staged->z, staged->lq, staged->indices, terms.indices64};
  }
  return {terms.support_z + at, terms.logprobs + at,
          terms.indices64
              ? static_cast<const void*>(
                    static_cast<const long long*>(terms.indices) + at)
              : static_cast<const void*>(
                    static_cast<const int*>(terms.indices) + at),
          terms.indices64};
}

// A top-k row's divergence from its support: log P_j = (z_j - ref) / tau -
// log_norm_p, log Q_j = logprob_j - log_norm_q (the renormalised support's:
// ref its largest z; or with the tail bucket ref the row's max m, log_norm_p
// log sum exp((z - m) / tau) and 0), D, gbar = sum_b h_b, and g_tail =
// h_tail / P_tail (the tail's P as 1 - the support's: the statistics do not
// keep the tail's own sum).
struct TopKRow {
  float ref;
  float log_norm_p;
  float log_norm_q;
  float gbar;
  float tail_g;
  float d;
};
// Warp-collective (every lane of the warp, the same bits in each).
// `ref`, `log_norm_p`: the tail bucket's, as above.
__device__ __forceinline__ TopKRow MakeTopKRow(const RowTerms& terms,
                                               const SupportView& sv, float ref,
                                               float log_norm_p, int lane) {
  const int k = terms.top_k;
  const float* z = sv.z;
  const float* lq = sv.lq;
  const float inv_tau = terms.inv_tau;
  TopKRow r = {ref, log_norm_p, 0.0f, 0.0f, 0.0f, 0.0f};
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
      sz += expf((z[j] - mz) * inv_tau);
      sq += lq[j] == -INFINITY ? 0.0f : expf(lq[j] - mq);
    }
    r.ref = mz;
    r.log_norm_p = logf(WarpSum(sz));
    r.log_norm_q = mq + logf(WarpSum(sq));
  }
  float d = 0.0f, h = 0.0f, mass_p = 0.0f;
  // The teacher's tail is 1 - its support's mass, exact logprobs summed in
  // fp64: in fp32 the difference keeps ~1e-7 absolute, a relative error of
  // 1e-4 in a tail of 1e-3 of the mass.
  double mass_q = 0.0;
  for (int j = lane; j < k; j += 32) {
    float dj, hj;
    const float log_p = (z[j] - r.ref) * inv_tau - r.log_norm_p;
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
  // A student of no mass on its buckets (the row, or the renormalised
  // support) has no distribution.
  r.d = r.ref == -INFINITY ? NAN : d;
  return r;
}

// The tail bucket's p^tau term of the gradient at temperature != 1 (the kTau
// builds): p^tau_c / corr_tau = Exp2(fma(z_c - shift, tau_l2, -hi)), hi + lo
// = (m - shift) tau_l2 + log2 T (T the row's sum of exp((z - m) / tau)) and
// a = F_tau s corr_tau, corr_tau = 2^-lo restoring the digits that hi drops.
struct TauMath {
  float tau_l2;
  float hi;
  float a;
};
__device__ __forceinline__ TauMath MakeTauMath(float m, float shift,
                                               float tau_l2, float tau_sum) {
  TauMath r;
  r.tau_l2 = tau_l2;
  const float a = __fmul_rn(m - shift, tau_l2);
  const float a_lo = fmaf(m - shift, tau_l2, -a);
  const float b = log2f(tau_sum);
  // Two-sum of a and b with explicitly rounded operations (as MakeRowMath).
  r.hi = __fadd_rn(a, b);
  const float bv = __fsub_rn(r.hi, a);
  const float lo = __fadd_rn(
      __fadd_rn(__fsub_rn(a, __fsub_rn(r.hi, bv)), __fsub_rn(b, bv)), a_lo);
  r.a = isfinite(r.hi) && isfinite(lo) ? exp2f(-lo) : 1.0f;
  return r;
}

// The RowMath of a post-training row, the factor that its entropy share
// needs (p_c = 2^(...) * corr: corr restores the digits of lse's split), a
// top-k row's divergence and, in the kTau builds, its p^tau term.
struct TermsRow {
  RowMath rm;
  float corr;
  float scale;  // s: the row's row_scale, or the prepare kernel's scale
  TopKRow top_k;
  TauMath tau;  // (a = 0 outside the kTau builds)
};

// The row's math with a and gy for s (F p - G onehot(y) + F_tau p^tau)
// (RowTerms), and, where `record`, its PostTrainingCudaRow (entropy 0:
// LaunchRowTermsEntropy adds it). Options other than the softcap are off
// (RowTerms), so MakeRowMath's A is 1, its a at scale 1 is corr and its gy
// p_y - 1. `tau_sum`: the row's sum of exp((z - m) / tau) where
// NeedsTauSums(terms). Warp-collective with a top-k teacher (`sv` its
// support).
__device__ __forceinline__ TermsRow
MakeTermsRow(const Params& p, WorkspaceHeader h, const Stats& st, bool valid,
             long long y, float zy, const RowTerms& terms, const float* in,
             const SupportView& sv, float tau_sum, long long row, int lane,
             bool record) {
  TermsRow out;
  out.scale = terms.row_scale != nullptr ? in[kInScale] : h.scale;
  h.scale = 1.0f;
  out.rm = MakeRowMath(p, h, st, true, zy, 1.0f);
  out.corr = out.rm.a;
  out.top_k = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  out.tau = {0.0f, 0.0f, 0.0f};
  const float logp = valid ? (zy - st.m) - out.rm.l1p : 0.0f;
  PolicyRow policy = {0.0, 0.0, 0.0f, 0.0f, false};
  double loss = 0.0;
  // (an ignored row's factors 0 are never used: its gradient is zeros)
  float f = 0.0f, g = 0.0f, f_tau = 0.0f, p_tau_y = 0.0f;
  if (valid && terms.policy) {
    policy = MakePolicyRow(terms, in, logp);
    loss = policy.loss;
    f = g = -policy.dlogp;
  } else if (valid && terms.kd) {
    const bool tau = NeedsTauSums(terms);
    const float log_sum = tau ? logf(tau_sum) : out.rm.l1p;
    out.top_k = MakeTopKRow(terms, sv, st.m, log_sum, lane);
    if (DistillationGradientIsNan(
            terms.divergence == static_cast<int>(Divergence::kReverseKl),
            out.top_k.d)) {
      out.scale = NAN;  // (every element of the row's gradient NaN)
    }
    const float alpha = terms.alpha;
    loss = alpha * static_cast<double>(-logp) + (1.0 - alpha) * out.top_k.d;
    f = g = alpha;
    if (!terms.renormalize) {
      f_tau =
          (1.0f - alpha) * terms.inv_tau * (out.top_k.tail_g - out.top_k.gbar);
    }
    if (tau) {
      out.tau =
          MakeTauMath(st.m, out.rm.shift, terms.inv_tau * kLog2e, tau_sum);
      p_tau_y = expf((zy - st.m) * terms.inv_tau - log_sum);
    } else {
      f += f_tau;  // (p^tau = p)
      f_tau = 0.0f;
    }
  } else if (valid) {
    loss = -static_cast<double>(logp);
    f = g = 1.0f;
  }
  const float s = out.scale;
  out.rm.a *= f * s;
  out.rm.gy = s * (fmaf(f, out.rm.gy, f - g) + f_tau * p_tau_y);
  out.tau.a *= f_tau * s;
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
    // (a row of no finite logit has no argmax: 0, as the CPU's)
    r.argmax = st.arg == INT_MAX ? 0 : st.arg;
    r.flags = flags;
  }
  return out;
}

// Warp-collective: the gradient of the top-k support's entries that lie in
// [start, start + n) written again over the cross-entropy form there (after
// a barrier that orders them after it): s (alpha (p_c - [c == y]) + (1 -
// alpha) (h_c - P_c gbar) / tau), times the softcap's factor.
template <typename T, int kOpts>
__device__ __forceinline__ void FixSupport(const RowTerms& terms,
                                           const SupportView& sv, long long y,
                                           int start, int n, T* out_row,
                                           const TopKRow& kr, float lse,
                                           float s, const ElementOptions& opts,
                                           int lane) {
  const int k = terms.top_k;
  const float kd_scale = (1.0f - terms.alpha) * terms.inv_tau;
  for (int j = lane; j < k; j += 32) {
    const long long c = sv.Index(j);
    if (c < start || c >= start + n) continue;
    const float z = sv.z[j];
    const float log_p = (z - kr.ref) * terms.inv_tau - kr.log_norm_p;
    float d, h;
    DivergenceTerm(terms.divergence, terms.beta, log_p,
                   sv.lq[j] - kr.log_norm_q, &d, &h);
    const float residual = c == y ? expm1f(z - lse) : expf(z - lse);
    float grad =
        s * (terms.alpha * residual + kd_scale * (h - expf(log_p) * kr.gbar));
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
// kTau: the tail bucket's p^tau term (`tm`) besides. kEntropy false: the
// gradient alone (returns 0).
template <typename T, int kBlock, int kOpts, bool kWrite, bool kTau = false,
          bool kEntropy = true>
__device__ __forceinline__ float EntropyGradientSlice(
    const uint4* sv, T* out, int nvec, int tid, const RowMath& rm,
    const ElementOptions& opts, const TauMath& tm = {}) {
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
      if (kEntropy) h[j % 2] += e > 0.0f ? e * (rm.lse - z) : 0.0f;
      float b = rm.b;
      if (kTau && kWrite) {
        b = fmaf(Exp2(fmaf(z - rm.shift, tm.tau_l2, -tm.hi)), tm.a, b);
      }
      gr[j] = fmaf(e, rm.a, b) * dfac;
    }
    if (kWrite) StoreGradVector<T>(out, q, gr);
  });
  return h[0] + h[1];
}

}  // namespace cuda_ce
}  // namespace lossd

#endif  // LOSSD_KERNELS_CUDA_ROW_TERMS_CUH_
