// Implementation of lossd::Client over the generated lossd.v1 stubs: the one
// place where gRPC status codes become absl ones, and where plain C++ structs
// are translated to and from the protobuf messages.
// Evaluate and the transfers live beside it: client_evaluate.cc,
// client_transfers.cc (what uploads and downloads share), client_uploads.cc
// and client_downloads.cc.
#include "client/client.h"

#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <algorithm>
#include <deque>
#include <optional>
#include <thread>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "client/client_internal.h"
#include "client/data_connection.h"
#include "common/files.h"
#include "common/server_features.h"
#include "common/status_macros.h"
#include "common/tensor_math.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "lossd/v1/lossd.grpc.pb.h"

namespace lossd {

using client_internal::CheckPostTrainingAnswered;
using client_internal::ConnectionCloser;
using client_internal::FinishAfterData;
using client_internal::FromProto;
using client_internal::kMessageOverheadBytes;
using client_internal::PrepareContext;
using client_internal::ToAbsl;

namespace client_internal {

absl::Status ToAbsl(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  const int code = static_cast<int>(status.error_code());
  if (code < 0 || code > static_cast<int>(absl::StatusCode::kUnauthenticated)) {
    return absl::UnknownError(
        absl::StrCat("gRPC status code ", code, ": ", status.error_message()));
  }
  return absl::Status(static_cast<absl::StatusCode>(code),
                      status.error_message());
}

void PrepareContext(const ClientOptions& options, grpc::Channel* channel,
                    grpc::ClientContext* context) {
  const absl::Time start = absl::Now();
  if (channel != nullptr && options.connect_wait > absl::ZeroDuration() &&
      channel->GetState(/*try_to_connect=*/true) != GRPC_CHANNEL_READY) {
    channel->WaitForConnected(absl::ToChronoTime(
        start + std::min(options.connect_wait, options.deadline)));
  }
  if (options.deadline != absl::InfiniteDuration()) {
    context->set_deadline(absl::ToChronoTime(start + options.deadline));
  }
  if (!options.bearer_token.empty()) {
    context->AddMetadata("authorization",
                         absl::StrCat("Bearer ", options.bearer_token));
  }
}

absl::Time FromTimestamp(const google::protobuf::Timestamp& ts) {
  return absl::FromUnixSeconds(ts.seconds()) + absl::Nanoseconds(ts.nanos());
}

TensorInfo FromProto(const v1::TensorInfo& proto) {
  TensorInfo info;
  info.handle = proto.handle();
  info.dtype = static_cast<DType>(proto.dtype());
  info.shape.assign(proto.shape().begin(), proto.shape().end());
  info.bytes = proto.bytes();
  info.device = proto.device();
  info.state = static_cast<TensorState>(proto.state());
  info.tenant = proto.tenant();
  info.label = proto.label();
  if (proto.has_created()) info.created = FromTimestamp(proto.created());
  if (proto.has_last_used()) info.last_used = FromTimestamp(proto.last_used());
  info.pending_scale = proto.pending_scale();
  info.pending_token_scale = proto.pending_token_scale();
  return info;
}

PolicyStats PolicyStatsFromProto(const v1::PolicyStats& proto) {
  PolicyStats stats;
  stats.clipped_tokens = proto.clipped_tokens();
  stats.ratio_sum = proto.ratio_sum();
  stats.approx_kl_sum = proto.approx_kl_sum();
  stats.kl_sum = proto.kl_sum();
  stats.entropy_sum = proto.entropy_sum();
  return stats;
}

EvaluateResult FromProto(const v1::EvaluateResponse& proto) {
  EvaluateResult result;
  result.loss = proto.loss();
  result.z_loss = proto.z_loss();
  result.rows = proto.rows();
  result.valid_tokens = proto.valid_tokens();
  result.correct_tokens = proto.correct_tokens();
  result.nonfinite_rows = proto.nonfinite_rows();
  result.denominator = proto.denominator();
  result.distillation_loss = proto.distillation_loss();
  result.policy_stats = PolicyStatsFromProto(proto.policy_stats());
  result.segment_loss.assign(proto.segment_loss().begin(),
                             proto.segment_loss().end());
  result.segment_tokens.assign(proto.segment_tokens().begin(),
                               proto.segment_tokens().end());
  return result;
}

ServerInfo FromProto(const v1::ServerInfo& proto) {
  ServerInfo info;
  info.instance_id = proto.instance_id();
  info.device = proto.device();
  info.budget_bytes = proto.budget_bytes();
  info.used_bytes = proto.used_bytes();
  info.free_bytes = proto.free_bytes();
  info.tensors = proto.tensors();
  info.version = proto.version();
  info.data_port = proto.data_port();
  info.features.assign(proto.features().begin(), proto.features().end());
  return info;
}

absl::Status CheckPostTrainingAnswered(const std::string& target, bool policy,
                                       int32_t segments, bool has_policy_stats,
                                       int segment_sums) {
  std::string missing;
  if (policy && !has_policy_stats) missing = "no policy_stats";
  if (segments > 0 && segment_sums != segments) {
    missing =
        absl::StrCat(segment_sums, " segment sums for ", segments, " segments");
  }
  if (missing.empty()) return absl::OkStatus();
  return absl::UnimplementedError(absl::StrCat(
      "the server at ", target, " answered with ", missing,
      ": it does not serve post-training losses and computed plain cross "
      "entropy (an in-place gradient it wrote is that loss's); upgrade lossd "
      "there"));
}

}  // namespace client_internal

namespace {

// Whether the options ask for TLS.
bool UsesTls(const ClientOptions& options) {
  return options.tls || !options.tls_ca_file.empty() ||
         !options.tls_cert_file.empty() || !options.tls_key_file.empty();
}

// Plaintext, or TLS from the PEM files the options name.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentials(
    const ClientOptions& options, grpc::ChannelArguments* args) {
  if (!UsesTls(options)) return grpc::InsecureChannelCredentials();
  if (options.tls_cert_file.empty() != options.tls_key_file.empty()) {
    return absl::InvalidArgumentError(
        "tls_cert_file and tls_key_file go together (mutual TLS needs both)");
  }
  grpc::SslCredentialsOptions ssl;
  if (!options.tls_ca_file.empty()) {
    ASSIGN_OR_RETURN(ssl.pem_root_certs,
                     ReadNonEmptyFile("tls_ca_file", options.tls_ca_file));
  }
  if (!options.tls_cert_file.empty()) {
    ASSIGN_OR_RETURN(ssl.pem_cert_chain,
                     ReadNonEmptyFile("tls_cert_file", options.tls_cert_file));
    ASSIGN_OR_RETURN(ssl.pem_private_key,
                     ReadNonEmptyFile("tls_key_file", options.tls_key_file));
  }
  if (!options.tls_server_name.empty()) {
    args->SetSslTargetNameOverride(options.tls_server_name);
  }
  return grpc::SslCredentials(ssl);
}

void ToProto(const CrossEntropyOptions& loss, const std::string& class_weights,
             v1::LossOptions* proto) {
  proto->set_ignore_index(loss.ignore_index);
  proto->set_label_smoothing(loss.label_smoothing);
  proto->set_reduction(static_cast<v1::Reduction>(loss.reduction));
  proto->set_z_loss_scale(loss.z_loss_scale);
  proto->set_softcap(loss.softcap);
  proto->set_class_weights(class_weights);
  proto->set_normalizer(loss.normalizer);
  proto->set_grad_scale(loss.grad_scale);
}

// An LossInput into a oneof of a handle and an InlineTensor; unset leaves
// both unset (the server says which inputs it needs).
absl::Status SetInput(absl::string_view name, const LossInput& input,
                      std::string* handle,
                      const std::function<v1::InlineTensor*()>& inline_tensor) {
  if (!input.handle.empty()) {
    *handle = input.handle;
    return absl::OkStatus();
  }
  if (input.inline_dtype == DType::kInvalid) return absl::OkStatus();
  if (input.inline_data == nullptr && input.inline_bytes > 0) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": null inline data"));
  }
  v1::InlineTensor* proto = inline_tensor();
  proto->set_dtype(static_cast<v1::DType>(input.inline_dtype));
  proto->set_data(static_cast<const char*>(input.inline_data),
                  input.inline_bytes);
  return absl::OkStatus();
}

// The fields of a Distillation other than its teacher.
void SetDistillationScalars(const DistillationOptions& options,
                            v1::Distillation* proto) {
  proto->set_temperature(options.temperature);
  proto->set_alpha(options.alpha);
  proto->set_divergence(static_cast<v1::Divergence>(options.divergence));
  proto->set_beta(options.beta);
}

absl::Status ToProto(const DistillationOptions& options,
                     v1::Distillation* proto) {
  SetDistillationScalars(options, proto);
  if (!options.teacher_logits.empty()) {
    proto->set_teacher_logits(options.teacher_logits);
    return absl::OkStatus();
  }
  if (!options.top_k_indices.set() && !options.top_k_logprobs.set()) {
    return absl::InvalidArgumentError(
        "distillation: no teacher (teacher_logits, or top_k_indices and "
        "top_k_logprobs)");
  }
  v1::TopKTeacher* top_k = proto->mutable_teacher_top_k();
  top_k->set_k(options.top_k);
  top_k->set_tail(static_cast<v1::TopKTail>(options.tail));
  std::string handle;
  RETURN_IF_ERROR(
      SetInput("top_k_indices", options.top_k_indices, &handle,
               [top_k] { return top_k->mutable_indices_inline(); }));
  if (!handle.empty()) top_k->set_indices_handle(handle);
  handle.clear();
  RETURN_IF_ERROR(
      SetInput("top_k_logprobs", options.top_k_logprobs, &handle,
               [top_k] { return top_k->mutable_logprobs_inline(); }));
  if (!handle.empty()) top_k->set_logprobs_handle(handle);
  return absl::OkStatus();
}

// The fields of a PolicyGradient other than its per-token inputs.
void SetPolicyScalars(const PolicyGradientOptions& options,
                      v1::PolicyGradient* proto) {
  proto->set_loss(static_cast<v1::PolicyLoss>(options.loss));
  proto->set_epsilon_low(options.epsilon_low);
  if (options.epsilon_high.has_value()) {
    proto->set_epsilon_high(*options.epsilon_high);
  }
  proto->set_kl_coef(options.kl_coef);
  proto->set_kl_estimator(static_cast<v1::KlEstimator>(options.kl_estimator));
}

absl::Status ToProto(const PolicyGradientOptions& options,
                     v1::PolicyGradient* proto) {
  SetPolicyScalars(options, proto);
  std::string handle;
  RETURN_IF_ERROR(SetInput("advantages", options.advantages, &handle, [proto] {
    return proto->mutable_advantages_inline();
  }));
  if (!handle.empty()) proto->set_advantages_handle(handle);
  handle.clear();
  RETURN_IF_ERROR(
      SetInput("sampling_logprobs", options.sampling_logprobs, &handle,
               [proto] { return proto->mutable_sampling_logprobs_inline(); }));
  if (!handle.empty()) proto->set_sampling_logprobs_handle(handle);
  handle.clear();
  RETURN_IF_ERROR(
      SetInput("reference_logprobs", options.reference_logprobs, &handle,
               [proto] { return proto->mutable_reference_logprobs_inline(); }));
  if (!handle.empty()) proto->set_reference_logprobs_handle(handle);
  return absl::OkStatus();
}

absl::Status ToProto(const SegmentOptions& options, v1::Segments* proto) {
  proto->set_count(options.count);
  proto->set_reduction(static_cast<v1::SegmentReduction>(options.reduction));
  std::string handle;
  RETURN_IF_ERROR(SetInput("segment ids", options.ids, &handle,
                           [proto] { return proto->mutable_ids_inline(); }));
  if (!handle.empty()) proto->set_ids_handle(handle);
  return absl::OkStatus();
}

// The targets of a Forward or LinearForward request: a handle, or inline
// int32/int64 data.
template <typename Request>
absl::Status SetTargets(const Targets& targets, Request* request) {
  if (!targets.handle.empty()) {
    request->set_targets_handle(targets.handle);
    return absl::OkStatus();
  }
  if (targets.inline_dtype == DType::kInvalid &&
      targets.inline_data == nullptr && targets.inline_bytes == 0) {
    return absl::OkStatus();  // none: the server says whether that is allowed
  }
  if (!IsTargetsDType(targets.inline_dtype)) {
    return absl::InvalidArgumentError(
        "targets: neither a handle nor inline int32/int64 data");
  }
  if (targets.inline_data == nullptr && targets.inline_bytes > 0) {
    return absl::InvalidArgumentError("inline targets: null data");
  }
  v1::InlineTensor* inline_targets = request->mutable_targets_inline();
  inline_targets->set_dtype(static_cast<v1::DType>(targets.inline_dtype));
  inline_targets->set_data(static_cast<const char*>(targets.inline_data),
                           targets.inline_bytes);
  return absl::OkStatus();
}

ForwardResult ForwardFromProto(const v1::ForwardResponse& response) {
  ForwardResult result;
  result.loss = response.loss();
  result.z_loss = response.z_loss();
  result.valid_tokens = response.valid_tokens();
  result.correct_tokens = response.correct_tokens();
  result.nonfinite_rows = response.nonfinite_rows();
  result.gradient = response.gradient();
  result.token_loss.assign(response.token_loss().begin(),
                           response.token_loss().end());
  result.token_lse.assign(response.token_lse().begin(),
                          response.token_lse().end());
  result.token_argmax.assign(response.token_argmax().begin(),
                             response.token_argmax().end());
  result.kernel_seconds = response.kernel_seconds();
  result.denominator = response.denominator();
  result.distillation_loss = response.distillation_loss();
  result.policy_stats =
      client_internal::PolicyStatsFromProto(response.policy_stats());
  result.segment_loss.assign(response.segment_loss().begin(),
                             response.segment_loss().end());
  result.segment_tokens.assign(response.segment_tokens().begin(),
                               response.segment_tokens().end());
  result.token_logprob.assign(response.token_logprob().begin(),
                              response.token_logprob().end());
  result.token_entropy.assign(response.token_entropy().begin(),
                              response.token_entropy().end());
  result.token_ratio.assign(response.token_ratio().begin(),
                            response.token_ratio().end());
  result.token_clipped.assign(response.token_clipped().begin(),
                              response.token_clipped().end());
  return result;
}

absl::StatusOr<BackwardResult> FinishBackward(const ClientOptions& options,
                                              grpc::Channel* channel,
                                              v1::Lossd::Stub* stub,
                                              const v1::BackwardRequest& req) {
  grpc::ClientContext context;
  PrepareContext(options, channel, &context);
  v1::BackwardResponse response;
  RETURN_IF_ERROR(ToAbsl(stub->Backward(&context, req, &response)));
  BackwardResult result;
  result.tensor = FromProto(response.tensor());
  result.kernel_launched = response.kernel_launched();
  return result;
}

}  // namespace

namespace client_internal {

v1::EvaluateHeader EvaluateHeaderFor(int64_t vocab, DType logits_dtype,
                                     DType targets_dtype,
                                     const EvaluateOptions& options) {
  v1::EvaluateHeader header;
  // Rows of hidden states: V is the weight's, `vocab` the rows' width H.
  header.set_vocab(options.weight.empty() ? vocab : 0);
  header.set_logits_dtype(static_cast<v1::DType>(logits_dtype));
  header.set_targets_dtype(static_cast<v1::DType>(targets_dtype));
  ToProto(options.loss, options.class_weights, header.mutable_options());
  header.set_weight(options.weight);
  header.set_bias(options.bias);
  if (options.distillation.has_value()) {
    const DistillationOptions& distillation = *options.distillation;
    SetDistillationScalars(distillation, header.mutable_distillation());
    if (distillation.evaluate_teacher_dtype != DType::kInvalid) {
      header.set_teacher_logits_dtype(
          static_cast<v1::DType>(distillation.evaluate_teacher_dtype));
    } else {
      header.set_teacher_top_k(distillation.top_k);
      header.set_teacher_indices_dtype(
          static_cast<v1::DType>(distillation.top_k_indices_dtype));
      header.set_teacher_top_k_tail(
          static_cast<v1::TopKTail>(distillation.tail));
    }
  }
  if (options.policy.has_value()) {
    SetPolicyScalars(*options.policy, header.mutable_policy());
    header.set_policy_reference_logprobs(
        options.policy->evaluate_reference_logprobs);
  }
  if (options.segments.has_value()) {
    header.mutable_segments()->set_count(options.segments->count);
    header.mutable_segments()->set_reduction(
        static_cast<v1::SegmentReduction>(options.segments->reduction));
  }
  return header;
}

}  // namespace client_internal

Client::Client(std::string target, ClientOptions options,
               std::unique_ptr<Channel> channel)
    : target_(std::move(target)),
      options_(std::move(options)),
      channel_(std::move(channel)) {}

Client::~Client() = default;

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(std::string target,
                                                        ClientOptions options) {
  if (target.empty()) return absl::InvalidArgumentError("empty server target");
  if (options.max_message_bytes <= static_cast<int>(kMessageOverheadBytes)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_message_bytes ", options.max_message_bytes, " is too small"));
  }
  if (options.chunk_bytes == 0 ||
      options.chunk_bytes >
          static_cast<std::size_t>(options.max_message_bytes) -
              kMessageOverheadBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk_bytes ", options.chunk_bytes, " must be in [1, ",
                     options.max_message_bytes - kMessageOverheadBytes, "]"));
  }
  if (options.deadline <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("deadline must be positive");
  }
  if (options.connect_wait < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("connect_wait must not be negative");
  }
  if (options.piece_bytes < (std::size_t{64} << 10) ||
      options.piece_bytes > (std::size_t{1} << 30)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "piece_bytes ", options.piece_bytes, " must be in [64 KiB, 1 GiB]"));
  }
  if (options.upload_streams < 1 || options.upload_streams > 64) {
    return absl::InvalidArgumentError(absl::StrCat(
        "upload_streams ", options.upload_streams, " must be in [1, 64]"));
  }
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(options.max_message_bytes);
  args.SetMaxSendMessageSize(options.max_message_bytes);
  // The connection belongs to this Client (not gRPC's process-wide pool), so
  // destroying the Client closes it instead of leaving it open for reuse.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  // Reconnect 100 ms after a failed attempt (gRPC's default is 1 s), so that
  // connect_wait rides over a failed attempt; at most 5 s apart while the
  // server stays away (default 120 s), so a restarted server is found soon.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 5000);
  ASSIGN_OR_RETURN(std::shared_ptr<grpc::ChannelCredentials> credentials,
                   ChannelCredentials(options, &args));
  auto channel = std::make_unique<Channel>();
  channel->channel = grpc::CreateCustomChannel(target, credentials, args);
  channel->credentials = credentials;
  channel->tls = UsesTls(options);
  channel->args = args;
  channel->lossd = v1::Lossd::NewStub(channel->channel);
  channel->health = health::Health::NewStub(channel->channel);
  return std::unique_ptr<Client>(
      new Client(std::move(target), std::move(options), std::move(channel)));
}

absl::StatusOr<TensorInfo> Client::Describe(const std::string& handle) {
  grpc::ClientContext context;
  PrepareContext(options_, channel_->channel.get(), &context);
  v1::DescribeRequest request;
  request.set_handle(handle);
  v1::TensorInfo response;
  RETURN_IF_ERROR(
      ToAbsl(channel_->lossd->Describe(&context, request, &response)));
  TensorInfo info = FromProto(response);
  channel_->Remember(info);
  return info;
}

absl::StatusOr<ListResult> Client::List(int page_size) {
  if (page_size <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("List: page_size = ", page_size, " must be > 0"));
  }
  ListResult result;
  v1::ListRequest request;
  request.set_page_size(page_size);
  // Page after page until the server says there is no more; the last page's
  // figures are the freshest.
  do {
    grpc::ClientContext context;
    PrepareContext(options_, channel_->channel.get(), &context);
    v1::ListResponse response;
    RETURN_IF_ERROR(
        ToAbsl(channel_->lossd->List(&context, request, &response)));
    for (const v1::TensorInfo& tensor : response.tensors()) {
      result.tensors.push_back(FromProto(tensor));
    }
    result.server = FromProto(response.server());
    request.set_page_token(response.next_page_token());
  } while (!request.page_token().empty());
  return result;
}

absl::StatusOr<int64_t> Client::Release(const std::string& handle) {
  grpc::ClientContext context;
  PrepareContext(options_, channel_->channel.get(), &context);
  v1::ReleaseRequest request;
  request.set_handle(handle);
  v1::ReleaseResponse response;
  channel_->Forget(handle);
  RETURN_IF_ERROR(
      ToAbsl(channel_->lossd->Release(&context, request, &response)));
  return response.released_bytes();
}

namespace {

// The post-training loss and its per-token outputs, which Forward and
// LinearForward requests (and options) share.
template <typename Options, typename Request>
absl::Status SetPostTrainingFields(const Options& options, Request* request) {
  v1::Outputs* outputs = request->mutable_outputs();
  outputs->set_token_logprob(options.token_logprob);
  outputs->set_token_entropy(options.token_entropy);
  outputs->set_token_ratio(options.token_ratio);
  outputs->set_token_clipped(options.token_clipped);
  if (options.distillation.has_value()) {
    RETURN_IF_ERROR(
        ToProto(*options.distillation, request->mutable_distillation()));
  }
  if (options.policy.has_value()) {
    RETURN_IF_ERROR(ToProto(*options.policy, request->mutable_policy()));
  }
  if (options.segments.has_value()) {
    RETURN_IF_ERROR(ToProto(*options.segments, request->mutable_segments()));
  }
  return absl::OkStatus();
}

// Whether Forward or LinearForward `options` ask for anything of the
// post-training losses, which older servers skip.
template <typename Options>
bool UsesPostTraining(const Options& options) {
  return options.distillation.has_value() || options.policy.has_value() ||
         options.segments.has_value() || options.token_logprob ||
         options.token_entropy || options.token_ratio || options.token_clipped;
}

}  // namespace

absl::StatusOr<ForwardResult> Client::Forward(const std::string& logits,
                                              const Targets& targets,
                                              const ForwardOptions& options) {
  v1::ForwardRequest request;
  request.set_logits(logits);
  RETURN_IF_ERROR(SetTargets(targets, &request));
  ToProto(options.loss, options.class_weights, request.mutable_options());
  request.set_mode(static_cast<v1::GradientMode>(options.mode));
  request.mutable_outputs()->set_token_loss(options.token_loss);
  request.mutable_outputs()->set_token_lse(options.token_lse);
  request.mutable_outputs()->set_token_argmax(options.token_argmax);
  request.set_gradient_label(options.gradient_label);
  RETURN_IF_ERROR(SetPostTrainingFields(options, &request));
  if (UsesPostTraining(options)) {
    RETURN_IF_ERROR(RequirePostTraining("Forward"));
  }

  grpc::ClientContext context;
  PrepareContext(options_, channel_->channel.get(), &context);
  v1::ForwardResponse response;
  RETURN_IF_ERROR(
      ToAbsl(channel_->lossd->Forward(&context, request, &response)));
  RETURN_IF_ERROR(CheckPostTrainingAnswered(target_, options, response));
  return ForwardFromProto(response);
}

absl::StatusOr<LinearForwardResult> Client::LinearForward(
    const std::string& hidden, const std::string& weight,
    const Targets& targets, const LinearForwardOptions& options) {
  v1::LinearForwardRequest request;
  request.set_hidden(hidden);
  request.set_weight(weight);
  request.set_bias(options.bias);
  RETURN_IF_ERROR(SetTargets(targets, &request));
  ToProto(options.loss, options.class_weights, request.mutable_options());
  request.set_mode(static_cast<v1::GradientMode>(options.mode));
  request.mutable_outputs()->set_token_loss(options.token_loss);
  request.mutable_outputs()->set_token_lse(options.token_lse);
  request.mutable_outputs()->set_token_argmax(options.token_argmax);
  request.set_gradient_label(options.gradient_label);
  request.set_accumulate(static_cast<v1::AccumulateMode>(options.accumulate));
  request.set_weight_grad(options.weight_grad);
  request.set_bias_grad(options.bias_grad);
  request.set_weight_grad_label(options.weight_grad_label);
  request.set_bias_grad_label(options.bias_grad_label);
  request.mutable_token_grad_output()->Add(options.token_grad_output.begin(),
                                           options.token_grad_output.end());
  request.set_precision(static_cast<v1::LinearPrecision>(options.precision));
  RETURN_IF_ERROR(SetPostTrainingFields(options, &request));
  if (UsesPostTraining(options)) {
    RETURN_IF_ERROR(RequirePostTraining("LinearForward"));
  }

  grpc::ClientContext context;
  PrepareContext(options_, channel_->channel.get(), &context);
  v1::LinearForwardResponse response;
  RETURN_IF_ERROR(
      ToAbsl(channel_->lossd->LinearForward(&context, request, &response)));
  RETURN_IF_ERROR(
      CheckPostTrainingAnswered(target_, options, response.result()));
  LinearForwardResult result;
  result.forward = ForwardFromProto(response.result());
  result.weight_grad = response.weight_grad();
  result.bias_grad = response.bias_grad();
  return result;
}

absl::StatusOr<BackwardResult> Client::Backward(const std::string& gradient,
                                                double grad_output,
                                                bool materialize) {
  v1::BackwardRequest request;
  request.set_gradient(gradient);
  request.set_scalar(grad_output);
  request.set_materialize(materialize);
  return FinishBackward(options_, channel_->channel.get(),
                        channel_->lossd.get(), request);
}

absl::StatusOr<BackwardResult> Client::Backward(
    const std::string& gradient, absl::Span<const float> token_grad_output,
    bool materialize) {
  v1::BackwardRequest request;
  request.set_gradient(gradient);
  request.mutable_per_token()->mutable_values()->Add(token_grad_output.begin(),
                                                     token_grad_output.end());
  request.set_materialize(materialize);
  return FinishBackward(options_, channel_->channel.get(),
                        channel_->lossd.get(), request);
}

absl::StatusOr<bool> Client::Health(const std::string& service) {
  grpc::ClientContext context;
  PrepareContext(options_, channel_->channel.get(), &context);
  health::HealthCheckRequest request;
  request.set_service(service);
  health::HealthCheckResponse response;
  RETURN_IF_ERROR(
      ToAbsl(channel_->health->Check(&context, request, &response)));
  return response.status() == health::HealthCheckResponse::SERVING;
}

absl::StatusOr<ServerInfo> Client::GetServerInfo() {
  grpc::ClientContext context;
  PrepareContext(options_, channel_->channel.get(), &context);
  v1::ServerInfo response;
  RETURN_IF_ERROR(ToAbsl(channel_->lossd->GetServerInfo(
      &context, v1::GetServerInfoRequest(), &response)));
  ServerInfo info = FromProto(response);
  absl::MutexLock lock(&channel_->mu);
  channel_->features = info.features;
  return info;
}

absl::Status Client::RequirePostTraining(const std::string& call) {
  if (!options_.check_server_features) return absl::OkStatus();
  std::optional<std::vector<std::string>> features;
  {
    absl::MutexLock lock(&channel_->mu);
    features = channel_->features;
  }
  if (!features.has_value()) {
    ASSIGN_OR_RETURN(ServerInfo info, GetServerInfo());
    features = std::move(info.features);
  }
  if (std::find(features->begin(), features->end(), kFeaturePostTraining) !=
      features->end()) {
    return absl::OkStatus();
  }
  // An empty list is a server from before the list, which serves none of
  // the post-training losses (ClientOptions::check_server_features says
  // what to do about a server between the two).
  return absl::FailedPreconditionError(absl::StrCat(
      "the server at ", target_, " does not serve post-training losses (", call,
      " with distillation, policy, segments or their outputs): its "
      "ServerInfo.features ",
      features->empty() ? "is empty, a server from before the list"
                        : absl::StrCat("are ", absl::StrJoin(*features, ",")),
      "; nothing was sent. Upgrade lossd there"));
}

const char* DTypeString(DType dtype) {
  // The CLI's short spelling of bf16; every other name is the canonical one.
  return dtype == DType::kBFloat16 ? "bf16" : DTypeName(dtype);
}

absl::StatusOr<DType> DTypeFromString(const std::string& name) {
  const std::string lower = absl::AsciiStrToLower(name);
  if (lower == "float32" || lower == "fp32" || lower == "f32") {
    return DType::kFloat32;
  }
  if (lower == "bfloat16" || lower == "bf16") return DType::kBFloat16;
  if (lower == "float16" || lower == "fp16" || lower == "f16" ||
      lower == "half") {
    return DType::kFloat16;
  }
  if (lower == "int32" || lower == "i32") return DType::kInt32;
  if (lower == "int64" || lower == "i64") return DType::kInt64;
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown dtype '", name, "' (float32, bf16, float16, int32, int64)"));
}

}  // namespace lossd
