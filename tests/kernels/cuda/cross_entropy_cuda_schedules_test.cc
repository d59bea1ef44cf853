// The CUDA cross-entropy's schedules (cluster stream, cluster slices, row
// pieces through L2 or shared memory, split rows) on the configurations that
// reach their edges, against the fp64 CPU reference; skipped without a GPU.
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/kernels/cuda/cross_entropy_cuda_test_util.h"

namespace lossd {
namespace cuda_ce_test {
namespace {

// Cluster stream rows with slices of 16 to 64 KiB, in place and out of
// place, p_y -> 1 rows (the second exchange) and tails that cut a vector,
// against the reference. (The occupancy caps of the sweep left with the bench
// knobs: bench/NOTES.md.)
TEST_F(CudaCrossEntropyTest, ClusterStreamRowsConfigs) {
  uint32_t seed = 700;
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    for (int slice : {16, 32, 64}) {
      for (GradientMode mode :
           {GradientMode::kInPlace, GradientMode::kOutOfPlace}) {
        Case c = Make(absl::StrCat("stream rows slice=", slice,
                                   " mode=", static_cast<int>(mode)),
                      7, 100003, dtype);
        c.pad = dtype == DType::kFloat32 ? 1 : 5;  // 16-byte rows
        c.config.schedule = CrossEntropyCudaSchedule::kClusterStreamRows;
        c.config.piece_kib = slice;
        c.mode = mode;
        c.ignore_fraction = 0.3;
        c.options.z_loss_scale = 1e-3f;
        CheckCase(c, seed++);
      }
    }
    Case d = Make("stream rows p_y -> 1", 6, 131072, dtype);
    d.logits = Logits::kTargetDominant;
    d.config.schedule = CrossEntropyCudaSchedule::kClusterStreamRows;
    CheckCase(d, seed++);
    Case f = Make("stream rows forward only", 9, 131072, dtype);
    f.config.schedule = CrossEntropyCudaSchedule::kClusterStreamRows;
    f.mode = GradientMode::kNone;
    CheckCase(f, seed++);
  }
}

// Cluster slice rows (slices in shared memory, bulk copies, persistent
// clusters): slice sizes that give clusters of 1 to 16 blocks, as many stages
// as fit (2 at 48 KiB), more rows than resident clusters (so each cluster
// loops and the pipeline turns over), ignored rows, padded rows, every mode,
// and the rare p_max -> 1 exchange. (The 512-thread build and the stages knob
// left with the bench knobs: bench/NOTES.md.)
TEST_F(CudaCrossEntropyTest, ClusterSliceRowsConfigs) {
  uint32_t seed = 900;
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    for (int slice : {8, 32, 48}) {
      for (GradientMode mode :
           {GradientMode::kInPlace, GradientMode::kOutOfPlace}) {
        // Clusters of at most 16: the 8 KiB slices on shorter rows.
        const int64_t vocab = slice == 8 ? 16000 : 100000;
        Case c = Make(absl::StrCat("slice rows slice=", slice,
                                   " mode=", static_cast<int>(mode)),
                      300, vocab, dtype);
        c.pad = dtype == DType::kFloat32 ? 4 : 8;  // 16-byte rows
        c.config.schedule = CrossEntropyCudaSchedule::kClusterSliceRows;
        c.config.piece_kib = slice;
        c.ignore_fraction = 0.3;
        c.options.z_loss_scale = 1e-3f;
        c.options.grad_scale = 0.5f;
        c.mode = mode;
        CheckCase(c, seed++);
      }
    }
    Case d = Make("slice rows p_y -> 1", 300, 131072, dtype);
    d.logits = Logits::kTargetDominant;
    d.config.schedule = CrossEntropyCudaSchedule::kClusterSliceRows;
    CheckCase(d, seed++);
    for (int slice : {32, 48}) {
      Case f = Make(absl::StrCat("slice rows forward only, slice=", slice), 300,
                    131072, dtype);
      f.config.schedule = CrossEntropyCudaSchedule::kClusterSliceRows;
      f.config.piece_kib = slice;
      f.mode = GradientMode::kNone;
      f.options.reduction = Reduction::kSum;
      CheckCase(f, seed++);
    }
    Case f1 = Make("slice rows forward only, p_y -> 1", 300, 131072, dtype);
    f1.logits = Logits::kTargetDominant;
    f1.config.schedule = CrossEntropyCudaSchedule::kClusterSliceRows;
    f1.mode = GradientMode::kNone;
    CheckCase(f1, seed++);
    Case s = Make("slice rows one row, one block", 1, 32000, dtype);
    s.config.schedule = CrossEntropyCudaSchedule::kClusterSliceRows;
    CheckCase(s, seed++);
  }
}

// Split row forward (row pieces on independent blocks): piece sizes that give
// 1 to 16 pieces a row (the last one short), padded rows, ignored rows, z-loss,
// per-token outputs, every reduction, and p_max -> 1 (a thread's exact second
// sum).
TEST_F(CudaCrossEntropyTest, SplitRowForwardConfigs) {
  uint32_t seed = 1100;
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    for (int slice : {8, 32, 64, 128}) {
      Case c =
          Make(absl::StrCat("split forward slice=", slice), 257, 100000, dtype);
      c.pad = dtype == DType::kFloat32 ? 4 : 8;  // 16-byte rows
      c.mode = GradientMode::kNone;
      c.config.schedule = CrossEntropyCudaSchedule::kSplitRowForward;
      c.config.piece_kib = slice;
      c.ignore_fraction = 0.3;
      c.options.z_loss_scale = 1e-3f;
      c.options.reduction = slice == 32 ? Reduction::kSum : Reduction::kMean;
      CheckCase(c, seed++);
    }
    Case d = Make("split forward p_y -> 1", 300, 131072, dtype);
    d.logits = Logits::kTargetDominant;
    d.mode = GradientMode::kNone;
    d.config.schedule = CrossEntropyCudaSchedule::kSplitRowForward;
    CheckCase(d, seed++);
    Case a = Make("split forward auto, 262144", 40, 262144, dtype);
    a.mode = GradientMode::kNone;
    CheckCase(a, seed++);
  }
}

// L2 row pieces (forward+gradient on row pieces through L2, one
// persistent kernel, 2-byte logits): pieces of 8 to 256 KiB, groups of one to
// many rows (so that statistics and gradient items of different groups
// interleave), in place and out of place, ignored rows, z-loss, grad_scale,
// p_y -> 1, NaN and infinite logits. (fp32 and the runs without L2 hints left
// with the bench knobs: bench/NOTES.md.)
TEST_F(CudaCrossEntropyTest, L2RowPiecesConfigs) {
  uint32_t seed = 1200;
  for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
    for (int slice : {8, 64, 256}) {
      for (int group : {1, 16}) {
        Case c = Make(
            absl::StrCat("L2 pieces slice=", slice, " group=", group, "MiB"),
            300, 100000, dtype);
        c.pad = dtype == DType::kFloat32 ? 4 : 8;  // 16-byte rows
        c.config.schedule = CrossEntropyCudaSchedule::kL2RowPieces;
        c.config.piece_kib = slice;
        c.config.group_mib = group;
        c.ignore_fraction = 0.3;
        c.options.z_loss_scale = 1e-3f;
        c.options.grad_scale = 0.5f;
        c.mode =
            group == 1 ? GradientMode::kOutOfPlace : GradientMode::kInPlace;
        CheckCase(c, seed++);
      }
    }
    Case d = Make("L2 pieces p_y -> 1", 300, 131072, dtype);
    d.logits = Logits::kTargetDominant;
    d.config.schedule = CrossEntropyCudaSchedule::kL2RowPieces;
    d.config.group_mib = 2;
    CheckCase(d, seed++);
  }
  for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
    Case nf = Make("L2 pieces NaN and inf logits", 64, 8192, dtype);
    nf.logits = Logits::kNonFinite;
    nf.config.schedule = CrossEntropyCudaSchedule::kL2RowPieces;
    nf.config.piece_kib = 8;
    nf.config.group_mib = 1;
    nf.exact_argmax = false;  // NaN rows: the first max is not defined
    CheckCase(nf, seed++);
    Case one = Make("L2 pieces one row", 1, 32000, dtype);
    one.config.schedule = CrossEntropyCudaSchedule::kL2RowPieces;
    CheckCase(one, seed++);
  }
}

// Smem row pieces (forward+gradient on row pieces kept in shared memory):
// pieces of 8 to 96 KiB (one to 13 a row), in place and out of place (for
// 2-byte logits: the threads' loads and bulk copies), the L2 prefetch where
// four blocks fit a SM and none where they do not (96 KiB), ignored rows,
// z-loss, grad_scale, p_y -> 1, NaN and infinite logits, one row. (The 128-
// and 512-thread builds and the prefetch knob left with the bench knobs.)
TEST_F(CudaCrossEntropyTest, SmemRowPiecesConfigs) {
  uint32_t seed = 1300;
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    for (int slice : {8, 48, 96}) {
      Case c =
          Make(absl::StrCat("smem pieces slice=", slice), 300, 100000, dtype);
      c.pad = dtype == DType::kFloat32 ? 4 : 8;  // 16-byte rows
      c.config.schedule = CrossEntropyCudaSchedule::kSmemRowPieces;
      c.config.piece_kib = slice;
      c.ignore_fraction = 0.3;
      c.options.z_loss_scale = 1e-3f;
      c.options.grad_scale = 0.5f;
      c.mode = slice == 48 ? GradientMode::kOutOfPlace : GradientMode::kInPlace;
      CheckCase(c, seed++);
    }
    Case d = Make("smem pieces p_y -> 1", 300, 131072, dtype);
    d.logits = Logits::kTargetDominant;
    d.config.schedule = CrossEntropyCudaSchedule::kSmemRowPieces;
    CheckCase(d, seed++);
    // Pieces by the threads' loads (2-byte logits in place) and by bulk
    // copies (in chunks of one batch, 16 KiB, the last piece of a row
    // shorter), default and 27 KiB pieces.
    for (int kib : {0, 27}) {
      for (GradientMode mode :
           {GradientMode::kInPlace, GradientMode::kOutOfPlace}) {
        Case b = Make(absl::StrCat("smem pieces mode=", static_cast<int>(mode),
                                   " kib=", kib),
                      200, 100000, dtype);
        b.pad = dtype == DType::kFloat32 ? 4 : 8;
        b.config.schedule = CrossEntropyCudaSchedule::kSmemRowPieces;
        b.config.piece_kib = kib;
        b.ignore_fraction = 0.3;
        b.options.z_loss_scale = 1e-3f;
        b.mode = mode;
        CheckCase(b, seed++);
      }
    }
  }
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    Case big = Make("smem pieces 262144", 40, 262144, dtype);
    big.config.schedule = CrossEntropyCudaSchedule::kSmemRowPieces;
    CheckCase(big, seed++);
    Case nf = Make("smem pieces NaN and inf logits", 64, 8192, dtype);
    nf.logits = Logits::kNonFinite;
    nf.config.schedule = CrossEntropyCudaSchedule::kSmemRowPieces;
    nf.config.piece_kib = 8;
    nf.exact_argmax = false;  // NaN rows: the first max is not defined
    CheckCase(nf, seed++);
    Case one = Make("smem pieces one row", 1, 32000, dtype);
    one.config.schedule = CrossEntropyCudaSchedule::kSmemRowPieces;
    CheckCase(one, seed++);
  }
  // Rows whose 32 pieces pass a block's shared memory (fp32, 8 MB rows):
  // the automatic choice falls back to another path, same results.
  Case wide = Make("smem pieces pieces past shared memory", 3, 2000000,
                   DType::kFloat32);
  CheckCase(wide, seed++);
}

// Small smem row pieces cases for compute-sanitizer (scripts/gpu-run): 2 pieces
// a row, ignored rows, both modes (the threads' loads and bulk copies), fp32
// too.
TEST_F(CudaCrossEntropyTest, SmemRowPiecesSmall) {
  uint32_t seed = 1350;
  for (GradientMode mode :
       {GradientMode::kInPlace, GradientMode::kOutOfPlace}) {
    Case c = Make("smem pieces small", 96, 8192, DType::kBFloat16);
    c.config.schedule = CrossEntropyCudaSchedule::kSmemRowPieces;
    c.config.piece_kib = 8;
    c.ignore_fraction = 0.2;
    c.mode = mode;
    CheckCase(c, seed++);
    c.dtype = DType::kFloat32;  // bulk copies in both modes
    c.config.piece_kib = 16;
    c.grad_rtol = DefaultGradRtol(c.dtype);
    CheckCase(c, seed++);
  }
}

// Small L2 row pieces cases for compute-sanitizer (scripts/gpu-run): 2 pieces a
// row, groups of 4 rows, ignored rows, in place and out of place.
TEST_F(CudaCrossEntropyTest, L2RowPiecesSmall) {
  uint32_t seed = 1250;
  for (int hints : {1, 2}) {  // (1: out of place)
    Case c = Make("L2 pieces small", 96, 8192, DType::kBFloat16);
    c.config.schedule = CrossEntropyCudaSchedule::kL2RowPieces;
    c.config.piece_kib = 8;
    c.config.group_mib = 1;
    c.ignore_fraction = 0.2;
    c.mode = hints == 2 ? GradientMode::kInPlace : GradientMode::kOutOfPlace;
    CheckCase(c, seed++);
  }
}

// Small split row forward cases for compute-sanitizer (scripts/gpu-run): 4
// pieces a row, ignored rows, NaN and infinite logits.
TEST_F(CudaCrossEntropyTest, SplitRowForwardSmall) {
  uint32_t seed = 1150;
  Case c = Make("split forward small", 200, 16384, DType::kBFloat16);
  c.mode = GradientMode::kNone;
  c.config.schedule = CrossEntropyCudaSchedule::kSplitRowForward;
  c.config.piece_kib = 8;
  c.ignore_fraction = 0.2;
  CheckCase(c, seed++);
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    Case nf = Make("split forward NaN and inf logits", 64, 8192, dtype);
    nf.logits = Logits::kNonFinite;
    nf.mode = GradientMode::kNone;
    nf.config.schedule = CrossEntropyCudaSchedule::kSplitRowForward;
    nf.config.piece_kib = 8;
    nf.exact_argmax = false;  // NaN rows: the first max is not defined
    CheckCase(nf, seed++);
  }
}

// Small cluster slice rows cases for compute-sanitizer (scripts/gpu-run):
// clusters of 2 and 4, more rows than clusters, both modes, the rare exchange;
// twice (the one-block-a-SM build is gone: bench/NOTES.md).
TEST_F(CudaCrossEntropyTest, ClusterSliceRowsSmall) {
  uint32_t seed = 950;
  for (int round : {1, 2}) {
    for (GradientMode mode : {GradientMode::kInPlace, GradientMode::kNone}) {
      Case c = Make(absl::StrCat("slice rows small, round ", round), 600, 16384,
                    DType::kBFloat16);
      c.config.schedule = CrossEntropyCudaSchedule::kClusterSliceRows;
      c.config.piece_kib = 8;
      c.mode = mode;
      c.ignore_fraction = 0.2;
      CheckCase(c, seed++);
    }
    Case h = Make("slice rows small fp16", 300, 8192, DType::kFloat16);
    h.config.schedule = CrossEntropyCudaSchedule::kClusterSliceRows;
    h.config.piece_kib = 8;
    CheckCase(h, seed++);
    for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
      Case nf = Make("slice rows small, NaN and inf logits", 64, 8192, dtype);
      nf.logits = Logits::kNonFinite;
      nf.config.schedule = CrossEntropyCudaSchedule::kClusterSliceRows;
      nf.config.piece_kib = 8;
      nf.exact_argmax = false;  // NaN rows: the first max is not defined
      CheckCase(nf, seed++);
    }
    // Clusters of one block: a 32 KiB row in 32 KiB slices.
    Case one = Make("slice rows auto, clusters of one block", 500, 16384,
                    DType::kBFloat16);
    one.config.piece_kib = 32;
    one.config.schedule = CrossEntropyCudaSchedule::kClusterSliceRows;
    one.ignore_fraction = 0.1;
    CheckCase(one, seed++);
    Case d = Make("slice rows small p_y -> 1", 300, 8192, DType::kFloat32);
    d.logits = Logits::kTargetDominant;
    d.config.schedule = CrossEntropyCudaSchedule::kClusterSliceRows;
    d.config.piece_kib = 8;
    CheckCase(d, seed++);
  }
}

// Odd vocabularies: contiguous rows that start off 16-byte boundaries (each
// row at another offset) and end inside a vector, on the schedules that take
// them (smem row pieces and split row forward handle the edges; cluster stream
// and register rows need rows padded to 16 bytes), in small pieces so that
// rows have several, against the reference.
TEST_F(CudaCrossEntropyTest, OddVocabOnFastSchedules) {
  uint32_t seed = 1500;
  using S = CrossEntropyCudaSchedule;
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    for (int64_t vocab : {1, 3, 50257, 32001}) {
      const int64_t rows = vocab > 1000 ? 24 : 40;
      const auto make = [&](const std::string& what, S schedule,
                            GradientMode mode) {
        Case c = Make(absl::StrCat("V=", vocab, " ", what), rows, vocab, dtype);
        c.config.schedule = schedule;
        c.config.piece_kib = schedule == S::kAuto ? 0 : 8;
        c.mode = mode;
        c.ignore_fraction = 0.2;
        c.options.z_loss_scale = 1e-3f;
        c.options.grad_scale = 0.5f;
        return c;
      };
      CheckCase(make("smem row pieces in place", S::kSmemRowPieces,
                     GradientMode::kInPlace),
                seed++);
      CheckCase(make("smem row pieces out of place", S::kSmemRowPieces,
                     GradientMode::kOutOfPlace),
                seed++);
      CheckCase(
          make("split row forward", S::kSplitRowForward, GradientMode::kNone),
          seed++);
      CheckCase(make("auto", S::kAuto, GradientMode::kInPlace), seed++);
      CheckCase(make("auto forward", S::kAuto, GradientMode::kNone), seed++);
      const int vec = static_cast<int>(16 / DTypeSize(dtype));
      for (S schedule : {S::kClusterStreamRows, S::kClusterRegisterRows}) {
        Case c =
            make(schedule == S::kClusterStreamRows ? "stream rows, padded"
                                                   : "register rows, padded",
                 schedule, GradientMode::kInPlace);
        c.pad = (vec - vocab % vec) % vec;  // 16-byte rows
        CheckCase(c, seed++);
      }
    }
  }
}

// Small odd-vocabulary cases for compute-sanitizer: every row at another
// offset from a 16-byte boundary, heads, tails and pieces without whole
// vectors, both schedules that handle edges.
TEST_F(CudaCrossEntropyTest, OddVocabSmall) {
  uint32_t seed = 1600;
  using S = CrossEntropyCudaSchedule;
  for (int64_t vocab : {3, 17, 4099}) {
    for (GradientMode mode : {GradientMode::kInPlace, GradientMode::kOutOfPlace,
                              GradientMode::kNone}) {
      Case c =
          Make(absl::StrCat("odd small V=", vocab), 9, vocab, DType::kBFloat16);
      c.config.schedule =
          mode == GradientMode::kNone ? S::kSplitRowForward : S::kSmemRowPieces;
      c.config.piece_kib = 1;
      c.mode = mode;
      c.ignore_fraction = 0.2;
      CheckCase(c, seed++);
    }
  }
}

}  // namespace
}  // namespace cuda_ce_test
}  // namespace lossd
