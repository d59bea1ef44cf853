// Tensor byte math and the stripe split (tensor_math.h).
#include "common/tensor_math.h"

#include <optional>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/checked_math.h"

namespace lossd {

std::string ShapeString(absl::Span<const int64_t> shape) {
  std::string text = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    absl::StrAppend(&text, i ? ", " : "", shape[i]);
  }
  return text + "]";
}

namespace {

// TensorBytes, with `stored`: StoredTensorBytes (dimensions > 0; checked in
// order, each before the product grows by it).
absl::StatusOr<int64_t> Bytes(DType dtype, absl::Span<const int64_t> shape,
                              bool stored) {
  if (DTypeSize(dtype) == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("invalid dtype ", static_cast<int>(dtype)));
  }
  if (stored && (shape.empty() || shape.size() > 2)) {
    return absl::InvalidArgumentError(
        absl::StrCat("a tensor has 1 or 2 dimensions, got ", shape.size()));
  }
  int64_t bytes = static_cast<int64_t>(DTypeSize(dtype));
  for (int64_t dim : shape) {
    if (stored && dim <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("dimension ", dim, " must be > 0"));
    }
    if (dim < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("negative dimension ", dim, " in shape"));
    }
    const std::optional<int64_t> product = CheckedMul(bytes, dim);
    if (!product.has_value()) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor size ", DTypeName(dtype), " ",
                       ShapeString(shape), " overflows int64"));
    }
    bytes = *product;
  }
  return bytes;
}

}  // namespace

absl::StatusOr<int64_t> TensorBytes(DType dtype,
                                    absl::Span<const int64_t> shape) {
  return Bytes(dtype, shape, /*stored=*/false);
}

absl::StatusOr<int64_t> StoredTensorBytes(DType dtype,
                                          absl::Span<const int64_t> shape) {
  return Bytes(dtype, shape, /*stored=*/true);
}

ElementRange StripeElements(int64_t elements, int index, int count) {
  // floor(i * E / K) = i * (E / K) + floor(i * (E % K) / K): no product
  // of E with anything, so no overflow.
  const int64_t whole = elements / count;
  const int64_t rest = elements % count;
  auto boundary = [&](int64_t i) { return i * whole + (i * rest) / count; };
  return ElementRange{boundary(index), boundary(index + 1)};
}

}  // namespace lossd
