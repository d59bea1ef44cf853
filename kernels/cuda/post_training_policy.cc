// The post-training losses' choice between the fast schedule and the row
// kernel (post_training_policy.h), apart from the launch for its CPU test.
#include "kernels/cuda/post_training_policy.h"

#include <algorithm>
#include <climits>

namespace lossd {
namespace cuda_ce {
namespace {

long long CeilDiv(long long a, long long b) { return (a + b - 1) / b; }

// A dense teacher's pieces: student and teacher slices of `chunk` elements
// (a multiple of 8: whole vectors of either dtype) in one block's shared
// memory, the student's in at most pieces_bulk_chunks batches.
std::optional<ScheduleChoice> DenseKdChoice(const PostTrainingShape& shape,
                                            const DeviceLimits& device,
                                            const Sm90Policy& policy) {
  const ScheduleShape& s = shape.logits;
  if (shape.row_options || s.options_on || !s.whole_vectors ||
      !shape.teacher_whole_vectors || s.rows <= 0 || s.rows > INT_MAX ||
      s.RowBytes() < policy.short_row_bytes) {
    return std::nullopt;
  }
  const long long pair_bytes = s.element_bytes + shape.teacher_element_bytes;
  const long long per_row = std::min<long long>(
      std::min(policy.max_pieces, 32),
      std::max(1LL, CeilDiv(s.vocab * pair_bytes, kDenseKdPieceKib * 1024LL)));
  const long long chunk = CeilDiv(CeilDiv(s.vocab, per_row), 8) * 8;
  const long long pieces = CeilDiv(s.vocab, chunk);
  const long long smem = chunk * pair_bytes;
  const long long block = smem + policy.pieces_smem_headroom + 1024;
  if (chunk * s.element_bytes >
          static_cast<long long>(policy.pieces_bulk_chunk_bytes) *
              policy.pieces_bulk_chunks ||
      block > device.smem_per_block_optin || block > device.smem_per_sm ||
      static_cast<long long>(device.sms) * (device.smem_per_sm / block) <
          pieces) {
    return std::nullopt;
  }
  ScheduleChoice c;
  c.schedule = Schedule::kSmemRowPieces;
  c.chunk = static_cast<int>(chunk);
  c.pieces = static_cast<int>(pieces);
  c.bulk = true;
  return c;
}

}  // namespace

std::optional<ScheduleChoice> ChoosePostTrainingSchedule(
    const PostTrainingShape& shape, const DeviceLimits& device,
    const Sm90Policy& policy) {
  const ScheduleShape& s = shape.logits;
  if (shape.distillation && shape.dense_teacher) {
    return DenseKdChoice(shape, device, policy);
  }
  if (!shape.targets || shape.row_options || !s.whole_vectors || s.rows <= 0 ||
      s.rows > INT_MAX) {
    return std::nullopt;
  }
  // Forward only: the pieces as a gradient would have them (the kernel
  // skips the writes), not cross entropy's split row forward, which keeps
  // no piece for the entropy's second pass.
  ScheduleShape pieces_shape = s;
  if (s.forward_only) {
    pieces_shape.forward_only = false;
    pieces_shape.in_place = false;
  }
  const ScheduleChoice c = ChooseSchedule(pieces_shape, device, policy);
  if (c.schedule != Schedule::kSmemRowPieces || c.edges) return std::nullopt;
  return c;
}

}  // namespace cuda_ce
}  // namespace lossd
