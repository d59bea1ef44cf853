// The Device that makes lossd GPU-resident: tensors in CUDA memory from the
// stream-ordered allocator, pinned staging for host transfers, and a stream
// per request so that one request never waits on another's kernel.
#ifndef LOSSD_SERVER_CUDA_DEVICE_H_
#define LOSSD_SERVER_CUDA_DEVICE_H_

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "kernels/cuda/stream_block.h"
#include "server/device.h"

namespace lossd {

struct CudaDeviceOptions {
  int ordinal = 0;
  // Device memory left to everything else (CUDA context, workspaces, other
  // processes): DefaultBudgetBytes() is the free memory at start minus this.
  int64_t reserve_bytes = int64_t{2} << 30;
  // Size of one pinned staging buffer; transfers move in pieces of this size.
  size_t staging_bytes = size_t{4} << 20;
};

// Number of CUDA devices visible to this process; 0 when there is none or no
// usable driver. Thread-safe.
int CudaDeviceCount();

// True for the CUDA errors after which the context is unusable (illegal
// address, ECC, launch failure, ...): the process must end. Pure.
bool IsStickyCudaError(cudaError_t error);

// One GPU. Thread-safe: any method may be called from any thread, on distinct
// buffers (uploads into one buffer come from one thread at a time). Every
// method but CopyFromHostAsync returns only once its device work is done.
class CudaDevice final : public Device {
 public:
  // Selects and initializes device `options.ordinal`. FAILED_PRECONDITION
  // when there is no such device or no driver; INTERNAL for other CUDA
  // failures. The caller owns the result.
  static absl::StatusOr<std::unique_ptr<CudaDevice>> Create(
      const CudaDeviceOptions& options);

  CudaDevice(const CudaDevice&) = delete;
  CudaDevice& operator=(const CudaDevice&) = delete;
  // Waits for in-flight uploads and frees the pools. Every buffer from
  // Allocate must have been freed.
  ~CudaDevice() override;

  std::string name() const override;
  bool host_accessible() const override { return false; }
  DeviceMemoryInfo memory() const override;
  int64_t DefaultBudgetBytes() const override;
  void SetFatalErrorHandler(
      std::function<void(const absl::Status&)> handler) override;

  // Stream-ordered allocation (cudaMallocAsync) from the device's default
  // pool; RESOURCE_EXHAUSTED when the device has no room (after one trim of
  // the pool's cached memory).
  absl::StatusOr<void*> Allocate(size_t bytes) override;
  void Free(void* buffer, size_t bytes) override;
  absl::Status CopyFromHost(void* buffer, size_t offset, const void* host,
                            size_t bytes) override;
  // Copies through two pinned staging buffers on the buffer's own stream:
  // returns once the bytes are in pinned memory. Consecutive calls that
  // continue where the previous one ended share a staging buffer, which is
  // copied to the device when full (or by FinishWrites), so that small pieces
  // (gRPC hands a message over in ~16 KiB slices) cost no copy each.
  absl::Status CopyFromHostAsync(void* buffer, size_t offset, const void* host,
                                 size_t bytes) override;
  // The window is the upload's next pinned staging buffer (after the wait
  // for its previous copy), up to staging_bytes.
  absl::StatusOr<HostWindow> BeginHostWrite(void* buffer, size_t offset,
                                            size_t max_bytes) override;
  absl::Status CommitHostWrite(void* buffer, size_t bytes) override;
  absl::Status FinishWrites(void* buffer) override;
  // Scales and converts on the device into scratch memory, then copies to the
  // host through pinned memory.
  // cudaMemcpyAsync on a stream of the pool, then a synchronize.
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
  // PostTrainingCuda (the row kernel of kernels/cuda/post_training_rows.cu)
  // on a stream of the pool.
  absl::Status PostTraining(const PostTrainingArgs& args,
                            PostTrainingResult* result) override;
  bool serves_post_training() const override { return true; }
  // LinearCrossEntropyCuda (cuBLASLt) on a stream of the pool, the per-token
  // arrays staged through one device block.
  absl::Status LinearCrossEntropy(const LinearCrossEntropyArgs& args,
                                  CrossEntropyResult* result) override;
  // LinearPostTrainingCuda on a stream of the pool (token_grad_output staged
  // on the device; the per-token outputs written from host copies).
  absl::Status LinearPostTraining(const LinearPostTrainingArgs& args,
                                  PostTrainingResult* result) override;
  // The kernel's planned workspace (PlanLinearCrossEntropyCuda) and the
  // block staging the per-token arrays.
  int64_t LinearCrossEntropyWorkspaceBytes(
      const LinearCrossEntropyArgs& args) const override;

 private:
  // A pinned host buffer of staging_bytes and the event of the last copy that
  // used it.
  struct Staging {
    void* host = nullptr;
    cudaEvent_t done = nullptr;
  };
  // The uploads in flight into one buffer.
  struct Upload {
    cudaStream_t stream = nullptr;
    Staging staging[2];
    int next = 0;
    // Bytes in staging[next] not yet enqueued, and where they go.
    size_t filled = 0;
    char* filled_to = nullptr;
    absl::Status error;
  };

  // A stream of the pool, given back to it when this goes. Move-only.
  class PooledStream {
   public:
    PooledStream(CudaDevice* device, cudaStream_t stream)
        : device_(device), stream_(stream) {}
    PooledStream(PooledStream&& other) noexcept
        : device_(other.device_), stream_(other.stream_) {
      other.stream_ = nullptr;
    }
    PooledStream(const PooledStream&) = delete;
    PooledStream& operator=(const PooledStream&) = delete;
    PooledStream& operator=(PooledStream&&) = delete;
    ~PooledStream() {
      if (stream_ != nullptr) device_->ReleaseStream(stream_);
    }
    cudaStream_t get() const { return stream_; }

   private:
    CudaDevice* const device_;
    cudaStream_t stream_;
  };

  explicit CudaDevice(const CudaDeviceOptions& options);

  // cudaSuccess -> OK. A sticky error also calls the fatal handler.
  absl::Status Check(cudaError_t error, const char* what);

  absl::StatusOr<cudaStream_t> AcquireStream() ABSL_LOCKS_EXCLUDED(mu_);
  // AcquireStream's stream, held until the PooledStream goes.
  absl::StatusOr<PooledStream> TakeStream() ABSL_LOCKS_EXCLUDED(mu_);
  void ReleaseStream(cudaStream_t stream) ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<Staging> AcquireStaging() ABSL_LOCKS_EXCLUDED(mu_);
  void ReleaseStaging(Staging staging) ABSL_LOCKS_EXCLUDED(mu_);
  // The upload into `buffer`, started (stream and two staging buffers) when
  // there is none. Only the thread that writes into `buffer` calls it.
  absl::StatusOr<Upload*> FindOrStartUpload(void* buffer)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Device memory ordered on `stream`, trimming the pool once when full.
  absl::Status AllocateOn(void** pointer, size_t bytes, cudaStream_t stream);
  // Enqueues the device copy of the bytes gathered in the current staging
  // buffer (none: nothing to do) and moves to the other one.
  absl::Status FlushUpload(Upload* upload);
  // Waits for and removes the uploads into `buffer`; with `flush`, first
  // enqueues what is still gathered in staging.
  absl::Status EndUpload(void* buffer, bool flush) ABSL_LOCKS_EXCLUDED(mu_);
  // Copies `bytes` from device to host through pinned staging on `stream`.
  absl::Status CopyToHost(void* host, const void* device, size_t bytes,
                          cudaStream_t stream);
  // Copies host row factors [first_row, first_row + rows) to a device array
  // ordered on `stream`; the caller frees it with cudaFreeAsync.
  absl::StatusOr<float*> StageRowScale(const float* host_row_scale,
                                       int64_t rows, cudaStream_t stream);

  const CudaDeviceOptions options_;
  int64_t total_bytes_ = 0;
  int64_t free_at_start_ = 0;
  cudaMemPool_t pool_ = nullptr;
  std::atomic<int64_t> allocated_bytes_{0};

  absl::Mutex fatal_mu_;
  std::function<void(const absl::Status&)> fatal_handler_
      ABSL_GUARDED_BY(fatal_mu_);
  bool fatal_reported_ ABSL_GUARDED_BY(fatal_mu_) = false;

  absl::Mutex mu_;
  std::vector<cudaStream_t> streams_ ABSL_GUARDED_BY(mu_);
  std::vector<Staging> staging_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<void*, std::unique_ptr<Upload>> uploads_
      ABSL_GUARDED_BY(mu_);
};

}  // namespace lossd

#endif  // LOSSD_SERVER_CUDA_DEVICE_H_
