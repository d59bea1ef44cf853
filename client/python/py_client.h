// lossd.Client of the Python bindings: the object owning a lossd::Client and
// the methods that take Python buffers and callbacks, release the GIL while
// bytes move and raise lossd.Error subclasses.
#ifndef LOSSD_CLIENT_PYTHON_PY_CLIENT_H_
#define LOSSD_CLIENT_PYTHON_PY_CLIENT_H_

#include <Python.h>
#include <pybind11/pybind11.h>
// In every file of the module: without it, a std::vector or std::optional
// is cast as an opaque type, not a Python list or None.
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "client/client.h"

namespace py = pybind11;

namespace lossd {
namespace python {

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

// The methods of lossd.Client (their docstrings are in bindings.cc).
TensorInfo Upload(PyClient& self, py::handle data, py::handle dtype,
                  py::handle shape, const std::string& label,
                  const std::optional<std::string>& idempotency_key,
                  const std::optional<std::string>& overwrite);
TensorInfo UploadFrom(PyClient& self, const py::function& source,
                      py::handle dtype, const std::vector<int64_t>& shape,
                      const std::string& label,
                      const std::optional<std::string>& idempotency_key);
py::object Download(PyClient& self, const std::string& handle, py::handle dtype,
                    py::handle out);
TensorInfo DownloadTo(PyClient& self, const std::string& handle,
                      const py::function& sink, py::handle dtype,
                      py::handle on_header);
ForwardResult Forward(PyClient& self, py::handle logits, py::handle target,
                      py::handle weight, int64_t ignore_index,
                      double label_smoothing, const std::string& reduction,
                      double z_loss_scale, double softcap, double normalizer,
                      double grad_scale, const std::string& mode,
                      bool token_loss, bool token_lse, bool token_argmax,
                      const std::string& gradient_label);
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
    const std::string& precision);
BackwardResult Backward(PyClient& self, const std::string& handle,
                        py::handle grad_output, bool materialize);
EvaluateResult Evaluate(PyClient& self, py::handle logits, py::handle target,
                        py::handle dtype, py::handle weight,
                        int64_t ignore_index, double label_smoothing,
                        const std::string& reduction, double z_loss_scale,
                        double softcap, double normalizer, int64_t block_rows);
EvaluateResult LinearEvaluate(PyClient& self, py::handle hidden,
                              const std::string& weight, py::handle target,
                              const std::string& bias, py::handle dtype,
                              py::handle class_weights, int64_t ignore_index,
                              double label_smoothing,
                              const std::string& reduction, double z_loss_scale,
                              double softcap, double normalizer,
                              int64_t block_rows);

}  // namespace python
}  // namespace lossd

#endif  // LOSSD_CLIENT_PYTHON_PY_CLIENT_H_
