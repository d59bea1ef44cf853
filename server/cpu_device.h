// The Device for GPU-less deployments and CI: host memory and the CPU
// backend of the cross-entropy contract (kernels/cpu).
#ifndef LOSSD_SERVER_CPU_DEVICE_H_
#define LOSSD_SERVER_CPU_DEVICE_H_

#include <atomic>
#include <cstdint>
#include <string>

#include "server/device.h"

namespace lossd {

// Host-memory device. Thread-safe.
class CpuDevice final : public Device {
 public:
  // `num_threads` is the thread count of each cross-entropy call (0 = the
  // hardware concurrency).
  explicit CpuDevice(int num_threads = 0);
  CpuDevice(const CpuDevice&) = delete;
  CpuDevice& operator=(const CpuDevice&) = delete;
  ~CpuDevice() override = default;

  std::string name() const override { return "cpu"; }
  bool host_accessible() const override { return true; }
  DeviceMemoryInfo memory() const override;
  absl::StatusOr<void*> Allocate(size_t bytes) override;
  void Free(void* buffer, size_t bytes) override;
  absl::Status CopyFromHost(void* buffer, size_t offset, const void* host,
                            size_t bytes) override;
  absl::Status CopyWithin(void* dst, const void* src, size_t bytes) override;
  absl::Status ReadConverted(const void* buffer, DType src_dtype, int64_t first,
                             int64_t count, int64_t row_length, float scale,
                             const float* host_row_scale, void* host_dst,
                             DType dst_dtype) override;
  absl::Status ScaleInPlace(void* buffer, DType dtype, int64_t count,
                            int64_t row_length, float scale,
                            const float* host_row_scale) override;
  absl::Status CrossEntropy(const CrossEntropyArgs& args,
                            CrossEntropyResult* result) override;
  // PostTrainingCpu (fp64 rows).
  absl::Status PostTraining(const PostTrainingArgs& args,
                            PostTrainingResult* result) override;
  bool serves_post_training() const override { return true; }
  // LinearCrossEntropyCpu (OpenBLAS).
  absl::Status LinearCrossEntropy(const LinearCrossEntropyArgs& args,
                                  CrossEntropyResult* result) override;
  // LinearPostTrainingCpu (fp64 rows on fp32 chunks of Z).
  absl::Status LinearPostTraining(const LinearPostTrainingArgs& args,
                                  PostTrainingResult* result) override;
  // LinearCrossEntropyCpuWorkspaceBytes: its scratch is host memory, the
  // CPU device's.
  int64_t LinearCrossEntropyWorkspaceBytes(
      const LinearCrossEntropyArgs& args) const override;

 private:
  const int num_threads_;
  const int64_t total_bytes_;
  std::atomic<int64_t> allocated_bytes_{0};
};

}  // namespace lossd

#endif  // LOSSD_SERVER_CPU_DEVICE_H_
