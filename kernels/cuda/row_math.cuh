// Row math shared by every schedule: softmax statistics (Stats) and their
// fixed-order merges, and the gradient and loss of a row from its statistics
// (RowMath), with the precision choices the contract's tolerances need.

#ifndef LOSSD_KERNELS_CUDA_ROW_MATH_CUH_
#define LOSSD_KERNELS_CUDA_ROW_MATH_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <cstdint>

#include "kernels/cuda/element_traits.cuh"
#include "kernels/cuda/launch_params.h"

namespace lossd {
namespace cuda_ce {

// Softmax statistics of a slice: max m at first index arg, and
// t = sum_{c != arg} exp(z_c - m), so that sum exp(z - m) = 1 + t keeps the
// digits of a tiny t (p_y -> 1); an empty slice has m = -inf, t = -1. sum_wz
// is sum_c w_c z_c for label smoothing.
struct Stats {
  float m;
  float t;
  float sum_wz;
  int arg;
};
static_assert(sizeof(Stats) == kStatsBytes, "the workspace's piece record");

__device__ __forceinline__ void Combine(Stats& a, const Stats& b) {
  const bool b_wins = b.m > a.m || (b.m == a.m && b.arg < a.arg);
  const Stats& win = b_wins ? b : a;
  const Stats& lose = b_wins ? a : b;
  const float m = win.m;
  // Accurate expf: a few calls per thread, and __expf's argument rounding
  // would cost the row sum several ulps (issue 3, oracle seed 1199677219).
  const float t =
      m == -INFINITY
          // (no finite z: empty, unless a NaN was seen, which stays)
          ? (isnan(win.t) || isnan(lose.t) ? NAN : -1.0f)
          : win.t + (1.0f + lose.t) * expf(lose.m - m);
  a.arg = win.arg;
  a.m = m;
  a.t = t;
  a.sum_wz += b.sum_wz;
}

__device__ __forceinline__ Stats ShuffleStats(const Stats& a, int lane_mask) {
  Stats b;
  b.m = __shfl_xor_sync(0xffffffffu, a.m, lane_mask);
  b.t = __shfl_xor_sync(0xffffffffu, a.t, lane_mask);
  b.sum_wz = __shfl_xor_sync(0xffffffffu, a.sum_wz, lane_mask);
  b.arg = __shfl_xor_sync(0xffffffffu, a.arg, lane_mask);
  return b;
}

// The lane-mask shuffles BlockReduce combines: Stats by Combine, a float by
// addition.
__device__ __forceinline__ void ShuffleCombine(Stats& v, int lane_mask) {
  Combine(v, ShuffleStats(v, lane_mask));
}
__device__ __forceinline__ void ShuffleCombine(float& v, int lane_mask) {
  v += __shfl_xor_sync(0xffffffffu, v, lane_mask);
}

// Block-wide fixed-order reduction (of Stats, or a float sum); the result is
// valid in every thread. `scratch` holds one value per warp plus one.
template <int kBlock, typename V>
__device__ V BlockReduce(V v, V* scratch) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) ShuffleCombine(v, o);
  const int warp = threadIdx.x / 32;
  if (threadIdx.x % 32 == 0) scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    constexpr int kWarps = kBlock / 32;
    V w = scratch[threadIdx.x % kWarps];
#pragma unroll
    for (int o = kWarps / 2; o > 0; o >>= 1) ShuffleCombine(w, o);
    if (threadIdx.x == 0) scratch[kWarps] = w;
  }
  __syncthreads();
  return scratch[kBlock / 32];
}

constexpr float kLog2e = 1.4426950408889634f;

// 2^x on the special-function unit; exp(z - c) is computed as
// Exp2(fma(z, log2e, -c * log2e)): one FFMA and one MUFU per element.
__device__ __forceinline__ float Exp2(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

// 1/x on the special-function unit (1 ulp).
__device__ __forceinline__ float Rcp(float x) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

// tanh(u) in fp32 within 3 ulp (CUDA's tanhf: 2), for the softcap on every
// element: two SFU operations and ~12 FMAs, no branch. |u| < 0.6: u + u^3
// Q(u^2), Q a fitted degree-4 polynomial (0.8 ulp); past it 1 - 2 / (e^2|u|
// + 1) with the reciprocal refined by one Newton step (the SFU's e^x carries
// ~2 ulp); |u| >= 10 is 1 in fp32 (the clamp keeps e finite; NaN stays NaN).
__device__ __forceinline__ float FastTanh(float u) {
  const float a = fabsf(u);
  const float ac = a > 10.0f ? 10.0f : a;
  const float d = Exp2(ac * (2.0f * kLog2e)) + 1.0f;
  float r = Rcp(d);
  r = r * fmaf(-d, r, 2.0f);
  const float big = copysignf(fmaf(-2.0f, r, 1.0f), u);
  const float s = u * u;
  float q = -0.005852169822901487f;
  q = fmaf(q, s, 0.020753629505634308f);
  q = fmaf(q, s, -0.05376870557665825f);
  q = fmaf(q, s, 0.13331688940525055f);
  q = fmaf(q, s, -0.3333328366279602f);
  const float small = fmaf(u * s, q, u);
  return a < 0.6f ? small : big;
}

// v * log2e as hi + lo with hi = fl(v * log2e): Exp2(fma(z, log2e, -hi))
// then carries only the rounding of fma's result, and 2^-lo (folded into a
// per-row or per-thread factor) restores the digits that fl(lse * log2e)
// drops: 0.5 ulp of a |lse| ~ 30 is ~1e-6 of every p (oracle failures, fp32).
struct Log2Split {
  float hi;
  float lo;
};
__device__ __forceinline__ Log2Split SplitLog2(float v) {
  Log2Split r;
  // __fmul_rn: never contracted into a later add, or lo would belong to a
  // different hi (seen on the H200: one ulp of lse * log2e, 2.6e-6 of p).
  r.hi = __fmul_rn(v, kLog2e);
  r.lo = isfinite(r.hi) ? fmaf(v, kLog2e, -r.hi) : 0.0f;
  return r;
}

// Past this |max|, fl(m * log2e) is off by more than 2^-1 of a unit (its ulp
// passes 1 near 2^23 / log2e), and the fused form Exp2(fma(z, log2e, -m_l2))
// would give 2^(rounding) for z = m: inf or 0 at |m| ~ 1e30, hence a NaN row.
// Such rows take their exponents as (z - shift) * log2e with shift = m
// (exact by Sterbenz wherever the result is not 0), every other row keeps the
// fused form with shift 0 (z - 0 = z: the same bits as before).
constexpr float kHugeLogit = 1048576.0f;  // 2^20
__device__ __forceinline__ float ExponentShift(float m) {
  return fabsf(m) >= kHugeLogit && isfinite(m) ? m : 0.0f;
}

// A running max m raised to bm (> m): returns the factor that takes sums
// relative to the old max to the new one (0 while m was -inf) and updates m,
// its shift (ExponentShift) and fl(m * log2e) (0 with a shift).
__device__ __forceinline__ float RaiseMax(float bm, float* m, float* shift,
                                          float* m_l2) {
  const float nshift = ExponentShift(bm);
  // = fl(m * log2e), see SplitLog2
  const float nl2 = nshift != 0.0f ? 0.0f : __fmul_rn(bm, kLog2e);
  float f = 0.0f;
  if (*m > -INFINITY) {
    f = *shift == 0.0f && nshift == 0.0f ? Exp2(*m_l2 - nl2)
                                         : Exp2((*m - bm) * kLog2e);
  }
  *m = bm;
  *shift = nshift;
  *m_l2 = nl2;
  return f;
}

// Everything the gradient and the row outputs need, from the row's statistics.
struct RowMath {
  float lse;
  float shift;   // ExponentShift(m): p_c = Exp2(fma(z_c - shift, ...))
  float l1p;     // lse - m, kept apart so that z_y - lse keeps its digits
  float lse_l2;  // fl(lse * log2e) as a pair with the factor folded into a
  float a;       // dz_c = p_c * a + b * w_c (w_c = 1 without weights), with
  float b;       // p_c = Exp2(fma(z_c, log2e, -lse_l2))
  float gy;      // dz_y, computed without cancellation
  float loss;
  float zloss;
  // Label smoothing: dz_c = -b w_c expm1(z_c - cut - ln w_c) with cut = lse +
  // ln(eps / (A V)) as cut_hi + cut_lo, for the c where p_c A and eps w_c / V
  // cancel (OtherGrad); cancel_b = |b|, or 0 where nothing cancels.
  float cut_hi;
  float cut_lo;
  float cancel_b;
};

__device__ __forceinline__ RowMath MakeRowMath(const Params& p,
                                               const WorkspaceHeader& h,
                                               const Stats& st, bool valid,
                                               float zy, float wy) {
  RowMath r;
  r.l1p = log1pf(st.t);
  r.lse = st.m + r.l1p;
  r.shift = ExponentShift(st.m);
  // (lse - shift) * log2e = (m - shift + l1p) * log2e to ~2^-40 relative:
  // both products split exactly by fma, summed with a two-sum.
  const Log2Split ms = SplitLog2(r.shift != 0.0f ? 0.0f : st.m);
  const Log2Split ls = SplitLog2(r.l1p);
  // Two-sum with explicitly rounded operations (no contraction, no
  // reassociation): the identity hi + lo = (m + l1p) * log2e relies on it.
  const float hi = __fadd_rn(ms.hi, ls.hi);
  const float bv = __fsub_rn(hi, ms.hi);
  const float lo = __fadd_rn(
      __fadd_rn(__fsub_rn(ms.hi, __fsub_rn(hi, bv)), __fsub_rn(ls.hi, bv)),
      __fadd_rn(ms.lo, ls.lo));
  r.lse_l2 = hi;
  const float corr = isfinite(hi) && isfinite(lo) ? exp2f(-lo) : 1.0f;
  const float zy_minus_lse = (zy - st.m) - r.l1p;
  const float inv_v = 1.0f / static_cast<float>(p.vocab);
  const float s = valid ? h.scale : 0.0f;
  const float big_a = (1.0f - p.eps) * wy + p.eps * h.weight_total * inv_v +
                      2.0f * p.zls * r.lse;
  r.a = s * big_a * corr;
  r.b = -s * p.eps * inv_v;
  // dz_y = p_y * A - B with B = (1 - eps) w_y + eps w_y / V. Two ways, each
  // with an error of eps32 times the terms it adds: A * (p_y - 1) + (A - B)
  // keeps the digits of p_y -> 1 (Liger lost them), p_y * A - B keeps those of
  // a small p_y with B ~ A p_y (label smoothing near 1: the expm1 form lost
  // ~1e-7 absolute there, 2 bf16 roundings of a 1/V-sized gradient). Take the
  // one whose terms are smaller.
  const float big_b = (1.0f - p.eps) * wy + p.eps * wy * inv_v;
  const float a_minus_b =
      p.eps * (h.weight_total - wy) * inv_v + 2.0f * p.zls * r.lse;
  const float em1 = expm1f(zy_minus_lse);
  const float py = expf(zy_minus_lse);
  const bool use_em1 =
      fabsf(big_a * em1) + fabsf(a_minus_b) <= fabsf(big_a * py) + fabsf(big_b);
  r.gy = s * (use_em1 ? fmaf(big_a, em1, a_minus_b) : fmaf(big_a, py, -big_b));
  r.cut_hi = 0.0f;
  r.cut_lo = 0.0f;
  r.cancel_b = 0.0f;
  if (p.eps > 0.0f && valid) {
    // In fp64, once a row: the fp32 rounding of log1p(t) alone is ~1e-7 of
    // lse, which a cancellation of 1e-5 makes 1e-2 of dz_c (2 bf16 ulps).
    const double lse =
        static_cast<double>(st.m) + log1p(static_cast<double>(st.t));
    const double v = static_cast<double>(p.vocab);
    const double big_a_d = (1.0 - p.eps) * static_cast<double>(wy) +
                           p.eps * static_cast<double>(h.weight_total) / v +
                           2.0 * static_cast<double>(p.zls) * lse;
    const double cut = lse + log(p.eps / (big_a_d * v));
    // A <= 0: p_c A and -eps w_c / V have one sign, nothing cancels.
    if (big_a_d > 0.0 && isfinite(cut)) {
      r.cut_hi = static_cast<float>(cut);
      r.cut_lo = static_cast<float>(cut - static_cast<double>(r.cut_hi));
      r.cancel_b = fabsf(r.b);
    }
  }
  r.zloss = valid ? p.zls * r.lse * r.lse : 0.0f;
  r.loss = valid ? -(1.0f - p.eps) * wy * zy_minus_lse +
                       p.eps * inv_v * (r.lse * h.weight_total - st.sum_wz) +
                       r.zloss
                 : 0.0f;
  return r;
}

// expm1(d) where the cancelled form below is taken: there |expm1(d)| is
// under the dtype's kCancelCut (1/64 bf16, 1/4 fp16 and fp32), so |d| < 0.29,
// and the Taylor series to d^8 (d^4 for bf16) is within 2^-26 (2^-20) of it,
// as FMAs: no call, no branch in the hot loops.
template <typename T>
__device__ __forceinline__ float Expm1Small(float d) {
  constexpr bool kShort = Traits<T>::kCancelCut < 0.0625f;
  float q = kShort ? 1.0f / 24 : 1.0f / 362880;
  if (!kShort) {
    q = fmaf(q, d, 1.0f / 40320);
    q = fmaf(q, d, 1.0f / 5040);
    q = fmaf(q, d, 1.0f / 720);
    q = fmaf(q, d, 1.0f / 120);
    q = fmaf(q, d, 1.0f / 24);
  }
  q = fmaf(q, d, 1.0f / 6);
  q = fmaf(q, d, 0.5f);
  q = fmaf(q, d, 1.0f);
  return d * q;
}

// ln w_c for the cancelled form: the SFU's for halves (2^-21 absolute, far
// under their rounding), the accurate one for fp32.
template <typename T>
__device__ __forceinline__ float LogWeight(float w) {
  return Traits<T>::kVec == 4 ? logf(w) : __logf(w);
}

// dz_c for c != y (before the softcap factor): p_c a + b w_c, and where the
// two cancel by more than the dtype's Traits<T>::kCancelCut (label
// smoothing), the same value as -b w_c (A V p_c / (eps w_c) - 1) = -b w_c
// expm1(d), d = (z_c - cut) - ln w_c, whose z_c - cut_hi is exact (Sterbenz)
// and keeps the digits of d: p_c carries the rounding of its exponent's
// argument (up to 2^-20 of p_c at |log2 p_c| ~ 20) and of Exp2, which the
// cancellation multiplies by |b w_c / dz_c|. Both forms computed and one
// selected, with no branch: the band holds a few percent of a row, which as a
// branch made nearly every warp take it, and a branch on w_c split the
// unrolled loops at every element. kWeights: w_c from class weights (else 1,
// which folds); cancel_b = 0 (nothing cancels) selects the fast form.
template <typename T, bool kWeights>
__device__ __forceinline__ float OtherGrad(const RowMath& r, float z,
                                           float wc) {
  const float fast =
      Exp2(fmaf(z - r.shift, kLog2e, -r.lse_l2)) * r.a + r.b * wc;
  float d = __fsub_rn(__fsub_rn(z, r.cut_hi), r.cut_lo);
  // (w_c = 0: d = +inf, never selected below)
  if (kWeights) d = __fsub_rn(d, LogWeight<T>(wc));
  const float cancelled = -r.b * wc * Expm1Small<T>(d);
  const bool band = fabsf(fast) < r.cancel_b * wc * Traits<T>::kCancelCut;
  return (kWeights ? wc > 0.0f && band : band) ? cancelled : fast;
}

__device__ __forceinline__ void WriteRowOutputs(const Params& p, long long row,
                                                bool valid, long long y,
                                                const RowMath& r, int arg,
                                                bool have_stats) {
  const float lse = have_stats ? r.lse : 0.0f;
  const float loss = valid ? r.loss : 0.0f;
  if (p.token_loss) p.token_loss[row] = loss;
  if (p.token_lse) p.token_lse[row] = lse;
  if (p.token_argmax) p.token_argmax[row] = have_stats ? arg : 0;
  p.row_loss[row] = loss;
  p.row_zloss[row] = valid ? r.zloss : 0.0f;
  int flags = 0;
  if (valid && arg == y) flags |= kFlagCorrect;
  if (valid && !isfinite(loss)) flags |= kFlagNonfinite;
  p.row_flags[row] = flags;
}

__device__ __forceinline__ float SoftcapZ(float x, float c, float* dfac) {
  const float t = tanhf(x / c);
  *dfac = fmaf(-t, t, 1.0f);
  return c * t;
}

// The options that act on every element, for the fast schedules' option
// builds: softcap (z = c tanh(x / c), dz/dx = 1 - tanh^2) and label
// smoothing's sum of w_c z_c (w_c = 1 without class weights) and its w_c in
// the gradient. Class weights without smoothing need only w_y (MakeRowMath)
// and the total (prepare), not a load an element.
struct ElementOptions {
  float cap;             // softcap c; 0: none
  float inv_cap;         // 1 / c: x / c as one multiply (1.5 ulp, not 0.5)
  float tanh_scale;      // 2 log2e / c: HalfTanh's argument in one multiply
  bool smoothing;        // eps > 0
  const float* weights;  // class weights where smoothing needs them, or null
};
__device__ __forceinline__ ElementOptions MakeElementOptions(const Params& p) {
  ElementOptions o;
  o.cap = p.softcap;
  o.inv_cap = p.softcap > 0.0f ? 1.0f / p.softcap : 0.0f;
  o.tanh_scale = 2.0f * kLog2e * o.inv_cap;
  o.smoothing = p.eps > 0.0f;
  o.weights = o.smoothing ? p.weights : nullptr;
  return o;
}
// tanh(x / c) for the softcap of logits of type T: FastTanh for fp32, whose
// bound counts every ulp of z; for the halves 1 - 2 / (2^(2 x log2e / c) + 1)
// with the SFU's ex2 and rcp and no refinement (~12 instructions fewer an
// element and pass). Its error is absolute, ~2^-22 (the rounding of the
// argument adds (1 - t^2) |2 u log2e| 2^-23), and z = c t carries c times it
// into p = exp(z - lse) as a relative error: 2^-15 of p at c = 30, under a
// half's rounding (2^-9 bf16, 2^-11 fp16). x = +-inf gives +-1, NaN stays.
template <typename T>
__device__ __forceinline__ float CapTanh(const ElementOptions& o, float x) {
  if (Traits<T>::kVec == 4) return FastTanh(x * o.inv_cap);
  return fmaf(-2.0f, Rcp(Exp2(x * o.tanh_scale) + 1.0f), 1.0f);
}
// z from the logit x in option build kOpts (launch_params.h): the softcap if
// any.
template <typename T, int kOpts>
__device__ __forceinline__ float OptionZ(const ElementOptions& o, float x) {
  return (kOpts & kOptSoftcap) ? o.cap * CapTanh<T>(o, x) : x;
}
// z and dz/dx from the logit x.
template <typename T, int kOpts>
__device__ __forceinline__ float OptionZ(const ElementOptions& o, float x,
                                         float* dfac) {
  if (!(kOpts & kOptSoftcap)) {
    *dfac = 1.0f;
    return x;
  }
  const float t = CapTanh<T>(o, x);
  *dfac = fmaf(-t, t, 1.0f);
  return o.cap * t;
}
// w_c as label smoothing's terms need it (1 without class weights or without
// smoothing, where b = 0 leaves it out of the gradient): a compile-time 1
// outside the kOptWeights builds.
template <int kOpts>
__device__ __forceinline__ float OptionWeight(const ElementOptions& o, int c) {
  return (kOpts & kOptWeights) ? __ldg(o.weights + c) : 1.0f;
}
// w_y of a row (1 without class weights or for an ignored row).
__device__ __forceinline__ float TargetWeight(const Params& p, bool valid,
                                              long long y) {
  return valid && p.weights != nullptr ? __ldg(p.weights + y) : 1.0f;
}

// Merges the statistics of the 32 lanes of a warp; every lane gets the same
// bits (each butterfly level adds or compares the same pair in every lane).
// One accurate expf a lane instead of one a level: max and first argmax
// first, then each lane's 1 + t rescaled to the warp max (the lane holding
// the argmax adds its t alone, so a tiny t keeps its digits) and summed.
__device__ __forceinline__ Stats WarpMergeStats(const Stats& v) {
  float m = v.m;
  int arg = v.arg;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float om = __shfl_xor_sync(0xffffffffu, m, o);
    const int oa = __shfl_xor_sync(0xffffffffu, arg, o);
    if (om > m || (om == m && oa < arg)) {
      m = om;
      arg = oa;
    }
  }
  float u = 0.0f;
  float wz = v.sum_wz;
  if (m != -INFINITY) {
    u = (v.arg == arg && v.m == m) ? v.t : (1.0f + v.t) * expf(v.m - m);
  } else if (isnan(v.t)) {
    u = v.t;  // (a NaN with no finite z beside it: the sum stays NaN)
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    u += __shfl_xor_sync(0xffffffffu, u, o);
    wz += __shfl_xor_sync(0xffffffffu, wz, o);
  }
  Stats r;
  r.m = m;
  r.arg = arg;
  r.t = m == -INFINITY && !isnan(u) ? -1.0f : u;
  r.sum_wz = wz;
  return r;
}

__device__ __forceinline__ Stats EmptyStats() {
  Stats e;
  e.m = -INFINITY;
  e.t = -1.0f;
  e.sum_wz = 0.0f;
  e.arg = INT_MAX;
  return e;
}

// Block-wide merge (kBlock threads, fixed order); valid in every thread.
// `scratch` holds kBlock / 32 + 1 Stats.
template <int kBlock>
__device__ __forceinline__ Stats BlockMergeStats(const Stats& v,
                                                 Stats* scratch) {
  constexpr int kWarps = kBlock / 32;
  const Stats w = WarpMergeStats(v);
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (lane == 0) scratch[warp] = w;
  __syncthreads();
  if (warp == 0) {
    const Stats b =
        WarpMergeStats(lane < kWarps ? scratch[lane] : EmptyStats());
    if (lane == 0) scratch[kWarps] = b;
  }
  __syncthreads();
  return scratch[kWarps];
}

}  // namespace cuda_ce
}  // namespace lossd

#endif  // LOSSD_KERNELS_CUDA_ROW_MATH_CUH_
