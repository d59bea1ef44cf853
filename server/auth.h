// Who is calling: TLS / mutual-TLS server credentials and the mapping of a
// bearer token or a client certificate to a tenant. The service asks it once
// per RPC; the tenant then scopes every handle and quota.
#ifndef LOSSD_SERVER_AUTH_H_
#define LOSSD_SERVER_AUTH_H_

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/security/server_credentials.h"

namespace lossd {

struct AuthOptions {
  // PEM certificate chain and private key of the server; both or neither.
  // Set, the main port speaks TLS.
  std::string tls_cert_file;
  std::string tls_key_file;
  // PEM CA bundle for client certificates. Set (needs TLS), clients must
  // present a certificate signed by it (mutual TLS) and their tenant is read
  // from it, see cert_tenant.
  std::string tls_client_ca_file;
  // Which part of a client certificate names the tenant: "cn" (the subject
  // Common Name), "san" (the first subject alternative name), or
  // "san:PREFIX" (the first SAN starting with PREFIX, PREFIX removed, e.g.
  // san:spiffe://cluster.local/ns/).
  std::string cert_tenant = "cn";
  // Bearer tokens: lines "TOKEN TENANT" ('#' starts a comment). Set, every
  // RPC of lossd.v1.Lossd needs "authorization: Bearer TOKEN".
  std::string tokens_file;
};

// Token -> tenant, parsed from the text of a tokens file. INVALID_ARGUMENT
// (naming the line, never the token) for a line without exactly two fields, a
// repeated token, or no token at all.
absl::StatusOr<std::vector<std::pair<std::string, std::string>>> ParseTokens(
    absl::string_view text);

// Decides the tenant of each call. Immutable after Create; thread-safe.
class Authenticator {
 public:
  // Reads the files the options name. INVALID_ARGUMENT for an inconsistent
  // set (a key without a certificate, a client CA without TLS, an unknown
  // cert_tenant), an unreadable or empty file, or a malformed tokens file.
  static absl::StatusOr<std::unique_ptr<Authenticator>> Create(
      const AuthOptions& options);

  Authenticator(const Authenticator&) = delete;
  Authenticator& operator=(const Authenticator&) = delete;

  bool tls() const { return !cert_chain_.empty(); }
  bool mutual_tls() const { return !client_ca_.empty(); }
  bool tokens() const { return !tokens_.empty(); }
  // With none of TLS client certificates and tokens every caller is one
  // tenant (kDefaultTenant).
  bool anonymous() const { return !mutual_tls() && !tokens(); }

  // Credentials of the main port: TLS (requiring and verifying a client
  // certificate with mutual TLS) or plaintext.
  std::shared_ptr<grpc::ServerCredentials> ServerCredentials() const;

  // The tenant of a call given its metadata and its auth context (null for a
  // plaintext connection). UNAUTHENTICATED when a token is needed and missing,
  // malformed or unknown, or a certificate is needed and absent or names no
  // tenant; PERMISSION_DENIED when token and certificate name different
  // tenants. Messages never repeat the token.
  absl::StatusOr<std::string> TenantOf(
      const std::multimap<grpc::string_ref, grpc::string_ref>& metadata,
      const grpc::AuthContext* auth_context) const;

  // TenantOf for a server call.
  absl::StatusOr<std::string> Authenticate(
      const grpc::ServerContextBase& context) const;

 private:
  Authenticator() = default;
  absl::StatusOr<std::string> TenantOfToken(
      const std::multimap<grpc::string_ref, grpc::string_ref>& metadata) const;
  absl::StatusOr<std::string> TenantOfCertificate(
      const grpc::AuthContext* auth_context) const;

  std::string cert_chain_;
  std::string private_key_;
  std::string client_ca_;
  std::string cert_tenant_;
  std::vector<std::pair<std::string, std::string>> tokens_;
};

}  // namespace lossd

#endif  // LOSSD_SERVER_AUTH_H_
