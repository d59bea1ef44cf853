// Authenticator: reads certificates and tokens at start, then maps each call
// to a tenant from its metadata and its TLS peer.
#include "server/auth.h"

#include <cstring>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/files.h"
#include "common/status_macros.h"
#include "server/tensor_store.h"

namespace lossd {
namespace {

constexpr char kSanPrefix[] = "san:";

// Compares in time that depends on the lengths only, so that response times
// do not reveal how much of a guessed token was right.
bool ConstantTimeEquals(absl::string_view a, absl::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char difference = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    difference |= static_cast<unsigned char>(a[i] ^ b[i]);
  }
  return difference == 0;
}

absl::string_view View(const grpc::string_ref& ref) {
  return absl::string_view(ref.data(), ref.size());
}

}  // namespace

absl::StatusOr<std::vector<std::pair<std::string, std::string>>> ParseTokens(
    absl::string_view text) {
  std::vector<std::pair<std::string, std::string>> tokens;
  absl::flat_hash_set<std::string> seen;
  int line_number = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_number;
    const size_t comment = line.find('#');
    if (comment != absl::string_view::npos) line = line.substr(0, comment);
    std::vector<absl::string_view> fields =
        absl::StrSplit(line, absl::ByAnyChar(" \t\r"), absl::SkipEmpty());
    if (fields.empty()) continue;
    if (fields.size() != 2) {
      return absl::InvalidArgumentError(
          absl::StrCat("tokens file line ", line_number, ": expected 'TOKEN ",
                       "TENANT', got ", fields.size(), " fields"));
    }
    if (!seen.insert(std::string(fields[0])).second) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tokens file line ", line_number, ": token repeated from above"));
    }
    tokens.emplace_back(std::string(fields[0]), std::string(fields[1]));
  }
  if (tokens.empty()) {
    return absl::InvalidArgumentError("the tokens file holds no token");
  }
  return tokens;
}

absl::StatusOr<std::unique_ptr<Authenticator>> Authenticator::Create(
    const AuthOptions& options) {
  std::unique_ptr<Authenticator> auth(new Authenticator());
  if (options.tls_cert_file.empty() != options.tls_key_file.empty()) {
    return absl::InvalidArgumentError(
        "--tls_cert and --tls_key go together (TLS needs both)");
  }
  if (!options.tls_client_ca_file.empty() && options.tls_cert_file.empty()) {
    return absl::InvalidArgumentError(
        "--tls_client_ca needs --tls_cert and --tls_key (mutual TLS is TLS)");
  }
  const std::string& mode = options.cert_tenant;
  if (mode != "cn" && mode != "san" &&
      !(absl::StartsWith(mode, kSanPrefix) && mode.size() > 4)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--cert_tenant='", mode, "': expected cn, san or ", "san:PREFIX"));
  }
  auth->cert_tenant_ = mode;
  if (!options.tls_cert_file.empty()) {
    ASSIGN_OR_RETURN(auth->cert_chain_,
                     ReadNonEmptyFile("--tls_cert", options.tls_cert_file));
    ASSIGN_OR_RETURN(auth->private_key_,
                     ReadNonEmptyFile("--tls_key", options.tls_key_file));
  }
  if (!options.tls_client_ca_file.empty()) {
    ASSIGN_OR_RETURN(
        auth->client_ca_,
        ReadNonEmptyFile("--tls_client_ca", options.tls_client_ca_file));
  }
  if (!options.tokens_file.empty()) {
    ASSIGN_OR_RETURN(const std::string text,
                     ReadNonEmptyFile("--tokens_file", options.tokens_file));
    absl::StatusOr<std::vector<std::pair<std::string, std::string>>> tokens =
        ParseTokens(text);
    if (!tokens.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--tokens_file '", options.tokens_file,
                       "': ", tokens.status().message()));
    }
    auth->tokens_ = std::move(*tokens);
  }
  return auth;
}

std::shared_ptr<grpc::ServerCredentials> Authenticator::ServerCredentials()
    const {
  if (!tls()) return grpc::InsecureServerCredentials();
  grpc::SslServerCredentialsOptions options(
      mutual_tls() ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                   : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  options.pem_root_certs = client_ca_;
  options.pem_key_cert_pairs.push_back({private_key_, cert_chain_});
  return grpc::SslServerCredentials(options);
}

absl::StatusOr<std::string> Authenticator::TenantOfToken(
    const std::multimap<grpc::string_ref, grpc::string_ref>& metadata) const {
  auto [begin, end] = metadata.equal_range("authorization");
  if (begin == end) {
    return absl::UnauthenticatedError(
        "missing bearer token (metadata 'authorization: Bearer TOKEN')");
  }
  if (std::next(begin) != end) {
    return absl::UnauthenticatedError("more than one authorization header");
  }
  absl::string_view value = View(begin->second);
  if (!absl::ConsumePrefix(&value, "Bearer ") || value.empty()) {
    return absl::UnauthenticatedError(
        "the authorization header is not 'Bearer TOKEN'");
  }
  // Every token is compared, matched or not, so that timing tells nothing.
  const std::string* tenant = nullptr;
  for (const auto& [token, owner] : tokens_) {
    if (ConstantTimeEquals(token, value) && tenant == nullptr) tenant = &owner;
  }
  if (tenant == nullptr) {
    return absl::UnauthenticatedError("unknown bearer token");
  }
  return *tenant;
}

absl::StatusOr<std::string> Authenticator::TenantOfCertificate(
    const grpc::AuthContext* auth_context) const {
  if (auth_context == nullptr || !auth_context->IsPeerAuthenticated()) {
    return absl::UnauthenticatedError(
        "no verified client certificate (this port requires mutual TLS)");
  }
  if (cert_tenant_ == "cn") {
    for (const grpc::string_ref& cn :
         auth_context->FindPropertyValues(GRPC_X509_CN_PROPERTY_NAME)) {
      if (cn.size() > 0) return std::string(View(cn));
    }
    return absl::UnauthenticatedError(
        "the client certificate has no subject Common Name (--cert_tenant=cn)");
  }
  const absl::string_view prefix =
      cert_tenant_ == "san"
          ? absl::string_view()
          : absl::string_view(cert_tenant_).substr(sizeof(kSanPrefix) - 1);
  for (const grpc::string_ref& san :
       auth_context->FindPropertyValues(GRPC_X509_SAN_PROPERTY_NAME)) {
    absl::string_view name = View(san);
    if (absl::ConsumePrefix(&name, prefix) && !name.empty()) {
      return std::string(name);
    }
  }
  return absl::UnauthenticatedError(absl::StrCat(
      "the client certificate has no subject alternative name",
      prefix.empty() ? "" : absl::StrCat(" starting with '", prefix, "'"),
      " (--cert_tenant=", cert_tenant_, ")"));
}

absl::StatusOr<std::string> Authenticator::TenantOf(
    const std::multimap<grpc::string_ref, grpc::string_ref>& metadata,
    const grpc::AuthContext* auth_context) const {
  if (anonymous()) return std::string(kDefaultTenant);
  std::string from_certificate;
  if (mutual_tls()) {
    ASSIGN_OR_RETURN(from_certificate, TenantOfCertificate(auth_context));
    if (!tokens()) return from_certificate;
  }
  ASSIGN_OR_RETURN(std::string from_token, TenantOfToken(metadata));
  if (mutual_tls() && from_token != from_certificate) {
    return absl::PermissionDeniedError(absl::StrCat(
        "the bearer token is for tenant '", from_token,
        "' but the client certificate names '", from_certificate, "'"));
  }
  return from_token;
}

absl::StatusOr<std::string> Authenticator::Authenticate(
    const grpc::ServerContextBase& context) const {
  if (anonymous()) return std::string(kDefaultTenant);
  const std::shared_ptr<const grpc::AuthContext> auth_context =
      mutual_tls() ? context.auth_context() : nullptr;
  return TenantOf(context.client_metadata(), auth_context.get());
}

}  // namespace lossd
