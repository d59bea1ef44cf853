// DumpBytes (raw_bytes.h).
#include "server/raw_bytes.h"

namespace lossd {

absl::Status DumpBytes(grpc::ByteBuffer* buffer, const char* message,
                       ReceivedBytes* out) {
  out->slices.clear();
  out->pieces.clear();
  if (!buffer->Dump(&out->slices).ok()) {
    return absl::InternalError(
        absl::StrCat("cannot read an ", message, "'s bytes"));
  }
  for (const grpc::Slice& slice : out->slices) {
    out->pieces.emplace_back(reinterpret_cast<const char*>(slice.begin()),
                             slice.size());
  }
  return absl::OkStatus();
}

}  // namespace lossd
