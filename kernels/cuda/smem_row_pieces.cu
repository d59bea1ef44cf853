// Schedule "smem row pieces", the default for forward+gradient: a persistent
// grid takes row pieces from a global counter, keeps each piece in shared
// memory while the row's pieces publish and merge their statistics, then
// writes its gradient from there.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "kernels/cuda/dtype_dispatch.cuh"
#include "kernels/cuda/element_traits.cuh"
#include "kernels/cuda/launch_params.h"
#include "kernels/cuda/ptx.cuh"
#include "kernels/cuda/row_math.cuh"
#include "kernels/cuda/row_terms.cuh"
#include "kernels/cuda/row_terms.h"
#include "kernels/cuda/schedules.h"
#include "kernels/cuda/slice_stats.cuh"

namespace lossd {
namespace cuda_ce {
namespace {

// A piece's slot: a piece's statistics and the row's target logit if the
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
// Label smoothing's sum of w_c z_c of a piece, beside its slot: stored before
// the slot is published (the fence orders the two for a reader that finds
// the slot full and fences in turn), read from L2.
__device__ __forceinline__ void PublishWz(float* wz, float v) {
  asm volatile("st.relaxed.gpu.global.f32 [%0], %1;" ::"l"(wz), "f"(v)
               : "memory");
  __threadfence();
}
__device__ __forceinline__ float ReadWz(const float* wz) {
  float v;
  asm volatile("ld.relaxed.gpu.global.f32 %0, [%1];"
               : "=f"(v)
               : "l"(wz)
               : "memory");
  return v;
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

// The two ways to bring a piece into shared memory: the threads' loads
// through registers (2-byte logits in place), or bulk copies (the TMA unit)
// issued when the piece is taken (everything else).
constexpr int kLoadRegisters = 1;
constexpr int kLoadBulk = 2;
// With bulk copies: barriers a block has for the chunks of its piece.
constexpr int kBulkChunks = 8;

// Row pieces as split_row_forward.cu's, each kept in shared memory until its
// row's statistics are known: a persistent block takes one piece at a time from
// a global counter (pieces in row order), reads it once from DRAM into
// registers and shared memory while computing its statistics (kLoadBulk: the
// TMA unit copies it into shared memory, in chunks of one batch of the
// statistics loop, each completing on its own mbarrier, as soon as the piece
// is taken; the statistics then read it from there), publishes them
// into the piece's slot with one 16-byte atomic (PieceSlot), waits for the
// row's other slots (one warp polls them all, each lane reading a whole slot
// in one atomic access, and merges them in a fixed order, every piece of a
// row getting the same bits) and writes the gradient from shared memory. One
// read and one write of the logits, through L2 once (L2 row pieces re-read it
// there, bench/NOTES.md). Every option (kOpts below).
// (bench/NOTES.md: smem row pieces.)
//
// What a piece waits for is the slowest piece of its row (bench/NOTES.md, the
// row wait: the wait costs 3-10 points of copy bandwidth), so the chain is
// kept short: one round trip to L2 finds a full slot with everything in it
// (rather than a count per row behind a fence, then the slots, then the
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
//
// kEdges: rows of any alignment and length. A row's pieces then cut its whole
// 16-byte vectors, from its first aligned address, as they cut an aligned
// row (bulk copies and vector loads need aligned addresses and sizes); the
// elements before that address (piece 0's) and after the last whole vector
// (the last piece's) are the piece's edges, at most 2 * (vector width - 1),
// read and written one at a time by one warp (PieceSpan).
//
// kOpts: softcap and label smoothing (ElementOptionsOn): z is the softcapped
// logit in the statistics and the gradient, each piece's sum of w_c z_c goes
// beside its slot (PublishWz), and the gradient takes OtherGrad's form.
//
// kTerms: a post-training row (RowTerms; no edges, no smoothing): the row's
// factor scales its gradient, its record replaces cross entropy's outputs,
// and each piece writes its share of the row's entropy. A top-k teacher's
// support (at most kStagedTopK entries) comes into shared memory by cp.async
// when the piece is taken, as the row's small inputs do.
// kTau (with kTerms): the statistics pass also sums exp((z - m) / tau)
// (TauSum), each piece publishes its sum beside its slot (as smoothing's
// w_c z_c) and the gradient adds the tail bucket's p^tau term (TauMath).
template <typename T, int kBlock, int kMinBlocks, int kLoad, bool kEdges,
          int kOpts, bool kTerms = false, bool kTau = false>
__global__ void __launch_bounds__(kBlock, kMinBlocks)
    SmemPieceKernel(Params p, int per_row, long long ahead, RowTerms terms) {
  static_assert(!kTerms || (!kEdges && !(kOpts & kOptSmoothing)),
                "post-training rows: whole vectors, no smoothing");
  static_assert(kTerms || !kTau, "tau sums: post-training rows only");
  using Tr = Traits<T>;
  constexpr int kVec = Tr::kVec;
  constexpr bool kBulk = kLoad == kLoadBulk;
  extern __shared__ uint4 kept[];
  __shared__ Stats scratch[kBlock / 32 + 1];
  __shared__ long long item_s;
  __shared__ RowMath rowmath;           // of the item's row
  __shared__ float row_corr;            // kTerms: the row's TermsRow::corr
  __shared__ float row_in[kRowInputs];  // kTerms: FetchRowInputs
  __shared__ TopKRow row_top_k;         // kTerms with a top-k teacher
  __shared__ StagedSupport staged;      // ... its support (StageSupport)
  __shared__ float tau_scratch[kBlock / 32];  // kTau: the warps' sums
  __shared__ TauMath row_tau;                 // kTau
  // kBulk: landed[c] completes when chunk c of the piece (kChunkBytes, the
  // bytes of one SliceStats batch of the block) is in `kept`.
  constexpr unsigned kChunkBytes = kU * kBlock * 16;
  __shared__ unsigned long long landed[kBulkChunks];
  const WorkspaceHeader hdr = *p.header;
  if (hdr.error) return;  // uniform: nothing is written
  const ElementOptions opts = MakeElementOptions(p);
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
    const PieceSpan<T, kEdges> sp(p, r, static_cast<int>(k - r * per_row));
    const unsigned bytes = static_cast<unsigned>(sp.n) * sizeof(T);
    const unsigned off = c * kChunkBytes;
    const unsigned len = off < bytes ? min(kChunkBytes, bytes - off) : 0;
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    MbarExpectTx(&landed[c], len);
    if (len > 0) {
      BulkLoad(reinterpret_cast<char*>(kept) + off,
               reinterpret_cast<const char*>(static_cast<const T*>(p.logits) +
                                             r * p.stride + sp.start) +
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
    if (ahead > 0 && tid == kBlock - 32 && k + ahead < total) {
      // (the last warp: off warp 0's publish and merge)
      const long long rn = (k + ahead) / per_row;
      const PieceSpan<T, kEdges> sn(p, rn,
                                    static_cast<int>(k + ahead - rn * per_row));
      if (sn.n > 0) {
        BulkPrefetchL2(
            static_cast<const T*>(p.logits) + rn * p.stride + sn.start,
            static_cast<unsigned>(sn.n * sizeof(T)));
      }
    }
    const long long row = k / per_row;
    if (kTerms && tid == 0) FetchRowInputs(terms, row, row_in);
    if (kTerms && terms.kd && warp == 0) {
      StageSupport(terms, row, &staged, lane);
    }
    const int piece = static_cast<int>(k - row * per_row);
    const PieceSpan<T, kEdges> span(p, row, piece);
    const int start = span.start;
    const int n = span.n;
    const T* const in_row = static_cast<const T*>(p.logits) + row * p.stride;
    const T* src = in_row + start;
    // Warp 0's lanes load the piece's edges now, off the row's chain: lane i
    // holds edge i's logit until its gradient replaces it.
    const bool edge_lane = kEdges && warp == 0 && lane < span.edges;
    const float edge_z =
        edge_lane ? Tr::Load(in_row + span.EdgeColumn(lane)) : 0.0f;
    Stats st;
    // kTau: this thread's sum of exp((z - st.m) / tau).
    const float tau_l2 = terms.inv_tau * kLog2e;
    TauSum ts = {tau_l2, 0.0f};
    using TauArg = std::conditional_t<kTau, TauSum, NoTau>;
    TauArg* tau_arg = nullptr;
    if constexpr (kTau) tau_arg = &ts;
    if (kBulk) {
      // Each batch once its chunk has landed (batch q0 is chunk
      // (q0 - tid) / (kU * kBlock)).
      st = SliceStats<T, kBlock, false, false, kOpts>(
          reinterpret_cast<const T*>(kept), n, start, tid, 0, nullptr,
          [&](int q0) {
            MbarWait(&landed[(q0 - tid) / (kU * kBlock)], parity);
          },
          opts, tau_arg);
    } else {
      st = SliceStats<T, kBlock, true, false, kOpts>(
          src, n, start, tid, 0, kept, NoWait(), opts, tau_arg);
    }
    // The warps' statistics to shared memory; warp 0 alone merges them (the
    // others go on to the barrier before the gradient, which is also the one
    // that makes `kept` whole).
    {
      const Stats w = WarpMergeStats(st);
      if (lane == 0) scratch[warp] = w;
      if constexpr (kTau) {
        const float tw = WarpSum(TauAbout(ts.sum, st.m, w.m, tau_l2));
        if (lane == 0) tau_scratch[warp] = tw;
      }
    }
    const long long y = LoadTarget(p, row);
    const bool valid = y != p.ignore_index;
    const int yl = static_cast<int>(y - start);
    // The piece whose slot carries the target logit (and whose block writes
    // the row's outputs).
    const int y_piece = valid ? span.PieceOf(static_cast<int>(y)) : 0;
    __syncthreads();
    if (warp == 0) {
      constexpr int kWarps = kBlock / 32;
      Stats edges = EmptyStats();
      if (kEdges && span.edges > 0) {
        // The edges' statistics, one element a lane (fewer than 32).
        const int c = span.EdgeColumn(lane);
        edges = WarpMergeStats(!edge_lane ? EmptyStats()
                               : kOpts ? ElementStats<T, kOpts>(opts, edge_z, c)
                                       : ElementStats(edge_z, c));
      }
      st = WarpMergeStats(lane < kWarps    ? scratch[lane]
                          : lane == kWarps ? edges
                                           : EmptyStats());
      // kTau: the piece's sum about its max st.m.
      float piece_tau = 0.0f;
      if constexpr (kTau) {
        piece_tau =
            WarpSum(lane < kWarps ? TauAbout(tau_scratch[lane], scratch[lane].m,
                                             st.m, tau_l2)
                                  : 0.0f);
      }
      PieceSlot* const row_slots = slots + (k - piece);
      // An edge's target logit, from the lane that holds it.
      unsigned y_edge = 0;
      if (kEdges && valid && span.edges > 0) {
        y_edge =
            __ballot_sync(0xffffffffu, edge_lane && span.EdgeColumn(lane) == y);
      }
      const float zy_edge =
          kEdges ? __shfl_sync(0xffffffffu, edge_z, max(0, __ffs(y_edge) - 1))
                 : 0.0f;
      if (lane == 0) {
        const bool holds_y = valid && yl >= 0 && yl < n;
        if (kBulk && holds_y) {  // (this thread may not have waited on it)
          MbarWait(&landed[yl * sizeof(T) / kChunkBytes], parity);
        }
        float zy =
            holds_y ? Tr::Load(reinterpret_cast<const T*>(kept) + yl) : 0.0f;
        if (kEdges && y_edge != 0) zy = zy_edge;
        if (kOpts) {
          zy = OptionZ<T, kOpts>(opts, zy);
          if (kOpts & kOptSmoothing) PublishWz(p.piece_wz + k, st.sum_wz);
        }
        if (kTau) PublishWz(terms.piece_tau + k, piece_tau);
        PublishSlot(row_slots + piece, st, zy);
      }
      // Every lane polls its piece's slot until the row's are all full, then
      // the warp merges them in a fixed order.
      Stats ps = EmptyStats();
      float zy_lane = 0.0f;
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
          } else {
            __nanosleep(32);
          }
        }
      }
      if ((kOpts & kOptSmoothing)) {
        __threadfence();  // (pairs with PublishWz's: the slot was full)
        ps.sum_wz =
            lane < per_row ? ReadWz(p.piece_wz + (k - piece) + lane) : 0.0f;
      }
      const Stats rs = WarpMergeStats(ps);
      const float zy =
          valid ? __shfl_sync(0xffffffffu, zy_lane, y_piece) : 0.0f;
      const bool owner = y_piece == piece;
      if constexpr (kTerms) {
        // kTau: the row's sum about its max rs.m, from the pieces' (each
        // stored before its slot was published).
        float row_tau_sum = 0.0f;
        if constexpr (kTau) {
          __threadfence();  // (pairs with PublishWz's: the slot was full)
          const float pt = lane < per_row
                               ? ReadWz(terms.piece_tau + (k - piece) + lane)
                               : 0.0f;
          row_tau_sum = WarpSum(TauAbout(pt, ps.m, rs.m, tau_l2));
        }
        // (the row's inputs, and its staged support: every lane's copies)
        if (lane == 0 || terms.kd) AwaitRowInputs();
        __syncwarp();
        const SupportView sv = SupportOf(terms, row, &staged);
        const TermsRow tr =
            MakeTermsRow(p, hdr, rs, valid, y, zy, terms, row_in, sv,
                         row_tau_sum, row, lane, owner && lane == 0);
        __syncwarp();  // (every lane has read row_in)
        if (lane == 0) {
          rowmath = tr.rm;
          row_corr = tr.corr;
          row_top_k = tr.top_k;
          row_in[kInScale] = tr.scale;
          if (kTau) row_tau = tr.tau;
        }
      } else {
        const RowMath rm =
            MakeRowMath(p, hdr, rs, valid, zy, TargetWeight(p, valid, y));
        if (lane == 0) {
          if (owner) WriteRowOutputs(p, row, valid, y, rm, rs.arg, true);
          rowmath = rm;
        }
      }
    }
    __syncthreads();
    T* const out_row = static_cast<T*>(p.grad) + row * p.stride;
    T* const out = out_row + start;
    const int nvec = n / kVec;
    float h = 0.0f;  // kTerms: this thread's share of the row's entropy
    // (kTerms forward only: the entropy alone, nothing written)
    const bool write = !kTerms || !terms.forward_only;
    if (!valid || !write) {
      if (write) ZeroSlice<T, kBlock>(out, nvec, tid);
      if constexpr (kTerms) {
        if (terms.entropy) {
          h = EntropyGradientSlice<T, kBlock, kOpts, false>(kept, out, nvec,
                                                            tid, rowmath, opts);
        }
      }
    } else {
      const RowMath rm = rowmath;
      if constexpr (kTerms) {
        const TauMath tm = kTau ? row_tau : TauMath{};  // (a register copy)
        if (terms.entropy) {
          h = EntropyGradientSlice<T, kBlock, kOpts, true, kTau>(
              kept, out, nvec, tid, rm, opts, tm);
        } else {
          EntropyGradientSlice<T, kBlock, kOpts, true, kTau, false>(
              kept, out, nvec, tid, rm, opts, tm);
        }
      } else {
        GradientSlice<T, kBlock, kOpts>(kept, out, nvec, tid, rm, opts, start);
      }
      // The target column, computed without cancellation, overwrites what
      // the same thread stored there (program order).
      if (yl >= 0 && yl < n && (yl / kVec) % kBlock == tid) {
        Tr::Store(out + yl,
                  kOpts ? TargetGrad<T, kOpts>(
                              rm, opts,
                              Tr::Load(reinterpret_cast<const T*>(kept) + yl))
                        : rm.gy);
      }
    }
    if (edge_lane) {
      // Each edge written by the lane that read it (in place: after it).
      const int c = span.EdgeColumn(lane);
      float g = 0.0f;
      if (valid) {
        const RowMath rm = rowmath;
        g = c != y  ? ElementGrad<T, kOpts>(rm, opts, edge_z, c)
            : kOpts ? TargetGrad<T, kOpts>(rm, opts, edge_z)
                    : rm.gy;
      }
      Tr::Store(out_row + c, g);
    }
    if constexpr (kTerms) {
      if (terms.entropy) {
        // (scratch is free: every warp has passed the barrier after the
        // merge)
        h = BlockReduce<kBlock>(h, reinterpret_cast<float*>(scratch));
        if (tid == 0) terms.piece_entropy[k] = h * row_corr;
      } else if (terms.kd) {
        __syncthreads();  // (the gradient before the support's fix-up)
      }
      if (terms.kd && valid && write && warp == 0) {
        // (after the barriers above: over the gradient just written)
        FixSupport<T, kOpts>(terms, SupportOf(terms, row, &staged), y, start, n,
                             out_row, row_top_k, rowmath.lse, row_in[kInScale],
                             opts, lane);
      }
    }
    parity ^= 1u;
    __syncthreads();  // kept, rowmath and item_s are rewritten by the next item
  }
}

// What a launch needs of this device: the piece's shared memory, resident
// blocks a SM, SMs, and whether the shape runs at all: the piece fits a
// block's shared memory (rows past 32 such pieces do not), and at least
// per_row blocks are resident (see the kernel: no deadlock then).
struct Plan {
  int smem = 0;
  int per_sm = 0;
  int sms = 0;
  bool fits = false;
};

template <typename T, int kLoad, bool kEdges, int kOpts, bool kTerms = false,
          bool kTau = false>
cudaError_t MakePlan(const Params& p, int per_row, Plan* plan) {
  constexpr int kBlock = kThreads;
  const auto kernel =
      SmemPieceKernel<T, kBlock, 4, kLoad, kEdges, kOpts, kTerms, kTau>;
  plan->smem = static_cast<int>(static_cast<long long>(p.chunk) * sizeof(T));
  plan->fits = false;
  int device = 0, smem_max = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e == cudaSuccess) {
    e = cudaDeviceGetAttribute(&plan->sms, cudaDevAttrMultiProcessorCount,
                               device);
  }
  if (e == cudaSuccess) {
    e = cudaDeviceGetAttribute(&smem_max,
                               cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  }
  if (e != cudaSuccess) return e;
  if (plan->smem >
      smem_max - static_cast<int>(sizeof(Stats) * (kBlock / 32 + 1)) - 64) {
    return cudaSuccess;
  }
  if (kTerms) {
    // (its static shared memory is past that headroom: the staged support)
    cudaFuncAttributes attributes;
    e = cudaFuncGetAttributes(&attributes, kernel);
    if (e != cudaSuccess) return e;
    if (plan->smem + static_cast<long long>(attributes.sharedSizeBytes) >
        smem_max) {
      return cudaSuccess;
    }
  }
  if (kLoad == kLoadBulk &&
      (plan->smem + kU * kBlock * 16 - 1) / (kU * kBlock * 16) > kBulkChunks) {
    return cudaSuccess;
  }
  e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           plan->smem);
  if (e == cudaSuccess) {
    e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&plan->per_sm, kernel,
                                                      kBlock, plan->smem);
  }
  if (e != cudaSuccess) return e;
  plan->fits = plan->per_sm > 0 && plan->sms * plan->per_sm >= per_row;
  return cudaSuccess;
}

// Launch: `per_row` (<= kMaxPieces) pieces of p.chunk elements a row, a
// persistent grid of every block that fits with a piece of shared memory
// (256 threads, four a SM); each taken item prefetches the piece 256 KiB of
// logits ahead into L2 where four blocks fit a SM (none otherwise).
template <typename T, int kLoad, bool kEdges, int kOpts, bool kTerms = false,
          bool kTau = false>
cudaError_t LaunchPieces(const Params& p, int per_row, cudaStream_t stream,
                         const RowTerms& terms = {}) {
  Plan plan;
  cudaError_t e =
      MakePlan<T, kLoad, kEdges, kOpts, kTerms, kTau>(p, per_row, &plan);
  if (e != cudaSuccess) return e;
  if (!plan.fits) return cudaErrorInvalidConfiguration;
  const long long grid = static_cast<long long>(plan.sms) * plan.per_sm;
  // The prefetch (bench/NOTES.md, the L2 prefetch): 256-512 KiB ahead, bf16
  // 82-83% -> 88-90% of copy at V >= 128k, fp32 +1-2 points; farther
  // measures worse (L2 holds the prefetched pieces longer), and with three
  // blocks of 64 KiB pieces a SM (fp32 1 MiB rows) any distance loses
  // (83% -> 72-73%).
  const long long ahead_kib = plan.per_sm >= 4 ? 256 : -1;
  // Empty piece slots (the kernel publishes into them by item).
  e = cudaMemsetAsync(p.pieces, 0, sizeof(PieceSlot) * p.rows * per_row,
                      stream);
  if (e != cudaSuccess) return e;
  SmemPieceKernel<T, kThreads, 4, kLoad, kEdges, kOpts, kTerms, kTau>
      <<<static_cast<unsigned>(grid), kThreads, plan.smem, stream>>>(
          p, per_row,
          ahead_kib > 0 ? std::max(1LL, ahead_kib * 1024LL / plan.smem) : 0,
          terms);
  return cudaGetLastError();
}

// Plans (fits != nullptr: says whether the shape runs) or launches the build
// for `bulk` and `edges`. kRegisterLoads: the type has a build with the
// threads' loads (2-byte logits).
template <typename T, int kLoad, bool kEdges, int kOpts>
cudaError_t FitOrLaunchBuild(const Params& p, int per_row, bool* fits,
                             cudaStream_t stream) {
  if (fits == nullptr)
    return LaunchPieces<T, kLoad, kEdges, kOpts>(p, per_row, stream);
  Plan plan;
  const cudaError_t e = MakePlan<T, kLoad, kEdges, kOpts>(p, per_row, &plan);
  *fits = plan.fits;
  return e;
}
template <typename T, int kLoad, bool kEdges>
cudaError_t FitOrLaunch(const Params& p, int per_row, bool* fits,
                        cudaStream_t stream) {
  // (option builds with bulk copies only: ForBuild)
  if constexpr (kLoad != kLoadBulk) {
    return FitOrLaunchBuild<T, kLoad, kEdges, 0>(p, per_row, fits, stream);
  } else {
    return WithOptionBuild(ElementOptionsOn(p), [&](auto opts) {
      return FitOrLaunchBuild<T, kLoad, kEdges, decltype(opts)::value>(
          p, per_row, fits, stream);
    });
  }
}

template <typename T, bool kRegisterLoads>
cudaError_t ForBuild(const Params& p, bool bulk, bool edges, int per_row,
                     bool* fits, cudaStream_t stream) {
  if (fits != nullptr) *fits = false;
  if (bulk || ElementOptionsOn(p)) {
    return edges ? FitOrLaunch<T, kLoadBulk, true>(p, per_row, fits, stream)
                 : FitOrLaunch<T, kLoadBulk, false>(p, per_row, fits, stream);
  }
  // The threads' loads: 2-byte logits of whole-vector rows only (with edges
  // that build spills; bulk copies measured as fast in place), plain options
  // (so does the option build, its softcap's registers on top of two batches
  // of loads in flight).
  if (!kRegisterLoads || edges || ElementOptionsOn(p)) {
    return cudaErrorInvalidValue;
  }
  constexpr int kLoad = kRegisterLoads ? kLoadRegisters : kLoadBulk;
  return FitOrLaunch<T, kLoad, false>(p, per_row, fits, stream);
}

cudaError_t ForDType(const Params& p, DType dtype, bool bulk, bool edges,
                     int pieces, bool* fits, cudaStream_t stream) {
  // (fp32 pieces always come in by bulk copies)
  return WithElementType(dtype, [&](auto t) {
    using T = decltype(t);
    return ForBuild<T, sizeof(T) == 2>(p, bulk, edges, pieces, fits, stream);
  });
}

// The kTerms builds: the softcap or none, by bulk copies, or the threads'
// loads where ForBuild would take them (2-byte logits, `bulk` false, no
// softcap); each with and without the tau sums (kTau).
template <typename T, bool kRegisterLoads, bool kTau>
cudaError_t LaunchTermsBuild(const Params& p, const RowTerms& terms, bool bulk,
                             int per_row, cudaStream_t stream) {
  if (p.softcap > 0.0f) {
    return LaunchPieces<T, kLoadBulk, false, kOptSoftcap, true, kTau>(
        p, per_row, stream, terms);
  }
  if (kRegisterLoads && !bulk) {
    constexpr int kLoad = kRegisterLoads ? kLoadRegisters : kLoadBulk;
    return LaunchPieces<T, kLoad, false, 0, true, kTau>(p, per_row, stream,
                                                        terms);
  }
  return LaunchPieces<T, kLoadBulk, false, 0, true, kTau>(p, per_row, stream,
                                                          terms);
}
template <typename T, bool kRegisterLoads>
cudaError_t LaunchTerms(const Params& p, const RowTerms& terms, bool bulk,
                        int per_row, cudaStream_t stream) {
  return NeedsTauSums(terms) ? LaunchTermsBuild<T, kRegisterLoads, true>(
                                   p, terms, bulk, per_row, stream)
                             : LaunchTermsBuild<T, kRegisterLoads, false>(
                                   p, terms, bulk, per_row, stream);
}

}  // namespace

cudaError_t LaunchSmemRowPiecesTerms(const Params& p, const RowTerms& terms,
                                     DType dtype, bool bulk, int pieces,
                                     cudaStream_t stream) {
  if (p.eps > 0.0f || p.zls != 0.0f || p.weights != nullptr ||
      (NeedsTauSums(terms) && terms.piece_tau == nullptr)) {
    return cudaErrorInvalidValue;
  }
  return WithElementType(dtype, [&](auto t) {
    using T = decltype(t);
    return LaunchTerms<T, sizeof(T) == 2>(p, terms, bulk, pieces, stream);
  });
}

cudaError_t SmemRowPiecesFit(const Params& p, DType dtype, bool bulk,
                             bool edges, int pieces, bool* fits) {
  return ForDType(p, dtype, bulk, edges, pieces, fits, nullptr);
}

cudaError_t LaunchSmemRowPieces(const Params& p, DType dtype, bool bulk,
                                bool edges, int pieces, cudaStream_t stream) {
  return ForDType(p, dtype, bulk, edges, pieces, nullptr, stream);
}

}  // namespace cuda_ce
}  // namespace lossd
