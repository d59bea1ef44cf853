// An Evaluate's checked header (EvaluateSpec) and the check of its row
// blocks' sizes: what the evaluation engine (evaluation.h) needs of request
// validation, without protobuf (validation.h makes the spec from a header).
#ifndef LOSSD_SERVER_EVALUATE_SPEC_H_
#define LOSSD_SERVER_EVALUATE_SPEC_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "common/dtype.h"
#include "common/loss_options.h"

namespace lossd {

// An Evaluate header, checked.
struct EvaluateSpec {
  CrossEntropyOptions options;
  int64_t vocab = 0;
  DType logits_dtype = DType::kInvalid;
  DType targets_dtype = DType::kInvalid;
  // False when the header's targets_dtype is UNSPECIFIED (a distillation
  // with alpha 0 only): no block or frame carries targets, and
  // targets_dtype is then int32 for the kernels' checks.
  bool has_targets = true;
  // The bytes of a row: vocab * the size of logits_dtype, or with a weight
  // hidden * that size.
  int64_t row_bytes = 0;
  // H of an evaluation over hidden states (header.weight set), once the
  // weight is known; 0 for logits.
  int64_t hidden = 0;
};

// Rows in one Evaluate block from the byte sizes of its logits and targets
// (the Evaluate reactor finds them in the raw message without parsing it;
// `index` counts blocks, for the message). INVALID_ARGUMENT: logits that are
// not whole rows, or a target count that is not the row count. Defined in
// validation.cc. Thread-safe.
absl::StatusOr<int64_t> ValidateRowBlockSizes(const EvaluateSpec& spec,
                                              int64_t logits_bytes,
                                              int64_t targets_bytes,
                                              int64_t index);

}  // namespace lossd

#endif  // LOSSD_SERVER_EVALUATE_SPEC_H_
