// Authenticator: reads certificates and tokens at start and on reload, then
// maps each call to a tenant from its metadata and its TLS peer. Certificates
// are checked with OpenSSL before gRPC's file-watching provider sees them.
#include "server/auth.h"

#include <fcntl.h>
#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/files.h"
#include "common/status_macros.h"
#include "grpcpp/security/tls_credentials_options.h"
#include "server/tensor_store.h"

namespace lossd {
namespace {

constexpr char kSanPrefix[] = "san:";
constexpr char kKeyFile[] = "key.pem";
constexpr char kCertFile[] = "cert.pem";
constexpr char kCaFile[] = "ca.pem";

struct BioFree {
  void operator()(BIO* bio) const { BIO_free(bio); }
};
struct X509Free {
  void operator()(X509* cert) const { X509_free(cert); }
};
struct PkeyFree {
  void operator()(EVP_PKEY* key) const { EVP_PKEY_free(key); }
};
using BioPtr = std::unique_ptr<BIO, BioFree>;
using X509Ptr = std::unique_ptr<X509, X509Free>;
using PkeyPtr = std::unique_ptr<EVP_PKEY, PkeyFree>;

BioPtr MemoryBio(const std::string& text) {
  return BioPtr(BIO_new_mem_buf(text.data(), static_cast<int>(text.size())));
}

// True when the last OpenSSL error is only "no more PEM blocks" (the clean
// end of the input); clears the error queue either way.
bool CleanPemEnd() {
  const unsigned long error = ERR_peek_last_error();
  ERR_clear_error();
  return error == 0 || (ERR_GET_LIB(error) == ERR_LIB_PEM &&
                        ERR_GET_REASON(error) == PEM_R_NO_START_LINE);
}

// Every certificate of a PEM bundle, in order.
absl::StatusOr<std::vector<X509Ptr>> ParseCertificates(const char* what,
                                                       const std::string& pem) {
  ERR_clear_error();
  BioPtr bio = MemoryBio(pem);
  std::vector<X509Ptr> certificates;
  while (X509* certificate =
             PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr)) {
    certificates.emplace_back(certificate);
  }
  if (!CleanPemEnd()) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": a PEM block that is not a well-formed certificate after ",
        certificates.size(), " good one(s)"));
  }
  if (certificates.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": no PEM certificate"));
  }
  return certificates;
}

absl::StatusOr<int64_t> NotAfter(const char* what, const X509* certificate) {
  std::tm tm{};
  if (ASN1_TIME_to_tm(X509_get0_notAfter(certificate), &tm) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": unreadable notAfter"));
  }
  return static_cast<int64_t>(timegm(&tm));
}

// Writes `text` to a new file only the owner can read, modified at
// `mtime_seconds`.
absl::Status WritePrivateFile(const std::string& path, const std::string& text,
                              int64_t mtime_seconds) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC,
                        S_IRUSR | S_IWUSR);
  if (fd < 0) {
    return absl::InternalError(
        absl::StrCat("cannot create ", path, ": ", std::strerror(errno)));
  }
  size_t written = 0;
  while (written < text.size()) {
    const ssize_t n = ::write(fd, text.data() + written, text.size() - written);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int error = errno;
      ::close(fd);
      return absl::InternalError(
          absl::StrCat("cannot write ", path, ": ", std::strerror(error)));
    }
    written += static_cast<size_t>(n);
  }
  struct timespec times[2] = {};
  times[0].tv_nsec = UTIME_OMIT;
  times[1].tv_sec = static_cast<time_t>(mtime_seconds);
  if (::futimens(fd, times) != 0) {
    const int error = errno;
    ::close(fd);
    return absl::InternalError(absl::StrCat("cannot set the time of ", path,
                                            ": ", std::strerror(error)));
  }
  if (::close(fd) != 0) {
    return absl::InternalError(
        absl::StrCat("cannot write ", path, ": ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

// Removes one staged version (its three files, then the directory).
void RemoveVersion(const std::string& dir) {
  for (const char* name : {kKeyFile, kCertFile, kCaFile}) {
    ::unlink(absl::StrCat(dir, "/", name).c_str());
  }
  ::rmdir(dir.c_str());
}

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

absl::StatusOr<TlsMaterial> CheckTlsMaterial(std::string cert_chain,
                                             std::string private_key,
                                             std::string client_ca) {
  TlsMaterial material;
  ASSIGN_OR_RETURN(std::vector<X509Ptr> chain,
                   ParseCertificates("--tls_cert", cert_chain));
  ASSIGN_OR_RETURN(material.cert_not_after,
                   NotAfter("--tls_cert", chain.front().get()));
  ERR_clear_error();
  BioPtr key_bio = MemoryBio(private_key);
  PkeyPtr key(
      PEM_read_bio_PrivateKey(key_bio.get(), nullptr, nullptr, nullptr));
  ERR_clear_error();
  if (key == nullptr) {
    return absl::InvalidArgumentError(
        "--tls_key: no well-formed PEM private key (an encrypted key is not "
        "supported)");
  }
  if (X509_check_private_key(chain.front().get(), key.get()) != 1) {
    ERR_clear_error();
    return absl::InvalidArgumentError(
        "--tls_key does not match the first certificate of --tls_cert");
  }
  if (!client_ca.empty()) {
    ASSIGN_OR_RETURN(std::vector<X509Ptr> authorities,
                     ParseCertificates("--tls_client_ca", client_ca));
    for (const X509Ptr& authority : authorities) {
      ASSIGN_OR_RETURN(const int64_t not_after,
                       NotAfter("--tls_client_ca", authority.get()));
      if (material.client_ca_not_after == 0 ||
          not_after < material.client_ca_not_after) {
        material.client_ca_not_after = not_after;
      }
    }
  }
  material.cert_chain = std::move(cert_chain);
  material.private_key = std::move(private_key);
  material.client_ca = std::move(client_ca);
  return material;
}

absl::StatusOr<std::unique_ptr<Authenticator>> Authenticator::Create(
    const AuthOptions& options) {
  std::unique_ptr<Authenticator> auth(new Authenticator(options));
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
  if (auth->tls()) {
    const char* tmpdir = std::getenv("TMPDIR");
    std::string pattern =
        absl::StrCat(tmpdir != nullptr && tmpdir[0] != '\0' ? tmpdir : "/tmp",
                     "/lossd-tls-XXXXXX");
    if (::mkdtemp(pattern.data()) == nullptr) {
      return absl::InternalError(
          absl::StrCat("cannot create a directory like ", pattern,
                       " for the TLS files: ", std::strerror(errno)));
    }
    auth->stage_dir_ = pattern;
    RETURN_IF_ERROR(auth->ReloadTls());
    const std::string current = absl::StrCat(auth->stage_dir_, "/current/");
    const double seconds = absl::ToDoubleSeconds(options.tls_refresh);
    const unsigned int refresh = static_cast<unsigned int>(
        std::max(1.0, std::min(86400.0, std::ceil(seconds))));
    auth->certificate_provider_ =
        std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
            current + kKeyFile, current + kCertFile,
            auth->mutual_tls() ? current + kCaFile : std::string(), refresh);
  }
  RETURN_IF_ERROR(auth->ReloadTokens());
  return auth;
}

Authenticator::~Authenticator() {
  certificate_provider_.reset();
  if (stage_dir_.empty()) return;
  absl::MutexLock lock(&mu_);
  ::unlink(absl::StrCat(stage_dir_, "/current").c_str());
  ::unlink(absl::StrCat(stage_dir_, "/current.tmp").c_str());
  for (int version = std::max(1, stage_version_ - 1); version <= stage_version_;
       ++version) {
    RemoveVersion(absl::StrCat(stage_dir_, "/v", version));
  }
  ::rmdir(stage_dir_.c_str());
}

absl::Status Authenticator::ReloadTokens() {
  if (!tokens()) return absl::OkStatus();
  ASSIGN_OR_RETURN(const std::string text,
                   ReadNonEmptyFile("--tokens_file", options_.tokens_file));
  absl::StatusOr<TokenList> tokens = ParseTokens(text);
  if (!tokens.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tokens_file '", options_.tokens_file,
                     "': ", tokens.status().message()));
  }
  auto list = std::make_shared<const TokenList>(*std::move(tokens));
  absl::MutexLock lock(&mu_);
  tokens_ = std::move(list);
  return absl::OkStatus();
}

absl::Status Authenticator::ReloadTls() {
  if (!tls()) return absl::OkStatus();
  ASSIGN_OR_RETURN(std::string cert_chain,
                   ReadNonEmptyFile("--tls_cert", options_.tls_cert_file));
  ASSIGN_OR_RETURN(std::string private_key,
                   ReadNonEmptyFile("--tls_key", options_.tls_key_file));
  std::string client_ca;
  if (mutual_tls()) {
    ASSIGN_OR_RETURN(client_ca, ReadNonEmptyFile("--tls_client_ca",
                                                 options_.tls_client_ca_file));
  }
  ASSIGN_OR_RETURN(
      TlsMaterial material,
      CheckTlsMaterial(std::move(cert_chain), std::move(private_key),
                       std::move(client_ca)));
  absl::MutexLock lock(&mu_);
  RETURN_IF_ERROR(Stage(material));
  cert_not_after_ = material.cert_not_after;
  client_ca_not_after_ = material.client_ca_not_after;
  return absl::OkStatus();
}

absl::Status Authenticator::Stage(const TlsMaterial& material) {
  // A new directory, then one rename of the symlink that the watched paths
  // go through. The provider (which re-reads on its own schedule) opens the
  // key and the certificate one after the other, so a rename between the two
  // would hand it the key of one version and the certificate of the other,
  // and every new handshake would fail until its next read. It reads again
  // when a file's modification time, in whole seconds, changed across its
  // reads: so each version's files are dated at least a second after the
  // previous version's, however fast reloads follow each other.
  const int64_t mtime = std::max<int64_t>(::time(nullptr), stage_mtime_ + 1);
  const int version = stage_version_ + 1;
  const std::string name = absl::StrCat("v", version);
  const std::string dir = absl::StrCat(stage_dir_, "/", name);
  if (::mkdir(dir.c_str(), S_IRWXU) != 0) {
    return absl::InternalError(
        absl::StrCat("cannot create ", dir, ": ", std::strerror(errno)));
  }
  absl::Status status = WritePrivateFile(absl::StrCat(dir, "/", kKeyFile),
                                         material.private_key, mtime);
  if (status.ok()) {
    status = WritePrivateFile(absl::StrCat(dir, "/", kCertFile),
                              material.cert_chain, mtime);
  }
  if (status.ok() && !material.client_ca.empty()) {
    status = WritePrivateFile(absl::StrCat(dir, "/", kCaFile),
                              material.client_ca, mtime);
  }
  const std::string link = absl::StrCat(stage_dir_, "/current.tmp");
  ::unlink(link.c_str());
  if (status.ok() && ::symlink(name.c_str(), link.c_str()) != 0) {
    status = absl::InternalError(
        absl::StrCat("cannot create ", link, ": ", std::strerror(errno)));
  }
  if (status.ok() &&
      std::rename(link.c_str(), (stage_dir_ + "/current").c_str()) != 0) {
    status = absl::InternalError(absl::StrCat(
        "cannot rename ", link, " to current: ", std::strerror(errno)));
  }
  if (!status.ok()) {
    RemoveVersion(dir);
    return status;
  }
  // The version before the previous one: the provider may still be reading
  // the previous one.
  if (version > 2) RemoveVersion(absl::StrCat(stage_dir_, "/v", version - 2));
  stage_version_ = version;
  stage_mtime_ = mtime;
  return absl::OkStatus();
}

std::vector<std::string> Authenticator::TokenTenants() const {
  std::shared_ptr<const TokenList> tokens;
  {
    absl::MutexLock lock(&mu_);
    tokens = tokens_;
  }
  std::vector<std::string> tenants;
  if (tokens == nullptr) return tenants;
  for (const auto& [token, tenant] : *tokens) tenants.push_back(tenant);
  std::sort(tenants.begin(), tenants.end());
  tenants.erase(std::unique(tenants.begin(), tenants.end()), tenants.end());
  return tenants;
}

int64_t Authenticator::cert_not_after() const {
  absl::MutexLock lock(&mu_);
  return cert_not_after_;
}

int64_t Authenticator::client_ca_not_after() const {
  absl::MutexLock lock(&mu_);
  return client_ca_not_after_;
}

std::shared_ptr<grpc::ServerCredentials> Authenticator::ServerCredentials()
    const {
  if (!tls()) return grpc::InsecureServerCredentials();
  grpc::experimental::TlsServerCredentialsOptions options(
      certificate_provider_);
  options.watch_identity_key_cert_pairs();
  if (mutual_tls()) {
    options.watch_root_certs();
    options.set_cert_request_type(
        GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  } else {
    options.set_cert_request_type(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  }
  return grpc::experimental::TlsServerCredentials(options);
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
  std::shared_ptr<const TokenList> tokens;
  {
    absl::MutexLock lock(&mu_);
    tokens = tokens_;
  }
  // Every token is compared, matched or not, so that timing tells nothing.
  const std::string* tenant = nullptr;
  for (const auto& [token, owner] : *tokens) {
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
  if (options_.cert_tenant == "cn") {
    for (const grpc::string_ref& cn :
         auth_context->FindPropertyValues(GRPC_X509_CN_PROPERTY_NAME)) {
      if (cn.size() > 0) return std::string(View(cn));
    }
    return absl::UnauthenticatedError(
        "the client certificate has no subject Common Name (--cert_tenant=cn)");
  }
  const absl::string_view prefix = options_.cert_tenant == "san"
                                       ? absl::string_view()
                                       : absl::string_view(options_.cert_tenant)
                                             .substr(sizeof(kSanPrefix) - 1);
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
      " (--cert_tenant=", options_.cert_tenant, ")"));
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
