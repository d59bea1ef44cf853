// The request checks of server/validation.h fed offsets, lengths and sizes at
// the int64 limits (INT64_MAX, INT64_MIN, -1, 2^62): the right code, the
// values as received in the message, and no signed overflow on the way
// (scripts/sanitize runs this with UBSan, which aborts on one).
#include <cstdint>
#include <limits>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/validation.h"

namespace lossd {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
constexpr int64_t kMin = std::numeric_limits<int64_t>::min();
constexpr int64_t k2p62 = int64_t{1} << 62;
// A well-formed handle, so that the checks past the handle's run.
constexpr char kHandle[] = "0123abcd-0123456789abcdef0123456789abcdef";

DownloadSpec Range(int64_t offset, int64_t length) {
  DownloadSpec spec;
  spec.offset = offset;
  spec.length = length;
  return spec;
}

TEST(DownloadElementsTest, RangesPastTheEndNameTheValuesReceived) {
  // 100 fp32 elements, 400 bytes.
  struct Case {
    int64_t offset, length;
    std::string message;
  };
  for (const Case& c : {
           Case{k2p62, k2p62,
                "offset = 4611686018427387904 and length = "
                "4611686018427387904 are past the end of the tensor (400 "
                "bytes as float32)"},
           Case{kMax - 3, kMax - 3,
                "offset = 9223372036854775804 and length = "
                "9223372036854775804"},
           Case{4, kMax - 3, "offset = 4 and length = 9223372036854775804"},
           Case{kMax - 3, 4, "offset = 9223372036854775804 and length = 4"},
           Case{k2p62, 0, "bytes [4611686018427387904, 4611686018427387904)"},
           Case{0, k2p62, "bytes [0, 4611686018427387904)"},
           Case{400, 4, "bytes [400, 404)"},
       }) {
    SCOPED_TRACE(c.message);
    const absl::StatusOr<ElementRange> range =
        DownloadElements(Range(c.offset, c.length), DType::kFloat32, 100);
    EXPECT_EQ(range.status().code(), absl::StatusCode::kOutOfRange);
    EXPECT_THAT(std::string(range.status().message()), HasSubstr(c.message));
    EXPECT_THAT(std::string(range.status().message()), Not(HasSubstr("-")));
  }
  const absl::StatusOr<ElementRange> whole =
      DownloadElements(Range(396, 4), DType::kFloat32, 100);
  ASSERT_TRUE(whole.ok()) << whole.status();
  EXPECT_EQ(whole->first, 99);
  EXPECT_EQ(whole->end, 100);
}

TEST(DownloadElementsTest, NotWholeElementsAtTheLimits) {
  for (const auto& [offset, length] :
       {std::pair{kMax, int64_t{0}}, std::pair{int64_t{0}, kMax},
        std::pair{kMax, kMax}}) {
    const absl::StatusOr<ElementRange> range =
        DownloadElements(Range(offset, length), DType::kFloat32, 100);
    EXPECT_EQ(range.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(range.status().message()),
                HasSubstr("must be whole elements"));
  }
}

TEST(ValidateDownloadRequestTest, NegativeAndHugeValues) {
  for (const auto& [offset, length] :
       {std::pair{int64_t{-1}, int64_t{0}}, std::pair{int64_t{0}, int64_t{-1}},
        std::pair{kMin, int64_t{0}}, std::pair{int64_t{4}, kMin},
        std::pair{kMin, kMin}}) {
    lossd::v1::DownloadRequest request;
    request.set_handle(kHandle);
    request.set_offset(offset);
    request.set_length(length);
    const absl::StatusOr<DownloadSpec> spec =
        ValidateDownloadRequest(request, 1 << 20);
    EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(spec.status().message()),
                HasSubstr("must be >= 0"));
  }
  for (int64_t chunk_bytes : {kMin, int64_t{-1}, k2p62, kMax}) {
    lossd::v1::DownloadRequest request;
    request.set_handle(kHandle);
    request.set_chunk_bytes(chunk_bytes);
    const absl::StatusOr<DownloadSpec> spec =
        ValidateDownloadRequest(request, 1 << 20);
    EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(spec.status().message()),
                HasSubstr(absl::StrCat("chunk_bytes = ", chunk_bytes)));
  }
}

TEST(DownloadChunkElementsTest, HugeChunks) {
  EXPECT_EQ(*DownloadChunkElements(DType::kFloat32, DType::kFloat32, kMax),
            kMax / 4);
  EXPECT_EQ(DownloadChunkElements(DType::kFloat32, DType::kFloat32, kMin)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

// A row of INT64_MAX - 3 bytes (fp32, vocab INT64_MAX / 4): the targets'
// count times their size would not fit in int64.
TEST(ValidateRowBlockSizesTest, RowCountsTimesTargetSizeAtTheLimits) {
  EvaluateSpec spec;
  spec.vocab = 1;
  spec.logits_dtype = DType::kFloat32;
  spec.targets_dtype = DType::kInt64;
  spec.row_bytes = 4;
  // kMax - 3 logits bytes are 2^61 - 1 rows, whose int64 targets would be
  // 2^64 - 8 bytes.
  absl::StatusOr<int64_t> rows = ValidateRowBlockSizes(spec, kMax - 3, 0, 0);
  EXPECT_EQ(rows.status().code(), absl::StatusCode::kInvalidArgument);
  rows = ValidateRowBlockSizes(spec, kMax - 3, kMax, 1);
  EXPECT_EQ(rows.status().code(), absl::StatusCode::kInvalidArgument);
  rows = ValidateRowBlockSizes(spec, 8, 16, 2);
  ASSERT_TRUE(rows.ok()) << rows.status();
  EXPECT_EQ(*rows, 2);
}

TEST(CheckInlineTargetsTest, RowCountsAtTheLimits) {
  lossd::v1::InlineTensor targets;
  targets.set_data(std::string(8, '\0'));
  for (int64_t rows : {kMax, kMin, int64_t{-1}, k2p62}) {
    const absl::Status status =
        CheckInlineTargets(targets, DType::kInt64, rows);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << rows;
  }
  EXPECT_TRUE(CheckInlineTargets(targets, DType::kInt64, 1).ok());
}

TEST(ValidateEvaluateHeaderTest, VocabAtTheLimits) {
  for (int64_t vocab : {kMax, kMax / 2, kMax / 4 + 1}) {
    lossd::v1::EvaluateHeader header;
    header.set_vocab(vocab);
    header.set_logits_dtype(lossd::v1::DTYPE_FLOAT32);
    header.set_targets_dtype(lossd::v1::DTYPE_INT64);
    const absl::StatusOr<EvaluateSpec> spec = ValidateEvaluateHeader(header);
    EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument)
        << vocab;
    EXPECT_THAT(std::string(spec.status().message()),
                HasSubstr(absl::StrCat("vocab = ", vocab)));
  }
}

}  // namespace
}  // namespace lossd
