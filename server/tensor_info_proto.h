// A stored tensor's record as the API's TensorInfo: what Describe, List,
// Upload and Backward answer with.
#ifndef LOSSD_SERVER_TENSOR_INFO_PROTO_H_
#define LOSSD_SERVER_TENSOR_INFO_PROTO_H_

#include "lossd/v1/lossd.pb.h"
#include "server/tensor_store.h"

namespace lossd {

// A stored tensor's metadata as the API's TensorInfo.
void ToProto(const TensorRecord& info, lossd::v1::TensorInfo* out);

}  // namespace lossd

#endif  // LOSSD_SERVER_TENSOR_INFO_PROTO_H_
