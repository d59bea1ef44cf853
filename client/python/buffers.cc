// The Python bindings' buffers (see buffers.h).
#include "client/python/buffers.h"

#include <utility>

#include "client/python/errors.h"
#include "common/dtype.h"

namespace py = pybind11;

namespace lossd {
namespace python {

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

int64_t Elements(const std::vector<int64_t>& shape) {
  int64_t elements = 1;
  for (int64_t dim : shape) elements *= dim;
  return elements;
}

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

const char* NumpyDType(DType dtype) {
  const char* typestr = DTypeNumpyTypestr(dtype);
  if (typestr == nullptr) {
    ThrowInvalid("no numpy dtype for " + std::string(DTypeString(dtype)));
  }
  return typestr;
}

py::object TimeOrNone(absl::Time time) {
  if (time == absl::InfinitePast() || time == absl::InfiniteFuture())
    return py::none();
  return py::float_(absl::ToDoubleSeconds(time - absl::UnixEpoch()));
}

}  // namespace python
}  // namespace lossd
