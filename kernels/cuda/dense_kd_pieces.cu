// Dense-teacher distillation on row pieces kept in shared memory: each piece
// reads its student slice and its teacher slice once (bulk copies), the row's
// pieces merge their statistics through published slots, and the gradient is
// written from shared memory over the student (dense_kd_pieces.h).
//
// Shapes: student z [N, V] (row stride S), teacher t [N, V] (stride St),
// targets [N]; a row is `pieces` pieces of `chunk` elements.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <type_traits>

#include "kernels/cuda/dense_kd_pieces.h"
#include "kernels/cuda/dtype_dispatch.cuh"
#include "kernels/cuda/element_traits.cuh"
#include "kernels/cuda/ptx.cuh"
#include "kernels/cuda/row_math.cuh"
#include "kernels/cuda/slice_stats.cuh"
#include "kernels/post_training.h"

namespace lossd {
namespace cuda_ce {
namespace {

// 128 threads a block, four blocks a SM (the registers allow no more
// threads): four pieces in flight a SM rather than two, so that one block's
// wait for its row or its piece's bulk copies leaves three at work.
constexpr int kBlock = 128;
constexpr int kWarps = kBlock / 32;
// Student vectors a batch (8 KiB of student): one chunk barrier each, at
// most kMaxBatches a piece (128 KiB of student, as the policy allows).
constexpr int kBatchVectors = kU * kBlock;
constexpr int kMaxBatches = 16;

constexpr int kFkl = static_cast<int>(Divergence::kForwardKl);
constexpr int kRkl = static_cast<int>(Divergence::kReverseKl);
constexpr int kJsd = static_cast<int>(Divergence::kJsd);
constexpr double kLog2eD = 1.4426950408889634;
// A thread's running maxima before its first element: finite, so that a
// vector of -inf leaves them alone and its exponents come out 0, not NaN.
constexpr float kNoMax = -3.402823466e38f;

// The statistics of a slice of a row, in raw logits: z's max mz (first
// argmax arg) and the teacher's max mt; sz = sum e^(z - mz) and hz = sum
// e^(z - mz) (z - mz) (the entropy's, 0 in the builds without it); su = sum
// e^((z - mz) / tau); sv = sum e^((t - mt) / tau); and the divergence's
// weighted sum w, forward KL sum e^((t - mt) / tau) (t - z), reverse KL sum
// e^((z - mz) / tau) (z - t) (w / sv or w / su is the mean of (v - u) or (u -
// v) times tau: the row kernel's WeightedStats). A thread sums each 16-byte
// vector in fp32 and adds the vector's sums to fp64 totals (sv and su, w's
// denominators, kept to fp64's digits: bench/NOTES.md, the reverse KL of a
// sharp student); every merge past the thread is in fp64.
struct DenseStats {
  float mz;
  float mt;
  int arg;
  double sz;
  double hz;
  double su;
  double sv;
  double w;
};
__device__ __forceinline__ DenseStats EmptyDense() {
  return {kNoMax, kNoMax, INT_MAX, 0.0, 0.0, 0.0, 0.0, 0.0};
}

// A piece's published statistics (and the target's z where it holds it);
// `tag` set last, by a release store, once the rest is visible.
struct alignas(16) DenseSlot {
  DenseStats st;
  float zy;
  unsigned tag;
};
// JSD's second exchange: a piece's sums of D, h and P (fp64).
struct alignas(16) SumsSlot {
  double d;
  double h;
  double p;
  unsigned tag;
};
constexpr size_t kCounterBytes = 16;

__device__ __forceinline__ void StoreRelease(unsigned* p, unsigned v) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v)
               : "memory");
}
__device__ __forceinline__ unsigned LoadAcquireU(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];"
               : "=r"(v)
               : "l"(p)
               : "memory");
  return v;
}

// Merges the 32 lanes' statistics; every lane gets the same bits (the max
// first, then each lane's sums rescaled to it once in fp64 and added by
// butterfly, which adds the same pair in every lane).
template <int kDiv>
__device__ __forceinline__ DenseStats WarpMergeDense(const DenseStats& v,
                                                     double inv_tau) {
  float m = v.mz;
  float mt = v.mt;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, o));
  }
  DenseStats r;
  r.mz = m;
  r.mt = mt;
  // (the first argmax: the least index among the lanes that hold the max)
  r.arg = __reduce_min_sync(0xffffffffu, v.mz == m ? v.arg : INT_MAX);
  // (both differences finite: the maxima start at kNoMax, not -inf)
  const double dz = static_cast<double>(v.mz) - m;
  const double fz = exp(dz);
  const double fu = inv_tau == 1.0 ? fz : exp(dz * inv_tau);
  const double fv = exp((static_cast<double>(v.mt) - mt) * inv_tau);
  r.sz = v.sz * fz;
  r.hz = fz * fma(dz, v.sz, v.hz);
  r.su = v.su * fu;
  r.sv = v.sv * fv;
  r.w = kDiv == kFkl ? v.w * fv : kDiv == kRkl ? v.w * fu : 0.0;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    r.sz += __shfl_xor_sync(0xffffffffu, r.sz, o);
    r.hz += __shfl_xor_sync(0xffffffffu, r.hz, o);
    r.su += __shfl_xor_sync(0xffffffffu, r.su, o);
    r.sv += __shfl_xor_sync(0xffffffffu, r.sv, o);
    if (kDiv != kJsd) r.w += __shfl_xor_sync(0xffffffffu, r.w, o);
  }
  return r;
}

// Sums of three fp64 values over the warp, the same bits in every lane.
__device__ __forceinline__ void WarpSum3(double* a, double* b, double* c) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    *a += __shfl_xor_sync(0xffffffffu, *a, o);
    *b += __shfl_xor_sync(0xffffffffu, *b, o);
    *c += __shfl_xor_sync(0xffffffffu, *c, o);
  }
}

// The kVec teacher values (as floats) beside student vector q: 8, 16 or 32
// bytes of the teacher's slice in shared memory.
template <typename T, typename TT>
__device__ __forceinline__ void TeacherValues(const uint4* ts, int q,
                                              float (&out)[Traits<T>::kVec]) {
  constexpr int kN = Traits<T>::kVec;
  constexpr int kBytes = kN * static_cast<int>(sizeof(TT));
  if constexpr (kBytes == 16) {
    const uint4 v = ts[q];
#pragma unroll
    for (int j = 0; j < kN; ++j) out[j] = Traits<TT>::Get(v, j);
  } else if constexpr (kBytes == 32) {  // fp32 teacher, 2-byte student
    const uint4 a = ts[2 * q];
    const uint4 b = ts[2 * q + 1];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      out[j] = Traits<TT>::Get(a, j);
      out[4 + j] = Traits<TT>::Get(b, j);
    }
  } else {  // 2-byte teacher, fp32 student
    const uint2 h = reinterpret_cast<const uint2*>(ts)[q];
    const uint4 v = make_uint4(h.x, h.y, 0u, 0u);
#pragma unroll
    for (int j = 0; j < kN; ++j) out[j] = Traits<TT>::Get(v, j);
  }
}

// The largest of a 16-byte vector's elements (halves: packed pairs, half the
// instructions of unpacking first).
template <typename T>
__device__ __forceinline__ float VectorMax(const uint4& v) {
  if constexpr (sizeof(T) == 4) {
    return fmaxf(fmaxf(__uint_as_float(v.x), __uint_as_float(v.y)),
                 fmaxf(__uint_as_float(v.z), __uint_as_float(v.w)));
  } else {
    using H2 =
        std::conditional_t<std::is_same_v<T, __half>, __half2, __nv_bfloat162>;
    const H2 m = __hmax2(__hmax2(AsPair<H2>(v.x), AsPair<H2>(v.y)),
                         __hmax2(AsPair<H2>(v.z), AsPair<H2>(v.w)));
    return fmaxf(__low2float(m), __high2float(m));
  }
}

// This thread's statistics of its piece (kept: the student's slice, tkept:
// the teacher's; nvec student vectors from column `start`), each batch once
// it has landed. A vector's max raises the running ones (rarely, past the
// first vectors); w's terms are centred on the pair at the running max of
// their weights (fp32 rounds each term relative to its distance from the
// centre, and a sharp row's terms near it carry the sum).
template <typename T, typename TT, int kDiv, bool kTauOne, bool kEntropy>
__device__ __forceinline__ DenseStats PieceStats(const uint4* kept,
                                                 const uint4* tkept, int nvec,
                                                 int start, int tid,
                                                 unsigned long long* landed,
                                                 unsigned parity, float c_u) {
  using Tr = Traits<T>;
  constexpr int kVec = Tr::kVec;
  float bz = kNoMax, bt = kNoMax;
  // The centre's partner: z at the teacher's max (forward KL), t at the
  // student's (reverse KL); w's terms are e (d - c) with c = bt - zc or bz -
  // tc, d the raw difference t - z or z - t.
  float partner = 0.0f;
  double centre = 0.0;
  int arg = INT_MAX;
  double sz = 0.0, hz = 0.0, su = 0.0, sv = 0.0, w = 0.0;
#pragma unroll 1
  for (int b = 0; b * kBatchVectors < nvec; ++b) {
    MbarWait(&landed[b], parity);
#pragma unroll 2
    for (int q = b * kBatchVectors + tid;
         q < min(nvec, (b + 1) * kBatchVectors); q += kBlock) {
      const uint4 zv = kept[q];
      float tv[kVec];
      TeacherValues<T, TT>(tkept, q, tv);
      float z[kVec];
#pragma unroll
      for (int j = 0; j < kVec; ++j) z[j] = Tr::Get(zv, j);
      const float vz = VectorMax<T>(zv);
      float vt = tv[0];
#pragma unroll
      for (int j = 1; j < kVec; ++j) vt = fmaxf(vt, tv[j]);
      if (vz > bz) {
        // (the first j at the max, and its teacher value: selects, no
        // indexing of the register arrays)
        int jm = kVec - 1;
        float tc = tv[kVec - 1];
#pragma unroll
        for (int j = kVec - 1; j >= 0; --j) {
          if (z[j] == vz) {
            jm = j;
            tc = tv[j];
          }
        }
        arg = start + q * kVec + jm;
        const double dz = static_cast<double>(bz) - vz;
        const double fz = Exp2(static_cast<float>(dz) * kLog2e);
        const double fu = kTauOne ? fz : Exp2(static_cast<float>(dz) * c_u);
        if (kDiv == kRkl) {
          const double c = static_cast<double>(vz) - (isfinite(tc) ? tc : 0.0f);
          w = fu * fma(centre - c, kTauOne ? sz : su, w);
          centre = c;
          partner = isfinite(tc) ? tc : 0.0f;
        }
        if (kEntropy) hz = fz * fma(dz, sz, hz);
        sz *= fz;
        su *= fu;
        bz = vz;
      }
      if (vt > bt) {
        const double fv =
            Exp2(static_cast<float>(static_cast<double>(bt) - vt) * c_u);
        if (kDiv == kFkl) {
          float zc = z[kVec - 1];
#pragma unroll
          for (int j = kVec - 1; j >= 0; --j) {
            if (tv[j] == vt) zc = z[j];
          }
          const double c = static_cast<double>(vt) - (isfinite(zc) ? zc : 0.0f);
          w = fv * fma(centre - c, sv, w);
          centre = c;
          partner = isfinite(zc) ? zc : 0.0f;
        }
        sv *= fv;
        bt = vt;
      }
      float pz = 0.0f, ph = 0.0f, pu = 0.0f, pv = 0.0f, pw = 0.0f;
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const float dz = z[j] - bz;
        const float ez = Exp2(dz * kLog2e);
        pz += ez;
        // (a class of z -inf: e 0, no 0 * inf)
        if (kEntropy) ph = ez > 0.0f ? fmaf(ez, dz, ph) : ph;
        float eu = ez;
        if (!kTauOne) {
          eu = Exp2(dz * c_u);
          pu += eu;
        }
        const float dt = tv[j] - bt;
        const float ev = Exp2(dt * c_u);
        pv += ev;
        if (kDiv == kFkl) {
          pw = ev > 0.0f ? fmaf(ev, dt - (z[j] - partner), pw) : pw;
        } else if (kDiv == kRkl) {
          pw = eu > 0.0f ? fmaf(eu, dz - (tv[j] - partner), pw) : pw;
        }
      }
      sz += pz;
      if (kEntropy) hz += ph;
      if (!kTauOne) su += pu;
      sv += pv;
      if (kDiv != kJsd) w += pw;
    }
  }
  if (kTauOne) su = sz;
  const double ws = kDiv == kFkl ? sv : su;
  // (w back to raw differences: its centre times the weights' sum)
  const double wr = kDiv != kJsd && ws > 0.0 ? fma(centre, ws, w) : 0.0;
  return {bz, bt, arg, sz, hz, su, sv, wr};
}

// What the gradient pass needs of a row, set by warp 0 after the merge.
struct DenseRow {
  float mz, mt;      // the maxima of z and t
  float c_u;         // log2e / tau
  float inv_tau;     // 1 / tau
  float cz;          // p_c = 2^((z_c - mz) log2e - cz)
  float cu;          // p^tau_c = 2^((z_c - mz) c_u - cu)
  float cv;          // q_c = 2^((t_c - mt) c_u - cv)
  float lu, lv;      // log su, log sv (JSD's log P, log Q)
  float a_ce;        // s alpha
  float a_kd;        // s (1 - alpha) / tau
  float cp, cp_ce;   // forward KL: a_kd sum q / sum p (cp_ce: + a_ce, tau 1)
  float a_rkl;       // reverse KL: a_kd / tau
  float k_hi, k_lo;  // reverse KL: sum p (z - t) / sum p as a pair
  float gbar;        // JSD: sum h / sum P
  float gy;          // the target's gradient (its cross-entropy part)
  float logp;
  float s;
  bool valid;
  // The record's: D (JSD's after the second exchange), lse, entropy, argmax.
  double distill;
  float lse;
  float entropy;
  int arg;
};

// The row's record as the row kernel writes it (an ignored row: its lse,
// entropy and argmax alone).
__device__ __forceinline__ void WriteRecord(const DenseRow& r, float alpha,
                                            bool correct,
                                            PostTrainingCudaRow* out) {
  const double ce = alpha > 0.0f ? alpha * -static_cast<double>(r.logp) : 0.0;
  const int flags =
      r.valid ? kPostTrainingRowValid | (correct ? kPostTrainingRowCorrect : 0)
              : 0;
  *out = {r.valid ? ce + (1.0 - alpha) * r.distill : 0.0,
          r.valid ? r.distill : 0.0,
          0.0,
          0.0,
          0.0,
          r.entropy,
          r.lse,
          r.logp,
          r.arg,
          flags,
          0.0};
}

// The row's constants from its merged statistics (`zy` the target's z).
template <int kDiv, bool kTauOne>
__device__ __forceinline__ DenseRow MakeDenseRow(const DenseStats& rs,
                                                 const DistillationArgs& kd,
                                                 float zy, bool has_target,
                                                 bool valid, float s, float c_u,
                                                 float inv_tau) {
  const double inv_tau_d = 1.0 / static_cast<double>(kd.temperature);
  const double lz = log(rs.sz);
  const double lu = kTauOne ? lz : log(rs.su);
  const double lv = log(rs.sv);
  DenseRow r;
  r.mz = rs.mz;
  r.mt = rs.mt;
  r.c_u = c_u;
  r.inv_tau = inv_tau;
  r.cz = static_cast<float>(lz * kLog2eD);
  r.cu = kTauOne ? r.cz : static_cast<float>(lu * kLog2eD);
  r.cv = static_cast<float>(lv * kLog2eD);
  r.lu = static_cast<float>(lu);
  r.lv = static_cast<float>(lv);
  r.valid = valid;
  r.s = s;
  r.a_ce = s * kd.alpha;
  r.a_kd = s * (1.0f - kd.alpha) * inv_tau;
  r.logp = has_target && valid ? (zy - rs.mz) - static_cast<float>(lz) : 0.0f;
  r.gy = r.a_ce * expm1f(r.logp);
  r.lse = static_cast<float>(rs.mz + lz);
  r.entropy = static_cast<float>(lz - rs.hz / rs.sz);
  // (a row of -inf raises no max: its argmax is column 0, as on the CPU)
  r.arg = rs.arg == INT_MAX ? 0 : rs.arg;
  r.cp = r.cp_ce = r.a_rkl = r.k_hi = r.k_lo = r.gbar = 0.0f;
  // lse(u) - lse(v)
  const double gap =
      (static_cast<double>(rs.mz) - rs.mt) * inv_tau_d + (lu - lv);
  double distill = 0.0;
  if (kDiv == kFkl) {
    distill = rs.sv > 0.0 ? rs.w / rs.sv * inv_tau_d + gap : 0.0;
    // sum q / sum p over the p and q as the gradient computes them
    const double sum_p = rs.su * exp2(-static_cast<double>(r.cu));
    const double sum_q = rs.sv * exp2(-static_cast<double>(r.cv));
    const float ratio = sum_p > 0.0 ? static_cast<float>(sum_q / sum_p) : 0.0f;
    r.cp = r.a_kd * ratio;
    r.cp_ce = kTauOne ? r.cp + r.a_ce : r.cp;
  } else if (kDiv == kRkl) {
    const double k = rs.su > 0.0 ? rs.w / rs.su : 0.0;
    r.k_hi = static_cast<float>(k);
    r.k_lo = static_cast<float>(k - r.k_hi);
    r.a_rkl = r.a_kd * inv_tau;
    distill = rs.su > 0.0 ? k * inv_tau_d - gap : 0.0;
  }
  // A side of no mass has no distribution (JSD's D is added to this after
  // its exchange); such a row's factors are NaN, and so is its gradient.
  if (!(rs.su > 0.0 && rs.sv > 0.0)) distill = NAN;
  r.distill = distill;
  if (DistillationGradientIsNan(kDiv == kRkl, distill)) {
    r.a_ce = r.a_kd = r.cp = r.cp_ce = r.a_rkl = r.gy = NAN;
  }
  return r;
}

// JSD's terms of one class from log P and log Q on the special-function
// unit (DivergenceTerm's d and h, and P): P and Q by ex2, log M by one lg2 of
// M = (1 - beta) P + beta Q (lg2's ~2^-22 absolute error near M ~ 1, relative
// below, where P and Q weigh as little), so that log P - log M and log Q -
// log M carry no rounding of either log's size; three SFU operations a class
// (the accurate expf and logf of the row kernel cost ~20 instructions).
struct JsdParts {
  float p;
  float d;
  float h;
};
__device__ __forceinline__ JsdParts JsdTerm(float beta, float log_p,
                                            float log_q) {
  constexpr float kLn2 = 0.6931471805599453f;
  // (the least normal float: an M flushed to 0 would make lg2 -inf where P
  // or Q is not 0)
  constexpr float kLeastNormal = 1.17549435e-38f;
  const float p = Exp2(log_p * kLog2e);
  const float q = Exp2(log_q * kLog2e);
  const float m = fmaxf(fmaf(beta, q, (1.0f - beta) * p), kLeastNormal);
  float lm;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(lm) : "f"(m));
  lm *= kLn2;
  // (a class of mass 0, log -inf: its term is 0, no 0 * inf)
  const float pm = p > 0.0f ? p * (log_p - lm) : 0.0f;
  const float qm = q > 0.0f ? q * (log_q - lm) : 0.0f;
  return {p, fmaf(beta, qm, (1.0f - beta) * pm), (1.0f - beta) * pm};
}

// JSD's log P and log Q of a class.
__device__ __forceinline__ JsdParts JsdOf(const DenseRow& r, float beta,
                                          float z, float t) {
  return JsdTerm(beta, fmaf(z - r.mz, r.inv_tau, -r.lu),
                 fmaf(t - r.mt, r.inv_tau, -r.lv));
}

// Element c's gradient from z_c, t_c: the divergence's part (forward KL
// a_kd (p ratio - q); reverse KL a_kd / tau p ((z - t) - k); JSD a_kd (h - P
// gbar)) plus, with `ce`, the cross entropy's a_ce p (at tau 1 the same p).
template <int kDiv, bool kTauOne>
__device__ __forceinline__ float DenseGrad(const DenseRow& r, float beta,
                                           float z, float t, bool ce) {
  const float dz = z - r.mz;
  float g;
  float p_ce = 0.0f;  // softmax(z)_c where this divergence has it (tau 1)
  if (kDiv == kFkl) {
    const float p = Exp2(fmaf(dz, r.c_u, -r.cu));
    const float q = Exp2(fmaf(t - r.mt, r.c_u, -r.cv));
    if (kTauOne) return fmaf(p, ce ? r.cp_ce : r.cp, -r.a_kd * q);
    g = fmaf(p, r.cp, -r.a_kd * q);
  } else if (kDiv == kRkl) {
    const float p = Exp2(fmaf(dz, r.c_u, -r.cu));
    // z - t as an exact pair (two-sum): d cancels to a few units where the
    // student is sharp, and z - t rounded alone moved it by up to 2^-24 |z -
    // t| (an fp32 student's gradient off by 3e-4 of itself on the GPU).
    const float s = __fsub_rn(z, t);
    const float zs = __fadd_rn(s, t);
    const float ts = __fsub_rn(zs, s);
    const float e = __fadd_rn(__fsub_rn(z, zs), __fsub_rn(ts, t));
    const float d = __fadd_rn(__fsub_rn(s, r.k_hi), __fsub_rn(e, r.k_lo));
    // (a class of mass 0: its term is 0, no 0 * inf)
    g = r.a_rkl * (p > 0.0f ? p * d : 0.0f);
    p_ce = p;
  } else {
    const JsdParts j = JsdOf(r, beta, z, t);
    g = r.a_kd * fmaf(-j.p, r.gbar, j.h);
    p_ce = j.p;
  }
  if (!ce) return g;
  if (!kTauOne) p_ce = Exp2(fmaf(dz, kLog2e, -r.cz));
  return fmaf(r.a_ce, p_ce, g);
}

struct KernelArgs {
  DenseKdPieces call;
  float inv_tau;
  float c_u;        // log2e / tau
  long long ahead;  // items ahead whose pieces go to L2
  int batches;      // chunk barriers a piece
};

template <typename T, typename TT, int kDiv, bool kTauOne, bool kEntropy>
__global__ void __launch_bounds__(kBlock, 4)
    DenseKdKernel(const KernelArgs ka) {
  using Tr = Traits<T>;
  constexpr int kVec = Tr::kVec;
  constexpr int kTeacherVecBytes = kVec * static_cast<int>(sizeof(TT));
  const DenseKdPieces& a = ka.call;
  extern __shared__ uint4 kept[];  // student piece, then teacher piece
  __shared__ DenseStats scratch[kWarps];
  __shared__ double sums[kWarps][3];
  __shared__ unsigned long long landed[kMaxBatches];
  __shared__ long long item_s;
  __shared__ DenseRow row_s;
  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int per_row = a.pieces;
  const int vocab = static_cast<int>(a.base.vocab);
  const bool targets64 = a.base.targets_dtype == DType::kInt64;
  const double inv_tau_d = 1.0 / static_cast<double>(a.kd.temperature);
  auto* counter = static_cast<unsigned long long*>(a.workspace);
  auto* slots = reinterpret_cast<DenseSlot*>(static_cast<char*>(a.workspace) +
                                             kCounterBytes);
  auto* sums_slots = reinterpret_cast<SumsSlot*>(slots + a.base.rows * per_row);
  const long long total = a.base.rows * per_row;
  uint4* const teacher_kept = reinterpret_cast<uint4*>(
      reinterpret_cast<char*>(kept) + static_cast<size_t>(a.chunk) * sizeof(T));
  unsigned parity = 0;
  constexpr unsigned kBatchBytes = kBatchVectors * 16;
  constexpr unsigned kTeacherBatchBytes =
      kBatchVectors * static_cast<unsigned>(kTeacherVecBytes);
  if (tid == 0) {
    for (int c = 0; c < ka.batches; ++c) MbarInit(&landed[c], 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
#pragma unroll 1
  for (;;) {
    if (tid == 0) {
      const long long k = static_cast<long long>(atomicAdd(counter, 1ull));
      item_s = k;
      if (k < total) {
        // Both slices into shared memory by the TMA unit, batch by batch
        // (an empty batch only completes its barrier's phase).
        const long long r = k / per_row;
        const int start = static_cast<int>(k - r * per_row) * a.chunk;
        const int n = max(0, min(a.chunk, vocab - start));
        const char* zs = static_cast<const char*>(a.base.logits) +
                         (r * a.base.row_stride + start) * sizeof(T);
        const char* ts = static_cast<const char*>(a.kd.teacher_logits) +
                         (r * a.kd.teacher_row_stride + start) * sizeof(TT);
        const unsigned bytes = static_cast<unsigned>(n) * sizeof(T);
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        for (int c = 0; c < ka.batches; ++c) {
          const unsigned off = c * kBatchBytes;
          const unsigned len = off < bytes ? min(kBatchBytes, bytes - off) : 0;
          const unsigned tlen = len / sizeof(T) * sizeof(TT);
          const unsigned toff = c * kTeacherBatchBytes;
          MbarExpectTx(&landed[c], len + tlen);
          if (len > 0) {
            BulkLoad(reinterpret_cast<char*>(kept) + off, zs + off, len,
                     &landed[c]);
            BulkLoad(reinterpret_cast<char*>(teacher_kept) + toff, ts + toff,
                     tlen, &landed[c]);
          }
        }
      }
    }
    __syncthreads();
    const long long k = item_s;
    if (k >= total) break;
    if (ka.ahead > 0 && tid == kBlock - 32 && k + ka.ahead < total) {
      // (the last warp: off warp 0's publish and merge)
      const long long kn = k + ka.ahead;
      const long long rn = kn / per_row;
      const int sn = static_cast<int>(kn - rn * per_row) * a.chunk;
      const int nn = max(0, min(a.chunk, vocab - sn));
      if (nn > 0) {
        BulkPrefetchL2(
            static_cast<const T*>(a.base.logits) + rn * a.base.row_stride + sn,
            static_cast<unsigned>(nn * sizeof(T)));
        BulkPrefetchL2(static_cast<const TT*>(a.kd.teacher_logits) +
                           rn * a.kd.teacher_row_stride + sn,
                       static_cast<unsigned>(nn * sizeof(TT)));
      }
    }
    const long long row = k / per_row;
    const int piece = static_cast<int>(k - row * per_row);
    const int start = piece * a.chunk;
    const int n = max(0, min(a.chunk, vocab - start));
    const int nvec = n / kVec;
    const bool has_target = a.base.targets != nullptr;
    const long long y =
        has_target
            ? (targets64 ? static_cast<const long long*>(a.base.targets)[row]
                         : static_cast<const int*>(a.base.targets)[row])
            : -1;
    const bool valid = !has_target || y != a.base.options.ignore_index;

    {
      const DenseStats st = PieceStats<T, TT, kDiv, kTauOne, kEntropy>(
          kept, teacher_kept, nvec, start, tid, landed, parity, ka.c_u);
      const DenseStats w = WarpMergeDense<kDiv>(st, inv_tau_d);
      if (lane == 0) scratch[warp] = w;
    }
    // The piece whose slot carries the target's z (and whose block writes
    // the row's record): piece 0 without a target.
    const int y_piece = has_target && valid ? static_cast<int>(y / a.chunk) : 0;
    const bool owner = y_piece == piece;
    __syncthreads();
    if (warp == 0) {
      const DenseStats ps = WarpMergeDense<kDiv>(
          lane < kWarps ? scratch[lane] : EmptyDense(), inv_tau_d);
      DenseSlot* const row_slots = slots + (k - piece);
      if (lane == 0) {
        const bool holds_y = has_target && valid && y >= start && y < start + n;
        if (holds_y)
          MbarWait(&landed[(y - start) / (kBatchVectors * kVec)], parity);
        DenseSlot* const mine = row_slots + piece;
        mine->st = ps;
        mine->zy =
            holds_y ? Tr::Load(reinterpret_cast<const T*>(kept) + (y - start))
                    : 0.0f;
        __threadfence();
        StoreRelease(&mine->tag, 1u);
      }
      // Every lane waits for its piece's slot, then the warp merges them in
      // lane order: every piece of the row gets the same bits.
      DenseStats rs = EmptyDense();
      float zy_lane = 0.0f;
      if (lane < per_row) {
        DenseSlot* const s = row_slots + lane;
        while (LoadAcquireU(&s->tag) == 0u) __nanosleep(32);
        rs.mz = __ldcg(&s->st.mz);
        rs.mt = __ldcg(&s->st.mt);
        rs.arg = __ldcg(&s->st.arg);
        rs.sz = __ldcg(&s->st.sz);
        rs.hz = __ldcg(&s->st.hz);
        rs.su = __ldcg(&s->st.su);
        rs.sv = __ldcg(&s->st.sv);
        rs.w = __ldcg(&s->st.w);
        zy_lane = __ldcg(&s->zy);
      }
      rs = WarpMergeDense<kDiv>(rs, inv_tau_d);
      const float zy = __shfl_sync(0xffffffffu, zy_lane, y_piece);
      if (lane == 0) {
        row_s = MakeDenseRow<kDiv, kTauOne>(rs, a.kd, zy, has_target, valid,
                                            valid ? a.row_scale[row] : 0.0f,
                                            ka.c_u, ka.inv_tau);
        if (!kEntropy) row_s.entropy = 0.0f;  // (not summed: no one reads it)
      }
    }
    __syncthreads();
    const uint4* const tkept = teacher_kept;
    if (kDiv == kJsd && valid) {
      // JSD's log M needs both lse: its sums in a pass of their own, merged
      // through a second exchange (every piece of the row has published its
      // first slot, so none waits on a block that is not running).
      const DenseRow r = row_s;
      double dsum = 0.0, hsum = 0.0, psum = 0.0;
#pragma unroll 1
      for (int q = tid; q < nvec; q += kBlock) {
        const uint4 zv = kept[q];
        float tv[kVec];
        TeacherValues<T, TT>(tkept, q, tv);
        float pd = 0.0f, ph = 0.0f, pp = 0.0f;
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          const JsdParts t = JsdOf(r, a.kd.beta, Tr::Get(zv, j), tv[j]);
          pd += t.d;
          ph += t.h;
          pp += t.p;
        }
        dsum += pd;
        hsum += ph;
        psum += pp;
      }
      WarpSum3(&dsum, &hsum, &psum);
      if (lane == 0) {
        sums[warp][0] = dsum;
        sums[warp][1] = hsum;
        sums[warp][2] = psum;
      }
      __syncthreads();
      if (warp == 0) {
        double d = 0.0, h = 0.0, p = 0.0;
        if (lane == 0) {
          for (int w = 0; w < kWarps; ++w) {
            d += sums[w][0];
            h += sums[w][1];
            p += sums[w][2];
          }
          SumsSlot* const mine = sums_slots + k;
          mine->d = d;
          mine->h = h;
          mine->p = p;
          __threadfence();
          StoreRelease(&mine->tag, 1u);
        }
        d = h = p = 0.0;
        if (lane < per_row) {
          SumsSlot* const s = sums_slots + (k - piece) + lane;
          while (LoadAcquireU(&s->tag) == 0u) __nanosleep(32);
          d = __ldcg(&s->d);
          h = __ldcg(&s->h);
          p = __ldcg(&s->p);
        }
        WarpSum3(&d, &h, &p);
        if (lane == 0) {
          row_s.gbar = p > 0.0 ? static_cast<float>(h / p) : 0.0f;
          row_s.distill += d;
        }
      }
      __syncthreads();
    }
    if (owner && tid == 0) {
      WriteRecord(row_s, a.kd.alpha, has_target && row_s.arg == y,
                  a.rows_out + row);
    }
    T* const out = a.gradient ? static_cast<T*>(a.base.gradient) +
                                    row * a.base.row_stride + start
                              : nullptr;
    if (!a.gradient) {
      // (forward only: the record above is the piece's whole output)
    } else if (!valid) {
      ZeroSlice<T, kBlock>(out, nvec, tid);
    } else {
      const DenseRow r = row_s;
      const float beta = a.kd.beta;
      const bool ce_on = a.kd.alpha > 0.0f;
#pragma unroll 2
      for (int q = tid; q < nvec; q += kBlock) {
        const uint4 zv = kept[q];
        float tv[kVec];
        TeacherValues<T, TT>(tkept, q, tv);
        float g[kVec];
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          g[j] =
              DenseGrad<kDiv, kTauOne>(r, beta, Tr::Get(zv, j), tv[j], ce_on);
        }
        StoreGradVector<T>(out, q, g);
      }
      // The target column, its p - 1 without cancellation, over what the same
      // thread stored there (program order).
      const long long yl = y - start;
      if (has_target && yl >= 0 && yl < n && (yl / kVec) % kBlock == tid) {
        const float z = Tr::Load(reinterpret_cast<const T*>(kept) + yl);
        float tyv[kVec];
        TeacherValues<T, TT>(tkept, static_cast<int>(yl / kVec), tyv);
        const float kd = DenseGrad<kDiv, kTauOne>(
            r, beta, z, tyv[static_cast<int>(yl % kVec)], false);
        Tr::Store(out + yl, kd + r.gy);
      }
    }
    parity ^= 1u;
    __syncthreads();  // kept, row_s and item_s are rewritten by the next item
  }
}

// A kernel build's facts on one device, asked once rather than on every call:
// the SMs, the opt-in shared memory a block, the largest dynamic shared
// memory set on the build so far, and its blocks a SM at the last size asked.
struct KernelFit {
  bool known = false;
  int sms = 0;
  int smem_max = 0;
  int smem_set = 0;
  int smem = -1;
  int per_sm = 0;
};
constexpr int kCachedDevices = 64;

// The KernelFit of the build DenseKdKernel<T, TT, kDiv, kTauOne, kEntropy> for
// `smem` bytes of dynamic shared memory on the current device (smem within the
// device's opt-in less its reserve: the caller checks it against
// fit->smem_max first, through `smem` 0). One cache a build: the statics are
// the template's, so each build sets its own shared-memory attribute.
template <typename T, typename TT, int kDiv, bool kTauOne, bool kEntropy>
cudaError_t FitKernel(int smem, KernelFit* out) {
  const auto kernel = DenseKdKernel<T, TT, kDiv, kTauOne, kEntropy>;
  static std::mutex mu;
  static KernelFit fits[kCachedDevices];
  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) return e;
  std::lock_guard<std::mutex> lock(mu);
  KernelFit uncached;
  KernelFit& fit =
      device >= 0 && device < kCachedDevices ? fits[device] : uncached;
  if (!fit.known) {
    e = cudaDeviceGetAttribute(&fit.sms, cudaDevAttrMultiProcessorCount,
                               device);
    if (e == cudaSuccess) {
      e = cudaDeviceGetAttribute(
          &fit.smem_max, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    }
    if (e != cudaSuccess) return e;
    fit.known = true;
  }
  if (smem > fit.smem_set) {
    e = cudaFuncSetAttribute(kernel,
                             cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) return e;
    fit.smem_set = smem;
  }
  if (smem > 0 && smem != fit.smem) {
    e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit.per_sm, kernel,
                                                      kBlock, smem);
    if (e != cudaSuccess) return e;
    fit.smem = smem;
  }
  *out = fit;
  return cudaSuccess;
}

template <typename T, typename TT, int kDiv, bool kTauOne, bool kEntropy>
cudaError_t Launch(const DenseKdPieces& call, cudaStream_t stream) {
  const auto kernel = DenseKdKernel<T, TT, kDiv, kTauOne, kEntropy>;
  const int smem = call.chunk * static_cast<int>(sizeof(T)) +
                   call.chunk * static_cast<int>(sizeof(TT));
  constexpr long long kBatchElems =
      static_cast<long long>(kBatchVectors) * Traits<T>::kVec;
  const int batches =
      static_cast<int>((call.chunk + kBatchElems - 1) / kBatchElems);
  if (batches > kMaxBatches || call.pieces > 32 || call.chunk % 8 != 0) {
    return cudaErrorInvalidConfiguration;
  }
  KernelFit fit;
  cudaError_t e = FitKernel<T, TT, kDiv, kTauOne, kEntropy>(0, &fit);
  if (e != cudaSuccess) return e;
  if (smem > fit.smem_max - 1024) return cudaErrorInvalidConfiguration;
  e = FitKernel<T, TT, kDiv, kTauOne, kEntropy>(smem, &fit);
  if (e != cudaSuccess) return e;
  const int sms = fit.sms;
  const int per_sm = fit.per_sm;
  if (per_sm <= 0 || static_cast<long long>(sms) * per_sm < call.pieces) {
    return cudaErrorInvalidConfiguration;
  }
  const int pieces = call.pieces;
  const size_t used = kCounterBytes + (sizeof(DenseSlot) + sizeof(SumsSlot)) *
                                          static_cast<size_t>(call.base.rows) *
                                          pieces;
  e = cudaMemsetAsync(call.workspace, 0, used, stream);
  if (e != cudaSuccess) return e;
  KernelArgs ka;
  ka.call = call;
  ka.inv_tau = 1.0f / call.kd.temperature;
  ka.c_u = kLog2e / call.kd.temperature;
  // The next pieces about 256 KiB ahead into L2 (smem row pieces' prefetch)
  ka.ahead = per_sm >= 2 ? std::max(1, 256 * 1024 / smem) : 0;
  ka.batches = batches;
  kernel<<<static_cast<unsigned>(sms * per_sm), kBlock, smem, stream>>>(ka);
  return cudaGetLastError();
}

// One build per divergence, for tau 1 (u = z: its sums and p are z's) and
// with or without the entropy, so that no branch of another stays in the
// loops.
template <typename T, typename TT, int kDiv, bool kTauOne>
cudaError_t LaunchWithEntropy(const DenseKdPieces& call, cudaStream_t stream) {
  return call.entropy ? Launch<T, TT, kDiv, kTauOne, true>(call, stream)
                      : Launch<T, TT, kDiv, kTauOne, false>(call, stream);
}
template <typename T, typename TT, int kDiv>
cudaError_t LaunchAtTau(const DenseKdPieces& call, cudaStream_t stream) {
  return call.kd.temperature == 1.0f
             ? LaunchWithEntropy<T, TT, kDiv, true>(call, stream)
             : LaunchWithEntropy<T, TT, kDiv, false>(call, stream);
}
template <typename T, typename TT>
cudaError_t LaunchFor(const DenseKdPieces& call, cudaStream_t stream) {
  switch (call.divergence) {
    case kFkl:
      return LaunchAtTau<T, TT, kFkl>(call, stream);
    case kRkl:
      return LaunchAtTau<T, TT, kRkl>(call, stream);
    case kJsd:
      return LaunchAtTau<T, TT, kJsd>(call, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace

size_t DenseKdWorkspaceBytes(long long rows, int pieces) {
  return kCounterBytes + (sizeof(DenseSlot) + sizeof(SumsSlot)) *
                             static_cast<size_t>(rows) * pieces;
}

cudaError_t LaunchDenseKdPieces(const DenseKdPieces& call,
                                cudaStream_t stream) {
  if (call.base.rows <= 0) return cudaSuccess;
  return WithElementType(call.base.logits_dtype, [&](auto student) {
    return WithElementType(call.kd.teacher_dtype, [&](auto teacher) {
      return LaunchFor<decltype(student), decltype(teacher)>(call, stream);
    });
  });
}

}  // namespace cuda_ce
}  // namespace lossd
