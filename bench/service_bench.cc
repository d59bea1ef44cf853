// Service benchmark: what the gRPC service adds on top of the CUDA kernel.
// Starts lossd in process on 127.0.0.1:0 and measures, for one [rows, vocab]
// bf16 tensor: upload throughput against raw TCP and against a server that
// discards the bytes, Forward RPC time against the bare kernel (CUDA events),
// Backward RPC time, download and Evaluate throughput, peak device memory, and
// one client workload against lossd and against bench/python_server.py.
#include <arpa/inet.h>
#include <cuda_runtime_api.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "client/client.h"
#include "common/float16.h"
#include "grpcpp/grpcpp.h"
#include "kernels/cuda/cross_entropy_cuda.h"
#include "lossd/v1/lossd.grpc.pb.h"
#include "server/server.h"

ABSL_FLAG(int64_t, rows, 16384, "rows of the logits");
ABSL_FLAG(int64_t, vocab, 131072, "vocabulary");
ABSL_FLAG(int64_t, chunk_bytes, 4 << 20, "upload/download chunk");
ABSL_FLAG(int, repeats, 10, "timed runs per measurement");
ABSL_FLAG(int64_t, staging_bytes, 4 << 20,
          "lossd's pinned staging buffer (ServerConfig::staging_bytes)");
ABSL_FLAG(bool, upload_only, false,
          "stop after the upload measurements (to study them alone)");
ABSL_FLAG(int, upload_repeats, 3,
          "uploads per target (raw TCP, discarding server, lossd); medians");
ABSL_FLAG(int, upload_streams, 4,
          "stripes (= connections) of the striped upload rows; lossd::Client's "
          "default");
ABSL_FLAG(std::string, eval_block_bytes, "4194304,33554432",
          "Evaluate row-block sizes to measure (comma-separated bytes)");
ABSL_FLAG(std::string, device, "cuda",
          "lossd device: cuda, or cpu (then no kernel / pool figures)");
ABSL_FLAG(std::string, python_server, "",
          "bench/python_server.py; empty = no Python comparison");
ABSL_FLAG(std::string, python, "python3", "interpreter for --python_server");
ABSL_FLAG(std::string, stubs, "", "folder with the Python lossd stubs");
ABSL_FLAG(std::string, out, "", "append a markdown summary here");
ABSL_FLAG(std::string, grpc_args, "",
          "extra integer gRPC arguments for the client channels and the "
          "discarding servers, name=value,... (to study the transport)");
ABSL_FLAG(bool, metrics, false,
          "serve Prometheus metrics (on a free port), as a deployment does");

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

// Raw TCP over loopback, `connections` connections at once, each carrying its
// share of `data` (the stripes of a striped upload) from its own thread, in
// `chunk` writes; 1 connection is the one-stream baseline.
double RawTcpStripedSeconds(const std::string& data, size_t chunk,
                            int connections) {
  const int listener = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address = {};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(address);
  if (bind(listener, reinterpret_cast<sockaddr*>(&address), length) != 0 ||
      listen(listener, connections) != 0 ||
      getsockname(listener, reinterpret_cast<sockaddr*>(&address), &length) !=
          0) {
    Die("raw tcp: cannot listen");
  }
  std::vector<int> senders;
  std::vector<std::thread> receivers;
  for (int i = 0; i < connections; ++i) {
    const int sender = socket(AF_INET, SOCK_STREAM, 0);
    if (connect(sender, reinterpret_cast<sockaddr*>(&address), length) != 0) {
      Die("raw tcp: cannot connect");
    }
    senders.push_back(sender);
    const int connection = accept(listener, nullptr, nullptr);
    receivers.emplace_back([connection, chunk] {
      std::vector<char> buffer(chunk);
      while (read(connection, buffer.data(), buffer.size()) > 0) {
      }
      close(connection);
    });
  }
  const auto start = Clock::now();
  std::vector<std::thread> writers;
  for (int i = 0; i < connections; ++i) {
    writers.emplace_back([&, i] {
      const size_t first = data.size() * i / connections;
      const size_t end = data.size() * (i + 1) / connections;
      for (size_t at = first; at < end;) {
        const ssize_t n =
            write(senders[i], data.data() + at, std::min(chunk, end - at));
        if (n <= 0) Die("raw tcp: write failed");
        at += static_cast<size_t>(n);
      }
      shutdown(senders[i], SHUT_WR);
    });
  }
  for (std::thread& writer : writers) writer.join();
  for (std::thread& receiver : receivers) receiver.join();
  const double seconds = Seconds(start);
  for (int sender : senders) close(sender);
  close(listener);
  return seconds;
}

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

// The serialized framing of a length-delimited field `field` of `length`
// bytes (tag, then the length as a varint).
std::string FieldPrefix(int field, size_t length) {
  std::string prefix(1, static_cast<char>((field << 3) | 2));
  for (uint64_t left = length;; left >>= 7) {
    prefix.push_back(
        static_cast<char>((left & 0x7f) | (left > 0x7f ? 0x80 : 0)));
    if (left <= 0x7f) break;
  }
  return prefix;
}

// Upload as the client library does it (client/client.cc, Client::Upload): the
// header as a protobuf, then each chunk as its framing plus a view of the
// caller's bytes, so no copy is made before the socket. Kept on raw channels
// so that the discarding server and lossd see byte-identical traffic.
// One Upload stream: `header`, then the `bytes` at `data`. Returns the
// handle (empty from the discarding server).
std::string SendUpload(grpc::Channel* channel, const pb::TensorHeader& header,
                       const char* data, size_t bytes, size_t chunk) {
  grpc::ClientContext context;
  grpc::ByteBuffer raw_response;
  const grpc::internal::RpcMethod method(
      "/lossd.v1.Lossd/Upload", grpc::internal::RpcMethod::CLIENT_STREAMING);
  std::unique_ptr<grpc::ClientWriter<grpc::ByteBuffer>> writer(
      grpc::internal::ClientWriterFactory<grpc::ByteBuffer>::Create(
          channel, method, &context, &raw_response));
  pb::UploadRequest request;
  *request.mutable_header() = header;
  grpc::ByteBuffer message;
  bool own_buffer = false;
  grpc::SerializationTraits<pb::UploadRequest>::Serialize(request, &message,
                                                          &own_buffer);
  bool sending = writer->Write(message);
  for (size_t at = 0; sending && at < bytes; at += chunk) {
    const size_t n = std::min(chunk, bytes - at);
    grpc::Slice slices[2] = {
        grpc::Slice(FieldPrefix(2, n)),
        grpc::Slice(data + at, n, grpc::Slice::STATIC_SLICE)};
    message = grpc::ByteBuffer(slices, 2);
    sending = writer->Write(message);
  }
  if (sending) writer->WritesDone();
  Check(writer->Finish(), "upload");
  pb::UploadResponse response;
  grpc::SerializationTraits<pb::UploadResponse>::Deserialize(&raw_response,
                                                             &response);
  return response.tensor().handle();
}

pb::TensorHeader Header(pb::DType dtype, const std::vector<int64_t>& shape) {
  pb::TensorHeader header;
  header.set_dtype(dtype);
  for (int64_t dim : shape) header.add_shape(dim);
  return header;
}

std::string RawUpload(const std::shared_ptr<grpc::Channel>& channel,
                      pb::DType dtype, std::vector<int64_t> shape,
                      const std::string& data, size_t chunk, double* seconds) {
  const auto start = Clock::now();
  const std::string handle = SendUpload(channel.get(), Header(dtype, shape),
                                        data.data(), data.size(), chunk);
  *seconds = Seconds(start);
  return handle;
}

// A striped upload as lossd::Client sends one (client/client.cc,
// Client::UploadStriped): stripe i of K on channels[i] from its own thread,
// carrying elements [floor(i * E / K), floor((i + 1) * E / K)).
std::string RawStripedUpload(
    const std::vector<std::shared_ptr<grpc::Channel>>& channels,
    pb::DType dtype, std::vector<int64_t> shape, int64_t element_bytes,
    const std::string& data, size_t chunk, double* seconds) {
  static int uploads = 0;
  const int count = static_cast<int>(channels.size());
  const int64_t elements = static_cast<int64_t>(data.size()) / element_bytes;
  pb::TensorHeader header = Header(dtype, shape);
  header.mutable_stripe()->set_upload_id(
      absl::StrFormat("bench-%d-%d", getpid(), ++uploads));
  header.mutable_stripe()->set_count(count);
  std::vector<std::string> handles(static_cast<size_t>(count));
  const auto start = Clock::now();
  std::vector<std::thread> threads;
  for (int i = 0; i < count; ++i) {
    threads.emplace_back([&, i] {
      const int64_t first =
          i * (elements / count) + i * (elements % count) / count;
      const int64_t end =
          (i + 1) * (elements / count) + (i + 1) * (elements % count) / count;
      pb::TensorHeader stripe = header;
      stripe.mutable_stripe()->set_index(i);
      handles[i] = SendUpload(
          channels[i].get(), stripe, data.data() + first * element_bytes,
          static_cast<size_t>((end - first) * element_bytes), chunk);
    });
  }
  for (std::thread& thread : threads) thread.join();
  *seconds = Seconds(start);
  return handles[0];
}

// The --grpc_args pairs, for a ChannelArguments or a ServerBuilder.
std::vector<std::pair<std::string, int>> ExtraGrpcArgs() {
  std::vector<std::pair<std::string, int>> args;
  for (absl::string_view pair :
       absl::StrSplit(absl::GetFlag(FLAGS_grpc_args), ',', absl::SkipEmpty())) {
    const std::vector<std::string> parts = absl::StrSplit(pair, '=');
    int value = 0;
    if (parts.size() != 2 || !absl::SimpleAtoi(parts[1], &value)) {
      std::fprintf(stderr, "bad --grpc_args entry: %s\n",
                   std::string(pair).c_str());
      std::exit(2);
    }
    args.emplace_back(parts[0], value);
  }
  return args;
}

// A channel of its own TCP connection (`connection` tells the channels of
// one striped upload apart, as lossd::Client does).
std::shared_ptr<grpc::Channel> Connect(const std::string& address,
                                       int connection = 0) {
  grpc::ChannelArguments channel_args;
  channel_args.SetMaxReceiveMessageSize(64 << 20);
  channel_args.SetMaxSendMessageSize(64 << 20);
  channel_args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  channel_args.SetInt("lossd.upload_stripe", connection);
  for (const auto& [name, value] : ExtraGrpcArgs())
    channel_args.SetInt(name, value);
  return grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(),
                                   channel_args);
}

std::vector<std::shared_ptr<grpc::Channel>> ConnectStripes(
    const std::string& address, int count) {
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  for (int i = 0; i < count; ++i) channels.push_back(Connect(address, i + 1));
  return channels;
}

// Evaluate with blocks of `block_rows` rows sent as raw messages whose logits
// and targets are views of the caller's memory (no client-side copies, as
// RawUpload): the server's pipeline is what is measured.
// `*response` gets the server's answer (loss, and its copy and kernel time).
double EvaluateSeconds(const std::shared_ptr<grpc::Channel>& channel,
                       const std::string& logits, const std::string& targets,
                       int64_t rows, int64_t vocab, int64_t block_rows,
                       pb::EvaluateResponse* response) {
  grpc::ClientContext context;
  grpc::ByteBuffer raw_response;
  const grpc::internal::RpcMethod method(
      "/lossd.v1.Lossd/Evaluate", grpc::internal::RpcMethod::CLIENT_STREAMING);
  const auto start = Clock::now();
  std::unique_ptr<grpc::ClientWriter<grpc::ByteBuffer>> writer(
      grpc::internal::ClientWriterFactory<grpc::ByteBuffer>::Create(
          channel.get(), method, &context, &raw_response));
  pb::EvaluateRequest request;
  request.mutable_header()->set_vocab(vocab);
  request.mutable_header()->set_logits_dtype(pb::DTYPE_BFLOAT16);
  request.mutable_header()->set_targets_dtype(pb::DTYPE_INT64);
  grpc::ByteBuffer message;
  bool own_buffer = false;
  grpc::SerializationTraits<pb::EvaluateRequest>::Serialize(request, &message,
                                                            &own_buffer);
  bool sending = writer->Write(message);
  for (int64_t row = 0; sending && row < rows; row += block_rows) {
    const int64_t n = std::min(block_rows, rows - row);
    const size_t logits_bytes = static_cast<size_t>(n * vocab * 2);
    const size_t targets_bytes = static_cast<size_t>(n * 8);
    const std::string logits_prefix = FieldPrefix(1, logits_bytes);
    const std::string targets_prefix = FieldPrefix(2, targets_bytes);
    const std::string block_prefix =
        FieldPrefix(2, logits_prefix.size() + logits_bytes +
                           targets_prefix.size() + targets_bytes);
    grpc::Slice slices[5] = {
        grpc::Slice(block_prefix), grpc::Slice(logits_prefix),
        grpc::Slice(logits.data() + row * vocab * 2, logits_bytes,
                    grpc::Slice::STATIC_SLICE),
        grpc::Slice(targets_prefix),
        grpc::Slice(targets.data() + row * 8, targets_bytes,
                    grpc::Slice::STATIC_SLICE)};
    message = grpc::ByteBuffer(slices, 5);
    sending = writer->Write(message);
  }
  if (sending) writer->WritesDone();
  Check(writer->Finish(), "evaluate");
  const double seconds = Seconds(start);
  grpc::SerializationTraits<pb::EvaluateResponse>::Deserialize(&raw_response,
                                                               response);
  return seconds;
}

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

Workload RunWorkload(const std::shared_ptr<grpc::Channel>& channel,
                     const std::string& logits, const std::string& targets,
                     int64_t rows, int64_t vocab, size_t chunk,
                     std::string* gradient_out) {
  auto stub = pb::Lossd::NewStub(channel);
  Workload w;
  const auto start = Clock::now();
  double seconds = 0;
  const std::string logits_handle = RawUpload(
      channel, pb::DTYPE_BFLOAT16, {rows, vocab}, logits, chunk, &seconds);
  const std::string targets_handle =
      RawUpload(channel, pb::DTYPE_INT64, {rows}, targets, chunk, &seconds);
  w.upload = Seconds(start);
  auto step = Clock::now();
  pb::ForwardResponse forward;
  {
    pb::ForwardRequest request;
    request.set_logits(logits_handle);
    request.set_targets_handle(targets_handle);
    grpc::ClientContext context;
    Check(stub->Forward(&context, request, &forward), "workload forward");
  }
  w.forward = Seconds(step);
  w.loss = forward.loss();
  step = Clock::now();
  {
    pb::BackwardRequest request;
    request.set_gradient(forward.gradient());
    request.set_scalar(0.5);
    pb::BackwardResponse response;
    grpc::ClientContext context;
    Check(stub->Backward(&context, request, &response), "workload backward");
  }
  w.backward = Seconds(step);
  step = Clock::now();
  gradient_out->clear();
  gradient_out->reserve(logits.size());
  {
    pb::DownloadRequest request;
    request.set_handle(forward.gradient());
    request.set_chunk_bytes(static_cast<int64_t>(chunk));
    grpc::ClientContext context;
    auto reader = stub->Download(&context, request);
    pb::DownloadResponse response;
    while (reader->Read(&response)) gradient_out->append(response.chunk());
    Check(reader->Finish(), "workload download");
  }
  w.download = Seconds(step);
  w.total = Seconds(start);
  for (const std::string& handle : {forward.gradient(), targets_handle}) {
    pb::ReleaseRequest request;
    request.set_handle(handle);
    pb::ReleaseResponse response;
    grpc::ClientContext context;
    stub->Release(&context, request, &response);
  }
  return w;
}

// The same workload through lossd::Client with its defaults (lossd only:
// large tensors go up and the gradient comes back over data connections).
Workload RunClientWorkload(lossd::Client* client, const std::string& logits,
                           const std::string& targets, int64_t rows,
                           int64_t vocab, std::string* gradient_out) {
  Workload w;
  const auto start = Clock::now();
  auto must = [](const absl::Status& status, const char* what) {
    if (!status.ok())
      Die(absl::StrCat("client workload ", what, ": ", status.ToString()));
  };
  absl::StatusOr<lossd::TensorInfo> uploaded = client->Upload(
      lossd::DType::kBFloat16, {rows, vocab}, logits.data(), logits.size());
  must(uploaded.status(), "upload");
  absl::StatusOr<lossd::TensorInfo> uploaded_targets = client->Upload(
      lossd::DType::kInt64, {rows}, targets.data(), targets.size());
  must(uploaded_targets.status(), "upload targets");
  w.upload = Seconds(start);
  auto step = Clock::now();
  absl::StatusOr<lossd::ForwardResult> forward = client->Forward(
      uploaded->handle, lossd::Targets::Handle(uploaded_targets->handle));
  must(forward.status(), "forward");
  w.forward = Seconds(step);
  w.loss = forward->loss;
  step = Clock::now();
  must(client->Backward(forward->gradient, 0.5).status(), "backward");
  w.backward = Seconds(step);
  // Into a buffer filled here (in the total, not in the download's time).
  step = Clock::now();
  gradient_out->assign(logits.size(), '\0');
  w.fill = Seconds(step);
  step = Clock::now();
  must(client
           ->DownloadInto(forward->gradient, lossd::DType::kInvalid,
                          gradient_out->data(), gradient_out->size())
           .status(),
       "download");
  w.download = Seconds(step);
  w.total = Seconds(start);
  client->Release(forward->gradient).IgnoreError();
  client->Release(uploaded_targets->handle).IgnoreError();
  return w;
}

// bench/python_server.py as a child process on 127.0.0.1:0; the port comes
// back through a file. Returns the pid (0 on failure) and sets `address`.
pid_t StartPython(std::string* address) {
  const std::string port_file =
      absl::StrFormat("/tmp/service_bench_python_%d.port", getpid());
  unlink(port_file.c_str());
  std::vector<std::string> args = {
      absl::GetFlag(FLAGS_python), absl::GetFlag(FLAGS_python_server),
      "--stubs=" + absl::GetFlag(FLAGS_stubs), "--port_file=" + port_file,
      "--device=" + absl::GetFlag(FLAGS_device)};
  std::vector<char*> argv;
  for (std::string& arg : args) argv.push_back(arg.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  if (posix_spawnp(&pid, argv[0], nullptr, nullptr, argv.data(), environ) !=
      0) {
    return 0;
  }
  // Torch takes seconds to import; poll for the port file.
  for (int i = 0; i < 1200; ++i) {
    std::ifstream in(port_file);
    int port = 0;
    if (in >> port && port > 0) {
      *address = absl::StrFormat("127.0.0.1:%d", port);
      unlink(port_file.c_str());
      return pid;
    }
    int status = 0;
    if (waitpid(pid, &status, WNOHANG) == pid) return 0;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
  return 0;
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

// The device's host-to-device copy rate from pinned memory, the reference for
// the server's copy times: `total` bytes in `piece` pieces from two pinned
// buffers, one stream, as the device's uploads move them (without the gather
// into the pinned buffers). Median of `repeats`.
double PinnedCopyGBs(size_t piece, size_t total, int repeats) {
  void* host[2] = {nullptr, nullptr};
  void* device = nullptr;
  if (cudaHostAlloc(&host[0], piece, cudaHostAllocDefault) != cudaSuccess ||
      cudaHostAlloc(&host[1], piece, cudaHostAllocDefault) != cudaSuccess ||
      cudaMalloc(&device, total) != cudaSuccess) {
    Die("cannot allocate the pinned copy reference");
  }
  std::memset(host[0], 1, piece);
  std::memset(host[1], 2, piece);
  cudaStream_t stream;
  cudaStreamCreate(&stream);
  cudaEvent_t begin, end;
  cudaEventCreate(&begin);
  cudaEventCreate(&end);
  std::vector<double> rates;
  for (int i = 0; i < repeats + 1; ++i) {
    cudaEventRecord(begin, stream);
    for (size_t offset = 0, k = 0; offset < total; offset += piece, ++k) {
      cudaMemcpyAsync(static_cast<char*>(device) + offset, host[k % 2],
                      std::min(piece, total - offset), cudaMemcpyHostToDevice,
                      stream);
    }
    cudaEventRecord(end, stream);
    cudaEventSynchronize(end);
    float ms = 0;
    cudaEventElapsedTime(&ms, begin, end);
    if (i >= 1) rates.push_back(total / (ms * 1e-3) / 1e9);
  }
  cudaEventDestroy(begin);
  cudaEventDestroy(end);
  cudaStreamDestroy(stream);
  cudaFree(device);
  cudaFreeHost(host[0]);
  cudaFreeHost(host[1]);
  return Median(rates);
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const int64_t rows = absl::GetFlag(FLAGS_rows);
  const int64_t vocab = absl::GetFlag(FLAGS_vocab);
  const size_t chunk = static_cast<size_t>(absl::GetFlag(FLAGS_chunk_bytes));
  const int repeats = absl::GetFlag(FLAGS_repeats);
  const int upload_repeats = std::max(1, absl::GetFlag(FLAGS_upload_repeats));
  const int streams = std::clamp(absl::GetFlag(FLAGS_upload_streams), 1, 64);
  const bool cuda = absl::GetFlag(FLAGS_device) != "cpu";
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
  config.device = cuda ? "cuda" : "cpu";
  if (absl::GetFlag(FLAGS_metrics)) config.metrics_port = 0;
  config.staging_bytes = absl::GetFlag(FLAGS_staging_bytes);
  config.data_port = 0;  // a free port, as --data_port does in a deployment
  absl::StatusOr<std::unique_ptr<lossd::LossdServer>> server =
      lossd::LossdServer::Start(config);
  if (!server.ok()) Die(server.status().ToString());
  const std::shared_ptr<grpc::Channel> channel = Connect((*server)->address());
  auto stub = pb::Lossd::NewStub(channel);
  auto release = [&stub](const std::string& handle) {
    pb::ReleaseRequest request;
    request.set_handle(handle);
    pb::ReleaseResponse response;
    grpc::ClientContext context;
    stub->Release(&context, request, &response);
  };

  // The discarding servers (same builder settings as LossdServer's): the
  // floor, and the control that copies each chunk on the reaction's thread.
  struct Discarding {
    std::unique_ptr<DiscardService> service;
    std::unique_ptr<grpc::Server> server;
    int port = 0;
  };
  auto start_discarding = [&config](bool copy) {
    Discarding d;
    d.service = std::make_unique<DiscardService>(copy);
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(),
                             &d.port);
    builder.SetMaxReceiveMessageSize(
        static_cast<int>(config.max_message_bytes));
    builder.SetMaxSendMessageSize(static_cast<int>(config.max_message_bytes));
    for (const auto& [name, value] : ExtraGrpcArgs())
      builder.AddChannelArgument(name, value);
    builder.RegisterService(d.service.get());
    d.server = builder.BuildAndStart();
    if (d.server == nullptr) Die("cannot start a discarding server");
    return d;
  };
  Discarding discarding = start_discarding(false);
  Discarding copying = start_discarding(true);
  const int discard_port = discarding.port;
  const std::shared_ptr<grpc::Channel> discard_channel =
      Connect(absl::StrFormat("127.0.0.1:%d", discard_port));

  std::string report;
  auto line = [&report](const std::string& text) {
    std::printf("%s\n", text.c_str());
    std::fflush(stdout);
    report += text + "\n";
  };
  line(absl::StrFormat(
      "## service_bench: [%d, %d] bf16 (%.2f GB), chunk %d B, device %s%s",
      rows, vocab, gigabytes, chunk, config.device,
      config.staging_bytes == (int64_t{4} << 20)
          ? ""
          : absl::StrFormat(", staging %d B", config.staging_bytes)));
  line("");
  line("| measurement | result | target |");
  line("|---|---|---|");

  // Upload: raw TCP, the discarding server and lossd take turns, one stream
  // and striped, so that drifts of the machine hit all of them alike.
  const std::vector<std::shared_ptr<grpc::Channel>> stripe_channels =
      ConnectStripes((*server)->address(), streams);
  const std::vector<std::shared_ptr<grpc::Channel>> discard_stripe_channels =
      ConnectStripes(absl::StrFormat("127.0.0.1:%d", discard_port), streams);
  const std::vector<std::shared_ptr<grpc::Channel>> copying_stripe_channels =
      ConnectStripes(absl::StrFormat("127.0.0.1:%d", copying.port), streams);
  std::vector<double> tcp_times, discard_times, lossd_times;
  std::vector<double> tcp_k_times, discard_k_times, lossd_k_times;
  std::vector<double> copying_k_times, data_times, data_k_times;
  // lossd::Client as users get it: a tensor this large goes over its data
  // connections (straight into pinned staging, no gRPC in between), one
  // connection or `streams` (lossd::Client's default upload_streams).
  auto make_client = [&](int connections) {
    lossd::ClientOptions options;
    options.upload_streams = connections;
    absl::StatusOr<std::unique_ptr<lossd::Client>> client =
        lossd::Client::Connect((*server)->address(), options);
    if (!client.ok()) Die(client.status().ToString());
    return *std::move(client);
  };
  const std::unique_ptr<lossd::Client> client_1 = make_client(1);
  const std::unique_ptr<lossd::Client> client_k = make_client(streams);
  auto data_upload = [&](lossd::Client* client, int connections) {
    const int64_t completed = (*server)->data_plane()->completed();
    const auto start = Clock::now();
    absl::StatusOr<lossd::TensorInfo> uploaded = client->Upload(
        lossd::DType::kBFloat16, {rows, vocab}, logits.data(), logits.size());
    const double seconds = Seconds(start);
    if (!uploaded.ok()) Die(uploaded.status().ToString());
    if ((*server)->data_plane()->completed() != completed + connections) {
      Die("lossd::Client did not use its data connections");
    }
    release(uploaded->handle);
    return seconds;
  };
  std::string handle;
  for (int i = 0; i < upload_repeats; ++i) {
    tcp_times.push_back(RawTcpStripedSeconds(logits, chunk, 1));
    data_times.push_back(data_upload(client_1.get(), 1));
    double seconds = 0;
    RawUpload(discard_channel, pb::DTYPE_BFLOAT16, {rows, vocab}, logits, chunk,
              &seconds);
    discard_times.push_back(seconds);
    if (!handle.empty()) release(handle);
    handle = RawUpload(channel, pb::DTYPE_BFLOAT16, {rows, vocab}, logits,
                       chunk, &seconds);
    lossd_times.push_back(seconds);

    tcp_k_times.push_back(RawTcpStripedSeconds(logits, chunk, streams));
    data_k_times.push_back(data_upload(client_k.get(), streams));
    RawStripedUpload(discard_stripe_channels, pb::DTYPE_BFLOAT16, {rows, vocab},
                     2, logits, chunk, &seconds);
    discard_k_times.push_back(seconds);
    release(handle);
    handle = RawStripedUpload(stripe_channels, pb::DTYPE_BFLOAT16,
                              {rows, vocab}, 2, logits, chunk, &seconds);
    if (handle.empty()) Die("striped upload returned no handle");
    lossd_k_times.push_back(seconds);

    RawStripedUpload(copying_stripe_channels, pb::DTYPE_BFLOAT16, {rows, vocab},
                     2, logits, chunk, &seconds);
    copying_k_times.push_back(seconds);
  }
  const double tcp = Median(tcp_times);
  const double discard = Median(discard_times);
  const double upload = Median(lossd_times);
  const double tcp_k = Median(tcp_k_times);
  const double discard_k = Median(discard_k_times);
  const double upload_k = Median(lossd_k_times);
  const double upload_data = Median(data_times);
  line(absl::StrFormat(
      "| Upload %.2f GB, raw TCP (1 connection, same bytes) | %.3f s = %.2f "
      "GB/s | |",
      gigabytes, tcp, gigabytes / tcp));
  line(absl::StrFormat(
      "| Upload to lossd (%s) over 1 data connection (lossd::Client::Upload, "
      "upload_streams=1: header on gRPC, bytes on 1 TCP connection into "
      "pinned staging) | %.3f s = %.2f GB/s: **%.0f%% of raw TCP**, **%.3fx "
      "the raw TCP receiver that discards the bytes** | >= 80%%; <= 1.1x |",
      config.device, upload_data, gigabytes / upload_data,
      100 * tcp / upload_data, upload_data / tcp));
  line(
      absl::StrFormat("| Upload to a server that discards the bytes | %.3f s = "
                      "%.2f GB/s (%.0f%% "
                      "of raw TCP) | |",
                      discard, gigabytes / discard, 100 * tcp / discard));
  line(absl::StrFormat(
      "| Upload to lossd (%s) | %.3f s = %.2f GB/s: **%.0f%% of raw TCP**, "
      "**%.3fx the discarding server** | >= 80%%; <= 1.1x |",
      config.device, upload, gigabytes / upload, 100 * tcp / upload,
      upload / discard));
  line(absl::StrFormat(
      "| Upload %.2f GB, raw TCP (%d connections, same bytes) | %.3f s = "
      "%.2f GB/s | |",
      gigabytes, streams, tcp_k, gigabytes / tcp_k));
  line(absl::StrFormat(
      "| Upload to a server that discards the bytes, %d stripes over %d "
      "connections | %.3f s = %.2f GB/s (%.0f%% of raw TCP, 1 connection) | "
      "|",
      streams, streams, discard_k, gigabytes / discard_k,
      100 * tcp / discard_k));
  line(absl::StrFormat(
      "| Upload to lossd (%s), %d stripes over %d connections | %.3f s = "
      "%.2f GB/s: **%.0f%% of raw TCP (1 connection)**, %.0f%% of raw TCP "
      "(%d connections), %.3fx the striped discarding server | >= 80%% |",
      config.device, streams, streams, upload_k, gigabytes / upload_k,
      100 * tcp / upload_k, 100 * tcp_k / upload_k, streams,
      upload_k / discard_k));
  const double upload_data_k = Median(data_k_times);
  line(absl::StrFormat(
      "| Upload to lossd (%s) over %d data connections (lossd::Client::Upload "
      "with its defaults) | %.3f s = %.2f GB/s: **%.0f%% of raw TCP (1 "
      "connection)**, %.0f%% of raw TCP (%d connections), **%.3fx the raw TCP "
      "receivers (%d connections) that discard the bytes** | >= 80%%; <= "
      "1.1x |",
      config.device, streams, upload_data_k, gigabytes / upload_data_k,
      100 * tcp / upload_data_k, 100 * tcp_k / upload_data_k, streams,
      upload_data_k / tcp_k, streams));
  const double copying_k = Median(copying_k_times);
  line(absl::StrFormat(
      "| Control: %d stripes to a discarding server that first copies each "
      "chunk into host memory on gRPC's reaction thread | %.3f s = %.2f GB/s, "
      "%.3fx the striped discarding server | |",
      streams, copying_k, gigabytes / copying_k, copying_k / discard_k));

  if (absl::GetFlag(FLAGS_upload_only)) {
    if (!absl::GetFlag(FLAGS_out).empty()) {
      FILE* file = std::fopen(absl::GetFlag(FLAGS_out).c_str(), "a");
      if (file != nullptr) {
        std::fputs(report.c_str(), file);
        std::fclose(file);
      }
    }
    return 0;
  }
  double targets_seconds = 0;
  const std::string targets_handle = RawUpload(
      channel, pb::DTYPE_INT64, {rows}, targets, chunk, &targets_seconds);

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
    const double kernel =
        cuda ? KernelSeconds(logits, targets, rows, vocab,
                             mode == pb::GRADIENT_MODE_NONE
                                 ? lossd::GradientMode::kNone
                                 : lossd::GradientMode::kOutOfPlace,
                             repeats)
             : 0.0;
    line(absl::StrFormat(
        "| Forward %s | RPC %.3f ms; server device call %.3f ms; bare kernel "
        "%.3f ms | server <= 1.05 kernel + 0.1 ms = %.3f ms |",
        pb::GradientMode_Name(mode), 1e3 * Median(rpc),
        1e3 * Median(server_side), 1e3 * kernel, 1e3 * (1.05 * kernel + 1e-4)));
  }

  // In place: consumes the logits, so once, on the last upload; peak memory
  // measured around it.
  if (cuda) ResetPoolHighWater();
  double in_place_kernel = 0;
  const double in_place = forward(pb::GRADIENT_MODE_IN_PLACE, &in_place_kernel);
  const int64_t peak = cuda ? PoolHighWater() : 0;
  const double held = static_cast<double>(logits.size()) + targets.size();
  line(absl::StrFormat(
      "| Forward GRADIENT_IN_PLACE (one run) | RPC %.3f ms, device call %.3f "
      "ms; pool high-water %.3f GB = logits+targets %.3f GB + %.1f MB | "
      "logits + O(N) |",
      1e3 * in_place, 1e3 * in_place_kernel, peak / 1e9, held / 1e9,
      (peak - held) / 1e6));

  // Backward: records the factor only.
  for (double factor : {1.0, 0.5}) {
    std::vector<double> times;
    bool launched = false;
    for (int i = 0; i < 1001; ++i) {
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
        "| Backward grad_output=%.1f | RPC median %.1f us, kernel launched: %s "
        "| < 200 us, none |",
        factor, 1e6 * Median(times), launched ? "yes" : "no"));
  }
  // The floor under Backward: a unary RPC that does almost nothing.
  {
    std::vector<double> times;
    for (int i = 0; i < 1001; ++i) {
      pb::GetServerInfoRequest request;
      pb::ServerInfo response;
      grpc::ClientContext context;
      const auto start = Clock::now();
      Check(stub->GetServerInfo(&context, request, &response), "info");
      if (i > 0) times.push_back(Seconds(start));
    }
    line(absl::StrFormat(
        "| GetServerInfo (the unary RPC floor, for comparison) | RPC median "
        "%.1f us | |",
        1e6 * Median(times)));
  }

  // Download of the gradient with the pending 0.5, as stored (bf16).
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
    line(absl::StrFormat(
        "| Download gradient (x0.5 applied on the device) | %.3f s = %.2f "
        "GB/s | |",
        seconds, bytes / seconds / 1e9));
  }
  // The same as lossd::Client fetches it into a caller's buffer (touched
  // once before, so that no row pays for page faults): over `streams` data
  // connections (the scale applied on the device, the bytes sent from host
  // memory over TCP), and over as many ranged gRPC streams (data connections
  // off), against raw TCP over as many connections (the upload rows').
  {
    std::vector<char> into(logits.size(), 1);
    const std::unique_ptr<lossd::Client> ranged_client = [&] {
      lossd::ClientOptions options;
      options.upload_streams = streams;
      options.data_connection = false;
      absl::StatusOr<std::unique_ptr<lossd::Client>> made =
          lossd::Client::Connect((*server)->address(), options);
      if (!made.ok()) Die(made.status().ToString());
      return *std::move(made);
    }();
    std::vector<double> data_times, ranged_times;
    for (int i = 0; i < upload_repeats; ++i) {
      const int64_t completed = (*server)->data_plane()->completed();
      auto start = Clock::now();
      absl::StatusOr<lossd::TensorInfo> got = client_k->DownloadInto(
          handle, lossd::DType::kInvalid, into.data(), into.size());
      data_times.push_back(Seconds(start));
      if (!got.ok()) Die(got.status().ToString());
      if ((*server)->data_plane()->completed() != completed + streams) {
        Die("lossd::Client did not download over its data connections");
      }
      start = Clock::now();
      got = ranged_client->DownloadInto(handle, lossd::DType::kInvalid,
                                        into.data(), into.size());
      ranged_times.push_back(Seconds(start));
      if (!got.ok()) Die(got.status().ToString());
    }
    const double data_seconds = Median(data_times);
    const double ranged_seconds = Median(ranged_times);
    line(absl::StrFormat(
        "| Download gradient into a buffer, %d data connections "
        "(lossd::Client::DownloadInto; median of %d) | %.3f s = %.2f GB/s: "
        "%.0f%% of raw TCP (%d connections, the upload rows') | |",
        streams, upload_repeats, data_seconds, gigabytes / data_seconds,
        100 * tcp_k / data_seconds, streams));
    line(absl::StrFormat(
        "| Download gradient into a buffer, %d ranged gRPC streams (the same, "
        "data connections off) | %.3f s = %.2f GB/s: %.0f%% of raw TCP (%d "
        "connections) | |",
        streams, ranged_seconds, gigabytes / ranged_seconds,
        100 * tcp_k / ranged_seconds, streams));
  }

  // Evaluate: the same logits streamed in row blocks, after the reference for
  // its copies.
  if (config.device == "cuda") {
    line(absl::StrFormat(
        "| Reference: host-to-device copy from pinned memory, 4 MiB pieces, "
        "one stream (1 GiB, median of 5) | %.2f GB/s | |",
        PinnedCopyGBs(size_t{4} << 20, size_t{1} << 30, 5)));
  }
  for (absl::string_view size :
       absl::StrSplit(absl::GetFlag(FLAGS_eval_block_bytes), ',')) {
    int64_t block_bytes = 0;
    if (!absl::SimpleAtoi(size, &block_bytes) || block_bytes <= 0) {
      Die("bad --eval_block_bytes");
    }
    const int64_t block_rows = std::max<int64_t>(1, block_bytes / (vocab * 2));
    pb::EvaluateResponse response;
    const double seconds = EvaluateSeconds(channel, logits, targets, rows,
                                           vocab, block_rows, &response);
    // The server's copy + kernel time against the RPC's: near the RPC time
    // minus the network's (raw TCP), they overlap the receipt; near the
    // difference, they do not.
    line(absl::StrFormat(
        "| Evaluate, blocks of %d rows (%.1f MiB) | %.3f s = **%.2f GB/s of "
        "logits** (%.0f%% of raw TCP); server: copies %.3f s + kernel %.3f s; "
        "loss %.6f | |",
        block_rows, block_rows * vocab * 2 / 1048576.0, seconds,
        gigabytes / seconds, 100 * tcp / seconds, response.copy_seconds(),
        response.kernel_seconds(), response.loss()));
    // The same blocks through lossd::Client over its `streams` data
    // connections (block b over connection b mod K).
    const int64_t completed = (*server)->data_plane()->completed();
    const auto start = Clock::now();
    absl::StatusOr<lossd::EvaluateResult> evaluated =
        client_k->Evaluate(rows, vocab, lossd::DType::kBFloat16, logits.data(),
                           lossd::DType::kInt64, targets.data(),
                           lossd::EvaluateOptions(), block_rows);
    const double data_seconds = Seconds(start);
    if (!evaluated.ok()) Die(evaluated.status().ToString());
    if ((*server)->data_plane()->completed() != completed + streams) {
      Die("lossd::Client did not evaluate over its data connections");
    }
    line(absl::StrFormat(
        "| Evaluate, blocks of %d rows, over %d data connections "
        "(lossd::Client::Evaluate) | %.3f s = **%.2f GB/s of logits** (%.0f%% "
        "of raw TCP over %d connections); loss %.6f (stream: %.6f) | |",
        block_rows, streams, data_seconds, gigabytes / data_seconds,
        100 * tcp_k / data_seconds, streams, evaluated->loss, response.loss()));
  }

  // The same client workload against lossd and the Python server.
  if (!absl::GetFlag(FLAGS_python_server).empty()) {
    release(handle);
    release(targets_handle);
    std::string lossd_gradient;
    const Workload ours = RunWorkload(channel, logits, targets, rows, vocab,
                                      chunk, &lossd_gradient);
    std::string client_gradient;
    const Workload ours_client = RunClientWorkload(
        client_k.get(), logits, targets, rows, vocab, &client_gradient);
    if (client_gradient != lossd_gradient) {
      Die("the client workload's gradient differs from the raw one's");
    }
    std::string address;
    const pid_t python = StartPython(&address);
    if (python == 0) {
      line("| Python server | did not start | |");
    } else {
      const std::shared_ptr<grpc::Channel> python_channel = Connect(address);
      std::string python_gradient;
      const Workload theirs = RunWorkload(python_channel, logits, targets, rows,
                                          vocab, chunk, &python_gradient);
      kill(python, SIGTERM);
      waitpid(python, nullptr, 0);
      // Agreement of the two gradients: the largest difference against the
      // largest magnitude (bf16 keeps ~3 significant digits).
      float max_difference = 0;
      float max_magnitude = 0;
      const auto* a = reinterpret_cast<const uint16_t*>(lossd_gradient.data());
      const auto* b = reinterpret_cast<const uint16_t*>(python_gradient.data());
      const int64_t compared =
          std::min(lossd_gradient.size(), python_gradient.size()) / 2;
      for (int64_t i = 0; i < compared; ++i) {
        const float x = lossd::BF16ToFloat(a[i]);
        const float y = lossd::BF16ToFloat(b[i]);
        max_difference = std::max(max_difference, std::fabs(x - y));
        max_magnitude = std::max(max_magnitude, std::fabs(y));
      }
      auto row = [&](const char* who, const Workload& w) {
        line(absl::StrFormat(
            "| Workload on %s: upload, forward (in place), backward 0.5, "
            "download bf16 | total %.3f s (upload %.3f, forward %.3f, "
            "backward %.4f, download %.3f); loss %.6f | |",
            who, w.total, w.upload, w.forward, w.backward, w.download, w.loss));
      };
      row("lossd", ours);
      row(absl::StrFormat("lossd through lossd::Client's defaults (data "
                          "connections both ways; the total includes %.3f s "
                          "of zero-filling a fresh buffer for the gradient)",
                          ours_client.fill)
              .c_str(),
          ours_client);
      row("Python (grpcio + torch F.cross_entropy)", theirs);
      line(absl::StrFormat(
          "| lossd vs Python, end to end | **%.2fx faster** (%.3f s vs %.3f "
          "s); gradients: max difference / max magnitude = %.2g over %d "
          "elements | |",
          theirs.total / ours.total, ours.total, theirs.total,
          max_magnitude > 0 ? max_difference / max_magnitude : 0.0, compared));
      const double kept = ours_client.total - ours_client.fill;
      line(absl::StrFormat(
          "| lossd through lossd::Client vs Python, end to end | **%.2fx "
          "faster** (%.3f s vs %.3f s; same gradient bits as the raw client); "
          "into a gradient buffer already there (a training loop keeps one "
          "from step to step): %.2fx (%.3f s) | |",
          theirs.total / ours_client.total, ours_client.total, theirs.total,
          theirs.total / kept, kept));
    }
  }

  if (!absl::GetFlag(FLAGS_out).empty()) {
    FILE* file = std::fopen(absl::GetFlag(FLAGS_out).c_str(), "a");
    if (file != nullptr) {
      std::fputs(report.c_str(), file);
      std::fclose(file);
    }
  }
  discarding.server->Shutdown();
  copying.server->Shutdown();
  (*server)->Drain();
  return 0;
}
