// Issue 6 soak: several clients drive a real in-process server on loopback
// with a random mix of Upload, Forward, Backward, Download, Evaluate and
// Release, cancelling streams midway and setting tight deadlines. Afterwards
// there must have been no unexpected status, no tensor and no reserved byte
// left, and bounded resident-memory growth.
//
// LOSSD_SOAK_CLIENTS (default 8), LOSSD_SOAK_SECONDS (default 10; 60 for the
// long run), LOSSD_TEST_SEED (default fixed) tune it.
#include <dirent.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/data_connection.h"
#include "common/float16.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "lossd/v1/lossd.grpc.pb.h"
#include "server/server.h"

namespace lossd {
namespace {

namespace pb = ::lossd::v1;
using Code = grpc::StatusCode;

int64_t EnvInt(const char* name, int64_t fallback) {
  const char* text = std::getenv(name);
  return text != nullptr ? std::strtoll(text, nullptr, 0) : fallback;
}

// Open file descriptors of this process (sockets included).
int OpenDescriptors() {
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return -1;
  int count = 0;
  while (readdir(dir) != nullptr) ++count;
  closedir(dir);
  return count - 3;  // ".", ".." and the directory's own descriptor
}

// What the open descriptors are, e.g. "socket x3, anon_inode:[eventfd] x2"
// (for a failure's message).
std::string DescriptorKinds() {
  std::map<std::string, int> kinds;
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return "?";
  while (const dirent* entry = readdir(dir)) {
    if (entry->d_name[0] == '.') continue;
    char target[256] = {};
    const std::string path = absl::StrCat("/proc/self/fd/", entry->d_name);
    if (readlink(path.c_str(), target, sizeof(target) - 1) < 0) continue;
    std::string kind = target;
    kind = kind.substr(0, kind.find(":["));  // socket:[123] -> socket
    ++kinds[kind];
  }
  closedir(dir);
  std::string out;
  for (const auto& [kind, count] : kinds) {
    absl::StrAppend(&out, out.empty() ? "" : ", ", kind, " x", count);
  }
  return out;
}

// Resident memory of this process (the server runs in it), in bytes.
int64_t ResidentBytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) == 0) {
      return std::strtoll(line.c_str() + 6, nullptr, 10) * 1024;
    }
  }
  return -1;
}

#if defined(__SANITIZE_ADDRESS__)
constexpr bool kSanitized = true;  // ASan's quarantine holds freed memory
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif
#else
constexpr bool kSanitized = false;
#endif

// What all clients did, summed.
struct Figures {
  int64_t requests = 0;
  int64_t ok = 0;
  int64_t expected_errors = 0;  // bad requests sent on purpose
  int64_t cancellations = 0;    // streams the client cancelled midway
  int64_t deadlines = 0;        // RPCs that ran into their deadline
  // RPCs that never left the client because its channel could not connect
  // at that moment (seen once in CI: a fresh loopback connection failed and
  // the default one-second-and-growing backoff failed every RPC for seconds
  // after). They reach no server, so they change nothing there; the client
  // then waits for its channel to reconnect, which must happen.
  int64_t connect_failures = 0;
  std::string first_connect_failure;
  int64_t bytes_uploaded = 0;
  int64_t bytes_downloaded = 0;
  int64_t bytes_evaluated = 0;
  std::vector<std::string> unexpected;

  void Add(const Figures& other) {
    requests += other.requests;
    ok += other.ok;
    expected_errors += other.expected_errors;
    cancellations += other.cancellations;
    deadlines += other.deadlines;
    connect_failures += other.connect_failures;
    if (first_connect_failure.empty()) {
      first_connect_failure = other.first_connect_failure;
    }
    bytes_uploaded += other.bytes_uploaded;
    bytes_downloaded += other.bytes_downloaded;
    bytes_evaluated += other.bytes_evaluated;
    unexpected.insert(unexpected.end(), other.unexpected.begin(),
                      other.unexpected.end());
  }
};

// A tensor one client owns.
struct Owned {
  std::string handle;
  pb::DType dtype = pb::DTYPE_FLOAT32;
  int64_t rows = 0;
  int64_t vocab = 0;  // 0 for targets
  bool gradient = false;
  pb::Reduction reduction = pb::REDUCTION_MEAN;
  bool materialized = false;
  double factor = 1.0;
  std::string bytes;  // what was uploaded, while it holds logits
  // A Download of it failed. A failure of the client's own making (it
  // cancelled, or its deadline passed) returns before the server learns of it
  // (asynchronously), so the server may still hold the read lease and an
  // in-place write may find the tensor busy, until one such write succeeds.
  // A status the server sent, OK or not, comes after its lease ended; any
  // failure counts here, as the client cannot always tell whose it was.
  bool maybe_read = false;
};

// One client: its own channel, random generator and tensors.
class SoakClient {
 public:
  SoakClient(const std::string& address, int data_port, int id, unsigned seed)
      : id_(id), data_port_(data_port), rng_(seed) {
    grpc::ChannelArguments args;
    // A distinct argument gives each client its own connection.
    args.SetInt("lossd.soak_client", id);
    // A failed connection attempt is retried after 100 ms, not gRPC's
    // default second (growing to two minutes).
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
    args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
    channel_ = grpc::CreateCustomChannel(
        address, grpc::InsecureChannelCredentials(), args);
    stub_ = pb::Lossd::NewStub(channel_);
  }

  void Run(absl::Time end) {
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

  const Figures& figures() const { return figures_; }

 private:
  static constexpr size_t kMaxOwned = 8;

  int Uniform(int low, int high) {
    return std::uniform_int_distribution<int>(low, high)(rng_);
  }
  bool Chance(int percent) { return Uniform(0, 99) < percent; }

  // The channel's connection could not be made when the RPC started: it was
  // never sent.
  static bool NotConnected(const grpc::Status& status) {
    return status.error_code() == Code::UNAVAILABLE &&
           status.error_message().rfind("failed to connect", 0) == 0;
  }

  // Waits until the channel is connected; false (and an unexpected failure)
  // if that takes longer than 10 s.
  bool Reconnect() {
    if (channel_->WaitForConnected(std::chrono::system_clock::now() +
                                   std::chrono::seconds(10))) {
      return true;
    }
    figures_.unexpected.push_back(
        absl::StrCat("client ", id_, ": no connection to the server in 10 s"));
    return false;
  }

  // Counts one RPC whose status must be one of `allowed`.
  void Check(const char* what, const grpc::Status& status,
             std::initializer_list<Code> allowed) {
    ++figures_.requests;
    const Code code = status.error_code();
    if (NotConnected(status)) {
      if (figures_.connect_failures++ == 0) {
        figures_.first_connect_failure = absl::StrCat(
            "client ", id_, " ", what, ": ", status.error_message());
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

  void MaybeDeadline(grpc::ClientContext* context, bool* with_deadline) {
    *with_deadline = Chance(10);
    if (*with_deadline) {
      context->set_deadline(std::chrono::system_clock::now() +
                            std::chrono::milliseconds(Uniform(1, 20)));
    }
  }

  std::string RandomLogits(pb::DType dtype, int64_t count) {
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
        x = dtype == pb::DTYPE_BFLOAT16 ? FloatToBF16(value)
                                        : FloatToHalf(value);
      }
      bytes.assign(reinterpret_cast<const char*>(values.data()), count * 2);
    }
    return bytes;
  }

  std::string RandomTargets(int64_t rows, int64_t vocab, pb::DType dtype) {
    std::vector<int64_t> targets(rows);
    for (int64_t& y : targets) {
      y = Chance(10) ? -100 : Uniform(0, static_cast<int>(vocab) - 1);
    }
    if (dtype == pb::DTYPE_INT64) {
      return std::string(reinterpret_cast<const char*>(targets.data()),
                         rows * 8);
    }
    std::vector<int32_t> narrow(targets.begin(), targets.end());
    return std::string(reinterpret_cast<const char*>(narrow.data()), rows * 4);
  }

  Owned* Pick(bool (*want)(const Owned&)) {
    std::vector<Owned*> candidates;
    for (Owned& owned : owned_) {
      if (want(owned)) candidates.push_back(&owned);
    }
    if (candidates.empty()) return nullptr;
    return candidates[Uniform(0, static_cast<int>(candidates.size()) - 1)];
  }

  // Logits of a random float dtype and shape (not uploaded yet).
  Owned RandomTensor() {
    static constexpr pb::DType kTypes[] = {
        pb::DTYPE_FLOAT32, pb::DTYPE_BFLOAT16, pb::DTYPE_FLOAT16};
    Owned tensor;
    tensor.dtype = kTypes[Uniform(0, 2)];
    tensor.rows = Uniform(1, 64);
    tensor.vocab = Uniform(1, 512);
    tensor.bytes = RandomLogits(tensor.dtype, tensor.rows * tensor.vocab);
    return tensor;
  }

  void Upload() {
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

  // Owns an uploaded tensor, which the server must describe as its size.
  void Keep(Owned tensor, const pb::TensorInfo& uploaded, const char* what) {
    tensor.handle = uploaded.handle();
    if (uploaded.bytes() != static_cast<int64_t>(tensor.bytes.size())) {
      figures_.unexpected.push_back(
          absl::StrCat("client ", id_, " ", what, ": wrong size"));
    }
    owned_.push_back(std::move(tensor));
  }

  // The bytes of a Download that ended OK: as many as its header said, and
  // the uploaded ones when they were asked for unconverted.
  void CheckDownloaded(const char* what, const Owned& tensor, pb::DType dtype,
                       const std::string& bytes, int64_t announced) {
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

  // One tensor as 2-4 stripes, each its own stream on its own thread (the
  // server joins them by upload_id). Sometimes one stripe is cancelled
  // midway: that stripe ends CANCELLED and every other ABORTED (at once, or
  // after the server's stripe timeout when the cancelled stream never got to
  // attach), and nothing is stored.
  void StripedUpload() {
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
    const bool lost =
        std::any_of(statuses.begin(), statuses.end(), NotConnected);
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

  // The first element of part `i` of `count` over `elements` elements (the
  // split of stripes and data connections).
  static int64_t PartStart(int64_t elements, int i, int count) {
    return elements * i / count;
  }

  // `count` sockets connected to the data port and a fresh token for them;
  // empty (and an unexpected failure) when that cannot be had.
  std::vector<int> ConnectData(int count, std::string* token) {
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

  // Sends parts[i] over data connection i (after its preamble), each on its
  // own thread; when `cancel`, the last connection sends nothing and the RPC
  // is cancelled afterwards (so it cannot complete first). Then `finish`
  // ends the RPC and the connections are closed.
  grpc::Status SendParts(const std::vector<int>& fds, const std::string& token,
                         const std::vector<std::string>& parts, bool cancel,
                         grpc::ClientContext* context,
                         const std::function<grpc::Status()>& finish) {
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

  // Counts the status of a transfer over data connections in the mode it
  // ran in: cancelled, with a short part (`broken`), with a tight deadline or
  // plain. True when it ended OK.
  bool CheckData(const std::string& what, const grpc::Status& status,
                 bool cancel, bool broken, bool with_deadline) {
    if (cancel) {
      Check((what + " (data, cancelled)").c_str(), status, {Code::CANCELLED});
    } else if (broken) {
      Check((what + " (data, short)").c_str(), status,
            {Code::INVALID_ARGUMENT});
    } else if (with_deadline) {
      Check((what + " (data, deadline)").c_str(), status,
            {Code::OK, Code::DEADLINE_EXCEEDED});
    } else {
      Check((what + " (data)").c_str(), status, {Code::OK});
    }
    return !cancel && !broken && status.ok();
  }

  // An Upload whose bytes go over 1-3 data connections. Sometimes one
  // connection ends short (INVALID_ARGUMENT), sometimes the last one never
  // sends and the RPC is cancelled (CANCELLED), sometimes the deadline is
  // tight; nothing is stored unless it ends OK.
  void DataUpload() {
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
          static_cast<size_t>(
              PartStart(elements, i + 1, count) * element_bytes - first)));
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

  // A Download whose bytes come over 1-3 data connections. Sometimes the RPC
  // is cancelled once the header came, sometimes the client closes its
  // connections unread (the server's sends may fail: UNAVAILABLE, or the
  // bytes fit the socket buffers: OK), sometimes the deadline is tight.
  void DataDownload() {
    Owned* tensor = Pick([](const Owned&) { return true; });
    if (tensor == nullptr) return DataUpload();
    static constexpr pb::DType kTypes[] = {
        pb::DTYPE_UNSPECIFIED, pb::DTYPE_FLOAT32, pb::DTYPE_BFLOAT16,
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
      Check("Download (data, abandoned)", status,
            {Code::OK, Code::UNAVAILABLE});
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

  void Forward() {
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
    static constexpr pb::GradientMode kModes[] = {
        pb::GRADIENT_MODE_IN_PLACE, pb::GRADIENT_MODE_OUT_OF_PLACE,
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

  void Backward() {
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

  void Download() {
    Owned* tensor = Pick([](const Owned&) { return true; });
    if (tensor == nullptr) return Upload();
    static constexpr pb::DType kTypes[] = {
        pb::DTYPE_UNSPECIFIED, pb::DTYPE_FLOAT32, pb::DTYPE_BFLOAT16,
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

  void Evaluate() {
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

  // An Evaluate whose blocks go over 1-3 data connections (block b over
  // connection b mod K, each one's frames in order). Sometimes a frame is cut
  // short (INVALID_ARGUMENT), sometimes the RPC is cancelled while the last
  // connection has not sent its frames (CANCELLED), sometimes the deadline is
  // tight.
  void DataEvaluate() {
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

  void Release(bool any) {
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

  // Requests that must fail, mixed in with the rest.
  void BadRequest() {
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
        const grpc::Status status =
            stub_->Forward(&context, request, &response);
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

  void Inspect() {
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

  const int id_;
  const int data_port_;
  std::mt19937 rng_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<pb::Lossd::Stub> stub_;
  int64_t stripe_uploads_ = 0;
  std::vector<Owned> owned_;
  Figures figures_;
};

TEST(SoakTest, MixedTrafficWithCancellationsLeavesNothingBehind) {
  const int clients = static_cast<int>(EnvInt("LOSSD_SOAK_CLIENTS", 8));
  const absl::Duration duration =
      absl::Seconds(EnvInt("LOSSD_SOAK_SECONDS", 10));
  const unsigned seed =
      static_cast<unsigned>(EnvInt("LOSSD_TEST_SEED", 20240601));
  SCOPED_TRACE(::testing::Message() << "seed " << seed);

  ServerConfig config;
  config.host = "127.0.0.1";
  config.port = 0;
  config.device = "cpu";
  config.memory_budget = int64_t{512} << 20;  // never the limit here
  config.threads = 2;
  config.drain_timeout = absl::Seconds(20);
  // A striped upload whose cancelled stripe never attached waits this long.
  config.stripe_timeout = absl::Seconds(2);
  // Data connections on a free port. A connection whose RPC ended before
  // the server registered its token (a tight deadline) waits for it up to
  // min(data_timeout, 10 s): 5 s here.
  config.data_port = 0;
  config.data_timeout = absl::Seconds(5);
  auto server = LossdServer::Start(config);
  ASSERT_TRUE(server.ok()) << server.status();
  const int fds_start = OpenDescriptors();

  const int64_t rss_start = ResidentBytes();
  const absl::Time start = absl::Now();
  const absl::Time end = start + duration;
  std::vector<std::unique_ptr<SoakClient>> soak_clients;
  for (int id = 0; id < clients; ++id) {
    soak_clients.push_back(std::make_unique<SoakClient>(
        (*server)->address(), (*server)->data_port(), id,
        seed + static_cast<unsigned>(id)));
  }
  std::vector<std::thread> threads;
  for (auto& client : soak_clients) {
    threads.emplace_back([&client, end] { client->Run(end); });
  }
  // Resident memory once warm (a quarter in) and at its highest after.
  absl::SleepFor(duration / 4);
  const int64_t rss_warm = ResidentBytes();
  int64_t rss_peak = rss_warm;
  while (absl::Now() < end) {
    absl::SleepFor(std::min(absl::Milliseconds(250), end - absl::Now()));
    rss_peak = std::max(rss_peak, ResidentBytes());
  }
  for (std::thread& thread : threads) thread.join();
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);

  Figures total;
  for (auto& client : soak_clients) total.Add(client->figures());
  // Every socket of the clients' channels and of the data connections gets
  // closed (the server closes its ends as it sees them end), and cancelled
  // transfers leave the data plane's registry at its next sweep.
  soak_clients.clear();
  int fds_end = OpenDescriptors();
  int registered = (*server)->data_plane()->registered();
  const absl::Time give_up = absl::Now() + absl::Seconds(20);
  while ((fds_end > fds_start || registered > 0) && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(50));
    fds_end = OpenDescriptors();
    registered = (*server)->data_plane()->registered();
  }
  // An Upload whose deadline expired just as the server committed it is a
  // tensor the client never got the handle of (the reply raced the client's
  // timer; the server saw no cancellation). Only those may remain: they are
  // counted and released here. Anything else left over is a leak.
  int64_t orphans = 0;
  for (const TensorRecord& info : (*server)->store()->List(kDefaultTenant)) {
    if (info.label.find(" deadline") != std::string::npos) {
      ++orphans;
      EXPECT_TRUE(
          (*server)->store()->Release(kDefaultTenant, info.handle).ok());
    } else {
      ADD_FAILURE() << "left behind: " << info.handle << " '" << info.label
                    << "' state " << static_cast<int>(info.state) << " "
                    << info.bytes << " bytes";
    }
  }
  // Uploads and Evaluates are torn down when the server sees their end.
  const bool drained = (*server)->store()->AwaitUsedBytes(0, absl::Seconds(30));
  const StoreStats stats = (*server)->store()->Stats();
  const int64_t rss_end = ResidentBytes();

  constexpr double kMiB = 1 << 20;
  const std::string summary = absl::StrFormat(
      "soak: %d clients x %.1f s: %d requests (%.0f/s), %d ok, %d expected "
      "errors, %d cancellations, %d deadlines, %d not sent (no connection), "
      "%d unexpected; %.1f MiB up, "
      "%.1f MiB down, %.1f MiB evaluated; %d upload-deadline orphans; left: "
      "%d tensors, %d bytes; %d data connections completed, %d transfers "
      "registered; descriptors start %d, end %d; RSS "
      "start %.1f MiB, warm %.1f MiB, peak %.1f MiB, end %.1f MiB%s",
      clients, seconds, total.requests, total.requests / seconds, total.ok,
      total.expected_errors, total.cancellations, total.deadlines,
      total.connect_failures, total.unexpected.size(),
      total.bytes_uploaded / kMiB, total.bytes_downloaded / kMiB,
      total.bytes_evaluated / kMiB, orphans, stats.tensors, stats.used_bytes,
      (*server)->data_plane()->completed(), registered, fds_start, fds_end,
      rss_start / kMiB, rss_warm / kMiB, rss_peak / kMiB, rss_end / kMiB,
      kSanitized ? " (ASan)" : "");
  std::printf("%s\n", summary.c_str());
  if (!total.first_connect_failure.empty()) {
    std::printf("soak: first RPC not sent: %s\n",
                total.first_connect_failure.c_str());
  }
  ::testing::Test::RecordProperty("summary", summary);

  for (size_t i = 0; i < std::min<size_t>(total.unexpected.size(), 20); ++i) {
    ADD_FAILURE() << total.unexpected[i];
  }
  EXPECT_TRUE(total.unexpected.empty());
  EXPECT_GT(total.ok, 0);
  EXPECT_GT(total.cancellations, 0);
  EXPECT_TRUE(drained);
  EXPECT_GT((*server)->data_plane()->completed(), 0);
  EXPECT_EQ(registered, 0);
  EXPECT_LE(fds_end, fds_start) << DescriptorKinds();
  EXPECT_EQ(stats.tensors, 0);
  EXPECT_EQ(stats.used_bytes, 0);
  // Growth from warm to the end: a leak of anything per request would show
  // up here; steady-state buffers (gRPC, allocator arenas) do not grow.
  if (!kSanitized) {
    EXPECT_LT(rss_peak - rss_warm, int64_t{96} << 20) << summary;
    EXPECT_LT(rss_end - rss_warm, int64_t{96} << 20) << summary;
  }
}

}  // namespace
}  // namespace lossd
