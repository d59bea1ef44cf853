// Fused cross-entropy on the GPU: one read of the logits and one write of the
// gradient, the row kept in registers across a thread-block cluster between
// its softmax statistics and its gradient. See cross_entropy_cuda.h.
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>

#include "kernels/cuda/cross_entropy_cuda.h"

namespace lossd {
namespace {

namespace cg = cooperative_groups;

constexpr int kThreads = 256;         // cluster path: threads per block
constexpr int kGenericThreads = 512;  // generic path: threads per block
constexpr int kReduceThreads = 1024;  // prepare/finalize: one block
constexpr int kMaxCluster = 16;

// Workspace: header, then per-row loss, z-loss and flags (kFlag*).
struct WorkspaceHeader {
  int error;
  int pad;
  long long bad_row;
  long long valid;
  double denominator;            // D for kMean (0 without valid rows)
  float scale;                   // s of the contract, rounded once to fp32
  float weight_total;            // W
  unsigned long long next_item;  // v8: the next work item (0 at the start)
};
constexpr std::size_t kHeaderBytes = 256;
constexpr int kFlagCorrect = 1;
constexpr int kFlagNonfinite = 2;

std::size_t AlignUp(std::size_t n) { return (n + 255) / 256 * 256; }

struct Params {
  const void* logits;
  void* grad;  // nullptr for GradientMode::kNone
  const void* targets;
  const float* weights;
  float* token_loss;
  float* token_lse;
  int32_t* token_argmax;
  WorkspaceHeader* header;
  float* row_loss;
  float* row_zloss;
  int* row_flags;
  void* pieces;   // v7, v8: kMaxPieces Stats a row; v9: a PieceSlot an item
  int* row_done;  // v8: pieces a row whose statistics are written
  float* row_zy;  // v8: the target logit of a row
  long long rows;
  long long stride;
  long long ignore_index;
  double normalizer;
  int vocab;
  int chunk;  // cluster path: elements per block
  int targets64;
  int reduction;
  float eps;
  float zls;
  float softcap;
  float grad_scale;
};

// ---- element access -------------------------------------------------------

template <typename T>
struct Traits;
template <>
struct Traits<float> {
  static constexpr int kVec = 4;
  __device__ static float Get(const uint4& v, int j) {
    const unsigned r[4] = {v.x, v.y, v.z, v.w};
    return __uint_as_float(r[j]);
  }
  __device__ static void Pack(const float* g, uint4* out) {
    *out = make_uint4(__float_as_uint(g[0]), __float_as_uint(g[1]),
                      __float_as_uint(g[2]), __float_as_uint(g[3]));
  }
  __device__ static float Load(const float* p) { return *p; }
  __device__ static void Store(float* p, float g) { *p = g; }
};
template <>
struct Traits<__nv_bfloat16> {
  static constexpr int kVec = 8;
  __device__ static float Get(const uint4& v, int j) {
    const unsigned r[4] = {v.x, v.y, v.z, v.w};
    const unsigned w = r[j / 2];
    // Opaque (volatile asm): otherwise the compiler keeps all unpacked floats
    // alive from one pass over the registers to the next and spills.
    unsigned f;
    if (j % 2 == 0) {
      asm volatile("shl.b32 %0, %1, 16;" : "=r"(f) : "r"(w));
    } else {
      asm volatile("and.b32 %0, %1, 0xffff0000;" : "=r"(f) : "r"(w));
    }
    return __uint_as_float(f);
  }
  __device__ static void Pack(const float* g, uint4* out) {
    unsigned r[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      __nv_bfloat162 h = __floats2bfloat162_rn(g[2 * i], g[2 * i + 1]);
      r[i] = *reinterpret_cast<unsigned*>(&h);
    }
    *out = make_uint4(r[0], r[1], r[2], r[3]);
  }
  __device__ static float Load(const __nv_bfloat16* p) {
    return __bfloat162float(*p);
  }
  __device__ static void Store(__nv_bfloat16* p, float g) {
    *p = __float2bfloat16_rn(g);
  }
};
template <>
struct Traits<__half> {
  static constexpr int kVec = 8;
  __device__ static float Get(const uint4& v, int j) {
    const unsigned r[4] = {v.x, v.y, v.z, v.w};
    const unsigned w = r[j / 2];
    unsigned short b;
    if (j % 2 == 0) {
      asm volatile("cvt.u16.u32 %0, %1;" : "=h"(b) : "r"(w));
    } else {
      asm volatile("{ .reg .b32 t; shr.b32 t, %1, 16; cvt.u16.u32 %0, t; }"
                   : "=h"(b)
                   : "r"(w));
    }
    return __half2float(__ushort_as_half(b));
  }
  __device__ static void Pack(const float* g, uint4* out) {
    unsigned r[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      __half2 h = __floats2half2_rn(g[2 * i], g[2 * i + 1]);
      r[i] = *reinterpret_cast<unsigned*>(&h);
    }
    *out = make_uint4(r[0], r[1], r[2], r[3]);
  }
  __device__ static float Load(const __half* p) { return __half2float(*p); }
  __device__ static void Store(__half* p, float g) { *p = __float2half_rn(g); }
};

__device__ __forceinline__ long long LoadTarget(const Params& p,
                                                long long row) {
  return p.targets64 ? static_cast<const long long*>(p.targets)[row]
                     : static_cast<const int*>(p.targets)[row];
}

// ---- per-row math shared by both paths --------------------------------------

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

__device__ __forceinline__ void Combine(Stats& a, const Stats& b) {
  const bool b_wins = b.m > a.m || (b.m == a.m && b.arg < a.arg);
  const Stats& win = b_wins ? b : a;
  const Stats& lose = b_wins ? a : b;
  const float m = win.m;
  // Accurate expf: a few calls per thread, and __expf's argument rounding
  // would cost the row sum several ulps (issue 3, oracle seed 1199677219).
  const float t =
      m == -INFINITY ? -1.0f : win.t + (1.0f + lose.t) * expf(lose.m - m);
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

// Block-wide fixed-order reduction; the result is valid in every thread.
// `scratch` holds one Stats per warp plus one.
template <int kBlock>
__device__ Stats BlockReduce(Stats v, Stats* scratch) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) Combine(v, ShuffleStats(v, o));
  const int warp = threadIdx.x / 32;
  if (threadIdx.x % 32 == 0) scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    constexpr int kWarps = kBlock / 32;
    Stats w = scratch[threadIdx.x % kWarps];
#pragma unroll
    for (int o = kWarps / 2; o > 0; o >>= 1) Combine(w, ShuffleStats(w, o));
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

// Everything the gradient and the row outputs need, from the row's statistics.
struct RowMath {
  float lse;
  float l1p;     // lse - m, kept apart so that z_y - lse keeps its digits
  float lse_l2;  // fl(lse * log2e) as a pair with the factor folded into a
  float a;       // dz_c = p_c * a + b * w_c (w_c = 1 without weights), with
  float b;       // p_c = Exp2(fma(z_c, log2e, -lse_l2))
  float gy;      // dz_y, computed without cancellation
  float loss;
  float zloss;
};

__device__ __forceinline__ RowMath MakeRowMath(const Params& p,
                                               const WorkspaceHeader& h,
                                               const Stats& st, bool valid,
                                               float zy, float wy) {
  RowMath r;
  r.l1p = log1pf(st.t);
  r.lse = st.m + r.l1p;
  // lse * log2e = (m + l1p) * log2e to ~2^-40 relative: both products split
  // exactly by fma, summed with a two-sum.
  const Log2Split ms = SplitLog2(st.m);
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
  r.zloss = valid ? p.zls * r.lse * r.lse : 0.0f;
  r.loss = valid ? -(1.0f - p.eps) * wy * zy_minus_lse +
                       p.eps * inv_v * (r.lse * h.weight_total - st.sum_wz) +
                       r.zloss
                 : 0.0f;
  return r;
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

// ---- prepare: target check, D, W, s ---------------------------------------

// Fixed-order reduction over the kReduceThreads threads of a block with `op`
// (commutative): butterflies within each warp, then over the warps' results;
// every thread gets the same bits. `scratch` holds 32 values.
template <typename A, typename Op>
__device__ A BlockFold(A v, A* scratch, Op op) {
  static_assert(kReduceThreads == 32 * 32, "one warp's lanes for the warps");
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  }
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();
  v = scratch[threadIdx.x % 32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  }
  __syncthreads();  // scratch may be reused at once
  return v;
}

template <typename A>
__device__ A BlockSum(A v, A* scratch) {
  return BlockFold(v, scratch, [](A a, A b) { return a + b; });
}

// Rows a thread of the prepare and finalize kernels loads at once (their
// loads in flight together, not one DRAM round trip a row).
constexpr int kRowBatch = 8;

__global__ void __launch_bounds__(kReduceThreads) PrepareKernel(Params p) {
  __shared__ double dscratch[32];
  __shared__ long long lscratch[32];
  long long bad = LLONG_MAX;
  long long valid = 0;
  double wsum = 0.0;
  for (long long base = threadIdx.x; base < p.rows;
       base += kRowBatch * kReduceThreads) {
    long long ys[kRowBatch];
#pragma unroll
    for (int k = 0; k < kRowBatch; ++k) {
      const long long i = base + k * kReduceThreads;
      ys[k] = i < p.rows ? LoadTarget(p, i) : p.ignore_index;
    }
#pragma unroll
    for (int k = 0; k < kRowBatch; ++k) {
      const long long y = ys[k];
      if (y == p.ignore_index) continue;
      if (y < 0 || y >= p.vocab) {
        bad = min(bad, base + k * kReduceThreads);
        continue;
      }
      ++valid;
      wsum += p.weights ? static_cast<double>(p.weights[y]) : 1.0;
    }
  }
  for (long long i = threadIdx.x; i < p.rows; i += kReduceThreads) {
    p.row_done[i] = 0;  // v8's per-row counts start from nothing
  }
  double wtotal = 0.0;
  if (p.weights) {
    for (int c = threadIdx.x; c < p.vocab; c += kReduceThreads) {
      wtotal += p.weights[c];
    }
  } else if (threadIdx.x == 0) {
    wtotal = p.vocab;
  }
  bad = BlockFold(bad, lscratch,
                  [](long long a, long long b) { return min(a, b); });
  valid = BlockSum(valid, lscratch);
  wsum = BlockSum(wsum, dscratch);
  wtotal = BlockSum(wtotal, dscratch);
  if (threadIdx.x == 0) {
    WorkspaceHeader h = {};
    h.error = bad != LLONG_MAX ? kCrossEntropyBadTarget : 0;
    h.bad_row = bad != LLONG_MAX ? bad : -1;
    h.valid = valid;
    // As the reference: a mean over zero valid rows is 0; a zero D with valid
    // rows (weights summing to 0) gives NaN/Inf as torch does.
    const bool mean = p.reduction == static_cast<int>(Reduction::kMean);
    const double d = p.normalizer > 0 ? p.normalizer : wsum;
    h.denominator = mean && valid > 0 ? d : 0.0;
    double s = p.grad_scale;
    if (mean) s = valid > 0 ? s / d : 0.0;
    h.scale = static_cast<float>(s);
    h.weight_total = static_cast<float>(wtotal);
    *p.header = h;
  }
}

// ---- finalize: fixed-order reduction of the per-row values ----------------

__global__ void __launch_bounds__(kReduceThreads)
    FinalizeKernel(Params p, CrossEntropyCudaResult* out) {
  __shared__ double dscratch[32];
  __shared__ long long lscratch[32];
  const WorkspaceHeader h = *p.header;
  if (h.error) {
    if (threadIdx.x == 0) {
      CrossEntropyCudaResult r = {};
      r.error = h.error;
      r.bad_row = h.bad_row;
      r.bad_target = LoadTarget(p, h.bad_row);
      *out = r;
    }
    return;
  }
  double loss = 0.0, zloss = 0.0;
  long long correct = 0, nonfinite = 0;
  for (long long base = threadIdx.x; base < p.rows;
       base += kRowBatch * kReduceThreads) {
    float l[kRowBatch], z[kRowBatch];
    int f[kRowBatch];
#pragma unroll
    for (int k = 0; k < kRowBatch; ++k) {
      const long long i = base + k * kReduceThreads;
      const bool in = i < p.rows;
      l[k] = in ? p.row_loss[i] : 0.0f;
      z[k] = in ? p.row_zloss[i] : 0.0f;
      f[k] = in ? p.row_flags[i] : 0;
    }
#pragma unroll
    for (int k = 0; k < kRowBatch; ++k) {
      loss += l[k];
      zloss += z[k];
      correct += (f[k] & kFlagCorrect) ? 1 : 0;
      nonfinite += (f[k] & kFlagNonfinite) ? 1 : 0;
    }
  }
  loss = BlockSum(loss, dscratch);
  zloss = BlockSum(zloss, dscratch);
  correct = BlockSum(correct, lscratch);
  nonfinite = BlockSum(nonfinite, lscratch);
  if (threadIdx.x == 0) {
    CrossEntropyCudaResult r = {};
    if (p.reduction == static_cast<int>(Reduction::kMean)) {
      loss = h.valid > 0 ? loss / h.denominator : 0.0;
      zloss = h.valid > 0 ? zloss / h.denominator : 0.0;
    }
    r.loss = loss;
    r.z_loss = zloss;
    r.denominator = h.denominator;
    r.valid_tokens = h.valid;
    r.correct_tokens = correct;
    r.nonfinite_rows = nonfinite;
    r.bad_row = -1;
    *out = r;
  }
}

// ---- cluster path
// ------------------------------------------------------------

// Split cluster barrier. DSMEM may be written only once the peer block has
// started, so blocks arrive on entry and wait just before the first push.
__device__ __forceinline__ void ClusterArriveRelaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void ClusterWait() {
  asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");
}

constexpr int MinBlocks(int vpt) { return vpt >= 16 ? 2 : (vpt >= 8 ? 3 : 4); }
constexpr int kLanes = 4;  // independent accumulators per thread (ILP)
// Logits [N, V] with row stride; grid = N * C blocks in clusters of C; block
// `rank` of row `row` keeps elements [rank*chunk, rank*chunk + chunk) in
// registers as VPT 16-byte vectors per thread, vector q = k*kThreads + tid, so
// each element is read once and written once. Each block pushes its partial
// statistics into every peer's shared memory (DSMEM) before one cluster
// barrier, then combines them locally in rank order. kGeneral adds softcap,
// class weights and label smoothing; the plain variant is the fast path.
template <typename T, int VPT, bool kGeneral>
__global__ void __launch_bounds__(kThreads, MinBlocks(VPT))
    ClusterKernel(Params p) {
  using Tr = Traits<T>;
  constexpr int kVec = Tr::kVec;
  __shared__ Stats scratch[kThreads / 32 + 1];
  __shared__ Stats inbox[kMaxCluster];

  cg::cluster_group cluster = cg::this_cluster();
  const int csize = static_cast<int>(cluster.num_blocks());
  const int rank = static_cast<int>(cluster.block_rank());
  const long long row = blockIdx.x / csize;
  const int tid = threadIdx.x;
  const int start = rank * p.chunk;
  const int vocab = p.vocab;
  const T* in = static_cast<const T*>(p.logits) + row * p.stride;

  ClusterArriveRelaxed();
  // Loads first: nothing below may delay them.
  uint4 data[VPT];
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int e = start + (k * kThreads + tid) * kVec;
    if (e + kVec <= vocab) {
      data[k] = __ldcs(reinterpret_cast<const uint4*>(in + e));
    } else {
      // Tail (or past the row): -inf never wins the max and adds exp() = 0.
      float f[kVec];
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        f[j] = e + j < vocab ? Tr::Load(in + e + j) : -INFINITY;
      }
      Tr::Pack(f, &data[k]);
    }
  }
  const long long y = LoadTarget(p, row);
  const WorkspaceHeader& hdr = *p.header;
  if (hdr.error) {  // uniform: the whole grid leaves, nothing written
    ClusterWait();
    return;
  }

  const bool valid = y != p.ignore_index;
  const bool owner = valid ? (y >= start && y < start + p.chunk) : rank == 0;
  T* out = p.grad ? static_cast<T*>(p.grad) + row * p.stride : nullptr;
  // The owner reads z_y before the cluster barrier; only it writes column y.
  float zy = 0.0f, wy = 1.0f;
  if (valid && owner) {
    float unused;
    const float xy = Tr::Load(in + y);
    zy = (kGeneral && p.softcap > 0) ? SoftcapZ(xy, p.softcap, &unused) : xy;
  }
  if (kGeneral && valid && p.weights) wy = p.weights[y];

  // Max and first argmax, in kLanes independent chains (vector k goes to
  // lane k % kLanes; ties resolve by column when the lanes merge).
  float lm[kLanes];
  int larg[kLanes];
#pragma unroll
  for (int l = 0; l < kLanes; ++l) {
    lm[l] = -INFINITY;
    larg[l] = INT_MAX;
  }
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      float z = Tr::Get(data[k], j);
      const int c = start + (k * kThreads + tid) * kVec + j;
      if (kGeneral) {
        if (c >= vocab) continue;
        float unused;
        if (p.softcap > 0) z = SoftcapZ(z, p.softcap, &unused);
      }
      if (z > lm[k % kLanes]) {
        lm[k % kLanes] = z;
        larg[k % kLanes] = c;
      }
    }
  }
  Stats st;
  st.m = lm[0];
  st.arg = larg[0];
#pragma unroll
  for (int l = 1; l < kLanes; ++l) {
    if (lm[l] > st.m || (lm[l] == st.m && larg[l] < st.arg)) {
      st.m = lm[l];
      st.arg = larg[l];
    }
  }
  float lt[kLanes] = {};
  const Log2Split m_l2 = SplitLog2(st.m);
  const float m_log2e = m_l2.hi;
  st.sum_wz = 0.0f;
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      float z = Tr::Get(data[k], j);
      if (kGeneral) {
        const int c = start + (k * kThreads + tid) * kVec + j;
        if (c >= vocab) continue;
        float unused;
        if (p.softcap > 0) z = SoftcapZ(z, p.softcap, &unused);
        if (p.eps > 0) {
          st.sum_wz += (p.weights ? p.weights[c] : 1.0f) * z;
        }
      }
      lt[k % kLanes] += Exp2(fmaf(z, kLog2e, -m_log2e));  // the max adds ~1
    }
  }
  // The terms are exp(z - m) * 2^lo: undo the rounding of m * log2e.
  st.t = ((lt[0] + lt[1]) + (lt[2] + lt[3])) * exp2f(-m_l2.lo);
  if (st.m == -INFINITY) {
    st.t = -1.0f;
  } else if (st.t < 1.0625f) {
    // One element dominates this slice: 1 + t lost t's low digits, so sum
    // the others alone (rare; keeps p_y -> 1 exact in the gradient). Re-read
    // from memory, which nothing has written yet: a second pass over the
    // registers here makes the compiler spill the hot path.
    st.t = 0.0f;
    bool skipped = false;
#pragma unroll 1
    for (int k = 0; k < VPT; ++k) {
#pragma unroll 1
      for (int j = 0; j < kVec; ++j) {
        const int c = start + (k * kThreads + tid) * kVec + j;
        if (c >= vocab) break;
        float z = Tr::Load(in + c);
        float unused;
        if (kGeneral && p.softcap > 0) z = SoftcapZ(z, p.softcap, &unused);
        // Skip the first element equal to the max (the argmax).
        const bool skip = !skipped && z == st.m;
        skipped = skipped || skip;
        st.t += skip ? 0.0f : expf(z - st.m);
      }
    }
  } else {
    st.t -= 1.0f;
  }

  st = BlockReduce<kThreads>(st, scratch);
  // Push this block's partial into slot `rank` of every peer: stores, not
  // round trips, before the one barrier; nothing touches remote shared memory
  // after it, so blocks may exit freely.
  ClusterWait();  // every peer has started
  if (tid < csize) *cluster.map_shared_rank(&inbox[rank], tid) = st;
  cluster.sync();
  // Every block combines the partials in rank order, so all get the same bits.
  Stats row_st = inbox[0];
  for (int r = 1; r < csize; ++r) Combine(row_st, inbox[r]);

  const RowMath rm = MakeRowMath(p, hdr, row_st, valid, zy, wy);
  if (owner && tid == 0)
    WriteRowOutputs(p, row, valid, y, rm, row_st.arg, true);
  if (!out) return;

  if (!kGeneral && !valid) {
    // Ignored row: zeros (the formula would give NaN for non-finite logits).
    const float zero[kVec] = {};
    uint4 zv;
    Tr::Pack(zero, &zv);
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int e = start + (k * kThreads + tid) * kVec;
      if (e + kVec <= vocab) {
        __stcs(reinterpret_cast<uint4*>(out + e), zv);
      } else {
#pragma unroll
        for (int j = 0; j < kVec; ++j)
          if (e + j < vocab) Tr::Store(out + e + j, 0.0f);
      }
    }
    return;
  }
  const float lse_log2e = rm.lse_l2;
  const int yq = (valid && owner) ? static_cast<int>(y - start) / kVec : -1;
  const int yj = (valid && owner) ? static_cast<int>(y - start) % kVec : -1;
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int q = k * kThreads + tid;
    const int e = start + q * kVec;
    float g[kVec];
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const float x = Tr::Get(data[k], j);
      if (kGeneral) {
        float dfac = 1.0f;
        const float z = p.softcap > 0 ? SoftcapZ(x, p.softcap, &dfac) : x;
        const int c = e + j;
        const float wc = (p.weights && c < vocab) ? p.weights[c] : 1.0f;
        float gz = Exp2(fmaf(z, kLog2e, -lse_log2e)) * rm.a + rm.b * wc;
        if (q == yq && j == yj) gz = rm.gy;
        g[j] = valid ? gz * dfac : 0.0f;
      } else {
        g[j] = fmaf(Exp2(fmaf(x, kLog2e, -lse_log2e)), rm.a, rm.b);
      }
    }
    if (!kGeneral && q == yq) {
#pragma unroll
      for (int j = 0; j < kVec; ++j)
        if (j == yj) g[j] = rm.gy;
    }
    if (e + kVec <= vocab) {
      uint4 v;
      Tr::Pack(g, &v);
      __stcs(reinterpret_cast<uint4*>(out + e), v);
    } else {
#pragma unroll
      for (int j = 0; j < kVec; ++j)
        if (e + j < vocab) Tr::Store(out + e + j, g[j]);
    }
  }
}

// ---- v5: stream the slice, exchange, re-read it from L2 -------------------

// 16-byte vectors per thread per batch: the loads one thread keeps in flight
// (twice that with the next batch prefetched).
constexpr int kU = 4;
// Resident blocks per SM the v5 kernel is compiled for: 4 (<= 64 registers,
// spills ~150 bytes of per-row state) or 3 (<= 80, none).

// Loads vectors base + (u * kThreads + tid) * kVec of a slice ending at `end`;
// elements past `end` read as -inf (never the max, exp() = 0). kLastUse marks
// the re-read: evict-first, the gradient replaces it.
template <typename T, bool kLastUse>
__device__ __forceinline__ void LoadBatch(const T* in, int base, int tid,
                                          int end, uint4 (&v)[kU]) {
  using Tr = Traits<T>;
  constexpr int kVec = Tr::kVec;
#pragma unroll
  for (int u = 0; u < kU; ++u) {
    const int e = base + (u * kThreads + tid) * kVec;
    if (e + kVec <= end) {
      const uint4* ptr = reinterpret_cast<const uint4*>(in + e);
      v[u] = kLastUse ? __ldcs(ptr) : *ptr;
    } else {
      float f[kVec];
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        f[j] = e + j < end ? Tr::Load(in + e + j) : -INFINITY;
      }
      Tr::Pack(f, &v[u]);
    }
  }
}

// Fixed-order block sum; the result is valid in every thread. `scratch`
// holds one float per warp plus one.
__device__ float BlockSumFloat(float v, float* scratch) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x / 32;
  if (threadIdx.x % 32 == 0) scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    constexpr int kWarps = kThreads / 32;
    float w = scratch[threadIdx.x % kWarps];
#pragma unroll
    for (int o = kWarps / 2; o > 0; o >>= 1)
      w += __shfl_xor_sync(0xffffffffu, w, o);
    if (threadIdx.x == 0) scratch[kWarps] = w;
  }
  __syncthreads();
  return scratch[kThreads / 32];
}

// Logits [N, V] with row stride; grid = N * C blocks in clusters of C, block
// `rank` owning elements [rank*chunk, min(rank*chunk + chunk, V)). Unlike v4
// the slice is not held in registers: each block streams it once in batches
// of kU vectors a thread (online max / sum-exp, next batch in flight), pushes
// its partial into every peer's DSMEM before one cluster barrier, then reads
// the slice again -- from L2, which holds ~132 * blocks/SM * slice bytes --
// and writes the gradient with streaming stores. So DRAM sees one read and
// one write, and with 4+ small blocks per SM in different phases memory stays
// busy through each block's barrier (v4's limit, bench/NOTES.md). Plain
// options only (z-loss, grad_scale); softcap, weights and smoothing take v4.
template <typename T, int kMinBlocks>
__global__ void __launch_bounds__(kThreads, kMinBlocks) StreamKernel(Params p) {
  using Tr = Traits<T>;
  constexpr int kVec = Tr::kVec;
  constexpr int kBatch = kU * kThreads * kVec;  // elements a block per batch
  __shared__ Stats scratch[kThreads / 32 + 1];
  __shared__ float fscratch[kThreads / 32 + 1];
  // Two inboxes by row parity: a peer may push row r+1's partial while this
  // block still reads row r's; it cannot reach r+2 before this block has
  // arrived at r+1's barrier.
  __shared__ Stats inbox[2][kMaxCluster];
  __shared__ float tbox[kMaxCluster];

  cg::cluster_group cluster = cg::this_cluster();
  const int csize = static_cast<int>(cluster.num_blocks());
  const int rank = static_cast<int>(cluster.block_rank());
  const int tid = threadIdx.x;
  const int start = rank * p.chunk;
  const int end = min(start + p.chunk, p.vocab);
  const WorkspaceHeader& hdr = *p.header;
  // DSMEM may be written only once every peer has started.
  cluster.sync();
  if (hdr.error) return;  // uniform: the whole grid leaves, nothing written

  // Persistent: a cluster per row at a time, rows strided by the cluster
  // count (launching a cluster per row cost ~30 ns a block: bench/NOTES.md).
  const long long nclusters = gridDim.x / csize;
  int parity = 0;
#pragma unroll 1
  for (long long row = blockIdx.x / csize; row < p.rows;
       row += nclusters, parity ^= 1) {
    const T* in = static_cast<const T*>(p.logits) + row * p.stride;
    uint4 cur[kU];
    LoadBatch<T, false>(in, start, tid, end, cur);
    const long long y = LoadTarget(p, row);
    const bool valid = y != p.ignore_index;
    const bool owner = valid ? (y >= start && y < end) : rank == 0;
    const float zy = (valid && owner) ? Tr::Load(in + y) : 0.0f;

    // Pass 1: online max and sum of 2^(z*log2e - m_l2), rescaled when a batch
    // raises the max; the argmax is found afterwards in the batch that set it.
    float m = -INFINITY;
    float m_l2 = 0.0f;  // fl(m * log2e); 0 while m = -inf
    int arg_base = start;
    float acc[2] = {0.0f, 0.0f};
#pragma unroll 1
    for (int base = start; base < end; base += kBatch) {
      uint4 nxt[kU];
      if (base + kBatch < end)
        LoadBatch<T, false>(in, base + kBatch, tid, end, nxt);
      float bm = -INFINITY;
#pragma unroll
      for (int u = 0; u < kU; ++u)
#pragma unroll
        for (int j = 0; j < kVec; ++j) bm = fmaxf(bm, Tr::Get(cur[u], j));
      if (bm > m) {
        const float nl2 = __fmul_rn(bm, kLog2e);  // = fl(m * log2e), see lo
        const float f = m > -INFINITY ? Exp2(m_l2 - nl2) : 0.0f;
        acc[0] *= f;
        acc[1] *= f;
        m = bm;
        m_l2 = nl2;
        arg_base = base;
      }
#pragma unroll
      for (int u = 0; u < kU; ++u)
#pragma unroll
        for (int j = 0; j < kVec; ++j)
          acc[j % 2] += Exp2(fmaf(Tr::Get(cur[u], j), kLog2e, -m_l2));
#pragma unroll
      for (int u = 0; u < kU; ++u) cur[u] = nxt[u];
    }
    Stats st;
    st.m = m;
    st.sum_wz = 0.0f;
    st.arg = INT_MAX;
    if (m == -INFINITY) {
      st.t = -1.0f;
    } else {
      // First index of m: in the batch that set it (earlier ones were below).
      uint4 v[kU];
      LoadBatch<T, false>(in, arg_base, tid, end, v);
#pragma unroll
      for (int u = kU - 1; u >= 0; --u)
#pragma unroll
        for (int j = kVec - 1; j >= 0; --j)
          if (Tr::Get(v[u], j) == m)
            st.arg = arg_base + (u * kThreads + tid) * kVec + j;
      const float lo = isfinite(m_l2) ? fmaf(m, kLog2e, -m_l2) : 0.0f;
      st.t = (acc[0] + acc[1]) * exp2f(-lo) - 1.0f;
    }

    st = BlockReduce<kThreads>(st, scratch);
    if (tid < csize) *cluster.map_shared_rank(&inbox[parity][rank], tid) = st;
    cluster.sync();
    Stats row_st = inbox[parity][0];
    for (int r = 1; r < csize; ++r) Combine(row_st, inbox[parity][r]);

    if (row_st.t < 0.0625f && isfinite(row_st.m)) {
      // One element dominates the row: 1 + t kept only t's high digits, which
      // p_y - 1 needs. Sum the others alone, relative to the row max, and
      // exchange again (rare; uniform over the cluster, nothing written yet).
      float t = 0.0f;
#pragma unroll 1
      for (int base = start; base < end; base += kBatch) {
        uint4 v[kU];
        LoadBatch<T, false>(in, base, tid, end, v);
#pragma unroll
        for (int u = 0; u < kU; ++u)
#pragma unroll
          for (int j = 0; j < kVec; ++j) {
            const int c = base + (u * kThreads + tid) * kVec + j;
            const float e = expf(Tr::Get(v[u], j) - row_st.m);
            t += c == row_st.arg ? 0.0f : e;
          }
      }
      t = BlockSumFloat(t, fscratch);
      if (tid < csize) *cluster.map_shared_rank(&tbox[rank], tid) = t;
      cluster.sync();
      row_st.t = tbox[0];
      for (int r = 1; r < csize; ++r) row_st.t += tbox[r];
    }

    const RowMath rm = MakeRowMath(p, hdr, row_st, valid, zy, 1.0f);
    if (owner && tid == 0)
      WriteRowOutputs(p, row, valid, y, rm, row_st.arg, true);
    if (!p.grad) continue;
    T* out = static_cast<T*>(p.grad) + row * p.stride;

    if (!valid) {
      // Ignored row: zeros, no re-read (the formula would give NaN for
      // non-finite logits).
      const float zero[kVec] = {};
      uint4 zv;
      Tr::Pack(zero, &zv);
#pragma unroll 1
      for (int base = start; base < end; base += kBatch) {
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          const int e = base + (u * kThreads + tid) * kVec;
          if (e + kVec <= end) {
            __stcs(reinterpret_cast<uint4*>(out + e), zv);
          } else {
#pragma unroll
            for (int j = 0; j < kVec; ++j)
              if (e + j < end) Tr::Store(out + e + j, 0.0f);
          }
        }
      }
      continue;
    }

    // Pass 2: the slice again (L2), gradient out with streaming stores.
    const int yl = owner ? static_cast<int>(y) : -1;
    LoadBatch<T, true>(in, start, tid, end, cur);
#pragma unroll 1
    for (int base = start; base < end; base += kBatch) {
      uint4 nxt[kU];
      if (base + kBatch < end)
        LoadBatch<T, true>(in, base + kBatch, tid, end, nxt);
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int e = base + (u * kThreads + tid) * kVec;
        float g[kVec];
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          g[j] = fmaf(Exp2(fmaf(Tr::Get(cur[u], j), kLog2e, -rm.lse_l2)), rm.a,
                      rm.b);
        }
        if (yl >= e && yl < e + kVec) {
#pragma unroll
          for (int j = 0; j < kVec; ++j)
            if (e + j == yl) g[j] = rm.gy;
        }
        if (e + kVec <= end) {
          uint4 v;
          Tr::Pack(g, &v);
          __stcs(reinterpret_cast<uint4*>(out + e), v);
        } else {
#pragma unroll
          for (int j = 0; j < kVec; ++j)
            if (e + j < end) Tr::Store(out + e + j, g[j]);
        }
      }
#pragma unroll
      for (int u = 0; u < kU; ++u) cur[u] = nxt[u];
    }
  }  // rows
}

// ---- v6: slices in shared memory by bulk copy, a pipeline per block ------

constexpr int kMaxStages = 8;

__device__ __forceinline__ unsigned SmemAddr(const void* ptr) {
  return static_cast<unsigned>(__cvta_generic_to_shared(ptr));
}
__device__ __forceinline__ void MbarInit(unsigned long long* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(SmemAddr(bar)),
               "r"(count)
               : "memory");
}
__device__ __forceinline__ void MbarExpectTx(unsigned long long* bar,
                                             unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(
                   SmemAddr(bar)),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void MbarArrive(unsigned long long* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(SmemAddr(bar))
               : "memory");
}
// How long a waiting thread may sleep in try_wait before it looks again: a
// waiting warp then takes no issue slots from the SM's other block.
constexpr unsigned kSuspendNs = 1000000;
__device__ __forceinline__ void MbarWait(unsigned long long* bar,
                                         unsigned parity) {
  unsigned done = 0;
  do {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2, %3;\n"
        "selp.u32 %0, 1, 0, p;\n"
        "}\n"
        : "=r"(done)
        : "r"(SmemAddr(bar)), "r"(parity), "n"(kSuspendNs)
        : "memory");
  } while (!done);
}
// Global -> shared bulk copy (the TMA unit, no tensor map): `bytes` a
// multiple of 16, both addresses 16-byte aligned; completes on `bar`.
__device__ __forceinline__ void BulkLoad(void* dst, const void* src,
                                         unsigned bytes,
                                         unsigned long long* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes "
      "[%0], [%1], %2, [%3];" ::"r"(SmemAddr(dst)),
      "l"(src), "r"(bytes), "r"(SmemAddr(bar))
      : "memory");
}
// try_wait with cluster-scope acquire: the data other blocks' st.async wrote
// before completing the phase is visible after it.
__device__ __forceinline__ void MbarWaitCluster(unsigned long long* bar,
                                                unsigned parity) {
  unsigned done = 0;
  do {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], "
        "%2, %3;\n"
        "selp.u32 %0, 1, 0, p;\n"
        "}\n"
        : "=r"(done)
        : "r"(SmemAddr(bar)), "r"(parity), "n"(kSuspendNs)
        : "memory");
  } while (!done);
}
// Stores `v` into `slot` (an address in this block's shared memory) of the
// block of cluster rank `peer`, completing 16 bytes of the transaction on
// that block's copy of `bar`. No fence: ordering comes from the mbarrier.
__device__ __forceinline__ void StAsyncStats(Stats* slot, int peer,
                                             const Stats& v,
                                             unsigned long long* bar) {
  unsigned rslot, rbar;
  asm("mapa.shared::cluster.u32 %0, %1, %2;"
      : "=r"(rslot)
      : "r"(SmemAddr(slot)), "r"(peer));
  asm("mapa.shared::cluster.u32 %0, %1, %2;"
      : "=r"(rbar)
      : "r"(SmemAddr(bar)), "r"(peer));
  asm volatile(
      "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], "
      "{%1, %2, %3, %4}, [%5];" ::"r"(rslot),
      "r"(__float_as_uint(v.m)), "r"(__float_as_uint(v.t)),
      "r"(__float_as_uint(v.sum_wz)), "r"(v.arg), "r"(rbar)
      : "memory");
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
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    u += __shfl_xor_sync(0xffffffffu, u, o);
    wz += __shfl_xor_sync(0xffffffffu, wz, o);
  }
  Stats r;
  r.m = m;
  r.arg = arg;
  r.t = m == -INFINITY ? -1.0f : u;
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

// L2 eviction priorities (v8, unless cache_hints = 1): a policy for every line
// an access touches, and vector loads and streaming stores that carry one.
__device__ __forceinline__ unsigned long long L2EvictLast() {
  unsigned long long pol;
  asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(pol));
  return pol;
}
__device__ __forceinline__ unsigned long long L2EvictFirst() {
  unsigned long long pol;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
  return pol;
}
__device__ __forceinline__ uint4 LoadWithPolicy(const uint4* a,
                                                unsigned long long pol) {
  uint4 v;
  asm("ld.global.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(a), "l"(pol));
  return v;
}
__device__ __forceinline__ void StoreStreamWithPolicy(uint4* a, uint4 v,
                                                      unsigned long long pol) {
  asm volatile(
      "st.global.cs.L2::cache_hint.v4.u32 [%0], {%1, %2, %3, %4}, %5;" ::"l"(a),
      "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "l"(pol)
      : "memory");
}

// This thread's statistics of a slice of `n` elements (a multiple of the
// vector width) at `s` (shared or global memory), columns from `col0`: online
// max and sum of 2^(z*log2e - m_l2) over batches of kU vectors, the first
// argmax found afterwards in the batch that set the max. kPrefetch (global
// memory): the next batch's loads are issued before this one's arithmetic.
// kHint: global loads carry the L2 eviction policy `policy`. `keep` (not
// null): every vector read is also stored there, at its index (v9 keeps its
// piece in shared memory), and the p_y -> 1 pass below reads it from there.
struct NoWait {
  __device__ void operator()(int) const {}
};
template <typename T, int kBlock, bool kPrefetch = false, bool kHint = false,
          typename Wait = NoWait>
__device__ __forceinline__ Stats SliceStats(const T* s, int n, int col0,
                                            int tid,
                                            unsigned long long policy = 0,
                                            uint4* keep = nullptr,
                                            const Wait& wait = Wait()) {
  using Tr = Traits<T>;
  constexpr int kVec = Tr::kVec;
  const uint4* sv = reinterpret_cast<const uint4*>(s);
  const int nvec = n / kVec;
  float m = -INFINITY;
  float m_l2 = 0.0f;
  int arg_q = 0;
  int arg = INT_MAX;  // kPrefetch: the first argmax, found in the loop
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
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
    const float bm = BatchMax<T>(v);
    if (bm > m) {
      const float nl2 = __fmul_rn(bm, kLog2e);  // = fl(m * log2e), see lo
      const float f = m > -INFINITY ? Exp2(m_l2 - nl2) : 0.0f;
#pragma unroll
      for (int a = 0; a < 4; ++a) acc[a] *= f;
      m = bm;
      m_l2 = nl2;
      arg_q = q0;
      if (kPrefetch) {
        // The first argmax now, from registers: a re-read after the loop
        // would wait for global memory at the block's end.
        arg = INT_MAX;
#pragma unroll
        for (int u = kU - 1; u >= 0; --u)
#pragma unroll
          for (int j = kVec - 1; j >= 0; --j)
            if (Tr::Get(v[u], j) == bm)
              arg = col0 + (q0 + u * kBlock) * kVec + j;
      }
    }
    // Four independent sums: the adds' latency is not one chain.
#pragma unroll
    for (int u = 0; u < kU; ++u)
#pragma unroll
      for (int j = 0; j < kVec; ++j)
        acc[(u * kVec + j) % 4] += Exp2(fmaf(Tr::Get(v[u], j), kLog2e, -m_l2));
  }
  Stats st;
  st.m = m;
  st.sum_wz = 0.0f;
  st.arg = kPrefetch ? arg : INT_MAX;
  if (m == -INFINITY) {
    st.t = -1.0f;
  } else {
#pragma unroll 1
    for (int u = kU - 1; u >= 0 && !kPrefetch; --u) {
      const int q = arg_q + u * kBlock;
      if (q >= nvec) continue;
      const uint4 v = sv[q];
#pragma unroll
      for (int j = kVec - 1; j >= 0; --j)
        if (Tr::Get(v, j) == m) st.arg = col0 + q * kVec + j;
    }
    const float lo = isfinite(m_l2) ? fmaf(m, kLog2e, -m_l2) : 0.0f;
    const float corr = exp2f(-lo);
    st.t = ((acc[0] + acc[1]) + (acc[2] + acc[3])) * corr - 1.0f;
    if (st.t < 0.0625f) {
      // This thread's max dominates its elements: 1 + t kept only t's high
      // digits, which p_max - 1 needs (p_y -> 1). Sum the others alone, from
      // shared memory; then no merge above cancels, and the row needs no
      // second exchange (v5 has one).
      float t = 0.0f;
#pragma unroll 1
      for (int q = tid; q < nvec; q += kBlock) {
        const uint4 v = keep != nullptr ? keep[q] : sv[q];
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          const float e = Exp2(fmaf(Tr::Get(v, j), kLog2e, -m_l2));
          t += col0 + q * kVec + j == st.arg ? 0.0f : e;
        }
      }
      st.t = t * corr;
    }
  }
  return st;
}

// Gradient of this thread's share of a slice (shared memory) into `out`
// with streaming stores; the target column is fixed up by the caller.
template <typename T, int kBlock>
__device__ __forceinline__ void GradientSlice(const uint4* sv, T* out, int nvec,
                                              int tid, const RowMath& rm) {
  using Tr = Traits<T>;
  constexpr int kVec = Tr::kVec;
#pragma unroll 4
  for (int q = tid; q < nvec; q += kBlock) {
    const uint4 v = sv[q];
    float gr[kVec];
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      gr[j] = fmaf(Exp2(fmaf(Tr::Get(v, j), kLog2e, -rm.lse_l2)), rm.a, rm.b);
    }
    uint4 o;
    Tr::Pack(gr, &o);
    __stcs(reinterpret_cast<uint4*>(out) + q, o);
  }
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

// Logits [N, V] with 16-byte aligned rows, V a multiple of the vector width;
// persistent grid of clusters of C blocks (kMinBlocks blocks of kBlock threads
// a SM); block `rank` owns columns [start, end) of every row its cluster takes
// (rows g, g + G, ...). Thread 0 streams the block's slices of the next rows
// into `stages` shared-memory buffers with bulk copies (TMA) that complete on
// mbarriers, so DRAM reads run ahead of the arithmetic. Per row: statistics of
// the slice from shared memory, sent to every peer with st.async into a ring
// of kInbox slots that completes on the peer's mbarrier (no cluster barrier,
// so no release fence waits for this block's gradient stores), the next row's
// statistics computed before this row's partials are awaited, then the
// gradient from shared memory with streaming stores. Targets are read a row
// ahead and the target logit from shared memory: nothing on a row's chain
// waits for DRAM; a dominant element (p -> 1) is summed exactly per thread,
// so no row needs a second exchange. Two blocks a SM overlap one's reductions
// and exchange with the other's streaming. One read and one write of the
// logits. Plain options only (z-loss, grad_scale), like v5.
template <typename T, int kBlock, int kMinBlocks>
__global__ void __launch_bounds__(kBlock, kMinBlocks)
    TmaKernel(Params p, int stages, int stage_bytes) {
  using Tr = Traits<T>;
  constexpr int kVec = Tr::kVec;
  // A peer pushes row j + 1 once it has row j - 1 from this block, so this
  // block may still read the slot of row j - 2: four slots never collide.
  constexpr int kInbox = 4;
  extern __shared__ __align__(128) unsigned char smem6[];
  __shared__ Stats scratch[kBlock / 32 + 1];
  __shared__ __align__(16) Stats inbox[kInbox][kMaxCluster];
  __shared__ unsigned long long full[kMaxStages];
  __shared__ unsigned long long inbar[kInbox];
  __shared__ RowMath rowmath;

  cg::cluster_group cluster = cg::this_cluster();
  const int csize = static_cast<int>(cluster.num_blocks());
  const int rank = static_cast<int>(cluster.block_rank());
  const int tid = threadIdx.x;
  const int start = rank * p.chunk;
  const int end = min(start + p.chunk, p.vocab);
  const int n = max(0, end - start);
  const unsigned slice_bytes = static_cast<unsigned>(n) * sizeof(T);
  const long long g = blockIdx.x / csize;
  const long long ncl = gridDim.x / csize;
  // rows <= INT_MAX (CrossEntropyCudaLaunch), so local counts fit an int.
  const int nrows =
      g < p.rows ? static_cast<int>((p.rows - g + ncl - 1) / ncl) : 0;
  const unsigned inbox_bytes = static_cast<unsigned>(csize * sizeof(Stats));

  if (tid == 0) {
    for (int s = 0; s < stages; ++s) MbarInit(&full[s], 1);
    for (int s = 0; s < kInbox; ++s) MbarInit(&inbar[s], 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  // Peers' mbarriers and inboxes may be used only once every peer has
  // started and initialised them.
  cluster.sync();
  const WorkspaceHeader hdr = *p.header;
  if (hdr.error) return;  // uniform: the whole grid leaves, nothing written

  // Stage and mbarrier parity of a local row, advanced row by row: no
  // division on the row's chain (a 64-bit modulo costs ~100 instructions).
  struct Ring {
    int stage;
    unsigned parity;
  };
  const auto advance = [&](Ring r) {
    if (++r.stage == stages) {
      r.stage = 0;
      r.parity ^= 1u;
    }
    return r;
  };
  const auto stage_ptr = [&](const Ring& r) {
    return reinterpret_cast<T*>(smem6 + r.stage * stage_bytes);
  };
  const auto row_of = [&](int i) { return g + i * ncl; };
  const auto target_of = [&](int i) {
    return i < nrows ? LoadTarget(p, row_of(i)) : p.ignore_index;
  };
  // Thread 0 only: bring local row i's slice into stage r.
  const auto issue = [&](int i, const Ring& r) {
    if (i >= nrows || slice_bytes == 0) return;
    unsigned long long* bar = &full[r.stage];
    const char* src = reinterpret_cast<const char*>(
        static_cast<const T*>(p.logits) + row_of(i) * p.stride + start);
    char* dst = reinterpret_cast<char*>(stage_ptr(r));
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    MbarExpectTx(bar, slice_bytes);
    constexpr unsigned kPiece = 16384;
    for (unsigned off = 0; off < slice_bytes; off += kPiece) {
      BulkLoad(dst + off, src + off, min(kPiece, slice_bytes - off), bar);
    }
  };
  // Thread 0 only: expect row i's partials from every peer. A block alone in
  // its cluster stores its partial with a plain store and reads it back in
  // the same thread (lane 0 of warp 0): the phase needs no transaction (the
  // sanitizer refuses st.async within a one-block cluster).
  const auto arm = [&](int i) {
    if (i >= nrows) return;
    if (csize == 1) {
      MbarArrive(&inbar[i % kInbox]);
    } else {
      MbarExpectTx(&inbar[i % kInbox], inbox_bytes);
    }
  };
  const bool forward_only = p.grad == nullptr;
  // Statistics of local row i (target y, stage r): block-merged and sent to
  // every peer; *zy gets the target logit when this block owns column y.
  const auto stats_and_push = [&](int i, const Ring& r, long long y,
                                  float* zy) {
    const T* sl = stage_ptr(r);
    if (slice_bytes != 0) MbarWait(&full[r.stage], r.parity);
    Stats st = SliceStats<T, kBlock>(sl, n, start, tid);
    const bool mine = y != p.ignore_index && y >= start && y < end;
    *zy = mine ? Tr::Load(sl + (y - start)) : 0.0f;
    st = BlockMergeStats<kBlock>(st, scratch);  // every thread is past sl
    if (forward_only && tid == 0) issue(i + stages, r);
    if (csize == 1) {
      if (tid == 0) inbox[i % kInbox][0] = st;
    } else if (tid < csize) {
      StAsyncStats(&inbox[i % kInbox][rank], tid, st, &inbar[i % kInbox]);
    }
  };

  Ring ring = {0, 0u};
  if (tid == 0) {
    for (int i = 0; i < kInbox; ++i) arm(i);
    Ring r = ring;
    for (int i = 0; i < stages; ++i, r = advance(r)) issue(i, r);
  }
  long long y = target_of(0);
  long long y_next = target_of(1);
  float zy = 0.0f, zy_next = 0.0f;
  if (nrows > 0) stats_and_push(0, ring, y, &zy);
  const int warp = tid / 32;
  const int lane = tid % 32;
#pragma unroll 1
  for (int i = 0; i < nrows; ++i) {
    const long long row = row_of(i);
    const long long y_after = target_of(i + 2);  // in flight meanwhile
    const Ring next = advance(ring);
    // The next row's statistics while the peers finish this one.
    if (i + 1 < nrows) stats_and_push(i + 1, next, y_next, &zy_next);
    // One warp awaits and merges the partials (fixed order); the others
    // sleep at the barrier and leave the issue slots to the SM's other block.
    if (warp == 0) {
      MbarWaitCluster(&inbar[i % kInbox],
                      static_cast<unsigned>((i / kInbox) & 1));
      const Stats m =
          WarpMergeStats(lane < csize ? inbox[i % kInbox][lane] : EmptyStats());
      if (lane == 0) scratch[0] = m;
    }
    __syncthreads();
    const Stats row_st = scratch[0];
    const bool valid = y != p.ignore_index;
    const bool owner = valid ? (y >= start && y < end) : rank == 0;
    const T* sl = stage_ptr(ring);

    if (tid == 0) arm(i + kInbox);
    if (warp == 0) {
      const RowMath rm = MakeRowMath(p, hdr, row_st, valid, zy, 1.0f);
      if (lane == 0) {
        rowmath = rm;
        if (owner) WriteRowOutputs(p, row, valid, y, rm, row_st.arg, true);
      }
    }
    __syncthreads();
    const RowMath rm = rowmath;

    if (!forward_only) {
      T* out = static_cast<T*>(p.grad) + row * p.stride + start;
      const uint4* sv = reinterpret_cast<const uint4*>(sl);
      const int nvec = n / kVec;
      if (!valid) {
        ZeroSlice<T, kBlock>(out, nvec, tid);
      } else {
        GradientSlice<T, kBlock>(sv, out, nvec, tid, rm);
        // The target column, computed without cancellation, overwrites what
        // the same thread stored there (program order).
        const int yl = static_cast<int>(y - start);
        if (owner && (yl / kVec) % kBlock == tid) Tr::Store(out + yl, rm.gy);
      }
      __syncthreads();  // every thread is done with this row's stage
      if (tid == 0) issue(i + stages, ring);
    }
    ring = next;
    y = y_next;
    y_next = y_after;
    zy = zy_next;
  }
}

// Makes `cfg` launch `kernel` in clusters of `csize` blocks along x, with
// `attr` (which must outlive the launch) as its one attribute; clusters past
// 8 blocks (the portable size) are allowed first.
template <typename... KernelArgs>
cudaError_t SetClusterLaunch(void (*kernel)(KernelArgs...), int csize,
                             cudaLaunchAttribute* attr,
                             cudaLaunchConfig_t* cfg) {
  if (csize > 8) {
    const cudaError_t e = cudaFuncSetAttribute(
        kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
    if (e != cudaSuccess) return e;
  }
  attr->id = cudaLaunchAttributeClusterDimension;
  attr->val.clusterDim.x = csize;
  attr->val.clusterDim.y = 1;
  attr->val.clusterDim.z = 1;
  cfg->attrs = attr;
  cfg->numAttrs = 1;
  return cudaSuccess;
}

// Launches `kernel` with `cfg` (block, shared memory and stream set) in
// clusters of `csize` blocks on a persistent grid: as many clusters as can be
// resident at once, at most one a row.
template <typename... KernelArgs, typename... Args>
cudaError_t LaunchPersistentClusters(void (*kernel)(KernelArgs...),
                                     cudaLaunchConfig_t cfg, int csize,
                                     long long rows, Args... args) {
  cudaLaunchAttribute attr;
  const cudaError_t set = SetClusterLaunch(kernel, csize, &attr, &cfg);
  if (set != cudaSuccess) return set;
  cfg.gridDim = dim3(static_cast<unsigned>(csize));
  int clusters = 0;
  const cudaError_t e = cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg);
  if (e != cudaSuccess || clusters <= 0) {
    cudaGetLastError();
    return e != cudaSuccess ? e : cudaErrorInvalidConfiguration;
  }
  cfg.gridDim =
      dim3(static_cast<unsigned>(std::min<long long>(rows, clusters) * csize));
  return cudaLaunchKernelEx(&cfg, kernel, args...);
}

// v6 launch: clusters of `csize` blocks, `ctas_per_sm` (1: 512 threads, 2:
// 256 threads) blocks a SM, `stages` stage buffers of the slice (0 = as many
// as fit, at most kMaxStages), a persistent grid. (Two 512-thread blocks a SM
// measured 10-16 points slower than either: bench/NOTES.md, v6.)
template <typename T>
cudaError_t LaunchTma(const Params& p, int csize, int ctas_per_sm, int stages,
                      cudaStream_t stream) {
  const bool two = ctas_per_sm == 2;
  auto kernel = two ? TmaKernel<T, 256, 2> : TmaKernel<T, 512, 1>;
  int device = 0, per_sm = 0, optin = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e == cudaSuccess) {
    e = cudaDeviceGetAttribute(
        &per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device);
  }
  if (e == cudaSuccess) {
    e = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                               device);
  }
  if (e != cudaSuccess) return e;
  const int stage_bytes = static_cast<int>(
      (static_cast<long long>(p.chunk) * sizeof(T) + 127) / 128 * 128);
  // Per block: its share of the SM less the runtime's 1 KiB reservation and
  // the kernel's static shared memory (< 2 KiB).
  const int room = std::min(optin, per_sm / (two ? 2 : 1) - 1024) - 2048;
  const int fit = std::min(kMaxStages, room / stage_bytes);
  if (stages <= 0) stages = fit;
  if (stages < 2 || stages > fit) return cudaErrorInvalidConfiguration;
  const int dyn = stages * stage_bytes;
  e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           dyn);
  if (e != cudaSuccess) return e;
  cudaLaunchConfig_t cfg = {};
  cfg.blockDim = dim3(two ? 256 : 512);
  cfg.dynamicSmemBytes = static_cast<std::size_t>(dyn);
  cfg.stream = stream;
  return LaunchPersistentClusters(kernel, cfg, csize, p.rows, p, stages,
                                  stage_bytes);
}

// ---- v7: forward-only, row pieces on independent blocks -------------------

// Forward-only needs no row on chip, only its statistics: every block takes
// one piece of one row (p.chunk elements), computes the piece's statistics
// from global memory and writes them to the workspace; a second kernel merges
// each row's pieces in a fixed order (one warp a row) and writes the row's
// outputs. No cluster, no exchange, no barrier between blocks: a block's
// reductions overlap the other resident blocks' loads. One read of the logits.
// Plain options only (z-loss), like v5 and v6.
// Per-row statistics slots in the workspace (at most a warp: one warp merges
// them). 32 since session 5: v9 splits fp32 1 MiB rows into 22 pieces of 48
// KiB, four blocks a SM (at 16, 64 KiB pieces fit three: 83% against 89-91%).
constexpr int kMaxPieces = 32;

template <typename T, bool kPrefetch>
__global__ void __launch_bounds__(kThreads, 4)
    PieceStatsKernel(Params p, int per_row) {
  __shared__ Stats scratch[kThreads / 32 + 1];
  if (p.header->error) return;  // uniform: nothing is written
  const long long item = blockIdx.x;
  const long long row = item / per_row;
  const int start = static_cast<int>(item - row * per_row) * p.chunk;
  const int n = max(0, min(p.chunk, p.vocab - start));
  const T* s = static_cast<const T*>(p.logits) + row * p.stride + start;
  Stats st = SliceStats<T, kThreads, kPrefetch>(s, n, start, threadIdx.x);
  st = BlockMergeStats<kThreads>(st, scratch);
  if (threadIdx.x == 0) {
    static_cast<Stats*>(p.pieces)[row * kMaxPieces + (item - row * per_row)] =
        st;
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    PieceMergeKernel(Params p, int per_row) {
  const long long row =
      static_cast<long long>(blockIdx.x) * (kThreads / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= p.rows) return;
  const WorkspaceHeader hdr = *p.header;
  if (hdr.error) return;
  const Stats st = WarpMergeStats(
      lane < per_row
          ? static_cast<const Stats*>(p.pieces)[row * kMaxPieces + lane]
          : EmptyStats());
  const long long y = LoadTarget(p, row);
  const bool valid = y != p.ignore_index;
  const float zy = valid ? Traits<T>::Load(static_cast<const T*>(p.logits) +
                                           row * p.stride + y)
                         : 0.0f;
  const RowMath rm = MakeRowMath(p, hdr, st, valid, zy, 1.0f);
  if (lane == 0) WriteRowOutputs(p, row, valid, y, rm, st.arg, true);
}

// v7 launch: `per_row` (<= kMaxPieces) pieces of p.chunk elements a row;
// `prefetch`: each thread keeps two batches of loads in flight.
template <typename T>
cudaError_t LaunchPieces(const Params& p, int per_row, bool prefetch,
                         cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(p.rows * per_row));
  if (prefetch) {
    PieceStatsKernel<T, true><<<grid, kThreads, 0, stream>>>(p, per_row);
  } else {
    PieceStatsKernel<T, false><<<grid, kThreads, 0, stream>>>(p, per_row);
  }
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  constexpr int kRowsPerBlock = kThreads / 32;
  PieceMergeKernel<T>
      <<<static_cast<unsigned>((p.rows + kRowsPerBlock - 1) / kRowsPerBlock),
         kThreads, 0, stream>>>(p, per_row);
  return cudaGetLastError();
}

// ---- v8: forward+gradient on row pieces, the row kept in L2 ----------------

// v7's independent row pieces for forward+gradient: one persistent kernel
// takes work items from a global counter in a fixed sequence of row groups,
// statistics of group g + 1 before the gradient of group g:
//   S(0) S(1) G(0) S(2) G(1) ... S(n - 1) G(n - 2) - G(n - 1)
// A statistics item reads one piece of one row from DRAM (v7's loop), writes
// the piece's Stats (and, where it holds the target column, the target
// logit) and counts itself done for the row (release). A gradient item waits
// for its row's count (acquire), merges the row's pieces in a fixed order,
// and re-reads its piece -- from L2, a group (group_rows rows) having been
// read only one group earlier -- to write the gradient with streaming stores.
// One read and one write of the logits in DRAM while two groups fit in L2.
// No deadlock with every block resident: a block waits only in a gradient
// item, for statistics items taken earlier by blocks that never wait in them.
// Plain options only (z-loss, grad_scale), like v5 to v7.
// kHints: the statistics loads mark their lines evict-last in L2, the
// gradient's re-reads and stores evict-first, so that the groups waiting for
// their gradient outlive the lines already written (bench/NOTES.md "v8":
// bf16 72-73% -> 77-78% of copy in one run; fewer re-reads miss L2).

__device__ __forceinline__ int LoadAcquire(const int* ptr) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];"
               : "=r"(v)
               : "l"(ptr)
               : "memory");
  return v;
}

// v8, v9: one warp waits until all `per_row` pieces of `row` have published
// their statistics (every lane acquires the count itself before it reads
// them), then merges them in a fixed order: every piece of a row gets the
// same bits.
__device__ __forceinline__ Stats MergeRowPieces(const Params& p, long long row,
                                                int per_row, int lane) {
  while (LoadAcquire(p.row_done + row) < per_row) __nanosleep(32);
  Stats ps = EmptyStats();
  if (lane < per_row) {
    const Stats* from =
        static_cast<const Stats*>(p.pieces) + row * kMaxPieces + lane;
    ps.m = __ldcg(&from->m);
    ps.t = __ldcg(&from->t);
    ps.sum_wz = __ldcg(&from->sum_wz);
    ps.arg = __ldcg(&from->arg);
  }
  return WarpMergeStats(ps);
}

template <typename T, bool kHints>
__global__ void __launch_bounds__(kThreads, 4)
    L2PieceKernel(Params p, int per_row, int group_rows, int lookahead) {
  using Tr = Traits<T>;
  constexpr int kVec = Tr::kVec;
  __shared__ Stats scratch[kThreads / 32 + 1];
  __shared__ long long item_s[2];
  __shared__ RowMath rowmath;
  __shared__ int row_y;  // the target's column in the piece, or kIgnoredRow
  constexpr int kIgnoredRow = INT_MIN;
  const WorkspaceHeader hdr = *p.header;
  if (hdr.error) return;  // uniform: nothing is written
  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  Stats* const pieces = static_cast<Stats*>(p.pieces);
  const long long groups = (p.rows + group_rows - 1) / group_rows;
  const long long per_slot = static_cast<long long>(group_rows) * per_row;
  const long long total = (lookahead + 2 * groups) * per_slot;
  const unsigned long long keep = kHints ? L2EvictLast() : 0;
  const unsigned long long drop = kHints ? L2EvictFirst() : 0;
#pragma unroll 1
  for (int turn = 0;; turn ^= 1) {
    if (tid == 0)
      item_s[turn] =
          static_cast<long long>(atomicAdd(&p.header->next_item, 1ull));
    __syncthreads();  // (item_s[turn ^ 1] is not read again before the next)
    const long long k = item_s[turn];
    if (k >= total) break;
    const long long slot = k / per_slot;
    const long long o = k - slot * per_slot;
    // Slots: S(0) .. S(L - 1), then S(L + i) and G(i) in turns (L =
    // lookahead); statistics past the last group are empty slots.
    const long long t = slot - lookahead;
    const bool stats = t < 0 || t % 2 == 0;
    const long long group = t < 0 ? slot : stats ? lookahead + t / 2 : t / 2;
    if (group >= groups) continue;
    const long long row = group * group_rows + o / per_row;
    if (row >= p.rows) continue;
    const int piece = static_cast<int>(o % per_row);
    const int start = piece * p.chunk;
    const int n = max(0, min(p.chunk, p.vocab - start));
    const T* src = static_cast<const T*>(p.logits) + row * p.stride + start;
    if (stats) {
      Stats st =
          SliceStats<T, kThreads, true, kHints>(src, n, start, tid, keep);
      st = BlockMergeStats<kThreads>(st, scratch);
      if (tid == 0) {
        pieces[row * kMaxPieces + piece] = st;
        const long long y = LoadTarget(p, row);
        if (y != p.ignore_index && y >= start && y < start + n) {
          p.row_zy[row] = Tr::Load(src + (y - start));
        }
        __threadfence();
        atomicAdd(p.row_done + row, 1);
      }
      continue;
    }
    if (warp == 0) {
      const Stats st = MergeRowPieces(p, row, per_row, lane);
      const long long y = LoadTarget(p, row);
      const bool valid = y != p.ignore_index;
      const float zy = valid ? __ldcg(p.row_zy + row) : 0.0f;
      const RowMath rm = MakeRowMath(p, hdr, st, valid, zy, 1.0f);
      const bool owner = valid ? (y >= start && y < start + n) : piece == 0;
      if (lane == 0) {
        rowmath = rm;
        if (owner) WriteRowOutputs(p, row, valid, y, rm, st.arg, true);
        row_y = valid ? static_cast<int>(y - start) : kIgnoredRow;
      }
    }
    __syncthreads();
    const RowMath rm = rowmath;
    const int yl = row_y;
    const uint4* sv = reinterpret_cast<const uint4*>(src);
    uint4* out = reinterpret_cast<uint4*>(static_cast<T*>(p.grad) +
                                          row * p.stride + start);
    const int nvec = n / kVec;
    if (yl == kIgnoredRow) {
      const float zero[kVec] = {};
      uint4 zv;
      Tr::Pack(zero, &zv);
#pragma unroll 4
      for (int q = tid; q < nvec; q += kThreads) {
        if (kHints) {
          StoreStreamWithPolicy(out + q, zv, drop);
        } else {
          __stcs(out + q, zv);
        }
      }
    } else {
      constexpr int kB = 4;
#pragma unroll 1
      for (int q0 = tid; q0 < nvec; q0 += kB * kThreads) {
        uint4 v[kB];
#pragma unroll
        for (int b = 0; b < kB; ++b) {
          const int q = q0 + b * kThreads;
          if (q < nvec) {
            v[b] = kHints ? LoadWithPolicy(sv + q, drop) : __ldcg(sv + q);
          }
        }
#pragma unroll
        for (int b = 0; b < kB; ++b) {
          const int q = q0 + b * kThreads;
          if (q >= nvec) break;
          float gr[kVec];
#pragma unroll
          for (int j = 0; j < kVec; ++j) {
            gr[j] = fmaf(Exp2(fmaf(Tr::Get(v[b], j), kLog2e, -rm.lse_l2)), rm.a,
                         rm.b);
          }
          uint4 o4;
          Tr::Pack(gr, &o4);
          if (kHints) {
            StoreStreamWithPolicy(out + q, o4, drop);
          } else {
            __stcs(out + q, o4);
          }
        }
      }
      // The target column, computed without cancellation, overwrites what
      // the same thread stored there (program order).
      if (yl >= 0 && yl < n && (yl / kVec) % kThreads == tid) {
        Tr::Store(static_cast<T*>(p.grad) + row * p.stride + start + yl, rm.gy);
      }
    }
    __syncthreads();  // rowmath and row_y are rewritten by the next item
  }
}

// v7's and v8's split of a row of `vocab` elements (`row_bytes` bytes) into
// at most kMaxPieces pieces of about `slice_kib` KiB (`default_kib` when 0),
// each a multiple of `vec` elements; the last piece may be shorter.
struct RowPieces {
  int chunk;   // elements a piece
  int pieces;  // pieces a row
};
RowPieces SplitRow(long long vocab, long long row_bytes, int vec, int slice_kib,
                   int default_kib) {
  const long long slice =
      static_cast<long long>(slice_kib > 0 ? slice_kib : default_kib) * 1024;
  const long long per_row = std::min<long long>(
      kMaxPieces, std::max<long long>(1, (row_bytes + slice - 1) / slice));
  const long long chunk =
      ((vocab + per_row - 1) / per_row + vec - 1) / vec * vec;
  return {static_cast<int>(chunk),
          static_cast<int>((vocab + chunk - 1) / chunk)};
}

// v8 launch: `per_row` (<= kMaxPieces) pieces of p.chunk elements a row,
// groups of `group_rows` rows, statistics `lookahead` groups ahead of the
// gradient, a persistent grid of every block that fits.
template <typename T, bool kHints>
cudaError_t LaunchL2Pieces(const Params& p, int per_row, int group_rows,
                           int lookahead, cudaStream_t stream) {
  int device = 0, sms = 0, per_sm = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e == cudaSuccess) {
    e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  }
  if (e == cudaSuccess) {
    e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &per_sm, L2PieceKernel<T, kHints>, kThreads, 0);
  }
  if (e != cudaSuccess) return e;
  if (per_sm <= 0) return cudaErrorInvalidConfiguration;
  L2PieceKernel<T, kHints>
      <<<static_cast<unsigned>(sms * per_sm), kThreads, 0, stream>>>(
          p, per_row, group_rows, lookahead);
  return cudaGetLastError();
}

// ---- v9: forward+gradient on row pieces kept in shared memory -----------

// Asks the TMA unit to bring `bytes` (a multiple of 16) at `src` (16-byte
// aligned) into L2; nothing waits for it.
__device__ __forceinline__ void BulkPrefetchL2(const void* src,
                                               unsigned bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(src),
               "r"(bytes)
               : "memory");
}
// v9's piece slot: a piece's statistics and the row's target logit if the
// piece holds it, published with one 16-byte atomic (no fence, no count):
// `tag` = the piece's argmax + 1, never 0, so a zeroed slot is empty, and
// a waiter reads everything it needs in the one access that finds it full.
struct alignas(16) PieceSlot {
  float m;
  float t;
  float zy;
  unsigned tag;
};
__device__ __forceinline__ void PublishSlot(PieceSlot* slot, const Stats& st,
                                            float zy) {
  asm volatile(
      "{\n.reg .b128 d, b;\n.reg .b64 lo, hi;\n"
      "mov.b64 lo, {%1, %2};\nmov.b64 hi, {%3, %4};\n"
      "mov.b128 b, {lo, hi};\n"
      "atom.relaxed.gpu.global.exch.b128 d, [%0], b;\n}\n" ::"l"(slot),
      "r"(__float_as_uint(st.m)), "r"(__float_as_uint(st.t)),
      "r"(__float_as_uint(zy)), "r"(static_cast<unsigned>(st.arg) + 1u)
      : "memory");
}
// The slot's 16 bytes read atomically (a compare-and-swap of zero with zero
// leaves the slot unchanged and returns it whole).
__device__ __forceinline__ PieceSlot ReadSlot(PieceSlot* slot) {
  unsigned a, b, c, d;
  asm volatile(
      "{\n.reg .b128 r, z;\n.reg .b64 lo, hi;\n"
      "mov.b128 z, {0, 0};\n"
      "atom.relaxed.gpu.global.cas.b128 r, [%4], z, z;\n"
      "mov.b128 {lo, hi}, r;\n"
      "mov.b64 {%0, %1}, lo;\nmov.b64 {%2, %3}, hi;\n}\n"
      : "=r"(a), "=r"(b), "=r"(c), "=r"(d)
      : "l"(slot)
      : "memory");
  return {__uint_as_float(a), __uint_as_float(b), __uint_as_float(c), d};
}

// `ablate` (diagnostic, bench only; results are wrong): stages left out to
// measure what each costs (bench/NOTES.md "v9, session 5").
constexpr int kAblateRowWait = 1;   // each piece is its own row: no publish,
                                    // no wait for the row's other pieces
constexpr int kAblateGradient = 2;  // the piece is stored back unchanged
constexpr int kAblateStats = 4;     // the piece is read without statistics
constexpr int kAblatePollSleep = 8;
// v9's ways to bring a piece into shared memory (CrossEntropyCudaConfig::
// piece_load): the threads' loads through registers, or bulk copies (TMA)
// issued when the piece is taken.
constexpr int kLoadRegisters = 1;
constexpr int kLoadBulk = 2;
// v9 with bulk copies: barriers a block has for the chunks of its piece.
constexpr int kBulkChunks = 8;
// CrossEntropyCudaConfig::trace: words a v9 item records.
constexpr int kTraceWords = 5;
__device__ __forceinline__ unsigned long long GlobalTimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}  // the slot poll does not sleep between
   // reads

// v7's independent row pieces, each kept in shared memory until its row's
// statistics are known: a persistent block takes one piece at a time from a
// global counter (pieces in row order), reads it once from DRAM into
// registers and shared memory while computing its statistics (kLoadBulk: the
// TMA unit copies it into shared memory, in chunks of one batch of the
// statistics loop, each completing on its own mbarrier, as soon as the piece
// is taken; the statistics then read it from there), publishes them
// into the piece's slot with one 16-byte atomic (PieceSlot), waits for the
// row's other slots (one warp polls them all, each lane reading a whole slot
// in one atomic access, and merges them in a fixed order, every piece of a
// row getting the same bits) and writes the gradient from shared memory. One
// read and one write of the logits, through L2 once (v8 re-reads through L2,
// bench/NOTES.md). Plain options only (z-loss, grad_scale), like v5 to v8.
//
// What a piece waits for is the slowest piece of its row (bench/NOTES.md "v9,
// session 5": the wait costs 3-10 points of copy bandwidth), so the chain is
// kept short: one round trip to L2 finds a full slot with everything in it
// (session 4 had a count per row behind a fence, then the slots, then the
// target logit: three), and when a block takes item k, its last warp has the
// TMA unit prefetch item k + `ahead`'s piece into L2, so that whoever takes
// that piece reads it from L2 and the pieces of a row finish closer together.
//
// No deadlock while at least `per_row` blocks are resident (checked at
// launch): a block publishes its piece before it waits, items are taken in
// order, so only the row being handed out can be incomplete, and it holds at
// most per_row - 1 waiting blocks; every other block finishes and takes the
// rest. The next item is taken at the top of the loop, not during the
// gradient: taken earlier, a row's pieces start further apart and their
// blocks wait longer (measured: bf16 4096 x 262144 82% -> 71%); before the
// wait it could deadlock (a block holding an unpublished piece of the row it
// waits for).
template <typename T, int kBlock, int kMinBlocks, int kLoad>
__global__ void __launch_bounds__(kBlock, kMinBlocks)
    SmemPieceKernel(Params p, int per_row, long long ahead, int ablate,
                    unsigned long long* trace) {
  using Tr = Traits<T>;
  constexpr int kVec = Tr::kVec;
  constexpr bool kBulk = kLoad == kLoadBulk;
  extern __shared__ uint4 kept[];
  __shared__ Stats scratch[kBlock / 32 + 1];
  __shared__ long long item_s;
  __shared__ RowMath rowmath;  // of the item's row
  // kBulk: landed[c] completes when chunk c of the piece (kChunkBytes, the
  // bytes of one SliceStats batch of the block) is in `kept`.
  constexpr unsigned kChunkBytes = kU * kBlock * 16;
  __shared__ unsigned long long landed[kBulkChunks];
  const WorkspaceHeader hdr = *p.header;
  if (hdr.error) return;  // uniform: nothing is written
  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  PieceSlot* const slots = static_cast<PieceSlot*>(p.pieces);  // by item
  const long long total = p.rows * per_row;
  unsigned parity = 0;
  // Every chunk barrier completes a phase every item (empty ones with a plain
  // arrive), so one parity serves them all.
  const int chunks = static_cast<int>(
      (static_cast<unsigned>(p.chunk) * sizeof(T) + kChunkBytes - 1) /
      kChunkBytes);
  // Thread 0: chunk c of item k's piece into `kept` by the TMA unit (an
  // empty chunk only completes its barrier's phase).
  const auto bring = [&](long long k, int c) {
    const long long r = k / per_row;
    const int s0 = static_cast<int>(k - r * per_row) * p.chunk;
    const unsigned bytes =
        static_cast<unsigned>(max(0, min(p.chunk, p.vocab - s0))) * sizeof(T);
    const unsigned off = c * kChunkBytes;
    const unsigned len = off < bytes ? min(kChunkBytes, bytes - off) : 0;
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    MbarExpectTx(&landed[c], len);
    if (len > 0) {
      BulkLoad(reinterpret_cast<char*>(kept) + off,
               reinterpret_cast<const char*>(static_cast<const T*>(p.logits) +
                                             r * p.stride + s0) +
                   off,
               len, &landed[c]);
    }
  };
  if (kBulk && tid == 0) {
    for (int c = 0; c < chunks; ++c) MbarInit(&landed[c], 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
#pragma unroll 1
  for (;;) {
    if (tid == 0) {
      const long long k =
          static_cast<long long>(atomicAdd(&p.header->next_item, 1ull));
      item_s = k;
      if (kBulk && k < total) {
        // The whole piece into `kept` by the TMA unit at once (the block's
        // reads of the previous piece are over: the barrier at the end).
        for (int c = 0; c < chunks; ++c) bring(k, c);
      }
    }
    __syncthreads();
    const long long k = item_s;
    if (k >= total) break;
    if (trace != nullptr && tid == 0) trace[k * kTraceWords] = GlobalTimer();
    if (ahead > 0 && tid == kBlock - 32 && k + ahead < total) {
      // (the last warp: off warp 0's publish and merge)
      const long long rn = (k + ahead) / per_row;
      const int sn = static_cast<int>(k + ahead - rn * per_row) * p.chunk;
      const int nn = max(0, min(p.chunk, p.vocab - sn));
      if (nn > 0) {
        BulkPrefetchL2(static_cast<const T*>(p.logits) + rn * p.stride + sn,
                       static_cast<unsigned>(nn * sizeof(T)));
      }
    }
    const long long row = k / per_row;
    const int piece = static_cast<int>(k - row * per_row);
    const int start = piece * p.chunk;
    const int n = max(0, min(p.chunk, p.vocab - start));
    const T* src = static_cast<const T*>(p.logits) + row * p.stride + start;
    Stats st;
    if (!kBulk && (ablate & kAblateStats)) {
      const uint4* sv = reinterpret_cast<const uint4*>(src);
#pragma unroll 4
      for (int q = tid; q < n / kVec; q += kBlock) kept[q] = sv[q];
      st = EmptyStats();
      st.m = 0.0f;
      st.t = 0.0f;
    } else if (kBulk) {
      // Each batch once its chunk has landed (batch q0 is chunk
      // (q0 - tid) / (kU * kBlock)).
      st = SliceStats<T, kBlock>(reinterpret_cast<const T*>(kept), n, start,
                                 tid, 0, nullptr, [&](int q0) {
                                   MbarWait(&landed[(q0 - tid) / (kU * kBlock)],
                                            parity);
                                 });
    } else {
      st = SliceStats<T, kBlock, true>(src, n, start, tid, 0, kept);
    }
    // The warps' statistics to shared memory; warp 0 alone merges them (the
    // others go on to the barrier before the gradient, which is also the one
    // that makes `kept` whole).
    {
      const Stats w = WarpMergeStats(st);
      if (lane == 0) scratch[warp] = w;
    }
    const long long y = LoadTarget(p, row);
    const bool valid = y != p.ignore_index;
    const int yl = static_cast<int>(y - start);
    __syncthreads();
    if (warp == 0) {
      constexpr int kWarps = kBlock / 32;
      st = WarpMergeStats(lane < kWarps ? scratch[lane] : EmptyStats());
      if (trace != nullptr && lane == 0) {
        trace[k * kTraceWords + 1] = GlobalTimer();
      }
      const bool alone = ablate & kAblateRowWait;
      PieceSlot* const row_slots = slots + (k - piece);
      if (lane == 0 && !alone) {
        const bool holds_y = valid && yl >= 0 && yl < n;
        if (kBulk && holds_y) {  // (this thread may not have waited on it)
          MbarWait(&landed[yl * sizeof(T) / kChunkBytes], parity);
        }
        const float zy =
            holds_y ? Tr::Load(reinterpret_cast<const T*>(kept) + yl) : 0.0f;
        PublishSlot(row_slots + piece, st, zy);
      }
      // Every lane polls its piece's slot until the row's are all full, then
      // the warp merges them in a fixed order.
      Stats ps = EmptyStats();
      float zy_lane = 0.0f;
      if (!alone) {
        bool full = lane >= per_row;
        while (!__all_sync(0xffffffffu, full)) {
          if (!full) {
            const PieceSlot v = ReadSlot(row_slots + lane);
            full = v.tag != 0;
            if (full) {
              ps.m = v.m;
              ps.t = v.t;
              ps.arg = static_cast<int>(v.tag - 1u);
              zy_lane = v.zy;
            } else if (!(ablate & kAblatePollSleep)) {
              __nanosleep(32);
            }
          }
        }
      }
      const Stats rs = alone ? st : WarpMergeStats(ps);
      const float zy =
          valid && !alone
              ? __shfl_sync(0xffffffffu, zy_lane, static_cast<int>(y / p.chunk))
              : 0.0f;
      const RowMath rm = MakeRowMath(p, hdr, rs, valid, zy, 1.0f);
      const bool owner = valid ? (yl >= 0 && yl < n) : piece == 0;
      if (lane == 0) {
        if (owner) WriteRowOutputs(p, row, valid, y, rm, rs.arg, true);
        rowmath = rm;
        if (trace != nullptr) trace[k * kTraceWords + 2] = GlobalTimer();
      }
    }
    __syncthreads();
    T* const out = static_cast<T*>(p.grad) + row * p.stride + start;
    const int nvec = n / kVec;
    if (ablate & kAblateGradient) {
#pragma unroll 4
      for (int q = tid; q < nvec; q += kBlock) {
        __stcs(reinterpret_cast<uint4*>(out) + q, kept[q]);
      }
    } else if (!valid) {
      ZeroSlice<T, kBlock>(out, nvec, tid);
    } else {
      const RowMath rm = rowmath;
      GradientSlice<T, kBlock>(kept, out, nvec, tid, rm);
      // The target column, computed without cancellation, overwrites what
      // the same thread stored there (program order).
      if (yl >= 0 && yl < n && (yl / kVec) % kBlock == tid) {
        Tr::Store(out + yl, rm.gy);
      }
    }
    parity ^= 1u;
    __syncthreads();  // kept, rowmath and item_s are rewritten by the next item
    if (trace != nullptr && tid == 0) {
      trace[k * kTraceWords + 3] = GlobalTimer();
      unsigned sm;
      asm("mov.u32 %0, %%smid;" : "=r"(sm));
      trace[k * kTraceWords + 4] =
          (static_cast<unsigned long long>(sm) << 32) | blockIdx.x;
    }
  }
}

// v9 launch: `per_row` (<= kMaxPieces) pieces of p.chunk elements a row, a
// persistent grid of every block that fits with a piece of shared memory;
// each taken item prefetches the piece `ahead_kib` KiB of logits ahead into
// L2 (< 0: none; 0: 256 KiB where four blocks fit a SM, else none).
// cudaErrorInvalidConfiguration when a piece does not fit a block's shared
// memory or fewer than per_row blocks would be resident (the caller then
// takes another path).
template <typename T, int kBlock, int kMinBlocks>
cudaError_t LaunchSmemPieces(const Params& p, int per_row, int ahead_kib,
                             int ablate, int load, unsigned long long* trace,
                             cudaStream_t stream) {
  const bool bulk = load == kLoadBulk;
  const auto kernel =
      bulk ? SmemPieceKernel<T, kBlock, kMinBlocks, kLoadBulk>
           : SmemPieceKernel<T, kBlock, kMinBlocks, kLoadRegisters>;
  const int smem =
      static_cast<int>(static_cast<long long>(p.chunk) * sizeof(T));
  int device = 0, sms = 0, per_sm = 0, smem_max = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e == cudaSuccess) {
    e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  }
  if (e == cudaSuccess) {
    e = cudaDeviceGetAttribute(&smem_max,
                               cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  }
  if (e != cudaSuccess) return e;
  // A piece past the shared memory of a block (rows past 32 such pieces):
  // another path takes the row.
  if (smem >
      smem_max - static_cast<int>(sizeof(Stats) * (kBlock / 32 + 1)) - 64) {
    return cudaErrorInvalidConfiguration;
  }
  if (bulk &&
      (smem + kU * kBlock * 16 - 1) / (kU * kBlock * 16) > kBulkChunks) {
    return cudaErrorInvalidConfiguration;
  }
  e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           smem);
  if (e == cudaSuccess) {
    e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kBlock,
                                                      smem);
  }
  if (e != cudaSuccess) return e;
  if (per_sm <= 0 || sms * per_sm < per_row) {
    return cudaErrorInvalidConfiguration;
  }
  const long long grid = static_cast<long long>(sms) * per_sm;
  // The prefetch (bench/NOTES.md "v9, session 5"): 256-512 KiB ahead, bf16
  // 82-83% -> 88-90% of copy at V >= 128k, fp32 +1-2 points; farther
  // measures worse (L2 holds the prefetched pieces longer), and with three
  // blocks of 64 KiB pieces a SM (fp32 1 MiB rows) any distance loses
  // (83% -> 72-73%).
  if (ahead_kib == 0) ahead_kib = per_sm >= 4 ? 256 : -1;
  // Empty piece slots (the kernel publishes into them by item).
  e = cudaMemsetAsync(p.pieces, 0, sizeof(PieceSlot) * p.rows * per_row,
                      stream);
  if (e != cudaSuccess) return e;
  kernel<<<static_cast<unsigned>(grid), kBlock, smem, stream>>>(
      p, per_row, ahead_kib > 0 ? std::max(1LL, ahead_kib * 1024LL / smem) : 0,
      ablate, trace);
  return cudaGetLastError();
}

// ---- generic path: one block per row, any alignment ----------------------

// Logits [N, V]; grid = N blocks. Reads the row three times (the later reads
// mostly from L2); used for unaligned rows and vocabularies past the cluster
// path's reach.
template <typename T>
__global__ void __launch_bounds__(kGenericThreads) GenericKernel(Params p) {
  using Tr = Traits<T>;
  __shared__ Stats scratch[kGenericThreads / 32 + 1];
  const WorkspaceHeader& hdr = *p.header;
  if (hdr.error) return;
  const long long row = blockIdx.x;
  const int vocab = p.vocab;
  const long long y = LoadTarget(p, row);
  const bool valid = y != p.ignore_index;
  const T* in = static_cast<const T*>(p.logits) + row * p.stride;
  T* out = p.grad ? static_cast<T*>(p.grad) + row * p.stride : nullptr;
  const float c = p.softcap;

  float zy = 0.0f, wy = 1.0f, unused;
  if (valid) {
    const float xy = Tr::Load(in + y);
    zy = c > 0 ? SoftcapZ(xy, c, &unused) : xy;
    if (p.weights) wy = p.weights[y];
  }
  Stats st;
  st.m = -INFINITY;
  st.t = 0.0f;
  st.sum_wz = 0.0f;
  st.arg = INT_MAX;
  for (int i = threadIdx.x; i < vocab; i += kGenericThreads) {
    float z = Tr::Load(in + i);
    if (c > 0) z = SoftcapZ(z, c, &unused);
    if (z > st.m) {
      st.m = z;
      st.arg = i;
    }
    if (p.eps > 0) st.sum_wz += (p.weights ? p.weights[i] : 1.0f) * z;
  }
  for (int i = threadIdx.x; i < vocab; i += kGenericThreads) {
    float z = Tr::Load(in + i);
    if (c > 0) z = SoftcapZ(z, c, &unused);
    const float e = expf(z - st.m);
    st.t += i == st.arg ? 0.0f : e;
  }
  if (st.m == -INFINITY) st.t = -1.0f;
  st = BlockReduce<kGenericThreads>(st, scratch);  // also orders the zy read
  const RowMath rm = MakeRowMath(p, hdr, st, valid, zy, wy);
  if (threadIdx.x == 0) WriteRowOutputs(p, row, valid, y, rm, st.arg, true);
  if (!out) return;
  for (int i = threadIdx.x; i < vocab; i += kGenericThreads) {
    float dfac = 1.0f;
    float z = Tr::Load(in + i);
    if (c > 0) z = SoftcapZ(z, c, &dfac);
    const float wc = p.weights ? p.weights[i] : 1.0f;
    float gz = Exp2(fmaf(z, kLog2e, -rm.lse_l2)) * rm.a + rm.b * wc;
    if (valid && i == y) gz = rm.gy;
    Tr::Store(out + i, valid ? gz * dfac : 0.0f);
  }
}

// ---- launch
// ------------------------------------------------------------------

template <typename T, int VPT, bool kGeneral>
cudaError_t LaunchCluster(const Params& p, int csize, cudaStream_t stream) {
  auto kernel = ClusterKernel<T, VPT, kGeneral>;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(p.rows * csize));
  cfg.blockDim = dim3(kThreads);
  cfg.stream = stream;
  cudaLaunchAttribute attr;
  const cudaError_t e = SetClusterLaunch(kernel, csize, &attr, &cfg);
  if (e != cudaSuccess) return e;
  return cudaLaunchKernelEx(&cfg, kernel, p);
}

// v5 launch; `ctas_per_sm` > 0 caps resident blocks per SM with dynamic
// shared memory that the kernel never touches.
template <typename T>
cudaError_t LaunchStream(const Params& p, int csize, int ctas_per_sm,
                         cudaStream_t stream) {
  // The build for 3 blocks a SM by default: the one for 4 spills per-row
  // state and measured 25-35% slower (bench/NOTES.md, v5).
  auto kernel = ctas_per_sm == 4 ? StreamKernel<T, 4> : StreamKernel<T, 3>;
  if (ctas_per_sm == 3 || ctas_per_sm == 4) ctas_per_sm = 0;
  int dyn_smem = 0;
  if (ctas_per_sm > 0) {
    int device = 0, per_sm = 0;
    cudaError_t e = cudaGetDevice(&device);
    if (e == cudaSuccess) {
      e = cudaDeviceGetAttribute(
          &per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device);
    }
    if (e != cudaSuccess) return e;
    dyn_smem = std::max(0, per_sm / ctas_per_sm - 4096);  // static + reserved
    e = cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, dyn_smem);
    if (e != cudaSuccess) return e;
  }
  cudaLaunchConfig_t cfg = {};
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = static_cast<std::size_t>(dyn_smem);
  cfg.stream = stream;
  return LaunchPersistentClusters(kernel, cfg, csize, p.rows, p);
}

template <typename T, bool kGeneral>
cudaError_t LaunchClusterVpt(const Params& p, int vpt, int csize,
                             cudaStream_t stream) {
  switch (vpt) {
    case 1:
      return LaunchCluster<T, 1, kGeneral>(p, csize, stream);
    case 2:
      return LaunchCluster<T, 2, kGeneral>(p, csize, stream);
    case 4:
      return LaunchCluster<T, 4, kGeneral>(p, csize, stream);
    case 8:
      return LaunchCluster<T, 8, kGeneral>(p, csize, stream);
    case 16:
      return LaunchCluster<T, 16, kGeneral>(p, csize, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

template <typename T>
cudaError_t LaunchMain(Params p, const CrossEntropyCudaConfig& config,
                       std::size_t esize, cudaStream_t stream) {
  const bool general = p.softcap > 0 || p.weights != nullptr || p.eps > 0;
  const auto aligned = [](const void* ptr) {
    return reinterpret_cast<std::uintptr_t>(ptr) % 16 == 0;
  };
  const bool vec_ok = aligned(p.logits) &&
                      (p.grad == nullptr || aligned(p.grad)) &&
                      (p.stride * static_cast<long long>(esize)) % 16 == 0;
  const int vec = static_cast<int>(16 / esize);
  const long long row_bytes = static_cast<long long>(p.vocab) * esize;
  // v5 for the plain options where it measured faster than v4 on the H200
  // (bench/NOTES.md): forward-only from 32 KiB rows, forward+gradient past
  // 128 KiB rows (at 32000 fp32/bf16 v4 is 2-6 points ahead).
  const bool v5 = !general && vec_ok && !config.generic &&
                  config.vectors_per_thread == 0 &&
                  (config.version == 5 ||
                   (config.version == 0 &&
                    (row_bytes > 160 * 1024 ||
                     (p.grad == nullptr && row_bytes >= 32 * 1024))));
  // v6 (bench/NOTES.md): forward+gradient on rows of 32 KiB and more, 32 KiB
  // slices with two blocks a SM; rows past 16 such slices take 64 KiB slices
  // with one block a SM. Forward-only stays on v5, which measured faster.
  const bool v6 =
      !general && vec_ok && !config.generic && config.vectors_per_thread == 0 &&
      p.vocab % vec == 0 &&
      (config.version == 6 ||
       (config.version == 0 && p.grad != nullptr && row_bytes >= 32 * 1024));
  // v7 (bench/NOTES.md): forward-only on rows of 32 KiB and more, pieces of
  // 256 KiB on independent blocks (more where a row would pass kMaxPieces).
  const bool v7 =
      !general && vec_ok && !config.generic && config.vectors_per_thread == 0 &&
      p.grad == nullptr && p.vocab % vec == 0 &&
      (config.version == 7 || (config.version == 0 && row_bytes >= 32 * 1024));
  // v8 (bench/NOTES.md): in-place forward+gradient of 2-byte logits on rows
  // of 32 KiB and more where v9 (below) cannot launch, 64 KiB pieces, 4 MiB
  // groups, statistics two groups ahead, L2 hints (bf16 73-78% of copy, bound
  // by L2 line touches; v9 measures 80-82% on the same shapes).
  const bool v8 =
      !general && vec_ok && !config.generic && config.vectors_per_thread == 0 &&
      p.grad != nullptr && p.vocab % vec == 0 &&
      (config.version == 8 || (config.version == 0 && esize == 2 &&
                               p.grad == p.logits && row_bytes >= 32 * 1024));
  // v9 (bench/NOTES.md): forward+gradient on row pieces kept in shared
  // memory, 48 KiB pieces, L2 prefetch: the default for 2-byte logits on rows
  // of 32 KiB and more, in place or not (bf16 88-90% of copy at V >= 128k
  // against v8's 77% and v6's 71-76%; 80% at V = 32000 against v6's 72%), and
  // for fp32 rows of 120 KiB and more, the pieces by bulk copies (90-93% at
  // 128k and 89.5-90.5% at 1 MiB rows against v6's 83-86% and 77%; 89.6-89.7%
  // at V = 32000 against v6's 87-88%). Shorter fp32 rows stay on v6.
  const bool v9 =
      !general && vec_ok && !config.generic && config.vectors_per_thread == 0 &&
      p.grad != nullptr && p.vocab % vec == 0 &&
      (config.version == 9 ||
       (config.version == 0 && row_bytes >= (esize == 2 ? 32 : 120) * 1024));
  if (v9) {
    const RowPieces rp = SplitRow(p.vocab, row_bytes, vec, config.slice_kib,
                                  /*default_kib=*/48);
    p.chunk = rp.chunk;
    // ctas_per_sm (bench sweeps): 2 = 512-thread blocks, two a SM (pieces up
    // to ~110 KiB), 8 = 128 threads; otherwise four blocks of 256 threads a
    // SM. Pieces come in by bulk copies (bench/NOTES.md "v9, session 9": fp32
    // 87-91% -> 89.5-93% of copy, bf16 out of place 87.7% -> 88.8% on
    // average) except 2-byte logits in place, where the threads' own loads
    // measured the same or better (89.1 / 88.6 / 89.1% against 87.1 / 89.3 /
    // 89.1% at 8192x128256 / 4096x262144 / 16384x131072, means of 5 runs).
    const int load = config.piece_load != 0             ? config.piece_load
                     : esize == 2 && p.grad == p.logits ? kLoadRegisters
                                                        : kLoadBulk;
    cudaError_t e;
    switch (config.ctas_per_sm) {
      case 2:
        e = LaunchSmemPieces<T, 512, 2>(p, rp.pieces, config.prefetch_kib,
                                        config.ablate, load, config.trace,
                                        stream);
        break;
      case 8:
        e = LaunchSmemPieces<T, 128, 8>(p, rp.pieces, config.prefetch_kib,
                                        config.ablate, load, config.trace,
                                        stream);
        break;
      default:
        e = LaunchSmemPieces<T, kThreads, 4>(p, rp.pieces, config.prefetch_kib,
                                             config.ablate, load, config.trace,
                                             stream);
    }
    if (e != cudaErrorInvalidConfiguration) return e;
    cudaGetLastError();
  }
  if (v8) {
    const RowPieces rp = SplitRow(p.vocab, row_bytes, vec, config.slice_kib,
                                  /*default_kib=*/64);
    const long long group_bytes =
        static_cast<long long>(config.group_mib > 0 ? config.group_mib : 4)
        << 20;
    const long long group_rows = std::min<long long>(
        std::max<long long>(1, group_bytes / row_bytes), p.rows);
    p.chunk = rp.chunk;
    const int lookahead = config.stages > 0 ? config.stages : 2;
    return config.cache_hints != 1
               ? LaunchL2Pieces<T, true>(p, rp.pieces,
                                         static_cast<int>(group_rows),
                                         lookahead, stream)
               : LaunchL2Pieces<T, false>(p, rp.pieces,
                                          static_cast<int>(group_rows),
                                          lookahead, stream);
  }
  if (v7) {
    const RowPieces rp = SplitRow(p.vocab, row_bytes, vec, config.slice_kib,
                                  /*default_kib=*/256);
    if (p.rows * rp.pieces <= INT_MAX) {
      p.chunk = rp.chunk;
      return LaunchPieces<T>(p, rp.pieces, config.stages != 1, stream);
    }
  }
  if (v6) {
    int slice_kib = config.slice_kib;
    int ctas = config.ctas_per_sm;
    if (slice_kib <= 0) {
      const bool fits =
          row_bytes <= static_cast<long long>(kMaxCluster) * 32 * 1024;
      slice_kib = fits ? 32 : 64;
      if (ctas <= 0) ctas = fits ? 2 : 1;
    }
    const long long slice = static_cast<long long>(slice_kib) * 1024;
    long long csize = std::max<long long>(1, (row_bytes + slice - 1) / slice);
    const long long chunk =
        ((p.vocab + csize - 1) / csize + vec - 1) / vec * vec;
    csize = (p.vocab + chunk - 1) / chunk;
    cudaError_t e = cudaErrorInvalidConfiguration;
    if (csize <= kMaxCluster) {
      p.chunk = static_cast<int>(chunk);
      e = LaunchTma<T>(p, static_cast<int>(csize), ctas, config.stages, stream);
    }
    // Asked for by name (tests, benchmark): report rather than fall back.
    if (e == cudaSuccess || config.version == 6) return e;
    cudaGetLastError();  // fall through to v5 / v4 / generic
  }
  if (v5) {
    const long long slice =
        static_cast<long long>(config.slice_kib > 0 ? config.slice_kib : 128) *
        1024;
    long long csize = std::min<long long>(
        kMaxCluster, std::max<long long>(1, (row_bytes + slice - 1) / slice));
    const long long unit = static_cast<long long>(kThreads) * vec;
    const long long chunk =
        ((p.vocab + csize - 1) / csize + unit - 1) / unit * unit;
    csize = (p.vocab + chunk - 1) / chunk;
    if (p.rows * csize <= INT_MAX) {
      p.chunk = static_cast<int>(chunk);
      const cudaError_t e = LaunchStream<T>(p, static_cast<int>(csize),
                                            config.ctas_per_sm, stream);
      if (e == cudaSuccess) return e;
      cudaGetLastError();  // fall through to v4 / generic
    }
  }
  int vpt = config.vectors_per_thread;
  if (vpt == 0) {
    // Measured on the H200 (bench/NOTES.md): the largest slice (16 vectors,
    // 64 KiB a block) wins at every vocabulary tried, since fewer blocks per
    // row mean fewer cluster barriers; short rows take the smallest slice
    // that holds them in one block.
    vpt = 16;
    for (int v = 1; v < 16; v *= 2) {
      if (p.vocab <= v * kThreads * vec) {
        vpt = v;
        break;
      }
    }
  }
  const long long chunk = static_cast<long long>(vpt) * kThreads * vec;
  const long long csize = (p.vocab + chunk - 1) / chunk;
  if (config.generic || !vec_ok || csize > kMaxCluster ||
      p.rows * csize > INT_MAX) {
    GenericKernel<T>
        <<<static_cast<unsigned>(p.rows), kGenericThreads, 0, stream>>>(p);
    return cudaGetLastError();
  }
  p.chunk = static_cast<int>(chunk);
  const cudaError_t e =
      general
          ? LaunchClusterVpt<T, true>(p, vpt, static_cast<int>(csize), stream)
          : LaunchClusterVpt<T, false>(p, vpt, static_cast<int>(csize), stream);
  if (e == cudaSuccess) return e;
  // A cluster shape this device cannot schedule: the generic path still works.
  cudaGetLastError();
  GenericKernel<T>
      <<<static_cast<unsigned>(p.rows), kGenericThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

std::size_t CrossEntropyCudaWorkspaceBytes(int64_t rows) {
  const std::size_t n = rows > 0 ? static_cast<std::size_t>(rows) : 0;
  return kHeaderBytes + 5 * AlignUp(n * 4) +
         AlignUp(n * kMaxPieces * sizeof(Stats));
}

cudaError_t CrossEntropyCudaLaunch(const CrossEntropyArgs& args,
                                   CrossEntropyCudaResult* device_result,
                                   void* workspace, std::size_t workspace_bytes,
                                   cudaStream_t stream,
                                   const CrossEntropyCudaConfig* config) {
  if (workspace_bytes < CrossEntropyCudaWorkspaceBytes(args.rows) ||
      args.vocab <= 0 || args.vocab > INT_MAX || args.rows < 0 ||
      args.rows > INT_MAX || device_result == nullptr) {
    return cudaErrorInvalidValue;
  }
  Params p = {};
  p.logits = args.logits;
  p.grad = args.mode == GradientMode::kNone ? nullptr : args.gradient;
  p.targets = args.targets;
  p.weights = args.class_weights;
  p.token_loss = args.token_loss;
  p.token_lse = args.token_lse;
  p.token_argmax = args.token_argmax;
  char* ws = static_cast<char*>(workspace);
  const std::size_t col = AlignUp(static_cast<std::size_t>(args.rows) * 4);
  p.header = reinterpret_cast<WorkspaceHeader*>(ws);
  p.row_loss = reinterpret_cast<float*>(ws + kHeaderBytes);
  p.row_zloss = reinterpret_cast<float*>(ws + kHeaderBytes + col);
  p.row_flags = reinterpret_cast<int*>(ws + kHeaderBytes + 2 * col);
  p.row_done = reinterpret_cast<int*>(ws + kHeaderBytes + 3 * col);
  p.row_zy = reinterpret_cast<float*>(ws + kHeaderBytes + 4 * col);
  p.pieces = ws + kHeaderBytes + 5 * col;
  p.rows = args.rows;
  p.stride = args.row_stride;
  p.ignore_index = args.options.ignore_index;
  p.normalizer = args.options.normalizer;
  p.vocab = static_cast<int>(args.vocab);
  p.targets64 = args.targets_dtype == DType::kInt64 ? 1 : 0;
  p.reduction = static_cast<int>(args.options.reduction);
  p.eps = args.options.label_smoothing;
  p.zls = args.options.z_loss_scale;
  p.softcap = args.options.softcap;
  p.grad_scale = args.options.grad_scale;

  PrepareKernel<<<1, kReduceThreads, 0, stream>>>(p);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  if (args.rows > 0) {
    const CrossEntropyCudaConfig cfg =
        config ? *config : CrossEntropyCudaConfig{};
    switch (args.logits_dtype) {
      case DType::kFloat32:
        e = LaunchMain<float>(p, cfg, 4, stream);
        break;
      case DType::kBFloat16:
        e = LaunchMain<__nv_bfloat16>(p, cfg, 2, stream);
        break;
      case DType::kFloat16:
        e = LaunchMain<__half>(p, cfg, 2, stream);
        break;
      default:
        return cudaErrorInvalidValue;
    }
    if (e != cudaSuccess) return e;
  }
  FinalizeKernel<<<1, kReduceThreads, 0, stream>>>(p, device_result);
  return cudaGetLastError();
}

}  // namespace lossd
