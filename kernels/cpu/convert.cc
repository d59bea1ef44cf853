// ConvertAndScale: one loop per (source, destination) type pair, so that the
// common cases compile to straight-line conversions without a per-element
// switch.
#include "kernels/cpu/convert.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/cross_entropy_internal.h"

namespace lossd {
namespace {

using cpu_internal::BFloat16Format;
using cpu_internal::Float16Format;
using cpu_internal::Float32Format;

// Reads each element before its slot in dst is written, so src == dst (same
// dtype) is safe.
template <typename Src, typename Dst>
void ConvertFloats(const void* src, void* dst, int64_t first, int64_t count,
                   int64_t row_length, float scale, const float* row_scale) {
  const auto* in = static_cast<const typename Src::Storage*>(src);
  auto* out = static_cast<typename Dst::Storage*>(dst);
  if (row_scale == nullptr) {
    for (int64_t i = 0; i < count; ++i) {
      out[i] = Dst::Store(Src::Load(in[i]) * scale);
    }
    return;
  }
  int64_t i = 0;
  while (i < count) {
    const int64_t row = (first + i) / row_length;
    const int64_t row_end = (row + 1) * row_length - first;
    const int64_t end = row_end < count ? row_end : count;
    const float factor = scale * row_scale[row];
    for (; i < end; ++i) out[i] = Dst::Store(Src::Load(in[i]) * factor);
  }
}

template <typename Src>
void ConvertFrom(const void* src, void* dst, DType dst_dtype, int64_t first,
                 int64_t count, int64_t row_length, float scale,
                 const float* row_scale) {
  switch (dst_dtype) {
    case DType::kFloat32:
      ConvertFloats<Src, Float32Format>(src, dst, first, count, row_length,
                                        scale, row_scale);
      return;
    case DType::kBFloat16:
      ConvertFloats<Src, BFloat16Format>(src, dst, first, count, row_length,
                                         scale, row_scale);
      return;
    default:
      ConvertFloats<Src, Float16Format>(src, dst, first, count, row_length,
                                        scale, row_scale);
      return;
  }
}

bool KnownDType(DType dtype) { return DTypeSize(dtype) != 0; }

}  // namespace

absl::Status ConvertAndScale(const void* src, DType src_dtype, void* dst,
                             DType dst_dtype, int64_t first, int64_t count,
                             int64_t row_length, float scale,
                             const float* row_scale) {
  if (!KnownDType(src_dtype) || !KnownDType(dst_dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat("ConvertAndScale: unknown dtype (src_dtype ",
                     static_cast<int>(src_dtype), ", dst_dtype ",
                     static_cast<int>(dst_dtype), ")"));
  }
  if (first < 0 || count < 0) {
    return absl::InvalidArgumentError(absl::StrCat("ConvertAndScale: first (",
                                                   first, ") and count (",
                                                   count, ") must be >= 0"));
  }
  if (row_scale != nullptr && row_length < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("ConvertAndScale: row_length must be >= 1 with a "
                     "row_scale, got ",
                     row_length));
  }
  const bool src_float = IsLogitsDType(src_dtype);
  const bool dst_float = IsLogitsDType(dst_dtype);
  if (!src_float || !dst_float) {
    if (src_dtype != dst_dtype || scale != 1.0f || row_scale != nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "ConvertAndScale: integer tensors only convert to their own dtype "
          "with scale 1 and no row_scale (src_dtype ",
          static_cast<int>(src_dtype), ", dst_dtype ",
          static_cast<int>(dst_dtype), ", scale ", scale, ")"));
    }
  }
  if (count == 0) return absl::OkStatus();
  if (src == nullptr || dst == nullptr) {
    return absl::InvalidArgumentError(
        "ConvertAndScale: src and dst must not be nullptr when count > 0");
  }
  const auto src_begin = reinterpret_cast<uintptr_t>(src);
  const auto dst_begin = reinterpret_cast<uintptr_t>(dst);
  const uintptr_t src_end =
      src_begin + static_cast<uintptr_t>(count) * DTypeSize(src_dtype);
  const uintptr_t dst_end =
      dst_begin + static_cast<uintptr_t>(count) * DTypeSize(dst_dtype);
  const bool overlap = src_begin < dst_end && dst_begin < src_end;
  if (overlap && !(src == dst && src_dtype == dst_dtype)) {
    return absl::InvalidArgumentError(
        "ConvertAndScale: src and dst overlap; only the exact in-place case "
        "(same pointer, same dtype) is supported");
  }

  if (src_dtype == dst_dtype && scale == 1.0f && row_scale == nullptr) {
    if (src != dst) {
      std::memcpy(dst, src, static_cast<size_t>(count) * DTypeSize(src_dtype));
    }
    return absl::OkStatus();
  }
  switch (src_dtype) {
    case DType::kFloat32:
      ConvertFrom<Float32Format>(src, dst, dst_dtype, first, count, row_length,
                                 scale, row_scale);
      break;
    case DType::kBFloat16:
      ConvertFrom<BFloat16Format>(src, dst, dst_dtype, first, count, row_length,
                                  scale, row_scale);
      break;
    default:
      ConvertFrom<Float16Format>(src, dst, dst_dtype, first, count, row_length,
                                 scale, row_scale);
      break;
  }
  return absl::OkStatus();
}

}  // namespace lossd
