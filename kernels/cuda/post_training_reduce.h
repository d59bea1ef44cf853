// The device-side end of a post-training call without segments: the rows'
// records summed on the GPU in a fixed order, and the per-token outputs asked
// for gathered from them, so that only those come back to the host.
#ifndef LOSSD_KERNELS_CUDA_POST_TRAINING_REDUCE_H_
#define LOSSD_KERNELS_CUDA_POST_TRAINING_REDUCE_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/cuda/post_training_cuda.h"
#include "kernels/post_training_plan.h"

namespace lossd {

// Enqueues the sum of `rows` [count] (device records, count >= 1) into `out`
// (device memory) on `stream`, as ReducePostTrainingRows sums them: valid rows
// only; the entropy only where `policy`; the z-loss only where `z_loss` (the
// fast schedule leaves that field unwritten). One block, each thread's rows in
// row order then a fixed tree: the same bits every run, for any device.
// Returns the launch's error. Thread-safe for distinct buffers.
cudaError_t LaunchPostTrainingReduce(const PostTrainingCudaRow* rows,
                                     long long count, bool policy, bool z_loss,
                                     PostTrainingSums* out,
                                     cudaStream_t stream);

// The per-token outputs a caller asked for (device arrays [count] each;
// nullptr where not asked), as CollectPostTrainingCudaRows writes them.
struct PostTrainingCudaTokens {
  float* loss = nullptr;
  float* lse = nullptr;
  int32_t* argmax = nullptr;
  float* logprob = nullptr;
  float* entropy = nullptr;
  float* ratio = nullptr;      // 0 off a policy's valid rows
  uint8_t* clipped = nullptr;  // 0 off a policy's valid rows
};

// Enqueues the gather of the fields `tokens` asks for from `rows` [count]
// (device) on `stream`; `policy` as for the reduction. Returns the launch's
// error (cudaSuccess without a launch when nothing is asked or count is 0).
cudaError_t LaunchPostTrainingTokens(const PostTrainingCudaRow* rows,
                                     long long count, bool policy,
                                     const PostTrainingCudaTokens& tokens,
                                     cudaStream_t stream);

}  // namespace lossd

#endif  // LOSSD_KERNELS_CUDA_POST_TRAINING_REDUCE_H_
