// common/data_wire.h: the bytes of a data connection's preamble and of an
// Evaluate frame's header, as design.md §3 fixes them.
#include "common/data_wire.h"

#include <gtest/gtest.h>

#include <array>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>

namespace lossd {
namespace {

const std::string kToken = "0123456789abcdef";

TEST(DataPreambleTest, LayoutIsMagicTokenIndexLittleEndian) {
  ASSERT_EQ(kDataPreambleBytes, 28u);
  const std::string preamble = EncodeDataPreamble(kToken, 0x01020304);
  ASSERT_EQ(preamble.size(), kDataPreambleBytes);
  EXPECT_EQ(preamble.substr(0, 8), "LOSSDDC1");
  EXPECT_EQ(preamble.substr(8, 16), kToken);
  EXPECT_EQ(preamble.substr(24), std::string("\x04\x03\x02\x01", 4));
}

TEST(DataPreambleTest, RoundTrips) {
  for (int index : {0, 1, 63, 64, 255, 256, 65537, 0x7fffffff}) {
    const std::string preamble = EncodeDataPreamble(kToken, index);
    const std::optional<DataPreamble> parsed =
        ParseDataPreamble(preamble.data());
    ASSERT_TRUE(parsed.has_value());
    EXPECT_EQ(parsed->token, kToken);
    EXPECT_EQ(parsed->index, static_cast<uint32_t>(index));
  }
}

TEST(DataPreambleTest, IndexIsUnsignedOnTheWire) {
  std::string preamble = EncodeDataPreamble(kToken, 0);
  preamble.replace(24, 4, std::string("\xff\xff\xff\xff", 4));
  EXPECT_EQ(ParseDataPreamble(preamble.data())->index, 0xffffffffu);
}

TEST(DataPreambleTest, WrongMagicIsRefused) {
  for (size_t at = 0; at < kDataMagicBytes; ++at) {
    std::string preamble = EncodeDataPreamble(kToken, 3);
    preamble[at] ^= 0x20;
    EXPECT_FALSE(ParseDataPreamble(preamble.data()).has_value()) << at;
  }
}

TEST(FrameRowsTest, LittleEndianEightBytes) {
  char header[kFrameHeaderBytes];
  EncodeFrameRows(0x0102030405060708, header);
  EXPECT_EQ(std::string(header, 8),
            std::string("\x08\x07\x06\x05\x04\x03\x02\x01", 8));
  for (int64_t rows : {int64_t{1}, int64_t{255}, int64_t{1} << 40,
                       int64_t{0x7fffffffffffffff}}) {
    EncodeFrameRows(rows, header);
    EXPECT_EQ(DecodeFrameRows(reinterpret_cast<unsigned char*>(header)),
              static_cast<uint64_t>(rows));
  }
  const unsigned char all_ones[8] = {0xff, 0xff, 0xff, 0xff,
                                     0xff, 0xff, 0xff, 0xff};
  EXPECT_EQ(DecodeFrameRows(all_ones), UINT64_MAX);
}

TEST(FrameRowsTest, MaxFrameRowsFitsSixtyFourMiB) {
  EXPECT_EQ(kMaxFrameBytes, int64_t{64} << 20);
  // 32000 fp32 logits and an int64 target a row.
  const int64_t rows = MaxFrameRows(128000, 8);
  EXPECT_LE(rows * (128000 + 8), kMaxFrameBytes);
  EXPECT_GT((rows + 1) * (128000 + 8), kMaxFrameBytes);
  EXPECT_EQ(MaxFrameRows(kMaxFrameBytes, 8), 0);
  EXPECT_EQ(MaxFrameRows(kMaxFrameBytes - 8, 8), 1);
}

// A row of a vocab near the int64 limit: its logits and target bytes do not
// add up in int64, and no such row fits a frame.
TEST(FrameRowsTest, MaxFrameRowsAtTheInt64Limit) {
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  EXPECT_EQ(MaxFrameRows(kMax - 3, 8), 0);  // fp32 logits of vocab kMax / 4
  EXPECT_EQ(MaxFrameRows(kMax, 8), 0);
  EXPECT_EQ(MaxFrameRows(kMax, kMax), 0);
  EXPECT_EQ(MaxFrameRows(int64_t{1} << 62, int64_t{1} << 62), 0);
  EXPECT_EQ(MaxFrameRows(kMaxFrameBytes - 8, 8), 1);
}

// The parts of a post-training frame, in their order: each as many bytes a
// row as the header declares, and the row limit counts them all.
TEST(FrameLayoutTest, PartsAndTheirRowLimit) {
  FrameInputs top_k;
  top_k.top_k = 4;
  top_k.index_bytes = 8;
  top_k.segments = true;
  EvaluateFrameLayout layout = MakeEvaluateFrameLayout(4 * 100, 4, top_k);
  const std::array<int64_t, kFrameParts> want = {400, 4, 0, 32, 16, 4, 0, 0, 0};
  EXPECT_EQ(layout.row_bytes, want);
  EXPECT_EQ(layout.TotalRowBytes(), 456);
  EXPECT_EQ(MaxFrameRows(layout), kMaxFrameBytes / 456);

  FrameInputs policy;
  policy.teacher_row_bytes = 200;
  policy.policy = true;
  layout = MakeEvaluateFrameLayout(400, 0, policy);  // no targets
  const std::array<int64_t, kFrameParts> want_policy = {400, 0, 200, 0, 0,
                                                        0,   4, 4,   0};
  EXPECT_EQ(layout.row_bytes, want_policy);
  policy.reference_logprobs = true;
  EXPECT_EQ(MakeEvaluateFrameLayout(400, 0, policy)
                .row_bytes[kFrameReferenceLogprobs],
            4);
  // Reference logprobs come only with a policy.
  FrameInputs reference;
  reference.reference_logprobs = true;
  EXPECT_EQ(MakeEvaluateFrameLayout(4, 4, reference)
                .row_bytes[kFrameReferenceLogprobs],
            0);

  // Parts that do not add up in int64 fit no frame.
  FrameInputs wide;
  wide.teacher_row_bytes = std::numeric_limits<int64_t>::max();
  layout = MakeEvaluateFrameLayout(8, 8, wide);
  EXPECT_EQ(layout.TotalRowBytes(), std::nullopt);
  EXPECT_EQ(MaxFrameRows(layout), 0);
  EXPECT_EQ(MaxFrameRows(EvaluateFrameLayout()), 0);

  EXPECT_STREQ(FramePartName(kFrameRows), "logits");
  EXPECT_STREQ(FramePartName(kFrameTeacherIndices), "teacher_indices");
  EXPECT_STREQ(FramePartName(kFrameReferenceLogprobs), "reference_logprobs");
}

}  // namespace
}  // namespace lossd
