// The resident LM head of an Evaluate over hidden states: the stored weight
// W [V, H] (and bias [V]) named by the header, checked, and read for the
// RPC's whole life so that its blocks meet the same tensor throughout.
#ifndef LOSSD_SERVER_LINEAR_HEAD_H_
#define LOSSD_SERVER_LINEAR_HEAD_H_

#include <string>

#include "absl/status/statusor.h"
#include "lossd/v1/lossd.pb.h"
#include "server/tensor_store.h"
#include "server/validation.h"

namespace lossd {

// The weight and bias, read-leased: an overwrite of either fails while the
// leases live, a Release succeeds and frees the memory once they go.
struct LinearHead {
  ReadLease weight;
  ReadLease bias;  // no tensor when there is no bias
};

// Looks up header.weight (and header.bias) of `tenant`, checks them and the
// header against each other, leases them and completes `spec` (checked by
// ValidateEvaluateHeader, with the weight set): vocab, logits_dtype, hidden
// and row_bytes become the weight's V, dtype, H and H times the dtype's size.
//   NOT_FOUND           weight or bias unknown, released or foreign.
//   INVALID_ARGUMENT    weight not a 2-D float tensor, or holding a
//                       gradient; bias not [V] of the weight's dtype;
//                       header.vocab neither 0 nor V; header.logits_dtype
//                       neither UNSPECIFIED nor the weight's dtype.
//   FAILED_PRECONDITION weight or bias being written (an overwrite).
// Every message names the header's field. On error nothing is held.
// Thread-safe.
absl::StatusOr<LinearHead> LeaseLinearHead(
    TensorStore* store, const std::string& tenant,
    const lossd::v1::EvaluateHeader& header, EvaluateSpec* spec);

}  // namespace lossd

#endif  // LOSSD_SERVER_LINEAR_HEAD_H_
