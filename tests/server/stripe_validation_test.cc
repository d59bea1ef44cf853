// The striped-upload checks of server/validation.h (ValidateUploadStripe,
// StripeElements) and the --stripe_timeout flag, without gRPC traffic.
#include <cstdint>
#include <random>
#include <string>

#include "absl/flags/flag.h"
#include "gtest/gtest.h"
#include "server/flags.h"
#include "server/validation.h"

namespace lossd {
namespace {

namespace pb = ::lossd::v1;

pb::UploadStripe Stripe(const std::string& id, int index, int count) {
  pb::UploadStripe stripe;
  stripe.set_upload_id(id);
  stripe.set_index(index);
  stripe.set_count(count);
  return stripe;
}

TEST(ValidateUploadStripeTest, AcceptsTheDocumentedRange) {
  const std::string longest(kMaxUploadIdLength, 'z');
  for (const pb::UploadStripe& stripe :
       {Stripe("a", 0, 1), Stripe("A-z_09", 63, 64), Stripe(longest, 3, 4)}) {
    absl::StatusOr<StripeSpec> spec = ValidateUploadStripe(stripe);
    ASSERT_TRUE(spec.ok()) << spec.status();
    EXPECT_EQ(spec->upload_id, stripe.upload_id());
    EXPECT_EQ(spec->index, stripe.index());
    EXPECT_EQ(spec->count, stripe.count());
  }
}

TEST(ValidateUploadStripeTest, RejectsBadIdsCountsAndIndexes) {
  for (const pb::UploadStripe& stripe :
       {Stripe("", 0, 1),
        Stripe(std::string(kMaxUploadIdLength + 1, 'a'), 0, 1),
        Stripe("a b", 0, 1), Stripe("a/b", 0, 1), Stripe("\xc3\xa9", 0, 1),
        Stripe(std::string("a\0b", 3), 0, 1), Stripe("a", 0, 0),
        Stripe("a", 0, -3), Stripe("a", 0, kMaxUploadStripes + 1),
        Stripe("a", 1, 1), Stripe("a", -1, 2), Stripe("a", 64, 64)}) {
    EXPECT_EQ(ValidateUploadStripe(stripe).status().code(),
              absl::StatusCode::kInvalidArgument)
        << stripe.ShortDebugString();
  }
}

// The stripes of any split cover [0, E) exactly, in order, and each boundary
// is floor(i * E / K) (checked in 128-bit arithmetic, also for E near 2^62).
TEST(StripeElementsTest, PartitionsEveryElementOnce) {
  const uint32_t seed = 20240617;
  std::mt19937_64 random(seed);
  for (int trial = 0; trial < 2000; ++trial) {
    int64_t elements;
    switch (trial % 4) {
      case 0:
        elements = static_cast<int64_t>(random() % 100);
        break;
      case 1:
        elements = static_cast<int64_t>(random() % (int64_t{1} << 40));
        break;
      case 2:
        elements = static_cast<int64_t>(random() >> 2);  // up to 2^62
        break;
      default:
        elements = (int64_t{1} << 62) - static_cast<int64_t>(random() % 100);
        break;
    }
    const int count = 1 + static_cast<int>(random() % kMaxUploadStripes);
    int64_t next = 0;
    for (int index = 0; index < count; ++index) {
      const ElementRange range = StripeElements(elements, index, count);
      const __int128 expected_first =
          static_cast<__int128>(index) * elements / count;
      ASSERT_EQ(range.first, static_cast<int64_t>(expected_first))
          << "seed " << seed << " E " << elements << " K " << count << " i "
          << index;
      ASSERT_EQ(range.first, next) << "seed " << seed;
      ASSERT_LE(range.first, range.end) << "seed " << seed;
      next = range.end;
    }
    ASSERT_EQ(next, elements) << "seed " << seed << " K " << count;
  }
}

TEST(StripeTimeoutFlagTest, MustBePositive) {
  const absl::Duration saved = absl::GetFlag(FLAGS_stripe_timeout);
  absl::SetFlag(&FLAGS_stripe_timeout, absl::Seconds(5));
  absl::StatusOr<ServerConfig> config = ConfigFromFlags();
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->stripe_timeout, absl::Seconds(5));
  absl::SetFlag(&FLAGS_stripe_timeout, absl::ZeroDuration());
  EXPECT_EQ(ConfigFromFlags().status().code(),
            absl::StatusCode::kInvalidArgument);
  absl::SetFlag(&FLAGS_stripe_timeout, saved);
}

}  // namespace
}  // namespace lossd
