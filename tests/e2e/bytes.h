// Raw-byte views of typed vectors, for the e2e tests that build and read
// tensor payloads by hand; one copy instead of one per test file.
#ifndef LOSSD_TESTS_E2E_BYTES_H_
#define LOSSD_TESTS_E2E_BYTES_H_

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace lossd {
namespace e2e_test {

// The bytes of `values` in host order, as the wire carries a tensor. Pure.
template <typename T>
std::string Bytes(const std::vector<T>& values) {
  return std::string(reinterpret_cast<const char*>(values.data()),
                     values.size() * sizeof(T));
}

// The whole T values held in `bytes` (a trailing partial value is dropped).
// Pure.
template <typename T>
std::vector<T> FromBytes(const std::string& bytes) {
  std::vector<T> values(bytes.size() / sizeof(T));
  std::memcpy(values.data(), bytes.data(), values.size() * sizeof(T));
  return values;
}

// `size` pseudo-random bytes from `seed` (the same bytes for the same seed).
inline std::string RandomBytes(size_t size, uint32_t seed) {
  std::mt19937 random(seed);
  std::string bytes(size, '\0');
  for (char& c : bytes) c = static_cast<char>(random() & 0xff);
  return bytes;
}

}  // namespace e2e_test
}  // namespace lossd

#endif  // LOSSD_TESTS_E2E_BYTES_H_
