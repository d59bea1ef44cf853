// Small pieces shared by the fast CPU backend and the fp64 reference, so that
// the two agree on the details that are conventions rather than math: how a
// row's argmax treats NaN and ties, and how a value is rounded once to a
// 16-bit output; and the dtype storage formats the backend and convert.cc use.
#ifndef LOSSD_KERNELS_CPU_CROSS_ENTROPY_INTERNAL_H_
#define LOSSD_KERNELS_CPU_CROSS_ENTROPY_INTERNAL_H_

#include <cmath>
#include <cstdint>

#include "common/float16.h"
#include "kernels/cross_entropy.h"

namespace lossd {
namespace cpu_internal {

// Storage formats of the floating-point dtypes, for loops templated on the
// format (the fast backend's rows, the conversions of convert.cc): Load is
// exact, Store rounds once (nearest even).
struct Float32Format {
  using Storage = float;
  static float Load(float v) { return v; }
  static float Store(float v) { return v; }
};
struct BFloat16Format {
  using Storage = uint16_t;
  static float Load(uint16_t v) { return BF16ToFloat(v); }
  static uint16_t Store(float v) { return FloatToBF16(v); }
};
struct Float16Format {
  using Storage = uint16_t;
  static float Load(uint16_t v) { return HalfToFloat(v); }
  static uint16_t Store(float v) { return FloatToHalf(v); }
};

// Running argmax with torch's conventions: the first maximum wins ties, and the
// first NaN wins over everything (the maximum of a row holding a NaN is NaN).
// Start with best = -inf, best_index = 0.
template <typename T>
inline void ArgmaxUpdate(T value, int64_t index, T* best, int64_t* best_index) {
  if (!(value <= *best) && *best == *best) {
    *best = value;
    *best_index = index;
  }
}

// Rounds a double to fp32 with round-to-odd. Rounding that result once more to
// bf16 or half (nearest even) then equals rounding the double directly,
// because fp32 keeps more than two extra bits; a plain double->float->bf16
// chain would round twice.
inline float DoubleToFloatRoundToOdd(double value) {
  float rounded = static_cast<float>(value);
  if (static_cast<double>(rounded) == value || std::isnan(value)) {
    return rounded;
  }
  uint32_t bits = FloatBits(rounded);
  if (std::fabs(static_cast<double>(rounded)) > std::fabs(value)) bits -= 1;
  return FloatFromBits(bits | 1u);
}

// Writes `value` into element `index` of a buffer of `dtype` with one rounding.
inline void StoreDouble(void* out, DType dtype, int64_t index, double value) {
  switch (dtype) {
    case DType::kFloat32:
      static_cast<float*>(out)[index] = static_cast<float>(value);
      return;
    case DType::kBFloat16:
      static_cast<uint16_t*>(out)[index] =
          FloatToBF16(DoubleToFloatRoundToOdd(value));
      return;
    default:
      static_cast<uint16_t*>(out)[index] =
          FloatToHalf(DoubleToFloatRoundToOdd(value));
      return;
  }
}

// Reads element `index` of a logits buffer of `dtype` (exact in fp32).
inline float LoadLogit(const void* logits, DType dtype, int64_t index) {
  switch (dtype) {
    case DType::kFloat32:
      return static_cast<const float*>(logits)[index];
    case DType::kBFloat16:
      return BF16ToFloat(static_cast<const uint16_t*>(logits)[index]);
    default:
      return HalfToFloat(static_cast<const uint16_t*>(logits)[index]);
  }
}

}  // namespace cpu_internal
}  // namespace lossd

#endif  // LOSSD_KERNELS_CPU_CROSS_ENTROPY_INTERNAL_H_
