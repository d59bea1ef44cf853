// service_bench's setup: timing and failing, the server that discards
// uploads (the floor lossd's upload is compared with), channels of their own
// TCP connection, bench/python_server.py as a child, the device pool's peak.
#ifndef LOSSD_BENCH_SERVICE_BENCH_SETUP_H_
#define LOSSD_BENCH_SERVICE_BENCH_SETUP_H_

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/declare.h"
#include "grpcpp/grpcpp.h"
#include "lossd/v1/lossd.grpc.pb.h"

ABSL_DECLARE_FLAG(std::string, device);
ABSL_DECLARE_FLAG(std::string, python_server);
ABSL_DECLARE_FLAG(std::string, python);
ABSL_DECLARE_FLAG(std::string, stubs);
ABSL_DECLARE_FLAG(std::string, grpc_args);

namespace service_bench {

namespace pb = ::lossd::v1;
using Clock = std::chrono::steady_clock;

// Seconds since `since`.
double Seconds(Clock::time_point since);

// The median of `values` (the upper one of an even count).
double Median(std::vector<double> values);

// Prints `what` and exits: a benchmark that cannot measure stops.
void Die(const std::string& what);

// Dies with `what` and the status's message unless it is OK.
void Check(const grpc::Status& status, const char* what);

// A server with lossd's Upload method that reads every message and drops it:
// the same gRPC stack, channel settings, client and read pattern as lossd,
// without the store and the device. Upload to it is the floor lossd's upload
// is compared with (the host-to-device copy hidden = within 1.1x of it). With
// `copy`, a control: each message is first copied into host memory on the
// reaction's thread (what lossd's staging copy costs there).
class DiscardUploadReactor final
    : public grpc::ServerReadReactor<grpc::ByteBuffer> {
 public:
  DiscardUploadReactor(grpc::ByteBuffer* response, bool copy)
      : response_(response) {
    if (copy) sink_.assign(kSinkBytes, 1);
    StartRead(&buffer_);
  }
  void OnReadDone(bool ok) override {
    if (!ok) {
      bool own_buffer = false;
      grpc::SerializationTraits<pb::UploadResponse>::Serialize(
          pb::UploadResponse(), response_, &own_buffer);
      Finish(grpc::Status::OK);
      return;
    }
    bytes_ += buffer_.Length();
    if (!sink_.empty()) {
      std::vector<grpc::Slice> slices;
      if (buffer_.Dump(&slices).ok()) {
        for (const grpc::Slice& slice : slices) {
          for (size_t at = 0; at < slice.size();) {
            const size_t n = std::min(slice.size() - at, kSinkBytes - filled_);
            std::memcpy(sink_.data() + filled_, slice.begin() + at, n);
            at += n;
            filled_ = (filled_ + n) % kSinkBytes;
          }
        }
      }
    }
    buffer_.Clear();
    StartRead(&buffer_);
  }
  void OnDone() override { delete this; }

 private:
  static constexpr size_t kSinkBytes = 4 << 20;  // lossd's staging buffer
  grpc::ByteBuffer* const response_;
  grpc::ByteBuffer buffer_;
  size_t bytes_ = 0;
  std::vector<char> sink_;
  size_t filled_ = 0;
};

class DiscardService final : public pb::Lossd::WithRawCallbackMethod_Upload<
                                 pb::Lossd::CallbackService> {
 public:
  explicit DiscardService(bool copy) : copy_(copy) {}
  grpc::ServerReadReactor<grpc::ByteBuffer>* Upload(
      grpc::CallbackServerContext* /*context*/,
      grpc::ByteBuffer* response) override {
    return new DiscardUploadReactor(response, copy_);
  }

 private:
  const bool copy_;
};

// The --grpc_args pairs, for a ChannelArguments or a ServerBuilder.
std::vector<std::pair<std::string, int>> ExtraGrpcArgs();

// A channel of its own TCP connection (`connection` tells the channels of
// one striped upload apart, as lossd::Client does).
std::shared_ptr<grpc::Channel> Connect(const std::string& address,
                                       int connection = 0);

// Channels for `connections` stripes, each of its own TCP connection.
std::vector<std::shared_ptr<grpc::Channel>> ConnectStripes(
    const std::string& address, int count);

// bench/python_server.py as a child process on 127.0.0.1:0; the port comes
// back through a file. Returns the pid (0 on failure) and sets `address`.
pid_t StartPython(std::string* address);

// The default device memory pool's high-water mark (bytes), and its reset.
int64_t PoolHighWater();
void ResetPoolHighWater();

}  // namespace service_bench

#endif  // LOSSD_BENCH_SERVICE_BENCH_SETUP_H_
