// The Python bindings' errors: a non-OK absl::Status thrown as StatusError and
// raised in Python as the lossd.Error subclass of its code, and the Python
// exceptions of callbacks carried across a transfer's threads.
#ifndef LOSSD_CLIENT_PYTHON_ERRORS_H_
#define LOSSD_CLIENT_PYTHON_ERRORS_H_

#include <Python.h>
#include <pybind11/pybind11.h>
// In every file of the module: without it, a std::vector or std::optional
// is cast as an opaque type, not a Python list or None.
#include <pybind11/stl.h>

#include <exception>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace py = pybind11;

namespace lossd {
namespace python {

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

// Throws a StatusError for a non-OK status.
void ThrowIfError(const absl::Status& status);

template <typename T>
T ValueOrThrow(absl::StatusOr<T> value) {
  ThrowIfError(value.status());
  return *std::move(value);
}

// Throws a StatusError of INVALID_ARGUMENT with `message`.
[[noreturn]] void ThrowInvalid(const std::string& message);

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

// Registers the translator that raises a StatusError in Python as the
// lossd.Error subclass (lossd._errors) of its code.
void RegisterStatusTranslator();

}  // namespace python
}  // namespace lossd

#endif  // LOSSD_CLIENT_PYTHON_ERRORS_H_
