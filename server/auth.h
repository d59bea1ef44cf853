// Who is calling: TLS / mutual-TLS server credentials and the mapping of a
// bearer token or a client certificate to a tenant. The service asks it once
// per RPC; the tenant then scopes every handle and quota. Certificates and
// tokens can be reloaded while serving (ReloadTls, ReloadTokens).
#ifndef LOSSD_SERVER_AUTH_H_
#define LOSSD_SERVER_AUTH_H_

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/security/tls_certificate_provider.h"

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
  // How often the TLS library re-reads the validated certificate files that
  // ReloadTls stages (rounded up to whole seconds, at least 1).
  absl::Duration tls_refresh = absl::Seconds(10);
};

// What a PEM certificate, key and CA bundle hold, once checked.
struct TlsMaterial {
  std::string cert_chain;
  std::string private_key;
  std::string client_ca;            // empty without mutual TLS
  int64_t cert_not_after = 0;       // leaf certificate, seconds since epoch
  int64_t client_ca_not_after = 0;  // earliest in the bundle; 0 without one
};

// Checks PEM text: the chain holds at least one certificate and nothing else
// unparsable, the key parses and matches the chain's first certificate, the CA
// bundle (if any) holds certificates only. INVALID_ARGUMENT naming the part.
absl::StatusOr<TlsMaterial> CheckTlsMaterial(std::string cert_chain,
                                             std::string private_key,
                                             std::string client_ca);

// Token -> tenant, parsed from the text of a tokens file. INVALID_ARGUMENT
// (naming the line, never the token) for a line without exactly two fields, a
// repeated token, or no token at all.
absl::StatusOr<std::vector<std::pair<std::string, std::string>>> ParseTokens(
    absl::string_view text);

// Decides the tenant of each call. Its modes (TLS, mutual TLS, tokens) are
// fixed at Create; the certificates and tokens behind them can be reloaded.
// Thread-safe.
class Authenticator {
 public:
  // Reads the files the options name. INVALID_ARGUMENT for an inconsistent
  // set (a key without a certificate, a client CA without TLS, an unknown
  // cert_tenant), an unreadable or empty file, a certificate, key or CA that
  // does not parse (or a key that does not match its certificate), or a
  // malformed tokens file. With TLS, the checked files are copied into a
  // private directory under $TMPDIR (default /tmp), which the TLS library
  // watches; it is removed with the authenticator.
  static absl::StatusOr<std::unique_ptr<Authenticator>> Create(
      const AuthOptions& options);

  Authenticator(const Authenticator&) = delete;
  Authenticator& operator=(const Authenticator&) = delete;
  ~Authenticator();

  bool tls() const { return !options_.tls_cert_file.empty(); }
  bool mutual_tls() const { return !options_.tls_client_ca_file.empty(); }
  bool tokens() const { return !options_.tokens_file.empty(); }
  // With none of TLS client certificates and tokens every caller is one
  // tenant (kDefaultTenant).
  bool anonymous() const { return !mutual_tls() && !tokens(); }

  // Credentials of the main port: TLS (requiring and verifying a client
  // certificate with mutual TLS) or plaintext. The TLS credentials follow
  // ReloadTls: new connections get the certificate in force, connections
  // already open keep theirs.
  std::shared_ptr<grpc::ServerCredentials> ServerCredentials() const;

  // Re-reads the tokens file; a token removed from it fails the next RPC that
  // presents it. On any error (INVALID_ARGUMENT: unreadable, empty or
  // malformed) the tokens in force stay. OK and nothing done without tokens.
  absl::Status ReloadTokens() ABSL_LOCKS_EXCLUDED(mu_);
  // Re-reads the certificate, key and client CA and, when they check
  // (CheckTlsMaterial), hands them to the TLS library, which uses them for
  // new connections within AuthOptions::tls_refresh. On any error the
  // material in force stays. OK and nothing done without TLS.
  absl::Status ReloadTls() ABSL_LOCKS_EXCLUDED(mu_);

  // The tenants the tokens file names now, sorted, without repeats.
  std::vector<std::string> TokenTenants() const ABSL_LOCKS_EXCLUDED(mu_);
  // notAfter (seconds since epoch) of the server certificate in force and the
  // earliest of the client CA bundle; 0 when there is none.
  int64_t cert_not_after() const ABSL_LOCKS_EXCLUDED(mu_);
  int64_t client_ca_not_after() const ABSL_LOCKS_EXCLUDED(mu_);
  const AuthOptions& options() const { return options_; }

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
  using TokenList = std::vector<std::pair<std::string, std::string>>;

  explicit Authenticator(const AuthOptions& options) : options_(options) {}
  absl::StatusOr<std::string> TenantOfToken(
      const std::multimap<grpc::string_ref, grpc::string_ref>& metadata) const
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<std::string> TenantOfCertificate(
      const grpc::AuthContext* auth_context) const;
  // Writes `material` as a new version of the staged files, dated at least a
  // second after the previous version's, and points the watched paths at it
  // (one rename of a symlink, as Kubernetes does).
  absl::Status Stage(const TlsMaterial& material)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const AuthOptions options_;
  // The private directory of the staged TLS files; empty without TLS.
  std::string stage_dir_;
  std::shared_ptr<grpc::experimental::CertificateProviderInterface>
      certificate_provider_;

  mutable absl::Mutex mu_;
  // Replaced whole by ReloadTokens: a call checks one consistent list.
  std::shared_ptr<const TokenList> tokens_ ABSL_GUARDED_BY(mu_);
  int64_t cert_not_after_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t client_ca_not_after_ ABSL_GUARDED_BY(mu_) = 0;
  int stage_version_ ABSL_GUARDED_BY(mu_) = 0;
  // Modification time (seconds since epoch) of the latest staged files.
  int64_t stage_mtime_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace lossd

#endif  // LOSSD_SERVER_AUTH_H_
