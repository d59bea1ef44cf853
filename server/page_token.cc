// ListPageTokens: a List position sealed with an HMAC, so that a forged,
// altered or foreign token is refused instead of read as a place to resume.
#include "server/page_token.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "common/handle.h"

namespace lossd {
namespace {

// The token's first bytes: a token of another format (lossd's unsigned
// "lossd.List.v1:" tokens among them) is refused by its length or its tag.
// Three bytes, so that the raw token is a multiple of 3 bytes long and its
// base64 has no padding and no spare bits.
constexpr absl::string_view kTag = "lt2";
// Separates these MACs from any other use of the key.
constexpr absl::string_view kMacContext = "lossd.v1.List page token";
constexpr size_t kTokenBytes = kTag.size() + 8 + kHandleLength + 32;
static_assert(kTokenBytes % 3 == 0, "base64 without padding or spare bits");

void AppendLittleEndian(uint64_t value, int bytes, std::string* out) {
  for (int i = 0; i < bytes; ++i) {
    out->push_back(static_cast<char>((value >> (8 * i)) & 0xff));
  }
}

uint64_t ReadLittleEndian64(absl::string_view bytes) {
  uint64_t value = 0;
  for (int i = 0; i < 8; ++i) {
    value |= uint64_t{static_cast<unsigned char>(bytes[i])} << (8 * i);
  }
  return value;
}

}  // namespace

absl::StatusOr<std::unique_ptr<ListPageTokens>> ListPageTokens::Create(
    std::string instance_id) {
  std::array<unsigned char, kKeyBytes> key{};
  if (RAND_bytes(key.data(), static_cast<int>(key.size())) != 1) {
    return absl::InternalError(
        "cannot draw the List page-token key from OpenSSL's RAND_bytes");
  }
  return std::unique_ptr<ListPageTokens>(
      new ListPageTokens(std::move(instance_id), key));
}

std::array<unsigned char, ListPageTokens::kMacBytes> ListPageTokens::Mac(
    const ListTokenScope& scope, uint64_t created_unix_nanos,
    absl::string_view handle) const {
  // Every variable-length field is preceded by its length, so that no two
  // scopes give the same message.
  std::string message(kMacContext);
  AppendLittleEndian(instance_id_.size(), 8, &message);
  message.append(instance_id_);
  AppendLittleEndian(scope.tenant.size(), 8, &message);
  message.append(scope.tenant);
  AppendLittleEndian(static_cast<uint32_t>(scope.page_size), 4, &message);
  AppendLittleEndian(created_unix_nanos, 8, &message);
  AppendLittleEndian(handle.size(), 8, &message);
  message.append(handle.data(), handle.size());
  std::array<unsigned char, kMacBytes> mac{};
  unsigned int mac_size = 0;
  HMAC(EVP_sha256(), key_.data(), static_cast<int>(key_.size()),
       reinterpret_cast<const unsigned char*>(message.data()), message.size(),
       mac.data(), &mac_size);
  return mac;
}

std::string ListPageTokens::Make(const ListTokenScope& scope,
                                 const ListPosition& after) const {
  const uint64_t nanos = static_cast<uint64_t>(after.created_unix_nanos);
  std::string raw(kTag);
  AppendLittleEndian(nanos, 8, &raw);
  raw.append(after.handle);
  const std::array<unsigned char, kMacBytes> mac =
      Mac(scope, nanos, after.handle);
  raw.append(reinterpret_cast<const char*>(mac.data()), mac.size());
  return absl::WebSafeBase64Escape(raw);
}

absl::StatusOr<ListPosition> ListPageTokens::Open(
    absl::string_view token, const ListTokenScope& scope) const {
  const std::string refused = absl::StrCat(
      "page_token (", token.size(),
      " bytes) is not a next_page_token of this server's List for this "
      "caller and page_size; start again without one");
  std::string raw;
  // Canonical encodings only: otherwise a token whose spare bits or padding
  // differ would decode to the same bytes and be accepted.
  if (!absl::WebSafeBase64Unescape(token, &raw) || raw.size() != kTokenBytes ||
      absl::WebSafeBase64Escape(raw) != token) {
    return absl::InvalidArgumentError(refused);
  }
  absl::string_view rest = raw;
  if (rest.substr(0, kTag.size()) != kTag) {
    return absl::InvalidArgumentError(refused);
  }
  rest.remove_prefix(kTag.size());
  const uint64_t nanos = ReadLittleEndian64(rest);
  rest.remove_prefix(8);
  const absl::string_view handle = rest.substr(0, kHandleLength);
  const absl::string_view mac = rest.substr(kHandleLength);
  const std::array<unsigned char, kMacBytes> expected =
      Mac(scope, nanos, handle);
  if (CRYPTO_memcmp(expected.data(), mac.data(), kMacBytes) != 0) {
    // A token of another instance (a restart, another pod) is the one
    // refusal worth telling apart; the handle's instance says which, and is
    // quoted only when it has the shape of one.
    const absl::string_view instance = handle.substr(0, instance_id_.size());
    if (IsWellFormedHandle(handle) && instance != instance_id_) {
      return absl::InvalidArgumentError(absl::StrCat(
          refused, " (it comes from instance ", instance, ", this is instance ",
          instance_id_, ": restarted or other pod)"));
    }
    return absl::InvalidArgumentError(refused);
  }
  ListPosition position;
  position.created_unix_nanos = static_cast<int64_t>(nanos);
  position.handle = std::string(handle);
  return position;
}

}  // namespace lossd
