// Element access of the three logits dtypes: 16-byte vectors unpacked to
// fp32 and packed back with one rounding, scalar loads and stores, targets.

#ifndef LOSSD_KERNELS_CUDA_ELEMENT_TRAITS_CUH_
#define LOSSD_KERNELS_CUDA_ELEMENT_TRAITS_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <cstdint>

#include "kernels/cuda/launch_params.h"

namespace lossd {
namespace cuda_ce {

template <typename T>
struct Traits;
template <>
struct Traits<float> {
  static constexpr int kVec = 4;
  // |dz_c| / |b w_c| below which label smoothing's cancellation takes the
  // exact form (row_math.cuh OtherGrad). Halves: above it the fast form's
  // ~1e-6 relative error of p_c A stays under 1/32 ulp of the rounded result.
  // fp32: past a 4x cancellation the exact form is the more accurate one.
  static constexpr float kCancelCut = 0.25f;
  __device__ static float Get(const uint4& v, int j) {
    const unsigned r[4] = {v.x, v.y, v.z, v.w};
    return __uint_as_float(r[j]);
  }
  __device__ static void Pack(const float* g, uint4* out) {
    *out = make_uint4(__float_as_uint(g[0]), __float_as_uint(g[1]),
                      __float_as_uint(g[2]), __float_as_uint(g[3]));
  }
  __device__ static float Load(const float* p) { return *p; }
  __device__ static void Store(float* p, float g) { *p = g; }
};
template <>
struct Traits<__nv_bfloat16> {
  static constexpr int kVec = 8;
  static constexpr float kCancelCut = 1.0f / 64;
  __device__ static float Get(const uint4& v, int j) {
    const unsigned r[4] = {v.x, v.y, v.z, v.w};
    const unsigned w = r[j / 2];
    // Opaque (volatile asm): otherwise the compiler keeps all unpacked floats
    // alive from one pass over the registers to the next and spills.
    unsigned f;
    if (j % 2 == 0) {
      asm volatile("shl.b32 %0, %1, 16;" : "=r"(f) : "r"(w));
    } else {
      asm volatile("and.b32 %0, %1, 0xffff0000;" : "=r"(f) : "r"(w));
    }
    return __uint_as_float(f);
  }
  __device__ static void Pack(const float* g, uint4* out) {
    unsigned r[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      __nv_bfloat162 h = __floats2bfloat162_rn(g[2 * i], g[2 * i + 1]);
      r[i] = *reinterpret_cast<unsigned*>(&h);
    }
    *out = make_uint4(r[0], r[1], r[2], r[3]);
  }
  __device__ static float Load(const __nv_bfloat16* p) {
    return __bfloat162float(*p);
  }
  __device__ static void Store(__nv_bfloat16* p, float g) {
    *p = __float2bfloat16_rn(g);
  }
};
template <>
struct Traits<__half> {
  static constexpr int kVec = 8;
  static constexpr float kCancelCut = 0.25f;
  __device__ static float Get(const uint4& v, int j) {
    const unsigned r[4] = {v.x, v.y, v.z, v.w};
    const unsigned w = r[j / 2];
    unsigned short b;
    if (j % 2 == 0) {
      asm volatile("cvt.u16.u32 %0, %1;" : "=h"(b) : "r"(w));
    } else {
      asm volatile("{ .reg .b32 t; shr.b32 t, %1, 16; cvt.u16.u32 %0, t; }"
                   : "=h"(b)
                   : "r"(w));
    }
    return __half2float(__ushort_as_half(b));
  }
  __device__ static void Pack(const float* g, uint4* out) {
    unsigned r[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      __half2 h = __floats2half2_rn(g[2 * i], g[2 * i + 1]);
      r[i] = *reinterpret_cast<unsigned*>(&h);
    }
    *out = make_uint4(r[0], r[1], r[2], r[3]);
  }
  __device__ static float Load(const __half* p) { return __half2float(*p); }
  __device__ static void Store(__half* p, float g) { *p = __float2half_rn(g); }
};

__device__ __forceinline__ long long LoadTarget(const Params& p,
                                                long long row) {
  return p.targets64 ? static_cast<const long long*>(p.targets)[row]
                     : static_cast<const int*>(p.targets)[row];
}

// The kVec elements of T from column e, those at or past `end` as -inf
// (never the max, exp() = 0): one 16-byte load where all lie before `end`,
// evict-first (__ldcs) for kLastUse, the read the gradient replaces.
template <typename T, bool kLastUse>
__device__ __forceinline__ uint4 LoadVectorPadded(const T* in, int e, int end) {
  using Tr = Traits<T>;
  if (e + Tr::kVec <= end) {
    const uint4* ptr = reinterpret_cast<const uint4*>(in + e);
    return kLastUse ? __ldcs(ptr) : *ptr;
  }
  float f[Tr::kVec];
#pragma unroll
  for (int j = 0; j < Tr::kVec; ++j) {
    f[j] = e + j < end ? Tr::Load(in + e + j) : -INFINITY;
  }
  uint4 v;
  Tr::Pack(f, &v);
  return v;
}

// Gradient values g of the kVec elements of T from column e, those before
// `end`: one streaming 16-byte store where all of them lie before it.
template <typename T>
__device__ __forceinline__ void StoreVector(T* out, int e, int end,
                                            const float (&g)[Traits<T>::kVec]) {
  using Tr = Traits<T>;
  if (e + Tr::kVec <= end) {
    uint4 v;
    Tr::Pack(g, &v);
    __stcs(reinterpret_cast<uint4*>(out + e), v);
  } else {
#pragma unroll
    for (int j = 0; j < Tr::kVec; ++j)
      if (e + j < end) Tr::Store(out + e + j, g[j]);
  }
}

// Zeros for the same (an ignored row's gradient).
template <typename T>
__device__ __forceinline__ void StoreZeroVector(T* out, int e, int end) {
  const float zero[Traits<T>::kVec] = {};
  StoreVector(out, e, end, zero);
}

}  // namespace cuda_ce
}  // namespace lossd

#endif  // LOSSD_KERNELS_CUDA_ELEMENT_TRAITS_CUH_
