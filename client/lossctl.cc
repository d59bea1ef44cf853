// lossctl: the command-line client of lossd, for people and shell scripts.
// Thin over lossd::Client; results go to stdout (one parseable line each),
// progress and diagnostics to stderr. --server may name several instances
// (RoutingClient): handles go to their owner, uploads to the emptiest one.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <initializer_list>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "client/convert.h"
#include "client/lossctl_post_training.h"
#include "client/npy.h"
#include "client/router.h"
#include "client/tensor_file.h"
#include "common/status_macros.h"

ABSL_FLAG(std::string, server, "127.0.0.1:50051",
          "lossd address host:port; several comma-separated, or "
          "dns:///NAME:PORT for every address of a headless Service "
          "(handles go to their instance, uploads to the most free memory)");
ABSL_FLAG(absl::Duration, deadline, absl::InfiniteDuration(),
          "deadline of each RPC, e.g. 30s (default: none)");
ABSL_FLAG(absl::Duration, connect_wait, absl::Seconds(1),
          "how long an RPC first waits for the connection to come up (e.g. "
          "60s while a pod starts); 0 = fail at once when it is down");
ABSL_FLAG(int64_t, chunk_bytes, 1 << 20,
          "bytes per upload/download/eval message");
ABSL_FLAG(std::string, token, "", "bearer token sent with every RPC");
ABSL_FLAG(std::string, token_file, "",
          "read the bearer token from this file (first line), keeping it out "
          "of the process list");
ABSL_FLAG(bool, tls, false,
          "connect with TLS (implied by --tls_ca, --tls_cert, --tls_key)");
ABSL_FLAG(std::string, tls_ca, "",
          "PEM CA of the server's certificate (default: the system roots)");
ABSL_FLAG(std::string, tls_cert, "",
          "mutual TLS: PEM certificate chain of this client");
ABSL_FLAG(std::string, tls_key, "", "mutual TLS: PEM key of --tls_cert");
ABSL_FLAG(std::string, tls_server_name, "",
          "name to check the server's certificate against instead of the "
          "host of --server");
ABSL_FLAG(bool, progress, false,
          "show progress on stderr even when it is not a terminal");

ABSL_FLAG(std::string, dtype, "",
          "upload/eval: convert the logits to this dtype while sending "
          "(float32, bf16, float16); download: ask the server for this dtype");
ABSL_FLAG(std::string, label, "",
          "upload: label of the tensor (at most 1024 bytes, one line)");
ABSL_FLAG(std::string, idempotency_key, "",
          "upload: names the upload (0-128 chars of [A-Za-z0-9_-]): running "
          "the same upload again with the same key returns the tensor the "
          "first run stored instead of storing a second one");
ABSL_FLAG(std::string, overwrite, "",
          "upload: replace the contents of this stored tensor (same dtype "
          "and shape; the handle, label and memory stay) instead of storing "
          "a new one, sent as an upload of that size");
ABSL_FLAG(bool, data_connection, true,
          "upload a tensor of at least --stripe_min_bytes, and send eval's "
          "blocks, over --upload_streams plain TCP connections to the "
          "server's data port when the server offers one and TLS is off "
          "(otherwise, or when that port cannot be reached, over gRPC)");
ABSL_FLAG(bool, check_server_features, true,
          "forward, linear and eval with a post-training flag first check "
          "that the server lists post_training in its features (lossctl "
          "info) and fail FAILED_PRECONDITION, sending nothing, when it does "
          "not; false skips that check");
ABSL_FLAG(int, upload_streams, 4,
          "upload: a tensor of at least --stripe_min_bytes that does not go "
          "over a data connection goes as this many parallel streams over as "
          "many connections (1 = one stream)");
ABSL_FLAG(int64_t, stripe_min_bytes, int64_t{64} << 20,
          "upload: smallest tensor sent over a data connection or as parallel "
          "streams");
ABSL_FLAG(std::string, near, "",
          "upload: store the tensor on the instance holding this handle "
          "(a forward's targets and weights must share the logits' instance)");

ABSL_FLAG(std::string, reduction, "mean", "mean, sum or none");
ABSL_FLAG(int64_t, ignore_index, -100, "target value that is ignored");
ABSL_FLAG(double, label_smoothing, 0.0, "in [0, 1]");
ABSL_FLAG(double, z_loss_scale, 0.0, "weight of the lse^2 term (>= 0)");
ABSL_FLAG(double, softcap, 0.0, "logit soft-capping (0 = off)");
ABSL_FLAG(std::string, weights, "", "handle of fp32 [V] class weights");
ABSL_FLAG(std::string, mode, "in_place",
          "forward: in_place, out_of_place or none");
ABSL_FLAG(double, normalizer, 0.0,
          "divide a mean by this token count (0 = the valid-token count)");
ABSL_FLAG(double, grad_scale, 1.0, "grad_output folded into the gradient");
ABSL_FLAG(std::string, gradient_label, "",
          "forward: label of an out-of-place gradient");

ABSL_FLAG(std::string, bias, "", "linear, eval: handle of the [V] bias");
ABSL_FLAG(std::string, weight, "",
          "eval: handle of a stored LM head W [V, H]; the file then holds "
          "hidden states [N, H] of W's dtype instead of logits");
ABSL_FLAG(std::string, weight_grad, "",
          "linear: fp32 [V, H] accumulator of the weight gradient (empty = "
          "create one)");
ABSL_FLAG(std::string, bias_grad, "",
          "linear: fp32 [V] accumulator of the bias gradient (empty = create "
          "one when --bias is set)");
ABSL_FLAG(std::string, accumulate, "",
          "linear: add, overwrite or none (empty = add with a gradient)");
ABSL_FLAG(std::string, linear_precision, "exact",
          "linear: exact (dW within ~3e-5 of fp32) or fast (16-bit products "
          "on a CUDA device: a ~1.1x faster kernel, dW 2e-4 to 2e-2)");

ABSL_FLAG(std::string, grad_output, "1",
          "backward: a number, or a float32 [N] .npy of per-token factors");
ABSL_FLAG(bool, materialize, false,
          "backward: apply the factor on the server now, in place");
ABSL_FLAG(int64_t, piece_bytes, int64_t{8} << 20,
          "upload/download: bytes each connection converts and sends, or "
          "receives and writes, at a time (in [64 KiB, 1 GiB])");
ABSL_FLAG(int, convert_threads, 0,
          "threads that convert dtypes and write files besides the "
          "transfer's own (0 = one per core)");
ABSL_FLAG(std::string, write_mode, "mmap",
          "download: how pieces reach the file: mmap (converted straight into "
          "a shared mapping, by every thread at once) or pwrite (from a small "
          "buffer per thread; tmpfs takes one file's pwrites one at a time)");
ABSL_FLAG(int64_t, block_rows, 0,
          "eval: rows per message (0 = as many as fit --chunk_bytes)");
namespace lossd {
namespace {

constexpr char kUsage[] =
    R"(lossctl: command-line client of lossd.

usage: lossctl [--server=host:port[,host:port...] | --server=dns:///NAME:PORT]
               COMMAND [ARGS] [FLAGS]

commands:
  health                         liveness and readiness of each server
  info                           instance id, device, memory of each
  upload FILE                    store a tensor; prints its handle. FILE is
         [--dtype=bf16]          FILE.npy, FILE.safetensors (its only
         [--label=TEXT]          tensor) or FILE.safetensors:NAME; --dtype
         [--near=HANDLE]         converts float data on the way (all cores);
         [--idempotency_key=K]   the same K again returns the first run's
         [--overwrite=HANDLE]    tensor instead of storing a second one;
                                 --overwrite replaces HANDLE's contents in
                                 place (same dtype and shape) and prints it
  forward LOGITS TARGETS         cross entropy; TARGETS is a handle or an
         [--reduction --ignore_index --label_smoothing --z_loss_scale
          --softcap --weights --mode --normalizer --grad_scale]
                                 int32/int64 tensor file sent inline
         [--teacher | --teacher_indices --teacher_logprobs [--top_k_tail]]
         [--temperature --alpha --divergence --beta]
                                 distillation (TARGETS "none" with alpha 0)
         [--policy_loss --advantages --old_logprobs [--ref_logprobs
          --kl_coef --kl_estimator] --epsilon_low --epsilon_high]
                                 a policy-gradient loss
         [--segments --num_segments --segment_reduction]
                                 per-segment sums of packed sequences
         [--token_logprob --token_entropy --token_ratio]
  linear HIDDEN WEIGHT TARGETS    the LM head and cross entropy: hidden
         [loss options --mode    states [N, H] times the weight [V, H];
          --bias --weight_grad   dX as --mode says, dW (and dbias) added
          --bias_grad            into fp32 accumulators (printed)
          --accumulate
          --linear_precision     forward's post-training flags: that
          and forward's post-    loss on Z = X W^T (TARGETS "none"
          training flags]        with alpha 0)
  backward HANDLE                record grad_output for a gradient
         [--grad_output=X|FILE]  (FILE: a float32 [N] tensor file)
         [--materialize]
  download HANDLE OUT            fetch a tensor into OUT.npy (bf16 is
         [--dtype]               written as float32) or OUT.safetensors[:NAME]
                                 (written as sent, bf16 included; NAME
                                 defaults to the tensor's label, else
                                 "gradient" or "tensor")
  ls                             list tensors (all pages)
  rm HANDLE...                   release tensors
  eval LOGITS TARGETS|none       stream the files to Evaluate; prints loss
                                 (none: a distillation with alpha 0)
         [loss options] [--block_rows] [--dtype] [--progress]
         [--teacher=FILE | --teacher_indices=FILE --teacher_logprobs=FILE]
         [distillation flags] [--segments=FILE --num_segments]
         [--weight [--bias]]     LOGITS holds hidden states [N, H] against
                                 the stored LM head W [V, H] (+ bias)

Files are mapped, not read whole; conversion and writing run on all cores
(--convert_threads) while the pieces (--piece_bytes) are in flight.
)";

// A one-line progress bar on stderr, redrawn at most ten times a second.
class ProgressBar {
 public:
  ProgressBar(std::string what, std::string unit, double unit_scale)
      : what_(std::move(what)),
        unit_(std::move(unit)),
        unit_scale_(unit_scale),
        enabled_(absl::GetFlag(FLAGS_progress) || isatty(STDERR_FILENO)),
        start_(absl::Now()) {}
  ~ProgressBar() { Done(); }

  // Ends the bar's line, so that later output starts on a fresh one.
  void Done() {
    if (drawn_) std::fputc('\n', stderr);
    drawn_ = false;
  }

  void Update(int64_t done, int64_t total) {
    if (!enabled_) return;
    const absl::Time now = absl::Now();
    if (drawn_ && done != total && now - last_draw_ < absl::Milliseconds(100)) {
      return;
    }
    last_draw_ = now;
    drawn_ = true;
    const double seconds = std::max(absl::ToDoubleSeconds(now - start_), 1e-9);
    const double rate = done / unit_scale_ / seconds;
    constexpr int kWidth = 30;
    std::string bar;
    if (total > 0) {
      const double fraction = std::min(1.0, static_cast<double>(done) / total);
      const int filled = static_cast<int>(fraction * kWidth);
      bar = absl::StrCat("[", std::string(filled, '#'),
                         std::string(kWidth - filled, '.'), "] ",
                         absl::StrFormat("%5.1f%% ", 100.0 * fraction));
    }
    // Whole units (rows) print as integers, scaled ones (MB) with a decimal.
    const int decimals = unit_scale_ == 1.0 ? 0 : 1;
    std::string count =
        total > 0
            ? absl::StrFormat("%.*f/%.*f %s", decimals, done / unit_scale_,
                              decimals, total / unit_scale_, unit_)
            : absl::StrFormat("%.*f %s", decimals, done / unit_scale_, unit_);
    std::fprintf(stderr, "\r%s %s%s %.1f %s/s   ", what_.c_str(), bar.c_str(),
                 count.c_str(), rate, unit_.c_str());
    std::fflush(stderr);
  }

  ProgressCallback Callback() {
    return [this](int64_t done, int64_t total) { Update(done, total); };
  }

 private:
  const std::string what_;
  const std::string unit_;
  const double unit_scale_;
  const bool enabled_;
  const absl::Time start_;
  absl::Time last_draw_;
  bool drawn_ = false;
};

absl::Status UsageError(absl::string_view message) {
  return absl::InvalidArgumentError(absl::StrCat("usage: ", message));
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

absl::StatusOr<std::unique_ptr<RoutingClient>> MakeClient() {
  RoutingOptions options;
  const int64_t chunk = absl::GetFlag(FLAGS_chunk_bytes);
  if (chunk <= 0) return UsageError("--chunk_bytes must be positive");
  options.client.chunk_bytes = static_cast<std::size_t>(chunk);
  options.client.deadline = absl::GetFlag(FLAGS_deadline);
  options.client.connect_wait = absl::GetFlag(FLAGS_connect_wait);
  if (options.client.connect_wait < absl::ZeroDuration()) {
    return UsageError("--connect_wait must not be negative");
  }
  const int streams = absl::GetFlag(FLAGS_upload_streams);
  if (streams < 1 || streams > 64) {
    return UsageError("--upload_streams must be in [1, 64]");
  }
  options.client.upload_streams = streams;
  const int64_t stripe_min = absl::GetFlag(FLAGS_stripe_min_bytes);
  if (stripe_min < 0) return UsageError("--stripe_min_bytes must be >= 0");
  options.client.stripe_min_bytes = static_cast<std::size_t>(stripe_min);
  options.client.data_connection = absl::GetFlag(FLAGS_data_connection);
  options.client.check_server_features =
      absl::GetFlag(FLAGS_check_server_features);
  const int64_t piece = absl::GetFlag(FLAGS_piece_bytes);
  if (piece < (int64_t{64} << 10) || piece > (int64_t{1} << 30)) {
    return UsageError("--piece_bytes must be in [64 KiB, 1 GiB]");
  }
  options.client.piece_bytes = static_cast<std::size_t>(piece);
  options.client.bearer_token = absl::GetFlag(FLAGS_token);
  const std::string token_file = absl::GetFlag(FLAGS_token_file);
  if (!token_file.empty()) {
    if (!options.client.bearer_token.empty()) {
      return UsageError("--token and --token_file exclude each other");
    }
    std::ifstream in(token_file);
    std::string token;
    if (!in || !std::getline(in, token)) {
      return UsageError(absl::StrCat("cannot read --token_file '", token_file,
                                     "': ", std::strerror(errno)));
    }
    options.client.bearer_token =
        std::string(absl::StripAsciiWhitespace(token));
  }
  options.client.tls = absl::GetFlag(FLAGS_tls);
  options.client.tls_ca_file = absl::GetFlag(FLAGS_tls_ca);
  options.client.tls_cert_file = absl::GetFlag(FLAGS_tls_cert);
  options.client.tls_key_file = absl::GetFlag(FLAGS_tls_key);
  options.client.tls_server_name = absl::GetFlag(FLAGS_tls_server_name);
  std::vector<std::string> targets =
      absl::StrSplit(absl::GetFlag(FLAGS_server), ',', absl::SkipWhitespace());
  for (std::string& target : targets) {
    target = std::string(absl::StripAsciiWhitespace(target));
  }
  if (targets.empty()) return UsageError("--server is empty");
  return RoutingClient::Connect(std::move(targets), options);
}

absl::StatusOr<Reduction> ParseReduction(const std::string& name) {
  if (name == "mean") return Reduction::kMean;
  if (name == "sum") return Reduction::kSum;
  if (name == "none") return Reduction::kNone;
  return UsageError(
      absl::StrCat("--reduction=", name, ": expected mean, sum or none"));
}

absl::StatusOr<GradientMode> ParseMode(const std::string& name) {
  if (name == "in_place") return GradientMode::kInPlace;
  if (name == "out_of_place") return GradientMode::kOutOfPlace;
  if (name == "none") return GradientMode::kNone;
  return UsageError(absl::StrCat("--mode=", name,
                                 ": expected in_place, out_of_place or none"));
}

absl::StatusOr<CrossEntropyOptions> LossOptionsFromFlags() {
  CrossEntropyOptions loss;
  ASSIGN_OR_RETURN(loss.reduction,
                   ParseReduction(absl::GetFlag(FLAGS_reduction)));
  loss.ignore_index = absl::GetFlag(FLAGS_ignore_index);
  loss.label_smoothing =
      static_cast<float>(absl::GetFlag(FLAGS_label_smoothing));
  loss.z_loss_scale = static_cast<float>(absl::GetFlag(FLAGS_z_loss_scale));
  loss.softcap = static_cast<float>(absl::GetFlag(FLAGS_softcap));
  loss.normalizer = absl::GetFlag(FLAGS_normalizer);
  loss.grad_scale = static_cast<float>(absl::GetFlag(FLAGS_grad_scale));
  return loss;
}

// The dtype --dtype asks for, or `fallback` when the flag is empty.
absl::StatusOr<DType> DTypeFlag(DType fallback) {
  const std::string name = absl::GetFlag(FLAGS_dtype);
  if (name.empty()) return fallback;
  return DTypeFromString(name);
}

// With several servers each line starts with the server's address.
absl::Status Health(RoutingClient& client) {
  const auto live = client.Health("");
  const auto ready = client.Health(kLossdService);
  absl::Status first_error;
  const auto state = [&first_error](const absl::StatusOr<bool>& serving) {
    if (!serving.ok()) {
      if (first_error.ok()) first_error = serving.status();
      return serving.status().ToString();
    }
    if (!*serving && first_error.ok()) {
      first_error = absl::UnavailableError("a server is not serving");
    }
    return std::string(*serving ? "SERVING" : "NOT_SERVING");
  };
  for (size_t i = 0; i < live.size() && i < ready.size(); ++i) {
    const std::string prefix =
        live.size() == 1 ? "" : absl::StrCat(live[i].first, " ");
    std::printf("%sliveness %s\n%sreadiness %s\n", prefix.c_str(),
                state(live[i].second).c_str(), prefix.c_str(),
                state(ready[i].second).c_str());
  }
  return first_error;
}

absl::Status Info(RoutingClient& client) {
  const std::vector<InstanceStatus> instances = client.Instances();
  absl::Status first_error;
  for (const InstanceStatus& instance : instances) {
    if (instances.size() > 1) {
      std::printf("endpoint %s\n", instance.endpoint.c_str());
    }
    if (!instance.status.ok()) {
      std::fprintf(stderr, "lossctl: %s: %s\n", instance.endpoint.c_str(),
                   instance.status.ToString().c_str());
      if (first_error.ok()) first_error = instance.status;
      continue;
    }
    const ServerInfo& info = instance.info;
    std::printf(
        "instance %s\ndevice %s\nversion %s\ntensors %lld\nbudget_bytes "
        "%lld\nused_bytes %lld\nfree_bytes %lld\ndata_port %d\nfeatures "
        "%s\n",
        info.instance_id.c_str(), info.device.c_str(), info.version.c_str(),
        static_cast<long long>(info.tensors),
        static_cast<long long>(info.budget_bytes),
        static_cast<long long>(info.used_bytes),
        static_cast<long long>(info.free_bytes), info.data_port,
        absl::StrJoin(info.features, ",").c_str());
  }
  return first_error;
}

// The conversion threads of this process, made on first use.
ConvertPool& Pool() {
  static ConvertPool* pool =
      new ConvertPool(absl::GetFlag(FLAGS_convert_threads));
  return *pool;
}

double Rate(double bytes, double seconds) {
  return bytes / 1e9 / std::max(seconds, 1e-9);
}

absl::Status Upload(RoutingClient& client,
                    const std::vector<std::string>& args) {
  if (args.size() != 1) {
    return UsageError("lossctl upload FILE.npy|FILE.safetensors[:NAME]");
  }
  const std::string overwrite = absl::GetFlag(FLAGS_overwrite);
  if (!overwrite.empty()) {
    // An overwrite names its tensor: where it lives, its label and its key
    // are that tensor's.
    for (const auto& [flag, value] :
         {std::pair<const char*, std::string>{"label",
                                              absl::GetFlag(FLAGS_label)},
          {"near", absl::GetFlag(FLAGS_near)},
          {"idempotency_key", absl::GetFlag(FLAGS_idempotency_key)}}) {
      if (!value.empty()) {
        return UsageError(absl::StrCat(
            "--", flag, "=", value,
            " does not go with --overwrite: the overwritten tensor keeps its "
            "own (leave --",
            flag, " out)"));
      }
    }
  }
  const absl::Time start = absl::Now();
  ASSIGN_OR_RETURN(std::unique_ptr<InputTensor> input,
                   InputTensor::Open(args[0]));
  ASSIGN_OR_RETURN(const DType dtype, DTypeFlag(input->dtype()));
  if (!CanConvert(input->dtype(), dtype)) {
    return UsageError(absl::StrCat(
        "--dtype=", DTypeString(dtype), ": ", input->description(), " holds ",
        DTypeString(input->dtype()), ", which does not convert to it"));
  }
  // The file is read, converted and sent piece by piece, all at once.
  const std::size_t bytes = input->elements() * DTypeSize(dtype);
  ProgressBar bar("upload", "MB", 1e6);
  const UploadSource source = MakeUploadSource(*input, dtype, &Pool());
  ASSIGN_OR_RETURN(
      const TensorInfo info,
      overwrite.empty()
          ? client.UploadFrom(dtype, input->shape(), source,
                              absl::GetFlag(FLAGS_label), bar.Callback(),
                              absl::GetFlag(FLAGS_near),
                              absl::GetFlag(FLAGS_idempotency_key))
          : client.OverwriteFrom(overwrite, dtype, input->shape(), source,
                                 bar.Callback()));
  bar.Done();
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  const std::string done = overwrite.empty()
                               ? absl::StrCat("uploaded ", input->description())
                               : absl::StrCat("overwrote ", overwrite, " with ",
                                              input->description());
  std::fprintf(stderr, "%s as %s %s, %zu bytes in %.3f s (%.2f GB/s)\n",
               done.c_str(), DTypeString(dtype),
               ShapeString(input->shape()).c_str(), bytes, seconds,
               Rate(bytes, seconds));
  std::printf("%s\n", info.handle.c_str());
  return absl::OkStatus();
}

// The options forward and linear share, from their flags: the loss
// options, --mode, --weights and --gradient_label.
template <typename Options>
absl::Status ForwardFlagsInto(Options* options) {
  ASSIGN_OR_RETURN(options->loss, LossOptionsFromFlags());
  ASSIGN_OR_RETURN(options->mode, ParseMode(absl::GetFlag(FLAGS_mode)));
  options->class_weights = absl::GetFlag(FLAGS_weights);
  options->gradient_label = absl::GetFlag(FLAGS_gradient_label);
  return absl::OkStatus();
}

// A TARGETS argument: a handle, or a tensor file sent inline (opened into
// `*file`, which must outlive the call that sends it).
absl::StatusOr<Targets> TargetsArg(const std::string& arg,
                                   std::unique_ptr<InputTensor>* file) {
  if (!LooksLikeTensorFile(arg)) return Targets::Handle(arg);
  ASSIGN_OR_RETURN(*file, InputTensor::Open(arg));
  return Targets::Inline((*file)->dtype(), (*file)->data(), (*file)->bytes());
}

// forward's and linear's result lines.
void PrintForwardResult(const ForwardResult& result) {
  std::printf(
      "loss %.17g z_loss %.17g valid %lld correct %lld nonfinite %lld "
      "denominator %.17g kernel_seconds %.6f\n",
      result.loss, result.z_loss, static_cast<long long>(result.valid_tokens),
      static_cast<long long>(result.correct_tokens),
      static_cast<long long>(result.nonfinite_rows), result.denominator,
      result.kernel_seconds);
  if (!result.gradient.empty()) {
    std::printf("gradient %s\n", result.gradient.c_str());
  }
}

absl::Status Forward(RoutingClient& client,
                     const std::vector<std::string>& args) {
  if (args.size() != 2) {
    return UsageError(
        "lossctl forward LOGITS_HANDLE TARGETS(handle|.npy|.safetensors|none)");
  }
  ForwardOptions options;
  RETURN_IF_ERROR(ForwardFlagsInto(&options));
  std::vector<std::unique_ptr<InputTensor>> files;
  RETURN_IF_ERROR(PostTrainingFlagsInto(&options, &files));
  std::unique_ptr<InputTensor> targets_file;
  Targets targets;  // "none": no targets (a distillation with alpha 0)
  if (args[1] != "none") {
    ASSIGN_OR_RETURN(targets, TargetsArg(args[1], &targets_file));
  }
  ASSIGN_OR_RETURN(const ForwardResult result,
                   client.Forward(args[0], targets, options));
  PrintForwardResult(result);
  PrintPostTrainingResult(options, result);
  return absl::OkStatus();
}

absl::Status Linear(RoutingClient& client,
                    const std::vector<std::string>& args) {
  if (args.size() != 3) {
    return UsageError(
        "lossctl linear HIDDEN_HANDLE WEIGHT_HANDLE "
        "TARGETS(handle|.npy|.safetensors)");
  }
  LinearForwardOptions options;
  RETURN_IF_ERROR(ForwardFlagsInto(&options));
  options.bias = absl::GetFlag(FLAGS_bias);
  options.weight_grad = absl::GetFlag(FLAGS_weight_grad);
  options.bias_grad = absl::GetFlag(FLAGS_bias_grad);
  const std::string accumulate = absl::GetFlag(FLAGS_accumulate);
  if (accumulate == "add") {
    options.accumulate = LinearAccumulate::kAdd;
  } else if (accumulate == "overwrite") {
    options.accumulate = LinearAccumulate::kOverwrite;
  } else if (accumulate == "none") {
    options.accumulate = LinearAccumulate::kNone;
  } else if (!accumulate.empty()) {
    return UsageError(absl::StrCat("--accumulate=", accumulate,
                                   ": add, overwrite, none or empty"));
  }
  const std::string precision = absl::GetFlag(FLAGS_linear_precision);
  if (precision == "fast") {
    options.precision = LinearForwardPrecision::kFast;
  } else if (precision != "exact") {
    return UsageError(
        absl::StrCat("--linear_precision=", precision, ": exact or fast"));
  }
  std::vector<std::unique_ptr<InputTensor>> files;
  RETURN_IF_ERROR(PostTrainingFlagsInto(&options, &files));
  std::unique_ptr<InputTensor> targets_file;
  Targets targets;  // "none": no targets (a distillation with alpha 0)
  if (args[2] != "none") {
    ASSIGN_OR_RETURN(targets, TargetsArg(args[2], &targets_file));
  }
  ASSIGN_OR_RETURN(const LinearForwardResult linear,
                   client.LinearForward(args[0], args[1], targets, options));
  PrintForwardResult(linear.forward);
  PrintPostTrainingResult(options, linear.forward);
  if (!linear.weight_grad.empty()) {
    std::printf("weight_grad %s\n", linear.weight_grad.c_str());
  }
  if (!linear.bias_grad.empty()) {
    std::printf("bias_grad %s\n", linear.bias_grad.c_str());
  }
  return absl::OkStatus();
}

absl::Status Backward(RoutingClient& client,
                      const std::vector<std::string>& args) {
  if (args.size() != 1) return UsageError("lossctl backward HANDLE");
  const std::string grad_output = absl::GetFlag(FLAGS_grad_output);
  const bool materialize = absl::GetFlag(FLAGS_materialize);
  BackwardResult result;
  if (LooksLikeTensorFile(grad_output)) {
    ASSIGN_OR_RETURN(std::unique_ptr<InputTensor> file,
                     InputTensor::Open(grad_output));
    if (file->dtype() != DType::kFloat32 || file->shape().size() != 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          file->description(), ": expected a float32 [N] array, got ",
          DTypeString(file->dtype()), " ", ShapeString(file->shape())));
    }
    std::vector<float> values(file->elements());
    std::memcpy(values.data(), file->data(), file->bytes());
    ASSIGN_OR_RETURN(result, client.Backward(args[0], values, materialize));
  } else {
    double scalar;
    if (!absl::SimpleAtod(grad_output, &scalar)) {
      return UsageError(
          absl::StrCat("--grad_output=", grad_output,
                       ": expected a number, a .npy or a .safetensors file"));
    }
    ASSIGN_OR_RETURN(result, client.Backward(args[0], scalar, materialize));
  }
  std::printf("%s %s pending_scale %.17g%s kernel_launched %s\n",
              result.tensor.handle.c_str(),
              TensorStateName(result.tensor.state), result.tensor.pending_scale,
              result.tensor.pending_token_scale ? " (per-token)" : "",
              result.kernel_launched ? "true" : "false");
  return absl::OkStatus();
}

// The name of a downloaded tensor in a safetensors file without :NAME.
std::string DefaultTensorName(const TensorInfo& info) {
  if (!info.label.empty()) return info.label;
  return info.state == TensorState::kGradient ? "gradient" : "tensor";
}

absl::Status Download(RoutingClient& client,
                      const std::vector<std::string>& args) {
  if (args.size() != 2) {
    return UsageError("lossctl download HANDLE OUT.npy|OUT.safetensors[:NAME]");
  }
  ASSIGN_OR_RETURN(const DType as_dtype, DTypeFlag(DType::kInvalid));
  const std::string write_mode = absl::GetFlag(FLAGS_write_mode);
  if (write_mode != "pwrite" && write_mode != "mmap") {
    return UsageError(
        absl::StrCat("--write_mode=", write_mode, ": expected pwrite or mmap"));
  }
  const OutputTensorFile::WriteMode mode =
      write_mode == "mmap" ? OutputTensorFile::WriteMode::kMapped
                           : OutputTensorFile::WriteMode::kPwrite;
  std::unique_ptr<OutputTensorFile> out;
  ProgressBar bar("download", "MB", 1e6);
  const absl::Time start = absl::Now();
  // Pieces are converted and written at their place in the file as they
  // arrive over the connections, concurrently.
  ASSIGN_OR_RETURN(
      const TensorInfo info,
      client.DownloadTo(
          args[0], as_dtype,
          [&](const TensorInfo& header) -> absl::Status {
            ASSIGN_OR_RETURN(out,
                             OutputTensorFile::Create(
                                 args[1], header.dtype, header.shape,
                                 DefaultTensorName(header), &Pool(), mode));
            return absl::OkStatus();
          },
          [&](int64_t offset, const void* data,
              std::size_t bytes) -> absl::Status {
            if (out == nullptr) {
              return absl::InternalError("download data before its header");
            }
            return out->Write(offset, data, bytes);
          },
          bar.Callback()));
  bar.Done();
  if (out == nullptr) return absl::InternalError("download without a header");
  RETURN_IF_ERROR(out->Commit());
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  std::fprintf(
      stderr,
      "wrote %s%s%s as %s %s, %lld bytes received in %.3f s (%.2f GB/s)\n",
      out->path().c_str(), out->tensor_name().empty() ? "" : ":",
      out->tensor_name().c_str(), DTypeString(out->file_dtype()),
      ShapeString(info.shape).c_str(), static_cast<long long>(info.bytes),
      seconds, Rate(info.bytes, seconds));
  return absl::OkStatus();
}

std::string Age(absl::Time since) {
  if (since == absl::InfinitePast()) return "-";
  const int64_t seconds = absl::ToInt64Seconds(absl::Now() - since);
  if (seconds < 120) return absl::StrCat(seconds, "s");
  if (seconds < 7200) return absl::StrCat(seconds / 60, "m");
  return absl::StrCat(seconds / 3600, "h");
}

absl::Status List(RoutingClient& client, const std::vector<std::string>& args) {
  if (!args.empty()) return UsageError("lossctl ls");
  ASSIGN_OR_RETURN(const RoutedListResult list, client.List());
  std::printf("%-45s %-8s %-16s %12s %-9s %-6s %5s %5s %s\n", "HANDLE", "DTYPE",
              "SHAPE", "BYTES", "STATE", "DEVICE", "AGE", "IDLE", "LABEL");
  for (const TensorInfo& t : list.tensors) {
    std::printf("%-45s %-8s %-16s %12lld %-9s %-6s %5s %5s %s\n",
                t.handle.c_str(), DTypeString(t.dtype),
                ShapeString(t.shape).c_str(), static_cast<long long>(t.bytes),
                TensorStateName(t.state), t.device.c_str(),
                Age(t.created).c_str(), Age(t.last_used).c_str(),
                t.label.c_str());
  }
  absl::Status first_error;
  for (const InstanceStatus& instance : list.instances) {
    const std::string where =
        list.instances.size() == 1 ? "" : absl::StrCat(instance.endpoint, ": ");
    if (!instance.status.ok()) {
      std::fprintf(stderr, "lossctl: %s%s\n", where.c_str(),
                   instance.status.ToString().c_str());
      if (first_error.ok()) first_error = instance.status;
      continue;
    }
    // The caller's tensors there (the server's count includes other tenants).
    const long long mine = std::count_if(
        list.tensors.begin(), list.tensors.end(), [&](const TensorInfo& t) {
          absl::StatusOr<std::string> id = RoutingClient::InstanceOf(t.handle);
          return id.ok() && *id == instance.info.instance_id;
        });
    std::fprintf(stderr, "%s%lld tensors; %lld of %lld bytes used on %s\n",
                 where.c_str(), mine,
                 static_cast<long long>(instance.info.used_bytes),
                 static_cast<long long>(instance.info.budget_bytes),
                 instance.info.device.c_str());
  }
  return first_error;
}

absl::Status Remove(RoutingClient& client,
                    const std::vector<std::string>& args) {
  if (args.empty()) return UsageError("lossctl rm HANDLE...");
  absl::Status first_error;
  for (const std::string& handle : args) {
    absl::StatusOr<int64_t> released = client.Release(handle);
    if (released.ok()) {
      std::printf("released %s %lld bytes\n", handle.c_str(),
                  static_cast<long long>(*released));
    } else {
      std::fprintf(stderr, "lossctl: rm %s: %s\n", handle.c_str(),
                   released.status().ToString().c_str());
      if (first_error.ok()) first_error = released.status();
    }
  }
  if (!first_error.ok()) {
    return absl::Status(first_error.code(), "some handles were not released");
  }
  return absl::OkStatus();
}

absl::Status Eval(RoutingClient& client, const std::vector<std::string>& args) {
  if (args.size() != 2) {
    return UsageError(
        "lossctl eval LOGITS(.npy|.safetensors[:NAME]) "
        "TARGETS(.npy|.safetensors[:NAME]|none)");
  }
  ASSIGN_OR_RETURN(std::unique_ptr<InputTensor> logits,
                   InputTensor::Open(args[0]));
  // "none": no targets (a distillation with alpha 0), as forward's.
  std::unique_ptr<InputTensor> targets;
  if (args[1] != "none") {
    ASSIGN_OR_RETURN(targets, InputTensor::Open(args[1]));
  }
  const std::string weight = absl::GetFlag(FLAGS_weight);
  if (logits->shape().size() != 2 || !IsLogitsDType(logits->dtype())) {
    return absl::InvalidArgumentError(absl::StrCat(
        logits->description(), ": expected float32/bf16/float16 ",
        weight.empty() ? "logits [N, V]" : "hidden states [N, H]", ", got ",
        DTypeString(logits->dtype()), " ", ShapeString(logits->shape())));
  }
  if (targets != nullptr &&
      (targets->shape().size() != 1 || !IsTargetsDType(targets->dtype()) ||
       targets->shape()[0] != logits->shape()[0])) {
    return absl::InvalidArgumentError(absl::StrCat(
        targets->description(), ": expected int32/int64 targets [",
        logits->shape()[0], "], got ", DTypeString(targets->dtype()), " ",
        ShapeString(targets->shape())));
  }
  const int64_t rows = logits->shape()[0];
  const int64_t vocab = logits->shape()[1];
  if (vocab < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        logits->description(), weight.empty() ? ": vocab is 0" : ": H is 0"));
  }
  const DType file_dtype = logits->dtype();
  ASSIGN_OR_RETURN(const DType send_dtype, DTypeFlag(file_dtype));
  if (!IsLogitsDType(send_dtype)) {
    return UsageError("--dtype for eval must be float32, bf16 or float16");
  }
  EvaluateOptions options;
  ASSIGN_OR_RETURN(options.loss, LossOptionsFromFlags());
  options.class_weights = absl::GetFlag(FLAGS_weights);
  options.weight = weight;
  options.bias = absl::GetFlag(FLAGS_bias);
  options.total_rows = rows;
  std::vector<EvalColumn> columns;
  RETURN_IF_ERROR(EvalPostTrainingFromFlags(rows, &options, &columns));
  const std::size_t file_row_bytes = vocab * DTypeSize(file_dtype);
  const std::size_t send_row_bytes = vocab * DTypeSize(send_dtype);
  const DType targets_dtype =
      targets != nullptr ? targets->dtype() : DType::kInvalid;
  const std::size_t target_bytes =
      targets != nullptr ? DTypeSize(targets_dtype) : 0;
  int64_t block_rows = absl::GetFlag(FLAGS_block_rows);
  if (block_rows <= 0) {
    block_rows = std::max<int64_t>(
        1, static_cast<int64_t>(client.options().chunk_bytes / send_row_bytes));
  }
  int64_t next_row = 0;
  const char* logits_data = reinterpret_cast<const char*>(logits->data());
  const char* targets_data =
      targets != nullptr ? reinterpret_cast<const char*>(targets->data())
                         : nullptr;
  ProgressBar bar("eval", "rows", 1.0);
  const absl::Time start = absl::Now();
  ASSIGN_OR_RETURN(
      const EvaluateResult result,
      client.Evaluate(
          vocab, send_dtype, targets_dtype, options,
          [&](RowBlock* block) -> absl::StatusOr<bool> {
            if (next_row >= rows) return false;
            const int64_t n = std::min(block_rows, rows - next_row);
            const char* src = logits_data + next_row * file_row_bytes;
            // The mapping stays unchanged until Evaluate returns, so blocks
            // that need no conversion are sent from it, uncopied.
            block->targets_view =
                targets_data == nullptr
                    ? absl::string_view()
                    : absl::string_view(targets_data + next_row * target_bytes,
                                        n * target_bytes);
            if (send_dtype == file_dtype) {
              block->logits_view = absl::string_view(src, n * file_row_bytes);
            } else {
              block->logits_view = absl::string_view();
              block->logits.resize(n * send_row_bytes);
              RETURN_IF_ERROR(Pool().Convert(src, file_dtype,
                                             block->logits.data(), send_dtype,
                                             static_cast<uint64_t>(n) * vocab));
              block->targets.assign(block->targets_view.data(),
                                    block->targets_view.size());
            }
            CopyEvalColumns(columns, rows, next_row, n, block);
            next_row += n;
            return true;
          },
          bar.Callback()));
  bar.Done();
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  const double accuracy =
      result.valid_tokens > 0
          ? static_cast<double>(result.correct_tokens) / result.valid_tokens
          : 0.0;
  std::fprintf(stderr, "evaluated %lld rows x %lld in %.3f s (%.1f MB/s)\n",
               static_cast<long long>(result.rows),
               static_cast<long long>(vocab), seconds,
               rows * send_row_bytes / 1e6 / std::max(seconds, 1e-9));
  if (result.nonfinite_rows > 0) {
    std::fprintf(stderr, "warning: %lld rows have a non-finite loss\n",
                 static_cast<long long>(result.nonfinite_rows));
  }
  std::printf("loss %.12g accuracy %.6f tokens %lld\n", result.loss, accuracy,
              static_cast<long long>(result.valid_tokens));
  PrintEvalPostTrainingResult(options, result);
  return absl::OkStatus();
}

absl::Status Run(const std::vector<std::string>& positional) {
  if (positional.empty()) return UsageError("no command; see lossctl --help");
  const std::string& command = positional[0];
  const std::vector<std::string> args(positional.begin() + 1, positional.end());
  ASSIGN_OR_RETURN(std::unique_ptr<RoutingClient> client, MakeClient());
  if (command == "health") {
    if (!args.empty()) return UsageError("lossctl health");
    return Health(*client);
  }
  if (command == "info") {
    if (!args.empty()) return UsageError("lossctl info");
    return Info(*client);
  }
  if (command == "upload") return Upload(*client, args);
  if (command == "forward") return Forward(*client, args);
  if (command == "linear") return Linear(*client, args);
  if (command == "backward") return Backward(*client, args);
  if (command == "download") return Download(*client, args);
  if (command == "ls") return List(*client, args);
  if (command == "rm") return Remove(*client, args);
  if (command == "eval") return Eval(*client, args);
  return UsageError(
      absl::StrCat("unknown command '", command, "'; see lossctl --help"));
}

}  // namespace
}  // namespace lossd

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(lossd::kUsage);
  std::vector<char*> parsed = absl::ParseCommandLine(argc, argv);
  const std::vector<std::string> positional(parsed.begin() + 1, parsed.end());
  const absl::Status status = lossd::Run(positional);
  if (!status.ok()) {
    std::fprintf(stderr, "lossctl: %s\n", status.ToString().c_str());
    return absl::StartsWith(status.message(), "usage: ") ? 2 : 1;
  }
  return 0;
}
