// Host side of lossd's Hopper GEMM: the TMA tensor maps (through the
// driver's entry point, as the runtime exposes no encoder), the plain store
// epilogue and the persistent launch.
#include <cuda.h>
#include <cuda_bf16.h>

#include <algorithm>

#include "kernels/cuda/gemm_sm90.cuh"
#include "kernels/cuda/gemm_sm90.h"

namespace lossd {
namespace cuda_gemm {
namespace {

// Stores the accumulator as Z's element type, two adjacent columns a store
// where Z's rows and pointer allow it.
template <typename T>
struct StoreZ {
  T* z;
  int64_t stride;
  int rows;
  int cols;
  bool pairs;

  __device__ __forceinline__ void Store2(int64_t at, float a, float b) const;

  __device__ __forceinline__ void operator()(
      const float (&acc)[kFragmentValues], const FragmentCoords& at) const {
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

template <int kCluster, typename Epilogue>
cudaError_t Launch(const CUtensorMap& x_map, const CUtensorMap& w_map,
                   const GemmSm90Args& args, const Epilogue& epilogue,
                   cudaStream_t stream) {
  auto kernel = GemmSm90Kernel<kCluster, Epilogue>;
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

template <typename Epilogue>
cudaError_t LaunchCluster(const CUtensorMap& x_map, const CUtensorMap& w_map,
                          const GemmSm90Args& args, const Epilogue& epilogue,
                          cudaStream_t stream) {
  return args.cluster == 1 ? Launch<1>(x_map, w_map, args, epilogue, stream)
                           : Launch<2>(x_map, w_map, args, epilogue, stream);
}

}  // namespace

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
  return s;
}

cudaError_t GemmSm90(const GemmSm90Args& args, cudaStream_t stream) {
  if (args.cluster != 1 && args.cluster != 2) return cudaErrorInvalidValue;
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
  const GemmSm90Shape shape = ShapeOf(args);
  if (GemmSm90Eligibility(shape, major, minor) != GemmSm90Fit::kYes) {
    return cudaErrorNotSupported;
  }
  CUtensorMap x_map, w_map;
  e = OperandMap(&x_map, args.x, args.rows, args.depth, kTileRows);
  if (e != cudaSuccess) return e;
  e = OperandMap(&w_map, args.w, args.cols, args.depth,
                 kTileCols / args.cluster);
  if (e != cudaSuccess) return e;
  const int element = shape.z_element_bytes;
  const bool pairs = args.z_stride % 2 == 0 &&
                     reinterpret_cast<uintptr_t>(args.z) % (2 * element) == 0;
  if (args.z_type == ZType::kBFloat16) {
    const StoreZ<__nv_bfloat16> store{
        static_cast<__nv_bfloat16*>(args.z), args.z_stride,
        static_cast<int>(args.rows), static_cast<int>(args.cols), pairs};
    return LaunchCluster(x_map, w_map, args, store, stream);
  }
  const StoreZ<float> store{static_cast<float*>(args.z), args.z_stride,
                            static_cast<int>(args.rows),
                            static_cast<int>(args.cols), pairs};
  return LaunchCluster(x_map, w_map, args, store, stream);
}

}  // namespace cuda_gemm
}  // namespace lossd
