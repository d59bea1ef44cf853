// The absl::Status face of the CUDA post-training losses: launch the fast
// schedule or the row kernel and reduce the rows, on the device or the host.
// The server's CudaDevice and the GPU tests call it.
#ifndef LOSSD_KERNELS_CUDA_POST_TRAINING_CUDA_HOST_H_
#define LOSSD_KERNELS_CUDA_POST_TRAINING_CUDA_HOST_H_

#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "kernels/cuda/post_training_cuda.h"
#include "kernels/post_training.h"
#include "kernels/post_training_plan.h"

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
// Without segments the rows are reduced on the device (post_training_reduce.h)
// and only the sums and the per-token outputs asked for come back; with
// segments the rows' records come back and are reduced as the CPU backend
// does. Each calling thread keeps a pinned host buffer (what comes
// back comes through it), grown as needed, freed at its exit.
// Thread safety: reentrant for distinct buffers.
absl::Status PostTrainingCuda(
    const PostTrainingArgs& device_args, PostTrainingResult* result,
    cudaStream_t stream,
    PostTrainingCudaPath path = PostTrainingCudaPath::kAuto);

// UNIMPLEMENTED for a top-k teacher over more than
// kPostTrainingCudaMaxTopKVocab classes (the row kernel's support bitmap),
// else OK. Pure.
absl::Status CheckPostTrainingCudaSupport(const PostTrainingArgs& args);

// `device_args` with its targets and segment ids copied to the host (what
// the plan and the reduction read; the rest still device pointers), in
// `host`, which must stay where it is while host->args is used. Synchronizes
// `stream`; INTERNAL on a CUDA error.
struct PostTrainingHostView {
  PostTrainingArgs args;
  std::vector<char> targets;
  std::vector<int32_t> ids;
  SegmentArgs segments;
};
absl::Status CopyPostTrainingPlanInputs(const PostTrainingArgs& device_args,
                                        cudaStream_t stream,
                                        PostTrainingHostView* host);

// The row kernel's `out` [args.base.rows] (host copies) as the rows' totals
// (`totals`, as many) and, where args asks for them, the per-token outputs
// (HOST pointers). Pure but for those writes.
void CollectPostTrainingCudaRows(const PostTrainingArgs& args,
                                 const PostTrainingCudaRow* out,
                                 PostTrainingRowTotals* totals);

}  // namespace lossd

#endif  // LOSSD_KERNELS_CUDA_POST_TRAINING_CUDA_HOST_H_
