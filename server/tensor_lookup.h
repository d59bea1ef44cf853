// The lookups a request's tensor fields share: a field's name on its lookup
// error, and the class weights checked and leased for one computation.
#ifndef LOSSD_SERVER_TENSOR_LOOKUP_H_
#define LOSSD_SERVER_TENSOR_LOOKUP_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/tensor_store.h"

namespace lossd {

// The tensor `handle` of `tenant`; a lookup error (NOT_FOUND, or
// INVALID_ARGUMENT for a malformed handle) is prefixed with `field`, the
// request's name for it ("weight: unknown handle ...").
absl::StatusOr<std::shared_ptr<Tensor>> LookupField(TensorStore* store,
                                                    const std::string& tenant,
                                                    absl::string_view field,
                                                    const std::string& handle);

// A stored fp32 [vocab] class-weights tensor, leased for one computation.
absl::StatusOr<ReadLease> LeaseClassWeights(TensorStore* store,
                                            const std::string& tenant,
                                            const std::string& handle,
                                            int64_t vocab);

}  // namespace lossd

#endif  // LOSSD_SERVER_TENSOR_LOOKUP_H_
