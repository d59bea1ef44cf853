// service_bench's measured ways: raw TCP, uploads on raw gRPC channels (as
// lossd::Client sends them, byte for byte), Evaluate in raw blocks, the
// client workload of the Python comparison, the bare kernel and the pinned
// host-to-device copy.
#ifndef LOSSD_BENCH_SERVICE_BENCH_WAYS_H_
#define LOSSD_BENCH_SERVICE_BENCH_WAYS_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "client/client.h"
#include "grpcpp/grpcpp.h"
#include "kernels/cuda/cross_entropy_cuda.h"
#include "lossd/v1/lossd.grpc.pb.h"

namespace service_bench {

namespace pb = ::lossd::v1;

// Raw TCP over loopback, `connections` connections at once, each carrying its
// share of `data` (the stripes of a striped upload) from its own thread, in
// `chunk` writes; 1 connection is the one-stream baseline.
double RawTcpStripedSeconds(const std::string& data, size_t chunk,
                            int connections);

// One Upload stream of `data` on `channel` in `chunk`-byte messages, as
// SendUpload (service_bench_ways.cc); *seconds gets its time. Returns the
// handle (empty from the discarding server).
std::string RawUpload(const std::shared_ptr<grpc::Channel>& channel,
                      pb::DType dtype, std::vector<int64_t> shape,
                      const std::string& data, size_t chunk, double* seconds);

// A striped upload as lossd::Client sends one (client/client_uploads.cc,
// Client::UploadStriped): stripe i of K on channels[i] from its own thread,
// carrying elements [floor(i * E / K), floor((i + 1) * E / K)).
std::string RawStripedUpload(
    const std::vector<std::shared_ptr<grpc::Channel>>& channels,
    pb::DType dtype, std::vector<int64_t> shape, int64_t element_bytes,
    const std::string& data, size_t chunk, double* seconds);

// Evaluate with blocks of `block_rows` rows sent as raw messages whose logits
// and targets are views of the caller's memory (no client-side copies, as
// RawUpload): the server's pipeline is what is measured.
// `*response` gets the server's answer (loss, and its copy and kernel time).
double EvaluateSeconds(const std::shared_ptr<grpc::Channel>& channel,
                       const std::string& logits, const std::string& targets,
                       int64_t rows, int64_t vocab, int64_t block_rows,
                       pb::EvaluateResponse* response);

// The client workload of the Python comparison, timed per step.
struct Workload {
  double upload = 0;    // logits and targets
  double forward = 0;   // in place, mean
  double backward = 0;  // grad_output 0.5
  double download = 0;  // the gradient, as stored (bf16), factor applied
  double fill = 0;      // making the destination buffer (in the total)
  double total = 0;
  double loss = 0;
  uint64_t checksum = 0;  // of the downloaded gradient's bits
};

// The workload on `channel` through raw RPCs; the gradient's bytes go to
// *gradient_out.
Workload RunWorkload(const std::shared_ptr<grpc::Channel>& channel,
                     const std::string& logits, const std::string& targets,
                     int64_t rows, int64_t vocab, size_t chunk,
                     std::string* gradient_out);

// The same workload through lossd::Client with its defaults (lossd only:
// large tensors go up and the gradient comes back over data connections).
Workload RunClientWorkload(lossd::Client* client, const std::string& logits,
                           const std::string& targets, int64_t rows,
                           int64_t vocab, std::string* gradient_out);

// The bare kernel on device copies of the same inputs, timed with events.
double KernelSeconds(const std::string& logits, const std::string& targets,
                     int64_t rows, int64_t vocab, lossd::GradientMode mode,
                     int repeats);

// The device's host-to-device copy rate from pinned memory, the reference for
// the server's copy times: `total` bytes in `piece` pieces from two pinned
// buffers, one stream, as the device's uploads move them (without the gather
// into the pinned buffers). Median of `repeats`.
double PinnedCopyGBs(size_t piece, size_t total, int repeats);

}  // namespace service_bench

#endif  // LOSSD_BENCH_SERVICE_BENCH_WAYS_H_
