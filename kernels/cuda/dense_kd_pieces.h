// Distillation against a dense teacher on row pieces kept in shared memory
// (student and teacher slices side by side): the launch, CUDA runtime headers
// only; the kernel is dense_kd_pieces.cu.
#ifndef LOSSD_KERNELS_CUDA_DENSE_KD_PIECES_H_
#define LOSSD_KERNELS_CUDA_DENSE_KD_PIECES_H_

#include <cuda_runtime_api.h>

#include <cstddef>

#include "kernels/cuda/post_training_cuda.h"
#include "kernels/post_training.h"

namespace lossd {
namespace cuda_ce {

// One dense-teacher distillation call, forward+gradient, device pointers:
// `base` the student (its gradient, targets or none for alpha 0, and
// ignore_index; the other options off) and `kd` the teacher (teacher_logits
// set). Student, gradient and teacher rows start 16-byte aligned and the
// vocab is a whole number of 16-byte vectors of both dtypes; each row is cut
// into `pieces` pieces of `chunk` elements (a multiple of 8; the last may be
// shorter), as ChoosePostTrainingSchedule sizes them.
struct DenseKdPieces {
  CrossEntropyArgs base;
  DistillationArgs kd;
  int divergence = 0;  // KernelDivergence(kd)
  int chunk = 0;
  int pieces = 0;
  const float* row_scale = nullptr;  // [rows]: the reduction's, grad_scale in
  PostTrainingCudaRow* rows_out = nullptr;  // [rows], as the row kernel's
  void* workspace = nullptr;  // DenseKdWorkspaceBytes(rows, pieces)
  // false: the records alone, nothing written over the gradient (forward
  // only; the statistics pass and JSD's sums without the gradient pass).
  bool gradient = true;
  // false: the records' entropy is 0, not summed (an FMA and a select an
  // element) where no one reads it (no policy, no per-token entropy).
  bool entropy = true;
};

// Device bytes of the launch's workspace (a work counter and each piece's
// published statistics).
size_t DenseKdWorkspaceBytes(long long rows, int pieces);

// Enqueues the call: the gradient over `gradient` and each row's record into
// `rows_out`. cudaErrorInvalidConfiguration (nothing enqueued) where the
// pieces do not fit this device (shared memory, or fewer resident blocks
// than pieces a row); cudaErrorInvalidValue for another dtype.
cudaError_t LaunchDenseKdPieces(const DenseKdPieces& call, cudaStream_t stream);

}  // namespace cuda_ce
}  // namespace lossd

#endif  // LOSSD_KERNELS_CUDA_DENSE_KD_PIECES_H_
