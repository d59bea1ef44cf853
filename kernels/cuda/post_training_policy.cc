// The post-training losses' choice between the fast schedule and the row
// kernel (post_training_policy.h), apart from the launch for its CPU test.
#include "kernels/cuda/post_training_policy.h"

#include <climits>

namespace lossd {
namespace cuda_ce {

std::optional<ScheduleChoice> ChoosePostTrainingSchedule(
    const PostTrainingShape& shape, const DeviceLimits& device,
    const Sm90Policy& policy) {
  const ScheduleShape& s = shape.logits;
  if (shape.distillation &&
      (shape.dense_teacher || shape.temperature != 1.0f)) {
    return std::nullopt;
  }
  if (!shape.targets || shape.row_options || s.forward_only ||
      !s.whole_vectors || s.rows <= 0 || s.rows > INT_MAX) {
    return std::nullopt;
  }
  const ScheduleChoice c = ChooseSchedule(s, device, policy);
  if (c.schedule != Schedule::kSmemRowPieces || c.edges) return std::nullopt;
  return c;
}

}  // namespace cuda_ce
}  // namespace lossd
