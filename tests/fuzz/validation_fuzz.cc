// libFuzzer target for the service's request validation (server/validation.h):
// every request field reaches these functions straight from the network. The
// first byte picks the message; the rest is parsed as that protobuf message.
// Accepted requests must satisfy what the service relies on afterwards.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>

#include "lossd/v1/lossd.pb.h"
#include "server/validation.h"

namespace {

namespace pb = ::lossd::v1;

void Require(bool condition) {
  if (!condition) __builtin_trap();
}

// Errors of pure validation are always INVALID_ARGUMENT.
void RequireInvalidArgument(const absl::Status& status) {
  Require(status.code() == absl::StatusCode::kInvalidArgument);
  Require(!status.message().empty());
}

void CheckOptions(const lossd::CrossEntropyOptions& options) {
  Require(options.label_smoothing >= 0.0f && options.label_smoothing <= 1.0f);
  Require(std::isfinite(options.z_loss_scale) && options.z_loss_scale >= 0.0f);
  Require(std::isfinite(options.softcap) && options.softcap >= 0.0f);
  Require(std::isfinite(options.normalizer) && options.normalizer >= 0.0);
  Require(std::isfinite(options.grad_scale));
}

void FuzzTensorHeader(const std::string& bytes) {
  pb::TensorHeader header;
  if (!header.ParseFromString(bytes)) return;
  auto spec = lossd::ValidateTensorHeader(header);
  if (!spec.ok()) return RequireInvalidArgument(spec.status());
  Require(spec->shape.size() == 1 || spec->shape.size() == 2);
  int64_t bytes_expected = static_cast<int64_t>(lossd::DTypeSize(spec->dtype));
  for (int64_t dim : spec->shape) {
    Require(dim > 0);
    Require(!__builtin_mul_overflow(bytes_expected, dim, &bytes_expected));
  }
  Require(spec->bytes == bytes_expected);
  if (!header.has_stripe()) return;
  auto stripe = lossd::ValidateUploadStripe(header.stripe());
  if (!stripe.ok()) return RequireInvalidArgument(stripe.status());
  Require(stripe->count >= 1 && stripe->index >= 0 &&
          stripe->index < stripe->count);
  // The stripes tile the tensor: contiguous, in order, nothing left out.
  const int64_t elements =
      spec->bytes / static_cast<int64_t>(lossd::DTypeSize(spec->dtype));
  int64_t next = 0;
  for (int i = 0; i < stripe->count; ++i) {
    const lossd::ElementRange range =
        lossd::StripeElements(elements, i, stripe->count);
    Require(range.first == next && range.end >= range.first);
    next = range.end;
  }
  Require(next == elements);
}

void FuzzDownload(const std::string& bytes) {
  pb::DownloadRequest request;
  if (!request.ParseFromString(bytes)) return;
  auto spec = lossd::ValidateDownloadRequest(request, 16 << 20);
  if (!spec.ok()) return RequireInvalidArgument(spec.status());
  Require(spec->chunk_bytes >= 0 && spec->chunk_bytes <= (16 << 20));
  for (int stored = 1; stored <= 5; ++stored) {
    const auto stored_dtype = static_cast<lossd::DType>(stored);
    const lossd::DType sent =
        spec->dtype == lossd::DType::kInvalid ? stored_dtype : spec->dtype;
    auto elements = lossd::DownloadChunkElements(
        stored_dtype, sent,
        spec->chunk_bytes == 0 ? 1 << 20 : spec->chunk_bytes);
    if (!elements.ok()) {
      RequireInvalidArgument(elements.status());
      continue;
    }
    Require(*elements >= 1);
    Require(lossd::IsLogitsDType(stored_dtype) == lossd::IsLogitsDType(sent));
    // A byte range of a tensor of a few sizes: inside the tensor, or a clear
    // INVALID_ARGUMENT / OUT_OF_RANGE.
    for (int64_t tensor_elements : {int64_t{0}, int64_t{7}, int64_t{1} << 40}) {
      auto range = lossd::DownloadElements(*spec, sent, tensor_elements);
      if (!range.ok()) {
        Require(range.status().code() == absl::StatusCode::kInvalidArgument ||
                range.status().code() == absl::StatusCode::kOutOfRange);
        continue;
      }
      Require(range->first >= 0 && range->first <= range->end &&
              range->end <= tensor_elements);
    }
  }
}

void FuzzForward(const std::string& bytes) {
  pb::ForwardRequest request;
  if (!request.ParseFromString(bytes)) return;
  auto spec = lossd::ValidateForwardRequest(request);
  if (!spec.ok()) return RequireInvalidArgument(spec.status());
  CheckOptions(spec->options);
  if (request.has_targets_inline()) {
    Require(lossd::IsTargetsDType(spec->inline_targets_dtype));
    // Any row count a stored tensor could have, and hostile ones.
    for (int64_t rows : {int64_t{0}, int64_t{1}, int64_t{3},
                         std::numeric_limits<int64_t>::max(), int64_t{-1}}) {
      const absl::Status status = lossd::CheckInlineTargets(
          request.targets_inline(), spec->inline_targets_dtype, rows);
      if (!status.ok()) {
        RequireInvalidArgument(status);
        continue;
      }
      Require(static_cast<int64_t>(request.targets_inline().data().size()) ==
              rows * static_cast<int64_t>(
                         lossd::DTypeSize(spec->inline_targets_dtype)));
    }
  } else {
    Require(request.targets_case() == pb::ForwardRequest::kTargetsHandle);
  }
}

void FuzzBackward(const std::string& bytes) {
  pb::BackwardRequest request;
  if (!request.ParseFromString(bytes)) return;
  auto out = lossd::ValidateBackwardRequest(request);
  if (!out.ok()) return RequireInvalidArgument(out.status());
  Require(std::isfinite(static_cast<float>(out->scale)));
  for (float value : out->token_scale) Require(std::isfinite(value));
}

void FuzzEvaluate(const std::string& bytes) {
  // Two bytes of header length, the header, then one block.
  if (bytes.size() < 2) return;
  const size_t length = static_cast<uint8_t>(bytes[0]) |
                        static_cast<size_t>(static_cast<uint8_t>(bytes[1]))
                            << 8;
  if (bytes.size() - 2 < length) return;
  pb::EvaluateHeader header;
  if (!header.ParseFromString(bytes.substr(2, length))) return;
  auto spec = lossd::ValidateEvaluateHeader(header);
  if (!spec.ok()) return RequireInvalidArgument(spec.status());
  CheckOptions(spec->options);
  Require(spec->options.reduction != lossd::Reduction::kNone);
  pb::RowBlock block;
  if (!header.weight().empty()) {
    // Hidden states: the row's size waits for the weight, so no block
    // passes before it is known.
    Require(spec->vocab >= 0 && spec->row_bytes == 0 && spec->hidden == 0);
    if (!block.ParseFromString(bytes.substr(2 + length))) return;
    return RequireInvalidArgument(
        lossd::ValidateRowBlock(*spec, block, 0).status());
  }
  Require(header.bias().empty());
  Require(spec->vocab > 0 && spec->row_bytes > 0);
  Require(spec->row_bytes / spec->vocab ==
          static_cast<int64_t>(lossd::DTypeSize(spec->logits_dtype)));
  if (!block.ParseFromString(bytes.substr(2 + length))) return;
  auto rows = lossd::ValidateRowBlock(*spec, block, 0);
  if (!rows.ok()) return RequireInvalidArgument(rows.status());
  Require(*rows >= 0);
  Require(*rows * spec->row_bytes ==
          static_cast<int64_t>(block.logits().size()));
  Require(*rows * static_cast<int64_t>(lossd::DTypeSize(spec->targets_dtype)) ==
          static_cast<int64_t>(block.targets().size()));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string bytes(reinterpret_cast<const char*>(data) + 1, size - 1);
  switch (data[0] % 5) {
    case 0:
      FuzzTensorHeader(bytes);
      break;
    case 1:
      FuzzDownload(bytes);
      break;
    case 2:
      FuzzForward(bytes);
      break;
    case 3:
      FuzzBackward(bytes);
      break;
    case 4:
      FuzzEvaluate(bytes);
      break;
  }
  return 0;
}
