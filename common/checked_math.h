// Sums and products of int64 values a client chose (offsets, lengths, counts,
// sizes), checked: signed overflow is undefined behaviour, and a wrapped value
// in a range check or an error message lies about what was asked. Every such
// computation in the server and common/ goes through these.
#ifndef LOSSD_COMMON_CHECKED_MATH_H_
#define LOSSD_COMMON_CHECKED_MATH_H_

#include <cstdint>
#include <optional>

namespace lossd {

// a + b, or nullopt when int64 cannot hold it. Pure; thread-safe.
inline std::optional<int64_t> CheckedAdd(int64_t a, int64_t b) {
  int64_t sum = 0;
  if (__builtin_add_overflow(a, b, &sum)) return std::nullopt;
  return sum;
}

// a * b, or nullopt when int64 cannot hold it. Pure; thread-safe.
inline std::optional<int64_t> CheckedMul(int64_t a, int64_t b) {
  int64_t product = 0;
  if (__builtin_mul_overflow(a, b, &product)) return std::nullopt;
  return product;
}

}  // namespace lossd

#endif  // LOSSD_COMMON_CHECKED_MATH_H_
