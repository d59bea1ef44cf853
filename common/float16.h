// Bit-exact conversions between fp32 and the two 16-bit float formats lossd
// stores (bfloat16, IEEE half). Host-only and header-only so every CPU-side
// module (the CPU kernels, the server, the client) can use them without a
// dependency on CUDA's headers.
#ifndef LOSSD_COMMON_FLOAT16_H_
#define LOSSD_COMMON_FLOAT16_H_

#include <cstdint>
#include <cstring>

namespace lossd {

inline uint32_t FloatBits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

inline float FloatFromBits(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

// Exact: every bfloat16 is an fp32 with the low 16 bits zero.
inline float BF16ToFloat(uint16_t bits) {
  return FloatFromBits(static_cast<uint32_t>(bits) << 16);
}

// Round to nearest even; overflow gives inf; a NaN stays a NaN (sign and the
// top payload bits kept, quiet bit set so a payload living only in the dropped
// bits cannot turn it into an inf).
inline uint16_t FloatToBF16(float value) {
  uint32_t bits = FloatBits(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) {
    return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  }
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// Exact: every half (subnormals included) is representable in fp32.
inline float HalfToFloat(uint16_t half) {
  const uint32_t sign = static_cast<uint32_t>(half & 0x8000u) << 16;
  const uint32_t exponent = (half >> 10) & 0x1fu;
  const uint32_t mantissa = half & 0x3ffu;
  if (exponent == 0x1f) {
    return FloatFromBits(sign | 0x7f800000u | (mantissa << 13));
  }
  if (exponent == 0) {
    // Subnormal or zero: mantissa * 2^-24 is exact in fp32.
    const float magnitude = static_cast<float>(mantissa) * 0x1p-24f;
    return FloatFromBits(sign | FloatBits(magnitude));
  }
  return FloatFromBits(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

// IEEE half, round to nearest even, with subnormals; |value| >= 65520 gives
// inf; a NaN stays a quiet NaN with its sign and top payload bits.
inline uint16_t FloatToHalf(float value) {
  uint32_t bits = FloatBits(value);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  bits &= 0x7fffffffu;
  if (bits >= 0x7f800000u) {
    if (bits > 0x7f800000u) {
      return sign | 0x7e00u | static_cast<uint16_t>((bits >> 13) & 0x3ffu);
    }
    return sign | 0x7c00u;
  }
  if (bits >= 0x477ff000u) return sign | 0x7c00u;  // rounds past 65504
  if (bits < 0x38800000u) {
    // Below 2^-14 the half is subnormal: adding 0.5f aligns the value so that
    // the fp32 adder itself rounds (to nearest even) at the half's last
    // subnormal bit, which is 2^-24.
    const float aligned = FloatFromBits(bits) + 0.5f;
    return sign | static_cast<uint16_t>(FloatBits(aligned) - FloatBits(0.5f));
  }
  const uint32_t odd = (bits >> 13) & 1u;
  bits += (static_cast<uint32_t>(15 - 127) << 23) + 0xfffu + odd;
  return sign | static_cast<uint16_t>(bits >> 13);
}

}  // namespace lossd

#endif  // LOSSD_COMMON_FLOAT16_H_
