// Schedule "cluster slice rows": persistent clusters whose blocks keep their
// slice of a row in shared memory, brought in by bulk copies, and exchange
// statistics with st.async; fp32 forward+gradient rows of 32 to 120 KiB.

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
#include "kernels/cuda/slice_stats.cuh"

namespace lossd {
namespace cuda_ce {

namespace cg = cooperative_groups;

namespace {

constexpr int kMaxStages = 8;

// Logits [N, V] with 16-byte aligned rows, V a multiple of the vector width;
// persistent grid of clusters of C blocks (kMinBlocks blocks of kBlock threads
// a SM); block `rank` owns its VocabSlice of every row its cluster takes
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
// logits. Every option: kOpts builds take the softcap and label smoothing's
// sums (SliceStats, GradientSlice).
template <typename T, int kBlock, int kMinBlocks, int kOpts>
__global__ void __launch_bounds__(kBlock, kMinBlocks)
    ClusterSliceRowsKernel(Params p, int stages, int stage_bytes) {
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
  const VocabSlice slice = VocabSliceOf(p, rank);
  const int n = slice.Size();
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
  const ElementOptions opts = MakeElementOptions(p);

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
        static_cast<const T*>(p.logits) + row_of(i) * p.stride + slice.start);
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
    Stats st = SliceStats<T, kBlock, false, false, kOpts>(
        sl, n, slice.start, tid, 0, nullptr, NoWait(), opts);
    const bool mine = y != p.ignore_index && slice.Holds(y);
    *zy =
        mine ? OptionZ<T, kOpts>(opts, Tr::Load(sl + (y - slice.start))) : 0.0f;
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
    const bool owner = valid ? slice.Holds(y) : rank == 0;
    const T* sl = stage_ptr(ring);

    if (tid == 0) arm(i + kInbox);
    if (warp == 0) {
      const RowMath rm =
          MakeRowMath(p, hdr, row_st, valid, zy, TargetWeight(p, valid, y));
      if (lane == 0) {
        rowmath = rm;
        if (owner) WriteRowOutputs(p, row, valid, y, rm, row_st.arg, true);
      }
    }
    __syncthreads();
    const RowMath rm = rowmath;

    if (!forward_only) {
      T* out = static_cast<T*>(p.grad) + row * p.stride + slice.start;
      const uint4* sv = reinterpret_cast<const uint4*>(sl);
      const int nvec = n / kVec;
      if (!valid) {
        ZeroSlice<T, kBlock>(out, nvec, tid);
      } else {
        GradientSlice<T, kBlock, kOpts>(sv, out, nvec, tid, rm, opts,
                                        slice.start);
        // The target column, computed without cancellation, overwrites what
        // the same thread stored there (program order).
        const int yl = static_cast<int>(y - slice.start);
        if (owner && (yl / kVec) % kBlock == tid) {
          Tr::Store(out + yl,
                    kOpts ? TargetGrad<T, kOpts>(rm, opts, Tr::Load(sl + yl))
                          : rm.gy);
        }
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

// Launch: clusters of `csize` blocks of 256 threads, two a SM, as many
// stage buffers of the slice as fit (at most kMaxStages), a persistent grid.
// (One 512-thread block a SM, for rows past 16 slices of 32 KiB, measured
// slower than the row pieces and left with the bench knobs: bench/NOTES.md.)
struct ClusterSliceRows {
  template <typename T, int kOpts>
  static cudaError_t Launch(const Params& p, int csize, cudaStream_t stream) {
    auto kernel = ClusterSliceRowsKernel<T, 256, 2, kOpts>;
    int device = 0, per_sm = 0, optin = 0;
    cudaError_t e = cudaGetDevice(&device);
    if (e == cudaSuccess) {
      e = cudaDeviceGetAttribute(
          &per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device);
    }
    if (e == cudaSuccess) {
      e = cudaDeviceGetAttribute(
          &optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    }
    if (e != cudaSuccess) return e;
    const int stage_bytes = static_cast<int>(
        (static_cast<long long>(p.chunk) * sizeof(T) + 127) / 128 * 128);
    // Per block: its share of the SM less the runtime's 1 KiB reservation and
    // the kernel's static shared memory (< 2 KiB).
    const int room = std::min(optin, per_sm / 2 - 1024) - 2048;
    const int stages = std::min(kMaxStages, room / stage_bytes);
    if (stages < 2) return cudaErrorInvalidConfiguration;
    const int dyn = stages * stage_bytes;
    e = cudaFuncSetAttribute(kernel,
                             cudaFuncAttributeMaxDynamicSharedMemorySize, dyn);
    if (e != cudaSuccess) return e;
    cudaLaunchConfig_t cfg = {};
    cfg.blockDim = dim3(256);
    cfg.dynamicSmemBytes = static_cast<std::size_t>(dyn);
    cfg.stream = stream;
    return LaunchPersistentClusters(kernel, cfg, csize, p.rows, p, stages,
                                    stage_bytes);
  }
};

}  // namespace

cudaError_t LaunchClusterSliceRows(const Params& p, DType dtype, int cluster,
                                   cudaStream_t stream) {
  return LaunchBuild<ClusterSliceRows>(p, dtype, cluster, stream);
}

}  // namespace cuda_ce
}  // namespace lossd
