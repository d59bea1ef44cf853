// The Hopper GEMM's policy on the CPU (kernels/cuda/gemm_sm90_policy.h):
// which products and devices it takes, and that its tile order visits every
// tile once with the band's row tiles running fastest.
#include "kernels/cuda/gemm_sm90_policy.h"

#include <vector>

#include "gtest/gtest.h"

namespace lossd {
namespace cuda_gemm {
namespace {

GemmSm90Shape BenchShape() {
  GemmSm90Shape s;
  s.rows = 8192;
  s.cols = 128256;
  s.depth = 4096;
  s.z_stride = 128256;
  s.z_element_bytes = 2;
  s.operands_aligned = true;
  s.z_aligned = true;
  return s;
}

TEST(GemmSm90PolicyTest, TakesTheBenchShapesOnSm90Only) {
  EXPECT_EQ(GemmSm90Eligibility(BenchShape(), 9, 0), GemmSm90Fit::kYes);
  EXPECT_EQ(GemmSm90Eligibility(BenchShape(), 8, 0), GemmSm90Fit::kNotSm90);
  EXPECT_EQ(GemmSm90Eligibility(BenchShape(), 10, 0), GemmSm90Fit::kNotSm90);
  EXPECT_EQ(GemmSm90Eligibility(BenchShape(), 12, 0), GemmSm90Fit::kNotSm90);
}

TEST(GemmSm90PolicyTest, EachRefusalHasItsReason) {
  GemmSm90Shape s = BenchShape();
  s.rows = 0;
  EXPECT_EQ(GemmSm90Eligibility(s, 9, 0), GemmSm90Fit::kEmpty);
  s = BenchShape();
  s.cols = int64_t{1} << 31;
  s.z_stride = s.cols;
  EXPECT_EQ(GemmSm90Eligibility(s, 9, 0), GemmSm90Fit::kTooLarge);
  s = BenchShape();
  s.z_stride = s.cols - 1;
  EXPECT_EQ(GemmSm90Eligibility(s, 9, 0), GemmSm90Fit::kZStride);
  s = BenchShape();
  s.depth = 4100;
  EXPECT_EQ(GemmSm90Eligibility(s, 9, 0), GemmSm90Fit::kDepthAlignment);
  s = BenchShape();
  s.operands_aligned = false;
  EXPECT_EQ(GemmSm90Eligibility(s, 9, 0), GemmSm90Fit::kPointerAlignment);
  s = BenchShape();
  s.z_aligned = false;
  EXPECT_EQ(GemmSm90Eligibility(s, 9, 0), GemmSm90Fit::kPointerAlignment);
  s = BenchShape();
  s.z_element_bytes = 8;
  EXPECT_EQ(GemmSm90Eligibility(s, 9, 0), GemmSm90Fit::kPointerAlignment);
}

TEST(GemmSm90PolicyTest, RaggedShapesAreTaken) {
  GemmSm90Shape s = BenchShape();
  s.rows = 1;
  s.cols = 7;
  s.z_stride = 7;
  s.depth = 72;
  EXPECT_EQ(GemmSm90Eligibility(s, 9, 0), GemmSm90Fit::kYes);
}

TEST(GemmSm90PolicyTest, ZGoesByTmaWhenItsRowsAreWhole16BytePieces) {
  GemmSm90Shape s = BenchShape();
  s.z_aligned16 = true;
  EXPECT_TRUE(ZByTensorStore(s));  // 128256 bf16: 16032 pieces
  s.z_stride = 128255;
  EXPECT_FALSE(ZByTensorStore(s));
  s.z_stride = 128260;
  s.z_element_bytes = 4;
  EXPECT_TRUE(ZByTensorStore(s));
  s.z_stride = 128258;
  EXPECT_FALSE(ZByTensorStore(s));
  // A row that ends inside a 16-byte piece: TMA would write the piece whole.
  s.z_stride = 128264;
  s.z_element_bytes = 2;
  s.cols = 128257;
  EXPECT_FALSE(ZByTensorStore(s));
  s.cols = 128256;
  EXPECT_TRUE(ZByTensorStore(s));
  s = BenchShape();
  s.z_aligned16 = false;
  EXPECT_FALSE(ZByTensorStore(s));
}

TEST(GemmSm90PolicyTest, TwoBlocksAClusterForEitherZ) {
  GemmSm90Shape s = BenchShape();
  EXPECT_EQ(GemmSm90Cluster(s), 2);
  s.z_element_bytes = 4;
  EXPECT_EQ(GemmSm90Cluster(s), 2);
}

TEST(GemmSm90PolicyTest, CooperativeUntilPingPongIsMeasured) {
  GemmSm90Shape s = BenchShape();
  EXPECT_EQ(GemmSm90ScheduleFor(s, 2), GemmSm90Schedule::kCooperative);
  s.z_element_bytes = 4;
  EXPECT_EQ(GemmSm90ScheduleFor(s, 2), GemmSm90Schedule::kCooperative);
  EXPECT_EQ(GemmSm90ScheduleFor(s, 1), GemmSm90Schedule::kCooperative);
}

TEST(GemmSm90PolicyTest, FusedLinearForwardTakesForwardOnlyBf16OnSm90) {
  GemmSm90Shape s = BenchShape();
  s.z_element_bytes = 4;  // no Z is stored: the statistics' shape
  EXPECT_TRUE(FusedLinearForwardTakes(s, true, false, 9, 0));
  // A gradient needs Z (or G) in memory for its products.
  EXPECT_FALSE(FusedLinearForwardTakes(s, true, true, 9, 0));
  // fp16 and fp32 operands: the kernel multiplies bf16 only.
  EXPECT_FALSE(FusedLinearForwardTakes(s, false, false, 9, 0));
  EXPECT_FALSE(FusedLinearForwardTakes(s, true, false, 8, 0));
  EXPECT_FALSE(FusedLinearForwardTakes(s, true, false, 10, 0));
  s.depth = 4100;  // H not a multiple of 8: no tensor map
  EXPECT_FALSE(FusedLinearForwardTakes(s, true, false, 9, 0));
  s = BenchShape();
  s.operands_aligned = false;
  EXPECT_FALSE(FusedLinearForwardTakes(s, true, false, 9, 0));
  // One row and a ragged vocabulary are the kernel's to take.
  s = BenchShape();
  s.rows = 1;
  s.cols = 300;
  s.z_stride = 300;
  EXPECT_TRUE(FusedLinearForwardTakes(s, true, false, 9, 0));
}

// The fused gradient's Z: fp32 in a 256-byte aligned workspace.
GemmSm90Shape GradientShape() {
  GemmSm90Shape s = BenchShape();
  s.z_element_bytes = 4;
  s.z_aligned16 = true;
  return s;
}

FusedGradientCall PlainCall() {
  FusedGradientCall c;
  c.bf16 = true;
  c.sparse_residual = true;
  return c;
}

TEST(GemmSm90PolicyTest, FusedGradientTakesBf16SparseResidualOnSm90) {
  EXPECT_EQ(FusedLinearGradientRefusal(GradientShape(), PlainCall(), 9, 0),
            nullptr);
  // One row and a vocabulary not a multiple of the 256-column tile.
  GemmSm90Shape s = GradientShape();
  s.rows = 1;
  s.cols = 1000;
  s.z_stride = 1000;
  EXPECT_EQ(FusedLinearGradientRefusal(s, PlainCall(), 9, 0), nullptr);
}

TEST(GemmSm90PolicyTest, FusedGradientRoutesTheRestToCublasLt) {
  const GemmSm90Shape s = GradientShape();
  EXPECT_STREQ(FusedLinearGradientRefusal(s, PlainCall(), 8, 0), "not sm_90");
  EXPECT_STREQ(FusedLinearGradientRefusal(s, PlainCall(), 10, 0), "not sm_90");
  FusedGradientCall c = PlainCall();
  c.bf16 = false;
  EXPECT_STREQ(FusedLinearGradientRefusal(s, c, 9, 0),
               "operands other than bf16");
  c = PlainCall();
  c.sparse_residual = false;
  EXPECT_STREQ(FusedLinearGradientRefusal(s, c, 9, 0),
               "a precision other than the sparse residual");
  c = PlainCall();
  c.softcap = true;
  EXPECT_STREQ(FusedLinearGradientRefusal(s, c, 9, 0), "a softcap");
  c = PlainCall();
  c.grad_bias = true;
  EXPECT_STREQ(FusedLinearGradientRefusal(s, c, 9, 0), "dbias");
  c = PlainCall();
  c.post_training = true;
  EXPECT_STREQ(FusedLinearGradientRefusal(s, c, 9, 0), "a post-training loss");
  GemmSm90Shape t = GradientShape();
  t.depth = 4100;  // H not a multiple of 8: no tensor map
  EXPECT_STREQ(FusedLinearGradientRefusal(t, PlainCall(), 9, 0),
               "depth alignment");
  t = GradientShape();
  t.operands_aligned = false;
  EXPECT_STREQ(FusedLinearGradientRefusal(t, PlainCall(), 9, 0),
               "pointer alignment");
  // V = 1002: fp32 rows of 4008 bytes, not whole 16-byte pieces.
  t = GradientShape();
  t.cols = 1002;
  t.z_stride = 1002;
  EXPECT_STREQ(FusedLinearGradientRefusal(t, PlainCall(), 9, 0),
               "Z's rows not whole 16-byte pieces");
  t = GradientShape();
  t.z_element_bytes = 2;
  EXPECT_STREQ(FusedLinearGradientRefusal(t, PlainCall(), 9, 0),
               "Z's rows not whole 16-byte pieces");
}

TEST(GemmSm90PolicyTest, TileOrderIsABijectionInBands) {
  for (int row_tiles : {1, 5, 16, 17, 40, 64}) {
    for (int col_tiles : {1, 3, 501}) {
      SCOPED_TRACE(testing::Message() << row_tiles << " x " << col_tiles);
      std::vector<int> seen(row_tiles * col_tiles, 0);
      const int64_t tiles = static_cast<int64_t>(row_tiles) * col_tiles;
      for (int64_t t = 0; t < tiles; ++t) {
        const TileCoord c = GemmTileAt(t, row_tiles, col_tiles);
        ASSERT_GE(c.row_tile, 0);
        ASSERT_LT(c.row_tile, row_tiles);
        ASSERT_GE(c.col_tile, 0);
        ASSERT_LT(c.col_tile, col_tiles);
        ++seen[c.row_tile * col_tiles + c.col_tile];
        // Within a band the row tile runs fastest.
        if (t + 1 < tiles && c.row_tile % kBandRowTiles + 1 < kBandRowTiles &&
            c.row_tile + 1 < row_tiles) {
          const TileCoord next = GemmTileAt(t + 1, row_tiles, col_tiles);
          EXPECT_EQ(next.row_tile, c.row_tile + 1);
          EXPECT_EQ(next.col_tile, c.col_tile);
        }
      }
      for (int v : seen) ASSERT_EQ(v, 1);
    }
  }
}

}  // namespace
}  // namespace cuda_gemm
}  // namespace lossd
