// The raw (ByteBuffer) side of the Upload and Evaluate reactors: a received
// message's bytes as views, and a response serialized by hand.
#ifndef LOSSD_SERVER_RAW_BYTES_H_
#define LOSSD_SERVER_RAW_BYTES_H_

#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "grpcpp/grpcpp.h"
// SerializationTraits of protobuf messages.
#include "grpcpp/impl/codegen/proto_utils.h"

namespace lossd {

// Serializes the response of a raw (ByteBuffer) reactor into `out`.
template <typename Message>
absl::Status SerializeResponse(const Message& message, grpc::ByteBuffer* out) {
  bool own_buffer = false;
  if (!grpc::SerializationTraits<Message>::Serialize(message, out, &own_buffer)
           .ok()) {
    return absl::InternalError(
        absl::StrCat("cannot serialize the ", Message::descriptor()->name()));
  }
  return absl::OkStatus();
}

// The bytes of a received raw message, as gRPC's slices (which hold them) and
// views of those (what common/raw_messages.h reads).
struct ReceivedBytes {
  std::vector<grpc::Slice> slices;
  std::vector<absl::string_view> pieces;
};
// INTERNAL when gRPC cannot hand out the bytes of `buffer`, a `message`
// ("UploadRequest").
absl::Status DumpBytes(grpc::ByteBuffer* buffer, const char* message,
                       ReceivedBytes* out);

}  // namespace lossd

#endif  // LOSSD_SERVER_RAW_BYTES_H_
