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

// The statistics of a slice of a row: z's max mz (first argmax arg), sum
// sz = sum exp(z - mz) and wz = sum exp(z - mz) z (the entropy's); u = z /
// tau's sum su = sum exp(u - mz / tau) (its max is mz / tau: the product is
// monotone); the teacher's v = t / tau, max mv and sv = sum exp(v - mv); and
// the divergence's weighted sum in fp64, forward KL w = sum exp(v - mv) (v -
// u), reverse KL w = sum exp(u - mu) (u - v), and ws the sum of those weights
// in fp64 too (w / ws is the mean sum q (v - u) or sum p (u - v), the row
// kernel's WeightedStats: with fp32's sv or su below it, their summation's
// ~1e-6 times a mean of ~50 moved reverse KL's u - v - mean by more than a
// sharp row's gradient allows).
struct DenseStats {
  float mz;
  float sz;
  float wz;
  int arg;
  float su;
  float sv;
  float mv;
  double w;
  double ws;
};
__device__ __forceinline__ DenseStats EmptyDense() {
  return {-INFINITY, 0.0f, 0.0f, INT_MAX, 0.0f, 0.0f, -INFINITY, 0.0, 0.0};
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
// first, then each lane's sums rescaled to it once and added by butterfly,
// which adds the same pair in every lane). kDiv picks w's weights.
__device__ __forceinline__ DenseStats WarpMergeDense(const DenseStats& v,
                                                     float inv_tau, int div) {
  float m = v.mz;
  float mv = v.mv;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    mv = fmaxf(mv, __shfl_xor_sync(0xffffffffu, mv, o));
  }
  DenseStats r;
  r.mz = m;
  // (the first argmax: the least index among the lanes that hold the max)
  r.arg = __reduce_min_sync(0xffffffffu, v.mz == m ? v.arg : INT_MAX);
  r.mv = mv;
  // (accurate expf: one a lane, and a few ulps here are every element's)
  const float fz = v.mz == -INFINITY ? 0.0f : expf(v.mz - m);
  const float fu =
      v.mz == -INFINITY ? 0.0f : expf(v.mz * inv_tau - m * inv_tau);
  const float fv = v.mv == -INFINITY ? 0.0f : expf(v.mv - mv);
  r.sz = v.sz * fz;
  r.wz = v.wz * fz;
  r.su = v.su * fu;
  r.sv = v.sv * fv;
  const double fw = div == kFkl ? fv : div == kRkl ? fu : 0.0;
  r.w = v.w * fw;
  r.ws = v.ws * fw;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    r.sz += __shfl_xor_sync(0xffffffffu, r.sz, o);
    r.wz += __shfl_xor_sync(0xffffffffu, r.wz, o);
    r.su += __shfl_xor_sync(0xffffffffu, r.su, o);
    r.sv += __shfl_xor_sync(0xffffffffu, r.sv, o);
    r.w += __shfl_xor_sync(0xffffffffu, r.w, o);
    r.ws += __shfl_xor_sync(0xffffffffu, r.ws, o);
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

// What the gradient pass needs of a row, set by warp 0 after the merge.
struct DenseRow {
  float mz, cz;  // p_c = 2^((z_c - mz) log2e - cz)
  float mu, cu;  // p^tau_c = 2^((u_c - mu) log2e - cu)
  float mv, cv;  // q_c = 2^((v_c - mv) log2e - cv)
  float lu, lv;  // log su, log sv (JSD's log P, log Q)
  float a_ce;    // s alpha
  float a_kd;    // s (1 - alpha) / tau
  float ratio;   // forward KL: sum q / sum p, as the pass computes them
  float gbar;    // JSD: sum h / sum P
  double k;      // reverse KL: sum p (u - v)
  float gy;      // the target's gradient (its cross-entropy part)
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

// JSD's terms of one class from log P and log Q on the special-function
// unit (DivergenceTerm's d and h, and P): log M = log max(P, Q) + log w, w =
// M / max(P, Q) in [min(beta, 1 - beta), 1] from e^-|log Q - log P|, so that
// log P - log M and log Q - log M carry lg2's ~2^-22 absolute error and no
// rounding of either log's size (the accurate expf and logf of the row
// kernel cost four times the instructions an element).
struct JsdParts {
  float p;
  float d;
  float h;
};
__device__ __forceinline__ JsdParts JsdTerm(float beta, float log_p,
                                            float log_q) {
  constexpr float kLn2 = 0.6931471805599453f;
  const float x = log_q - log_p;
  const bool q_big = x > 0.0f;
  const float e = Exp2(-fabsf(x) * kLog2e);
  const float w =
      q_big ? fmaf(1.0f - beta, e, beta) : fmaf(beta, e, 1.0f - beta);
  float lw;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(lw) : "f"(w));
  lw *= kLn2;
  const float p = Exp2(log_p * kLog2e);
  const float q = Exp2(log_q * kLog2e);
  // (a class of mass 0, log -inf: its term is 0, no 0 * inf)
  const float pm = p > 0.0f ? p * (q_big ? -x - lw : -lw) : 0.0f;
  const float qm = q > 0.0f ? q * (q_big ? -lw : x - lw) : 0.0f;
  return {p, fmaf(beta, qm, (1.0f - beta) * pm), (1.0f - beta) * pm};
}

// The divergence's part of element c's gradient (before a_kd) from u_c, v_c:
// forward KL p ratio - q, reverse KL p (u - v - k) with the difference in
// fp64 (it cancels: bench/NOTES.md, post-training precision), JSD h - P gbar.
__device__ __forceinline__ float KdTerm(const DenseRow& r, int div, float beta,
                                        float u, float v) {
  if (div == kFkl) {
    const float p = Exp2(fmaf(u - r.mu, kLog2e, -r.cu));
    const float q = Exp2(fmaf(v - r.mv, kLog2e, -r.cv));
    return fmaf(p, r.ratio, -q);
  }
  if (div == kRkl) {
    const float p = Exp2(fmaf(u - r.mu, kLog2e, -r.cu));
    return p > 0.0f ? p * static_cast<float>(static_cast<double>(u) -
                                             static_cast<double>(v) - r.k)
                    : 0.0f;
  }
  const JsdParts j = JsdTerm(beta, (u - r.mu) - r.lu, (v - r.mv) - r.lv);
  return j.h - j.p * r.gbar;
}

struct KernelArgs {
  DenseKdPieces call;
  float inv_tau;
  bool u_is_z;      // tau 1: u's statistics are z's
  long long ahead;  // items ahead whose pieces go to L2
  int batches;      // chunk barriers a piece
};

template <typename T, typename TT>
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
  const int div = a.divergence;
  const int vocab = static_cast<int>(a.base.vocab);
  const bool targets64 = a.base.targets_dtype == DType::kInt64;
  const float inv_tau = ka.inv_tau;
  const bool u_is_z = ka.u_is_z;
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

    // The statistics pass, each batch once it has landed; a vector's max
    // raises the running ones (rarely, past the first vectors).
    DenseStats st = EmptyDense();
    {
      float mt = -INFINITY;  // the teacher's raw max (mv = mt / tau)
      float bz = 0.0f, bu = 0.0f, bv = 0.0f;  // the maxima, 0 while -inf
#pragma unroll 1
      for (int b = 0; b * kBatchVectors < nvec; ++b) {
        MbarWait(&landed[b], parity);
#pragma unroll 2
        for (int q = b * kBatchVectors + tid;
             q < min(nvec, (b + 1) * kBatchVectors); q += kBlock) {
          const uint4 zv = kept[q];
          float tv[kVec];
          TeacherValues<T, TT>(teacher_kept, q, tv);
          float vz = -INFINITY, vt = -INFINITY;
#pragma unroll
          for (int j = 0; j < kVec; ++j) {
            vz = fmaxf(vz, Tr::Get(zv, j));
            vt = fmaxf(vt, tv[j]);
          }
          if (vz > st.mz) {
            const float fz =
                st.mz == -INFINITY ? 0.0f : Exp2((st.mz - vz) * kLog2e);
            const float fu =
                st.mz == -INFINITY
                    ? 0.0f
                    : Exp2((st.mz * inv_tau - vz * inv_tau) * kLog2e);
            st.sz *= fz;
            st.wz *= fz;
            st.su *= fu;
            if (div == kRkl) {
              st.w *= fu;
              st.ws *= fu;
            }
            int arg = INT_MAX;
#pragma unroll
            for (int j = kVec - 1; j >= 0; --j) {
              if (Tr::Get(zv, j) == vz) arg = start + q * kVec + j;
            }
            st.arg = arg;
            st.mz = vz;
            bz = vz;
            bu = vz * inv_tau;
          }
          if (vt > mt) {
            const float nv = vt * inv_tau;
            const float fv =
                mt == -INFINITY ? 0.0f : Exp2((st.mv - nv) * kLog2e);
            st.sv *= fv;
            if (div == kFkl) {
              st.w *= fv;
              st.ws *= fv;
            }
            mt = vt;
            st.mv = nv;
            bv = nv;
          }
#pragma unroll
          for (int j = 0; j < kVec; ++j) {
            const float z = Tr::Get(zv, j);
            const float ez = Exp2((z - bz) * kLog2e);
            st.sz += ez;
            st.wz = ez > 0.0f ? fmaf(ez, z, st.wz) : st.wz;
            const float u = z * inv_tau;
            const float eu = u_is_z ? ez : Exp2((u - bu) * kLog2e);
            if (!u_is_z) st.su += eu;
            const float v = tv[j] * inv_tau;
            const float ev = Exp2((v - bv) * kLog2e);
            st.sv += ev;
            if (div == kFkl && ev > 0.0f) {
              st.w = fma(static_cast<double>(ev),
                         static_cast<double>(v) - static_cast<double>(u), st.w);
              st.ws += ev;
            } else if (div == kRkl && eu > 0.0f) {
              st.w = fma(static_cast<double>(eu),
                         static_cast<double>(u) - static_cast<double>(v), st.w);
              st.ws += eu;
            }
          }
        }
      }
      if (u_is_z) st.su = st.sz;
    }
    {
      const DenseStats w = WarpMergeDense(st, inv_tau, div);
      if (lane == 0) scratch[warp] = w;
    }
    // The piece whose slot carries the target's z (and whose block writes
    // the row's record): piece 0 without a target.
    const int y_piece = has_target && valid ? static_cast<int>(y / a.chunk) : 0;
    const bool owner = y_piece == piece;
    __syncthreads();
    if (warp == 0) {
      const DenseStats ps = WarpMergeDense(
          lane < kWarps ? scratch[lane] : EmptyDense(), inv_tau, div);
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
        const float4 f0 = __ldcg(reinterpret_cast<const float4*>(s));
        const float4 f1 = __ldcg(reinterpret_cast<const float4*>(s) + 1);
        rs.mz = f0.x;
        rs.sz = f0.y;
        rs.wz = f0.z;
        rs.arg = __float_as_int(f0.w);
        rs.su = f1.x;
        rs.sv = f1.y;
        rs.mv = f1.z;
        rs.w = __ldcg(&s->st.w);
        rs.ws = __ldcg(&s->st.ws);
        zy_lane = __ldcg(&s->zy);
      }
      rs = WarpMergeDense(rs, inv_tau, div);
      const float zy = __shfl_sync(0xffffffffu, zy_lane, y_piece);
      const float lz = logf(rs.sz);
      const float lse = rs.mz + lz;
      const float mu = rs.mz * inv_tau;
      const float lu = u_is_z ? lz : logf(rs.su);
      const float lv = logf(rs.sv);
      DenseRow r;
      r.mz = rs.mz;
      r.cz = lz * kLog2e;
      r.mu = mu;
      r.cu = lu * kLog2e;
      r.mv = rs.mv;
      r.cv = lv * kLog2e;
      r.lu = lu;
      r.lv = lv;
      r.valid = valid;
      r.s = valid ? a.row_scale[row] : 0.0f;
      r.a_ce = r.s * a.kd.alpha;
      r.a_kd = r.s * (1.0f - a.kd.alpha) * inv_tau;
      r.logp = has_target && valid ? (zy - rs.mz) - lz : 0.0f;
      r.gy = r.a_ce * expm1f(r.logp);
      // lse(u) - lse(v), in fp64 from its parts
      const double gap =
          (static_cast<double>(mu) + lu) - (static_cast<double>(rs.mv) + lv);
      r.lse = lse;
      r.entropy = lse - rs.wz / rs.sz;
      r.arg = rs.arg;
      double distill = 0.0;
      r.ratio = 0.0f;
      r.k = 0.0;
      r.gbar = 0.0f;
      if (div == kFkl) {
        distill = rs.ws > 0.0 ? rs.w / rs.ws + gap : 0.0;
        // sum q / sum p over the p and q as the gradient computes them
        const double sum_p = rs.su * exp2(-static_cast<double>(r.cu));
        const double sum_q = rs.sv * exp2(-static_cast<double>(r.cv));
        r.ratio = sum_p > 0.0 ? static_cast<float>(sum_q / sum_p) : 0.0f;
      } else if (div == kRkl) {
        r.k = rs.ws > 0.0 ? rs.w / rs.ws : 0.0;
        distill = r.k - gap;
      }
      r.distill = distill;
      if (lane == 0) row_s = r;
    }
    __syncthreads();
    const DenseRow r = row_s;
    const uint4* const tkept = teacher_kept;
    if (div == static_cast<int>(Divergence::kJsd) && valid) {
      // JSD's log M needs both lse: its sums in a pass of their own, merged
      // through a second exchange (every piece of the row has published its
      // first slot, so none waits on a block that is not running).
      double dsum = 0.0, hsum = 0.0, psum = 0.0;
#pragma unroll 1
      for (int q = tid; q < nvec; q += kBlock) {
        const uint4 zv = kept[q];
        float tv[kVec];
        TeacherValues<T, TT>(tkept, q, tv);
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          const JsdParts t =
              JsdTerm(a.kd.beta, (Tr::Get(zv, j) * inv_tau - r.mu) - r.lu,
                      (tv[j] * inv_tau - r.mv) - r.lv);
          dsum += t.d;
          hsum += t.h;
          psum += t.p;
        }
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
          row_s.distill = d;
        }
      }
      __syncthreads();
    }
    if (owner && tid == 0) {
      WriteRecord(row_s, a.kd.alpha, has_target && row_s.arg == y,
                  a.rows_out + row);
    }
    const float gbar = row_s.gbar;
    T* const out =
        static_cast<T*>(a.base.gradient) + row * a.base.row_stride + start;
    if (!valid) {
      ZeroSlice<T, kBlock>(out, nvec, tid);
    } else {
      DenseRow rr = r;
      rr.gbar = gbar;
      const bool ce_on = a.kd.alpha > 0.0f;
#pragma unroll 2
      for (int q = tid; q < nvec; q += kBlock) {
        const uint4 zv = kept[q];
        float tv[kVec];
        TeacherValues<T, TT>(tkept, q, tv);
        float g[kVec];
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          const float z = Tr::Get(zv, j);
          const float kd =
              KdTerm(rr, div, a.kd.beta, z * inv_tau, tv[j] * inv_tau);
          float v = rr.a_kd * kd;
          if (ce_on) {
            v = fmaf(rr.a_ce, Exp2(fmaf(z - rr.mz, kLog2e, -rr.cz)), v);
          }
          g[j] = v;
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
        const float kd = KdTerm(rr, div, a.kd.beta, z * inv_tau,
                                tyv[static_cast<int>(yl % kVec)] * inv_tau);
        Tr::Store(out + yl, fmaf(rr.a_kd, kd, rr.gy));
      }
    }
    parity ^= 1u;
    __syncthreads();  // kept, row_s and item_s are rewritten by the next item
  }
}

template <typename T, typename TT>
cudaError_t Launch(const DenseKdPieces& call, cudaStream_t stream) {
  const auto kernel = DenseKdKernel<T, TT>;
  const int smem = call.chunk * static_cast<int>(sizeof(T)) +
                   call.chunk * static_cast<int>(sizeof(TT));
  constexpr long long kBatchElems =
      static_cast<long long>(kBatchVectors) * Traits<T>::kVec;
  const int batches =
      static_cast<int>((call.chunk + kBatchElems - 1) / kBatchElems);
  if (batches > kMaxBatches || call.pieces > 32 || call.chunk % 8 != 0) {
    return cudaErrorInvalidConfiguration;
  }
  int device = 0, sms = 0, smem_max = 0, per_sm = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e == cudaSuccess) {
    e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  }
  if (e == cudaSuccess) {
    e = cudaDeviceGetAttribute(&smem_max,
                               cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  }
  if (e != cudaSuccess) return e;
  if (smem > smem_max - 1024) return cudaErrorInvalidConfiguration;
  e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           smem);
  if (e == cudaSuccess) {
    e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kBlock,
                                                      smem);
  }
  if (e != cudaSuccess) return e;
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
  ka.u_is_z = call.kd.temperature == 1.0f;
  // The next pieces about 256 KiB ahead into L2 (smem row pieces' prefetch)
  ka.ahead = per_sm >= 2 ? std::max(1, 256 * 1024 / smem) : 0;
  ka.batches = batches;
  kernel<<<static_cast<unsigned>(sms * per_sm), kBlock, smem, stream>>>(ka);
  return cudaGetLastError();
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
      return Launch<decltype(student), decltype(teacher)>(call, stream);
    });
  });
}

}  // namespace cuda_ce
}  // namespace lossd
