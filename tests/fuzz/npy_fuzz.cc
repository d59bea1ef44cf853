// libFuzzer target for the .npy header parser (client/npy.h): lossctl opens
// files it did not write, so the parser must survive any bytes. Beyond "no
// crash, no sanitizer report" it checks that an accepted header re-encodes to
// one that parses to the same array description.
#include <cstddef>
#include <cstdint>

#include "absl/strings/string_view.h"
#include "client/npy.h"

namespace {

// Aborts (a crash libFuzzer records) when a property does not hold.
void Require(bool condition) {
  if (!condition) __builtin_trap();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::string_view bytes(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<lossd::NpyHeader> header = lossd::ParseNpyHeader(bytes);
  if (!header.ok()) {
    Require(header.status().code() == absl::StatusCode::kInvalidArgument);
    return 0;
  }
  Require(header->data_offset <= size);
  Require(header->shape.size() <= static_cast<size_t>(lossd::kMaxNpyRank));
  uint64_t elements = 1;
  for (int64_t dim : header->shape) {
    Require(dim >= 0);
    elements *= static_cast<uint64_t>(dim);
  }
  Require(elements == header->elements);
  Require(header->data_bytes ==
          header->elements * lossd::DTypeSize(header->dtype));

  absl::StatusOr<std::string> encoded =
      lossd::EncodeNpyHeader(header->dtype, header->shape);
  Require(encoded.ok());
  absl::StatusOr<lossd::NpyHeader> again = lossd::ParseNpyHeader(*encoded);
  Require(again.ok());
  Require(again->dtype == header->dtype);
  Require(again->shape == header->shape);
  Require(again->data_offset == encoded->size());
  Require(again->data_offset % 64 == 0);
  return 0;
}
