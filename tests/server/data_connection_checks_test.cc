// DataRanges: the byte ranges of a transfer's data connections cover the
// tensor once, in order, each on element boundaries.
#include "server/data_connection_checks.h"

#include <cstdint>
#include <vector>

#include "gtest/gtest.h"

namespace lossd {
namespace {

TEST(DataRangesTest, ConnectionsCoverTheTensorInOrderOnElementBoundaries) {
  for (const int64_t elements :
       {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{1000003}}) {
    for (const int64_t element_bytes : {int64_t{2}, int64_t{4}}) {
      for (const int connections : {1, 2, 3, 8, 64}) {
        const std::vector<DataTransfer::Range> ranges =
            DataRanges(elements, element_bytes, connections);
        ASSERT_EQ(ranges.size(), static_cast<size_t>(connections));
        int64_t next = 0;
        for (const DataTransfer::Range& range : ranges) {
          EXPECT_EQ(range.offset, next);
          EXPECT_GE(range.bytes, 0);
          EXPECT_EQ(range.bytes % element_bytes, 0);
          next += range.bytes;
        }
        EXPECT_EQ(next, elements * element_bytes)
            << elements << " elements over " << connections;
      }
    }
  }
}

TEST(DataRangesTest, StripesDifferByAtMostOneElement) {
  const std::vector<DataTransfer::Range> ranges = DataRanges(10, 4, 3);
  ASSERT_EQ(ranges.size(), 3u);
  EXPECT_EQ(ranges[0].bytes, 3 * 4);
  EXPECT_EQ(ranges[1].bytes, 3 * 4);
  EXPECT_EQ(ranges[2].bytes, 4 * 4);
}

}  // namespace
}  // namespace lossd
