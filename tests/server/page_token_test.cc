// Issue 31: List page tokens without a server. A token opens only in the
// ListPageTokens that made it (its key, not only its instance id, decides)
// and only for the scope it was made for.
#include "server/page_token.h"

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace lossd {
namespace {

using ::testing::HasSubstr;

constexpr char kInstance[] = "0badcafe";

ListPosition Position() {
  ListPosition position;
  position.created_unix_nanos = 1764633600123456789;
  position.handle = std::string(kInstance) + "-" + std::string(32, 'f');
  return position;
}

std::unique_ptr<ListPageTokens> Tokens() {
  absl::StatusOr<std::unique_ptr<ListPageTokens>> tokens =
      ListPageTokens::Create(kInstance);
  EXPECT_TRUE(tokens.ok()) << tokens.status();
  return tokens.ok() ? std::move(*tokens) : nullptr;
}

TEST(ListPageTokensTest, OpensWhatItMadeForTheSameScope) {
  std::unique_ptr<ListPageTokens> tokens = Tokens();
  ASSERT_NE(tokens, nullptr);
  const ListTokenScope scope{"alpha", 7};
  const std::string token = tokens->Make(scope, Position());
  EXPECT_EQ(token.size(), 112u);
  EXPECT_EQ(token.find_first_not_of("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmn"
                                    "opqrstuvwxyz0123456789-_"),
            std::string::npos)
      << token;
  absl::StatusOr<ListPosition> opened = tokens->Open(token, scope);
  ASSERT_TRUE(opened.ok()) << opened.status();
  EXPECT_EQ(opened->created_unix_nanos, Position().created_unix_nanos);
  EXPECT_EQ(opened->handle, Position().handle);
}

// A restarted instance that kept its id (or two with the same id) draws
// another key: the token of one is refused by the other.
TEST(ListPageTokensTest, AnotherKeyWithTheSameInstanceIdRefuses) {
  std::unique_ptr<ListPageTokens> made = Tokens();
  std::unique_ptr<ListPageTokens> other = Tokens();
  ASSERT_NE(made, nullptr);
  ASSERT_NE(other, nullptr);
  const ListTokenScope scope{"alpha", 7};
  const std::string token = made->Make(scope, Position());
  absl::StatusOr<ListPosition> opened = other->Open(token, scope);
  ASSERT_FALSE(opened.ok());
  EXPECT_EQ(opened.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(opened.status().message(),
              HasSubstr("page_token (112 bytes) is not a next_page_token"));
  EXPECT_TRUE(made->Open(token, scope).ok());
}

TEST(ListPageTokensTest, AnotherScopeRefuses) {
  std::unique_ptr<ListPageTokens> tokens = Tokens();
  ASSERT_NE(tokens, nullptr);
  const std::string token = tokens->Make({"alpha", 7}, Position());
  // Tenant names that a naive concatenation with the page size could
  // confuse, the empty tenant, and other page sizes.
  const ListTokenScope others[] = {
      {"beta", 7},  {"alph", 7},  {"alpha ", 7}, {"", 7},
      {"alpha", 0}, {"alpha", 8}, {"alpha", -7}, {"alpha", 7 + (1 << 16)},
  };
  for (const ListTokenScope& scope : others) {
    absl::StatusOr<ListPosition> opened = tokens->Open(token, scope);
    EXPECT_EQ(opened.status().code(), absl::StatusCode::kInvalidArgument)
        << "'" << scope.tenant << "' " << scope.page_size;
  }
}

}  // namespace
}  // namespace lossd
