// List's next_page_token, made so that the server can tell its own tokens from
// any other string: an HMAC-SHA256 under a key that lives only in this process
// binds the page position to the instance, the tenant and the page size.
#ifndef LOSSD_SERVER_PAGE_TOKEN_H_
#define LOSSD_SERVER_PAGE_TOKEN_H_

#include <array>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/tensor_store.h"

namespace lossd {

// What a page token is valid for besides its position: the caller and the
// request's page parameters. A token made for one scope opens in no other.
struct ListTokenScope {
  std::string tenant;
  // ListRequest.page_size as sent (0 stays 0): a client pages with the
  // page_size of the request that got the token.
  int32_t page_size = 0;
};

// Makes and opens page tokens for one server instance. The key is 32 bytes
// from OpenSSL's CSPRNG, drawn at Create and never written anywhere: a token
// is good until the process ends, and only in it (another instance, or this
// one restarted, refuses it). Thread-safe (immutable after Create).
class ListPageTokens {
 public:
  // `instance_id` is bound into every token and named in the error for a
  // token of another instance. INTERNAL when the CSPRNG fails.
  static absl::StatusOr<std::unique_ptr<ListPageTokens>> Create(
      std::string instance_id);

  ListPageTokens(const ListPageTokens&) = delete;
  ListPageTokens& operator=(const ListPageTokens&) = delete;

  // The token of a page whose last tensor is at `after` (a well-formed handle
  // and its creation time), for `scope`. URL-safe base64, no padding.
  std::string Make(const ListTokenScope& scope,
                   const ListPosition& after) const;

  // The position a token made by Make for the same scope holds.
  // INVALID_ARGUMENT, naming the token's size and never its contents, for
  // anything else: not canonical unpadded URL-safe base64, the wrong length,
  // another instance's, another tenant's or another page_size's, or any byte
  // changed. Compares the MAC in constant time.
  absl::StatusOr<ListPosition> Open(absl::string_view token,
                                    const ListTokenScope& scope) const;

 private:
  static constexpr size_t kKeyBytes = 32;
  static constexpr size_t kMacBytes = 32;  // SHA-256

  ListPageTokens(std::string instance_id,
                 const std::array<unsigned char, kKeyBytes>& key)
      : instance_id_(std::move(instance_id)), key_(key) {}

  // HMAC-SHA256 under key_ of everything the token vouches for.
  std::array<unsigned char, kMacBytes> Mac(const ListTokenScope& scope,
                                           uint64_t created_unix_nanos,
                                           absl::string_view handle) const;

  const std::string instance_id_;
  const std::array<unsigned char, kKeyBytes> key_;
};

}  // namespace lossd

#endif  // LOSSD_SERVER_PAGE_TOKEN_H_
