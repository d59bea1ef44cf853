// lossd's Hopper GEMM, Z = X W^T (X [N, H], W [V, H], both row-major bf16,
// fp32 accumulation), with its epilogue a template parameter: the plain store
// of Z (gemm_sm90.cu), or per-row loss statistics of Z that never store it
// (fused_linear_forward.cu). sm_90a only: wgmma, TMA tensor loads and
// setmaxnreg.
#ifndef LOSSD_KERNELS_CUDA_GEMM_SM90_CUH_
#define LOSSD_KERNELS_CUDA_GEMM_SM90_CUH_

#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "kernels/cuda/gemm_sm90.h"
#include "kernels/cuda/gemm_sm90_policy.h"

namespace lossd {
namespace cuda_gemm {

// Shape (one block, persistent over tiles of Z):
//   warpgroup 0: one thread issues TMA loads of X [128, 64] and W [256, 64]
//     boxes into a ring of stages (SmemLayout; full/empty mbarriers);
//   warpgroups 1, 2: each owns 64 of the tile's 128 rows, issues
//     wgmma m64n256k16 on the stage, then hands its 64 x 256 fp32
//     accumulator (128 values a thread) to the epilogue.
// The ping-pong schedule (kPingPong) takes the same tiles and rows per
// warpgroup, but in turn: the producer loads the tile's two halves one after
// the other (X [64, 64] and W [256, 64] a stage), warpgroup 1 multiplies the
// first and warpgroup 2 the second, so that each runs its epilogue while the
// other multiplies instead of both stalling the tensor cores at once. The
// price: each W box is loaded twice a tile (from L2).
// With kCluster = 2 the blocks of a cluster take two adjacent row tiles of
// one column tile: each loads half of the W box and multicasts it to both,
// which halves W's traffic out of L2.
constexpr int kConsumerWarpgroups = 2;
constexpr int kThreads = 128 * (1 + kConsumerWarpgroups);
constexpr int kWStageBytes = kTileCols * kDepthBlock * 2;  // 32 KiB
constexpr int kMaxStages = 6;

// Ping-pong's turns: named barriers of both consumer warpgroups (ids 1 and 2
// are theirs alone, for the epilogues). Warpgroup 2 starts a tile's products
// once warpgroup 1 has waited on every stage of its own tile (kSecondTurn),
// and warpgroup 1 its next tile once warpgroup 2 has (kFirstTurn). This is
// what keeps each wait on a stage's full barrier at most one phase ahead of
// the barrier: try_wait.parity tells phases apart by parity alone, and a
// warpgroup that has skipped ahead over the other's stages would otherwise
// take a barrier two phases behind for complete (and read a stage not yet
// loaded) wherever a tile has more depth blocks than the ring has stages.
constexpr int kFirstTurn = 3;
constexpr int kSecondTurn = 4;

// What the schedule changes: the X rows a stage holds (the whole tile's, or
// one warpgroup's half) and how many consumer warpgroups read each stage.
template <bool kPingPong>
struct StageShape {
  static constexpr int kXRows = kPingPong ? kTileRows / 2 : kTileRows;
  static constexpr int kXStageBytes = kXRows * kDepthBlock * 2;
  static constexpr int kReaders = kPingPong ? 1 : kConsumerWarpgroups;
};
constexpr int kFragmentValues = kTileCols / 2;

// Shared memory: the ring's stages, then each consumer warpgroup's staging
// buffer for its epilogue (Epilogue::kStagingBytes), then the barriers. As
// many stages as fit in the opt-in 227 KiB, at most kMaxStages. The 128-byte
// swizzle repeats every 8 rows of 128 bytes: every box starts on a
// 1024-byte boundary, hence the slack.
template <int kStagingBytes, int kXStageBytes>
struct SmemLayout {
  static constexpr int kLimit = 227 * 1024;
  static constexpr int kBarrierBytes = 2 * kMaxStages * 8;
  static constexpr int kFit =
      (kLimit - 1024 - kConsumerWarpgroups * kStagingBytes - kBarrierBytes) /
      (kXStageBytes + kWStageBytes);
  static constexpr int kStages = kFit < kMaxStages ? kFit : kMaxStages;
  static_assert(kStages >= 2, "the epilogue's staging leaves no ring");
  static constexpr int kStaging = kStages * (kXStageBytes + kWStageBytes);
  static constexpr int kBarriers =
      kStaging + kConsumerWarpgroups * kStagingBytes;
  static constexpr int kBytes = kBarriers + kBarrierBytes + 1024;
};

// Where a thread's accumulator values sit in Z (wgmma's m64nN f32 layout):
// value i is at row RowOf(i), column ColOf(i). A thread holds two rows, 8
// apart, and 64 column pairs of each; the four threads of a quad (lanes 4q ..
// 4q + 3) hold all 256 columns of the same two rows, so a row's reduction
// over the tile is a quad shuffle.
struct FragmentCoords {
  int row;  // of the values with (i & 2) == 0
  int col;  // of value 0
  __device__ __forceinline__ int RowOf(int i) const {
    return row + ((i & 2) << 2);
  }
  __device__ __forceinline__ int ColOf(int i) const {
    return col + ((i >> 2) << 3) + (i & 1);
  }
};

// A consumer warpgroup's part of the tile: its 64 x 256 corner in Z, and
// what its epilogue may use besides the fragment.
struct WarpgroupTile {
  int row;                 // first of the 64 rows
  int col;                 // first of the 256 columns
  int thread;              // 0 .. 127 in the warpgroup
  int barrier;             // a named barrier id for the warpgroup's 128 threads
  unsigned char* staging;  // Epilogue::kStagingBytes, 1024-byte aligned
};

// An epilogue is a struct (a __grid_constant__ kernel parameter, so that it
// may hold TMA tensor maps) with
//   static constexpr int kStagingBytes;  // shared memory a warpgroup
//   __device__ void operator()(float (&acc)[kFragmentValues],
//                              const FragmentCoords& at,
//                              const WarpgroupTile& wg) const;
//   __device__ void Finish(const WarpgroupTile& wg) const;
// The call is made by every thread of a consumer warpgroup once its part of
// a tile is final (it may overwrite acc: the next tile's first product
// overwrites it anyway); Finish once at the end (for asynchronous stores to
// complete before the block's shared memory goes). Values past Z's rows or
// columns are zeros (TMA fills the boxes' out-of-bounds rows with zeros) and
// the epilogue must not store them.

namespace sm90 {

__device__ __forceinline__ unsigned SmemAddr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void MbarInit(uint64_t* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(SmemAddr(bar)),
               "r"(count)
               : "memory");
}

__device__ __forceinline__ void MbarExpectTx(uint64_t* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(
                   SmemAddr(bar)),
               "r"(bytes)
               : "memory");
}

// Spins on try_wait (which suspends the warp for a while inside): the
// pipeline's waits are short, and a sleep would add its granularity to each.
__device__ __forceinline__ void MbarWait(uint64_t* bar, unsigned parity) {
  unsigned done;
  do {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n"
        "}\n"
        : "=r"(done)
        : "r"(SmemAddr(bar)), "r"(parity)
        : "memory");
  } while (!done);
}

// Arrives on `bar` in the cluster's block `rank` (this block's own included):
// a stage is free for a producer only when the consumers of every block its
// multicast writes into are done with it.
__device__ __forceinline__ void MbarArriveCluster(uint64_t* bar,
                                                  unsigned rank) {
  unsigned remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;"
               : "=r"(remote)
               : "r"(SmemAddr(bar)), "r"(rank));
  // The default (.release at CTA scope), as the stage's readers were this
  // block's wgmma: a cluster-scope release here waits for the thread's
  // earlier global stores, and made the clustered product 1.8x slower.
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(remote)
               : "memory");
}

__device__ __forceinline__ void MbarArrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(SmemAddr(bar))
               : "memory");
}

__device__ __forceinline__ unsigned ClusterRank() {
  unsigned rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  return rank;
}

__device__ __forceinline__ void ClusterSync() {
  asm volatile(
      "barrier.cluster.arrive.release.aligned;\n"
      "barrier.cluster.wait.acquire.aligned;\n" ::
          : "memory");
}

// A [rows, 64] bf16 box at (depth c0, row c1) into shared memory, 128-byte
// swizzled as the tensor map says; completes its bytes on `bar`.
__device__ __forceinline__ void TmaLoad(void* dst, const CUtensorMap* map,
                                        int c0, int c1, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::"
      "bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(SmemAddr(dst)),
      "l"(map), "r"(c0), "r"(c1), "r"(SmemAddr(bar))
      : "memory");
}

// The same box written at the same offset into every block of `mask`, each
// completing on its own copy of `bar`.
__device__ __forceinline__ void TmaLoadMulticast(void* dst,
                                                 const CUtensorMap* map, int c0,
                                                 int c1, uint64_t* bar,
                                                 uint16_t mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::"
      "bytes.multicast::cluster [%0], [%1, {%2, %3}], [%4], %5;" ::"r"(
          SmemAddr(dst)),
      "l"(map), "r"(c0), "r"(c1), "r"(SmemAddr(bar)), "h"(mask)
      : "memory");
}

// wgmma's shared-memory matrix descriptor for a K-major operand stored as
// rows of 64 bf16 (128 bytes) with the 128-byte swizzle: 8-row groups 1024
// bytes apart (the stride byte offset); the leading offset is unused.
__device__ __forceinline__ uint64_t SwizzledDescriptor(const void* p) {
  const uint64_t addr = SmemAddr(p);
  return ((addr & 0x3FFFF) >> 4) | (uint64_t{1} << 16) |
         (uint64_t{1024 >> 4} << 32) | (uint64_t{1} << 62);
}

// Z's TMA stores: a box from shared memory into global memory, tracked as a
// bulk group of the issuing thread.
__device__ __forceinline__ void TmaStore(const CUtensorMap* map,
                                         const void* src, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], "
      "[%3];" ::"l"(map),
      "r"(c0), "r"(c1), "r"(SmemAddr(src))
      : "memory");
}
__device__ __forceinline__ void BulkCommit() {
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
// The thread's bulk store groups but the newest kPending have read their
// shared memory (groups complete in order).
template <int kPending>
__device__ __forceinline__ void BulkWaitRead() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(kPending) : "memory");
}
// ... and have completed.
__device__ __forceinline__ void BulkWait() {
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}
// Generic-proxy writes to shared memory become visible to the TMA unit.
__device__ __forceinline__ void FenceProxyAsync() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
__device__ __forceinline__ void NamedBarrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
// Counts this thread toward `id`'s `threads` without waiting for the rest.
__device__ __forceinline__ void NamedArrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ void WgmmaFence() {
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void WgmmaCommit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void WgmmaWait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}

// Tells the compiler that the accumulator may have changed here: wgmma
// writes it asynchronously, so no read of it may move above the wait.
__device__ __forceinline__ void FenceFragment(float (&d)[kFragmentValues]) {
#pragma unroll
  for (int i = 0; i < kFragmentValues; ++i) {
    asm volatile("" : "+f"(d[i])::"memory");
  }
}

// d (+)= A B^T for A [64, 16] and B [256, 16] as the descriptors say;
// `accumulate` 0 overwrites d.
__device__ __forceinline__ void WgmmaM64N256K16(float (&d)[kFragmentValues],
                                                uint64_t desc_a,
                                                uint64_t desc_b,
                                                int accumulate) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, "
      "%8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, "
      "%24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, "
      "%40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, "
      "%56, %57, %58, %59, %60, %61, %62, %63, "
      "%64, %65, %66, %67, %68, %69, %70, %71, "
      "%72, %73, %74, %75, %76, %77, %78, %79, "
      "%80, %81, %82, %83, %84, %85, %86, %87, "
      "%88, %89, %90, %91, %92, %93, %94, %95, "
      "%96, %97, %98, %99, %100, %101, %102, %103, "
      "%104, %105, %106, %107, %108, %109, %110, %111, "
      "%112, %113, %114, %115, %116, %117, %118, %119, "
      "%120, %121, %122, %123, %124, %125, %126, %127}, "
      "%128, %129, p, 1, 1, 0, 0;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
        "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]),
        "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]),
        "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]),
        "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),
        "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]),
        "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]),
        "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]),
        "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]),
        "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]),
        "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]),
        "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]),
        "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]),
        "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]),
        "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]),
        "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
        "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]),
        "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]),
        "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]),
        "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]),
        "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]),
        "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]),
        "+f"(d[126]), "+f"(d[127])
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

}  // namespace sm90

// The kernel. Tiles are visited in units of kCluster row tiles (one unit a
// cluster) in GemmTileAt's order, unit u by the cluster u mod clusters.
template <int kCluster, bool kPingPong, typename Epilogue>
__global__ void __launch_bounds__(kThreads, 1)
    GemmSm90Kernel(const __grid_constant__ CUtensorMap x_map,
                   const __grid_constant__ CUtensorMap w_map, int rows,
                   int cols, int depth,
                   const __grid_constant__ Epilogue epilogue) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Stage = StageShape<kPingPong>;
  constexpr int kXStageBytes = Stage::kXStageBytes;
  using Layout = SmemLayout<Epilogue::kStagingBytes, kXStageBytes>;
  constexpr int kStages = Layout::kStages;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem =
      smem_raw + ((1024 - (sm90::SmemAddr(smem_raw) & 1023)) & 1023);
  unsigned char* x_smem = smem;
  unsigned char* w_smem = smem + kStages * kXStageBytes;
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + Layout::kBarriers);
  uint64_t* empty = full + kStages;

  const int warpgroup = threadIdx.x / 128;
  const unsigned rank = kCluster == 1 ? 0 : sm90::ClusterRank();
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      sm90::MbarInit(&full[s], 1);
      // One arrival a consumer warp of every block that reads the stage.
      sm90::MbarInit(&empty[s], Stage::kReaders * 4 * kCluster);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  if (kCluster > 1) {
    sm90::ClusterSync();
  } else {
    __syncthreads();
  }

  const int row_tiles = (rows + kTileRows - 1) / kTileRows;
  const int col_tiles = (cols + kTileCols - 1) / kTileCols;
  const int unit_rows = (row_tiles + kCluster - 1) / kCluster;
  const int64_t units = static_cast<int64_t>(unit_rows) * col_tiles;
  const int first_unit = blockIdx.x / kCluster;
  const int unit_step = gridDim.x / kCluster;
  const int depth_blocks = (depth + kDepthBlock - 1) / kDepthBlock;

  if (warpgroup == 0) {
    // The producer needs few registers; the consumers get them.
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
    if (threadIdx.x == 0) {
      int stage = 0;
      unsigned phase = 0;
      for (int64_t u = first_unit; u < units; u += unit_step) {
        const TileCoord t = GemmTileAt(u, unit_rows, col_tiles);
        const int row0 = (t.row_tile * kCluster + rank) * kTileRows;
        const int col0 = t.col_tile * kTileCols;
        // The tile's X rows in one pass, or its two halves in turn.
        constexpr int kPasses = kTileRows / Stage::kXRows;
        for (int step = 0; step < kPasses * depth_blocks; ++step) {
          const int xb = step / depth_blocks;
          const int kb = step - xb * depth_blocks;
          sm90::MbarWait(&empty[stage], phase ^ 1);
          sm90::MbarExpectTx(&full[stage], kXStageBytes + kWStageBytes);
          sm90::TmaLoad(x_smem + stage * kXStageBytes, &x_map, kb * kDepthBlock,
                        row0 + xb * Stage::kXRows, &full[stage]);
          if (kCluster == 1) {
            sm90::TmaLoad(w_smem + stage * kWStageBytes, &w_map,
                          kb * kDepthBlock, col0, &full[stage]);
          } else {
            constexpr int kHalf = kTileCols / 2;
            sm90::TmaLoadMulticast(
                w_smem + stage * kWStageBytes + rank * (kWStageBytes / 2),
                &w_map, kb * kDepthBlock, col0 + static_cast<int>(rank) * kHalf,
                &full[stage], static_cast<uint16_t>((1u << kCluster) - 1));
          }
          if (++stage == kStages) {
            stage = 0;
            phase ^= 1;
          }
        }
      }
    }
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
    const int consumer = warpgroup - 1;
    const int lane_in_group = threadIdx.x % 128;
    const int warp = lane_in_group / 32;
    const int lane = lane_in_group % 32;
    WarpgroupTile wg;
    wg.row = 0;
    wg.col = 0;
    wg.thread = lane_in_group;
    wg.barrier = 1 + consumer;
    wg.staging = smem + Layout::kStaging + consumer * Epilogue::kStagingBytes;
    float acc[kFragmentValues];
    int stage = 0;
    unsigned phase = 0;
    // Passes over the other warpgroup's stages (ping-pong): n stages on in
    // the ring, the phase flipping at each wrap.
    const auto skip = [&](int n) {
      stage += n;
      phase ^= static_cast<unsigned>(stage / kStages) & 1;
      stage %= kStages;
    };
    // Frees a stage once this warp's products on it are done.
    auto release = [&](int s) {
      __syncwarp();
      if (lane == 0) {
        if (kCluster == 1) {
          sm90::MbarArrive(&empty[s]);
        } else {
#pragma unroll
          for (int r = 0; r < kCluster; ++r) {
            sm90::MbarArriveCluster(&empty[s], r);
          }
        }
      }
    };
    for (int64_t u = first_unit; u < units; u += unit_step) {
      const TileCoord t = GemmTileAt(u, unit_rows, col_tiles);
      const int row0 = (t.row_tile * kCluster + rank) * kTileRows;
      const int col0 = t.col_tile * kTileCols;
      if (kPingPong) {
        if (consumer == 1) {
          skip(depth_blocks);
          sm90::NamedBarrier(kSecondTurn, 256);
        } else if (u != first_unit) {
          sm90::NamedBarrier(kFirstTurn, 256);
        }
      }
      int previous = 0;
      for (int kb = 0; kb < depth_blocks; ++kb) {
        sm90::MbarWait(&full[stage], phase);
        const unsigned char* x_stage =
            x_smem + stage * kXStageBytes +
            (kPingPong ? 0 : consumer * (kXStageBytes / 2));
        const unsigned char* w_stage = w_smem + stage * kWStageBytes;
        const uint64_t desc_x = sm90::SwizzledDescriptor(x_stage);
        const uint64_t desc_w = sm90::SwizzledDescriptor(w_stage);
        sm90::WgmmaFence();
#pragma unroll
        for (int k = 0; k < kDepthBlock / 16; ++k) {
          // 16 bf16 of depth are 32 bytes: 2 in the descriptor's units.
          sm90::WgmmaM64N256K16(acc, desc_x + 2 * k, desc_w + 2 * k,
                                kb > 0 || k > 0);
        }
        sm90::WgmmaCommit();
        // One group stays in flight; the one before it has read its stage.
        if (kb > 0) {
          sm90::WgmmaWait<1>();
          release(previous);
        }
        previous = stage;
        if (++stage == kStages) {
          stage = 0;
          phase ^= 1;
        }
      }
      if (kPingPong) {
        // Every stage of this tile waited on: the other warpgroup's turn
        // (warpgroup 2 has no turn to give after its last tile).
        if (consumer == 0) {
          sm90::NamedArrive(kSecondTurn, 256);
        } else if (u + unit_step < units) {
          sm90::NamedArrive(kFirstTurn, 256);
        }
      }
      sm90::WgmmaWait<0>();
      sm90::FenceFragment(acc);
      release(previous);
      if (kPingPong && consumer == 0) skip(depth_blocks);
      FragmentCoords at;
      at.row = row0 + consumer * 64 + warp * 16 + lane / 4;
      at.col = col0 + 2 * (lane % 4);
      wg.row = row0 + consumer * 64;
      wg.col = col0;
      epilogue(acc, at, wg);
    }
    epilogue.Finish(wg);
  }
  // No block may leave while a peer can still multicast into it or arrive
  // on its barriers.
  __syncwarp();
  if (kCluster > 1) sm90::ClusterSync();
#elif defined(__CUDA_ARCH__)
  // Built for a device without sm_90a's features: fail loudly rather than
  // leave Z unwritten (the library is built for sm_90a alone).
  __trap();
#endif
}

// ---- host side, shared by the epilogues' entry points --------------------

// Checks the current device and `args` against GemmSm90Eligibility, fills in
// the policy's cluster size for args->cluster 0 and its schedule for
// kPolicy, and encodes X's and W's tensor maps. cudaSuccess;
// cudaErrorNotSupported where the policy says no (use cuBLASLt);
// cudaErrorInvalidValue for a cluster other than 0, 1 or 2, the ping-pong
// schedule with one block a cluster, or a map the driver refuses.
// gemm_sm90.cu.
cudaError_t PrepareGemmSm90(GemmSm90Args* args, CUtensorMap* x_map,
                            CUtensorMap* w_map);

// Enqueues the persistent kernel with `epilogue` over the tiles of `args`
// (as PrepareGemmSm90 left them: rows, cols, depth, cluster).
template <int kCluster, bool kPingPong, typename Epilogue>
cudaError_t LaunchGemmSm90Kernel(const CUtensorMap& x_map,
                                 const CUtensorMap& w_map,
                                 const GemmSm90Args& args,
                                 const Epilogue& epilogue,
                                 cudaStream_t stream) {
  auto kernel = GemmSm90Kernel<kCluster, kPingPong, Epilogue>;
  constexpr int kSmemBytes =
      SmemLayout<Epilogue::kStagingBytes,
                 StageShape<kPingPong>::kXStageBytes>::kBytes;
  cudaError_t e = cudaFuncSetAttribute(
      kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  if (e != cudaSuccess) return e;
  cudaLaunchConfig_t cfg = {};
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = kSmemBytes;
  cfg.stream = stream;
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = kCluster;
  attr.val.clusterDim.y = 1;
  attr.val.clusterDim.z = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  cfg.gridDim = dim3(kCluster);
  // Persistent: as many clusters as fit at once, no more than the units.
  int clusters = 0;
  e = cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg);
  if (e != cudaSuccess) return e;
  if (clusters <= 0) return cudaErrorInvalidConfiguration;
  const int64_t row_tiles = (args.rows + kTileRows - 1) / kTileRows;
  const int64_t col_tiles = (args.cols + kTileCols - 1) / kTileCols;
  const int64_t units = (row_tiles + kCluster - 1) / kCluster * col_tiles;
  cfg.gridDim = dim3(
      static_cast<unsigned>(std::min<int64_t>(units, clusters) * kCluster));
  return cudaLaunchKernelEx(
      &cfg, kernel, x_map, w_map, static_cast<int>(args.rows),
      static_cast<int>(args.cols), static_cast<int>(args.depth), epilogue);
}

// The same with args.cluster (1 or 2) and args.schedule chosen at run time,
// as PrepareGemmSm90 left them (ping-pong runs two blocks a cluster only).
template <typename Epilogue>
cudaError_t LaunchGemmSm90(const CUtensorMap& x_map, const CUtensorMap& w_map,
                           const GemmSm90Args& args, const Epilogue& epilogue,
                           cudaStream_t stream) {
  if (args.schedule == GemmSm90Schedule::kPingPong) {
    return LaunchGemmSm90Kernel<2, true>(x_map, w_map, args, epilogue, stream);
  }
  return args.cluster == 1 ? LaunchGemmSm90Kernel<1, false>(x_map, w_map, args,
                                                            epilogue, stream)
                           : LaunchGemmSm90Kernel<2, false>(x_map, w_map, args,
                                                            epilogue, stream);
}

}  // namespace cuda_gemm
}  // namespace lossd

#endif  // LOSSD_KERNELS_CUDA_GEMM_SM90_CUH_
