// ValidateCrossEntropyArgs and CheckTargets: the checks every backend runs
// before it touches memory, in a library of their own so that the CUDA backend
// does not link the CPU one for them.
#include "kernels/cross_entropy_validate.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include "absl/strings/str_cat.h"

namespace lossd {
namespace {

absl::Status Invalid(const std::string& message) {
  return absl::InvalidArgumentError(absl::StrCat("cross_entropy: ", message));
}

bool IsFiniteNonNegative(double value) {
  return std::isfinite(value) && value >= 0.0;
}

// Bytes from the first logit to one past the last of a [rows, vocab] tensor
// with `row_stride`; callers have checked that this fits in int64.
int64_t SpanBytes(const CrossEntropyArgs& args) {
  return ((args.rows - 1) * args.row_stride + args.vocab) *
         static_cast<int64_t>(DTypeSize(args.logits_dtype));
}

}  // namespace

absl::Status ValidateCrossEntropyArgs(const CrossEntropyArgs& args) {
  if (args.rows < 0)
    return Invalid(absl::StrCat("rows must be >= 0, got ", args.rows));
  if (args.vocab < 1) {
    return Invalid(absl::StrCat("vocab must be >= 1, got ", args.vocab));
  }
  if (args.vocab > std::numeric_limits<int32_t>::max()) {
    return Invalid(absl::StrCat(
        "vocab must fit in int32 (argmax is int32), got ", args.vocab));
  }
  if (args.row_stride < args.vocab) {
    return Invalid(absl::StrCat("row_stride (", args.row_stride,
                                ") must be >= vocab (", args.vocab, ")"));
  }
  if (!IsLogitsDType(args.logits_dtype)) {
    return Invalid(
        absl::StrCat("logits_dtype must be float32, bfloat16 or float16, got ",
                     static_cast<int>(args.logits_dtype)));
  }
  if (!IsTargetsDType(args.targets_dtype)) {
    return Invalid(absl::StrCat("targets_dtype must be int32 or int64, got ",
                                static_cast<int>(args.targets_dtype)));
  }
  const int64_t element_size =
      static_cast<int64_t>(DTypeSize(args.logits_dtype));
  if (args.rows > 0 && args.row_stride > std::numeric_limits<int64_t>::max() /
                                             element_size / args.rows) {
    return Invalid(absl::StrCat("rows (", args.rows, ") * row_stride (",
                                args.row_stride, ") overflows"));
  }
  const CrossEntropyOptions& options = args.options;
  if (options.reduction != Reduction::kMean &&
      options.reduction != Reduction::kSum &&
      options.reduction != Reduction::kNone) {
    return Invalid(absl::StrCat("reduction must be mean, sum or none, got ",
                                static_cast<int>(options.reduction)));
  }
  if (!(options.label_smoothing >= 0.0f && options.label_smoothing <= 1.0f)) {
    return Invalid(absl::StrCat("label_smoothing must be in [0, 1], got ",
                                options.label_smoothing));
  }
  if (!IsFiniteNonNegative(options.z_loss_scale)) {
    return Invalid(absl::StrCat("z_loss_scale must be finite and >= 0, got ",
                                options.z_loss_scale));
  }
  if (!IsFiniteNonNegative(options.softcap)) {
    return Invalid(
        absl::StrCat("softcap must be finite and >= 0, got ", options.softcap));
  }
  if (!IsFiniteNonNegative(options.normalizer)) {
    return Invalid(absl::StrCat("normalizer must be finite and >= 0, got ",
                                options.normalizer));
  }
  if (!std::isfinite(options.grad_scale)) {
    return Invalid(
        absl::StrCat("grad_scale must be finite, got ", options.grad_scale));
  }
  if (args.rows > 0 && args.logits == nullptr) {
    return Invalid("logits is nullptr");
  }
  if (args.rows > 0 && args.targets == nullptr) {
    return Invalid("targets is nullptr");
  }
  switch (args.mode) {
    case GradientMode::kInPlace:
      if (args.gradient != args.logits) {
        return Invalid("mode in-place needs gradient == logits");
      }
      break;
    case GradientMode::kOutOfPlace:
      if (args.rows > 0) {
        if (args.gradient == nullptr) {
          return Invalid(
              "mode out-of-place needs a gradient buffer, got nullptr");
        }
        const auto logits_begin = reinterpret_cast<uintptr_t>(args.logits);
        const auto gradient_begin = reinterpret_cast<uintptr_t>(args.gradient);
        const auto span = static_cast<uintptr_t>(SpanBytes(args));
        if (logits_begin < gradient_begin + span &&
            gradient_begin < logits_begin + span) {
          return Invalid(
              "mode out-of-place needs a gradient buffer that does not "
              "overlap the logits");
        }
      }
      break;
    case GradientMode::kNone:
      if (args.gradient != nullptr) {
        return Invalid("mode none (forward only) needs gradient == nullptr");
      }
      break;
    default:
      return Invalid(
          absl::StrCat("mode must be in-place, out-of-place or none, got ",
                       static_cast<int>(args.mode)));
  }
  return absl::OkStatus();
}

absl::Status CheckTargets(const void* targets, DType targets_dtype,
                          int64_t rows, int64_t vocab, int64_t ignore_index) {
  if (!IsTargetsDType(targets_dtype)) {
    return Invalid(absl::StrCat("targets_dtype must be int32 or int64, got ",
                                static_cast<int>(targets_dtype)));
  }
  if (rows > 0 && targets == nullptr) return Invalid("targets is nullptr");
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t target = LoadTarget(targets, targets_dtype, row);
    if ((target < 0 || target >= vocab) && target != ignore_index) {
      return Invalid(absl::StrCat("targets[", row, "] = ", target,
                                  " is out of range: must be in [0, ", vocab,
                                  ") or equal ignore_index ", ignore_index));
    }
  }
  return absl::OkStatus();
}

}  // namespace lossd
