// service_bench's measured ways (see service_bench_ways.h).
#include "bench/service_bench_ways.h"

#include <cuda_runtime_api.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>

#include "absl/strings/str_format.h"
#include "bench/loopback_tcp.h"
#include "bench/service_bench_setup.h"

namespace service_bench {

namespace {

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

// Upload as the client library does it (client/client_uploads.cc,
// Client::UploadPieces): the header as a protobuf, then each chunk as its
// framing plus a view of the caller's bytes, so no copy is made before the
// socket. Kept on raw channels so that the discarding server and lossd see
// byte-identical traffic. One Upload stream: `header`, then the `bytes` at
// `data`. Returns the handle (empty from the discarding server).
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

}  // namespace

double RawTcpStripedSeconds(const std::string& data, size_t chunk,
                            int connections) {
  absl::StatusOr<loopback_tcp::Connections> connected =
      loopback_tcp::Connect(connections);
  if (!connected.ok()) Die(connected.status().ToString());
  const std::vector<int>& senders = connected->senders;
  std::vector<std::thread> receivers;
  for (const int connection : connected->receivers) {
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
  return seconds;
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

}  // namespace service_bench
