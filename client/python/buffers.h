// The Python bindings' buffers: views of Python buffers (numpy, torch,
// memoryview, bytes) used where they lie, what dtype and shape they are sent
// as, and numpy arrays and memoryviews of what lossd returns.
#ifndef LOSSD_CLIENT_PYTHON_BUFFERS_H_
#define LOSSD_CLIENT_PYTHON_BUFFERS_H_

#include <Python.h>
#include <pybind11/pybind11.h>
// In every file of the module: without it, a std::vector or std::optional
// is cast as an opaque type, not a Python list or None.
#include <pybind11/stl.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "client/client.h"
#include "client/python/errors.h"

namespace py = pybind11;

namespace lossd {
namespace python {

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
DType ParseDType(py::handle dtype);

// An object to take a buffer from: the object itself when it exports one;
// a CPU torch.Tensor as its numpy view (bf16 as an int16 view, reported in
// *implied_dtype); other array-likes through numpy.asarray, which does not
// copy objects with __array_interface__.
py::object AsBufferObject(py::handle object, DType* implied_dtype);

// A buffer and the dtype and shape it is sent as.
struct Tensor {
  py::object owner;  // keeps a converted object alive while the view is held
  std::unique_ptr<Buffer> buffer;
  DType dtype = DType::kInvalid;
  std::vector<int64_t> shape;
};

// The number of elements of `shape`.
int64_t Elements(const std::vector<int64_t>& shape);

// dtype: explicit > implied by a torch bf16 tensor > the buffer's format.
// shape: explicit > the buffer's when its items have the dtype's size >
// one dimension of all the bytes.
Tensor TensorFromObject(py::handle object, py::handle dtype, py::handle shape,
                        const char* what);

// The numpy dtype a tensor of `dtype` downloads into; bf16 has none in numpy,
// so its bits arrive as uint16.
const char* NumpyDType(DType dtype);

// Seconds since the Unix epoch, or None for an unset time.
py::object TimeOrNone(absl::Time time);

// A new numpy array of `dtype` holding a copy of `values`.
template <typename T>
py::object NumpyCopy(const std::vector<T>& values, const char* dtype) {
  py::object array =
      py::module_::import("numpy").attr("empty")(values.size(), dtype);
  Buffer buffer(array, /*writable=*/true);
  if (!values.empty())
    std::memcpy(buffer.data(), values.data(), values.size() * sizeof(T));
  return array;
}

// NumpyCopy, or None for an empty vector (a per-row output not asked for).
template <typename T>
py::object NumpyCopyOrNone(const std::vector<T>& values, const char* dtype) {
  return values.empty() ? py::none() : NumpyCopy(values, dtype);
}

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

}  // namespace python
}  // namespace lossd

#endif  // LOSSD_CLIENT_PYTHON_BUFFERS_H_
