// The Python bindings' error translation (see errors.h).
#include "client/python/errors.h"

#include <string>

namespace py = pybind11;

namespace lossd {
namespace python {

void ThrowIfError(const absl::Status& status) {
  if (!status.ok()) throw StatusError(status);
}

[[noreturn]] void ThrowInvalid(const std::string& message) {
  throw StatusError(absl::InvalidArgumentError(message));
}

void RegisterStatusTranslator() {
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
}

}  // namespace python
}  // namespace lossd
