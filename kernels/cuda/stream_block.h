// Device memory ordered on one stream (cudaMallocAsync), freed on that stream
// when its owner goes: host code with early returns releases what a call
// allocated on every path without freeing by hand before each return.
#ifndef LOSSD_KERNELS_CUDA_STREAM_BLOCK_H_
#define LOSSD_KERNELS_CUDA_STREAM_BLOCK_H_

#include <cuda_runtime_api.h>

#include <cstddef>

namespace lossd {

// One block of stream-ordered device memory (nullptr: none). Declare it after
// the stream it is ordered on, so that the free is enqueued before the stream
// goes back to a pool. Not thread-safe: one owner; neither copied nor moved.
class StreamBlock {
 public:
  explicit StreamBlock(cudaStream_t stream) : stream_(stream) {}
  StreamBlock(const StreamBlock&) = delete;
  StreamBlock& operator=(const StreamBlock&) = delete;
  ~StreamBlock() { Free(); }

  // Allocates `bytes` on the stream (the block held before is freed first).
  cudaError_t Allocate(size_t bytes) {
    Free();
    return cudaMallocAsync(&pointer_, bytes, stream_);
  }
  // Where an allocator of the caller's own writes the block (the one held
  // before is freed first).
  void** address() {
    Free();
    return &pointer_;
  }
  void* get() const { return pointer_; }
  void Free() {
    if (pointer_ != nullptr) cudaFreeAsync(pointer_, stream_);
    pointer_ = nullptr;
  }

 private:
  const cudaStream_t stream_;
  void* pointer_ = nullptr;
};

}  // namespace lossd

#endif  // LOSSD_KERNELS_CUDA_STREAM_BLOCK_H_
