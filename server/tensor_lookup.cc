// LookupField and LeaseClassWeights (tensor_lookup.h).
#include "server/tensor_lookup.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "common/tensor_math.h"

namespace lossd {

absl::StatusOr<std::shared_ptr<Tensor>> LookupField(TensorStore* store,
                                                    const std::string& tenant,
                                                    absl::string_view field,
                                                    const std::string& handle) {
  absl::StatusOr<std::shared_ptr<Tensor>> tensor = store->Get(tenant, handle);
  if (!tensor.ok()) {
    return absl::Status(tensor.status().code(),
                        absl::StrCat(field, ": ", tensor.status().message()));
  }
  return tensor;
}

absl::StatusOr<ReadLease> LeaseClassWeights(TensorStore* store,
                                            const std::string& tenant,
                                            const std::string& handle,
                                            int64_t vocab) {
  ASSIGN_OR_RETURN(std::shared_ptr<Tensor> weights, store->Get(tenant, handle));
  if (weights->dtype() != DType::kFloat32 || weights->shape().size() != 1 ||
      weights->shape()[0] != vocab) {
    return absl::InvalidArgumentError(absl::StrCat(
        "class_weights must be float32 [", vocab, "], got ",
        DTypeName(weights->dtype()), " ", ShapeString(weights->shape())));
  }
  if (weights->state() != TensorState::kLogits) {
    return absl::InvalidArgumentError("class_weights holds a gradient");
  }
  return store->BeginRead(std::move(weights));
}

}  // namespace lossd
