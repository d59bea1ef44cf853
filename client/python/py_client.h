// lossd.Client of the Python bindings: the object owning a lossd::Client and
// the methods that take Python buffers and callbacks, release the GIL while
// bytes move and raise lossd.Error subclasses.
#ifndef LOSSD_CLIENT_PYTHON_PY_CLIENT_H_
#define LOSSD_CLIENT_PYTHON_PY_CLIENT_H_

#include <Python.h>
#include <pybind11/pybind11.h>
#include <unistd.h>
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
//
// A client belongs to the process that made it. After fork() the child has
// the parent's gRPC channel and data connections without the threads that
// serve them, and a call there could wait forever; so a call in another
// process raises lossd.ForkedClient at once, and the child's copy is never
// freed (freeing it would shut down the parent's channel from a process
// without its threads).
class PyClient {
 public:
  PyClient(std::string target, std::shared_ptr<Client> client)
      : target_(std::move(target)),
        client_(std::move(client)),
        owner_pid_(getpid()) {}
  ~PyClient() { Close(); }

  const std::string& target() const { return target_; }
  bool closed() const { return !client_; }

  std::shared_ptr<Client> Get() const {
    if (!client_) throw py::value_error("the lossd.Client is closed");
    if (getpid() != owner_pid_) ThrowForked();
    return client_;
  }

  // Runs the close hooks (lossd.torch unregisters the scratch buffers from
  // CUDA there, which must happen before they are freed), then drops the
  // client.
  void Close() {
    if (!client_) return;
    if (getpid() != owner_pid_) {
      // The inherited copy in a child of fork(): left allocated on purpose
      // (see the class comment); the close hooks belong to the parent too.
      new std::shared_ptr<Client>(std::move(client_));
      close_hooks_.clear();
      return;
    }
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
  [[noreturn]] void ThrowForked() const;

  const std::string target_;
  std::shared_ptr<Client> client_;
  const pid_t owner_pid_;
  std::vector<py::object> close_hooks_;
};

// gRPC's process-wide state (its threads and pollers, started by the first
// channel) does not survive fork(): in the child a new channel can wait
// forever. gRPC's own fork handlers (GRPC_ENABLE_FORK_SUPPORT) were tried and
// hung the child now and then (1 run in 3 under ctest), so they are not
// used: a client made in a child of fork() after gRPC had started in an
// ancestor raises lossd.ForkedClient instead. A child forked before the
// parent's first client is free to make its own. All of these run with the
// GIL held, which orders them.
void CheckGrpcUsableHere();  // before a client connects
void NoteGrpcUsed();         // after it connected
[[noreturn]] void ThrowForkedClient(const std::string& message);

// The post-training keyword arguments of lossd.Client.forward and evaluate
// (docs/api.md, "Post-training losses"; bindings.cc documents each).
struct PostTrainingKwargs {
  py::object teacher = py::none();  // handle / array, or (indices, logprobs)
  double temperature = 1.0;
  double alpha = 0.0;
  std::string divergence = "forward_kl";
  double beta = 0.5;
  std::string top_k_tail = "renormalize";
  py::object policy_loss =
      py::none();  // "importance_sampling" | "ppo" | "cispo"
  py::object advantages = py::none();
  py::object old_logprobs = py::none();
  py::object ref_logprobs = py::none();
  double epsilon_low = 0.2;
  py::object epsilon_high = py::none();
  double kl_coef = 0.0;
  std::string kl_estimator = "k3";
  py::object segments = py::none();
  int64_t num_segments = 0;
  py::object segment_reduction = py::none();
  bool token_logprob = false;
  bool token_entropy = false;
  bool token_ratio = false;  // and token_clipped
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
                      const std::string& gradient_label,
                      const PostTrainingKwargs& post_training);
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
    const std::string& precision, const py::kwargs& post_training);
BackwardResult Backward(PyClient& self, const std::string& handle,
                        py::handle grad_output, bool materialize);
EvaluateResult Evaluate(PyClient& self, py::handle logits, py::handle target,
                        py::handle dtype, py::handle weight,
                        int64_t ignore_index, double label_smoothing,
                        const std::string& reduction, double z_loss_scale,
                        double softcap, double normalizer, int64_t block_rows,
                        const PostTrainingKwargs& post_training);
EvaluateResult LinearEvaluate(PyClient& self, py::handle hidden,
                              const std::string& weight, py::handle target,
                              const std::string& bias, py::handle dtype,
                              py::handle class_weights, int64_t ignore_index,
                              double label_smoothing,
                              const std::string& reduction, double z_loss_scale,
                              double softcap, double normalizer,
                              int64_t block_rows,
                              const py::kwargs& post_training_kwargs);

}  // namespace python
}  // namespace lossd

#endif  // LOSSD_CLIENT_PYTHON_PY_CLIENT_H_
