// The soak client's loop, its bookkeeping of statuses and tensors, and the
// RPCs that neither move tensor bytes nor compute a loss: Release, requests
// that must fail, List and Describe.
#include "tests/e2e/soak_client.h"

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/data_connection.h"
#include "common/float16.h"
#include "grpcpp/grpcpp.h"
#include "lossd/v1/lossd.grpc.pb.h"

namespace lossd {
namespace soak_test {

void SoakClient::Run(absl::Time end) {
  if (!Reconnect()) return;
  while (absl::Now() < end) {
    const int dice = Uniform(0, 99);
    if (dice < 13) {
      Upload();
    } else if (dice < 17) {
      DataUpload();
    } else if (dice < 22) {
      StripedUpload();
    } else if (dice < 40) {
      Forward();
    } else if (dice < 50) {
      Backward();
    } else if (dice < 63) {
      Download();
    } else if (dice < 68) {
      DataDownload();
    } else if (dice < 78) {
      Evaluate();
    } else if (dice < 82) {
      DataEvaluate();
    } else if (dice < 92) {
      Release(/*any=*/true);
    } else if (dice < 97) {
      BadRequest();
    } else {
      Inspect();
    }
  }
  while (!owned_.empty()) Release(/*any=*/true);
}

bool SoakClient::Reconnect() {
  if (channel_->WaitForConnected(std::chrono::system_clock::now() +
                                 std::chrono::seconds(10))) {
    return true;
  }
  figures_.unexpected.push_back(
      absl::StrCat("client ", id_, ": no connection to the server in 10 s"));
  return false;
}

void SoakClient::Check(const char* what, const grpc::Status& status,
                       std::initializer_list<Code> allowed) {
  ++figures_.requests;
  const Code code = status.error_code();
  if (NotConnected(status)) {
    if (figures_.connect_failures++ == 0) {
      figures_.first_connect_failure =
          absl::StrCat("client ", id_, " ", what, ": ", status.error_message());
    }
    Reconnect();
    return;
  }
  if (std::find(allowed.begin(), allowed.end(), code) == allowed.end()) {
    figures_.unexpected.push_back(absl::StrCat("client ", id_, " ", what,
                                               ": code ", code, " ",
                                               status.error_message()));
    return;
  }
  if (code == Code::OK) {
    ++figures_.ok;
  } else if (code == Code::CANCELLED) {
    ++figures_.cancellations;
  } else if (code == Code::DEADLINE_EXCEEDED) {
    ++figures_.deadlines;
  } else {
    ++figures_.expected_errors;
  }
}

void SoakClient::MaybeDeadline(grpc::ClientContext* context,
                               bool* with_deadline) {
  *with_deadline = Chance(10);
  if (*with_deadline) {
    context->set_deadline(std::chrono::system_clock::now() +
                          std::chrono::milliseconds(Uniform(1, 20)));
  }
}

std::string SoakClient::RandomLogits(pb::DType dtype, int64_t count) {
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::string bytes;
  if (dtype == pb::DTYPE_FLOAT32) {
    std::vector<float> values(count);
    for (float& x : values) x = normal(rng_);
    bytes.assign(reinterpret_cast<const char*>(values.data()), count * 4);
  } else {
    std::vector<uint16_t> values(count);
    for (uint16_t& x : values) {
      const float value = normal(rng_);
      x = dtype == pb::DTYPE_BFLOAT16 ? FloatToBF16(value) : FloatToHalf(value);
    }
    bytes.assign(reinterpret_cast<const char*>(values.data()), count * 2);
  }
  return bytes;
}

std::string SoakClient::RandomTargets(int64_t rows, int64_t vocab,
                                      pb::DType dtype) {
  std::vector<int64_t> targets(rows);
  for (int64_t& y : targets) {
    y = Chance(10) ? -100 : Uniform(0, static_cast<int>(vocab) - 1);
  }
  if (dtype == pb::DTYPE_INT64) {
    return std::string(reinterpret_cast<const char*>(targets.data()), rows * 8);
  }
  std::vector<int32_t> narrow(targets.begin(), targets.end());
  return std::string(reinterpret_cast<const char*>(narrow.data()), rows * 4);
}

Owned* SoakClient::Pick(bool (*want)(const Owned&)) {
  std::vector<Owned*> candidates;
  for (Owned& owned : owned_) {
    if (want(owned)) candidates.push_back(&owned);
  }
  if (candidates.empty()) return nullptr;
  return candidates[Uniform(0, static_cast<int>(candidates.size()) - 1)];
}

Owned SoakClient::RandomTensor() {
  static constexpr pb::DType kTypes[] = {pb::DTYPE_FLOAT32, pb::DTYPE_BFLOAT16,
                                         pb::DTYPE_FLOAT16};
  Owned tensor;
  tensor.dtype = kTypes[Uniform(0, 2)];
  tensor.rows = Uniform(1, 64);
  tensor.vocab = Uniform(1, 512);
  tensor.bytes = RandomLogits(tensor.dtype, tensor.rows * tensor.vocab);
  return tensor;
}

void SoakClient::Keep(Owned tensor, const pb::TensorInfo& uploaded,
                      const char* what) {
  tensor.handle = uploaded.handle();
  if (uploaded.bytes() != static_cast<int64_t>(tensor.bytes.size())) {
    figures_.unexpected.push_back(
        absl::StrCat("client ", id_, " ", what, ": wrong size"));
  }
  owned_.push_back(std::move(tensor));
}

void SoakClient::Release(bool any) {
  if (owned_.empty() || !any) return;
  const size_t index =
      static_cast<size_t>(Uniform(0, static_cast<int>(owned_.size()) - 1));
  grpc::ClientContext context;
  pb::ReleaseRequest request;
  request.set_handle(owned_[index].handle);
  pb::ReleaseResponse response;
  Check("Release", stub_->Release(&context, request, &response), {Code::OK});
  owned_.erase(owned_.begin() + static_cast<std::ptrdiff_t>(index));
}

void SoakClient::BadRequest() {
  switch (Uniform(0, 3)) {
    case 0: {
      Owned* gradient = Pick([](const Owned& o) { return o.gradient; });
      if (gradient == nullptr) return;
      pb::ForwardRequest request;
      request.set_logits(gradient->handle);
      request.mutable_targets_inline()->set_dtype(pb::DTYPE_INT64);
      request.mutable_targets_inline()->set_data(
          std::string(gradient->rows * 8, '\0'));
      grpc::ClientContext context;
      pb::ForwardResponse response;
      Check("Forward on a gradient",
            stub_->Forward(&context, request, &response),
            {Code::FAILED_PRECONDITION});
      return;
    }
    case 1: {
      grpc::ClientContext context;
      pb::DescribeRequest request;
      request.set_handle(absl::StrCat("nope-", id_));
      pb::TensorInfo info;
      Check("Describe malformed", stub_->Describe(&context, request, &info),
            {Code::INVALID_ARGUMENT});
      return;
    }
    case 2: {
      grpc::ClientContext context;
      pb::UploadResponse response;
      auto writer = stub_->Upload(&context, &response);
      pb::UploadRequest request;
      request.mutable_header()->set_dtype(pb::DTYPE_FLOAT32);
      request.mutable_header()->add_shape(int64_t{1} << 40);
      request.mutable_header()->add_shape(int64_t{1} << 40);
      writer->Write(request);
      writer->WritesDone();
      Check("Upload overflow", writer->Finish(), {Code::INVALID_ARGUMENT});
      return;
    }
    default: {
      Owned* logits = Pick([](const Owned& o) { return !o.gradient; });
      if (logits == nullptr) return;
      pb::ForwardRequest request;
      request.set_logits(logits->handle);
      request.mutable_targets_inline()->set_dtype(pb::DTYPE_INT64);
      std::vector<int64_t> targets(logits->rows, logits->vocab);
      request.mutable_targets_inline()->set_data(std::string(
          reinterpret_cast<const char*>(targets.data()), logits->rows * 8));
      grpc::ClientContext context;
      pb::ForwardResponse response;
      const grpc::Status status = stub_->Forward(&context, request, &response);
      // The state check comes before the target check: a logits tensor
      // still held by a cancelled Download is busy first.
      if (logits->maybe_read) {
        Check("Forward out of range (after a cancelled Download)", status,
              {Code::INVALID_ARGUMENT, Code::FAILED_PRECONDITION});
      } else {
        Check("Forward out of range", status, {Code::INVALID_ARGUMENT});
      }
      return;
    }
  }
}

void SoakClient::Inspect() {
  grpc::ClientContext context;
  pb::ListResponse list;
  Check("List", stub_->List(&context, pb::ListRequest(), &list), {Code::OK});
  Owned* tensor = Pick([](const Owned&) { return true; });
  if (tensor == nullptr) return;
  grpc::ClientContext describe_context;
  pb::DescribeRequest request;
  request.set_handle(tensor->handle);
  pb::TensorInfo info;
  Check("Describe", stub_->Describe(&describe_context, request, &info),
        {Code::OK});
  if (info.state() != (tensor->gradient ? pb::TENSOR_STATE_GRADIENT
                                        : pb::TENSOR_STATE_LOGITS)) {
    figures_.unexpected.push_back(
        absl::StrCat("client ", id_, " Describe: wrong state"));
  }
}

}  // namespace soak_test
}  // namespace lossd
