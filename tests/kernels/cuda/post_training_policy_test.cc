// The post-training losses' choice of kernel (post_training_policy.h) on the
// CPU: the fast schedule for what it takes at the bench's shapes with the
// H200's limits (forward only and top-k at any temperature too), the row
// kernel for everything else.
#include "kernels/cuda/post_training_policy.h"

#include <utility>

#include "gtest/gtest.h"

namespace lossd {
namespace cuda_ce {
namespace {

DeviceLimits H200() {
  DeviceLimits d;
  d.sms = 132;
  d.smem_per_block_optin = 227 * 1024;
  d.smem_per_sm = 228 * 1024;
  return d;
}

// A policy call on contiguous, 16-byte aligned logits, in place.
PostTrainingShape Policy(long long rows, int vocab, int element_bytes) {
  PostTrainingShape s;
  s.logits.element_bytes = element_bytes;
  s.logits.rows = rows;
  s.logits.vocab = vocab;
  s.logits.in_place = true;
  const bool whole = static_cast<long long>(vocab) * element_bytes % 16 == 0;
  s.logits.aligned_rows = whole;
  s.logits.whole_vectors = whole;
  s.logits.edges_ok = true;
  s.policy = true;
  s.targets = true;
  return s;
}

TEST(PostTrainingPolicyTest, PolicyLossesOnLargeRowsTakeSmemRowPieces) {
  for (int bytes : {2, 4}) {
    for (const auto& [rows, vocab] :
         {std::pair<long long, int>{8192, 128256}, {16384, 131072}}) {
      const PostTrainingShape s = Policy(rows, vocab, bytes);
      const auto c = ChoosePostTrainingSchedule(s, H200());
      ASSERT_TRUE(c.has_value()) << rows << " x " << vocab << " " << bytes;
      EXPECT_EQ(c->schedule, Schedule::kSmemRowPieces);
      EXPECT_FALSE(c->edges);
      // The same sizes as cross entropy's own choice.
      EXPECT_EQ(*c, ChooseSchedule(s.logits, H200()));
    }
  }
}

TEST(PostTrainingPolicyTest, PlainCrossEntropyWithSegmentsTakesItToo) {
  PostTrainingShape s = Policy(4096, 128256, 2);
  s.policy = false;
  ASSERT_TRUE(ChoosePostTrainingSchedule(s, H200()).has_value());
}

TEST(PostTrainingPolicyTest, TopKDistillationAtAnyTemperatureTakesIt) {
  for (float tau : {1.0f, 0.5f, 2.0f, 3.7f}) {
    PostTrainingShape s = Policy(8192, 128256, 2);
    s.policy = false;
    s.distillation = true;
    s.temperature = tau;
    ASSERT_TRUE(ChoosePostTrainingSchedule(s, H200()).has_value()) << tau;
    EXPECT_EQ(*ChoosePostTrainingSchedule(s, H200()),
              ChooseSchedule(s.logits, H200()));
  }
}

// Forward only (Evaluate, GradientMode::kNone): the pieces sized as cross
// entropy's forward+gradient out of place (bulk copies), not its split row
// forward; every loss the fast path takes, either element size.
TEST(PostTrainingPolicyTest, ForwardOnlyTakesThePiecesOfAGradient) {
  for (int bytes : {2, 4}) {
    for (int loss = 0; loss < 3; ++loss) {
      PostTrainingShape s = Policy(8192, 128256, bytes);
      s.policy = loss == 0;
      s.distillation = loss == 1;
      s.temperature = 2.0f;
      s.logits.forward_only = true;
      s.logits.in_place = false;
      const auto c = ChoosePostTrainingSchedule(s, H200());
      ASSERT_TRUE(c.has_value()) << bytes << " " << loss;
      EXPECT_EQ(c->schedule, Schedule::kSmemRowPieces);
      EXPECT_TRUE(c->bulk);
      PostTrainingShape gradient = s;
      gradient.logits.forward_only = false;
      EXPECT_EQ(*c, ChooseSchedule(gradient.logits, H200()));
      // Cross entropy itself takes split row forward there.
      EXPECT_EQ(ChooseSchedule(s.logits, H200()).schedule,
                Schedule::kSplitRowForward);
    }
  }
}

TEST(PostTrainingPolicyTest,
     WhatTheFastScheduleDoesNotTakeStaysOnTheRowKernel) {
  PostTrainingShape s = Policy(8192, 128256, 2);
  s.policy = false;
  s.distillation = true;
  s.dense_teacher = true;  // (a teacher whose rows are not whole vectors)
  EXPECT_FALSE(ChoosePostTrainingSchedule(s, H200()).has_value());

  s = Policy(8192, 128256, 2);
  s.targets = false;
  EXPECT_FALSE(ChoosePostTrainingSchedule(s, H200()).has_value());

  // Label smoothing or z-loss beside the loss: the row kernel computes them.
  s = Policy(8192, 128256, 2);
  s.row_options = true;
  EXPECT_FALSE(ChoosePostTrainingSchedule(s, H200()).has_value());

  // An odd vocab: rows with edges (forward only too).
  s = Policy(8192, 128257, 2);
  EXPECT_FALSE(ChoosePostTrainingSchedule(s, H200()).has_value());
  s.logits.forward_only = true;
  s.logits.in_place = false;
  EXPECT_FALSE(ChoosePostTrainingSchedule(s, H200()).has_value());

  // Short rows: cross entropy takes cluster register rows there.
  s = Policy(8192, 1024, 2);
  EXPECT_FALSE(ChoosePostTrainingSchedule(s, H200()).has_value());

  // Rows past what the pieces hold in place (L2 row pieces for cross
  // entropy).
  s = Policy(64, 16 << 20, 2);
  EXPECT_FALSE(ChoosePostTrainingSchedule(s, H200()).has_value());

  // No device limits known (no SMs): nothing fits.
  EXPECT_FALSE(
      ChoosePostTrainingSchedule(Policy(8192, 128256, 2), DeviceLimits{})
          .has_value());
}

// A dense teacher: its own pieces, student and teacher slices together about
// kDenseKdPieceKib KiB, a multiple of 8 elements, bulk copies; every dtype
// pair, any temperature, with or without targets.
TEST(PostTrainingPolicyTest, DenseTeacherTakesItsOwnPieces) {
  for (int bytes : {2, 4}) {
    for (int teacher_bytes : {2, 4}) {
      for (const auto& [rows, vocab] :
           {std::pair<long long, int>{8192, 128256}, {16384, 131072}}) {
        PostTrainingShape s = Policy(rows, vocab, bytes);
        s.policy = false;
        s.distillation = true;
        s.dense_teacher = true;
        s.teacher_element_bytes = teacher_bytes;
        s.teacher_whole_vectors = true;
        s.temperature = 2.0f;
        s.targets = bytes == 2;
        const auto c = ChoosePostTrainingSchedule(s, H200());
        ASSERT_TRUE(c.has_value()) << vocab << " " << bytes << teacher_bytes;
        EXPECT_EQ(c->schedule, Schedule::kSmemRowPieces);
        EXPECT_TRUE(c->bulk);
        EXPECT_FALSE(c->edges);
        EXPECT_EQ(c->chunk % 8, 0);
        EXPECT_GE(static_cast<long long>(c->chunk) * c->pieces, vocab);
        EXPECT_LT(static_cast<long long>(c->chunk) * (c->pieces - 1), vocab);
        EXPECT_LE(static_cast<long long>(c->chunk) * (bytes + teacher_bytes),
                  kDenseKdPieceKib * 1024);
        EXPECT_LE(c->pieces, 32);
      }
    }
  }
  PostTrainingShape s = Policy(8192, 128256, 2);
  s.policy = false;
  s.distillation = true;
  s.dense_teacher = true;
  s.teacher_element_bytes = 2;
  s.teacher_whole_vectors = true;
  ASSERT_TRUE(ChoosePostTrainingSchedule(s, H200()).has_value());
  // Forward only: the same pieces (the kernel writes no gradient).
  PostTrainingShape f = s;
  f.logits.forward_only = true;
  const auto forward = ChoosePostTrainingSchedule(f, H200());
  ASSERT_TRUE(forward.has_value());
  EXPECT_EQ(forward->chunk, ChoosePostTrainingSchedule(s, H200())->chunk);
  // A softcap, label smoothing or z-loss, short rows, rows past 32 pieces of
  // shared memory and an unknown device: the row kernel.
  PostTrainingShape t = s;
  t.logits.options_on = true;
  EXPECT_FALSE(ChoosePostTrainingSchedule(t, H200()).has_value());
  t = s;
  t.row_options = true;
  EXPECT_FALSE(ChoosePostTrainingSchedule(t, H200()).has_value());
  t = s;
  t.logits.vocab = 1024;
  EXPECT_FALSE(ChoosePostTrainingSchedule(t, H200()).has_value());
  t = s;
  t.logits.vocab = 16 << 20;
  EXPECT_FALSE(ChoosePostTrainingSchedule(t, H200()).has_value());
  EXPECT_FALSE(ChoosePostTrainingSchedule(s, DeviceLimits{}).has_value());
}

}  // namespace
}  // namespace cuda_ce
}  // namespace lossd
