// Service benchmark: what the gRPC service adds on top of the CUDA kernel.
// Starts lossd in process on 127.0.0.1:0 and measures, for one [rows, vocab]
// bf16 tensor: upload throughput against raw TCP and against a server that
// discards the bytes, Forward RPC time against the bare kernel (CUDA events),
// Backward RPC time, download and Evaluate throughput, peak device memory, and
// one client workload against lossd and against bench/python_server.py.
// The helpers are in service_bench_setup.cc, the measured ways in
// service_bench_ways.cc.
#include <signal.h>
#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "bench/service_bench_setup.h"
#include "bench/service_bench_ways.h"
#include "client/client.h"
#include "common/float16.h"
#include "grpcpp/grpcpp.h"
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
using service_bench::Check;
using service_bench::Clock;
using service_bench::Connect;
using service_bench::ConnectStripes;
using service_bench::Die;
using service_bench::DiscardService;
using service_bench::EvaluateSeconds;
using service_bench::ExtraGrpcArgs;
using service_bench::KernelSeconds;
using service_bench::Median;
using service_bench::PinnedCopyGBs;
using service_bench::PoolHighWater;
using service_bench::RawStripedUpload;
using service_bench::RawTcpStripedSeconds;
using service_bench::RawUpload;
using service_bench::ResetPoolHighWater;
using service_bench::RunClientWorkload;
using service_bench::RunWorkload;
using service_bench::Seconds;
using service_bench::StartPython;
using service_bench::Workload;

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
