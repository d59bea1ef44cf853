// The soak client's losses: Forward and Backward on its stored tensors, and
// Evaluate over the stream or over data connections, sometimes cancelled,
// cut short or under a tight deadline.
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
#include "tests/e2e/soak_client.h"

namespace lossd {
namespace soak_test {

void SoakClient::Forward() {
  Owned* logits = Pick([](const Owned& o) { return !o.gradient; });
  if (logits == nullptr) return Upload();
  pb::ForwardRequest request;
  request.set_logits(logits->handle);
  const pb::DType targets_dtype =
      Chance(50) ? pb::DTYPE_INT32 : pb::DTYPE_INT64;
  request.mutable_targets_inline()->set_dtype(targets_dtype);
  request.mutable_targets_inline()->set_data(
      RandomTargets(logits->rows, logits->vocab, targets_dtype));
  static constexpr pb::Reduction kReductions[] = {
      pb::REDUCTION_MEAN, pb::REDUCTION_SUM, pb::REDUCTION_NONE};
  const pb::Reduction reduction = kReductions[Uniform(0, 2)];
  pb::LossOptions* options = request.mutable_options();
  options->set_reduction(reduction);
  if (Chance(30)) options->set_label_smoothing(0.1f);
  if (Chance(30)) options->set_z_loss_scale(1e-4f);
  if (Chance(20)) options->set_softcap(30.0f);
  static constexpr pb::GradientMode kModes[] = {pb::GRADIENT_MODE_IN_PLACE,
                                                pb::GRADIENT_MODE_OUT_OF_PLACE,
                                                pb::GRADIENT_MODE_NONE};
  pb::GradientMode mode = kModes[Uniform(0, 2)];
  if (mode == pb::GRADIENT_MODE_OUT_OF_PLACE && owned_.size() >= kMaxOwned) {
    mode = pb::GRADIENT_MODE_NONE;
  }
  request.set_mode(mode);
  request.mutable_outputs()->set_token_loss(Chance(30));
  request.set_gradient_label(absl::StrCat("soak ", id_, " gradient"));
  grpc::ClientContext context;
  pb::ForwardResponse response;
  const grpc::Status status = stub_->Forward(&context, request, &response);
  if (logits->maybe_read && mode == pb::GRADIENT_MODE_IN_PLACE) {
    Check("Forward (after a cancelled Download)", status,
          {Code::OK, Code::FAILED_PRECONDITION});
  } else {
    Check("Forward", status, {Code::OK});
  }
  if (!status.ok()) return;
  if (mode == pb::GRADIENT_MODE_IN_PLACE) {
    logits->maybe_read = false;  // the write found no read
    logits->gradient = true;
    logits->reduction = reduction;
    logits->bytes.clear();
  } else if (mode == pb::GRADIENT_MODE_OUT_OF_PLACE &&
             !response.gradient().empty()) {
    Owned gradient = *logits;
    gradient.handle = response.gradient();
    gradient.maybe_read = false;  // a new tensor, never downloaded
    gradient.gradient = true;
    gradient.reduction = reduction;
    gradient.bytes.clear();
    owned_.push_back(std::move(gradient));
  }
}

void SoakClient::Backward() {
  Owned* gradient = Pick([](const Owned& o) { return o.gradient; });
  if (gradient == nullptr) return Forward();
  pb::BackwardRequest request;
  request.set_gradient(gradient->handle);
  if (gradient->materialized) {
    request.set_scalar(gradient->factor);  // the same factor is a no-op
  } else if (gradient->reduction == pb::REDUCTION_NONE && Chance(50)) {
    for (int64_t row = 0; row < gradient->rows; ++row) {
      request.mutable_per_token()->add_values(
          static_cast<float>(Uniform(-4, 4)) / 4.0f);
    }
  } else {
    gradient->factor = static_cast<double>(Uniform(1, 16)) / 8.0;
    request.set_scalar(gradient->factor);
    request.set_materialize(Chance(20));
  }
  grpc::ClientContext context;
  pb::BackwardResponse response;
  const grpc::Status status = stub_->Backward(&context, request, &response);
  if (gradient->maybe_read && request.materialize()) {
    Check("Backward (after a cancelled Download)", status,
          {Code::OK, Code::FAILED_PRECONDITION});
  } else {
    Check("Backward", status, {Code::OK});
  }
  if (status.ok() && request.materialize()) {
    gradient->maybe_read = false;  // the write found no read
    gradient->materialized = true;
  }
}

void SoakClient::Evaluate() {
  const int64_t vocab = Uniform(1, 512);
  const pb::DType dtype = Chance(50) ? pb::DTYPE_FLOAT32 : pb::DTYPE_BFLOAT16;
  const bool cancel = Chance(15);
  grpc::ClientContext context;
  bool with_deadline = false;
  if (!cancel) MaybeDeadline(&context, &with_deadline);
  pb::EvaluateResponse response;
  auto writer = stub_->Evaluate(&context, &response);
  pb::EvaluateRequest request;
  request.mutable_header()->set_vocab(vocab);
  request.mutable_header()->set_logits_dtype(dtype);
  request.mutable_header()->set_targets_dtype(pb::DTYPE_INT64);
  bool open = writer->Write(request);
  const int blocks = Uniform(1, 6);
  for (int block = 0; open && block < blocks; ++block) {
    if (cancel && block == blocks / 2) break;
    const int64_t rows = Uniform(1, 32);
    request.mutable_block()->set_logits(RandomLogits(dtype, rows * vocab));
    request.mutable_block()->set_targets(
        RandomTargets(rows, vocab, pb::DTYPE_INT64));
    open = writer->Write(request);
    if (open) {
      figures_.bytes_evaluated +=
          request.block().logits().size() + request.block().targets().size();
    }
  }
  if (cancel) {
    context.TryCancel();
    Check("Evaluate (cancelled)", writer->Finish(), {Code::CANCELLED});
    return;
  }
  writer->WritesDone();
  const grpc::Status status = writer->Finish();
  if (with_deadline) {
    Check("Evaluate (deadline)", status, {Code::OK, Code::DEADLINE_EXCEEDED});
  } else {
    Check("Evaluate", status, {Code::OK});
  }
}

void SoakClient::DataEvaluate() {
  const int64_t vocab = Uniform(1, 512);
  const pb::DType dtype = Chance(50) ? pb::DTYPE_FLOAT32 : pb::DTYPE_BFLOAT16;
  const int count = Uniform(1, 3);
  const int mode = Uniform(0, 99);
  const bool short_frame = mode < 10;
  const bool cancel = mode >= 10 && mode < 25;
  std::string token;
  std::vector<int> fds = ConnectData(count, &token);
  if (fds.empty()) return;
  grpc::ClientContext context;
  bool with_deadline = false;
  if (!short_frame && !cancel) MaybeDeadline(&context, &with_deadline);
  pb::EvaluateResponse response;
  auto writer = stub_->Evaluate(&context, &response);
  pb::EvaluateRequest request;
  request.mutable_header()->set_vocab(vocab);
  request.mutable_header()->set_logits_dtype(dtype);
  request.mutable_header()->set_targets_dtype(pb::DTYPE_INT64);
  request.mutable_header()->set_data_token(token);
  request.mutable_header()->set_data_connections(count);
  if (writer->Write(request)) writer->WritesDone();
  // Every connection carries at least one block.
  std::vector<std::string> frames(static_cast<size_t>(count));
  const int blocks = Uniform(count, 6);
  int64_t rows_sent = 0;
  for (int block = 0; block < blocks; ++block) {
    const int64_t rows = Uniform(1, 32);
    std::string& into = frames[static_cast<size_t>(block % count)];
    for (int i = 0; i < 8; ++i) {
      into.push_back(static_cast<char>((rows >> (8 * i)) & 0xff));
    }
    into += RandomLogits(dtype, rows * vocab);
    into += RandomTargets(rows, vocab, pb::DTYPE_INT64);
    rows_sent += rows;
  }
  if (short_frame) frames.back().resize(frames.back().size() - 1);
  const grpc::Status status = SendParts(fds, token, frames, cancel, &context,
                                        [&] { return writer->Finish(); });
  if (!CheckData("Evaluate", status, cancel, short_frame, with_deadline)) {
    return;
  }
  figures_.bytes_evaluated +=
      rows_sent * vocab * (dtype == pb::DTYPE_FLOAT32 ? 4 : 2);
  if (response.rows() != rows_sent) {
    figures_.unexpected.push_back(
        absl::StrCat("client ", id_, " data Evaluate: ", response.rows(),
                     " rows of ", rows_sent));
  }
}

}  // namespace soak_test
}  // namespace lossd
