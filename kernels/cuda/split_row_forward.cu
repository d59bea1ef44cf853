// Schedule "split row forward": forward-only, each row cut into pieces read
// by independent blocks, the pieces' statistics merged by a second kernel.

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
#include "kernels/cuda/row_math.cuh"
#include "kernels/cuda/schedules.h"
#include "kernels/cuda/slice_stats.cuh"

namespace lossd {
namespace cuda_ce {
namespace {

// Forward-only needs no row on chip, only its statistics: every block takes
// one piece of one row (p.chunk elements), computes the piece's statistics
// from global memory and writes them to the workspace; a second kernel merges
// each row's pieces in a fixed order (one warp a row) and writes the row's
// outputs. No cluster, no exchange, no barrier between blocks: a block's
// reductions overlap the other resident blocks' loads. One read of the logits.
// Every option: kOpts builds take the softcap and label smoothing's sums
// (SliceStats). Each thread keeps two batches of loads in flight (SliceStats'
// prefetch).

// kEdges: rows of any alignment and vocab, cut as smem_row_pieces.cu cuts
// them (PieceSpan): whole vectors by the loop, the edges one element a lane of
// warp 0, merged after the block's statistics.
template <typename T, bool kEdges, int kOpts>
__global__ void __launch_bounds__(kThreads, 4)
    SplitRowStatsKernel(Params p, int per_row) {
  __shared__ Stats scratch[kThreads / 32 + 1];
  if (p.header->error) return;  // uniform: nothing is written
  const long long item = blockIdx.x;
  const long long row = item / per_row;
  const PieceSpan<T, kEdges> span(p, row,
                                  static_cast<int>(item - row * per_row));
  const int start = span.start;
  const int n = span.n;
  const T* const in_row = static_cast<const T*>(p.logits) + row * p.stride;
  const T* s = in_row + start;
  // Warp 0's lanes load the edges first, so that their loads overlap the
  // slice's.
  const bool edge_lane = kEdges && threadIdx.x < span.edges;
  const float edge_z =
      edge_lane ? Traits<T>::Load(in_row + span.EdgeColumn(threadIdx.x)) : 0.0f;
  const ElementOptions opts = MakeElementOptions(p);
  Stats st = SliceStats<T, kThreads, true, false, kOpts>(
      s, n, start, threadIdx.x, 0, nullptr, NoWait(), opts);
  st = BlockMergeStats<kThreads>(st, scratch);
  if (kEdges && span.edges > 0 && threadIdx.x < 32) {
    const int lane = threadIdx.x;
    const int c = span.EdgeColumn(lane);
    const Stats edges =
        WarpMergeStats(!edge_lane ? EmptyStats()
                       : kOpts    ? ElementStats<T, kOpts>(opts, edge_z, c)
                                  : ElementStats(edge_z, c));
    st = WarpMergeStats(lane == 0 ? st : lane == 1 ? edges : EmptyStats());
  }
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
  const float xy = valid ? Traits<T>::Load(static_cast<const T*>(p.logits) +
                                           row * p.stride + y)
                         : 0.0f;
  const float zy = p.softcap > 0.0f
                       ? OptionZ<T, kOptSoftcap>(MakeElementOptions(p), xy)
                       : xy;
  const RowMath rm =
      MakeRowMath(p, hdr, st, valid, zy, TargetWeight(p, valid, y));
  if (lane == 0) WriteRowOutputs(p, row, valid, y, rm, st.arg, true);
}

template <typename T>
cudaError_t LaunchPieces(const Params& p, bool edges, int per_row,
                         cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(p.rows * per_row));
  WithOptionBuild(ElementOptionsOn(p), [&](auto opts) {
    constexpr int kOpts = decltype(opts)::value;
    if (edges) {
      SplitRowStatsKernel<T, true, kOpts>
          <<<grid, kThreads, 0, stream>>>(p, per_row);
    } else {
      SplitRowStatsKernel<T, false, kOpts>
          <<<grid, kThreads, 0, stream>>>(p, per_row);
    }
    return 0;
  });
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  constexpr int kRowsPerBlock = kThreads / 32;
  PieceMergeKernel<T>
      <<<static_cast<unsigned>((p.rows + kRowsPerBlock - 1) / kRowsPerBlock),
         kThreads, 0, stream>>>(p, per_row);
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchSplitRowForward(const Params& p, DType dtype, bool edges,
                                  int pieces, cudaStream_t stream) {
  return WithElementType(dtype, [&](auto t) {
    return LaunchPieces<decltype(t)>(p, edges, pieces, stream);
  });
}

}  // namespace cuda_ce
}  // namespace lossd
