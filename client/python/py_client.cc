// lossd.Client's methods (see py_client.h).
#include "client/python/py_client.h"

#include <pybind11/stl.h>

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
// the call.
Targets ParseTargets(py::handle target, Tensor* keep) {
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
                      const std::string& gradient_label) {
  ForwardOptions options;
  SetForwardOptions(&options, ignore_index, label_smoothing, reduction,
                    z_loss_scale, softcap, normalizer, grad_scale, mode,
                    token_loss, token_lse, token_argmax, gradient_label);
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
    const std::string& precision) {
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
EvaluateResult EvaluateRows(PyClient& self, py::handle rows, py::handle target,
                            py::handle dtype, py::handle class_weights,
                            EvaluateOptions options, int64_t block_rows,
                            const char* shape_name) {
  std::shared_ptr<Client> client = self.Get();
  const char* const field = options.weight.empty() ? "logits" : "hidden";
  Tensor rows_tensor = TensorFromObject(rows, dtype, py::none(), field);
  if (rows_tensor.shape.size() != 2) {
    ThrowInvalid(absl::StrCat("evaluate: ", field, " must be ", shape_name,
                              ", got ", rows_tensor.shape.size(),
                              " dimensions"));
  }
  Tensor targets_tensor =
      TensorFromObject(target, py::none(), py::none(), "target");
  if (!IsTargetsDType(targets_tensor.dtype) ||
      targets_tensor.shape.size() != 1 ||
      targets_tensor.shape[0] != rows_tensor.shape[0]) {
    ThrowInvalid(
        absl::StrCat("evaluate: target must be int32 or int64 [N] for ", field,
                     " ", shape_name));
  }
  Weight weights(client, class_weights);
  options.class_weights = weights.handle();
  absl::StatusOr<EvaluateResult> result;
  {
    py::gil_scoped_release release;
    result = client->Evaluate(
        rows_tensor.shape[0], rows_tensor.shape[1], rows_tensor.dtype,
        rows_tensor.buffer->data(), targets_tensor.dtype,
        targets_tensor.buffer->data(), options, block_rows);
  }
  return ValueOrThrow(std::move(result));
}

}  // namespace

EvaluateResult Evaluate(PyClient& self, py::handle logits, py::handle target,
                        py::handle dtype, py::handle weight,
                        int64_t ignore_index, double label_smoothing,
                        const std::string& reduction, double z_loss_scale,
                        double softcap, double normalizer, int64_t block_rows) {
  EvaluateOptions options;
  options.loss = LossOptions(ignore_index, label_smoothing, reduction,
                             z_loss_scale, softcap, normalizer, 1.0);
  return EvaluateRows(self, logits, target, dtype, weight, std::move(options),
                      block_rows, "[N, V]");
}

EvaluateResult LinearEvaluate(PyClient& self, py::handle hidden,
                              const std::string& weight, py::handle target,
                              const std::string& bias, py::handle dtype,
                              py::handle class_weights, int64_t ignore_index,
                              double label_smoothing,
                              const std::string& reduction, double z_loss_scale,
                              double softcap, double normalizer,
                              int64_t block_rows) {
  if (weight.empty()) {
    ThrowInvalid("linear_evaluate: weight must name a stored [V, H] tensor");
  }
  EvaluateOptions options;
  options.loss = LossOptions(ignore_index, label_smoothing, reduction,
                             z_loss_scale, softcap, normalizer, 1.0);
  options.weight = weight;
  options.bias = bias;
  return EvaluateRows(self, hidden, target, dtype, class_weights,
                      std::move(options), block_rows, "[N, H]");
}

}  // namespace python
}  // namespace lossd
