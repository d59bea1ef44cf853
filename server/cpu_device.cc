// CpuDevice: host memory plus lossd::CrossEntropyCpu and
// lossd::ConvertAndScale.
#include "server/cpu_device.h"

#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <new>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/convert.h"
#include "kernels/cpu/cross_entropy_cpu.h"
#include "kernels/cpu/linear_cross_entropy_cpu.h"
#include "kernels/cpu/post_training_cpu.h"

namespace lossd {
namespace {

// Cache-line alignment suits every dtype and keeps rows of threads apart.
constexpr size_t kAlignment = 64;

int64_t PhysicalMemoryBytes() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page_size = sysconf(_SC_PAGE_SIZE);
  if (pages <= 0 || page_size <= 0) return 0;
  return static_cast<int64_t>(pages) * page_size;
}

}  // namespace

CpuDevice::CpuDevice(int num_threads)
    : num_threads_(num_threads), total_bytes_(PhysicalMemoryBytes()) {}

DeviceMemoryInfo CpuDevice::memory() const {
  return {allocated_bytes_.load(std::memory_order_relaxed), total_bytes_};
}

absl::StatusOr<void*> CpuDevice::Allocate(size_t bytes) {
  if (bytes == 0) return absl::InvalidArgumentError("allocation of 0 bytes");
  const size_t rounded = (bytes + kAlignment - 1) / kAlignment * kAlignment;
  if (rounded < bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cpu: cannot allocate ", bytes, " bytes"));
  }
  void* buffer = std::aligned_alloc(kAlignment, rounded);
  if (buffer == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cpu: cannot allocate ", bytes, " bytes"));
  }
  allocated_bytes_.fetch_add(static_cast<int64_t>(bytes),
                             std::memory_order_relaxed);
  return buffer;
}

void CpuDevice::Free(void* buffer, size_t bytes) {
  if (buffer == nullptr) return;
  std::free(buffer);
  allocated_bytes_.fetch_sub(static_cast<int64_t>(bytes),
                             std::memory_order_relaxed);
}

absl::Status CpuDevice::CopyFromHost(void* buffer, size_t offset,
                                     const void* host, size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  std::memcpy(static_cast<char*>(buffer) + offset, host, bytes);
  return absl::OkStatus();
}

absl::Status CpuDevice::CopyWithin(void* dst, const void* src, size_t bytes) {
  if (bytes > 0) std::memcpy(dst, src, bytes);
  return absl::OkStatus();
}

absl::Status CpuDevice::ReadConverted(const void* buffer, DType src_dtype,
                                      int64_t first, int64_t count,
                                      int64_t row_length, float scale,
                                      const float* host_row_scale,
                                      void* host_dst, DType dst_dtype) {
  const void* src =
      static_cast<const char*>(buffer) + first * DTypeSize(src_dtype);
  return ConvertAndScale(src, src_dtype, host_dst, dst_dtype, first, count,
                         row_length, scale, host_row_scale);
}

absl::Status CpuDevice::ScaleInPlace(void* buffer, DType dtype, int64_t count,
                                     int64_t row_length, float scale,
                                     const float* host_row_scale) {
  return ConvertAndScale(buffer, dtype, buffer, dtype, 0, count, row_length,
                         scale, host_row_scale);
}

absl::Status CpuDevice::CrossEntropy(const CrossEntropyArgs& args,
                                     CrossEntropyResult* result) {
  return CrossEntropyCpu(args, result, num_threads_);
}

absl::Status CpuDevice::PostTraining(const PostTrainingArgs& args,
                                     PostTrainingResult* result) {
  return PostTrainingCpu(args, result, num_threads_);
}

absl::Status CpuDevice::LinearCrossEntropy(const LinearCrossEntropyArgs& args,
                                           CrossEntropyResult* result) {
  return LinearCrossEntropyCpu(args, result);
}

absl::Status CpuDevice::LinearPostTraining(const LinearPostTrainingArgs& args,
                                           PostTrainingResult* result) {
  return LinearPostTrainingCpu(args, result, num_threads_);
}

int64_t CpuDevice::LinearCrossEntropyWorkspaceBytes(
    const LinearCrossEntropyArgs& args) const {
  return LinearCrossEntropyCpuWorkspaceBytes(args);
}

}  // namespace lossd
