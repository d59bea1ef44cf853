// The absl::Status face of the CUDA post-training losses: plan the reduction
// on the host, launch the row kernel, reduce the rows as the CPU backend does.
// The server's CudaDevice and the GPU tests call it.
#ifndef LOSSD_KERNELS_CUDA_POST_TRAINING_CUDA_HOST_H_
#define LOSSD_KERNELS_CUDA_POST_TRAINING_CUDA_HOST_H_

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "kernels/post_training.h"

namespace lossd {

// Which kernel runs a call: kAuto the choice of post_training_policy.h (the
// smem row pieces schedule where it takes the call, else the row kernel);
// kRowKernel the row kernel always (tests and benches compare the two).
enum class PostTrainingCudaPath { kAuto, kRowKernel };

// Runs `device_args` (device pointers; the per-token outputs are HOST
// pointers, as for Device::PostTraining) on `stream` and waits for it. The
// small inputs' values must have been checked already (CheckPostTrainingData
// on host copies). Returns OK; INVALID_ARGUMENT as ValidatePostTrainingArgs
// or for result == nullptr; UNIMPLEMENTED for a top-k teacher over more than
// kPostTrainingCudaMaxTopKVocab classes; RESOURCE_EXHAUSTED when device
// memory runs out; INTERNAL for other CUDA errors. Synchronizes `stream`.
// Each calling thread keeps two pinned host buffers (the rows' records and
// targets come back through them), grown as needed, freed at its exit.
// Thread safety: reentrant for distinct buffers.
absl::Status PostTrainingCuda(
    const PostTrainingArgs& device_args, PostTrainingResult* result,
    cudaStream_t stream,
    PostTrainingCudaPath path = PostTrainingCudaPath::kAuto);

}  // namespace lossd

#endif  // LOSSD_KERNELS_CUDA_POST_TRAINING_CUDA_HOST_H_
