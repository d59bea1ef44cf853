// The device launch of the CUDA post-training losses (CUDA runtime headers
// only); post_training_cuda_host.h is its absl wrapper.
#ifndef LOSSD_KERNELS_CUDA_POST_TRAINING_CUDA_H_
#define LOSSD_KERNELS_CUDA_POST_TRAINING_CUDA_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/post_training.h"

namespace lossd {

// What the row kernel writes for each row (device memory).
struct PostTrainingCudaRow {
  double loss;
  double distillation;
  double ratio;
  double approx_kl;
  double kl;
  double entropy;
  float lse;
  float logprob;
  int argmax;
  int flags;  // kPostTrainingRow*
  // Last, so that a kernel's positional initializer of the fields above
  // leaves it 0.
  double z_loss;  // z_loss_scale lse^2, included in loss
};
constexpr int kPostTrainingRowValid = 1;
constexpr int kPostTrainingRowCorrect = 2;
constexpr int kPostTrainingRowClipped = 4;

// The divergence a kernel computes for `kd`: JSD at beta 0 and 1 is defined
// as forward and reverse KL (docs/api.md), so the kernels take those.
inline int KernelDivergence(const DistillationArgs& kd) {
  if (kd.divergence == Divergence::kJsd && kd.beta == 0.0f) {
    return static_cast<int>(Divergence::kForwardKl);
  }
  if (kd.divergence == Divergence::kJsd && kd.beta == 1.0f) {
    return static_cast<int>(Divergence::kReverseKl);
  }
  return static_cast<int>(kd.divergence);
}

// The largest vocabulary a top-k teacher may have on the GPU: its support is
// marked in a shared-memory bitmap of V bits (192 KiB, beside the kernel's
// ~7 KiB of static shared memory under sm_90's 227 KiB a block; past the
// default 48 KiB the launch opts in).
constexpr int64_t kPostTrainingCudaMaxTopKVocab = int64_t{192} * 1024 * 8;

// Enqueues the row kernel on `stream`: one block per row of `args` (device
// pointers; the per-token outputs are ignored here), the gradient (as
// args.base.mode says) scaled by `row_scale` [rows] (device, grad_scale
// folded in), and each row's totals into `rows_out` [rows] (device). `args`
// must be valid (ValidatePostTrainingArgs, CheckPostTrainingData on the host).
// Returns cudaErrorInvalidValue for a top-k teacher past
// kPostTrainingCudaMaxTopKVocab or rows past 2^31 - 1, else the launch's
// error. Thread-safe for distinct buffers.
cudaError_t PostTrainingCudaLaunch(const PostTrainingArgs& args,
                                   const float* row_scale,
                                   PostTrainingCudaRow* rows_out,
                                   cudaStream_t stream);

}  // namespace lossd

#endif  // LOSSD_KERNELS_CUDA_POST_TRAINING_CUDA_H_
