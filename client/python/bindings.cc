// lossd._lossd: Python bindings of lossd::Client, so that Python shares the
// one client implementation. Buffers are used where they lie, and the GIL is
// released while bytes move, so that other Python threads keep running.
#include <Python.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/client.h"

namespace py = pybind11;

namespace lossd {
namespace {

// Carries a non-OK absl::Status from a binding to the exception translator,
// which raises the lossd.Error subclass of its code.
class StatusError : public std::exception {
 public:
  explicit StatusError(absl::Status status) : status_(std::move(status)) {}
  const absl::Status& status() const { return status_; }
  const char* what() const noexcept override { return "lossd status"; }

 private:
  absl::Status status_;
};

void ThrowIfError(const absl::Status& status) {
  if (!status.ok()) throw StatusError(status);
}

template <typename T>
T ValueOrThrow(absl::StatusOr<T> value) {
  ThrowIfError(value.status());
  return *std::move(value);
}

[[noreturn]] void ThrowInvalid(const std::string& message) {
  throw StatusError(absl::InvalidArgumentError(message));
}

// A C-contiguous view of a Python buffer. Holding the view keeps the exporter
// alive and stops it from resizing, so its memory may be used with the GIL
// released. Create and destroy with the GIL held.
class Buffer {
 public:
  Buffer(py::handle object, bool writable) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT;
    if (writable) flags |= PyBUF_WRITABLE;
    if (PyObject_GetBuffer(object.ptr(), &view_, flags) != 0) {
      throw py::error_already_set();
    }
  }
  ~Buffer() { PyBuffer_Release(&view_); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  void* data() const { return view_.buf; }
  std::size_t bytes() const { return static_cast<std::size_t>(view_.len); }
  std::size_t itemsize() const {
    return static_cast<std::size_t>(view_.itemsize);
  }
  std::vector<int64_t> shape() const {
    if (view_.shape == nullptr) {
      return {static_cast<int64_t>(view_.len /
                                   std::max<Py_ssize_t>(1, view_.itemsize))};
    }
    return std::vector<int64_t>(view_.shape, view_.shape + view_.ndim);
  }

  // The lossd dtype of the buffer's struct format; kInvalid when it has none
  // (bytes, uint16 holding bf16, ...). Big-endian formats are refused: lossd
  // takes little-endian bytes.
  DType FormatDType() const {
    std::string format = view_.format != nullptr ? view_.format : "B";
    if (!format.empty() && (format[0] == '>' || format[0] == '!')) {
      ThrowInvalid("big-endian buffer (format '" + format +
                   "'): convert it to little-endian first");
    }
    if (!format.empty() &&
        (format[0] == '<' || format[0] == '=' || format[0] == '@')) {
      format = format.substr(1);
    }
    if (format.size() != 1) return DType::kInvalid;
    switch (format[0]) {
      case 'f':
        return DType::kFloat32;
      case 'e':
        return DType::kFloat16;
      case 'i':
      case 'l':
      case 'q':
        return itemsize() == 4   ? DType::kInt32
               : itemsize() == 8 ? DType::kInt64
                                 : DType::kInvalid;
      default:
        return DType::kInvalid;
    }
  }

 private:
  Py_buffer view_{};
};

// Parses a dtype given as a name ("float32", "bf16", ...), a numpy dtype or
// scalar type, or a torch dtype. None gives kInvalid.
DType ParseDType(py::handle dtype) {
  if (dtype.is_none()) return DType::kInvalid;
  std::string name;
  if (py::isinstance<py::str>(dtype)) {
    name = dtype.cast<std::string>();
  } else {
    name = py::str(dtype).cast<std::string>();
    if (name.rfind("torch.", 0) == 0) {
      name = name.substr(6);
    } else {
      name = py::module_::import("numpy")
                 .attr("dtype")(dtype)
                 .attr("name")
                 .cast<std::string>();
    }
  }
  return ValueOrThrow(DTypeFromString(name));
}

// An object to take a buffer from: the object itself when it exports one;
// a CPU torch.Tensor as its numpy view (bf16 as an int16 view, reported in
// *implied_dtype); other array-likes through numpy.asarray, which does not
// copy objects with __array_interface__.
py::object AsBufferObject(py::handle object, DType* implied_dtype) {
  *implied_dtype = DType::kInvalid;
  if (PyObject_CheckBuffer(object.ptr()))
    return py::reinterpret_borrow<py::object>(object);
  py::handle type = reinterpret_cast<PyObject*>(Py_TYPE(object.ptr()));
  std::string module = py::str(type.attr("__module__")).cast<std::string>();
  if (module.rfind("torch", 0) == 0 && py::hasattr(object, "numpy")) {
    py::object tensor = object.attr("detach")();
    if (py::str(tensor.attr("device").attr("type")).cast<std::string>() !=
        "cpu") {
      ThrowInvalid("a tensor on " +
                   py::str(tensor.attr("device")).cast<std::string>() +
                   ": lossd.Client takes host memory "
                   "(lossd.torch.cross_entropy ships device "
                   "tensors, or use upload_from)");
    }
    py::object torch = py::module_::import("torch");
    if (tensor.attr("dtype").equal(torch.attr("bfloat16"))) {
      *implied_dtype = DType::kBFloat16;
      tensor = tensor.attr("view")(torch.attr("int16"));
    }
    return tensor.attr("numpy")();
  }
  if (py::hasattr(object, "__array_interface__") ||
      py::hasattr(object, "__array__")) {
    return py::module_::import("numpy").attr("asarray")(object);
  }
  throw py::type_error(
      "expected a buffer (numpy array, CPU torch.Tensor, memoryview, bytes), "
      "got " +
      py::str(type.attr("__name__")).cast<std::string>());
}

// A buffer and the dtype and shape it is sent as.
struct Tensor {
  py::object owner;  // keeps a converted object alive while the view is held
  std::unique_ptr<Buffer> buffer;
  DType dtype = DType::kInvalid;
  std::vector<int64_t> shape;
};

int64_t Elements(const std::vector<int64_t>& shape) {
  int64_t elements = 1;
  for (int64_t dim : shape) elements *= dim;
  return elements;
}

// dtype: explicit > implied by a torch bf16 tensor > the buffer's format.
// shape: explicit > the buffer's when its items have the dtype's size >
// one dimension of all the bytes.
Tensor TensorFromObject(py::handle object, py::handle dtype, py::handle shape,
                        const char* what) {
  Tensor tensor;
  DType implied = DType::kInvalid;
  tensor.owner = AsBufferObject(object, &implied);
  tensor.buffer = std::make_unique<Buffer>(tensor.owner, /*writable=*/false);
  tensor.dtype = ParseDType(dtype);
  if (tensor.dtype == DType::kInvalid) tensor.dtype = implied;
  if (tensor.dtype == DType::kInvalid)
    tensor.dtype = tensor.buffer->FormatDType();
  if (tensor.dtype == DType::kInvalid) {
    ThrowInvalid(
        std::string(what) +
        ": cannot tell the dtype from the buffer; pass dtype= (bf16 travels as "
        "uint16/int16 with dtype=\"bf16\"; float64 must be converted)");
  }
  const std::size_t element_bytes = DTypeSize(tensor.dtype);
  if (!shape.is_none()) {
    tensor.shape = shape.cast<std::vector<int64_t>>();
  } else if (tensor.buffer->itemsize() == element_bytes) {
    tensor.shape = tensor.buffer->shape();
  } else {
    tensor.shape = {
        static_cast<int64_t>(tensor.buffer->bytes() / element_bytes)};
  }
  if (static_cast<std::size_t>(Elements(tensor.shape)) * element_bytes !=
      tensor.buffer->bytes()) {
    ThrowInvalid(std::string(what) + ": the buffer has " +
                 std::to_string(tensor.buffer->bytes()) + " bytes, not the " +
                 std::to_string(Elements(tensor.shape)) + " elements of " +
                 DTypeString(tensor.dtype) + " its shape needs");
  }
  return tensor;
}

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

// The numpy dtype a tensor of `dtype` downloads into; bf16 has none in numpy,
// so its bits arrive as uint16.
const char* NumpyDType(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "<f4";
    case DType::kFloat16:
      return "<f2";
    case DType::kBFloat16:
      return "<u2";
    case DType::kInt32:
      return "<i4";
    case DType::kInt64:
      return "<i8";
    default:
      ThrowInvalid("no numpy dtype for " + std::string(DTypeString(dtype)));
  }
}

py::object TimeOrNone(absl::Time time) {
  if (time == absl::InfinitePast() || time == absl::InfiniteFuture())
    return py::none();
  return py::float_(absl::ToDoubleSeconds(time - absl::UnixEpoch()));
}

template <typename T>
py::object NumpyCopy(const std::vector<T>& values, const char* dtype) {
  py::object array =
      py::module_::import("numpy").attr("empty")(values.size(), dtype);
  Buffer buffer(array, /*writable=*/true);
  if (!values.empty())
    std::memcpy(buffer.data(), values.data(), values.size() * sizeof(T));
  return array;
}

// The first Python exception raised by a callback of a transfer (callbacks
// come from the transfer's threads), raised again on the calling thread once
// the transfer has stopped. Touch only with the GIL held.
class CallbackFailure {
 public:
  bool failed() const { return static_cast<bool>(value_); }
  absl::Status Record(py::error_already_set& error, const char* what) {
    if (!value_) {
      type_ = error.type();
      value_ = error.value();
      trace_ = error.trace();
    }
    return absl::CancelledError(std::string(what) + " raised: " + error.what());
  }
  // Records the exception being handled (call in a catch block): a Python
  // error, or a C++ one turned into its Python exception, since nothing may
  // be thrown through the transfer's threads.
  absl::Status RecordCurrent(const char* what) {
    try {
      throw;
    } catch (py::error_already_set& error) {
      return Record(error, what);
    } catch (py::builtin_exception& error) {
      error.set_error();
    } catch (const std::exception& error) {
      PyErr_SetString(PyExc_RuntimeError, error.what());
    }
    py::error_already_set fetched;
    return Record(fetched, what);
  }
  void RaiseIfAny() {
    if (!value_) return;
    PyErr_Restore(type_.release().ptr(), value_.release().ptr(),
                  trace_.release().ptr());
    throw py::error_already_set();
  }

 private:
  py::object type_, value_, trace_;
};

// A memoryview over memory lossd owns, valid during one callback: released
// after it so that a view kept by the callback fails instead of reading
// freed memory (a release refused because of a derived export is left).
class ScopedMemoryView {
 public:
  ScopedMemoryView(const void* data, std::size_t bytes, bool writable)
      : view_(py::reinterpret_steal<py::object>(
            PyMemoryView_FromMemory(static_cast<char*>(const_cast<void*>(data)),
                                    static_cast<Py_ssize_t>(bytes),
                                    writable ? PyBUF_WRITE : PyBUF_READ))) {
    if (!view_) throw py::error_already_set();
  }
  ~ScopedMemoryView() {
    PyObject* result = PyObject_CallMethod(view_.ptr(), "release", nullptr);
    if (result == nullptr) PyErr_Clear();
    Py_XDECREF(result);
  }
  const py::object& get() const { return view_; }

 private:
  py::object view_;
};

// lossd.Client: owns a lossd::Client. Calls hold a reference of their own,
// so close() while another thread is in a call frees the client after it.
class PyClient {
 public:
  PyClient(std::string target, std::shared_ptr<Client> client)
      : target_(std::move(target)), client_(std::move(client)) {}
  ~PyClient() { Close(); }

  const std::string& target() const { return target_; }
  bool closed() const { return !client_; }

  std::shared_ptr<Client> Get() const {
    if (!client_) throw py::value_error("the lossd.Client is closed");
    return client_;
  }

  // Runs the close hooks (lossd.torch unregisters the scratch buffers from
  // CUDA there, which must happen before they are freed), then drops the
  // client.
  void Close() {
    if (!client_) return;
    std::vector<py::object> hooks = std::move(close_hooks_);
    close_hooks_.clear();
    for (py::object& hook : hooks) {
      try {
        hook();
      } catch (py::error_already_set& error) {
        error.discard_as_unraisable("lossd.Client close hook");
      }
    }
    std::shared_ptr<Client> client = std::move(client_);
    py::gil_scoped_release release;
    client.reset();
  }

  void AddCloseHook(py::object hook) {
    close_hooks_.push_back(std::move(hook));
  }

 private:
  const std::string target_;
  std::shared_ptr<Client> client_;
  std::vector<py::object> close_hooks_;
};

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

// ---- the methods of lossd.Client ----

TensorInfo Upload(PyClient& self, py::handle data, py::handle dtype,
                  py::handle shape, const std::string& label,
                  py::handle overwrite = py::none()) {
  std::shared_ptr<Client> client = self.Get();
  Tensor tensor = TensorFromObject(data, dtype, shape, "upload");
  const std::string target =
      overwrite.is_none() ? std::string() : overwrite.cast<std::string>();
  absl::StatusOr<TensorInfo> info;
  {
    py::gil_scoped_release release;
    info =
        overwrite.is_none()
            ? client->Upload(tensor.dtype, tensor.shape, tensor.buffer->data(),
                             tensor.buffer->bytes(), label)
            : client->Overwrite(target, tensor.dtype, tensor.shape,
                                tensor.buffer->data(), tensor.buffer->bytes());
  }
  return ValueOrThrow(std::move(info));
}

TensorInfo UploadFrom(PyClient& self, const py::function& source,
                      py::handle dtype, const std::vector<int64_t>& shape,
                      const std::string& label) {
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
    info = client->UploadFrom(parsed, shape, adapter, label);
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

ForwardResult Forward(PyClient& self, py::handle logits, py::handle target,
                      py::handle weight, int64_t ignore_index,
                      double label_smoothing, const std::string& reduction,
                      double z_loss_scale, double softcap, double normalizer,
                      double grad_scale, const std::string& mode,
                      bool token_loss, bool token_lse, bool token_argmax,
                      const std::string& gradient_label) {
  std::shared_ptr<Client> client = self.Get();
  ForwardOptions options;
  options.loss = LossOptions(ignore_index, label_smoothing, reduction,
                             z_loss_scale, softcap, normalizer, grad_scale);
  options.mode = ParseMode(mode);
  options.token_loss = token_loss;
  options.token_lse = token_lse;
  options.token_argmax = token_argmax;
  options.gradient_label = gradient_label;

  std::string logits_handle;
  if (py::isinstance<py::str>(logits)) {
    logits_handle = logits.cast<std::string>();
  } else {
    logits_handle =
        Upload(self, logits, py::none(), py::none(), "logits").handle;
  }
  Tensor targets_tensor;
  Targets targets;
  if (py::isinstance<py::str>(target)) {
    targets = Targets::Handle(target.cast<std::string>());
  } else {
    targets_tensor = TensorFromObject(target, py::none(), py::none(), "target");
    if (!IsTargetsDType(targets_tensor.dtype)) {
      ThrowInvalid("target must hold int32 or int64 class indices, not " +
                   std::string(DTypeString(targets_tensor.dtype)));
    }
    targets =
        Targets::Inline(targets_tensor.dtype, targets_tensor.buffer->data(),
                        targets_tensor.buffer->bytes());
  }
  Weight class_weights(client, weight);
  options.class_weights = class_weights.handle();
  absl::StatusOr<ForwardResult> result;
  {
    py::gil_scoped_release release;
    result = client->Forward(logits_handle, targets, options);
  }
  if (!result.ok() && !py::isinstance<py::str>(logits)) {
    py::gil_scoped_release release;
    client->Release(logits_handle).IgnoreError();
  }
  return ValueOrThrow(std::move(result));
}

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

LinearForwardResult LinearForward(
    PyClient& self, py::handle hidden, const std::string& weight,
    py::handle target, const std::string& bias, const std::string& weight_grad,
    const std::string& bias_grad, py::handle accumulate,
    py::handle class_weights, int64_t ignore_index, double label_smoothing,
    const std::string& reduction, double z_loss_scale, double softcap,
    double normalizer, double grad_scale, const std::string& mode,
    bool token_loss, bool token_lse, bool token_argmax,
    py::handle token_grad_output, const std::string& gradient_label,
    const std::string& weight_grad_label, const std::string& bias_grad_label) {
  std::shared_ptr<Client> client = self.Get();
  LinearForwardOptions options;
  options.loss = LossOptions(ignore_index, label_smoothing, reduction,
                             z_loss_scale, softcap, normalizer, grad_scale);
  options.mode = ParseMode(mode);
  options.token_loss = token_loss;
  options.token_lse = token_lse;
  options.token_argmax = token_argmax;
  options.gradient_label = gradient_label;
  options.bias = bias;
  options.accumulate = ParseAccumulate(accumulate);
  options.weight_grad = weight_grad;
  options.bias_grad = bias_grad;
  options.weight_grad_label = weight_grad_label;
  options.bias_grad_label = bias_grad_label;
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

  std::string hidden_handle;
  if (py::isinstance<py::str>(hidden)) {
    hidden_handle = hidden.cast<std::string>();
  } else {
    hidden_handle =
        Upload(self, hidden, py::none(), py::none(), "hidden").handle;
  }
  Tensor targets_tensor;
  Targets targets;
  if (py::isinstance<py::str>(target)) {
    targets = Targets::Handle(target.cast<std::string>());
  } else {
    targets_tensor = TensorFromObject(target, py::none(), py::none(), "target");
    if (!IsTargetsDType(targets_tensor.dtype)) {
      ThrowInvalid("target must hold int32 or int64 class indices, not " +
                   std::string(DTypeString(targets_tensor.dtype)));
    }
    targets =
        Targets::Inline(targets_tensor.dtype, targets_tensor.buffer->data(),
                        targets_tensor.buffer->bytes());
  }
  Weight weights(client, class_weights);
  options.class_weights = weights.handle();
  absl::StatusOr<LinearForwardResult> result;
  {
    py::gil_scoped_release release;
    result = client->LinearForward(hidden_handle, weight, targets, options);
  }
  if (!result.ok() && !py::isinstance<py::str>(hidden)) {
    py::gil_scoped_release release;
    client->Release(hidden_handle).IgnoreError();
  }
  return ValueOrThrow(std::move(result));
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

EvaluateResult Evaluate(PyClient& self, py::handle logits, py::handle target,
                        py::handle dtype, py::handle weight,
                        int64_t ignore_index, double label_smoothing,
                        const std::string& reduction, double z_loss_scale,
                        double softcap, double normalizer, int64_t block_rows) {
  std::shared_ptr<Client> client = self.Get();
  EvaluateOptions options;
  options.loss = LossOptions(ignore_index, label_smoothing, reduction,
                             z_loss_scale, softcap, normalizer, 1.0);
  Tensor logits_tensor = TensorFromObject(logits, dtype, py::none(), "logits");
  if (logits_tensor.shape.size() != 2)
    ThrowInvalid("evaluate: logits must be [N, V]");
  Tensor targets_tensor =
      TensorFromObject(target, py::none(), py::none(), "target");
  if (!IsTargetsDType(targets_tensor.dtype) ||
      targets_tensor.shape.size() != 1 ||
      targets_tensor.shape[0] != logits_tensor.shape[0]) {
    ThrowInvalid(
        "evaluate: target must be int32 or int64 [N] for logits [N, V]");
  }
  Weight class_weights(client, weight);
  options.class_weights = class_weights.handle();
  absl::StatusOr<EvaluateResult> result;
  {
    py::gil_scoped_release release;
    result = client->Evaluate(
        logits_tensor.shape[0], logits_tensor.shape[1], logits_tensor.dtype,
        logits_tensor.buffer->data(), targets_tensor.dtype,
        targets_tensor.buffer->data(), options, block_rows);
  }
  return ValueOrThrow(std::move(result));
}

template <typename F>
auto WithoutGil(F&& call) {
  py::gil_scoped_release release;
  return call();
}

std::string TensorInfoRepr(const TensorInfo& info) {
  std::string shape;
  for (std::size_t i = 0; i < info.shape.size(); ++i) {
    shape += (i > 0 ? ", " : "") + std::to_string(info.shape[i]);
  }
  return "TensorInfo(handle='" + info.handle + "', dtype='" +
         DTypeString(info.dtype) + "', shape=(" + shape +
         (info.shape.size() == 1 ? ",)" : ")") +
         ", state=" + TensorStateName(info.state) +
         ", bytes=" + std::to_string(info.bytes) + ", device='" + info.device +
         "')";
}

constexpr char kClientDoc[] = R"doc(A connection to one lossd instance.

Client(target, *, token=None, tls=False, ca_file=None, cert_file=None,
       key_file=None, server_name=None, deadline=None, connect_wait=1.0,
       upload_streams=4, data_connection=True, stripe_min_bytes=64 MiB,
       chunk_bytes=1 MiB, piece_bytes=8 MiB, max_message_bytes=64 MiB)

target: "host:port" (or any gRPC target URI). Does not contact the server
(use health()). token: sent as "authorization: Bearer TOKEN". tls / ca_file /
cert_file / key_file / server_name: TLS (any file implies tls), mutual TLS
with cert_file and key_file. deadline: seconds per call (None = none).
connect_wait: seconds a call waits for the connection to come up.
Tensors of at least stripe_min_bytes go over upload_streams plain TCP data
connections when the server offers them (data_connection, no TLS), else as
that many gRPC stripes. piece_bytes: the most bytes one upload_from source or
download_to sink call covers, and the size of the client's scratch buffers.

Every method releases the GIL while it waits on the server, and raises a
lossd.Error subclass (lossd.NotFound, lossd.FailedPrecondition, ...) carrying
the gRPC code and message. Methods may be called from several threads.
Usable as a context manager (close() on exit).)doc";

constexpr char kUploadDoc[] =
    R"doc(upload(data, *, dtype=None, shape=None, label="", overwrite=None) -> TensorInfo

Stores a tensor on the server and returns its TensorInfo (.handle names it).
data: any C-contiguous buffer (numpy array, memoryview, bytes) or CPU
torch.Tensor; its memory is sent as it lies, without a copy. dtype: "float32",
"bf16", "float16", "int32", "int64" (or a numpy/torch dtype); default from
the buffer (a torch.bfloat16 tensor is bf16; bf16 in a numpy uint16/int16
array needs dtype="bf16"). shape: default the buffer's ([N, V] logits,
[N] targets, [V] weights).

overwrite: a handle whose contents the data replaces in place (same dtype
and shape; the handle, its memory and label stay; its state becomes LOGITS),
e.g. a weight after an optimizer step.

Raises InvalidArgument (dtype, shape or byte count), ResourceExhausted (over
the memory budget or a quota), Unavailable, ... On any error nothing stays
(overwrite: NotFound, InvalidArgument for another dtype or shape,
FailedPrecondition while the tensor is in use).)doc";

constexpr char kLinearForwardDoc[] =
    R"doc(linear_forward(hidden, weight, target, *, bias="", weight_grad="", bias_grad="", accumulate=None, class_weights=None, ignore_index=-100, label_smoothing=0.0, reduction="mean", z_loss_scale=0.0, softcap=0.0, normalizer=0.0, grad_scale=1.0, mode="in_place", token_loss=False, token_lse=False, token_argmax=False, token_grad_output=None, gradient_label="", weight_grad_label="", bias_grad_label="") -> LinearForwardResult

The LM head and the cross-entropy in one call: hidden states [N, H] (a
handle, or a buffer uploaded for the call) times the stored weight [V, H]
(`weight`, a handle; `bias` a [V] handle) into logits that never leave the
server, their loss as forward() computes it, and the gradients. mode:
"in_place" (the hidden handle becomes dX, state GRADIENT; backward() scales it
lazily), "out_of_place" (a new handle) or "none". The weight gradient (and
with a bias the bias gradient) accumulates in fp32 into `weight_grad` /
`bias_grad`, created on first use: result.weight_grad / .bias_grad name them,
download them as float32 or bf16. accumulate: "add" (default when a gradient
is formed), "overwrite" or "none". grad_scale multiplies every gradient (fold
1/micro-batches in); pass the whole batch's `normalizer` when a mean spans
micro-batches. class_weights: fp32 [V], as forward()'s `weight`.
reduction="none" with a gradient needs token_grad_output (float32 [N]).

Raises NotFound, InvalidArgument (shapes, dtypes, options, one tensor in two
roles), FailedPrecondition (hidden holds a gradient, a tensor in use),
ResourceExhausted. On any error nothing changes.)doc";

constexpr char kUploadFromDoc[] =
    R"doc(upload_from(source, dtype, shape, *, label="") -> TensorInfo

Stores a tensor whose bytes `source` produces piece by piece, for data not
in host memory (a GPU tensor, a file being converted). source(offset, size,
scratch) is called for the `size` bytes (whole elements, at most piece_bytes)
that start at byte `offset`: it fills `scratch` (a writable memoryview of
`size` bytes in one of the client's scratch buffers, the same few for the
client's life, valid during the call only) and returns None, or returns a
buffer of `size` bytes to send instead (held until the upload returns).
Calls come from the transfer's threads, holding the GIL, and together cover
the tensor once; the next piece is produced while the previous one is sent.
An exception from `source` stops the upload, nothing stays on the server,
and the exception is raised here. Other errors as upload().)doc";

constexpr char kDownloadDoc[] =
    R"doc(download(handle, *, dtype=None, out=None) -> numpy.ndarray | out

Fetches a tensor (for a gradient, with the grad_output of backward()
applied). dtype: convert on the server first ("float32", "bf16", "float16";
None = as stored): download(h, dtype="float32") gives float32 from a bf16
gradient. out: a writable C-contiguous buffer (numpy array, CPU
torch.Tensor) of exactly the bytes sent, written in place and returned;
else a new numpy array of the tensor's shape (bf16 arrives as uint16:
torch.from_numpy(a).view(torch.bfloat16)).

Raises NotFound, InvalidArgument (conversion), OutOfRange (out too small).)doc";

constexpr char kDownloadToDoc[] =
    R"doc(download_to(handle, sink, *, dtype=None, on_header=None) -> TensorInfo

Fetches a tensor piece by piece: sink(offset, data) receives the bytes
(as sent, after conversion) that start at byte `offset`; `data` is a
read-only memoryview valid during the call only (whole elements, at most
piece_bytes). Calls come from the transfer's threads, holding the GIL, and
together cover the tensor once. on_header(info) sees the TensorInfo as sent
before the first piece. An exception from a callback stops the download and
is raised here; the tensor stays as it was. Returns the TensorInfo as sent.)doc";

constexpr char kForwardDoc[] =
    R"doc(forward(logits, target, *, weight=None, ignore_index=-100, label_smoothing=0.0,
        reduction="mean", z_loss_scale=0.0, softcap=0.0, normalizer=0.0,
        grad_scale=1.0, mode="in_place", token_loss=False, token_lse=False,
        token_argmax=False, gradient_label="") -> ForwardResult

Cross entropy of stored logits [N, V], with the semantics of
torch.nn.functional.cross_entropy (and lossd's z-loss, softcap, normalizer
and grad_scale). logits: a handle (or a buffer, uploaded first; then
.gradient names it). target: a handle of int32/int64 [N], or an int32/int64
buffer sent inline. weight: class weights, a handle of float32 [V] or a
buffer uploaded for this call. mode: "in_place" (the gradient overwrites the
logits; .gradient is the logits handle, now a GRADIENT), "out_of_place" (a
new gradient tensor) or "none" (loss only; the logits stay). token_loss,
token_lse, token_argmax: per-row outputs as numpy arrays.

A mean over zero valid rows is 0 here (torch: NaN). Raises NotFound,
InvalidArgument (shapes, a target outside [0, V), options),
FailedPrecondition (logits consumed by an in-place forward, or busy),
ResourceExhausted (an out-of-place gradient over the budget).)doc";

constexpr char kBackwardDoc[] =
    R"doc(backward(handle, grad_output=1.0, *, materialize=False) -> BackwardResult

Records grad_output for a gradient: a number, or per-token float32 [N]
values for a gradient of reduction="none". It replaces any earlier factor
and is applied when the gradient is downloaded (materialize=True applies it
on the server now). Raises NotFound, FailedPrecondition (the handle holds
logits), InvalidArgument (non-finite, wrong count or reduction).)doc";

constexpr char kEvaluateDoc[] =
    R"doc(evaluate(logits, target, *, dtype=None, weight=None, ignore_index=-100,
         label_smoothing=0.0, reduction="mean", z_loss_scale=0.0, softcap=0.0,
         normalizer=0.0, block_rows=0) -> EvaluateResult

Loss only of logits [N, V] and target [N] in host memory, streamed through
the server in row blocks (over data connections when large); nothing is
stored. dtype as for upload() (bf16 from uint16 needs dtype="bf16").
reduction: "mean" or "sum". block_rows: rows per block (0 = about 1 MiB).)doc";

}  // namespace

// In namespace lossd for the names above; PyInit__lossd has C linkage.
PYBIND11_MODULE(_lossd, m) {
  m.doc() = "Bindings of lossd::Client; use the lossd package.";
  // Each docstring starts with the signature as Python callers write it;
  // pybind11's generated one would show C++ parameter types instead.
  py::options options;
  options.disable_function_signatures();
  m.attr("LOSSD_SERVICE") = kLossdService;

  py::register_exception_translator([](std::exception_ptr pointer) {
    try {
      if (pointer) std::rethrow_exception(pointer);
    } catch (const StatusError& error) {
      py::object exception =
          py::module_::import("lossd._errors")
              .attr("error_from_code")(static_cast<int>(error.status().code()),
                                       std::string(error.status().message()));
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exception.ptr())),
                      exception.ptr());
    }
  });

  py::class_<TensorInfo>(m, "TensorInfo", "Metadata of a stored tensor.")
      .def_readonly("handle", &TensorInfo::handle)
      .def_property_readonly(
          "dtype",
          [](const TensorInfo& info) { return DTypeString(info.dtype); },
          "\"float32\", \"bf16\", \"float16\", \"int32\" or \"int64\"")
      .def_property_readonly("shape",
                             [](const TensorInfo& info) {
                               return py::tuple(py::cast(info.shape));
                             })
      .def_readonly("bytes", &TensorInfo::bytes)
      .def_readonly("device", &TensorInfo::device)
      .def_property_readonly(
          "state",
          [](const TensorInfo& info) { return TensorStateName(info.state); },
          "\"LOGITS\" or \"GRADIENT\"")
      .def_readonly("tenant", &TensorInfo::tenant)
      .def_readonly("label", &TensorInfo::label)
      .def_property_readonly(
          "created",
          [](const TensorInfo& info) { return TimeOrNone(info.created); },
          "seconds since the epoch, or None")
      .def_property_readonly(
          "last_used",
          [](const TensorInfo& info) { return TimeOrNone(info.last_used); },
          "seconds since the epoch, or None")
      .def_readonly("pending_scale", &TensorInfo::pending_scale)
      .def_readonly("pending_token_scale", &TensorInfo::pending_token_scale)
      .def("__repr__", &TensorInfoRepr);

  py::class_<ServerInfo>(m, "ServerInfo",
                         "Identity and memory of a server instance.")
      .def_readonly("instance_id", &ServerInfo::instance_id)
      .def_readonly("device", &ServerInfo::device)
      .def_readonly("budget_bytes", &ServerInfo::budget_bytes)
      .def_readonly("used_bytes", &ServerInfo::used_bytes)
      .def_readonly("free_bytes", &ServerInfo::free_bytes)
      .def_readonly("tensors", &ServerInfo::tensors)
      .def_readonly("version", &ServerInfo::version)
      .def_readonly("data_port", &ServerInfo::data_port)
      .def("__repr__", [](const ServerInfo& info) {
        return "ServerInfo(instance_id='" + info.instance_id + "', device='" +
               info.device +
               "', used_bytes=" + std::to_string(info.used_bytes) +
               ", budget_bytes=" + std::to_string(info.budget_bytes) +
               ", tensors=" + std::to_string(info.tensors) + ")";
      });

  py::class_<ListResult>(m, "ListResult",
                         "The caller's tensors and the instance's memory.")
      .def_readonly("tensors", &ListResult::tensors)
      .def_readonly("server", &ListResult::server);

  py::class_<ForwardResult>(m, "ForwardResult", "The result of Client.forward.")
      .def_readonly("loss", &ForwardResult::loss)
      .def_readonly("z_loss", &ForwardResult::z_loss)
      .def_readonly("valid_tokens", &ForwardResult::valid_tokens)
      .def_readonly("correct_tokens", &ForwardResult::correct_tokens)
      .def_readonly("nonfinite_rows", &ForwardResult::nonfinite_rows)
      .def_readonly("gradient", &ForwardResult::gradient,
                    "the gradient's handle (\"\" for mode=\"none\")")
      .def_property_readonly("token_loss",
                             [](const ForwardResult& r) -> py::object {
                               return r.token_loss.empty()
                                          ? py::none()
                                          : NumpyCopy(r.token_loss, "<f4");
                             })
      .def_property_readonly("token_lse",
                             [](const ForwardResult& r) -> py::object {
                               return r.token_lse.empty()
                                          ? py::none()
                                          : NumpyCopy(r.token_lse, "<f4");
                             })
      .def_property_readonly("token_argmax",
                             [](const ForwardResult& r) -> py::object {
                               return r.token_argmax.empty()
                                          ? py::none()
                                          : NumpyCopy(r.token_argmax, "<i4");
                             })
      .def_readonly("kernel_seconds", &ForwardResult::kernel_seconds)
      .def_readonly("denominator", &ForwardResult::denominator)
      .def("__repr__", [](const ForwardResult& r) {
        return "ForwardResult(loss=" + std::to_string(r.loss) +
               ", valid_tokens=" + std::to_string(r.valid_tokens) +
               ", correct_tokens=" + std::to_string(r.correct_tokens) +
               ", gradient='" + r.gradient + "')";
      });

  py::class_<LinearForwardResult>(m, "LinearForwardResult",
                                  "The result of Client.linear_forward.")
      .def_property_readonly(
          "loss", [](const LinearForwardResult& r) { return r.forward.loss; })
      .def_property_readonly(
          "z_loss",
          [](const LinearForwardResult& r) { return r.forward.z_loss; })
      .def_property_readonly(
          "valid_tokens",
          [](const LinearForwardResult& r) { return r.forward.valid_tokens; })
      .def_property_readonly(
          "correct_tokens",
          [](const LinearForwardResult& r) { return r.forward.correct_tokens; })
      .def_property_readonly(
          "nonfinite_rows",
          [](const LinearForwardResult& r) { return r.forward.nonfinite_rows; })
      .def_property_readonly(
          "gradient",
          [](const LinearForwardResult& r) { return r.forward.gradient; },
          "dX's handle (\"\" for mode=\"none\")")
      .def_property_readonly("token_loss",
                             [](const LinearForwardResult& r) -> py::object {
                               return r.forward.token_loss.empty()
                                          ? py::none()
                                          : NumpyCopy(r.forward.token_loss,
                                                      "<f4");
                             })
      .def_property_readonly("token_lse",
                             [](const LinearForwardResult& r) -> py::object {
                               return r.forward.token_lse.empty()
                                          ? py::none()
                                          : NumpyCopy(r.forward.token_lse,
                                                      "<f4");
                             })
      .def_property_readonly("token_argmax",
                             [](const LinearForwardResult& r) -> py::object {
                               return r.forward.token_argmax.empty()
                                          ? py::none()
                                          : NumpyCopy(r.forward.token_argmax,
                                                      "<i4");
                             })
      .def_property_readonly(
          "kernel_seconds",
          [](const LinearForwardResult& r) { return r.forward.kernel_seconds; })
      .def_property_readonly(
          "denominator",
          [](const LinearForwardResult& r) { return r.forward.denominator; })
      .def_readonly("weight_grad", &LinearForwardResult::weight_grad,
                    "the fp32 [V, H] weight-gradient accumulator's handle")
      .def_readonly("bias_grad", &LinearForwardResult::bias_grad,
                    "the fp32 [V] bias-gradient accumulator's handle (\"\" "
                    "without a bias)")
      .def("__repr__", [](const LinearForwardResult& r) {
        return "LinearForwardResult(loss=" + std::to_string(r.forward.loss) +
               ", valid_tokens=" + std::to_string(r.forward.valid_tokens) +
               ", gradient='" + r.forward.gradient + "', weight_grad='" +
               r.weight_grad + "')";
      });

  py::class_<BackwardResult>(m, "BackwardResult",
                             "The result of Client.backward.")
      .def_readonly("tensor", &BackwardResult::tensor)
      .def_readonly("kernel_launched", &BackwardResult::kernel_launched);

  py::class_<EvaluateResult>(m, "EvaluateResult",
                             "The result of Client.evaluate.")
      .def_readonly("loss", &EvaluateResult::loss)
      .def_readonly("z_loss", &EvaluateResult::z_loss)
      .def_readonly("rows", &EvaluateResult::rows)
      .def_readonly("valid_tokens", &EvaluateResult::valid_tokens)
      .def_readonly("correct_tokens", &EvaluateResult::correct_tokens)
      .def_readonly("nonfinite_rows", &EvaluateResult::nonfinite_rows)
      .def_readonly("denominator", &EvaluateResult::denominator);

  py::class_<PyClient>(m, "Client", py::dynamic_attr(), kClientDoc)
      .def(py::init([](const std::string& target, py::object token, bool tls,
                       py::object ca_file, py::object cert_file,
                       py::object key_file, py::object server_name,
                       py::object deadline, double connect_wait,
                       int upload_streams, bool data_connection,
                       int64_t stripe_min_bytes, int64_t chunk_bytes,
                       int64_t piece_bytes, int64_t max_message_bytes) {
             ClientOptions options;
             auto text = [](const py::object& value) {
               return value.is_none() ? std::string()
                                      : value.cast<std::string>();
             };
             options.bearer_token = text(token);
             options.tls = tls;
             options.tls_ca_file = text(ca_file);
             options.tls_cert_file = text(cert_file);
             options.tls_key_file = text(key_file);
             options.tls_server_name = text(server_name);
             if (!deadline.is_none())
               options.deadline = absl::Seconds(deadline.cast<double>());
             options.connect_wait = absl::Seconds(connect_wait);
             options.upload_streams = upload_streams;
             options.data_connection = data_connection;
             if (stripe_min_bytes < 0 || chunk_bytes < 0 || piece_bytes < 0) {
               ThrowInvalid("byte counts must not be negative");
             }
             options.stripe_min_bytes =
                 static_cast<std::size_t>(stripe_min_bytes);
             options.chunk_bytes = static_cast<std::size_t>(chunk_bytes);
             options.piece_bytes = static_cast<std::size_t>(piece_bytes);
             options.max_message_bytes = static_cast<int>(max_message_bytes);
             std::unique_ptr<Client> client =
                 ValueOrThrow(Client::Connect(target, std::move(options)));
             return std::make_unique<PyClient>(
                 target, std::shared_ptr<Client>(std::move(client)));
           }),
           kClientDoc, py::arg("target"), py::kw_only(),
           py::arg("token") = py::none(), py::arg("tls") = false,
           py::arg("ca_file") = py::none(), py::arg("cert_file") = py::none(),
           py::arg("key_file") = py::none(),
           py::arg("server_name") = py::none(),
           py::arg("deadline") = py::none(), py::arg("connect_wait") = 1.0,
           py::arg("upload_streams") = 4, py::arg("data_connection") = true,
           py::arg("stripe_min_bytes") = int64_t{64} << 20,
           py::arg("chunk_bytes") = int64_t{1} << 20,
           py::arg("piece_bytes") = int64_t{8} << 20,
           py::arg("max_message_bytes") = int64_t{64} << 20)
      .def_property_readonly("target", &PyClient::target)
      .def_property_readonly(
          "piece_bytes",
          [](const PyClient& self) {
            return self.Get()->options().piece_bytes;
          },
          "bytes of each scratch buffer and the most one upload_from / "
          "download_to call covers")
      .def_property_readonly("closed", &PyClient::closed)
      .def("__repr__",
           [](const PyClient& self) {
             return "lossd.Client('" + self.target() + "'" +
                    (self.closed() ? ", closed" : "") + ")";
           })
      .def("close", &PyClient::Close,
           "close()\n\nFrees the connections. Calls after it raise "
           "ValueError; a call running in another thread finishes first.")
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__",
           [](PyClient& self, py::args) {
             self.Close();
             return false;
           })
      .def("_add_close_hook", &PyClient::AddCloseHook,
           "_add_close_hook(hook)\n\nCalls hook() when the client closes, "
           "before its scratch buffers are freed.")
      .def("upload", &Upload, kUploadDoc, py::arg("data"), py::kw_only(),
           py::arg("dtype") = py::none(), py::arg("shape") = py::none(),
           py::arg("label") = "", py::arg("overwrite") = py::none())
      .def("upload_from", &UploadFrom, kUploadFromDoc, py::arg("source"),
           py::arg("dtype"), py::arg("shape"), py::kw_only(),
           py::arg("label") = "")
      .def("download", &Download, kDownloadDoc, py::arg("handle"),
           py::kw_only(), py::arg("dtype") = py::none(),
           py::arg("out") = py::none())
      .def("download_to", &DownloadTo, kDownloadToDoc, py::arg("handle"),
           py::arg("sink"), py::kw_only(), py::arg("dtype") = py::none(),
           py::arg("on_header") = py::none())
      .def("forward", &Forward, kForwardDoc, py::arg("logits"),
           py::arg("target"), py::kw_only(), py::arg("weight") = py::none(),
           py::arg("ignore_index") = -100, py::arg("label_smoothing") = 0.0,
           py::arg("reduction") = "mean", py::arg("z_loss_scale") = 0.0,
           py::arg("softcap") = 0.0, py::arg("normalizer") = 0.0,
           py::arg("grad_scale") = 1.0, py::arg("mode") = "in_place",
           py::arg("token_loss") = false, py::arg("token_lse") = false,
           py::arg("token_argmax") = false, py::arg("gradient_label") = "")
      .def("linear_forward", &LinearForward, kLinearForwardDoc,
           py::arg("hidden"), py::arg("weight"), py::arg("target"),
           py::kw_only(), py::arg("bias") = "", py::arg("weight_grad") = "",
           py::arg("bias_grad") = "", py::arg("accumulate") = py::none(),
           py::arg("class_weights") = py::none(),
           py::arg("ignore_index") = -100, py::arg("label_smoothing") = 0.0,
           py::arg("reduction") = "mean", py::arg("z_loss_scale") = 0.0,
           py::arg("softcap") = 0.0, py::arg("normalizer") = 0.0,
           py::arg("grad_scale") = 1.0, py::arg("mode") = "in_place",
           py::arg("token_loss") = false, py::arg("token_lse") = false,
           py::arg("token_argmax") = false,
           py::arg("token_grad_output") = py::none(),
           py::arg("gradient_label") = "", py::arg("weight_grad_label") = "",
           py::arg("bias_grad_label") = "")
      .def("backward", &Backward, kBackwardDoc, py::arg("handle"),
           py::arg("grad_output") = 1.0, py::kw_only(),
           py::arg("materialize") = false)
      .def("evaluate", &Evaluate, kEvaluateDoc, py::arg("logits"),
           py::arg("target"), py::kw_only(), py::arg("dtype") = py::none(),
           py::arg("weight") = py::none(), py::arg("ignore_index") = -100,
           py::arg("label_smoothing") = 0.0, py::arg("reduction") = "mean",
           py::arg("z_loss_scale") = 0.0, py::arg("softcap") = 0.0,
           py::arg("normalizer") = 0.0, py::arg("block_rows") = 0)
      .def(
          "describe",
          [](PyClient& self, const std::string& handle) {
            std::shared_ptr<Client> client = self.Get();
            return ValueOrThrow(
                WithoutGil([&] { return client->Describe(handle); }));
          },
          "describe(handle) -> TensorInfo\n\nMetadata of a stored tensor. "
          "Raises NotFound.",
          py::arg("handle"))
      .def(
          "list",
          [](PyClient& self) {
            std::shared_ptr<Client> client = self.Get();
            return ValueOrThrow(WithoutGil([&] { return client->List(); }));
          },
          "list() -> ListResult\n\nThe caller's tensors (.tensors) and the "
          "instance's memory "
          "(.server).")
      .def(
          "release",
          [](PyClient& self, const std::string& handle) {
            std::shared_ptr<Client> client = self.Get();
            return ValueOrThrow(
                WithoutGil([&] { return client->Release(handle); }));
          },
          "release(handle) -> int\n\nFrees a tensor; returns the bytes "
          "released. Raises "
          "NotFound.",
          py::arg("handle"))
      .def(
          "info",
          [](PyClient& self) {
            std::shared_ptr<Client> client = self.Get();
            return ValueOrThrow(
                WithoutGil([&] { return client->GetServerInfo(); }));
          },
          "info() -> ServerInfo\n\nIdentity and memory figures of the server "
          "instance.")
      .def(
          "health",
          [](PyClient& self, const std::string& service) {
            std::shared_ptr<Client> client = self.Get();
            return ValueOrThrow(
                WithoutGil([&] { return client->Health(service); }));
          },
          "health(service=\"\") -> bool\n\nStandard gRPC health check: \"\" "
          "asks about "
          "liveness, lossd.LOSSD_SERVICE about readiness. True when SERVING. "
          "Raises NotFound "
          "(unknown service), Unavailable (unreachable).",
          py::arg("service") = "");
}

}  // namespace lossd
