// What the cluster schedules share: a block's slice of a row, launching a
// kernel in clusters, persistent (as many clusters as can be resident), and
// the dispatch of a launcher on the logits' element type.

#ifndef LOSSD_KERNELS_CUDA_CLUSTER_LAUNCH_CUH_
#define LOSSD_KERNELS_CUDA_CLUSTER_LAUNCH_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "common/dtype.h"
#include "kernels/cuda/dtype_dispatch.cuh"
#include "kernels/cuda/launch_params.h"

namespace lossd {
namespace cuda_ce {

// The columns [start, end) of every row that one block of a cluster owns:
// p.chunk columns from rank * p.chunk, cut at the vocab (none past it).
struct VocabSlice {
  int start;
  int end;

  __device__ bool Holds(long long column) const {
    return column >= start && column < end;
  }
  __device__ int Size() const { return max(0, end - start); }
};

// The slice of the block of rank `rank` in its cluster.
__device__ __forceinline__ VocabSlice VocabSliceOf(const Params& p, int rank) {
  const int start = rank * p.chunk;
  return {start, min(start + p.chunk, p.vocab)};
}

// Makes `cfg` launch `kernel` in clusters of `csize` blocks along x, with
// `attr` (which must outlive the launch) as its one attribute; clusters past
// 8 blocks (the portable size) are allowed first.
template <typename... KernelArgs>
cudaError_t SetClusterLaunch(void (*kernel)(KernelArgs...), int csize,
                             cudaLaunchAttribute* attr,
                             cudaLaunchConfig_t* cfg) {
  if (csize > 8) {
    const cudaError_t e = cudaFuncSetAttribute(
        kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
    if (e != cudaSuccess) return e;
  }
  attr->id = cudaLaunchAttributeClusterDimension;
  attr->val.clusterDim.x = csize;
  attr->val.clusterDim.y = 1;
  attr->val.clusterDim.z = 1;
  cfg->attrs = attr;
  cfg->numAttrs = 1;
  return cudaSuccess;
}

// Launches `kernel` with `cfg` (block, shared memory and stream set) in
// clusters of `csize` blocks on a persistent grid: as many clusters as can be
// resident at once, at most one a row.
template <typename... KernelArgs, typename... Args>
cudaError_t LaunchPersistentClusters(void (*kernel)(KernelArgs...),
                                     cudaLaunchConfig_t cfg, int csize,
                                     long long rows, Args... args) {
  cudaLaunchAttribute attr;
  const cudaError_t set = SetClusterLaunch(kernel, csize, &attr, &cfg);
  if (set != cudaSuccess) return set;
  cfg.gridDim = dim3(static_cast<unsigned>(csize));
  int clusters = 0;
  const cudaError_t e = cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg);
  if (e != cudaSuccess || clusters <= 0) {
    cudaGetLastError();
    return e != cudaSuccess ? e : cudaErrorInvalidConfiguration;
  }
  cfg.gridDim =
      dim3(static_cast<unsigned>(std::min<long long>(rows, clusters) * csize));
  return cudaLaunchKernelEx(&cfg, kernel, args...);
}

// Names an element type for DispatchElementType's callers.
template <typename T>
struct ElementTag {
  using type = T;
};

// Returns launch(ElementTag<T>()) for the element type T of `dtype` (float,
// __nv_bfloat16, __half; WithElementType's switch): `launch` instantiates the
// launcher of T. cudaErrorInvalidValue for any other dtype.
template <typename Launch>
cudaError_t DispatchElementType(DType dtype, const Launch& launch) {
  return WithElementType(dtype, [&](auto element) {
    return launch(ElementTag<decltype(element)>());
  });
}

// Returns launch(ElementTag<T>(), opts) for the element type of `dtype` and
// p's option build (WithOptionBuild): the entry of a schedule with option
// builds.
template <typename Launch>
cudaError_t DispatchBuild(const Params& p, DType dtype, const Launch& launch) {
  return DispatchElementType(dtype, [&](auto element) {
    return WithOptionBuild(ElementOptionsOn(p),
                           [&](auto opts) { return launch(element, opts); });
  });
}

// DispatchBuild for a schedule whose launcher is the static member template
// Schedule::Launch<T, kOpts>(p, args...): a function template cannot be
// passed as an argument, so each schedule names its launcher this way.
template <typename Schedule, typename... Args>
cudaError_t LaunchBuild(const Params& p, DType dtype, Args... args) {
  return DispatchBuild(p, dtype, [&](auto element, auto opts) {
    return Schedule::template Launch<typename decltype(element)::type,
                                     decltype(opts)::value>(p, args...);
  });
}

}  // namespace cuda_ce
}  // namespace lossd

#endif  // LOSSD_KERNELS_CUDA_CLUSTER_LAUNCH_CUH_
