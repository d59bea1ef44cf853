// A block's loops over a slice of a row: its statistics (online max and
// sum-exp over batches of 16-byte vectors), its gradient and its zeros.

#ifndef LOSSD_KERNELS_CUDA_SLICE_STATS_CUH_
#define LOSSD_KERNELS_CUDA_SLICE_STATS_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <type_traits>

#include "kernels/cuda/element_traits.cuh"
#include "kernels/cuda/ptx.cuh"
#include "kernels/cuda/row_math.cuh"

namespace lossd {
namespace cuda_ce {

// 16-byte vectors per thread per batch: the loads one thread keeps in flight
// (twice that with the next batch prefetched).
constexpr int kU = 4;

// Largest element of kU vectors (max of z; NaN loses as in fmaxf): the halves
// compare packed pairs, half the instructions of unpacking first.
template <typename T>
__device__ __forceinline__ float BatchMax(const uint4 (&v)[kU]);
template <>
__device__ __forceinline__ float BatchMax<float>(const uint4 (&v)[kU]) {
  float m = -INFINITY;
#pragma unroll
  for (int u = 0; u < kU; ++u) {
    m = fmaxf(m,
              fmaxf(fmaxf(__uint_as_float(v[u].x), __uint_as_float(v[u].y)),
                    fmaxf(__uint_as_float(v[u].z), __uint_as_float(v[u].w))));
  }
  return m;
}
template <typename H2>
__device__ __forceinline__ H2 AsPair(unsigned w) {
  return *reinterpret_cast<const H2*>(&w);
}
template <typename H2>
__device__ __forceinline__ H2 PairMax(const uint4 (&v)[kU]) {
  H2 m = __hmax2(__hmax2(AsPair<H2>(v[0].x), AsPair<H2>(v[0].y)),
                 __hmax2(AsPair<H2>(v[0].z), AsPair<H2>(v[0].w)));
#pragma unroll
  for (int u = 1; u < kU; ++u) {
    m = __hmax2(m, __hmax2(__hmax2(AsPair<H2>(v[u].x), AsPair<H2>(v[u].y)),
                           __hmax2(AsPair<H2>(v[u].z), AsPair<H2>(v[u].w))));
  }
  return m;
}
template <>
__device__ __forceinline__ float BatchMax<__nv_bfloat16>(const uint4 (&v)[kU]) {
  const __nv_bfloat162 m = PairMax<__nv_bfloat162>(v);
  return fmaxf(__low2float(m), __high2float(m));
}
template <>
__device__ __forceinline__ float BatchMax<__half>(const uint4 (&v)[kU]) {
  const __half2 m = PairMax<__half2>(v);
  return fmaxf(__low2float(m), __high2float(m));
}

// This thread's statistics of a slice of `n` elements (a multiple of the
// vector width) at `s` (shared or global memory), columns from `col0`: online
// max and sum of 2^((z - shift) * log2e - m_l2) over batches of kU vectors,
// the first argmax found afterwards in the batch that set the max. kPrefetch
// (global memory): the next batch's loads are issued before this one's
// arithmetic. kHint: global loads carry the L2 eviction policy `policy`.
// `keep` (not null): every vector read is also stored there, at its index
// (smem row pieces keep their piece in shared memory), and the p_y -> 1 pass
// below reads it from there. kOpts: z is the softcapped logit and the sum of
// w_c z_c is kept for label smoothing (`opts`); the argmax is the first
// index of the max of z (the softcap saturates: logits that differ can share
// a z).
//
// `tau` (a TauSum, not NoTau): the same loop also sums 2^((z - m) tau_l2)
// (tau_l2 = log2e / temperature: softmax(z / tau)'s sum about the thread's
// max m, whose max is m / tau) into tau->sum, for a loss that needs both
// lse(z) and lse(z / tau); one more FFMA, MUFU and FADD an element.
struct NoWait {
  __device__ void operator()(int) const {}
};
struct NoTau {};
struct TauSum {
  float tau_l2;  // in: log2e / temperature
  float sum;     // out: sum_c exp((z_c - m) / temperature), 0 if m = -inf
};
template <typename T, int kBlock, bool kPrefetch = false, bool kHint = false,
          int kOpts = 0, typename Wait = NoWait, typename Tau = NoTau>
__device__ __forceinline__ Stats
SliceStats(const T* s, int n, int col0, int tid, unsigned long long policy = 0,
           uint4* keep = nullptr, const Wait& wait = Wait(),
           const ElementOptions& opts = {}, Tau* tau = nullptr) {
  constexpr bool kTau = std::is_same<Tau, TauSum>::value;
  using Tr = Traits<T>;
  constexpr int kVec = Tr::kVec;
  const uint4* sv = reinterpret_cast<const uint4*>(s);
  const int nvec = n / kVec;
  float m = -INFINITY;
  float m_raw = -INFINITY;  // the max of the logits (kOpts: before the cap)
  float shift = 0.0f;       // ExponentShift(m)
  float m_l2 = 0.0f;
  float wz = 0.0f;
  int arg_q = 0;
  int arg = INT_MAX;  // kPrefetch: the first argmax, found in the loop
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  // kTau: the sum of 2^((z - shift) tau_l2 - mt), mt = fl((m - shift)
  // tau_l2), in two chains.
  float acc_tau[2] = {0.0f, 0.0f};
  float mt = 0.0f;
  uint4 ninf;
  {
    float f[kVec];
#pragma unroll
    for (int j = 0; j < kVec; ++j) f[j] = -INFINITY;
    Tr::Pack(f, &ninf);
  }
  const auto get = [&](const uint4* a) {
    return kHint ? LoadWithPolicy(a, policy) : *a;
  };
  const auto load = [&](int q0, uint4(&v)[kU]) {
    if (q0 + (kU - 1) * kBlock < nvec) {  // a whole batch (the usual case)
#pragma unroll
      for (int u = 0; u < kU; ++u) v[u] = get(sv + q0 + u * kBlock);
    } else {
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int q = q0 + u * kBlock;
        v[u] = q < nvec ? get(sv + q) : ninf;
      }
    }
  };
  // z of element j of a vector (kOpts: the softcap; plain: the logit).
  const auto zof = [&](const uint4& v, int j) {
    return OptionZ<T, kOpts>(opts, Tr::Get(v, j));
  };
  uint4 ahead[kU];
  if (kPrefetch) load(tid, ahead);
#pragma unroll 1
  for (int q0 = tid; q0 < nvec; q0 += kU * kBlock) {
    uint4 v[kU];
    wait(q0);  // (shared memory filled by bulk copies: this batch has landed)
    if (kPrefetch) {
#pragma unroll
      for (int u = 0; u < kU; ++u) v[u] = ahead[u];
      if (q0 + kU * kBlock < nvec) load(q0 + kU * kBlock, ahead);
    } else {
      load(q0, v);
    }
    if (keep != nullptr) {
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int q = q0 + u * kBlock;
        if (q < nvec) keep[q] = v[u];
      }
    }
    // The batch's max: of the logits (packed compares), then through the
    // softcap for kOpts, which is monotone (a later batch whose logits are
    // larger but whose z is not keeps the earlier first argmax).
    const float bmx = BatchMax<T>(v);
    if (bmx > (kOpts ? m_raw : m)) {
      if (kOpts) m_raw = bmx;
      const float bm = OptionZ<T, kOpts>(opts, bmx);
      if (bm > m) {
        if constexpr (kTau) {
          const float ft = m > -INFINITY ? Exp2((m - bm) * tau->tau_l2) : 0.0f;
          acc_tau[0] *= ft;
          acc_tau[1] *= ft;
        }
        const float f = RaiseMax(bm, &m, &shift, &m_l2);
        if constexpr (kTau) mt = __fmul_rn(m - shift, tau->tau_l2);
#pragma unroll
        for (int a = 0; a < 4; ++a) acc[a] *= f;
        arg_q = q0;
        if (kPrefetch) {
          // The first argmax now, from registers: a re-read after the loop
          // would wait for global memory at the block's end.
          arg = INT_MAX;
#pragma unroll
          for (int u = kU - 1; u >= 0; --u)
#pragma unroll
            for (int j = kVec - 1; j >= 0; --j)
              if (zof(v[u], j) == bm) arg = col0 + (q0 + u * kBlock) * kVec + j;
        }
      }
    }
    // Four independent sums: the adds' latency is not one chain.
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      // (kOpts: the padding past nvec stays -inf, which a softcap would
      // make -c, a term of the sum)
      const bool in = !kOpts || q0 + u * kBlock < nvec;
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const float zj = in ? zof(v[u], j) : -INFINITY;
        acc[(u * kVec + j) % 4] += Exp2(fmaf(zj - shift, kLog2e, -m_l2));
        if constexpr (kTau) {
          acc_tau[j % 2] += Exp2(fmaf(zj - shift, tau->tau_l2, -mt));
        }
        if ((kOpts & kOptSmoothing) && in) {
          wz = fmaf(
              OptionWeight<kOpts>(opts, col0 + (q0 + u * kBlock) * kVec + j),
              zj, wz);
        }
      }
    }
  }
  if constexpr (kTau) {
    // 2^-lo restores the digits of (m - shift) tau_l2 that mt dropped.
    const float lo = fmaf(m - shift, tau->tau_l2, -mt);
    tau->sum = m == -INFINITY ? 0.0f
                              : (acc_tau[0] + acc_tau[1]) *
                                    (isfinite(lo) ? exp2f(-lo) : 1.0f);
  }
  Stats st;
  st.m = m;
  st.sum_wz = wz;
  st.arg = kPrefetch ? arg : INT_MAX;
  if (m == -INFINITY) {
    // Empty, or NaN (never the max) and -inf only: the NaN stays in the sum.
    const float sum = (acc[0] + acc[1]) + (acc[2] + acc[3]);
    st.t = isnan(sum) ? sum : -1.0f;
  } else {
#pragma unroll 1
    for (int u = kU - 1; u >= 0 && !kPrefetch; --u) {
      const int q = arg_q + u * kBlock;
      if (q >= nvec) continue;
      const uint4 v = sv[q];
#pragma unroll
      for (int j = kVec - 1; j >= 0; --j)
        if (zof(v, j) == m) st.arg = col0 + q * kVec + j;
    }
    const float lo =
        shift == 0.0f && isfinite(m_l2) ? fmaf(m, kLog2e, -m_l2) : 0.0f;
    const float corr = exp2f(-lo);
    st.t = ((acc[0] + acc[1]) + (acc[2] + acc[3])) * corr - 1.0f;
    if (st.t < 0.0625f) {
      // This thread's max dominates its elements: 1 + t kept only t's high
      // digits, which p_max - 1 needs (p_y -> 1). Sum the others alone, from
      // shared memory; then no merge above cancels, and the row needs no
      // second exchange (cluster stream rows have one).
      float t = 0.0f;
#pragma unroll 1
      for (int q = tid; q < nvec; q += kBlock) {
        const uint4 v = keep != nullptr ? keep[q] : sv[q];
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          const float e = Exp2(fmaf(zof(v, j) - shift, kLog2e, -m_l2));
          t += col0 + q * kVec + j == st.arg ? 0.0f : e;
        }
      }
      st.t = t * corr;
    }
  }
  return st;
}

// The gradient of one element from its logit x at column c (before the
// target's fix-up): kOpts with the softcap's factor and label smoothing's w_c
// (OtherGrad, which also keeps the digits where smoothing cancels).
template <typename T, int kOpts>
__device__ __forceinline__ float ElementGrad(const RowMath& rm,
                                             const ElementOptions& opts,
                                             float x, int c) {
  if (!kOpts) {
    return fmaf(Exp2(fmaf(x - rm.shift, kLog2e, -rm.lse_l2)), rm.a, rm.b);
  }
  float dfac;
  const float z = OptionZ<T, kOpts>(opts, x, &dfac);
  if (!(kOpts & kOptSmoothing)) {
    return fmaf(Exp2(fmaf(z - rm.shift, kLog2e, -rm.lse_l2)), rm.a, rm.b) *
           dfac;
  }
  return OtherGrad<T, (kOpts & kOptWeights) != 0>(
             rm, z, OptionWeight<kOpts>(opts, c)) *
         dfac;
}

// dz_y with the options: the softcap's factor at the target's logit x_y.
template <typename T, int kOpts>
__device__ __forceinline__ float TargetGrad(const RowMath& rm,
                                            const ElementOptions& opts,
                                            float xy) {
  float dfac;
  OptionZ<T, kOpts>(opts, xy, &dfac);
  return rm.gy * dfac;
}

// f(q, sv[q]) for this thread's vectors of a slice in shared memory (q =
// tid, tid + kBlock, ...), four loop bodies unrolled: the gradient passes.
template <int kBlock, typename F>
__device__ __forceinline__ void ForSliceVectors(const uint4* sv, int nvec,
                                                int tid, F f) {
#pragma unroll 4
  for (int q = tid; q < nvec; q += kBlock) f(q, sv[q]);
}

// The kVec gradient values g into vector q of `out`, a streaming store (the
// gradient is not read again).
template <typename T>
__device__ __forceinline__ void StoreGradVector(
    T* out, int q, const float (&g)[Traits<T>::kVec]) {
  uint4 o;
  Traits<T>::Pack(g, &o);
  __stcs(reinterpret_cast<uint4*>(out) + q, o);
}

// Gradient of this thread's share of a slice (shared memory) into `out`
// with streaming stores, columns from `col0`; the target column is fixed up
// by the caller.
template <typename T, int kBlock, int kOpts = 0>
__device__ __forceinline__ void GradientSlice(const uint4* sv, T* out, int nvec,
                                              int tid, const RowMath& rm,
                                              const ElementOptions& opts = {},
                                              int col0 = 0) {
  using Tr = Traits<T>;
  constexpr int kVec = Tr::kVec;
  ForSliceVectors<kBlock>(sv, nvec, tid, [&](int q, const uint4& v) {
    float gr[kVec];
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      gr[j] =
          ElementGrad<T, kOpts>(rm, opts, Tr::Get(v, j), col0 + q * kVec + j);
    }
    StoreGradVector<T>(out, q, gr);
  });
}

// Zeros for this thread's share of an ignored row's slice (nvec vectors at
// `out`) with streaming stores: the formula would give NaN for non-finite
// logits.
template <typename T, int kBlock>
__device__ __forceinline__ void ZeroSlice(T* out, int nvec, int tid) {
  const float zero[Traits<T>::kVec] = {};
  uint4 zv;
  Traits<T>::Pack(zero, &zv);
#pragma unroll 4
  for (int q = tid; q < nvec; q += kBlock) {
    __stcs(reinterpret_cast<uint4*>(out) + q, zv);
  }
}

// Where piece `piece` of `row` lies: its whole vectors are the n elements
// from column `start` (a 16-byte aligned address; n a multiple of the vector
// width). Without kEdges the row starts aligned and holds whole vectors, and
// the pieces are [piece * chunk, + chunk) of it. With kEdges the whole vectors
// start at column `head` (the first aligned address), the pieces cut them the
// same way, and a piece has `edges` columns besides: the head (piece 0) and
// the columns past the last whole vector (the piece those would fall in).
template <typename T, bool kEdges>
struct PieceSpan {
  static constexpr int kVec = Traits<T>::kVec;
  int start;
  int n;
  int head = 0;  // columns before the first aligned address
  int whole;     // elements in whole vectors from `head`
  int chunk;
  int edges = 0;  // this piece's edge columns
  bool has_head = false;
  __device__ __forceinline__ PieceSpan(const Params& p, long long row,
                                       int piece)
      : chunk(p.chunk) {
    if (kEdges) {
      const auto addr = reinterpret_cast<std::uintptr_t>(
          static_cast<const T*>(p.logits) + row * p.stride);
      const int off = static_cast<int>(addr % 16 / sizeof(T));
      head = min(p.vocab, off == 0 ? 0 : kVec - off);
      whole = (p.vocab - head) / kVec * kVec;
    } else {
      whole = p.vocab;
    }
    const int s = piece * p.chunk;
    start = head + s;
    n = max(0, min(p.chunk, whole - s));
    if (kEdges) {
      has_head = piece == 0 && head > 0;
      const int tail = p.vocab - head - whole;
      const bool has_tail = tail > 0 && piece == whole / p.chunk;
      edges = (has_head ? head : 0) + (has_tail ? tail : 0);
    }
  }
  // The piece of column c: the edges go with their pieces.
  __device__ __forceinline__ int PieceOf(int c) const {
    return c < head ? 0 : min(c - head, whole) / chunk;
  }
  // Column of edge i (i < edges): the head's, then the tail's.
  __device__ __forceinline__ int EdgeColumn(int i) const {
    const int h = has_head ? head : 0;
    return i < h ? i : head + whole + (i - h);
  }
};

// The statistics of one element z at column c, as SliceStats counts it: a
// NaN is never the max but makes the sum NaN, and so does a max of +inf
// (exp(inf - inf)).
__device__ __forceinline__ Stats ElementStats(float z, int c) {
  Stats e = EmptyStats();
  if (isnan(z)) {
    e.t = z;
  } else if (z != -INFINITY) {
    e.m = z;
    e.t = z == INFINITY ? NAN : 0.0f;
    e.arg = c;
  }
  return e;
}
// The same of a logit x at column c in option build kOpts.
template <typename T, int kOpts>
__device__ __forceinline__ Stats ElementStats(const ElementOptions& o, float x,
                                              int c) {
  const float z = OptionZ<T, kOpts>(o, x);
  Stats e = ElementStats(z, c);
  if (kOpts & kOptSmoothing) e.sum_wz = OptionWeight<kOpts>(o, c) * z;
  return e;
}

}  // namespace cuda_ce
}  // namespace lossd

#endif  // LOSSD_KERNELS_CUDA_SLICE_STATS_CUH_
