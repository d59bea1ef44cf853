// lossd.Client's methods (see py_client.h).
#include "client/python/py_client.h"

#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <optional>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "client/python/buffers.h"
#include "client/python/errors.h"

namespace py = pybind11;

namespace lossd {
namespace python {

namespace {

Reduction ParseReduction(const std::string& name) {
  if (name == "mean") return Reduction::kMean;
  if (name == "sum") return Reduction::kSum;
  if (name == "none") return Reduction::kNone;
  ThrowInvalid("reduction must be \"mean\", \"sum\" or \"none\", not \"" +
               name + "\"");
}

GradientMode ParseMode(const std::string& name) {
  if (name == "in_place") return GradientMode::kInPlace;
  if (name == "out_of_place") return GradientMode::kOutOfPlace;
  if (name == "none") return GradientMode::kNone;
  ThrowInvalid(
      "mode must be \"in_place\", \"out_of_place\" or \"none\", not \"" + name +
      "\"");
}

// An fp32 [V] weight: a stored tensor's handle, or a buffer uploaded for one
// call and released after it.
class Weight {
 public:
  Weight(const std::shared_ptr<Client>& client, py::handle weight)
      : client_(client) {
    if (weight.is_none()) return;
    if (py::isinstance<py::str>(weight)) {
      handle_ = weight.cast<std::string>();
      return;
    }
    Tensor tensor = TensorFromObject(weight, py::none(), py::none(), "weight");
    if (tensor.dtype != DType::kFloat32 || tensor.shape.size() != 1) {
      ThrowInvalid("weight must be a float32 [V] array or a handle");
    }
    absl::StatusOr<TensorInfo> info;
    {
      py::gil_scoped_release release;
      info = client->Upload(tensor.dtype, tensor.shape, tensor.buffer->data(),
                            tensor.buffer->bytes(), "weight");
    }
    handle_ = ValueOrThrow(std::move(info)).handle;
    uploaded_ = true;
  }
  ~Weight() {
    if (!uploaded_) return;
    py::gil_scoped_release release;
    client_->Release(handle_).IgnoreError();
  }
  Weight(const Weight&) = delete;
  Weight& operator=(const Weight&) = delete;

  const std::string& handle() const { return handle_; }

 private:
  std::shared_ptr<Client> client_;
  std::string handle_;
  bool uploaded_ = false;
};

CrossEntropyOptions LossOptions(int64_t ignore_index, double label_smoothing,
                                const std::string& reduction,
                                double z_loss_scale, double softcap,
                                double normalizer, double grad_scale) {
  CrossEntropyOptions loss;
  loss.ignore_index = ignore_index;
  loss.label_smoothing = static_cast<float>(label_smoothing);
  loss.reduction = ParseReduction(reduction);
  loss.z_loss_scale = static_cast<float>(z_loss_scale);
  loss.softcap = static_cast<float>(softcap);
  loss.normalizer = normalizer;
  loss.grad_scale = static_cast<float>(grad_scale);
  return loss;
}

}  // namespace

void ThrowForkedClient(const std::string& message) {
  py::object error = py::module_::import("lossd._errors").attr("ForkedClient");
  PyErr_SetString(error.ptr(), message.c_str());
  throw py::error_already_set();
}

void PyClient::ThrowForked() const {
  ThrowForkedClient(absl::StrCat(
      "this lossd.Client (", target_, ") was made in process ", owner_pid_,
      " and cannot be used in process ", getpid(),
      ", a child of fork(): gRPC channels and connections do not survive "
      "fork(); make a new lossd.Client in the child"));
}

namespace {

// The process where the first client connected, whose gRPC state is usable;
// 0 until a client connects.
pid_t grpc_pid = 0;

}  // namespace

void CheckGrpcUsableHere() {
  if (grpc_pid == 0 || grpc_pid == getpid()) return;
  ThrowForkedClient(absl::StrCat(
      "gRPC was started in process ", grpc_pid, " and this is process ",
      getpid(),
      ", a child of fork(): a new channel here can wait forever, since "
      "gRPC's threads stayed in the parent. Make the child's clients in "
      "children started with multiprocessing's \"spawn\" or \"forkserver\", "
      "or fork before the parent's first lossd.Client"));
}

void NoteGrpcUsed() {
  if (grpc_pid == 0) grpc_pid = getpid();
}

TensorInfo Upload(PyClient& self, py::handle data, py::handle dtype,
                  py::handle shape, const std::string& label,
                  const std::optional<std::string>& idempotency_key,
                  const std::optional<std::string>& overwrite) {
  std::shared_ptr<Client> client = self.Get();
  Tensor tensor = TensorFromObject(data, dtype, shape, "upload");
  if (overwrite.has_value() && idempotency_key.has_value()) {
    ThrowInvalid(
        "upload takes idempotency_key or overwrite, not both: an overwrite "
        "names its tensor already and may simply be sent again");
  }
  absl::StatusOr<TensorInfo> info;
  {
    py::gil_scoped_release release;
    info =
        overwrite.has_value()
            ? client->Overwrite(*overwrite, tensor.dtype, tensor.shape,
                                tensor.buffer->data(), tensor.buffer->bytes())
            : client->Upload(tensor.dtype, tensor.shape, tensor.buffer->data(),
                             tensor.buffer->bytes(), label, nullptr,
                             idempotency_key.value_or(""));
  }
  return ValueOrThrow(std::move(info));
}

TensorInfo UploadFrom(PyClient& self, const py::function& source,
                      py::handle dtype, const std::vector<int64_t>& shape,
                      const std::string& label,
                      const std::optional<std::string>& idempotency_key) {
  std::shared_ptr<Client> client = self.Get();
  const DType parsed = ParseDType(dtype);
  if (parsed == DType::kInvalid) ThrowInvalid("upload_from needs a dtype");
  CallbackFailure failure;
  // Buffers a source returned instead of filling the scratch: held until the
  // upload has sent them. Touched with the GIL held only.
  std::vector<std::unique_ptr<Buffer>> returned;
  UploadSource adapter = [&](int64_t offset, std::size_t bytes,
                             void* scratch) -> absl::StatusOr<const void*> {
    py::gil_scoped_acquire acquire;
    if (failure.failed())
      return absl::CancelledError("an earlier source call raised");
    try {
      ScopedMemoryView view(scratch, bytes, /*writable=*/true);
      py::object result = source(offset, bytes, view.get());
      if (result.is_none() || result.is(view.get())) return scratch;
      auto buffer = std::make_unique<Buffer>(result, /*writable=*/false);
      if (buffer->bytes() != bytes) {
        throw py::value_error("upload_from: the source returned " +
                              std::to_string(buffer->bytes()) +
                              " bytes for a piece of " + std::to_string(bytes));
      }
      const void* data = buffer->data();
      returned.push_back(std::move(buffer));
      return data;
    } catch (...) {
      return failure.RecordCurrent("the upload source");
    }
  };
  absl::StatusOr<TensorInfo> info;
  {
    py::gil_scoped_release release;
    info = client->UploadFrom(parsed, shape, adapter, label, nullptr,
                              idempotency_key.value_or(""));
  }
  failure.RaiseIfAny();
  return ValueOrThrow(std::move(info));
}

py::object Download(PyClient& self, const std::string& handle, py::handle dtype,
                    py::handle out) {
  std::shared_ptr<Client> client = self.Get();
  const DType as_dtype = ParseDType(dtype);
  py::object target = py::reinterpret_borrow<py::object>(out);
  if (target.is_none()) {
    absl::StatusOr<TensorInfo> described;
    {
      py::gil_scoped_release release;
      described = client->Describe(handle);
    }
    TensorInfo info = ValueOrThrow(std::move(described));
    const DType sent = as_dtype != DType::kInvalid ? as_dtype : info.dtype;
    target = py::module_::import("numpy").attr("empty")(
        py::tuple(py::cast(info.shape)), NumpyDType(sent));
  } else {
    DType implied = DType::kInvalid;
    target = AsBufferObject(target, &implied);
  }
  Buffer buffer(target, /*writable=*/true);
  absl::StatusOr<TensorInfo> info;
  {
    py::gil_scoped_release release;
    info =
        client->DownloadInto(handle, as_dtype, buffer.data(), buffer.bytes());
  }
  TensorInfo received = ValueOrThrow(std::move(info));
  if (static_cast<std::size_t>(received.bytes) != buffer.bytes()) {
    ThrowInvalid("download: out has " + std::to_string(buffer.bytes()) +
                 " bytes but " + handle + " sent " +
                 std::to_string(received.bytes));
  }
  return out.is_none() ? target : py::reinterpret_borrow<py::object>(out);
}

TensorInfo DownloadTo(PyClient& self, const std::string& handle,
                      const py::function& sink, py::handle dtype,
                      py::handle on_header) {
  std::shared_ptr<Client> client = self.Get();
  const DType as_dtype = ParseDType(dtype);
  CallbackFailure failure;
  std::function<absl::Status(const TensorInfo&)> header_adapter;
  if (!on_header.is_none()) {
    header_adapter = [&](const TensorInfo& info) -> absl::Status {
      py::gil_scoped_acquire acquire;
      try {
        on_header(info);
        return absl::OkStatus();
      } catch (...) {
        return failure.RecordCurrent("on_header");
      }
    };
  }
  DownloadSink adapter = [&](int64_t offset, const void* data,
                             std::size_t bytes) -> absl::Status {
    py::gil_scoped_acquire acquire;
    if (failure.failed())
      return absl::CancelledError("an earlier sink call raised");
    try {
      ScopedMemoryView view(data, bytes, /*writable=*/false);
      sink(offset, view.get());
      return absl::OkStatus();
    } catch (...) {
      return failure.RecordCurrent("the download sink");
    }
  };
  absl::StatusOr<TensorInfo> info;
  {
    py::gil_scoped_release release;
    info = client->DownloadTo(handle, as_dtype, header_adapter, adapter);
  }
  failure.RaiseIfAny();
  return ValueOrThrow(std::move(info));
}

namespace {

// A tensor argument given as a handle, or as a buffer that is uploaded for
// the call under `label` (the caller releases it if the call fails).
std::string HandleOrUpload(PyClient& self, py::handle value,
                           const std::string& label) {
  if (py::isinstance<py::str>(value)) return value.cast<std::string>();
  return Upload(self, value, py::none(), py::none(), label, std::nullopt,
                std::nullopt)
      .handle;
}

// Targets given as a handle, or as an int32/int64 buffer held in `*keep` for
// the call; None sends none (a distillation with alpha 0 needs none).
Targets ParseTargets(py::handle target, Tensor* keep) {
  if (target.is_none()) return Targets();
  if (py::isinstance<py::str>(target)) {
    return Targets::Handle(target.cast<std::string>());
  }
  *keep = TensorFromObject(target, py::none(), py::none(), "target");
  if (!IsTargetsDType(keep->dtype)) {
    ThrowInvalid("target must hold int32 or int64 class indices, not " +
                 std::string(DTypeString(keep->dtype)));
  }
  return Targets::Inline(keep->dtype, keep->buffer->data(),
                         keep->buffer->bytes());
}

Divergence ParseDivergence(const std::string& name) {
  if (name == "forward_kl") return Divergence::kForwardKl;
  if (name == "reverse_kl") return Divergence::kReverseKl;
  if (name == "jsd") return Divergence::kJsd;
  ThrowInvalid(
      "divergence must be \"forward_kl\", \"reverse_kl\" or \"jsd\", not "
      "\"" +
      name + "\"");
}

TopKTail ParseTopKTail(const std::string& name) {
  if (name == "renormalize") return TopKTail::kRenormalize;
  if (name == "bucket") return TopKTail::kBucket;
  ThrowInvalid("top_k_tail must be \"renormalize\" or \"bucket\", not \"" +
               name + "\"");
}

PolicyLossKind ParsePolicyLoss(const std::string& name) {
  if (name == "importance_sampling") return PolicyLossKind::kImportanceSampling;
  if (name == "ppo") return PolicyLossKind::kPpoClip;
  if (name == "cispo") return PolicyLossKind::kCispo;
  ThrowInvalid(
      "policy_loss must be \"importance_sampling\", \"ppo\" or \"cispo\", "
      "not \"" +
      name + "\"");
}

KlEstimator ParseKlEstimator(const std::string& name) {
  if (name == "k1") return KlEstimator::kK1;
  if (name == "k2") return KlEstimator::kK2;
  if (name == "k3") return KlEstimator::kK3;
  ThrowInvalid("kl_estimator must be \"k1\", \"k2\" or \"k3\", not \"" + name +
               "\"");
}

SegmentReduction ParseSegmentReduction(py::handle reduction) {
  if (reduction.is_none()) return SegmentReduction::kNone;
  const std::string name = reduction.cast<std::string>();
  if (name == "seq_mean_token_mean") return SegmentReduction::kSeqMeanTokenMean;
  if (name == "seq_mean_token_sum") return SegmentReduction::kSeqMeanTokenSum;
  ThrowInvalid(
      "segment_reduction must be \"seq_mean_token_mean\", "
      "\"seq_mean_token_sum\" or None, not \"" +
      name + "\"");
}

// Host buffers the post-training inputs of one call point into: kept alive
// until the call returns.
struct KeptInputs {
  std::vector<Tensor> tensors;
  std::vector<std::vector<int32_t>> narrowed;  // int64 segment ids as int32
};

// A post-training input: a handle, or a buffer sent inline (held in `kept`).
LossInput ParseLossInput(py::handle value, const char* name, KeptInputs* kept) {
  if (py::isinstance<py::str>(value)) {
    return LossInput::Handle(value.cast<std::string>());
  }
  kept->tensors.push_back(
      TensorFromObject(value, py::none(), py::none(), name));
  const Tensor& tensor = kept->tensors.back();
  return LossInput::Inline(tensor.dtype, tensor.buffer->data(),
                           tensor.buffer->bytes());
}

// Segment ids: a handle, or an int32/int64 [N] buffer (int64 sent as int32).
// *count is set to max + 1 when 0 and the ids are a buffer.
LossInput ParseSegmentIds(py::handle value, int64_t* count, KeptInputs* kept) {
  if (py::isinstance<py::str>(value)) {
    return LossInput::Handle(value.cast<std::string>());
  }
  Tensor tensor = TensorFromObject(value, py::none(), py::none(), "segments");
  if (!IsTargetsDType(tensor.dtype) || tensor.shape.size() != 1) {
    ThrowInvalid(
        "segments must be int32 or int64 [N] segment ids, or a handle");
  }
  std::vector<int32_t> ids(static_cast<std::size_t>(tensor.shape[0]));
  for (std::size_t i = 0; i < ids.size(); ++i) {
    const int64_t id =
        tensor.dtype == DType::kInt32
            ? static_cast<const int32_t*>(tensor.buffer->data())[i]
            : static_cast<const int64_t*>(tensor.buffer->data())[i];
    if (id < 0 || id > INT32_MAX) {
      ThrowInvalid(absl::StrCat("segments[", i, "] = ", id,
                                " is not a segment id (0 <= id < 2^31)"));
    }
    ids[i] = static_cast<int32_t>(id);
  }
  if (*count == 0) {
    for (int32_t id : ids) *count = std::max<int64_t>(*count, int64_t{id} + 1);
  }
  kept->narrowed.push_back(std::move(ids));
  return LossInput::Inline(absl::Span<const int32_t>(kept->narrowed.back()));
}

// The distillation, policy and segment options of a forward's keyword
// arguments. `in_blocks` (evaluate): the teacher, the policy's per-token
// inputs and the ids stay out of the options; the caller sends them in the
// row blocks.
void SetPostTraining(const PostTrainingKwargs& kwargs, KeptInputs* kept,
                     std::optional<DistillationOptions>* distillation,
                     std::optional<PolicyGradientOptions>* policy,
                     std::optional<SegmentOptions>* segments, bool in_blocks) {
  if (!kwargs.teacher.is_none()) {
    DistillationOptions options;
    options.temperature = static_cast<float>(kwargs.temperature);
    options.alpha = static_cast<float>(kwargs.alpha);
    options.divergence = ParseDivergence(kwargs.divergence);
    options.beta = static_cast<float>(kwargs.beta);
    options.tail = ParseTopKTail(kwargs.top_k_tail);
    if (py::isinstance<py::tuple>(kwargs.teacher) ||
        py::isinstance<py::list>(kwargs.teacher)) {
      py::sequence pair = kwargs.teacher.cast<py::sequence>();
      if (py::len(pair) != 2) {
        ThrowInvalid(
            "teacher must be teacher logits, or a pair (top-k indices, "
            "top-k logprobs)");
      }
      if (!in_blocks) {
        options.top_k_indices =
            ParseLossInput(pair[0], "teacher indices", kept);
        options.top_k_logprobs =
            ParseLossInput(pair[1], "teacher logprobs", kept);
      }
      // k from whichever of the two is a buffer ([N, k]); 0 = the server
      // takes it from a handle's shape.
      for (py::handle part : {pair[0], pair[1]}) {
        if (py::isinstance<py::str>(part)) continue;
        Tensor tensor =
            TensorFromObject(part, py::none(), py::none(), "teacher");
        if (tensor.shape.size() != 2) {
          ThrowInvalid("top-k teacher indices and logprobs must be [N, k]");
        }
        options.top_k = static_cast<int32_t>(tensor.shape[1]);
        options.top_k_indices_dtype = tensor.dtype;
        break;
      }
      if (in_blocks) {
        Tensor indices =
            TensorFromObject(pair[0], py::none(), py::none(), "teacher");
        options.top_k_indices_dtype = indices.dtype;
      }
    } else if (py::isinstance<py::str>(kwargs.teacher)) {
      if (in_blocks) {
        ThrowInvalid(
            "evaluate: the teacher must be logits or top-k arrays in host "
            "memory, not a handle");
      }
      options.teacher_logits = kwargs.teacher.cast<std::string>();
    } else {
      if (!in_blocks) {
        ThrowInvalid(
            "forward: a dense teacher must be the handle of stored teacher "
            "logits (upload them first)");
      }
      Tensor tensor =
          TensorFromObject(kwargs.teacher, py::none(), py::none(), "teacher");
      options.evaluate_teacher_dtype = tensor.dtype;
    }
    *distillation = options;
  }
  if (!kwargs.policy_loss.is_none()) {
    if (distillation->has_value()) {
      ThrowInvalid("teacher and policy_loss do not go together");
    }
    PolicyGradientOptions options;
    options.loss = ParsePolicyLoss(kwargs.policy_loss.cast<std::string>());
    if (kwargs.advantages.is_none() || kwargs.old_logprobs.is_none()) {
      ThrowInvalid("policy_loss needs advantages and old_logprobs");
    }
    if (in_blocks) {
      options.evaluate_reference_logprobs = !kwargs.ref_logprobs.is_none();
    } else {
      options.advantages =
          ParseLossInput(kwargs.advantages, "advantages", kept);
      options.sampling_logprobs =
          ParseLossInput(kwargs.old_logprobs, "old_logprobs", kept);
      if (!kwargs.ref_logprobs.is_none()) {
        options.reference_logprobs =
            ParseLossInput(kwargs.ref_logprobs, "ref_logprobs", kept);
      }
    }
    options.epsilon_low = static_cast<float>(kwargs.epsilon_low);
    if (!kwargs.epsilon_high.is_none()) {
      options.epsilon_high = kwargs.epsilon_high.cast<float>();
    }
    options.kl_coef = static_cast<float>(kwargs.kl_coef);
    options.kl_estimator = ParseKlEstimator(kwargs.kl_estimator);
    *policy = options;
  } else if (!kwargs.advantages.is_none() || !kwargs.old_logprobs.is_none() ||
             !kwargs.ref_logprobs.is_none()) {
    ThrowInvalid(
        "advantages, old_logprobs and ref_logprobs need a policy_loss");
  }
  if (!kwargs.segments.is_none()) {
    SegmentOptions options;
    int64_t count = kwargs.num_segments;
    if (!in_blocks) {
      options.ids = ParseSegmentIds(kwargs.segments, &count, kept);
    } else if (count == 0) {
      ParseSegmentIds(kwargs.segments, &count, kept);
    }
    if (count > INT32_MAX) ThrowInvalid("num_segments is over 2^31 - 1");
    options.count = static_cast<int32_t>(count);
    options.reduction = ParseSegmentReduction(kwargs.segment_reduction);
    *segments = options;
  } else if (!kwargs.segment_reduction.is_none()) {
    ThrowInvalid("segment_reduction needs segments");
  }
}

// The options Forward and LinearForward share (ForwardOptions' fields that
// LinearForwardOptions repeats), from their keyword arguments.
template <typename Options>
void SetForwardOptions(Options* options, int64_t ignore_index,
                       double label_smoothing, const std::string& reduction,
                       double z_loss_scale, double softcap, double normalizer,
                       double grad_scale, const std::string& mode,
                       bool token_loss, bool token_lse, bool token_argmax,
                       const std::string& gradient_label) {
  options->loss = LossOptions(ignore_index, label_smoothing, reduction,
                              z_loss_scale, softcap, normalizer, grad_scale);
  options->mode = ParseMode(mode);
  options->token_loss = token_loss;
  options->token_lse = token_lse;
  options->token_argmax = token_argmax;
  options->gradient_label = gradient_label;
}

// Forward's and LinearForward's call: `input` (logits or hidden states, a
// handle or a buffer uploaded under `name`), the targets and class weights
// made ready, then call(client, input handle, targets, class weights handle)
// without the GIL. An input uploaded here is released when the call fails,
// and after any call but an in-place one, whose gradient lives in it: the
// caller never saw its handle.
template <typename Result, typename Call>
Result CallOnInputs(PyClient& self, py::handle input, const char* name,
                    GradientMode mode, py::handle target,
                    py::handle class_weights, const Call& call) {
  std::shared_ptr<Client> client = self.Get();
  const std::string input_handle = HandleOrUpload(self, input, name);
  Tensor targets_tensor;
  const Targets targets = ParseTargets(target, &targets_tensor);
  Weight weights(client, class_weights);
  absl::StatusOr<Result> result;
  {
    py::gil_scoped_release release;
    result = call(*client, input_handle, targets, weights.handle());
  }
  if ((!result.ok() || mode != GradientMode::kInPlace) &&
      !py::isinstance<py::str>(input)) {
    py::gil_scoped_release release;
    client->Release(input_handle).IgnoreError();
  }
  return ValueOrThrow(std::move(result));
}

}  // namespace

ForwardResult Forward(PyClient& self, py::handle logits, py::handle target,
                      py::handle weight, int64_t ignore_index,
                      double label_smoothing, const std::string& reduction,
                      double z_loss_scale, double softcap, double normalizer,
                      double grad_scale, const std::string& mode,
                      bool token_loss, bool token_lse, bool token_argmax,
                      const std::string& gradient_label,
                      const PostTrainingKwargs& post_training) {
  ForwardOptions options;
  SetForwardOptions(&options, ignore_index, label_smoothing, reduction,
                    z_loss_scale, softcap, normalizer, grad_scale, mode,
                    token_loss, token_lse, token_argmax, gradient_label);
  options.token_logprob = post_training.token_logprob;
  options.token_entropy = post_training.token_entropy;
  options.token_ratio = post_training.token_ratio;
  options.token_clipped = post_training.token_ratio;
  KeptInputs kept;
  SetPostTraining(post_training, &kept, &options.distillation, &options.policy,
                  &options.segments, /*in_blocks=*/false);
  return CallOnInputs<ForwardResult>(
      self, logits, "logits", options.mode, target, weight,
      [&](Client& client, const std::string& logits_handle,
          const Targets& targets, const std::string& class_weights) {
        options.class_weights = class_weights;
        return client.Forward(logits_handle, targets, options);
      });
}

namespace {

LinearAccumulate ParseAccumulate(py::handle accumulate) {
  if (accumulate.is_none()) return LinearAccumulate::kDefault;
  const std::string name = accumulate.cast<std::string>();
  if (name == "add") return LinearAccumulate::kAdd;
  if (name == "overwrite") return LinearAccumulate::kOverwrite;
  if (name == "none") return LinearAccumulate::kNone;
  ThrowInvalid(
      "accumulate must be \"add\", \"overwrite\", \"none\" or "
      "None, not \"" +
      name + "\"");
}

// The post-training keywords of linear_forward and linear_evaluate
// (forward's and evaluate's names and defaults, PostTrainingKwargs); the
// per-token outputs' keywords only where `per_token` (an Evaluate has none).
// Any other keyword is a TypeError naming `function`, as Python's own.
PostTrainingKwargs PostTrainingFromKwargs(const py::kwargs& kwargs,
                                          const char* function,
                                          bool per_token) {
  PostTrainingKwargs out;
  for (const auto& item : kwargs) {
    const std::string key = item.first.cast<std::string>();
    const py::object value = py::reinterpret_borrow<py::object>(item.second);
    const bool token_output = key == "token_logprob" ||
                              key == "token_entropy" || key == "token_ratio";
    if (token_output && !per_token) {
      throw py::type_error(absl::StrCat(
          function, "() got an unexpected keyword argument '", key, "'"));
    }
    if (key == "teacher") {
      out.teacher = value;
    } else if (key == "temperature") {
      out.temperature = value.cast<double>();
    } else if (key == "alpha") {
      out.alpha = value.cast<double>();
    } else if (key == "divergence") {
      out.divergence = value.cast<std::string>();
    } else if (key == "beta") {
      out.beta = value.cast<double>();
    } else if (key == "top_k_tail") {
      out.top_k_tail = value.cast<std::string>();
    } else if (key == "policy_loss") {
      out.policy_loss = value;
    } else if (key == "advantages") {
      out.advantages = value;
    } else if (key == "old_logprobs") {
      out.old_logprobs = value;
    } else if (key == "ref_logprobs") {
      out.ref_logprobs = value;
    } else if (key == "epsilon_low") {
      out.epsilon_low = value.cast<double>();
    } else if (key == "epsilon_high") {
      out.epsilon_high = value;
    } else if (key == "kl_coef") {
      out.kl_coef = value.cast<double>();
    } else if (key == "kl_estimator") {
      out.kl_estimator = value.cast<std::string>();
    } else if (key == "segments") {
      out.segments = value;
    } else if (key == "num_segments") {
      out.num_segments = value.cast<int64_t>();
    } else if (key == "segment_reduction") {
      out.segment_reduction = value;
    } else if (key == "token_logprob") {
      out.token_logprob = value.cast<bool>();
    } else if (key == "token_entropy") {
      out.token_entropy = value.cast<bool>();
    } else if (key == "token_ratio") {
      out.token_ratio = value.cast<bool>();
    } else {
      throw py::type_error(absl::StrCat(
          function, "() got an unexpected keyword argument '", key, "'"));
    }
  }
  return out;
}

LinearForwardPrecision ParsePrecision(const std::string& precision) {
  if (precision == "exact") return LinearForwardPrecision::kExact;
  if (precision == "fast") return LinearForwardPrecision::kFast;
  ThrowInvalid("precision must be \"exact\" or \"fast\", not \"" + precision +
               "\"");
}

}  // namespace

LinearForwardResult LinearForward(
    PyClient& self, py::handle hidden, const std::string& weight,
    py::handle target, const std::string& bias, const std::string& weight_grad,
    const std::string& bias_grad, py::handle accumulate,
    py::handle class_weights, int64_t ignore_index, double label_smoothing,
    const std::string& reduction, double z_loss_scale, double softcap,
    double normalizer, double grad_scale, const std::string& mode,
    bool token_loss, bool token_lse, bool token_argmax,
    py::handle token_grad_output, const std::string& gradient_label,
    const std::string& weight_grad_label, const std::string& bias_grad_label,
    const std::string& precision, const py::kwargs& post_training_kwargs) {
  LinearForwardOptions options;
  SetForwardOptions(&options, ignore_index, label_smoothing, reduction,
                    z_loss_scale, softcap, normalizer, grad_scale, mode,
                    token_loss, token_lse, token_argmax, gradient_label);
  options.bias = bias;
  options.accumulate = ParseAccumulate(accumulate);
  options.weight_grad = weight_grad;
  options.bias_grad = bias_grad;
  options.weight_grad_label = weight_grad_label;
  options.bias_grad_label = bias_grad_label;
  options.precision = ParsePrecision(precision);
  if (!token_grad_output.is_none()) {
    Tensor tensor = TensorFromObject(token_grad_output, py::none(), py::none(),
                                     "token_grad_output");
    if (tensor.dtype != DType::kFloat32) {
      ThrowInvalid("token_grad_output must be float32, not " +
                   std::string(DTypeString(tensor.dtype)));
    }
    const float* values = static_cast<const float*>(tensor.buffer->data());
    options.token_grad_output.assign(
        values, values + tensor.buffer->bytes() / sizeof(float));
  }

  const PostTrainingKwargs post_training =
      PostTrainingFromKwargs(post_training_kwargs, "linear_forward",
                             /*per_token=*/true);
  options.token_logprob = post_training.token_logprob;
  options.token_entropy = post_training.token_entropy;
  options.token_ratio = post_training.token_ratio;
  options.token_clipped = post_training.token_ratio;
  KeptInputs kept;
  SetPostTraining(post_training, &kept, &options.distillation, &options.policy,
                  &options.segments, /*in_blocks=*/false);
  return CallOnInputs<LinearForwardResult>(
      self, hidden, "hidden", options.mode, target, class_weights,
      [&](Client& client, const std::string& hidden_handle,
          const Targets& targets, const std::string& class_weights_handle) {
        options.class_weights = class_weights_handle;
        return client.LinearForward(hidden_handle, weight, targets, options);
      });
}

BackwardResult Backward(PyClient& self, const std::string& handle,
                        py::handle grad_output, bool materialize) {
  std::shared_ptr<Client> client = self.Get();
  absl::StatusOr<BackwardResult> result;
  if (PyFloat_Check(grad_output.ptr()) || PyLong_Check(grad_output.ptr()) ||
      (!PyObject_CheckBuffer(grad_output.ptr()) &&
       py::hasattr(grad_output, "__float__") &&
       !py::hasattr(grad_output, "numpy"))) {
    const double scale = grad_output.cast<double>();
    py::gil_scoped_release release;
    result = client->Backward(handle, scale, materialize);
  } else {
    Tensor tensor =
        TensorFromObject(grad_output, py::none(), py::none(), "grad_output");
    if (tensor.dtype != DType::kFloat32) {
      ThrowInvalid("a per-token grad_output must be float32, not " +
                   std::string(DTypeString(tensor.dtype)));
    }
    absl::Span<const float> values(
        static_cast<const float*>(tensor.buffer->data()),
        tensor.buffer->bytes() / sizeof(float));
    py::gil_scoped_release release;
    result = client->Backward(handle, values, materialize);
  }
  return ValueOrThrow(std::move(result));
}

namespace {

// evaluate() and linear_evaluate(): `rows` [N, W] (logits, or hidden states
// when options.weight is set) and target [N] streamed to Evaluate.
// One per-row input of Evaluate's blocks: its bytes, bytes a row, and the
// RowBlock string it is copied into.
struct BlockColumn {
  const char* data = nullptr;
  std::size_t row_bytes = 0;
  std::string RowBlock::*field = nullptr;
};

// A host buffer of `rows` rows for a block column, checked for its size.
BlockColumn Column(const Tensor& tensor, int64_t rows, const char* what,
                   std::string RowBlock::*field) {
  if (tensor.shape.empty() || tensor.shape[0] != rows) {
    ThrowInvalid(absl::StrCat("evaluate: ", what, " must have ", rows,
                              " rows (one per logits row)"));
  }
  return {
      static_cast<const char*>(tensor.buffer->data()),
      rows == 0 ? 0 : tensor.buffer->bytes() / static_cast<std::size_t>(rows),
      field};
}

// A policy's advantages, old_logprobs and ref_logprobs (float32 [n] host
// arrays; ref_logprobs optional) as evaluate's block columns, held in `kept`.
void AddPolicyColumns(const PostTrainingKwargs& kwargs, int64_t n,
                      KeptInputs* kept, std::vector<BlockColumn>* columns) {
  const struct {
    py::handle value;
    const char* name;
    std::string RowBlock::*field;
  } inputs[] = {
      {kwargs.advantages, "advantages", &RowBlock::advantages},
      {kwargs.old_logprobs, "old_logprobs", &RowBlock::sampling_logprobs},
      {kwargs.ref_logprobs, "ref_logprobs", &RowBlock::reference_logprobs}};
  for (const auto& input : inputs) {
    if (input.value.is_none()) continue;
    if (py::isinstance<py::str>(input.value)) {
      ThrowInvalid(absl::StrCat("evaluate: ", input.name,
                                " must be an array in host memory, not a "
                                "handle"));
    }
    kept->tensors.push_back(
        TensorFromObject(input.value, py::none(), py::none(), input.name));
    const Tensor& tensor = kept->tensors.back();
    if (tensor.dtype != DType::kFloat32 || tensor.shape.size() != 1) {
      ThrowInvalid(
          absl::StrCat("evaluate: ", input.name, " must be float32 [N]"));
    }
    columns->push_back(Column(tensor, n, input.name, input.field));
  }
}

EvaluateResult EvaluateRows(PyClient& self, py::handle rows, py::handle target,
                            py::handle dtype, py::handle class_weights,
                            EvaluateOptions options, int64_t block_rows,
                            const char* shape_name,
                            const PostTrainingKwargs* post_training) {
  std::shared_ptr<Client> client = self.Get();
  const char* const field = options.weight.empty() ? "logits" : "hidden";
  Tensor rows_tensor = TensorFromObject(rows, dtype, py::none(), field);
  if (rows_tensor.shape.size() != 2) {
    ThrowInvalid(absl::StrCat("evaluate: ", field, " must be ", shape_name,
                              ", got ", rows_tensor.shape.size(),
                              " dimensions"));
  }
  const int64_t n = rows_tensor.shape[0];
  KeptInputs kept;
  if (post_training != nullptr) {
    SetPostTraining(*post_training, &kept, &options.distillation,
                    &options.policy, &options.segments, /*in_blocks=*/true);
  }
  const bool in_blocks = options.distillation.has_value() ||
                         options.policy.has_value() ||
                         options.segments.has_value();
  Tensor targets_tensor;
  if (!target.is_none() || !in_blocks) {
    targets_tensor = TensorFromObject(target, py::none(), py::none(), "target");
    if (!IsTargetsDType(targets_tensor.dtype) ||
        targets_tensor.shape.size() != 1 || targets_tensor.shape[0] != n) {
      ThrowInvalid(
          absl::StrCat("evaluate: target must be int32 or int64 [N] "
                       "for ",
                       field, " ", shape_name));
    }
  }
  Weight weights(client, class_weights);
  options.class_weights = weights.handle();
  absl::StatusOr<EvaluateResult> result;
  if (!in_blocks) {
    py::gil_scoped_release release;
    result =
        client->Evaluate(n, rows_tensor.shape[1], rows_tensor.dtype,
                         rows_tensor.buffer->data(), targets_tensor.dtype,
                         targets_tensor.buffer->data(), options, block_rows);
    return ValueOrThrow(std::move(result));
  }
  // The teacher and segment ids go in the blocks, row by row beside the
  // logits.
  std::vector<BlockColumn> columns;
  columns.push_back(Column(rows_tensor, n, field, &RowBlock::logits));
  if (targets_tensor.buffer != nullptr) {
    columns.push_back(Column(targets_tensor, n, "target", &RowBlock::targets));
  }
  std::vector<Tensor> teacher;
  if (options.distillation.has_value()) {
    py::handle value = post_training->teacher;
    if (options.distillation->evaluate_teacher_dtype != DType::kInvalid) {
      teacher.push_back(
          TensorFromObject(value, py::none(), py::none(), "teacher"));
      columns.push_back(
          Column(teacher.back(), n, "teacher", &RowBlock::teacher_logits));
    } else {
      py::sequence pair = value.cast<py::sequence>();
      for (int i = 0; i < 2; ++i) {
        if (py::isinstance<py::str>(pair[i])) {
          ThrowInvalid(
              "evaluate: top-k teacher indices and logprobs must be arrays "
              "in host memory, not handles");
        }
        teacher.push_back(
            TensorFromObject(pair[i], py::none(), py::none(), "teacher"));
      }
      columns.push_back(
          Column(teacher[0], n, "teacher indices", &RowBlock::teacher_indices));
      columns.push_back(Column(teacher[1], n, "teacher logprobs",
                               &RowBlock::teacher_logprobs));
    }
  }
  if (options.policy.has_value()) {
    AddPolicyColumns(*post_training, n, &kept, &columns);
  }
  if (options.segments.has_value()) {
    int64_t count = options.segments->count;
    ParseSegmentIds(post_training->segments, &count, &kept);
    const std::vector<int32_t>& ids = kept.narrowed.back();
    if (static_cast<int64_t>(ids.size()) != n) {
      ThrowInvalid(absl::StrCat("evaluate: segments must have ", n,
                                " ids (one per logits row)"));
    }
    columns.push_back({reinterpret_cast<const char*>(ids.data()),
                       sizeof(int32_t), &RowBlock::segment_ids});
  }
  const std::size_t row_bytes = columns[0].row_bytes;
  if (block_rows <= 0) {
    block_rows = std::max<int64_t>(
        1, static_cast<int64_t>(client->options().chunk_bytes /
                                std::max<std::size_t>(row_bytes, 1)));
  }
  EvaluateOptions with_total = options;
  with_total.total_rows = n;
  int64_t next = 0;
  {
    py::gil_scoped_release release;
    result = client->Evaluate(
        rows_tensor.shape[1], rows_tensor.dtype,
        targets_tensor.buffer != nullptr ? targets_tensor.dtype
                                         : DType::kInvalid,
        with_total, [&](RowBlock* block) -> absl::StatusOr<bool> {
          if (next >= n) return false;
          const int64_t count = std::min(block_rows, n - next);
          for (const BlockColumn& column : columns) {
            (block->*column.field)
                .assign(column.data + next * column.row_bytes,
                        count * column.row_bytes);
          }
          next += count;
          return true;
        });
  }
  return ValueOrThrow(std::move(result));
}

}  // namespace

EvaluateResult Evaluate(PyClient& self, py::handle logits, py::handle target,
                        py::handle dtype, py::handle weight,
                        int64_t ignore_index, double label_smoothing,
                        const std::string& reduction, double z_loss_scale,
                        double softcap, double normalizer, int64_t block_rows,
                        const PostTrainingKwargs& post_training) {
  EvaluateOptions options;
  options.loss = LossOptions(ignore_index, label_smoothing, reduction,
                             z_loss_scale, softcap, normalizer, 1.0);
  return EvaluateRows(self, logits, target, dtype, weight, std::move(options),
                      block_rows, "[N, V]", &post_training);
}

EvaluateResult LinearEvaluate(PyClient& self, py::handle hidden,
                              const std::string& weight, py::handle target,
                              const std::string& bias, py::handle dtype,
                              py::handle class_weights, int64_t ignore_index,
                              double label_smoothing,
                              const std::string& reduction, double z_loss_scale,
                              double softcap, double normalizer,
                              int64_t block_rows,
                              const py::kwargs& post_training_kwargs) {
  if (weight.empty()) {
    ThrowInvalid("linear_evaluate: weight must name a stored [V, H] tensor");
  }
  const PostTrainingKwargs post_training = PostTrainingFromKwargs(
      post_training_kwargs, "linear_evaluate", /*per_token=*/false);
  EvaluateOptions options;
  options.loss = LossOptions(ignore_index, label_smoothing, reduction,
                             z_loss_scale, softcap, normalizer, 1.0);
  options.weight = weight;
  options.bias = bias;
  return EvaluateRows(self, hidden, target, dtype, class_weights,
                      std::move(options), block_rows, "[N, H]", &post_training);
}

}  // namespace python
}  // namespace lossd
