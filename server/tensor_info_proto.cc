// ToProto of a TensorRecord (tensor_info_proto.h).
#include "server/tensor_info_proto.h"

#include <cstdint>

namespace lossd {

namespace pb = ::lossd::v1;

namespace {

void ToProtoTime(absl::Time time, google::protobuf::Timestamp* out) {
  const int64_t nanos = absl::ToUnixNanos(time);
  int64_t seconds = nanos / 1000000000;
  int64_t rest = nanos % 1000000000;
  if (rest < 0) {
    rest += 1000000000;
    --seconds;
  }
  out->set_seconds(seconds);
  out->set_nanos(static_cast<int32_t>(rest));
}

}  // namespace

void ToProto(const TensorRecord& info, pb::TensorInfo* out) {
  out->set_handle(info.handle);
  out->set_dtype(static_cast<pb::DType>(info.dtype));
  for (int64_t dim : info.shape) out->add_shape(dim);
  out->set_bytes(info.bytes);
  out->set_device(info.device);
  out->set_state(static_cast<pb::TensorState>(info.state));
  out->set_tenant(info.tenant);
  out->set_label(info.label);
  ToProtoTime(info.created, out->mutable_created());
  ToProtoTime(info.last_used, out->mutable_last_used());
  out->set_pending_scale(info.pending_scale);
  out->set_pending_token_scale(info.pending_token_scale);
}

}  // namespace lossd
