// The orchestrator's step with the LM head on the server, against the logits
// step of the same shape, through one lossd::Client in one process, for
// bench/linear_step.py. Linear step: upload bf16 hidden states [rows, hidden]
// and int64 targets, LinearForward in place (dW accumulated in fp32 on the
// server), Backward 1.0, download dX as bf16; every --dw_every steps also
// download dW as bf16. Logits step: upload bf16 logits [rows, vocab] and the
// targets, Forward in place, Backward 1.0, download the bf16 gradient
// (--nologits_step: the linear step alone, e.g. for a second --precision).
// Prints one JSON object a line.
#include <algorithm>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "bench/step_bench.h"
#include "client/client.h"

ABSL_FLAG(std::string, target, "", "lossd address");
ABSL_FLAG(int64_t, rows, 16384, "rows (tokens) N");
ABSL_FLAG(int64_t, hidden, 4096, "hidden size H");
ABSL_FLAG(int64_t, vocab, 131072, "vocabulary V");
ABSL_FLAG(int, steps, 9, "steps to time, each way");
ABSL_FLAG(int, dw_every, 8,
          "download the weight gradient every this many steps");
ABSL_FLAG(bool, overwrite_weight, false,
          "also re-upload W in place (an optimizer step) before each linear "
          "step, timed apart");
ABSL_FLAG(std::string, precision, "exact",
          "LinearForward's precision: exact (the split dW) or fast (16-bit "
          "products as the peers compute them)");
ABSL_FLAG(bool, logits_step, true, "also time the logits step");

namespace {

using step_bench::Clock;
using step_bench::Die;
using step_bench::Must;
using step_bench::RandomBf16;
using step_bench::Seconds;

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const int64_t rows = absl::GetFlag(FLAGS_rows);
  const int64_t width = absl::GetFlag(FLAGS_hidden);
  const int64_t vocab = absl::GetFlag(FLAGS_vocab);
  const int steps = absl::GetFlag(FLAGS_steps);
  const int dw_every = std::max(1, absl::GetFlag(FLAGS_dw_every));
  const std::string precision = absl::GetFlag(FLAGS_precision);
  if (precision != "exact" && precision != "fast") {
    Die("--precision=" + precision + ": exact or fast");
  }
  // Hidden states about 0.5-2, weights about 1/64-1/32: logits of a few
  // units, as a trained head gives.
  const std::vector<uint16_t> hidden_states =
      RandomBf16(static_cast<size_t>(rows * width), 1, 0x7e, 2);
  const std::vector<uint16_t> weight =
      RandomBf16(static_cast<size_t>(vocab * width), 2, 0x79, 2);
  std::vector<int64_t> targets(static_cast<size_t>(rows));
  {
    std::mt19937 rng(4);
    for (int64_t& target : targets) target = rng() % vocab;
  }

  absl::StatusOr<std::unique_ptr<lossd::Client>> connected =
      lossd::Client::Connect(absl::GetFlag(FLAGS_target));
  Must(connected.status(), "connect");
  lossd::Client& client = **connected;

  // The resident LM head, uploaded once (untimed), and the accumulator.
  absl::StatusOr<lossd::TensorInfo> weight_info =
      client.Upload(lossd::DType::kBFloat16, {vocab, width}, weight.data(),
                    weight.size() * sizeof(uint16_t), "lm_head");
  Must(weight_info.status(), "upload weight");
  std::string weight_grad;
  std::vector<uint16_t> dx(hidden_states.size());
  std::vector<uint16_t> dw(weight.size());

  for (int step = 0; step < steps; ++step) {
    double overwrite = 0.0;
    if (absl::GetFlag(FLAGS_overwrite_weight)) {
      const auto at = Clock::now();
      Must(client
               .Overwrite(weight_info->handle, lossd::DType::kBFloat16,
                          {vocab, width}, weight.data(),
                          weight.size() * sizeof(uint16_t))
               .status(),
           "overwrite weight");
      overwrite = Seconds(at);
    }
    const auto start = Clock::now();
    absl::StatusOr<lossd::TensorInfo> uploaded = client.Upload(
        lossd::DType::kBFloat16, {rows, width}, hidden_states.data(),
        hidden_states.size() * sizeof(uint16_t));
    Must(uploaded.status(), "upload hidden");
    absl::StatusOr<lossd::TensorInfo> uploaded_targets =
        client.Upload(lossd::DType::kInt64, {rows}, targets.data(),
                      targets.size() * sizeof(int64_t));
    Must(uploaded_targets.status(), "upload targets");
    const double upload = Seconds(start);
    auto at = Clock::now();
    lossd::LinearForwardOptions options;
    options.weight_grad = weight_grad;
    options.precision = precision == "fast"
                            ? lossd::LinearForwardPrecision::kFast
                            : lossd::LinearForwardPrecision::kExact;
    // A new accumulation window every dw_every steps, as an optimizer step
    // would start one.
    options.accumulate = step % dw_every == 0
                             ? lossd::LinearAccumulate::kOverwrite
                             : lossd::LinearAccumulate::kAdd;
    absl::StatusOr<lossd::LinearForwardResult> forward = client.LinearForward(
        uploaded->handle, weight_info->handle,
        lossd::Targets::Handle(uploaded_targets->handle), options);
    Must(forward.status(), "linear forward");
    weight_grad = forward->weight_grad;
    const double forward_seconds = Seconds(at);
    at = Clock::now();
    Must(client.Backward(forward->forward.gradient, 1.0).status(), "backward");
    const double backward = Seconds(at);
    at = Clock::now();
    Must(client
             .DownloadInto(forward->forward.gradient, lossd::DType::kBFloat16,
                           dx.data(), dx.size() * sizeof(uint16_t))
             .status(),
         "download dX");
    const double download = Seconds(at);
    double download_dw = 0.0;
    if ((step + 1) % dw_every == 0) {
      at = Clock::now();
      Must(client
               .DownloadInto(weight_grad, lossd::DType::kBFloat16, dw.data(),
                             dw.size() * sizeof(uint16_t))
               .status(),
           "download dW");
      download_dw = Seconds(at);
    }
    const double total = Seconds(start);
    client.Release(forward->forward.gradient).IgnoreError();
    client.Release(uploaded_targets->handle).IgnoreError();
    std::printf(
        "{\"way\": \"linear\", \"precision\": \"%s\", \"step\": %d, "
        "\"seconds\": %.4f, \"upload\": %.4f, \"forward\": %.4f, "
        "\"backward\": %.4f, \"download\": %.4f, \"download_dw\": %.4f, "
        "\"overwrite_weight\": %.4f, \"kernel\": %.4f, \"loss\": %.6f}\n",
        precision.c_str(), step, total, upload, forward_seconds, backward,
        download, download_dw, overwrite, forward->forward.kernel_seconds,
        forward->forward.loss);
    std::fflush(stdout);
  }
  client.Release(weight_grad).IgnoreError();
  client.Release(weight_info->handle).IgnoreError();
  if (!absl::GetFlag(FLAGS_logits_step)) return 0;

  const std::vector<uint16_t> logits =
      RandomBf16(static_cast<size_t>(rows * vocab), 3, 0x7e, 2);
  std::vector<uint16_t> gradient(logits.size());
  for (int step = 0; step < steps; ++step) {
    const step_bench::LogitsStep timed = step_bench::TimeLogitsStep(
        client, logits, targets, rows, vocab, &gradient);
    std::printf(
        "{\"way\": \"logits\", \"step\": %d, \"seconds\": %.4f, \"upload\": "
        "%.4f, \"forward\": %.4f, \"backward\": %.4f, \"download\": %.4f, "
        "\"kernel\": %.4f, \"loss\": %.6f}\n",
        step, timed.seconds, timed.upload, timed.forward, timed.backward,
        timed.download, timed.forward_result.kernel_seconds,
        timed.forward_result.loss);
    std::fflush(stdout);
  }
  return 0;
}
