// The absl::Status face of the CUDA cross-entropy backend: validation, one
// synchronous call for callers that want a CrossEntropyResult on the host, and
// the single cudaError_t -> absl::Status mapping of the CUDA code.
#ifndef LOSSD_KERNELS_CUDA_CROSS_ENTROPY_CUDA_HOST_H_
#define LOSSD_KERNELS_CUDA_CROSS_ENTROPY_CUDA_HOST_H_

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "kernels/cross_entropy.h"
#include "kernels/cuda/cross_entropy_cuda.h"

namespace lossd {

// OK for cudaSuccess; RESOURCE_EXHAUSTED for cudaErrorMemoryAllocation;
// INTERNAL naming `what` and cudaGetErrorString otherwise. Pure.
absl::Status CudaStatus(cudaError_t error, absl::string_view what);

// Runs the fused cross-entropy on `stream` for `device_args` (device
// pointers; same contract as CrossEntropyCpu), waits for the stream and fills
// *result on the host. Allocates its workspace from the stream's memory pool.
//
// Returns OK; INVALID_ARGUMENT when ValidateCrossEntropyArgs fails, result is
// nullptr, or a target is outside [0, vocab) and not ignore_index (the message
// names the first such row and value; then no output is written and in-place
// logits are unchanged); RESOURCE_EXHAUSTED when device memory runs out;
// INTERNAL for other CUDA errors. Synchronizes `stream`. Ownership: borrows
// every buffer until it returns. Thread safety: reentrant for distinct buffers.
absl::Status CrossEntropyCuda(const CrossEntropyArgs& device_args,
                              CrossEntropyResult* result, cudaStream_t stream,
                              const CrossEntropyCudaConfig* config = nullptr);

}  // namespace lossd

#endif  // LOSSD_KERNELS_CUDA_CROSS_ENTROPY_CUDA_HOST_H_
