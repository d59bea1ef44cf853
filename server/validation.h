// Every check of a lossd.v1 request that needs neither the tensor store nor a
// device, as pure functions: the service runs them before any work, and the
// fuzzer (tests/fuzz) feeds them arbitrary messages. Protobuf in, lossd types
// out: only the RPC edge includes this (the store and devices use common/).
#ifndef LOSSD_SERVER_VALIDATION_H_
#define LOSSD_SERVER_VALIDATION_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/dtype.h"
#include "common/loss_options.h"
#include "common/tensor_math.h"
#include "lossd/v1/lossd.pb.h"
#include "server/evaluate_spec.h"
#include "server/stripe_spec.h"

namespace lossd {

// Every DType, in the proto's order.
inline constexpr DType kAllDTypes[] = {DType::kFloat32, DType::kBFloat16,
                                       DType::kFloat16, DType::kInt32,
                                       DType::kInt64};
inline constexpr DType kLogitsDTypes[] = {DType::kFloat32, DType::kBFloat16,
                                          DType::kFloat16};
inline constexpr DType kTargetsDTypes[] = {DType::kInt32, DType::kInt64};

// A lossd.v1.DType number as a DType. Success: the dtype, or kInvalid for
// DTYPE_UNSPECIFIED when `allow_unspecified`. INVALID_ARGUMENT naming `field`,
// what it holds and the values of `allowed`, e.g. "header.dtype is
// DTYPE_UNSPECIFIED; expected one of FLOAT32, ...": unspecified (and not
// allowed), a number outside the enum, or a dtype not in `allowed`.
// Thread-safe.
absl::StatusOr<DType> ParseDType(int value, absl::string_view field,
                                 bool allow_unspecified,
                                 absl::Span<const DType> allowed = kAllDTypes);

// The longest label (TensorHeader.label, ForwardRequest.gradient_label) in
// bytes: a label is kept with its tensor and sent back by every List.
inline constexpr size_t kMaxLabelBytes = 1024;

// OK for a label of at most kMaxLabelBytes bytes without ASCII control
// characters (bytes below 0x20, and 0x7f: a label is one line of text).
// INVALID_ARGUMENT naming `field`, the rule and what was received otherwise.
// Thread-safe.
absl::Status CheckLabel(absl::string_view label, absl::string_view field);

// The page size of a List without one (page_size 0), and the largest: a page
// of kMaxListPageSize tensors with labels of kMaxLabelBytes stays far below
// gRPC's default 4 MiB message limit.
inline constexpr int kDefaultListPageSize = 100;
inline constexpr int kMaxListPageSize = 1000;

// A List request's page size, checked. Where the page starts is in its
// page_token, which only the instance that made it can open
// (server/page_token.h).
struct ListSpec {
  int page_size = kDefaultListPageSize;
};

// INVALID_ARGUMENT: page_size < 0 (one above kMaxListPageSize is cut to it).
// Thread-safe.
absl::StatusOr<ListSpec> ValidateListRequest(
    const lossd::v1::ListRequest& request);

// LossOptions (all but class_weights, a handle the caller resolves) as
// CrossEntropyOptions. INVALID_ARGUMENT: label_smoothing outside [0, 1];
// z_loss_scale, softcap or normalizer < 0; any of them or grad_scale not
// finite; an unknown reduction. Thread-safe.
absl::StatusOr<CrossEntropyOptions> ParseLossOptions(
    const lossd::v1::LossOptions& options);

// A lossd.v1.GradientMode number; UNSPECIFIED is IN_PLACE. INVALID_ARGUMENT
// for an unknown value. Thread-safe.
absl::StatusOr<GradientMode> ParseMode(int mode);

// An Upload header, checked.
struct TensorSpec {
  DType dtype = DType::kInvalid;
  std::vector<int64_t> shape;
  int64_t bytes = 0;
};

// INVALID_ARGUMENT: as ParseDType (unspecified not allowed),
// StoredTensorBytes (common/tensor_math.h) and CheckLabel. Thread-safe.
absl::StatusOr<TensorSpec> ValidateTensorHeader(
    const lossd::v1::TensorHeader& header);

// Limits of a striped upload (lossd.v1.UploadStripe).
inline constexpr int kMaxUploadStripes = 64;
inline constexpr size_t kMaxUploadIdLength = 64;

// INVALID_ARGUMENT: upload_id empty, longer than kMaxUploadIdLength or with a
// character outside [A-Za-z0-9_-]; count outside [1, kMaxUploadStripes];
// index outside [0, count). Thread-safe.
absl::StatusOr<StripeSpec> ValidateUploadStripe(
    const lossd::v1::UploadStripe& stripe);

// A Download request, checked: `dtype` kInvalid means "as stored";
// `chunk_bytes` 0 means "the server's default"; `offset`/`length` a byte range
// of the converted output (length 0 = to the end).
struct DownloadSpec {
  DType dtype = DType::kInvalid;
  int64_t chunk_bytes = 0;
  int64_t offset = 0;
  int64_t length = 0;
};

// INVALID_ARGUMENT: a malformed handle (common/handle.h); an unknown dtype;
// chunk_bytes < 0 or > max_chunk_bytes; offset or length < 0. Thread-safe.
absl::StatusOr<DownloadSpec> ValidateDownloadRequest(
    const lossd::v1::DownloadRequest& request, int64_t max_chunk_bytes);

// Whether a tensor stored as `stored` may be sent as `sent`: floating-point
// types convert among themselves, integer types only to themselves. Success:
// elements per chunk of `chunk_bytes`. INVALID_ARGUMENT: a conversion between
// integer and floating point, or chunk_bytes smaller than one element.
// Thread-safe.
absl::StatusOr<int64_t> DownloadChunkElements(DType stored, DType sent,
                                              int64_t chunk_bytes);

// The elements [first, end) a Download of `spec` sends of a tensor of
// `elements` elements sent as `sent`. INVALID_ARGUMENT: offset or length not
// a multiple of the element size; OUT_OF_RANGE: offset + length past the end.
// Thread-safe.
absl::StatusOr<ElementRange> DownloadElements(const DownloadSpec& spec,
                                              DType sent, int64_t elements);

// The request-only part of a Forward: everything checkable before handles
// are resolved.
struct ForwardSpec {
  CrossEntropyOptions options;
  GradientMode mode = GradientMode::kInPlace;
  // kInvalid when the targets are a handle.
  DType inline_targets_dtype = DType::kInvalid;
};

// INVALID_ARGUMENT: as ParseLossOptions and ParseMode; a malformed logits,
// targets_handle or options.class_weights handle (common/handle.h); no
// targets; inline targets whose dtype is missing, unknown or not int32/int64;
// a gradient_label CheckLabel refuses. Thread-safe.
absl::StatusOr<ForwardSpec> ValidateForwardRequest(
    const lossd::v1::ForwardRequest& request);

// Inline targets once the logits' row count is known. INVALID_ARGUMENT when
// the byte count is not rows * the size of `dtype`. Thread-safe.
absl::Status CheckInlineTargets(const lossd::v1::InlineTensor& targets,
                                DType dtype, int64_t rows);

// A Backward request's grad_output: `token_scale` empty means the scalar
// `scale`.
struct GradOutput {
  double scale = 1.0;
  std::vector<float> token_scale;
};

// INVALID_ARGUMENT: a malformed gradient handle (common/handle.h); no
// grad_output; an empty per-token list; a non-finite
// value; a scalar outside float32's range (factors are applied in float32).
// Whether per-token values fit the gradient is the store's check (it needs
// the tensor). Thread-safe.
absl::StatusOr<GradOutput> ValidateBackwardRequest(
    const lossd::v1::BackwardRequest& request);

// INVALID_ARGUMENT: as ParseLossOptions; a malformed options.class_weights
// handle (common/handle.h); reduction NONE; vocab <= 0; logits dtype missing,
// unknown or not a float type; targets dtype missing (allowed for a
// distillation with alpha 0: the blocks then carry no targets,
// spec.has_targets), unknown or not int32/int64; a row size that overflows
// int64; a bias without a weight. With header.weight (a well-formed handle, as
// header.bias), vocab may be 0 and logits_dtype UNSPECIFIED (kInvalid): the
// spec's vocab, logits_dtype and row_bytes are then completed from the weight
// (ApplyLinearHead, server/linear_head.h); row_bytes stays 0 until then.
// Thread-safe.
absl::StatusOr<EvaluateSpec> ValidateEvaluateHeader(
    const lossd::v1::EvaluateHeader& header);

// Rows in one Evaluate block (`index` counts blocks, for the message), as
// ValidateRowBlockSizes (evaluate_spec.h) counts them.
absl::StatusOr<int64_t> ValidateRowBlock(const EvaluateSpec& spec,
                                         const lossd::v1::RowBlock& block,
                                         int64_t index);

// The longest TensorHeader.idempotency_key (a UUID has 36 characters).
inline constexpr size_t kMaxIdempotencyKeyLength = 128;

// INVALID_ARGUMENT: an idempotency_key longer than kMaxIdempotencyKeyLength
// or with a character outside [A-Za-z0-9_-] (empty is allowed: no key). The
// message names the length or the first such character and its position.
// Thread-safe.
absl::Status ValidateIdempotencyKey(const std::string& key);

}  // namespace lossd

#endif  // LOSSD_SERVER_VALIDATION_H_
