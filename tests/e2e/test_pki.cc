// Pki: openssl req / x509 run through sh in a mkdtemp directory.
#include "tests/e2e/test_pki.h"

#include <stdlib.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace lossd {
namespace {

class RemovePki : public ::testing::Environment {
 public:
  void TearDown() override { Pki::Get()->Remove(); }
};

}  // namespace

Pki* Pki::Get() {
  static Pki* const pki = [] {
    ::testing::AddGlobalTestEnvironment(new RemovePki());
    return new Pki();
  }();
  return pki;
}

std::string Pki::Path(const std::string& name) const {
  return absl::StrCat(dir_, "/", name);
}

std::string Pki::Read(const std::string& name) const {
  std::ifstream in(Path(name));
  return std::string(std::istreambuf_iterator<char>(in),
                     std::istreambuf_iterator<char>());
}

void Pki::Remove() {
  if (!dir_.empty()) std::filesystem::remove_all(dir_);
}

Pki::Pki() {
  char pattern[] = "/tmp/lossd-auth-test-XXXXXX";
  if (mkdtemp(pattern) == nullptr) {
    error_ = "mkdtemp failed";
    return;
  }
  dir_ = pattern;
  const std::string key = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1";
  // Each client: CN = tenant, and a URI SAN spiffe://lossd.test/tenant/NAME.
  std::string script = absl::StrCat(
      "set -e; cd ", dir_, "\n", "openssl req -x509 ", key,
      " -nodes -keyout ca.key -out ca.pem -days 2 -subj /CN=lossd-test-ca\n",
      "openssl req -x509 ", key,
      " -nodes -keyout rogue-ca.key -out rogue-ca.pem -days 2 "
      "-subj /CN=rogue-ca\n",
      "printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\\n' > server.ext\n",
      "openssl req ", key,
      " -nodes -keyout server.key -out server.csr -subj /CN=localhost\n",
      "openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key "
      "-CAcreateserial -days 2 -extfile server.ext -out server.pem\n",
      // The certificate a rotation brings: another key, another CA, a later
      // notAfter.
      "openssl req ", key,
      " -nodes -keyout server2.key -out server2.csr -subj /CN=localhost\n",
      "openssl x509 -req -in server2.csr -CA rogue-ca.pem -CAkey rogue-ca.key "
      "-CAcreateserial -days 5 -extfile server.ext -out server2.pem\n");
  for (const char* tenant : {"alpha", "beta"}) {
    absl::StrAppend(
        &script, "printf 'subjectAltName=URI:spiffe://lossd.test/tenant/",
        tenant, ",DNS:", tenant, ".clients.test\\n' > ", tenant, ".ext\n",
        "openssl req ", key, " -nodes -keyout ", tenant, ".key -out ", tenant,
        ".csr -subj /CN=", tenant, "\n", "openssl x509 -req -in ", tenant,
        ".csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 2 -extfile ",
        tenant, ".ext -out ", tenant, ".pem\n");
  }
  absl::StrAppend(&script, "openssl req ", key,
                  " -nodes -keyout rogue.key -out rogue.csr -subj /CN=alpha\n"
                  "openssl x509 -req -in rogue.csr -CA rogue-ca.pem -CAkey "
                  "rogue-ca.key -CAcreateserial -days 2 -out rogue.pem\n");
  std::ofstream(Path("make.sh")) << script;
  const std::string command =
      absl::StrCat("sh ", Path("make.sh"), " > ", Path("make.log"), " 2>&1");
  if (std::system(command.c_str()) != 0) {
    std::ifstream log(Path("make.log"));
    error_ = absl::StrCat("openssl failed: ",
                          std::string(std::istreambuf_iterator<char>(log),
                                      std::istreambuf_iterator<char>()));
    return;
  }
  ok_ = true;
}

}  // namespace lossd
