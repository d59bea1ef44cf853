// Host side of lossd's Hopper GEMM: the TMA tensor maps (through the
// driver's entry point, as the runtime exposes no encoder) and the plain
// product's launch with the store epilogues of gemm_sm90_store.cuh.
#include <cuda.h>
#include <cuda_bf16.h>

#include "kernels/cuda/gemm_sm90.cuh"
#include "kernels/cuda/gemm_sm90.h"
#include "kernels/cuda/gemm_sm90_store.cuh"

namespace lossd {
namespace cuda_gemm {
namespace {

using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t,
                                 void*, const cuuint64_t*, const cuuint64_t*,
                                 const cuuint32_t*, const cuuint32_t*,
                                 CUtensorMapInterleave, CUtensorMapSwizzle,
                                 CUtensorMapL2promotion,
                                 CUtensorMapFloatOOBfill);

// cuTensorMapEncodeTiled, looked up once; null if the driver lacks it.
EncodeTiled Encoder() {
  static EncodeTiled encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000,
                                         cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      return static_cast<EncodeTiled>(nullptr);
    }
    return reinterpret_cast<EncodeTiled>(fn);
  }();
  return encode;
}

// A row-major bf16 [rows, depth] matrix read in [box_rows, 64] boxes, rows
// and depth past the ends filled with zeros.
cudaError_t OperandMap(CUtensorMap* map, const void* base, int64_t rows,
                       int64_t depth, int box_rows) {
  const EncodeTiled encode = Encoder();
  if (encode == nullptr) return cudaErrorNotSupported;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(depth),
                              static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(depth) * 2};
  const cuuint32_t box[2] = {kDepthBlock, static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult r =
      encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(base),
             dims, strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
             CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
             CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

}  // namespace

// Z [rows, z_stride] written in [64, box_cols] boxes of 128 bytes a row,
// 128-byte swizzled as TmaStoreZ stages them.
cudaError_t ZMap(CUtensorMap* map, const GemmSm90Args& args,
                 CUtensorMapDataType type, int box_cols) {
  const EncodeTiled encode = Encoder();
  if (encode == nullptr) return cudaErrorNotSupported;
  const int64_t element = type == CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 ? 2 : 4;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(args.cols),
                              static_cast<cuuint64_t>(args.rows)};
  const cuuint64_t strides[1] = {
      static_cast<cuuint64_t>(args.z_stride * element)};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(box_cols), 64};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult r = encode(
      map, type, 2, args.z, dims, strides, box, element_strides,
      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
      CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

GemmSm90Shape ShapeOf(const GemmSm90Args& args) {
  GemmSm90Shape s;
  s.rows = args.rows;
  s.cols = args.cols;
  s.depth = args.depth;
  s.z_stride = args.z_stride;
  s.z_element_bytes = args.z_type == ZType::kBFloat16 ? 2 : 4;
  s.operands_aligned = reinterpret_cast<uintptr_t>(args.x) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(args.w) % 16 == 0;
  s.z_aligned = reinterpret_cast<uintptr_t>(args.z) % s.z_element_bytes == 0;
  s.z_aligned16 = reinterpret_cast<uintptr_t>(args.z) % 16 == 0;
  return s;
}

cudaError_t PrepareGemmSm90(GemmSm90Args* args, CUtensorMap* x_map,
                            CUtensorMap* w_map) {
  if (args->cluster < 0 || args->cluster > 2) return cudaErrorInvalidValue;
  int device = 0, major = 0, minor = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e == cudaSuccess) {
    e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor,
                               device);
  }
  if (e == cudaSuccess) {
    e = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor,
                               device);
  }
  if (e != cudaSuccess) return e;
  const GemmSm90Shape shape = ShapeOf(*args);
  if (GemmSm90Eligibility(shape, major, minor) != GemmSm90Fit::kYes) {
    return cudaErrorNotSupported;
  }
  if (args->cluster == 0) args->cluster = GemmSm90Cluster(shape);
  if (args->schedule == GemmSm90Schedule::kPolicy) {
    args->schedule = GemmSm90ScheduleFor(shape, args->cluster);
  }
  const bool ping_pong = args->schedule == GemmSm90Schedule::kPingPong;
  if (ping_pong && args->cluster != 2) return cudaErrorInvalidValue;
  // Ping-pong's stages hold one warpgroup's half of the tile's rows.
  e = OperandMap(x_map, args->x, args->rows, args->depth,
                 ping_pong ? kTileRows / 2 : kTileRows);
  if (e != cudaSuccess) return e;
  return OperandMap(w_map, args->w, args->cols, args->depth,
                    kTileCols / args->cluster);
}

cudaError_t GemmSm90(const GemmSm90Args& requested, cudaStream_t stream) {
  GemmSm90Args args = requested;
  CUtensorMap x_map, w_map;
  cudaError_t e = PrepareGemmSm90(&args, &x_map, &w_map);
  if (e != cudaSuccess) return e;
  const GemmSm90Shape shape = ShapeOf(args);
  const int element = shape.z_element_bytes;
  if (ZByTensorStore(shape)) {
    const CUtensorMapDataType type = args.z_type == ZType::kBFloat16
                                         ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                         : CU_TENSOR_MAP_DATA_TYPE_FLOAT32;
    const int box_cols = 128 / element;
    if (args.z_type == ZType::kBFloat16) {
      TmaStoreZ<__nv_bfloat16> store;
      store.rows = static_cast<int>(args.rows);
      e = ZMap(&store.map, args, type, box_cols);
      if (e != cudaSuccess) return e;
      return LaunchGemmSm90(x_map, w_map, args, store, stream);
    }
    TmaStoreZ<float> store;
    store.rows = static_cast<int>(args.rows);
    e = ZMap(&store.map, args, type, box_cols);
    if (e != cudaSuccess) return e;
    return LaunchGemmSm90(x_map, w_map, args, store, stream);
  }
  const bool pairs = args.z_stride % 2 == 0 &&
                     reinterpret_cast<uintptr_t>(args.z) % (2 * element) == 0;
  if (args.z_type == ZType::kBFloat16) {
    const StoreZ<__nv_bfloat16> store{
        static_cast<__nv_bfloat16*>(args.z), args.z_stride,
        static_cast<int>(args.rows), static_cast<int>(args.cols), pairs};
    return LaunchGemmSm90(x_map, w_map, args, store, stream);
  }
  const StoreZ<float> store{static_cast<float*>(args.z), args.z_stride,
                            static_cast<int>(args.rows),
                            static_cast<int>(args.cols), pairs};
  return LaunchGemmSm90(x_map, w_map, args, store, stream);
}

}  // namespace cuda_gemm
}  // namespace lossd
