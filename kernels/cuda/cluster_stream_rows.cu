// Schedule "cluster stream rows": persistent clusters that stream each
// block's slice of a row once for its statistics and once more, from L2, for
// the gradient. The fallback for rows no other fast schedule takes.

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
#include "kernels/cuda/row_math.cuh"
#include "kernels/cuda/schedules.h"
#include "kernels/cuda/slice_stats.cuh"

namespace lossd {
namespace cuda_ce {

namespace cg = cooperative_groups;

namespace {

// Loads vectors base + (u * kThreads + tid) * kVec of a slice ending at `end`;
// elements past `end` read as -inf (never the max, exp() = 0). kLastUse marks
// the re-read: evict-first, the gradient replaces it.
template <typename T, bool kLastUse>
__device__ __forceinline__ void LoadBatch(const T* in, int base, int tid,
                                          int end, uint4 (&v)[kU]) {
#pragma unroll
  for (int u = 0; u < kU; ++u) {
    v[u] = LoadVectorPadded<T, kLastUse>(
        in, base + (u * kThreads + tid) * Traits<T>::kVec, end);
  }
}

// Logits [N, V] with row stride; grid = N * C blocks in clusters of C, block
// `rank` owning elements [rank*chunk, min(rank*chunk + chunk, V)). Unlike
// cluster register rows the slice is not held in registers: each block
// streams it once in batches
// of kU vectors a thread (online max / sum-exp, next batch in flight), pushes
// its partial into every peer's DSMEM before one cluster barrier, then reads
// the slice again -- from L2, which holds ~132 * blocks/SM * slice bytes --
// and writes the gradient with streaming stores. So DRAM sees one read and
// one write, and with 4+ small blocks per SM in different phases memory stays
// busy through each block's barrier (register rows' limit, bench/NOTES.md:
// cluster register rows). Every option: kOpts builds take the softcap
// and label smoothing's sums (as SliceStats does).
template <typename T, int kMinBlocks, int kOpts>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    ClusterStreamRowsKernel(Params p) {
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
  const VocabSlice slice = VocabSliceOf(p, rank);
  const WorkspaceHeader& hdr = *p.header;
  // DSMEM may be written only once every peer has started.
  cluster.sync();
  if (hdr.error) return;  // uniform: the whole grid leaves, nothing written
  const ElementOptions opts = MakeElementOptions(p);
  // z of element j of vector u of a batch from `base` (kOpts: the softcap;
  // the padding past `end` stays -inf, which a softcap would make -c).
  const auto zof = [&](const uint4& v, int base, int u, int j) {
    if (!kOpts) return Tr::Get(v, j);
    return base + (u * kThreads + tid) * kVec + j < slice.end
               ? OptionZ<T, kOpts>(opts, Tr::Get(v, j))
               : -INFINITY;
  };

  // Persistent: a cluster per row at a time, rows strided by the cluster
  // count (launching a cluster per row cost ~30 ns a block: bench/NOTES.md).
  const long long nclusters = gridDim.x / csize;
  int parity = 0;
#pragma unroll 1
  for (long long row = blockIdx.x / csize; row < p.rows;
       row += nclusters, parity ^= 1) {
    const T* in = static_cast<const T*>(p.logits) + row * p.stride;
    uint4 cur[kU];
    LoadBatch<T, false>(in, slice.start, tid, slice.end, cur);
    const long long y = LoadTarget(p, row);
    const bool valid = y != p.ignore_index;
    const bool owner = valid ? slice.Holds(y) : rank == 0;
    const float xy = (valid && owner) ? Tr::Load(in + y) : 0.0f;
    const float zy = OptionZ<T, kOpts>(opts, xy);

    // Pass 1: online max and sum of 2^((z - shift) * log2e - m_l2), rescaled
    // when a batch raises the max; the argmax is found afterwards in the
    // batch that set it.
    float m = -INFINITY;
    float m_raw = -INFINITY;  // the max of the logits (kOpts: before the cap)
    float shift = 0.0f;       // ExponentShift(m)
    float m_l2 = 0.0f;        // fl(m * log2e); 0 while m = -inf
    float wz = 0.0f;
    int arg_base = slice.start;
    float acc[2] = {0.0f, 0.0f};
#pragma unroll 1
    for (int base = slice.start; base < slice.end; base += kBatch) {
      uint4 nxt[kU];
      if (base + kBatch < slice.end)
        LoadBatch<T, false>(in, base + kBatch, tid, slice.end, nxt);
      float bmx = -INFINITY;
#pragma unroll
      for (int u = 0; u < kU; ++u)
#pragma unroll
        for (int j = 0; j < kVec; ++j) bmx = fmaxf(bmx, Tr::Get(cur[u], j));
      if (bmx > m_raw) {
        m_raw = bmx;
        const float bm = kOpts ? OptionZ<T, kOpts>(opts, bmx) : bmx;
        if (bm > m) {
          const float f = RaiseMax(bm, &m, &shift, &m_l2);
          acc[0] *= f;
          acc[1] *= f;
          arg_base = base;
        }
      }
#pragma unroll
      for (int u = 0; u < kU; ++u)
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          const float z = zof(cur[u], base, u, j);
          acc[j % 2] += Exp2(fmaf(z - shift, kLog2e, -m_l2));
          if ((kOpts & kOptSmoothing) && z > -INFINITY) {
            wz = fmaf(OptionWeight<kOpts>(
                          opts, base + (u * kThreads + tid) * kVec + j),
                      z, wz);
          }
        }
#pragma unroll
      for (int u = 0; u < kU; ++u) cur[u] = nxt[u];
    }
    Stats st;
    st.m = m;
    st.sum_wz = wz;
    st.arg = INT_MAX;
    if (m == -INFINITY) {
      // Empty, or NaN (never the max) and -inf only: the NaN stays.
      const float sum = acc[0] + acc[1];
      st.t = isnan(sum) ? sum : -1.0f;
    } else {
      // First index of m: in the batch that set it (earlier ones were below).
      uint4 v[kU];
      LoadBatch<T, false>(in, arg_base, tid, slice.end, v);
#pragma unroll
      for (int u = kU - 1; u >= 0; --u)
#pragma unroll
        for (int j = kVec - 1; j >= 0; --j)
          if (zof(v[u], arg_base, u, j) == m)
            st.arg = arg_base + (u * kThreads + tid) * kVec + j;
      const float lo =
          shift == 0.0f && isfinite(m_l2) ? fmaf(m, kLog2e, -m_l2) : 0.0f;
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
      for (int base = slice.start; base < slice.end; base += kBatch) {
        uint4 v[kU];
        LoadBatch<T, false>(in, base, tid, slice.end, v);
#pragma unroll
        for (int u = 0; u < kU; ++u)
#pragma unroll
          for (int j = 0; j < kVec; ++j) {
            const int c = base + (u * kThreads + tid) * kVec + j;
            const float e = expf(zof(v[u], base, u, j) - row_st.m);
            t += c == row_st.arg ? 0.0f : e;
          }
      }
      t = BlockReduce<kThreads>(t, fscratch);
      if (tid < csize) *cluster.map_shared_rank(&tbox[rank], tid) = t;
      cluster.sync();
      row_st.t = tbox[0];
      for (int r = 1; r < csize; ++r) row_st.t += tbox[r];
    }

    const RowMath rm =
        MakeRowMath(p, hdr, row_st, valid, zy, TargetWeight(p, valid, y));
    if (owner && tid == 0)
      WriteRowOutputs(p, row, valid, y, rm, row_st.arg, true);
    if (!p.grad) continue;
    T* out = static_cast<T*>(p.grad) + row * p.stride;

    if (!valid) {
      // Ignored row: zeros, no re-read (the formula would give NaN for
      // non-finite logits).
#pragma unroll 1
      for (int base = slice.start; base < slice.end; base += kBatch) {
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          StoreZeroVector(out, base + (u * kThreads + tid) * kVec, slice.end);
        }
      }
      continue;
    }

    // Pass 2: the slice again (L2), gradient out with streaming stores.
    const int yl = owner ? static_cast<int>(y) : -1;
    LoadBatch<T, true>(in, slice.start, tid, slice.end, cur);
#pragma unroll 1
    for (int base = slice.start; base < slice.end; base += kBatch) {
      uint4 nxt[kU];
      if (base + kBatch < slice.end)
        LoadBatch<T, true>(in, base + kBatch, tid, slice.end, nxt);
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int e = base + (u * kThreads + tid) * kVec;
        float g[kVec];
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          g[j] = ElementGrad<T, kOpts>(rm, opts, Tr::Get(cur[u], j), e + j);
        }
        if (yl >= e && yl < e + kVec) {
#pragma unroll
          for (int j = 0; j < kVec; ++j)
            if (e + j == yl) {
              g[j] = kOpts ? TargetGrad<T, kOpts>(rm, opts, Tr::Get(cur[u], j))
                           : rm.gy;
            }
        }
        StoreVector(out, e, slice.end, g);
      }
#pragma unroll
      for (int u = 0; u < kU; ++u) cur[u] = nxt[u];
    }
  }  // rows
}

struct ClusterStreamRows {
  // The build for 3 blocks a SM: the one for 4 spills per-row state and
  // measured 25-35% slower (bench/NOTES.md, cluster stream rows).
  template <typename T, int kOpts>
  static cudaError_t Launch(const Params& p, int csize, cudaStream_t stream) {
    cudaLaunchConfig_t cfg = {};
    cfg.blockDim = dim3(kThreads);
    cfg.stream = stream;
    return LaunchPersistentClusters(ClusterStreamRowsKernel<T, 3, kOpts>, cfg,
                                    csize, p.rows, p);
  }
};

}  // namespace

cudaError_t LaunchClusterStreamRows(const Params& p, DType dtype, int cluster,
                                    cudaStream_t stream) {
  return LaunchBuild<ClusterStreamRows>(p, dtype, cluster, stream);
}

}  // namespace cuda_ce
}  // namespace lossd
