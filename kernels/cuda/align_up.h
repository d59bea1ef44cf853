// The alignment of the parts of a device block (workspaces, scratch): plain
// C++, so that host files and .cu files share the one definition.
#ifndef LOSSD_KERNELS_CUDA_ALIGN_UP_H_
#define LOSSD_KERNELS_CUDA_ALIGN_UP_H_

#include <cstddef>

namespace lossd {

// Parts start at 256 bytes: kernels load 16-byte vectors, and 256 is
// cudaMalloc's own guarantee.
constexpr std::size_t kDeviceAlign = 256;

// `bytes` rounded up to kDeviceAlign.
constexpr std::size_t AlignUp(std::size_t bytes) {
  return (bytes + kDeviceAlign - 1) / kDeviceAlign * kDeviceAlign;
}

}  // namespace lossd

#endif  // LOSSD_KERNELS_CUDA_ALIGN_UP_H_
