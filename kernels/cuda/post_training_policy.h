// Which CUDA kernel runs a post-training call: the smem row pieces schedule
// with per-row terms (row_terms.h) where it takes the call, else the row
// kernel (post_training_rows.cu). Plain C++, so that a CPU test checks it.
#ifndef LOSSD_KERNELS_CUDA_POST_TRAINING_POLICY_H_
#define LOSSD_KERNELS_CUDA_POST_TRAINING_POLICY_H_

#include <optional>

#include "kernels/cuda/schedule_policy.h"

namespace lossd {
namespace cuda_ce {

// What the choice depends on, from PostTrainingArgs.
struct PostTrainingShape {
  // The student logits as cross entropy's dispatch sees them (ShapeOf).
  ScheduleShape logits;
  bool distillation = false;   // a teacher
  bool dense_teacher = false;  // ... of logits [N, V] (else top-k)
  // A dense teacher's element size, and whether its rows start 16-byte
  // aligned with a stride and a vocab of whole 16-byte vectors.
  int teacher_element_bytes = 4;
  bool teacher_whole_vectors = false;
  float temperature = 1.0f;  // ... and its temperature
  bool policy = false;       // a policy loss
  bool targets = false;      // base.targets given
  // Label smoothing or z-loss beside the loss: the row kernel's alone.
  bool row_options = false;
};

// A dense teacher's row pieces: about this many KiB of student and teacher
// together a piece: five blocks of 128 threads a SM (their registers allow
// five), so that more blocks cover one's wait for its row (bench/NOTES.md:
// 40 KiB measured faster than 48 KiB, four a SM).
constexpr int kDenseKdPieceKib = 40;

// The smem row pieces choice for `shape`, or std::nullopt for the row kernel.
// The fast path takes policy losses, top-k distillation at any temperature
// and plain cross entropy (with segments) with targets, with a gradient or
// forward only, on rows of whole 16-byte vectors where cross entropy's
// forward+gradient would take smem row pieces (ChooseSchedule; forward only
// sized as out of place): the gradient is then a per-row combination of p -
// onehot(y) and, for the tail bucket at temperature != 1, p^tau on that
// schedule's passes (RowTerms), plus the support's entries. A dense teacher
// (any temperature, targets or none) takes its own pieces
// (dense_kd_pieces.h: chunk and pieces sized for student and teacher slices
// together, kDenseKdPieceKib, bulk copies) where both tensors' rows are whole
// 16-byte vectors, the student's row is as long as smem row pieces need, no
// softcap is set and the pieces fit the device, with a gradient or forward
// only. Label smoothing or z-loss, rows with unaligned edges and rows the
// pieces do not fit stay on the row kernel. Pure and thread-safe.
std::optional<ScheduleChoice> ChoosePostTrainingSchedule(
    const PostTrainingShape& shape, const DeviceLimits& device,
    const Sm90Policy& policy = {});

}  // namespace cuda_ce
}  // namespace lossd

#endif  // LOSSD_KERNELS_CUDA_POST_TRAINING_POLICY_H_
