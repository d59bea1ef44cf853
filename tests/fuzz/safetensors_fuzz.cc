// libFuzzer target for the safetensors header parser (client/safetensors.h):
// lossctl opens model outputs it did not write, so the parser must survive
// any bytes. Beyond "no crash, no sanitizer report" it checks what an
// accepted header promises (every tensor inside the file, sizes consistent,
// no overlaps) and that each tensor re-encodes to a header that parses back
// to the same description.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/strings/string_view.h"
#include "client/safetensors.h"

namespace {

// Aborts (a crash libFuzzer records) when a property does not hold.
void Require(bool condition) {
  if (!condition) __builtin_trap();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::string_view bytes(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<lossd::SafetensorsHeader> header =
      lossd::ParseSafetensorsHeader(bytes, size);
  if (!header.ok()) {
    Require(header.status().code() == absl::StatusCode::kInvalidArgument);
    return 0;
  }
  Require(header->data_offset <= size);
  Require(header->data_bytes <= size - header->data_offset);
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (const lossd::SafetensorsTensor& tensor : header->tensors) {
    Require(tensor.begin <= tensor.end);
    Require(tensor.end <= header->data_bytes);
    Require(tensor.shape.size() <= lossd::kMaxSafetensorsRank);
    uint64_t elements = 1;
    for (int64_t dim : tensor.shape) {
      Require(dim >= 0);
      elements *= static_cast<uint64_t>(dim);
    }
    Require(elements == tensor.elements);
    if (tensor.begin < tensor.end)
      ranges.emplace_back(tensor.begin, tensor.end);
    if (tensor.dtype == lossd::DType::kInvalid) continue;
    Require(tensor.elements * lossd::DTypeSize(tensor.dtype) ==
            tensor.end - tensor.begin);
    absl::StatusOr<std::string> encoded =
        lossd::EncodeSafetensorsHeader(tensor.name, tensor.dtype, tensor.shape);
    if (!encoded.ok()) {
      // Only a name the writer refuses: the parser keeps "" as a tensor.
      Require(tensor.name.empty());
      continue;
    }
    Require(encoded->size() % 8 == 0);
    const uint64_t tensor_bytes = tensor.end - tensor.begin;
    absl::StatusOr<lossd::SafetensorsHeader> again =
        lossd::ParseSafetensorsHeader(*encoded, encoded->size() + tensor_bytes);
    Require(again.ok());
    Require(again->tensors.size() == 1);
    Require(again->tensors[0].dtype == tensor.dtype);
    Require(again->tensors[0].shape == tensor.shape);
    Require(again->tensors[0].end == tensor_bytes);
    Require(again->data_offset == encoded->size());
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i) {
    Require(ranges[i - 1].second <= ranges[i].first);
  }
  return 0;
}
