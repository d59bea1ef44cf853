// Test certificates made at run time with the openssl CLI: a CA, a server
// certificate for localhost / 127.0.0.1, client certificates of tenants
// "alpha" and "beta", and a client certificate from an untrusted CA.
#ifndef LOSSD_TESTS_E2E_TEST_PKI_H_
#define LOSSD_TESTS_E2E_TEST_PKI_H_

#include <string>

namespace lossd {

// Files in a scratch directory: ca.pem, server.{pem,key}, server2.{pem,key}
// (CN=localhost from rogue-ca.pem, valid 5 days), alpha.{pem,key}
// and beta.{pem,key} (CN = tenant, SANs URI:spiffe://lossd.test/tenant/NAME
// and DNS:NAME.clients.test), rogue.{pem,key} (CN=alpha, from rogue-ca.pem).
// Made once per process; removed by a global test environment at the end.
// Not thread-safe.
class Pki {
 public:
  static Pki* Get();
  bool ok() const { return ok_; }
  // Why making the certificates failed (openssl's output).
  const std::string& error() const { return error_; }
  std::string Path(const std::string& name) const;
  // The contents of Path(name); empty when unreadable.
  std::string Read(const std::string& name) const;
  void Remove();

 private:
  Pki();

  std::string dir_;
  bool ok_ = false;
  std::string error_;
};

}  // namespace lossd

#endif  // LOSSD_TESTS_E2E_TEST_PKI_H_
