// The request checks of validation.h. Nothing here allocates by a size the
// client chose or indexes by a value it sent without checking first: these
// functions see raw fuzz input.
#include "server/validation.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <string>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/checked_math.h"
#include "common/echo.h"
#include "common/handle.h"
#include "common/status_macros.h"

namespace lossd {

namespace pb = ::lossd::v1;

namespace {

absl::Status CheckFinite(double value, absl::string_view field) {
  if (!std::isfinite(value)) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " = ", value, " is not finite"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<DType> ParseDType(int value, absl::string_view field,
                                 bool allow_unspecified,
                                 absl::Span<const DType> allowed) {
  if (value == pb::DTYPE_UNSPECIFIED && allow_unspecified) {
    return DType::kInvalid;
  }
  const bool known = pb::DType_IsValid(value);
  for (DType dtype : allowed) {
    if (known && value == static_cast<int>(dtype)) return dtype;
  }
  const std::string received =
      known ? pb::DType_Name(static_cast<pb::DType>(value))
            : absl::StrCat(value, ", which is no DType");
  return absl::InvalidArgumentError(
      absl::StrCat(field, " is ", received, "; expected one of ",
                   absl::StrJoin(allowed, ", ",
                                 [](std::string* out, DType dtype) {
                                   out->append(DTypeProtoName(dtype));
                                 }),
                   allow_unspecified ? " or DTYPE_UNSPECIFIED" : ""));
}

absl::Status CheckLabel(absl::string_view label, absl::string_view field) {
  if (label.size() > kMaxLabelBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " has ", label.size(), " bytes; at most ",
                     kMaxLabelBytes, " are allowed (", Echo(label), ")"));
  }
  for (size_t i = 0; i < label.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(label[i]);
    if (c < 0x20 || c == 0x7f) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s holds the control character 0x%02x at byte %d; a label is one "
          "line of printable text (%s)",
          field, c, i, Echo(label)));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<ListSpec> ValidateListRequest(const pb::ListRequest& request) {
  ListSpec spec;
  if (request.page_size() < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "page_size = ", request.page_size(), " is < 0 (0 = the default, ",
        kDefaultListPageSize, "; at most ", kMaxListPageSize, ")"));
  }
  if (request.page_size() > 0) {
    spec.page_size = std::min(request.page_size(), kMaxListPageSize);
  }
  return spec;
}

absl::StatusOr<CrossEntropyOptions> ParseLossOptions(
    const pb::LossOptions& in) {
  CrossEntropyOptions out;
  if (in.has_ignore_index()) out.ignore_index = in.ignore_index();
  RETURN_IF_ERROR(CheckFinite(in.label_smoothing(), "label_smoothing"));
  if (in.label_smoothing() < 0.0f || in.label_smoothing() > 1.0f) {
    return absl::InvalidArgumentError(absl::StrCat(
        "label_smoothing = ", in.label_smoothing(), " is outside [0, 1]"));
  }
  out.label_smoothing = in.label_smoothing();
  switch (in.reduction()) {
    case pb::REDUCTION_UNSPECIFIED:
    case pb::REDUCTION_MEAN:
      out.reduction = Reduction::kMean;
      break;
    case pb::REDUCTION_SUM:
      out.reduction = Reduction::kSum;
      break;
    case pb::REDUCTION_NONE:
      out.reduction = Reduction::kNone;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("unknown reduction ", in.reduction()));
  }
  RETURN_IF_ERROR(CheckFinite(in.z_loss_scale(), "z_loss_scale"));
  if (in.z_loss_scale() < 0.0f) {
    return absl::InvalidArgumentError(
        absl::StrCat("z_loss_scale = ", in.z_loss_scale(), " is < 0"));
  }
  out.z_loss_scale = in.z_loss_scale();
  RETURN_IF_ERROR(CheckFinite(in.softcap(), "softcap"));
  if (in.softcap() < 0.0f) {
    return absl::InvalidArgumentError(
        absl::StrCat("softcap = ", in.softcap(), " is < 0"));
  }
  out.softcap = in.softcap();
  RETURN_IF_ERROR(CheckFinite(in.normalizer(), "normalizer"));
  if (in.normalizer() < 0.0) {
    return absl::InvalidArgumentError(
        absl::StrCat("normalizer = ", in.normalizer(), " is < 0"));
  }
  out.normalizer = in.normalizer();
  if (in.has_grad_scale()) {
    RETURN_IF_ERROR(CheckFinite(in.grad_scale(), "grad_scale"));
    out.grad_scale = in.grad_scale();
  }
  return out;
}

absl::StatusOr<GradientMode> ParseMode(int mode) {
  switch (mode) {
    case pb::GRADIENT_MODE_UNSPECIFIED:
    case pb::GRADIENT_MODE_IN_PLACE:
      return GradientMode::kInPlace;
    case pb::GRADIENT_MODE_OUT_OF_PLACE:
      return GradientMode::kOutOfPlace;
    case pb::GRADIENT_MODE_NONE:
      return GradientMode::kNone;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("unknown gradient mode ", mode));
  }
}

absl::StatusOr<TensorSpec> ValidateTensorHeader(
    const pb::TensorHeader& header) {
  TensorSpec spec;
  ASSIGN_OR_RETURN(spec.dtype, ParseDType(header.dtype(), "header.dtype",
                                          /*allow_unspecified=*/false));
  spec.shape.assign(header.shape().begin(), header.shape().end());
  ASSIGN_OR_RETURN(spec.bytes, StoredTensorBytes(spec.dtype, spec.shape));
  RETURN_IF_ERROR(CheckLabel(header.label(), "header.label"));
  if (!header.overwrite_handle().empty()) {
    RETURN_IF_ERROR(
        CheckHandle(header.overwrite_handle(), "header.overwrite_handle"));
    // An overwrite names its tensor already, and repeating it is harmless.
    if (!header.idempotency_key().empty()) {
      return absl::InvalidArgumentError(
          "header.idempotency_key and header.overwrite_handle are exclusive: "
          "an overwrite names its tensor already and may simply be sent "
          "again");
    }
  }
  return spec;
}

absl::StatusOr<StripeSpec> ValidateUploadStripe(
    const pb::UploadStripe& stripe) {
  const std::string& id = stripe.upload_id();
  if (id.empty() || id.size() > kMaxUploadIdLength) {
    return absl::InvalidArgumentError(
        absl::StrCat("stripe.upload_id must have 1 to ", kMaxUploadIdLength,
                     " characters, got ", id.size()));
  }
  for (char c : id) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
                    (c >= '0' && c <= '9') || c == '_' || c == '-';
    if (!ok) {
      return absl::InvalidArgumentError(
          "stripe.upload_id may only hold the characters [A-Za-z0-9_-]");
    }
  }
  if (stripe.count() < 1 || stripe.count() > kMaxUploadStripes) {
    return absl::InvalidArgumentError(
        absl::StrCat("stripe.count = ", stripe.count(), " is outside [1, ",
                     kMaxUploadStripes, "]"));
  }
  if (stripe.index() < 0 || stripe.index() >= stripe.count()) {
    return absl::InvalidArgumentError(
        absl::StrCat("stripe.index = ", stripe.index(), " is outside [0, ",
                     stripe.count(), ")"));
  }
  StripeSpec spec;
  spec.upload_id = id;
  spec.index = stripe.index();
  spec.count = stripe.count();
  return spec;
}

absl::StatusOr<DownloadSpec> ValidateDownloadRequest(
    const pb::DownloadRequest& request, int64_t max_chunk_bytes) {
  DownloadSpec spec;
  RETURN_IF_ERROR(CheckHandle(request.handle(), "handle"));
  ASSIGN_OR_RETURN(spec.dtype, ParseDType(request.dtype(), "dtype",
                                          /*allow_unspecified=*/true));
  if (request.chunk_bytes() < 0 || request.chunk_bytes() > max_chunk_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk_bytes = ", request.chunk_bytes(),
                     " is outside [0, ", max_chunk_bytes, "]"));
  }
  spec.chunk_bytes = request.chunk_bytes();
  if (request.offset() < 0 || request.length() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("offset = ", request.offset(),
                     " and length = ", request.length(), " must be >= 0"));
  }
  spec.offset = request.offset();
  spec.length = request.length();
  return spec;
}

absl::StatusOr<ElementRange> DownloadElements(const DownloadSpec& spec,
                                              DType sent, int64_t elements) {
  const int64_t size = static_cast<int64_t>(DTypeSize(sent));
  if (size <= 0 || spec.offset % size != 0 || spec.length % size != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "offset = ", spec.offset, " and length = ", spec.length,
        " must be whole elements of ", DTypeName(sent), " (", size, " bytes)"));
  }
  const int64_t first = spec.offset / size;
  const int64_t count = spec.length / size;
  if (first > elements || count > elements - first) {
    // The range as received: offset + length may not fit in int64.
    const std::optional<int64_t> end = CheckedAdd(spec.offset, spec.length);
    const std::string range =
        end.has_value() ? absl::StrCat("bytes [", spec.offset, ", ", *end, ")")
                        : absl::StrCat("offset = ", spec.offset,
                                       " and length = ", spec.length);
    return absl::OutOfRangeError(
        absl::StrCat(range, " are past the end of the tensor (",
                     elements * size, " bytes as ", DTypeName(sent), ")"));
  }
  return ElementRange{first, count == 0 ? elements : first + count};
}

absl::StatusOr<int64_t> DownloadChunkElements(DType stored, DType sent,
                                              int64_t chunk_bytes) {
  if (IsLogitsDType(stored) != IsLogitsDType(sent) ||
      (!IsLogitsDType(stored) && stored != sent) || DTypeSize(sent) == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cannot convert ", DTypeName(stored), " to ", DTypeName(sent)));
  }
  const int64_t element = static_cast<int64_t>(DTypeSize(sent));
  const int64_t elements = chunk_bytes / element;
  if (elements < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk_bytes = ", chunk_bytes,
                     " is smaller than one element of ", element, " bytes"));
  }
  return elements;
}

absl::StatusOr<ForwardSpec> ValidateForwardRequest(
    const pb::ForwardRequest& request) {
  ForwardSpec spec;
  RETURN_IF_ERROR(CheckHandle(request.logits(), "logits"));
  ASSIGN_OR_RETURN(spec.options, ParseLossOptions(request.options()));
  if (!request.options().class_weights().empty()) {
    RETURN_IF_ERROR(CheckHandle(request.options().class_weights(),
                                "options.class_weights"));
  }
  ASSIGN_OR_RETURN(spec.mode, ParseMode(request.mode()));
  RETURN_IF_ERROR(CheckLabel(request.gradient_label(), "gradient_label"));
  switch (request.targets_case()) {
    case pb::ForwardRequest::kTargetsHandle:
      RETURN_IF_ERROR(CheckHandle(request.targets_handle(), "targets_handle"));
      break;
    case pb::ForwardRequest::kTargetsInline: {
      ASSIGN_OR_RETURN(
          spec.inline_targets_dtype,
          ParseDType(request.targets_inline().dtype(), "targets_inline.dtype",
                     false, kTargetsDTypes));
      break;
    }
    default:
      return absl::InvalidArgumentError(
          "targets missing: set targets_handle or targets_inline");
  }
  return spec;
}

absl::Status CheckInlineTargets(const pb::InlineTensor& targets, DType dtype,
                                int64_t rows) {
  const int64_t size = static_cast<int64_t>(DTypeSize(dtype));
  const int64_t bytes = static_cast<int64_t>(targets.data().size());
  const std::optional<int64_t> need = CheckedMul(rows, size);
  const bool overflow = !need.has_value();
  if (size == 0 || rows < 0 || overflow || bytes != *need) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "inline targets have %d bytes, %d rows of %s need %s", bytes, rows,
        DTypeName(dtype),
        overflow ? "more than int64 holds" : absl::StrCat(*need)));
  }
  return absl::OkStatus();
}

absl::StatusOr<GradOutput> ValidateBackwardRequest(
    const pb::BackwardRequest& request) {
  GradOutput out;
  RETURN_IF_ERROR(CheckHandle(request.gradient(), "gradient"));
  switch (request.grad_output_case()) {
    case pb::BackwardRequest::kScalar:
      out.scale = request.scalar();
      if (!std::isfinite(out.scale)) {
        return absl::InvalidArgumentError(
            absl::StrCat("grad_output ", out.scale, " is not finite"));
      }
      // Factors are applied in float32: a larger one would turn the whole
      // gradient into infinities.
      if (std::abs(out.scale) > std::numeric_limits<float>::max()) {
        return absl::InvalidArgumentError(
            absl::StrCat("grad_output ", out.scale,
                         " is outside the float32 range (it is applied in "
                         "float32)"));
      }
      break;
    case pb::BackwardRequest::kPerToken: {
      const auto& values = request.per_token().values();
      if (values.empty()) {
        return absl::InvalidArgumentError("per-token grad_output is empty");
      }
      for (int i = 0; i < values.size(); ++i) {
        if (!std::isfinite(values[i])) {
          return absl::InvalidArgumentError(absl::StrCat(
              "grad_output[", i, "] = ", values[i], " is not finite"));
        }
      }
      out.token_scale.assign(values.begin(), values.end());
      break;
    }
    default:
      return absl::InvalidArgumentError("no grad_output");
  }
  return out;
}

absl::StatusOr<EvaluateSpec> ValidateEvaluateHeader(
    const pb::EvaluateHeader& header) {
  EvaluateSpec spec;
  ASSIGN_OR_RETURN(spec.options, ParseLossOptions(header.options()));
  if (!header.options().class_weights().empty()) {
    RETURN_IF_ERROR(CheckHandle(header.options().class_weights(),
                                "header.options.class_weights"));
  }
  if (spec.options.reduction == Reduction::kNone) {
    return absl::InvalidArgumentError(
        "Evaluate reduces: reduction NONE is not allowed");
  }
  // A distillation with alpha 0 needs no targets: UNSPECIFIED says that the
  // rows come without any (over data connections, frames without that part).
  auto parse_targets = [&header, &spec]() -> absl::Status {
    const bool optional =
        header.has_distillation() && header.distillation().alpha() == 0.0f;
    ASSIGN_OR_RETURN(spec.targets_dtype,
                     ParseDType(header.targets_dtype(), "header.targets_dtype",
                                optional, kTargetsDTypes));
    if (spec.targets_dtype == DType::kInvalid) {
      spec.has_targets = false;
      spec.targets_dtype = DType::kInt32;
    }
    return absl::OkStatus();
  };
  if (!header.weight().empty()) {
    // Hidden states: V, H and the dtype are the weight's (LeaseLinearHead);
    // vocab and logits_dtype may only restate them.
    RETURN_IF_ERROR(CheckHandle(header.weight(), "header.weight"));
    if (!header.bias().empty()) {
      RETURN_IF_ERROR(CheckHandle(header.bias(), "header.bias"));
    }
    if (header.vocab() < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "header.vocab = ", header.vocab(),
          " must be 0 (the weight's V) or V with header.weight set"));
    }
    spec.vocab = header.vocab();
    ASSIGN_OR_RETURN(spec.logits_dtype,
                     ParseDType(header.logits_dtype(), "header.logits_dtype",
                                true, kLogitsDTypes));
    RETURN_IF_ERROR(parse_targets());
    return spec;
  }
  if (!header.bias().empty()) {
    return absl::InvalidArgumentError(
        "header.bias is set but header.weight is not: a bias needs the "
        "weight it is added to");
  }
  if (header.vocab() <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("vocab = ", header.vocab(), " must be > 0"));
  }
  spec.vocab = header.vocab();
  ASSIGN_OR_RETURN(spec.logits_dtype,
                   ParseDType(header.logits_dtype(), "header.logits_dtype",
                              false, kLogitsDTypes));
  RETURN_IF_ERROR(parse_targets());
  const int64_t element = static_cast<int64_t>(DTypeSize(spec.logits_dtype));
  if (spec.vocab > std::numeric_limits<int64_t>::max() / element) {
    return absl::InvalidArgumentError(
        absl::StrCat("vocab = ", spec.vocab, ": a row of ",
                     DTypeName(spec.logits_dtype), " overflows int64"));
  }
  spec.row_bytes = spec.vocab * element;
  return spec;
}

absl::StatusOr<int64_t> ValidateRowBlock(const EvaluateSpec& spec,
                                         const pb::RowBlock& block,
                                         int64_t index) {
  return ValidateRowBlockSizes(
      spec, static_cast<int64_t>(block.logits().size()),
      static_cast<int64_t>(block.targets().size()), index);
}

absl::StatusOr<int64_t> ValidateRowBlockSizes(const EvaluateSpec& spec,
                                              int64_t logits_bytes,
                                              int64_t targets_bytes,
                                              int64_t index) {
  const int64_t target_size =
      static_cast<int64_t>(DTypeSize(spec.targets_dtype));
  if (spec.row_bytes <= 0 || target_size == 0) {
    return absl::InvalidArgumentError("the Evaluate header is not valid");
  }
  const bool hidden = spec.hidden > 0;
  if (logits_bytes % spec.row_bytes != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "block %d: %d %s bytes are not a whole number of rows of %d bytes%s",
        index, logits_bytes, hidden ? "hidden-state" : "logits", spec.row_bytes,
        hidden ? absl::StrCat(" (H = ", spec.hidden, " values of ",
                              DTypeName(spec.logits_dtype), ")")
               : ""));
  }
  const int64_t rows = logits_bytes / spec.row_bytes;
  const std::optional<int64_t> need = CheckedMul(rows, target_size);
  if (!need.has_value() || targets_bytes != *need) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "block %d: %d rows of %s but %d bytes of targets (%d each)", index,
        rows, hidden ? "hidden states" : "logits", targets_bytes, target_size));
  }
  return rows;
}

absl::Status ValidateIdempotencyKey(const std::string& key) {
  if (key.size() > kMaxIdempotencyKeyLength) {
    return absl::InvalidArgumentError(absl::StrCat(
        "idempotency_key must have at most ", kMaxIdempotencyKeyLength,
        " characters, got ", key.size()));
  }
  for (size_t i = 0; i < key.size(); ++i) {
    const char c = key[i];
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
                    (c >= '0' && c <= '9') || c == '_' || c == '-';
    if (!ok) {
      return absl::InvalidArgumentError(absl::StrCat(
          "idempotency_key may only hold the characters [A-Za-z0-9_-], got '",
          absl::CHexEscape(absl::string_view(&key[i], 1)), "' at position ",
          i));
    }
  }
  return absl::OkStatus();
}

}  // namespace lossd
