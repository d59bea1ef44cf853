// Schedule "L2 row pieces": forward+gradient on row pieces whose rows stay
// in L2 between their statistics and their gradient; the fallback for 2-byte
// logits in place whose pieces do not fit shared memory.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>

#include "kernels/cuda/dtype_dispatch.cuh"
#include "kernels/cuda/element_traits.cuh"
#include "kernels/cuda/launch_params.h"
#include "kernels/cuda/ptx.cuh"
#include "kernels/cuda/row_math.cuh"
#include "kernels/cuda/schedules.h"
#include "kernels/cuda/slice_stats.cuh"

namespace lossd {
namespace cuda_ce {
namespace {

// Split row forward's independent row pieces for forward+gradient: one
// persistent kernel takes work items from a global counter in a fixed sequence
// of row groups, statistics of group g + 1 before the gradient of group g:
//   S(0) S(1) G(0) S(2) G(1) ... S(n - 1) G(n - 2) - G(n - 1)
// A statistics item reads one piece of one row from DRAM (its loop), writes
// the piece's Stats (and, where it holds the target column, the target
// logit) and counts itself done for the row (release). A gradient item waits
// for its row's count (acquire), merges the row's pieces in a fixed order,
// and re-reads its piece -- from L2, a group (group_rows rows) having been
// read only one group earlier -- to write the gradient with streaming stores.
// One read and one write of the logits in DRAM while two groups fit in L2.
// No deadlock with every block resident: a block waits only in a gradient
// item, for statistics items taken earlier by blocks that never wait in them.
// Every option: kOpts builds take the softcap and label smoothing's sums
// (SliceStats, ElementGrad). (bench/NOTES.md: L2 row pieces.)
// L2 hints: the statistics loads mark their lines evict-last in L2, the
// gradient's re-reads and stores evict-first, so that the groups waiting for
// their gradient outlive the lines already written (bench/NOTES.md, L2 hints:
// bf16 72-73% -> 77-78% of copy in one run; fewer re-reads miss L2).

// One warp waits until all `per_row` pieces of `row` have published
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

template <typename T, int kOpts>
__global__ void __launch_bounds__(kThreads, 4)
    L2PieceKernel(Params p, int per_row, int group_rows, int lookahead) {
  using Tr = Traits<T>;
  constexpr int kVec = Tr::kVec;
  __shared__ Stats scratch[kThreads / 32 + 1];
  __shared__ long long item_s[2];
  __shared__ RowMath rowmath;
  __shared__ int row_y;  // the target's column in the piece, or kIgnoredRow
  // The target's logit (in place, its thread has written over it by the time
  // it fixes the target's gradient up, which needs it with a softcap).
  __shared__ float row_xy;
  constexpr int kIgnoredRow = INT_MIN;
  const WorkspaceHeader hdr = *p.header;
  if (hdr.error) return;  // uniform: nothing is written
  const ElementOptions opts = MakeElementOptions(p);
  const int tid = threadIdx.x;
  Stats* const pieces = static_cast<Stats*>(p.pieces);
  const long long groups = (p.rows + group_rows - 1) / group_rows;
  const long long per_slot = static_cast<long long>(group_rows) * per_row;
  const long long total = (lookahead + 2 * groups) * per_slot;
  const unsigned long long keep = L2EvictLast();
  const unsigned long long drop = L2EvictFirst();
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
      Stats st = SliceStats<T, kThreads, true, true, kOpts>(
          src, n, start, tid, keep, nullptr, NoWait(), opts);
      st = BlockMergeStats<kThreads>(st, scratch);
      if (tid == 0) {
        pieces[row * kMaxPieces + piece] = st;
        const long long y = LoadTarget(p, row);
        if (y != p.ignore_index && y >= start && y < start + n) {
          p.row_zy[row] = Tr::Load(src + (y - start));  // (x_y: see row_xy)
        }
        __threadfence();
        atomicAdd(p.row_done + row, 1);
      }
      continue;
    }
    if (tid < 32) {  // warp 0: the lanes are the threads
      const Stats st = MergeRowPieces(p, row, per_row, tid);
      const long long y = LoadTarget(p, row);
      const bool valid = y != p.ignore_index;
      const float xy = valid ? __ldcg(p.row_zy + row) : 0.0f;
      const float zy = OptionZ<T, kOpts>(opts, xy);
      const RowMath rm =
          MakeRowMath(p, hdr, st, valid, zy, TargetWeight(p, valid, y));
      const bool owner = valid ? (y >= start && y < start + n) : piece == 0;
      if (tid == 0) {
        rowmath = rm;
        row_xy = xy;
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
        StoreStreamWithPolicy(out + q, zv, drop);
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
            v[b] = LoadWithPolicy(sv + q, drop);
          }
        }
#pragma unroll
        for (int b = 0; b < kB; ++b) {
          const int q = q0 + b * kThreads;
          if (q >= nvec) break;
          float gr[kVec];
#pragma unroll
          for (int j = 0; j < kVec; ++j) {
            gr[j] = ElementGrad<T, kOpts>(rm, opts, Tr::Get(v[b], j),
                                          start + q * kVec + j);
          }
          uint4 o4;
          Tr::Pack(gr, &o4);
          StoreStreamWithPolicy(out + q, o4, drop);
        }
      }
      // The target column, computed without cancellation, overwrites what
      // the same thread stored there (program order).
      if (yl >= 0 && yl < n && (yl / kVec) % kThreads == tid) {
        Tr::Store(static_cast<T*>(p.grad) + row * p.stride + start + yl,
                  kOpts ? TargetGrad<T, kOpts>(rm, opts, row_xy) : rm.gy);
      }
    }
    __syncthreads();  // rowmath and row_y are rewritten by the next item
  }
}

// Launch: `per_row` (<= kMaxPieces) pieces of p.chunk elements a row, groups
// of `group_rows` rows, statistics two groups ahead of the gradient, a
// persistent grid of every block that fits; the rows' done counts zeroed
// first.
template <typename T, int kOpts>
cudaError_t LaunchL2Pieces(const Params& p, int per_row, int group_rows,
                           cudaStream_t stream) {
  constexpr int kLookahead = 2;
  int device = 0, sms = 0, per_sm = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e == cudaSuccess) {
    e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  }
  if (e == cudaSuccess) {
    e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &per_sm, L2PieceKernel<T, kOpts>, kThreads, 0);
  }
  if (e != cudaSuccess) return e;
  if (per_sm <= 0) return cudaErrorInvalidConfiguration;
  e = cudaMemsetAsync(p.row_done, 0, sizeof(int) * p.rows, stream);
  if (e != cudaSuccess) return e;
  L2PieceKernel<T, kOpts>
      <<<static_cast<unsigned>(sms * per_sm), kThreads, 0, stream>>>(
          p, per_row, group_rows, kLookahead);
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchL2RowPieces(const Params& p, DType dtype, int pieces,
                              int group_rows, cudaStream_t stream) {
  return WithElementType(dtype, [&](auto t) -> cudaError_t {
    using T = decltype(t);
    if constexpr (sizeof(T) != 2) {
      return cudaErrorInvalidValue;  // (2-byte logits only)
    } else {
      return WithOptionBuild(ElementOptionsOn(p), [&](auto opts) {
        return LaunchL2Pieces<T, decltype(opts)::value>(p, pieces, group_rows,
                                                        stream);
      });
    }
  });
}

}  // namespace cuda_ce
}  // namespace lossd
