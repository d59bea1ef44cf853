// The LM head of an Evaluate over hidden states (linear_head.h).
#include "server/linear_head.h"

#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "common/tensor_math.h"
#include "server/tensor_lookup.h"

namespace lossd {

absl::StatusOr<LinearHead> LeaseLinearHead(
    TensorStore* store, const std::string& tenant,
    const lossd::v1::EvaluateHeader& header, EvaluateSpec* spec) {
  ASSIGN_OR_RETURN(
      std::shared_ptr<Tensor> weight,
      LookupField(store, tenant, "header.weight", header.weight()));
  if (!IsLogitsDType(weight->dtype()) || weight->shape().size() != 2) {
    return absl::InvalidArgumentError(absl::StrCat(
        "header.weight must be a 2-D float tensor [V, H] (float32, bfloat16 "
        "or float16), got ",
        DTypeName(weight->dtype()), " ", ShapeString(weight->shape())));
  }
  const DType dtype = weight->dtype();
  const int64_t vocab = weight->shape()[0];
  const int64_t hidden = weight->shape()[1];
  if (spec->vocab != 0 && spec->vocab != vocab) {
    return absl::InvalidArgumentError(absl::StrCat(
        "header.vocab = ", spec->vocab, " but header.weight has V = ", vocab,
        " (", ShapeString(weight->shape()), "); send 0 or ", vocab));
  }
  if (spec->logits_dtype != DType::kInvalid && spec->logits_dtype != dtype) {
    return absl::InvalidArgumentError(absl::StrCat(
        "header.logits_dtype is DTYPE_", DTypeProtoName(spec->logits_dtype),
        " but header.weight is ", DTypeName(dtype),
        "; the hidden states have the weight's dtype: send "
        "DTYPE_UNSPECIFIED or DTYPE_",
        DTypeProtoName(dtype)));
  }
  std::shared_ptr<Tensor> bias;
  if (!header.bias().empty()) {
    ASSIGN_OR_RETURN(bias,
                     LookupField(store, tenant, "header.bias", header.bias()));
    if (bias->dtype() != dtype ||
        bias->shape() != std::vector<int64_t>{vocab}) {
      return absl::InvalidArgumentError(absl::StrCat(
          "header.bias must be ", DTypeName(dtype), " [", vocab,
          "] (the weight's dtype and V), got ", DTypeName(bias->dtype()), " ",
          ShapeString(bias->shape())));
    }
  }
  // Reads fail rather than wait on an overwrite in progress (a client's
  // upload may take long), as LinearForward's.
  LinearHead head;
  ASSIGN_OR_RETURN(head.weight, store->TryBeginRead(weight));
  // Checked under the lease: an in-place Forward cannot turn it into a
  // gradient now. A gradient holds no weight any more (LinearForward refuses
  // it too).
  if (weight->state() != TensorState::kLogits) {
    return absl::InvalidArgumentError(
        absl::StrCat("header.weight ", weight->handle(), " holds a gradient"));
  }
  if (bias != nullptr) {
    ASSIGN_OR_RETURN(head.bias, store->TryBeginRead(std::move(bias)));
  }
  spec->vocab = vocab;
  spec->logits_dtype = dtype;
  spec->hidden = hidden;
  spec->row_bytes = hidden * static_cast<int64_t>(DTypeSize(dtype));
  return head;
}

}  // namespace lossd
