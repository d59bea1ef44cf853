// The epilogues that store Z from the accumulator (from the registers, or
// by TMA through shared memory), shared by the plain product (gemm_sm90.cu)
// and the fused linear cross-entropy, whose gradient path stores Z too.
#ifndef LOSSD_KERNELS_CUDA_GEMM_SM90_STORE_CUH_
#define LOSSD_KERNELS_CUDA_GEMM_SM90_STORE_CUH_

#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/cuda/gemm_sm90.cuh"

namespace lossd {
namespace cuda_gemm {

// Stores the accumulator as Z's element type straight from the registers,
// two adjacent columns a store where Z's rows and pointer allow it: for Z
// that no tensor map can describe.
template <typename T>
struct StoreZ {
  static constexpr int kStagingBytes = 0;
  T* z;
  int64_t stride;
  int rows;
  int cols;
  bool pairs;

  __device__ __forceinline__ void Store2(int64_t at, float a, float b) const;

  __device__ __forceinline__ void operator()(
      const float (&acc)[kFragmentValues], const FragmentCoords& at,
      const WarpgroupTile&) const {
#pragma unroll
    for (int i = 0; i < kFragmentValues; i += 2) {
      const int r = at.RowOf(i);
      const int c = at.ColOf(i);
      if (r >= rows || c >= cols) continue;
      const int64_t offset = r * stride + c;
      if (pairs && c + 1 < cols) {
        Store2(offset, acc[i], acc[i + 1]);
      } else {
        Store1(offset, acc[i]);
        if (c + 1 < cols) Store1(offset + 1, acc[i + 1]);
      }
    }
  }
  __device__ __forceinline__ void Store1(int64_t at, float v) const;
  __device__ __forceinline__ void Finish(const WarpgroupTile&) const {}
};

__device__ __forceinline__ unsigned Pack(__nv_bfloat16, float a, float b) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<const unsigned*>(&v);
}

// Stores the accumulator through shared memory with TMA: the warpgroup
// writes its 64 x 256 values, a chunk of columns at a time, into the halves
// of its staging buffer in turn, as boxes of 64 rows by 128 bytes, 128-byte
// swizzled (a quad's 16-byte pieces of 8 rows fall on distinct banks), and
// one thread hands each chunk's boxes to the TMA unit, which clips them at
// Z's edges. A half is written again once its previous chunk has been read,
// while the other half's stores drain: the warpgroup goes on to its next
// tile without waiting for its last chunk.
template <typename T>
struct TmaStoreZ {
  static constexpr int kStagingBytes = 32 * 1024;
  static constexpr int kBoxCols = 128 / sizeof(T);
  static constexpr int kBoxBytes = 64 * 128;
  static constexpr int kChunkBytes = kStagingBytes / 2;
  static constexpr int kChunkCols = kBoxCols * (kChunkBytes / kBoxBytes);
  static_assert(kTileCols / kChunkCols % 2 == 0,
                "each tile starts on the first half");
  CUtensorMap map;  // Z, in [64, kBoxCols] boxes
  int rows;

  __device__ __forceinline__ void operator()(
      const float (&acc)[kFragmentValues], const FragmentCoords&,
      const WarpgroupTile& wg) const {
    if (wg.row >= rows) return;  // the idle half of a cluster's last unit
    const int lane = wg.thread % 32;
    const int q = lane % 4;
    // One loop over the fragment, the chunk's barriers at its edges: fully
    // unrolled, so that the accumulator stays in registers.
    constexpr int kChunkValues = kChunkCols / 2;
#pragma unroll
    for (int i = 0; i < kFragmentValues; i += 2) {
      const int chunk = i / kChunkValues;
      unsigned char* half = wg.staging + (chunk % 2) * kChunkBytes;
      if (i % kChunkValues == 0) {
        if (wg.thread == 0) sm90::BulkWaitRead<1>();
        sm90::NamedBarrier(wg.barrier, 128);
      }
      const int r = (wg.thread / 32) * 16 + lane / 4 + ((i & 2) << 2);
      const int c = 8 * (i / 4) + 2 * q - chunk * kChunkCols;
      const int byte = (c % kBoxCols) * static_cast<int>(sizeof(T));
      unsigned char* at = half + (c / kBoxCols) * kBoxBytes + r * 128 +
                          (((byte >> 4) ^ (r & 7)) << 4) + (byte & 15);
      if (sizeof(T) == 2) {
        *reinterpret_cast<unsigned*>(at) =
            Pack(__nv_bfloat16(), acc[i], acc[i + 1]);
      } else {
        *reinterpret_cast<float2*>(at) = make_float2(acc[i], acc[i + 1]);
      }
      if ((i + 2) % kChunkValues == 0) {
        sm90::FenceProxyAsync();
        sm90::NamedBarrier(wg.barrier, 128);
        if (wg.thread == 0) {
#pragma unroll
          for (int b = 0; b < kChunkBytes / kBoxBytes; ++b) {
            sm90::TmaStore(&map, half + b * kBoxBytes,
                           wg.col + chunk * kChunkCols + b * kBoxCols, wg.row);
          }
          sm90::BulkCommit();
        }
      }
    }
  }
  __device__ __forceinline__ void Finish(const WarpgroupTile& wg) const {
    if (wg.thread == 0) sm90::BulkWait();
  }
};

template <>
__device__ __forceinline__ void StoreZ<__nv_bfloat16>::Store2(int64_t at,
                                                              float a,
                                                              float b) const {
  *reinterpret_cast<__nv_bfloat162*>(z + at) = __floats2bfloat162_rn(a, b);
}
template <>
__device__ __forceinline__ void StoreZ<__nv_bfloat16>::Store1(int64_t at,
                                                              float v) const {
  z[at] = __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ void StoreZ<float>::Store2(int64_t at, float a,
                                                      float b) const {
  *reinterpret_cast<float2*>(z + at) = make_float2(a, b);
}
template <>
__device__ __forceinline__ void StoreZ<float>::Store1(int64_t at,
                                                      float v) const {
  z[at] = v;
}

// Z [rows, z_stride] written in [64, box_cols] boxes of 128 bytes a row,
// 128-byte swizzled as TmaStoreZ stages them. gemm_sm90.cu.
cudaError_t ZMap(CUtensorMap* map, const GemmSm90Args& args,
                 CUtensorMapDataType type, int box_cols);

}  // namespace cuda_gemm
}  // namespace lossd

#endif  // LOSSD_KERNELS_CUDA_GEMM_SM90_STORE_CUH_
