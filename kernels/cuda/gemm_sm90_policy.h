// Where lossd's Hopper GEMM (gemm_sm90.h) runs and in which order it visits
// its output tiles: pure functions, plain C++ (usable from device code), so
// that a CPU test checks them without a GPU.
#ifndef LOSSD_KERNELS_CUDA_GEMM_SM90_POLICY_H_
#define LOSSD_KERNELS_CUDA_GEMM_SM90_POLICY_H_

#include <cstdint>

#if defined(__CUDACC__)
#define LOSSD_HOST_DEVICE __host__ __device__
#else
#define LOSSD_HOST_DEVICE
#endif

namespace lossd {
namespace cuda_gemm {

// The kernel's output tile: 128 rows of Z (two consumer warpgroups of 64)
// by 256 columns, over depth blocks of 64 (one 128-byte swizzle row of bf16).
constexpr int kTileRows = 128;
constexpr int kTileCols = 256;
constexpr int kDepthBlock = 64;
// Row tiles that a band of the tile order covers (GemmTileAt).
constexpr int kBandRowTiles = 16;

// Why the kernel does or does not take a product (GemmSm90Eligibility).
enum class GemmSm90Fit {
  kYes = 0,
  kNotSm90,   // the device is not compute capability 9.0 (sm_90a code)
  kEmpty,     // a dimension is 0
  kTooLarge,  // a dimension past INT_MAX (32-bit tile and TMA coordinates)
  kZStride,   // Z's row stride shorter than a row
  kDepthAlignment,    // X's and W's row stride is not a multiple of 16 bytes
  kPointerAlignment,  // X or W not 16-byte aligned, Z not aligned to its type
};

const char* GemmSm90FitName(GemmSm90Fit fit);

struct GemmSm90Shape {
  int64_t rows = 0;         // N: rows of X and of Z
  int64_t cols = 0;         // V: rows of W, columns of Z
  int64_t depth = 0;        // H: columns of X and W (both row-major, K-major)
  int64_t z_stride = 0;     // elements between rows of Z (>= cols)
  int z_element_bytes = 2;  // 2 (bf16) or 4 (fp32)
  bool operands_aligned = false;  // X and W 16-byte aligned
  bool z_aligned = false;         // Z aligned to its element
  bool z_aligned16 = false;       // Z 16-byte aligned
};

// The policy: kYes when the sm_90a kernel takes the product on a device of
// compute capability `major`.`minor`, otherwise the first reason it does not
// (the caller then uses cuBLASLt).
GemmSm90Fit GemmSm90Eligibility(const GemmSm90Shape& shape, int major,
                                int minor);

// Whether the kernel stores Z with TMA (through shared memory, overlapped
// with the next tile) rather than from registers: a tensor map needs Z
// 16-byte aligned and its row stride a multiple of 16 bytes, and a row of
// whole 16-byte pieces, as TMA stores a box's last piece of a row whole
// (on the H100 it wrote the 16-byte piece's columns past the end).
bool ZByTensorStore(const GemmSm90Shape& shape);

// The cluster size for GemmSm90Args::cluster 0: two blocks sharing each W
// tile by multicast. With Z stored by TMA the two sizes are within the runs'
// noise of each other at the bench's shapes (H100, five runs, mean time over
// cuBLASLt's for bf16 Z: 1.017 and 1.001 with two, 1.017 and 1.023 with
// one), and two halve W's traffic out of L2, which counts for more once the
// epilogue stores no Z.
int GemmSm90Cluster(const GemmSm90Shape& shape);

// How the two consumer warpgroups share the work (gemm_sm90.cuh):
// cooperatively (both on each 128-row tile at once, their epilogues at the
// same time) or in ping-pong (each its own 64-row half of the tile, in turn,
// one's epilogue under the other's products).
enum class GemmSm90Schedule { kPolicy = 0, kCooperative, kPingPong };

// The schedule for GemmSm90Args::schedule kPolicy with `cluster` blocks a
// cluster (the ping-pong kernel is built for two only): cooperative, as
// ping-pong measured 1.23-1.32x cuBLASLt's Z against the cooperative
// 1.015-1.05x on the H100 (each W box is loaded twice a tile: bench/NOTES.md,
// the ping-pong schedule); the bench and the tests ask for it by name.
GemmSm90Schedule GemmSm90ScheduleFor(const GemmSm90Shape& shape, int cluster);

// Whether the linear cross-entropy's chunk of `shape.rows` rows takes the
// fused forward (fused_linear_forward.h: the loss's statistics in the
// GEMM's epilogue, Z never stored) rather than cuBLASLt and the fused
// cross-entropy: forward-only work (no dX, no dW: `gradient` false) on bf16
// X and W, where the GEMM takes the product (GemmSm90Eligibility, with Z's
// fields as the statistics' epilogue stores none). A gradient needs Z (or G)
// in memory for its products: FusedLinearGradientRefusal decides that.
bool FusedLinearForwardTakes(const GemmSm90Shape& shape, bool bf16,
                             bool gradient, int major, int minor);

// What a linear cross-entropy call with a gradient asks of the fused
// gradient path (FusedLinearGradientRefusal).
struct FusedGradientCall {
  bool bf16 = false;             // X and W bf16 (the kernel multiplies bf16)
  bool sparse_residual = false;  // the precision is kSparseResidual
  bool softcap = false;          // LossOptions::softcap > 0
  bool grad_bias = false;        // dbias wanted
  bool post_training = false;    // a post-training loss, not cross entropy
};

// Why a chunk's gradient does not take the fused gradient path
// (fused_linear_forward.h: the statistics and Z's fp32 store in the Hopper
// GEMM's epilogue, then the bf16 split of G straight from Z), or nullptr
// where it does. `shape` is Z's as stored: fp32 (z_element_bytes 4) in the
// chunk's workspace. Everything it refuses keeps cuBLASLt's Z and the fused
// cross-entropy, with the same precision:
// - a device other than sm_90, H not a multiple of 8, unaligned X or W
//   (GemmSm90Eligibility), or Z's rows not whole 16-byte pieces (V not a
//   multiple of 4: no TMA store, ZByTensorStore);
// - operands other than bf16;
// - a precision other than the sparse residual (the dense split's lo, fp32
//   logits kept as G, fast's 16-bit Z are cuBLASLt's layouts);
// - a softcap (its factor needs the raw logit, which the stored z is not);
// - dbias (its column sums read G in fp32, which this path never forms);
// - the post-training losses (their row kernel reads Z itself).
// Class weights, label smoothing, z-loss, ignore_index, reductions,
// normalizer, grad_scale and grad_output are all taken.
const char* FusedLinearGradientRefusal(const GemmSm90Shape& shape,
                                       const FusedGradientCall& call, int major,
                                       int minor);

struct TileCoord {
  int row_tile;
  int col_tile;
};

// The tile order of the persistent schedule. Tiles are numbered in bands of
// kBandRowTiles row tiles (the last band may be shorter); within a band the
// row tile runs fastest, so the SMs working at one time share a few W tiles
// (each read once from HBM for the whole band) and the band's X rows stay in
// L2 while the band sweeps across W. A bijection from [0, rows*cols tiles).
LOSSD_HOST_DEVICE inline TileCoord GemmTileAt(int64_t tile, int row_tiles,
                                              int col_tiles) {
  const int64_t band_tiles = static_cast<int64_t>(kBandRowTiles) * col_tiles;
  const int band = static_cast<int>(tile / band_tiles);
  const int first_row = band * kBandRowTiles;
  const int band_rows = row_tiles - first_row < kBandRowTiles
                            ? row_tiles - first_row
                            : kBandRowTiles;
  const int64_t local = tile - band * band_tiles;
  TileCoord c;
  c.row_tile = first_row + static_cast<int>(local % band_rows);
  c.col_tile = static_cast<int>(local / band_rows);
  return c;
}

}  // namespace cuda_gemm
}  // namespace lossd

#endif  // LOSSD_KERNELS_CUDA_GEMM_SM90_POLICY_H_
