// Schedule "cluster register rows": a cluster of up to 16 blocks a row, each
// block's slice of the row held in registers between its statistics and its
// gradient; the only fused schedule for softcap, class weights and label
// smoothing, and the plain one for rows under 32 KiB.

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>

#include "kernels/cuda/cluster_launch.cuh"
#include "kernels/cuda/element_traits.cuh"
#include "kernels/cuda/launch_params.h"
#include "kernels/cuda/ptx.cuh"
#include "kernels/cuda/row_math.cuh"
#include "kernels/cuda/schedules.h"

namespace lossd {
namespace cuda_ce {

namespace cg = cooperative_groups;

namespace {

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
    ClusterRegisterRowsKernel(Params p) {
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
    // Tail (or past the row): -inf never wins the max and adds exp() = 0.
    data[k] = LoadVectorPadded<T, true>(in, start + (k * kThreads + tid) * kVec,
                                        vocab);
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
  const float shift = ExponentShift(st.m);
  const Log2Split m_l2 = SplitLog2(shift != 0.0f ? 0.0f : st.m);
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
      // (the max adds ~1)
      lt[k % kLanes] += Exp2(fmaf(z - shift, kLog2e, -m_log2e));
    }
  }
  // The terms are exp(z - m) * 2^lo: undo the rounding of m * log2e.
  st.t = ((lt[0] + lt[1]) + (lt[2] + lt[3])) * exp2f(-m_l2.lo);
  if (st.m == -INFINITY) {
    // Empty, or NaN (never the max) and -inf only, which must stay NaN:
    // looked for in memory (rare), not in the registers (the hot path's).
    st.t = -1.0f;
#pragma unroll 1
    for (int k = 0; k < VPT; ++k) {
#pragma unroll 1
      for (int j = 0; j < kVec; ++j) {
        const int c = start + (k * kThreads + tid) * kVec + j;
        if (c < vocab && isnan(Tr::Load(in + c))) st.t = NAN;
      }
    }
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
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      StoreZeroVector(out, start + (k * kThreads + tid) * kVec, vocab);
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
        float gz = p.weights ? OtherGrad<T, true>(
                                   rm, z, c < vocab ? p.weights[c] : 1.0f)
                             : OtherGrad<T, false>(rm, z, 1.0f);
        if (q == yq && j == yj) gz = rm.gy;
        g[j] = valid ? gz * dfac : 0.0f;
      } else {
        g[j] = fmaf(Exp2(fmaf(x - rm.shift, kLog2e, -lse_log2e)), rm.a, rm.b);
      }
    }
    if (!kGeneral && q == yq) {
#pragma unroll
      for (int j = 0; j < kVec; ++j)
        if (j == yj) g[j] = rm.gy;
    }
    StoreVector(out, e, vocab, g);
  }
}

template <typename T, int VPT, bool kGeneral>
cudaError_t LaunchCluster(const Params& p, int csize, cudaStream_t stream) {
  auto kernel = ClusterRegisterRowsKernel<T, VPT, kGeneral>;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(p.rows * csize));
  cfg.blockDim = dim3(kThreads);
  cfg.stream = stream;
  cudaLaunchAttribute attr;
  const cudaError_t e = SetClusterLaunch(kernel, csize, &attr, &cfg);
  if (e != cudaSuccess) return e;
  return cudaLaunchKernelEx(&cfg, kernel, p);
}

// `vpt` picks the build: the slice a thread holds is a template argument.
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
cudaError_t LaunchRegisterRows(const Params& p, bool general, int vpt,
                               int csize, cudaStream_t stream) {
  return general ? LaunchClusterVpt<T, true>(p, vpt, csize, stream)
                 : LaunchClusterVpt<T, false>(p, vpt, csize, stream);
}

}  // namespace

cudaError_t LaunchClusterRegisterRows(const Params& p, DType dtype,
                                      bool general, int vectors_per_thread,
                                      int cluster, cudaStream_t stream) {
  return DispatchElementType(dtype, [&](auto element) {
    return LaunchRegisterRows<typename decltype(element)::type>(
        p, general, vectors_per_thread, cluster, stream);
  });
}

}  // namespace cuda_ce
}  // namespace lossd
