// Service benchmark: what the gRPC service adds on top of the CUDA kernel.
// Starts lossd in process on 127.0.0.1:0 with the CUDA device and measures,
// for one resident [rows, vocab] bf16 handle: upload throughput against raw
// TCP over loopback, Forward RPC time against the bare kernel (CUDA events),
// Backward RPC time, download and Evaluate throughput, peak device memory.
#include <arpa/inet.h>
#include <cuda_runtime_api.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_format.h"
#include "grpcpp/grpcpp.h"
#include "kernels/cpu/float16.h"
#include "kernels/cuda/cross_entropy_cuda.h"
#include "lossd/v1/lossd.grpc.pb.h"
#include "server/server.h"

ABSL_FLAG(int64_t, rows, 16384, "rows of the logits");
ABSL_FLAG(int64_t, vocab, 131072, "vocabulary");
ABSL_FLAG(int64_t, chunk_bytes, 4 << 20, "upload/download chunk");
ABSL_FLAG(int, repeats, 10, "timed runs per measurement");
ABSL_FLAG(std::string, out, "", "append a markdown summary here");

namespace pb = ::lossd::v1;
using Clock = std::chrono::steady_clock;

namespace {

double Seconds(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}

double Median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

void Die(const std::string& what) {
  std::fprintf(stderr, "service_bench: %s\n", what.c_str());
  std::exit(1);
}

void Check(const grpc::Status& status, const char* what) {
  if (!status.ok())
    Die(absl::StrFormat("%s: %s", what, status.error_message()));
}

// Raw TCP over loopback: one connection, `chunk` writes of `data`.
double RawTcpSeconds(const std::string& data, size_t chunk) {
  const int listener = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address = {};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(address);
  if (bind(listener, reinterpret_cast<sockaddr*>(&address), length) != 0 ||
      listen(listener, 1) != 0 ||
      getsockname(listener, reinterpret_cast<sockaddr*>(&address), &length) !=
          0) {
    Die("raw tcp: cannot listen");
  }
  std::thread receiver([listener, total = data.size(), chunk] {
    const int connection = accept(listener, nullptr, nullptr);
    std::vector<char> buffer(chunk);
    size_t received = 0;
    while (received < total) {
      const ssize_t n = read(connection, buffer.data(), buffer.size());
      if (n <= 0) break;
      received += static_cast<size_t>(n);
    }
    close(connection);
  });
  const int sender = socket(AF_INET, SOCK_STREAM, 0);
  if (connect(sender, reinterpret_cast<sockaddr*>(&address), length) != 0) {
    Die("raw tcp: cannot connect");
  }
  const auto start = Clock::now();
  for (size_t at = 0; at < data.size();) {
    const ssize_t n =
        write(sender, data.data() + at, std::min(chunk, data.size() - at));
    if (n <= 0) Die("raw tcp: write failed");
    at += static_cast<size_t>(n);
  }
  shutdown(sender, SHUT_WR);
  receiver.join();
  const double seconds = Seconds(start);
  close(sender);
  close(listener);
  return seconds;
}

std::string Upload(pb::Lossd::Stub* stub, pb::DType dtype,
                   std::vector<int64_t> shape, const std::string& data,
                   size_t chunk) {
  grpc::ClientContext context;
  pb::UploadResponse response;
  auto writer = stub->Upload(&context, &response);
  pb::UploadRequest request;
  request.mutable_header()->set_dtype(dtype);
  for (int64_t dim : shape) request.mutable_header()->add_shape(dim);
  writer->Write(request);
  for (size_t at = 0; at < data.size(); at += chunk) {
    // A view would avoid this copy; the client side is not what is measured.
    request.mutable_chunk()->assign(data.data() + at,
                                    std::min(chunk, data.size() - at));
    if (!writer->Write(request)) break;
  }
  writer->WritesDone();
  Check(writer->Finish(), "upload");
  return response.tensor().handle();
}

int64_t PoolHighWater() {
  cudaMemPool_t pool;
  cudaDeviceGetDefaultMemPool(&pool, 0);
  uint64_t high = 0;
  cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &high);
  return static_cast<int64_t>(high);
}

void ResetPoolHighWater() {
  cudaMemPool_t pool;
  cudaDeviceGetDefaultMemPool(&pool, 0);
  uint64_t zero = 0;
  cudaMemPoolSetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &zero);
}

// The bare kernel on device copies of the same inputs, timed with events.
double KernelSeconds(const std::string& logits, const std::string& targets,
                     int64_t rows, int64_t vocab, lossd::GradientMode mode,
                     int repeats) {
  void* device_logits = nullptr;
  void* device_gradient = nullptr;
  void* device_targets = nullptr;
  void* workspace = nullptr;
  const size_t workspace_bytes = lossd::CrossEntropyCudaWorkspaceBytes(rows);
  cudaMalloc(&device_logits, logits.size());
  cudaMalloc(&device_gradient, logits.size());
  cudaMalloc(&device_targets, targets.size());
  cudaMalloc(&workspace, workspace_bytes + 256);
  cudaMemcpy(device_logits, logits.data(), logits.size(),
             cudaMemcpyHostToDevice);
  cudaMemcpy(device_targets, targets.data(), targets.size(),
             cudaMemcpyHostToDevice);
  lossd::CrossEntropyArgs args;
  args.rows = rows;
  args.vocab = vocab;
  args.row_stride = vocab;
  args.logits_dtype = lossd::DType::kBFloat16;
  args.logits = device_logits;
  args.targets_dtype = lossd::DType::kInt64;
  args.targets = device_targets;
  args.mode = mode;
  args.gradient =
      mode == lossd::GradientMode::kNone ? nullptr : device_gradient;
  auto* result = reinterpret_cast<lossd::CrossEntropyCudaResult*>(
      static_cast<char*>(workspace) + workspace_bytes);
  cudaStream_t stream;
  cudaStreamCreate(&stream);
  cudaEvent_t begin, end;
  cudaEventCreate(&begin);
  cudaEventCreate(&end);
  std::vector<double> times;
  for (int i = 0; i < repeats + 2; ++i) {
    cudaEventRecord(begin, stream);
    if (lossd::CrossEntropyCudaLaunch(args, result, workspace, workspace_bytes,
                                      stream) != cudaSuccess) {
      Die("kernel launch failed");
    }
    cudaEventRecord(end, stream);
    cudaEventSynchronize(end);
    float ms = 0;
    cudaEventElapsedTime(&ms, begin, end);
    if (i >= 2) times.push_back(ms * 1e-3);
  }
  cudaFree(device_logits);
  cudaFree(device_gradient);
  cudaFree(device_targets);
  cudaFree(workspace);
  cudaStreamDestroy(stream);
  return Median(times);
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const int64_t rows = absl::GetFlag(FLAGS_rows);
  const int64_t vocab = absl::GetFlag(FLAGS_vocab);
  const size_t chunk = static_cast<size_t>(absl::GetFlag(FLAGS_chunk_bytes));
  const int repeats = absl::GetFlag(FLAGS_repeats);
  const int64_t elements = rows * vocab;
  const double gigabytes = static_cast<double>(elements) * 2 / 1e9;

  // Random bf16 logits (never zeros) and targets.
  std::mt19937_64 rng(1234);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::string logits(static_cast<size_t>(elements) * 2, '\0');
  {
    std::vector<uint16_t> table(4096);
    for (uint16_t& v : table) v = lossd::FloatToBF16(normal(rng));
    auto* out = reinterpret_cast<uint16_t*>(logits.data());
    for (int64_t i = 0; i < elements; ++i)
      out[i] = table[(i * 2654435761u + (i >> 12)) & 4095];
  }
  std::vector<int64_t> target_values(static_cast<size_t>(rows));
  for (int64_t& t : target_values) t = static_cast<int64_t>(rng() % vocab);
  const std::string targets(reinterpret_cast<const char*>(target_values.data()),
                            target_values.size() * 8);

  lossd::ServerConfig config;
  config.host = "127.0.0.1";
  config.port = 0;
  config.device = "cuda";
  absl::StatusOr<std::unique_ptr<lossd::LossdServer>> server =
      lossd::LossdServer::Start(config);
  if (!server.ok()) Die(server.status().ToString());
  grpc::ChannelArguments channel_args;
  channel_args.SetMaxReceiveMessageSize(64 << 20);
  channel_args.SetMaxSendMessageSize(64 << 20);
  auto stub = pb::Lossd::NewStub(grpc::CreateCustomChannel(
      (*server)->address(), grpc::InsecureChannelCredentials(), channel_args));

  std::string report;
  auto line = [&report](const std::string& text) {
    std::printf("%s\n", text.c_str());
    std::fflush(stdout);
    report += text + "\n";
  };
  line(absl::StrFormat("## service_bench: [%d, %d] bf16 (%.2f GB), chunk %d B",
                       rows, vocab, gigabytes, chunk));

  // Upload vs raw TCP, same bytes, same run.
  const double tcp = RawTcpSeconds(logits, chunk);
  std::vector<double> uploads;
  std::string handle;
  for (int i = 0; i < 2; ++i) {
    if (!handle.empty()) {
      grpc::ClientContext context;
      pb::ReleaseRequest release;
      release.set_handle(handle);
      pb::ReleaseResponse released;
      stub->Release(&context, release, &released);
    }
    const auto start = Clock::now();
    handle =
        Upload(stub.get(), pb::DTYPE_BFLOAT16, {rows, vocab}, logits, chunk);
    uploads.push_back(Seconds(start));
  }
  const double upload = *std::min_element(uploads.begin(), uploads.end());
  line(absl::StrFormat(
      "- upload: %.3f s = %.2f GB/s; raw TCP same bytes: %.3f s = %.2f GB/s; "
      "ratio %.0f%%",
      upload, gigabytes / upload, tcp, gigabytes / tcp, 100 * tcp / upload));
  const std::string targets_handle =
      Upload(stub.get(), pb::DTYPE_INT64, {rows}, targets, chunk);

  // Forward, forward-only: repeatable on the resident handle.
  auto forward = [&](pb::GradientMode mode, double* kernel_seconds) {
    pb::ForwardRequest request;
    request.set_logits(handle);
    request.set_targets_handle(targets_handle);
    request.set_mode(mode);
    pb::ForwardResponse response;
    grpc::ClientContext context;
    const auto start = Clock::now();
    Check(stub->Forward(&context, request, &response), "forward");
    const double seconds = Seconds(start);
    *kernel_seconds = response.kernel_seconds();
    if (mode == pb::GRADIENT_MODE_OUT_OF_PLACE) {
      grpc::ClientContext release_context;
      pb::ReleaseRequest release;
      release.set_handle(response.gradient());
      pb::ReleaseResponse released;
      stub->Release(&release_context, release, &released);
    }
    return seconds;
  };
  for (pb::GradientMode mode :
       {pb::GRADIENT_MODE_NONE, pb::GRADIENT_MODE_OUT_OF_PLACE}) {
    std::vector<double> rpc;
    std::vector<double> server_side;
    for (int i = 0; i < repeats + 1; ++i) {
      double kernel_seconds = 0;
      const double seconds = forward(mode, &kernel_seconds);
      if (i == 0) continue;  // warm-up
      rpc.push_back(seconds);
      server_side.push_back(kernel_seconds);
    }
    const double kernel = KernelSeconds(logits, targets, rows, vocab,
                                        mode == pb::GRADIENT_MODE_NONE
                                            ? lossd::GradientMode::kNone
                                            : lossd::GradientMode::kOutOfPlace,
                                        repeats);
    line(absl::StrFormat(
        "- Forward %s: RPC (client) median %.3f ms; server device call "
        "(ForwardResponse.kernel_seconds) %.3f ms; bare kernel (events) "
        "%.3f ms; RPC / (1.05 kernel + 0.1 ms) = %.2f",
        pb::GradientMode_Name(mode), 1e3 * Median(rpc),
        1e3 * Median(server_side), 1e3 * kernel,
        Median(rpc) / (1.05 * kernel + 1e-4)));
  }

  // In place: consumes the logits, so once, on the last upload; peak memory
  // measured around it.
  ResetPoolHighWater();
  const int64_t before = PoolHighWater();
  double in_place_kernel = 0;
  const double in_place = forward(pb::GRADIENT_MODE_IN_PLACE, &in_place_kernel);
  const int64_t peak = PoolHighWater();
  line(absl::StrFormat(
      "- Forward GRADIENT_IN_PLACE (one run): RPC %.3f ms, device call %.3f "
      "ms; pool high-water %.3f GB with %.3f GB of logits+targets held "
      "(extra %.1f MB = O(N))",
      1e3 * in_place, 1e3 * in_place_kernel, peak / 1e9,
      (static_cast<double>(logits.size()) + targets.size()) / 1e9,
      (peak - static_cast<double>(logits.size()) - targets.size()) / 1e6));
  (void)before;

  // Backward: records the factor only.
  for (double factor : {1.0, 0.5}) {
    std::vector<double> times;
    bool launched = false;
    for (int i = 0; i < 101; ++i) {
      pb::BackwardRequest request;
      request.set_gradient(handle);
      request.set_scalar(factor);
      pb::BackwardResponse response;
      grpc::ClientContext context;
      const auto start = Clock::now();
      Check(stub->Backward(&context, request, &response), "backward");
      if (i > 0) times.push_back(Seconds(start));
      launched |= response.kernel_launched();
    }
    line(absl::StrFormat(
        "- Backward grad_output=%.1f: RPC median %.1f us, kernel launched: %s",
        factor, 1e6 * Median(times), launched ? "yes" : "no"));
  }

  // Download of the gradient with the pending 0.5, as bf16.
  {
    grpc::ClientContext context;
    pb::DownloadRequest request;
    request.set_handle(handle);
    request.set_chunk_bytes(static_cast<int64_t>(chunk));
    const auto start = Clock::now();
    auto reader = stub->Download(&context, request);
    pb::DownloadResponse response;
    int64_t bytes = 0;
    while (reader->Read(&response)) bytes += response.chunk().size();
    Check(reader->Finish(), "download");
    const double seconds = Seconds(start);
    line(
        absl::StrFormat("- Download gradient (x0.5 applied on device): %.3f s "
                        "= %.2f GB/s",
                        seconds, bytes / seconds / 1e9));
  }

  // Evaluate: the same logits streamed in row blocks.
  {
    const int64_t block_rows = std::max<int64_t>(1, (32 << 20) / (vocab * 2));
    grpc::ClientContext context;
    pb::EvaluateResponse response;
    const auto start = Clock::now();
    auto writer = stub->Evaluate(&context, &response);
    pb::EvaluateRequest request;
    request.mutable_header()->set_vocab(vocab);
    request.mutable_header()->set_logits_dtype(pb::DTYPE_BFLOAT16);
    request.mutable_header()->set_targets_dtype(pb::DTYPE_INT64);
    writer->Write(request);
    for (int64_t row = 0; row < rows; row += block_rows) {
      const int64_t n = std::min(block_rows, rows - row);
      request.mutable_block()->mutable_logits()->assign(
          logits.data() + row * vocab * 2, n * vocab * 2);
      request.mutable_block()->mutable_targets()->assign(
          targets.data() + row * 8, n * 8);
      if (!writer->Write(request)) break;
    }
    writer->WritesDone();
    Check(writer->Finish(), "evaluate");
    const double seconds = Seconds(start);
    line(absl::StrFormat(
        "- Evaluate (blocks of %d rows): %.3f s = %.2f GB/s of logits",
        block_rows, seconds, gigabytes / seconds));
  }

  if (!absl::GetFlag(FLAGS_out).empty()) {
    FILE* file = std::fopen(absl::GetFlag(FLAGS_out).c_str(), "a");
    if (file != nullptr) {
      std::fputs(report.c_str(), file);
      std::fclose(file);
    }
  }
  (*server)->Drain();
  return 0;
}
