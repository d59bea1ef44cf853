// lossd._lossd: Python bindings of lossd::Client, so that Python shares the
// one client implementation. Buffers are used where they lie, and the GIL is
// released while bytes move, so that other Python threads keep running.
// The module's classes and docstrings are here; lossd.Client's methods are in
// py_client.cc, buffers in buffers.cc and error translation in errors.cc.
#include <Python.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "client/python/buffers.h"
#include "client/python/errors.h"
#include "client/python/py_client.h"

namespace py = pybind11;

namespace lossd {
namespace python {
namespace {

// A property's getter: the result's per-row array as a numpy copy, None when
// it was not asked for (empty).
template <typename Result, typename T>
auto ArrayOrNone(std::vector<T> Result::*member, const char* dtype) {
  return [member, dtype](const Result& r) {
    return NumpyCopyOrNone(r.*member, dtype);
  };
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
       chunk_bytes=1 MiB, piece_bytes=8 MiB, max_message_bytes=64 MiB,
       check_server_features=True)

target: "host:port" (or any gRPC target URI). Does not contact the server
(use health()). token: sent as "authorization: Bearer TOKEN". tls / ca_file /
cert_file / key_file / server_name: TLS (any file implies tls), mutual TLS
with cert_file and key_file. deadline: seconds per call (None = none).
connect_wait: seconds a call waits for the connection to come up.
Tensors of at least stripe_min_bytes go over upload_streams plain TCP data
connections when the server offers them (data_connection, no TLS), else as
that many gRPC stripes. piece_bytes: the most bytes one upload_from source or
download_to sink call covers, and the size of the client's scratch buffers.
A call with a post-training loss (distillation, policy, segments) first
checks, once per Client, that the server lists 'post_training' in
info().features, and raises lossd.FailedPrecondition before sending anything
when it does not (an older server would answer plain cross entropy);
check_server_features=False skips that check.

Every method releases the GIL while it waits on the server, and raises a
lossd.Error subclass (lossd.NotFound, lossd.FailedPrecondition, ...) carrying
the gRPC code and message. Methods may be called from several threads.
Usable as a context manager (close() on exit).)doc";

constexpr char kUploadDoc[] =
    R"doc(upload(data, *, dtype=None, shape=None, label="", idempotency_key=None, overwrite=None) -> TensorInfo

Stores a tensor on the server and returns its TensorInfo (.handle names it).
data: any C-contiguous buffer (numpy array, memoryview, bytes) or CPU
torch.Tensor; its memory is sent as it lies, without a copy. dtype: "float32",
"bf16", "float16", "int32", "int64" (or a numpy/torch dtype); default from
the buffer (a torch.bfloat16 tensor is bf16; bf16 in a numpy uint16/int16
array needs dtype="bf16"). shape: default the buffer's ([N, V] logits,
[N] targets, [V] weights). idempotency_key: names the upload (1-128 chars of
[A-Za-z0-9_-], per tenant; None = none): an upload retried with the same key
after an error whose outcome was unknown (DeadlineExceeded, Unavailable)
returns the tensor the first attempt stored, if it did, instead of storing
a second one.

overwrite: a handle whose contents the data replaces in place (same dtype
and shape; the handle, its memory and label stay; its state becomes LOGITS),
e.g. a weight after an optimizer step, sent as an upload of its size goes
(data connections or stripes from stripe_min_bytes on). It takes no
idempotency_key: sending it again is harmless.

Raises InvalidArgument (dtype, shape, byte count or key), ResourceExhausted
(over the memory budget or a quota), AlreadyExists (the key names a stored
tensor of another dtype, shape or label), Aborted (an upload with the key is
in flight), Unavailable, ... On any error nothing stays (overwrite: NotFound,
InvalidArgument for another dtype or shape, FailedPrecondition while the
tensor is in use).)doc";

constexpr char kLinearForwardDoc[] =
    R"doc(linear_forward(hidden, weight, target, *, bias="", weight_grad="", bias_grad="", accumulate=None, class_weights=None, ignore_index=-100, label_smoothing=0.0, reduction="mean", z_loss_scale=0.0, softcap=0.0, normalizer=0.0, grad_scale=1.0, mode="in_place", token_loss=False, token_lse=False, token_argmax=False, token_grad_output=None, gradient_label="", weight_grad_label="", bias_grad_label="", precision="exact", **post_training) -> LinearForwardResult

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
precision: "exact" (dW within ~3e-5 of fp32) or "fast" (on a CUDA server with
bf16/fp16 inputs, the three products in 16 bits as the peers compute them:
a ~1.1x faster kernel, dW 2e-4 to 2e-3 relative error on mild logits, 2e-2 on
peaked ones); fp32 and the CPU compute the same.
post_training: forward()'s post-training keywords (teacher, temperature,
alpha, divergence, beta, top_k_tail, policy_loss, advantages, old_logprobs,
ref_logprobs, epsilon_low, epsilon_high, kl_coef, kl_estimator, segments,
num_segments, segment_reduction, token_logprob, token_entropy, token_ratio)
put that loss on the logits instead of cross entropy (target may be None for
a distillation with alpha 0); result.forward carries its fields.

Raises NotFound, InvalidArgument (shapes, dtypes, options, one tensor in two
roles, a precision other than "exact" or "fast"), FailedPrecondition (hidden holds a gradient, a tensor in use),
ResourceExhausted. On any error nothing changes.)doc";

constexpr char kUploadFromDoc[] =
    R"doc(upload_from(source, dtype, shape, *, label="", idempotency_key=None) -> TensorInfo

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
and the exception is raised here. idempotency_key and other errors as
upload().)doc";

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
        token_argmax=False, gradient_label="", teacher=None, temperature=1.0,
        alpha=0.0, divergence="forward_kl", beta=0.5, top_k_tail="renormalize",
        policy_loss=None, advantages=None, old_logprobs=None, ref_logprobs=None,
        epsilon_low=0.2, epsilon_high=None, kl_coef=0.0, kl_estimator="k3",
        segments=None, num_segments=0, segment_reduction=None,
        token_logprob=False, token_entropy=False, token_ratio=False)
        -> ForwardResult

Cross entropy of stored logits [N, V], with the semantics of
torch.nn.functional.cross_entropy (and lossd's z-loss, softcap, normalizer
and grad_scale). logits: a handle (or a buffer, uploaded first; then
.gradient names it). target: a handle of int32/int64 [N], or an int32/int64
buffer sent inline. weight: class weights, a handle of float32 [V] or a
buffer uploaded for this call. mode: "in_place" (the gradient overwrites the
logits; .gradient is the logits handle, now a GRADIENT), "out_of_place" (a
new gradient tensor) or "none" (loss only; the logits stay). token_loss,
token_lse, token_argmax: per-row outputs as numpy arrays.

Post-training losses (docs/api.md, "Post-training losses"); handles or
buffers for each tensor (buffers go inline in the request, which must stay
below max_message_bytes: upload larger ones and pass their handles):
- distillation: teacher = a handle of stored teacher logits [N, V], or a pair
  (indices [N, k] int32/int64, logprobs [N, k] float32) of a top-k teacher;
  temperature, alpha (weight of the cross entropy against target; with 0,
  target may be None), divergence ("forward_kl", "reverse_kl", "jsd"), beta
  (jsd: the teacher's weight in the mixture, as TRL and Liger),
  top_k_tail ("renormalize" or "bucket").
- policy: policy_loss ("importance_sampling", "ppo", "cispo") on the sampled
  tokens `target`, with advantages and old_logprobs (the sampling policy's)
  float32 [N], epsilon_low, epsilon_high (None = epsilon_low), and
  ref_logprobs, kl_coef, kl_estimator ("k1", "k2", "k3") for a KL penalty.
- segments: int32/int64 [N] segment ids of packed sequences, num_segments
  (0 = max id + 1), segment_reduction (None, "seq_mean_token_mean",
  "seq_mean_token_sum").
Results: .distillation_loss, .policy_stats, .segment_loss and
.segment_tokens, and with token_logprob / token_entropy those per row;
token_ratio=True adds the policy's .token_ratio (r) and .token_clipped
(bool) per row (0 / False for ignored rows).

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
         normalizer=0.0, block_rows=0, teacher=None, temperature=1.0, alpha=0.0,
         divergence="forward_kl", beta=0.5, top_k_tail="renormalize",
         segments=None, num_segments=0, segment_reduction=None,
         policy_loss=None, advantages=None, old_logprobs=None,
         ref_logprobs=None, epsilon_low=0.2, epsilon_high=None, kl_coef=0.0,
         kl_estimator="k3") -> EvaluateResult

Loss only of logits [N, V] and target [N] in host memory, streamed through
the server in row blocks (over data connections when large); nothing is
stored. dtype as for upload() (bf16 from uint16 needs dtype="bf16").
reduction: "mean" or "sum". block_rows: rows per block (0 = about 1 MiB).
Distillation metrics, policy-loss metrics and per-segment sums as forward()
takes them, the teacher (logits [N, V], or a pair (indices, logprobs)
[N, k]), the policy's advantages, old_logprobs and ref_logprobs (float32
[N]) and segment ids in host memory: they go in the blocks beside the rows
(over data connections when large, as the rows do). target=None with
alpha=0 sends no targets. Results add .distillation_loss, .policy_stats,
.segment_loss, .segment_tokens.)doc";

constexpr char kLinearEvaluateDoc[] =
    R"doc(linear_evaluate(hidden, weight, target, *, bias="", dtype=None, class_weights=None, ignore_index=-100, label_smoothing=0.0, reduction="mean", z_loss_scale=0.0, softcap=0.0, normalizer=0.0, block_rows=0, **post_training) -> EvaluateResult

evaluate() of hidden states: hidden [N, H] and target [N] in host memory
stream through the server in row blocks against the stored LM head `weight`
[V, H] (a handle; `bias` a [V] handle), whose logits never leave the server:
the loss linear_forward(..., mode="none") gives, from a client without a
GPU, sending H instead of V values a row; nothing is stored. hidden must
have the weight's dtype (bf16 from uint16 needs dtype="bf16").
class_weights: fp32 [V] (array or handle), as evaluate()'s `weight`.
**post_training: evaluate()'s distillation, policy and segment keywords
(teacher, temperature, alpha, divergence, beta, top_k_tail, policy_loss,
advantages, old_logprobs, ref_logprobs, epsilon_low, epsilon_high, kl_coef,
kl_estimator, segments, num_segments, segment_reduction), their rows in
host memory, sent in the blocks beside the hidden states.
Raises NotFound (weight, bias), InvalidArgument (shapes, dtypes, options),
FailedPrecondition (the weight being overwritten).)doc";

}  // namespace

// In namespace lossd::python for the names above; PyInit__lossd has C linkage.
PYBIND11_MODULE(_lossd, m) {
  m.doc() = "Bindings of lossd::Client; use the lossd package.";
  // Each docstring starts with the signature as Python callers write it;
  // pybind11's generated one would show C++ parameter types instead.
  py::options options;
  options.disable_function_signatures();
  m.attr("LOSSD_SERVICE") = kLossdService;

  RegisterStatusTranslator();

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
      .def_readonly("features", &ServerInfo::features,
                    "what the server serves beyond the first protocol "
                    "('post_training', ...); empty from an older server")
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

  py::class_<PolicyStats>(m, "PolicyStats",
                          "A policy-gradient step's metrics, sums over the "
                          "valid tokens (divide by valid_tokens).")
      .def_readonly("clipped_tokens", &PolicyStats::clipped_tokens)
      .def_readonly("ratio_sum", &PolicyStats::ratio_sum)
      .def_readonly("approx_kl_sum", &PolicyStats::approx_kl_sum)
      .def_readonly("kl_sum", &PolicyStats::kl_sum)
      .def_readonly("entropy_sum", &PolicyStats::entropy_sum);

  py::class_<ForwardResult>(m, "ForwardResult", "The result of Client.forward.")
      .def_readonly("loss", &ForwardResult::loss)
      .def_readonly("z_loss", &ForwardResult::z_loss)
      .def_readonly("valid_tokens", &ForwardResult::valid_tokens)
      .def_readonly("correct_tokens", &ForwardResult::correct_tokens)
      .def_readonly("nonfinite_rows", &ForwardResult::nonfinite_rows)
      .def_readonly("gradient", &ForwardResult::gradient,
                    "the gradient's handle (\"\" for mode=\"none\")")
      .def_property_readonly("token_loss",
                             ArrayOrNone(&ForwardResult::token_loss, "<f4"))
      .def_property_readonly("token_lse",
                             ArrayOrNone(&ForwardResult::token_lse, "<f4"))
      .def_property_readonly("token_argmax",
                             ArrayOrNone(&ForwardResult::token_argmax, "<i4"))
      .def_readonly("kernel_seconds", &ForwardResult::kernel_seconds)
      .def_readonly("denominator", &ForwardResult::denominator)
      .def_readonly("distillation_loss", &ForwardResult::distillation_loss)
      .def_readonly("policy_stats", &ForwardResult::policy_stats)
      .def_property_readonly("segment_loss",
                             ArrayOrNone(&ForwardResult::segment_loss, "<f8"))
      .def_property_readonly("segment_tokens",
                             ArrayOrNone(&ForwardResult::segment_tokens, "<i8"))
      .def_property_readonly("token_logprob",
                             ArrayOrNone(&ForwardResult::token_logprob, "<f4"))
      .def_property_readonly("token_entropy",
                             ArrayOrNone(&ForwardResult::token_entropy, "<f4"))
      .def_property_readonly("token_ratio",
                             ArrayOrNone(&ForwardResult::token_ratio, "<f4"))
      .def_property_readonly("token_clipped",
                             [](const ForwardResult& r) -> py::object {
                               if (r.token_clipped.empty()) return py::none();
                               const std::vector<uint8_t> flags(
                                   r.token_clipped.begin(),
                                   r.token_clipped.end());
                               return NumpyCopy(flags, "|b1");
                             })
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
                             [](const LinearForwardResult& r) {
                               return NumpyCopyOrNone(r.forward.token_loss,
                                                      "<f4");
                             })
      .def_property_readonly("token_lse",
                             [](const LinearForwardResult& r) {
                               return NumpyCopyOrNone(r.forward.token_lse,
                                                      "<f4");
                             })
      .def_property_readonly("token_argmax",
                             [](const LinearForwardResult& r) {
                               return NumpyCopyOrNone(r.forward.token_argmax,
                                                      "<i4");
                             })
      .def_property_readonly(
          "kernel_seconds",
          [](const LinearForwardResult& r) { return r.forward.kernel_seconds; })
      .def_property_readonly(
          "denominator",
          [](const LinearForwardResult& r) { return r.forward.denominator; })
      .def_property_readonly(
          "forward", [](const LinearForwardResult& r) { return r.forward; },
          "the loss's ForwardResult (with a post-training loss, its fields "
          "too)")
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
      .def_readonly("denominator", &EvaluateResult::denominator)
      .def_readonly("distillation_loss", &EvaluateResult::distillation_loss)
      .def_readonly("policy_stats", &EvaluateResult::policy_stats)
      .def_property_readonly("segment_loss",
                             ArrayOrNone(&EvaluateResult::segment_loss, "<f8"))
      .def_property_readonly(
          "segment_tokens",
          ArrayOrNone(&EvaluateResult::segment_tokens, "<i8"));

  py::class_<PyClient>(m, "Client", py::dynamic_attr(), kClientDoc)
      .def(py::init([](const std::string& target, py::object token, bool tls,
                       py::object ca_file, py::object cert_file,
                       py::object key_file, py::object server_name,
                       py::object deadline, double connect_wait,
                       int upload_streams, bool data_connection,
                       int64_t stripe_min_bytes, int64_t chunk_bytes,
                       int64_t piece_bytes, int64_t max_message_bytes,
                       bool check_server_features) {
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
             options.check_server_features = check_server_features;
             CheckGrpcUsableHere();
             std::unique_ptr<Client> client =
                 ValueOrThrow(Client::Connect(target, std::move(options)));
             NoteGrpcUsed();
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
           py::arg("max_message_bytes") = int64_t{64} << 20,
           py::arg("check_server_features") = true)
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
           py::arg("label") = "", py::arg("idempotency_key") = py::none(),
           py::arg("overwrite") = py::none())
      .def("upload_from", &UploadFrom, kUploadFromDoc, py::arg("source"),
           py::arg("dtype"), py::arg("shape"), py::kw_only(),
           py::arg("label") = "", py::arg("idempotency_key") = py::none())
      .def("download", &Download, kDownloadDoc, py::arg("handle"),
           py::kw_only(), py::arg("dtype") = py::none(),
           py::arg("out") = py::none())
      .def("download_to", &DownloadTo, kDownloadToDoc, py::arg("handle"),
           py::arg("sink"), py::kw_only(), py::arg("dtype") = py::none(),
           py::arg("on_header") = py::none())
      .def(
          "forward",
          [](PyClient& self, py::handle logits, py::handle target,
             py::handle weight, int64_t ignore_index, double label_smoothing,
             const std::string& reduction, double z_loss_scale, double softcap,
             double normalizer, double grad_scale, const std::string& mode,
             bool token_loss, bool token_lse, bool token_argmax,
             const std::string& gradient_label, py::object teacher,
             double temperature, double alpha, const std::string& divergence,
             double beta, const std::string& top_k_tail, py::object policy_loss,
             py::object advantages, py::object old_logprobs,
             py::object ref_logprobs, double epsilon_low,
             py::object epsilon_high, double kl_coef,
             const std::string& kl_estimator, py::object segments,
             int64_t num_segments, py::object segment_reduction,
             bool token_logprob, bool token_entropy, bool token_ratio) {
            PostTrainingKwargs post_training;
            post_training.teacher = std::move(teacher);
            post_training.temperature = temperature;
            post_training.alpha = alpha;
            post_training.divergence = divergence;
            post_training.beta = beta;
            post_training.top_k_tail = top_k_tail;
            post_training.policy_loss = std::move(policy_loss);
            post_training.advantages = std::move(advantages);
            post_training.old_logprobs = std::move(old_logprobs);
            post_training.ref_logprobs = std::move(ref_logprobs);
            post_training.epsilon_low = epsilon_low;
            post_training.epsilon_high = std::move(epsilon_high);
            post_training.kl_coef = kl_coef;
            post_training.kl_estimator = kl_estimator;
            post_training.segments = std::move(segments);
            post_training.num_segments = num_segments;
            post_training.segment_reduction = std::move(segment_reduction);
            post_training.token_logprob = token_logprob;
            post_training.token_entropy = token_entropy;
            post_training.token_ratio = token_ratio;
            return Forward(self, logits, target, weight, ignore_index,
                           label_smoothing, reduction, z_loss_scale, softcap,
                           normalizer, grad_scale, mode, token_loss, token_lse,
                           token_argmax, gradient_label, post_training);
          },
          kForwardDoc, py::arg("logits"), py::arg("target"), py::kw_only(),
          py::arg("weight") = py::none(), py::arg("ignore_index") = -100,
          py::arg("label_smoothing") = 0.0, py::arg("reduction") = "mean",
          py::arg("z_loss_scale") = 0.0, py::arg("softcap") = 0.0,
          py::arg("normalizer") = 0.0, py::arg("grad_scale") = 1.0,
          py::arg("mode") = "in_place", py::arg("token_loss") = false,
          py::arg("token_lse") = false, py::arg("token_argmax") = false,
          py::arg("gradient_label") = "", py::arg("teacher") = py::none(),
          py::arg("temperature") = 1.0, py::arg("alpha") = 0.0,
          py::arg("divergence") = "forward_kl", py::arg("beta") = 0.5,
          py::arg("top_k_tail") = "renormalize",
          py::arg("policy_loss") = py::none(),
          py::arg("advantages") = py::none(),
          py::arg("old_logprobs") = py::none(),
          py::arg("ref_logprobs") = py::none(), py::arg("epsilon_low") = 0.2,
          py::arg("epsilon_high") = py::none(), py::arg("kl_coef") = 0.0,
          py::arg("kl_estimator") = "k3", py::arg("segments") = py::none(),
          py::arg("num_segments") = 0,
          py::arg("segment_reduction") = py::none(),
          py::arg("token_logprob") = false, py::arg("token_entropy") = false,
          py::arg("token_ratio") = false)
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
           py::arg("bias_grad_label") = "", py::arg("precision") = "exact")
      .def("backward", &Backward, kBackwardDoc, py::arg("handle"),
           py::arg("grad_output") = 1.0, py::kw_only(),
           py::arg("materialize") = false)
      .def(
          "evaluate",
          [](PyClient& self, py::handle logits, py::handle target,
             py::handle dtype, py::handle weight, int64_t ignore_index,
             double label_smoothing, const std::string& reduction,
             double z_loss_scale, double softcap, double normalizer,
             int64_t block_rows, py::object teacher, double temperature,
             double alpha, const std::string& divergence, double beta,
             const std::string& top_k_tail, py::object segments,
             int64_t num_segments, py::object segment_reduction,
             py::object policy_loss, py::object advantages,
             py::object old_logprobs, py::object ref_logprobs,
             double epsilon_low, py::object epsilon_high, double kl_coef,
             const std::string& kl_estimator) {
            PostTrainingKwargs post_training;
            post_training.policy_loss = std::move(policy_loss);
            post_training.advantages = std::move(advantages);
            post_training.old_logprobs = std::move(old_logprobs);
            post_training.ref_logprobs = std::move(ref_logprobs);
            post_training.epsilon_low = epsilon_low;
            post_training.epsilon_high = std::move(epsilon_high);
            post_training.kl_coef = kl_coef;
            post_training.kl_estimator = kl_estimator;
            post_training.teacher = std::move(teacher);
            post_training.temperature = temperature;
            post_training.alpha = alpha;
            post_training.divergence = divergence;
            post_training.beta = beta;
            post_training.top_k_tail = top_k_tail;
            post_training.segments = std::move(segments);
            post_training.num_segments = num_segments;
            post_training.segment_reduction = std::move(segment_reduction);
            return Evaluate(self, logits, target, dtype, weight, ignore_index,
                            label_smoothing, reduction, z_loss_scale, softcap,
                            normalizer, block_rows, post_training);
          },
          kEvaluateDoc, py::arg("logits"), py::arg("target"), py::kw_only(),
          py::arg("dtype") = py::none(), py::arg("weight") = py::none(),
          py::arg("ignore_index") = -100, py::arg("label_smoothing") = 0.0,
          py::arg("reduction") = "mean", py::arg("z_loss_scale") = 0.0,
          py::arg("softcap") = 0.0, py::arg("normalizer") = 0.0,
          py::arg("block_rows") = 0, py::arg("teacher") = py::none(),
          py::arg("temperature") = 1.0, py::arg("alpha") = 0.0,
          py::arg("divergence") = "forward_kl", py::arg("beta") = 0.5,
          py::arg("top_k_tail") = "renormalize",
          py::arg("segments") = py::none(), py::arg("num_segments") = 0,
          py::arg("segment_reduction") = py::none(),
          py::arg("policy_loss") = py::none(),
          py::arg("advantages") = py::none(),
          py::arg("old_logprobs") = py::none(),
          py::arg("ref_logprobs") = py::none(), py::arg("epsilon_low") = 0.2,
          py::arg("epsilon_high") = py::none(), py::arg("kl_coef") = 0.0,
          py::arg("kl_estimator") = "k3")
      .def("linear_evaluate", &LinearEvaluate, kLinearEvaluateDoc,
           py::arg("hidden"), py::arg("weight"), py::arg("target"),
           py::kw_only(), py::arg("bias") = "", py::arg("dtype") = py::none(),
           py::arg("class_weights") = py::none(),
           py::arg("ignore_index") = -100, py::arg("label_smoothing") = 0.0,
           py::arg("reduction") = "mean", py::arg("z_loss_scale") = 0.0,
           py::arg("softcap") = 0.0, py::arg("normalizer") = 0.0,
           py::arg("block_rows") = 0)
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
          [](PyClient& self, int page_size) {
            std::shared_ptr<Client> client = self.Get();
            return ValueOrThrow(
                WithoutGil([&] { return client->List(page_size); }));
          },
          "list(page_size=1000) -> ListResult\n\nAll the caller's tensors "
          "(.tensors, oldest first) and the instance's memory (.server), "
          "fetched page_size tensors per RPC. Raises InvalidArgument for "
          "page_size <= 0.",
          py::arg("page_size") = kListPageSize)
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
          "require_post_training",
          [](PyClient& self, const std::string& call) {
            std::shared_ptr<Client> client = self.Get();
            ThrowIfError(
                WithoutGil([&] { return client->RequirePostTraining(call); }));
          },
          "require_post_training(call='') -> None\n\nRaises "
          "FailedPrecondition when the server does not serve the "
          "post-training losses (info().features lacks 'post_training'; "
          "asked once per Client), naming `call`; forward, linear_forward "
          "and evaluate check it themselves before sending one. lossd.torch "
          "calls it before uploading the logits.",
          py::arg("call") = "")
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

}  // namespace python
}  // namespace lossd
