// Tensor byte math and the stripe split, as the API defines them (lossd.v1
// TensorHeader, UploadStripe, data connections): written once, so that client
// and server count the same bytes.
#ifndef LOSSD_COMMON_TENSOR_MATH_H_
#define LOSSD_COMMON_TENSOR_MATH_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/dtype.h"

namespace lossd {

// "[4, 5]". Thread-safe.
std::string ShapeString(absl::Span<const int64_t> shape);

// Bytes of a tensor of `dtype` and `shape` (any rank; a dimension may be 0):
// DTypeSize(dtype) times the product of the dimensions. INVALID_ARGUMENT: an
// invalid dtype, a negative dimension, or a size that overflows int64.
// Thread-safe.
absl::StatusOr<int64_t> TensorBytes(DType dtype,
                                    absl::Span<const int64_t> shape);

// Bytes of a tensor lossd can store: 1 or 2 dimensions, each > 0.
// INVALID_ARGUMENT: an invalid dtype, not 1 or 2 dimensions, a dimension <= 0,
// or a size that overflows int64. Thread-safe.
absl::StatusOr<int64_t> StoredTensorBytes(DType dtype,
                                          absl::Span<const int64_t> shape);

// Elements [first, end) of a tensor.
struct ElementRange {
  int64_t first = 0;
  int64_t end = 0;
};

// The elements stripe `index` of `count` carries of a tensor of `elements`
// elements (a striped upload's stripe, a data connection's part):
// [floor(index * elements / count), floor((index + 1) * elements / count)),
// computed without overflow for any elements >= 0. Requires
// 0 <= index < count <= 64 (lossd.v1's limit on stripes and connections).
// Pure; thread-safe.
ElementRange StripeElements(int64_t elements, int index, int count);

}  // namespace lossd

#endif  // LOSSD_COMMON_TENSOR_MATH_H_
