// The soak client's uploads: one stream, striped over several streams, or
// over data connections, each sometimes cancelled midway, cut short or
// under a tight deadline.
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

void SoakClient::Upload() {
  if (owned_.size() >= kMaxOwned) Release(/*any=*/true);
  Owned tensor = RandomTensor();
  const bool cancel = Chance(15);
  grpc::ClientContext context;
  bool with_deadline = false;
  if (!cancel) MaybeDeadline(&context, &with_deadline);
  pb::UploadResponse response;
  auto writer = stub_->Upload(&context, &response);
  pb::UploadRequest request;
  request.mutable_header()->set_dtype(tensor.dtype);
  request.mutable_header()->add_shape(tensor.rows);
  request.mutable_header()->add_shape(tensor.vocab);
  request.mutable_header()->set_label(
      absl::StrCat("soak ", id_, cancel ? " cancelled" : "",
                   with_deadline ? " deadline" : ""));
  bool open = writer->Write(request);
  const size_t chunk = static_cast<size_t>(Uniform(1, 65536));
  const size_t cancel_at = cancel ? tensor.bytes.size() / 2 : SIZE_MAX;
  for (size_t offset = 0; open && offset < tensor.bytes.size();
       offset += chunk) {
    if (offset >= cancel_at) break;
    request.set_chunk(tensor.bytes.substr(offset, chunk));
    open = writer->Write(request);
    if (open) figures_.bytes_uploaded += request.chunk().size();
  }
  if (cancel) {
    context.TryCancel();
    Check("Upload (cancelled)", writer->Finish(), {Code::CANCELLED});
    return;
  }
  writer->WritesDone();
  const grpc::Status status = writer->Finish();
  if (with_deadline) {
    Check("Upload (deadline)", status, {Code::OK, Code::DEADLINE_EXCEEDED});
  } else {
    Check("Upload", status, {Code::OK});
  }
  if (!status.ok()) return;
  Keep(std::move(tensor), response.tensor(), "Upload");
}

void SoakClient::StripedUpload() {
  if (owned_.size() >= kMaxOwned) Release(/*any=*/true);
  Owned tensor = RandomTensor();
  const int count = Uniform(2, 4);
  const int cancelled = Chance(15) ? Uniform(0, count - 1) : -1;
  const int64_t elements = tensor.rows * tensor.vocab;
  const int64_t element_bytes =
      static_cast<int64_t>(tensor.bytes.size()) / elements;
  const size_t chunk = static_cast<size_t>(Uniform(1, 65536));
  pb::TensorHeader header;
  header.set_dtype(tensor.dtype);
  header.add_shape(tensor.rows);
  header.add_shape(tensor.vocab);
  header.set_label(absl::StrCat("soak ", id_, " striped",
                                cancelled >= 0 ? " cancelled" : ""));
  header.mutable_stripe()->set_upload_id(
      absl::StrCat("soak-", id_, "-", ++stripe_uploads_));
  header.mutable_stripe()->set_count(count);
  std::vector<grpc::Status> statuses(static_cast<size_t>(count));
  std::vector<pb::UploadResponse> responses(static_cast<size_t>(count));
  std::vector<int64_t> sent(static_cast<size_t>(count), 0);
  std::vector<std::thread> threads;
  for (int i = 0; i < count; ++i) {
    threads.emplace_back([&, i] {
      const int64_t first = elements * i / count * element_bytes;
      const int64_t end = elements * (i + 1) / count * element_bytes;
      grpc::ClientContext context;
      auto writer = stub_->Upload(&context, &responses[i]);
      pb::UploadRequest request;
      *request.mutable_header() = header;
      request.mutable_header()->mutable_stripe()->set_index(i);
      bool open = writer->Write(request);
      // The cancelled stripe stops short of its last half (whole
      // elements), so it can never complete before the cancel.
      const int64_t stop =
          i == cancelled
              ? first + (end - first) / 2 / element_bytes * element_bytes
              : end;
      for (int64_t offset = first; open && offset < stop;) {
        const int64_t n =
            std::min<int64_t>(static_cast<int64_t>(chunk), stop - offset);
        request.set_chunk(tensor.bytes.substr(static_cast<size_t>(offset),
                                              static_cast<size_t>(n)));
        open = writer->Write(request);
        if (open) sent[i] += n;
        offset += n;
      }
      if (i == cancelled) {
        context.TryCancel();
      } else {
        writer->WritesDone();
      }
      statuses[i] = writer->Finish();
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (int64_t n : sent) figures_.bytes_uploaded += n;
  // A stripe that could not be sent (no connection) fails the others too.
  const bool lost = std::any_of(statuses.begin(), statuses.end(), NotConnected);
  for (int i = 0; i < count; ++i) {
    if (cancelled < 0 && !lost) {
      Check("Upload (stripe)", statuses[i], {Code::OK});
    } else if (i == cancelled) {
      Check("Upload (stripe, cancelled)", statuses[i], {Code::CANCELLED});
    } else {
      Check("Upload (stripe, another cancelled or not sent)", statuses[i],
            {Code::ABORTED});
    }
  }
  if (cancelled >= 0 || lost || !statuses[0].ok()) return;
  for (int i = 1; i < count; ++i) {
    if (responses[i].tensor().handle() != responses[0].tensor().handle()) {
      figures_.unexpected.push_back(
          absl::StrCat("client ", id_,
                       " striped Upload: stripes returned different "
                       "handles"));
    }
  }
  Keep(std::move(tensor), responses[0].tensor(), "striped Upload");
}

int64_t SoakClient::PartStart(int64_t elements, int i, int count) {
  return elements * i / count;
}

std::vector<int> SoakClient::ConnectData(int count, std::string* token) {
  absl::StatusOr<std::string> drawn = RandomDataToken();
  if (!drawn.ok()) {
    figures_.unexpected.push_back(drawn.status().ToString());
    return {};
  }
  *token = *std::move(drawn);
  std::vector<int> fds;
  for (int i = 0; i < count; ++i) {
    absl::StatusOr<int> fd = ConnectDataPort(
        "127.0.0.1", data_port_, absl::Seconds(5), absl::Seconds(10));
    if (!fd.ok()) {
      figures_.unexpected.push_back(absl::StrCat(
          "client ", id_, " data connection: ", fd.status().ToString()));
      for (int open : fds) close(open);
      return {};
    }
    fds.push_back(*fd);
  }
  return fds;
}

grpc::Status SoakClient::SendParts(
    const std::vector<int>& fds, const std::string& token,
    const std::vector<std::string>& parts, bool cancel,
    grpc::ClientContext* context, const std::function<grpc::Status()>& finish) {
  const size_t sending = cancel ? parts.size() - 1 : parts.size();
  std::vector<std::thread> senders;
  for (size_t i = 0; i < sending; ++i) {
    senders.emplace_back([&, i] {
      // A failed send is the RPC's to explain.
      SendOverDataConnection(fds[i], token, static_cast<int>(i),
                             parts[i].data(), parts[i].size(), nullptr)
          .IgnoreError();
    });
  }
  for (std::thread& sender : senders) sender.join();
  if (cancel) context->TryCancel();
  const grpc::Status status = finish();
  for (int fd : fds) close(fd);
  return status;
}

bool SoakClient::CheckData(const std::string& what, const grpc::Status& status,
                           bool cancel, bool broken, bool with_deadline) {
  if (cancel) {
    Check((what + " (data, cancelled)").c_str(), status, {Code::CANCELLED});
  } else if (broken) {
    Check((what + " (data, short)").c_str(), status, {Code::INVALID_ARGUMENT});
  } else if (with_deadline) {
    Check((what + " (data, deadline)").c_str(), status,
          {Code::OK, Code::DEADLINE_EXCEEDED});
  } else {
    Check((what + " (data)").c_str(), status, {Code::OK});
  }
  return !cancel && !broken && status.ok();
}

void SoakClient::DataUpload() {
  if (owned_.size() >= kMaxOwned) Release(/*any=*/true);
  Owned tensor = RandomTensor();
  const int count = Uniform(1, 3);
  const int mode = Uniform(0, 99);
  const bool short_part = mode < 10;
  const bool cancel = mode >= 10 && mode < 25;
  std::string token;
  std::vector<int> fds = ConnectData(count, &token);
  if (fds.empty()) return;
  grpc::ClientContext context;
  bool with_deadline = false;
  if (!short_part && !cancel) MaybeDeadline(&context, &with_deadline);
  pb::UploadResponse response;
  auto writer = stub_->Upload(&context, &response);
  pb::UploadRequest request;
  pb::TensorHeader* header = request.mutable_header();
  header->set_dtype(tensor.dtype);
  header->add_shape(tensor.rows);
  header->add_shape(tensor.vocab);
  header->set_data_token(token);
  header->set_data_connections(count);
  header->set_label(absl::StrCat("soak ", id_, " data",
                                 cancel ? " cancelled" : "",
                                 with_deadline ? " deadline" : ""));
  if (writer->Write(request)) writer->WritesDone();
  const int64_t elements = tensor.rows * tensor.vocab;
  const int64_t element_bytes =
      static_cast<int64_t>(tensor.bytes.size()) / elements;
  std::vector<std::string> parts;
  for (int i = 0; i < count; ++i) {
    const int64_t first = PartStart(elements, i, count) * element_bytes;
    parts.push_back(tensor.bytes.substr(
        static_cast<size_t>(first),
        static_cast<size_t>(PartStart(elements, i + 1, count) * element_bytes -
                            first)));
  }
  // The last part always holds an element: half of it is short.
  if (short_part) parts.back().resize(parts.back().size() / 2);
  const grpc::Status status = SendParts(fds, token, parts, cancel, &context,
                                        [&] { return writer->Finish(); });
  if (!CheckData("Upload", status, cancel, short_part, with_deadline)) {
    return;
  }
  figures_.bytes_uploaded += static_cast<int64_t>(tensor.bytes.size());
  Keep(std::move(tensor), response.tensor(), "data Upload");
}

}  // namespace soak_test
}  // namespace lossd
