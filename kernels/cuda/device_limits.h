// The schedule policy's view of the current device (DeviceLimits), as the
// dispatch fills it: queried once a device, then cached.
#ifndef LOSSD_KERNELS_CUDA_DEVICE_LIMITS_H_
#define LOSSD_KERNELS_CUDA_DEVICE_LIMITS_H_

#include <cuda_runtime_api.h>

#include "kernels/cuda/schedule_policy.h"

namespace lossd {
namespace cuda_ce {

// The current device's DeviceLimits (its attributes, and the smem row pieces
// kernel's sm_90 builds as DeviceLimits' defaults say). cudaSuccess, or the
// error of cudaGetDevice or cudaDeviceGetAttribute (not cached: the next call
// asks again). Thread-safe.
cudaError_t CurrentDeviceLimits(DeviceLimits* limits);

}  // namespace cuda_ce
}  // namespace lossd

#endif  // LOSSD_KERNELS_CUDA_DEVICE_LIMITS_H_
