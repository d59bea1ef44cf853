// The soak client's downloads, over the stream or over data connections,
// sometimes cancelled, abandoned or under a tight deadline, and the check of
// the bytes that came back.
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

void SoakClient::CheckDownloaded(const char* what, const Owned& tensor,
                                 pb::DType dtype, const std::string& bytes,
                                 int64_t announced) {
  if (static_cast<int64_t>(bytes.size()) != announced) {
    figures_.unexpected.push_back(
        absl::StrCat("client ", id_, " ", what, ": ", bytes.size(),
                     " bytes, header says ", announced));
  } else if (!tensor.bytes.empty() &&
             (dtype == pb::DTYPE_UNSPECIFIED || dtype == tensor.dtype) &&
             bytes != tensor.bytes) {
    figures_.unexpected.push_back(
        absl::StrCat("client ", id_, " ", what, ": bytes differ"));
  }
}

void SoakClient::DataDownload() {
  Owned* tensor = Pick([](const Owned&) { return true; });
  if (tensor == nullptr) return DataUpload();
  static constexpr pb::DType kTypes[] = {pb::DTYPE_UNSPECIFIED,
                                         pb::DTYPE_FLOAT32, pb::DTYPE_BFLOAT16,
                                         pb::DTYPE_FLOAT16};
  const int count = Uniform(1, 3);
  const int mode = Uniform(0, 99);
  const bool cancel = mode < 15;
  const bool abandon = mode >= 15 && mode < 25;
  std::string token;
  std::vector<int> fds = ConnectData(count, &token);
  if (fds.empty()) return;
  for (int i = 0; i < count; ++i) {
    SendOverDataConnection(fds[static_cast<size_t>(i)], token, i, nullptr, 0,
                           nullptr)
        .IgnoreError();
  }
  pb::DownloadRequest request;
  request.set_handle(tensor->handle);
  request.set_dtype(tensor->vocab > 0 ? kTypes[Uniform(0, 3)]
                                      : pb::DTYPE_UNSPECIFIED);
  request.set_data_token(token);
  request.set_data_connections(count);
  grpc::ClientContext context;
  bool with_deadline = false;
  if (!cancel && !abandon) MaybeDeadline(&context, &with_deadline);
  auto reader = stub_->Download(&context, request);
  pb::DownloadResponse response;
  const bool headed = reader->Read(&response) && response.has_header();
  const int64_t total = headed ? response.header().bytes() : 0;
  const int64_t elements =
      tensor->rows * (tensor->vocab > 0 ? tensor->vocab : 1);
  std::string bytes(static_cast<size_t>(total), '\0');
  std::vector<absl::Status> received(static_cast<size_t>(count));
  if (cancel) context.TryCancel();
  if (abandon) {
    for (int fd : fds) close(fd);
    fds.clear();
  }
  if (headed && !cancel && !abandon && total % elements == 0) {
    const int64_t element_bytes = total / elements;
    std::vector<std::thread> receivers;
    for (int i = 0; i < count; ++i) {
      receivers.emplace_back([&, i] {
        const int64_t first = PartStart(elements, i, count) * element_bytes;
        const int64_t end = PartStart(elements, i + 1, count) * element_bytes;
        received[static_cast<size_t>(i)] = ReceiveOverDataConnection(
            fds[static_cast<size_t>(i)], bytes.data() + first,
            static_cast<size_t>(end - first), nullptr);
      });
    }
    for (std::thread& receiver : receivers) receiver.join();
  }
  while (reader->Read(&response)) {
  }
  const grpc::Status status = reader->Finish();
  for (int fd : fds) close(fd);
  if (!status.ok()) tensor->maybe_read = true;
  if (cancel) {
    Check("Download (data, cancelled)", status, {Code::OK, Code::CANCELLED});
    return;
  }
  if (abandon) {
    Check("Download (data, abandoned)", status, {Code::OK, Code::UNAVAILABLE});
    return;
  }
  if (with_deadline) {
    Check("Download (data, deadline)", status,
          {Code::OK, Code::DEADLINE_EXCEEDED});
  } else {
    Check("Download (data)", status, {Code::OK});
  }
  if (!status.ok()) return;
  for (const absl::Status& one : received) {
    if (!one.ok()) {
      figures_.unexpected.push_back(
          absl::StrCat("client ", id_, " data Download: ", one.ToString()));
      return;
    }
  }
  figures_.bytes_downloaded += total;
  if (!headed || total % elements != 0) {
    figures_.unexpected.push_back(absl::StrCat(
        "client ", id_, " data Download: header says ", total, " bytes"));
    return;
  }
  CheckDownloaded("data Download", *tensor, request.dtype(), bytes, total);
}

void SoakClient::Download() {
  Owned* tensor = Pick([](const Owned&) { return true; });
  if (tensor == nullptr) return Upload();
  static constexpr pb::DType kTypes[] = {pb::DTYPE_UNSPECIFIED,
                                         pb::DTYPE_FLOAT32, pb::DTYPE_BFLOAT16,
                                         pb::DTYPE_FLOAT16};
  pb::DownloadRequest request;
  request.set_handle(tensor->handle);
  request.set_dtype(kTypes[Uniform(0, 3)]);
  request.set_chunk_bytes(Chance(50) ? 0 : Uniform(8, 65536));
  const bool cancel = Chance(15);
  grpc::ClientContext context;
  bool with_deadline = false;
  if (!cancel) MaybeDeadline(&context, &with_deadline);
  auto reader = stub_->Download(&context, request);
  pb::DownloadResponse response;
  std::string bytes;
  int64_t expected = -1;
  int messages = 0;
  const int cancel_after = Uniform(1, 3);
  while (reader->Read(&response)) {
    if (response.has_header()) {
      expected = response.header().bytes();
    } else {
      bytes += response.chunk();
    }
    if (cancel && ++messages == cancel_after) {
      context.TryCancel();
      break;
    }
  }
  if (cancel) {
    while (reader->Read(&response)) {
    }
  }
  figures_.bytes_downloaded += static_cast<int64_t>(bytes.size());
  const grpc::Status status = reader->Finish();
  if (!status.ok()) tensor->maybe_read = true;
  if (cancel) {
    // The whole tensor may have arrived before the cancellation.
    Check("Download (cancelled)", status, {Code::OK, Code::CANCELLED});
    return;
  }
  if (with_deadline) {
    Check("Download (deadline)", status, {Code::OK, Code::DEADLINE_EXCEEDED});
  } else {
    Check("Download", status, {Code::OK});
  }
  if (!status.ok()) return;
  CheckDownloaded("Download", *tensor, request.dtype(), bytes, expected);
}

}  // namespace soak_test
}  // namespace lossd
