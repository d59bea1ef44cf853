// The linear cross-entropy's argument checks and chunk bookkeeping that both
// backends share (linear_cross_entropy_validate.h); no BLAS here, so that the
// CUDA backend (and the server) need not link it.
#include "kernels/linear_cross_entropy_validate.h"

#include <limits>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cross_entropy_validate.h"

namespace lossd {
namespace {

absl::Status Invalid(const std::string& message) {
  return absl::InvalidArgumentError(
      absl::StrCat("linear_cross_entropy: ", message));
}

bool MultiplyFits(int64_t a, int64_t b) {
  return a == 0 || b <= std::numeric_limits<int64_t>::max() / a;
}

// The sizes, dtypes and the caller's descriptions of its tensors.
absl::Status CheckShapes(const LinearCrossEntropyArgs& args) {
  if (args.rows < 0)
    return Invalid(absl::StrCat("rows must be >= 0, got ", args.rows));
  if (args.hidden < 1 || args.hidden > std::numeric_limits<int32_t>::max()) {
    // BLAS and cuBLASLt take 32-bit leading dimensions.
    return Invalid(
        absl::StrCat("hidden must be in [1, 2^31 - 1], got ", args.hidden));
  }
  if (args.vocab < 1 || args.vocab > std::numeric_limits<int32_t>::max() - 1) {
    return Invalid(
        absl::StrCat("vocab must be in [1, 2^31 - 1), got ", args.vocab));
  }
  if (!MultiplyFits(args.rows, args.hidden) ||
      !MultiplyFits(args.vocab, args.hidden) ||
      !MultiplyFits(args.vocab * args.hidden, 4)) {
    return Invalid(absl::StrCat("shape [", args.rows, ", ", args.hidden,
                                "] x [", args.vocab, ", ", args.hidden,
                                "] overflows int64"));
  }
  if (!IsLogitsDType(args.dtype)) {
    return Invalid(
        absl::StrCat("dtype must be float32, bfloat16 or float16, got ",
                     DTypeName(args.dtype)));
  }
  if (!IsTargetsDType(args.targets_dtype)) {
    return Invalid(absl::StrCat("targets_dtype must be int32 or int64, got ",
                                DTypeName(args.targets_dtype)));
  }
  if (args.weight_hidden != 0 && args.weight_hidden != args.hidden) {
    return Invalid(absl::StrCat("weight has hidden size ", args.weight_hidden,
                                " but x has ", args.hidden));
  }
  if (args.weight_dtype != DType::kInvalid && args.weight_dtype != args.dtype) {
    return Invalid(absl::StrCat("weight is ", DTypeName(args.weight_dtype),
                                " but x is ", DTypeName(args.dtype)));
  }
  if (args.bias_dtype != DType::kInvalid && args.bias_dtype != args.dtype) {
    return Invalid(absl::StrCat("bias is ", DTypeName(args.bias_dtype),
                                " but x is ", DTypeName(args.dtype)));
  }
  if ((args.grad_weight_rows != 0 && args.grad_weight_rows != args.vocab) ||
      (args.grad_weight_cols != 0 && args.grad_weight_cols != args.hidden)) {
    return Invalid(absl::StrCat("grad_weight is [", args.grad_weight_rows, ", ",
                                args.grad_weight_cols, "], the weight [",
                                args.vocab, ", ", args.hidden, "]"));
  }
  if (args.grad_bias_size != 0 && args.grad_bias_size != args.vocab) {
    return Invalid(absl::StrCat("grad_bias has ", args.grad_bias_size,
                                " elements, vocab is ", args.vocab));
  }
  return absl::OkStatus();
}

// The inputs' pointers and dX's, as its mode wants them.
absl::Status CheckInputsAndDx(const LinearCrossEntropyArgs& args) {
  if (args.weight == nullptr) return Invalid("weight is nullptr");
  if (args.rows > 0 && (args.x == nullptr || args.targets == nullptr)) {
    return Invalid("x and targets must not be nullptr when rows > 0");
  }
  switch (args.dx_mode) {
    case GradientMode::kInPlace:
      if (args.dx != args.x) return Invalid("in-place dx must equal x");
      break;
    case GradientMode::kOutOfPlace: {
      if (args.rows > 0 && args.dx == nullptr)
        return Invalid("out-of-place dx is nullptr");
      const int64_t bytes =
          args.rows * args.hidden * static_cast<int64_t>(DTypeSize(args.dtype));
      const char* x = static_cast<const char*>(args.x);
      const char* dx = static_cast<const char*>(args.dx);
      if (args.rows > 0 && dx < x + bytes && x < dx + bytes)
        return Invalid("out-of-place dx overlaps x");
      break;
    }
    case GradientMode::kNone:
      if (args.dx != nullptr)
        return Invalid("dx must be nullptr with mode none");
      break;
    default:
      return Invalid(
          absl::StrCat("dx_mode must be in-place, out-of-place or none, got ",
                       static_cast<int>(args.dx_mode)));
  }
  return absl::OkStatus();
}

// dW and dbias as the accumulate mode wants them, and the per-row
// grad_output that a per-row loss with a gradient needs.
absl::Status CheckWeightGradient(const LinearCrossEntropyArgs& args) {
  switch (args.accumulate) {
    case AccumulateMode::kNone:
      if (args.grad_weight != nullptr || args.grad_bias != nullptr) {
        return Invalid(
            "grad_weight and grad_bias must be nullptr with accumulate none");
      }
      break;
    case AccumulateMode::kAdd:
    case AccumulateMode::kOverwrite:
      if (args.grad_weight == nullptr)
        return Invalid("grad_weight is nullptr but a weight gradient is asked");
      break;
    default:
      return Invalid(
          absl::StrCat("accumulate must be none, add or overwrite, got ",
                       static_cast<int>(args.accumulate)));
  }
  if (args.grad_bias != nullptr && args.bias == nullptr)
    return Invalid("grad_bias given but there is no bias");
  const bool none = args.options.reduction == Reduction::kNone;
  if (none && LinearCrossEntropyWantsGradient(args) && args.rows > 0 &&
      args.token_grad_output == nullptr) {
    return Invalid(
        "reduction none with a gradient needs token_grad_output (the per-row "
        "grad_output, since dW is formed now)");
  }
  if ((!none || !LinearCrossEntropyWantsGradient(args)) &&
      args.token_grad_output != nullptr) {
    return Invalid(
        "token_grad_output is only for reduction none with a gradient");
  }
  return absl::OkStatus();
}

// The loss options, targets and class weights.
absl::Status CheckLossInputs(const LinearCrossEntropyArgs& args) {
  // The options, checked by the cross-entropy's own validation on an
  // equivalent logits problem (no memory is read).
  CrossEntropyArgs ce;
  ce.rows = args.rows;
  ce.vocab = args.vocab;
  ce.row_stride = args.vocab;
  ce.logits_dtype = DType::kFloat32;
  ce.logits = args.weight;
  ce.targets_dtype = args.targets_dtype;
  ce.targets = args.targets;
  ce.class_weights = args.class_weights;
  ce.options = args.options;
  ce.mode = GradientMode::kNone;
  if (!MultiplyFits(args.rows, args.vocab)) {
    return Invalid(absl::StrCat("rows (", args.rows, ") * vocab (", args.vocab,
                                ") overflows int64"));
  }
  absl::Status status = ValidateCrossEntropyArgs(ce);
  if (!status.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("linear_cross_entropy: ", status.message()));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateLinearCrossEntropyArgs(
    const LinearCrossEntropyArgs& args) {
  RETURN_IF_ERROR(CheckShapes(args));
  RETURN_IF_ERROR(CheckInputsAndDx(args));
  RETURN_IF_ERROR(CheckWeightGradient(args));
  return CheckLossInputs(args);
}

CrossEntropyOptions LinearChunkOptions(const CrossEntropyOptions& options,
                                       double target_weight_sum) {
  CrossEntropyOptions chunk = options;
  if (options.reduction == Reduction::kMean && options.normalizer <= 0.0 &&
      target_weight_sum > 0.0) {
    chunk.normalizer = target_weight_sum;
  }
  return chunk;
}

void AddChunkResult(const CrossEntropyResult& chunk,
                    CrossEntropyResult* total) {
  total->loss += chunk.loss;
  total->z_loss += chunk.z_loss;
  total->valid_tokens += chunk.valid_tokens;
  total->correct_tokens += chunk.correct_tokens;
  total->nonfinite_rows += chunk.nonfinite_rows;
  if (chunk.denominator != 0.0) total->denominator = chunk.denominator;
}

}  // namespace lossd
