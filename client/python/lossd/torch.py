"""lossd.torch: torch.nn.functional.cross_entropy computed by a lossd server, as an autograd
function, so that a training loop swaps one call and keeps its loss.backward().

The logits go to the server once; Forward writes the gradient over them there, in place, and
loss.backward() fetches it (with the incoming grad_output applied by the server) into a gradient
tensor of the logits' dtype on the logits' device. Host memory: CPU logits are sent from, and
their gradient received into, the tensors themselves; CUDA tensors move through the client's few
scratch buffers (kept for the client's life and registered with CUDA once, so the device copies
are direct DMA), the next piece's copy overlapping the current piece's send.
"""

import threading
import warnings
import weakref

import torch

from . import _futures
from ._errors import DataLoss

__all__ = ["cross_entropy", "cross_entropy_async", "PendingLoss", "LossdCrossEntropyLoss",
           "linear_cross_entropy", "kl_div", "jsd", "policy_loss", "kl_div_async", "jsd_async",
           "policy_loss_async", "linear_kl_div", "linear_jsd", "linear_policy_loss"]

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bf16", torch.float16: "float16"}

# Pieces of a download arrive in read-only memory of the client; torch.frombuffer warns about
# that although lossd.torch only reads them.
warnings.filterwarnings("ignore", message="The given buffer is not writable", module=__name__)


def cross_entropy(input, target, *, client, weight=None, ignore_index=-100, reduction="mean",
                  label_smoothing=0.0, z_loss_scale=0.0, softcap=0.0, normalizer=0.0,
                  grad_scale=1.0, label="logits", grad_out=None, segments=None,
                  num_segments=0, segment_reduction=None):
    """torch.nn.functional.cross_entropy(input, target, weight, ignore_index=ignore_index,
    reduction=reduction, label_smoothing=label_smoothing), computed by the lossd server that
    `client` (a lossd.Client) talks to.

    input: logits [N, V] (or [V] with a 0-d target) of float32, bfloat16 or float16, on the CPU
    or a CUDA device; target: class indices [N] (int64 or int32; ignore_index rows count for
    nothing); weight: class weights [V] (a tensor, sent as float32) or a handle of a stored
    float32 [V] tensor. Returns what F.cross_entropy returns: a 0-d tensor for "mean" and "sum",
    per-row losses [N] for "none", in the logits' dtype and on their device. One difference: a
    "mean" over zero valid rows is NaN as in torch, and its gradient 0.

    lossd's own options: z_loss_scale (adds z_loss_scale * lse^2 per valid row), softcap (the
    logits become softcap * tanh(x / softcap) first), normalizer (a "mean" divides by this
    instead of the valid-row count or weight sum), grad_scale (multiplies the gradient).

    grad_out: a contiguous tensor of the input's shape, dtype and device that the backward
    writes the gradient into and hands to autograd, instead of a new tensor. Pass the same one
    every step to skip fresh memory's first-touch page faults (CPU logits: on the build machine
    a download into fresh memory took 1.1-1.8 s against 0.14-0.28 s into reused memory, 0.49
    GiB). Only safe while nothing keeps the previous step's gradient: fine for logits computed
    from a model (the gradient is consumed by the backward of the ops before), not for leaf
    logits whose .grad would be this tensor.

    When a gradient will be needed (input.requires_grad with grad mode on), the server computes
    it in place during the forward and loss.backward() downloads it; the server tensor is freed
    after the backward, or when the graph is dropped without one. Otherwise the loss alone is
    computed and nothing stays on the server. Raises lossd.Error subclasses (e.g.
    lossd.InvalidArgument for a target outside [0, V)).

    segments: the segment (document) id [N] of each row of packed sequences; the loss then
    carries .segment_loss (each segment's loss sum, float64 [num_segments]) and
    .segment_tokens (its valid rows), e.g. per-document perplexity exp(segment_loss /
    segment_tokens). num_segments: 0 = max id + 1. segment_reduction: None (the reduction over
    tokens), "seq_mean_token_mean" or "seq_mean_token_sum" (verl's loss_agg_mode; needs
    reduction "mean").
    """
    logits, target, single, options = _prepare(
        input, target, weight=weight, ignore_index=ignore_index, reduction=reduction,
        label_smoothing=label_smoothing, z_loss_scale=z_loss_scale, softcap=softcap,
        normalizer=normalizer, grad_scale=grad_scale, label=label, grad_out=grad_out)
    options["extra"] = _segment_kwargs(segments, num_segments, segment_reduction)
    if options["extra"]:
        return _post_training_loss(logits, target, client, options, input.requires_grad)
    if torch.is_grad_enabled() and input.requires_grad:
        loss = _CrossEntropy.apply(logits, target, client, options)
    else:
        loss, _ = _forward(logits, target, client, options, need_gradient=False)
    return loss.reshape(()) if single and reduction == "none" else loss


def _prepare(input, target, *, weight, ignore_index, reduction, label_smoothing, z_loss_scale,
             softcap, normalizer, grad_scale, label, grad_out):
    """cross_entropy's checks: (logits [N, V], target [N], whether input was [V], options)."""
    if not isinstance(input, torch.Tensor) or not isinstance(target, torch.Tensor):
        raise TypeError("lossd.torch.cross_entropy: input and target must be tensors")
    if input.dtype not in _DTYPE_NAMES:
        raise TypeError("lossd.torch.cross_entropy: logits must be float32, bfloat16 or float16, "
                        "not %s" % input.dtype)
    if target.is_floating_point():
        raise ValueError("lossd.torch.cross_entropy: class probabilities as targets are not "
                         "supported; pass class indices")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError("reduction must be 'mean', 'sum' or 'none', not %r" % (reduction,))
    single = input.dim() == 1
    if single:
        if target.dim() != 0:
            raise ValueError("logits [V] need a 0-d target, got target of shape %s"
                             % (tuple(target.shape),))
        logits, target = input.unsqueeze(0), target.reshape(1)
    elif input.dim() == 2:
        if target.dim() != 1 or target.shape[0] != input.shape[0]:
            raise ValueError("logits [N, V] need a target [N]; got %s and %s"
                             % (tuple(input.shape), tuple(target.shape)))
        logits = input
    else:
        raise ValueError("lossd.torch.cross_entropy takes logits [N, V] or [V], not %d-d"
                         % input.dim())
    options = dict(weight=weight, ignore_index=int(ignore_index), reduction=reduction,
                   label_smoothing=float(label_smoothing), z_loss_scale=float(z_loss_scale),
                   softcap=float(softcap), normalizer=float(normalizer),
                   grad_scale=float(grad_scale), label=label, grad_out=None)
    if grad_out is not None:
        if (not isinstance(grad_out, torch.Tensor) or grad_out.shape != input.shape
                or grad_out.dtype != input.dtype or grad_out.device != input.device
                or not grad_out.is_contiguous()):
            raise ValueError("grad_out must be a contiguous tensor of the input's shape, dtype "
                             "and device (%s %s on %s)"
                             % (tuple(input.shape), input.dtype, input.device))
        options["grad_out"] = grad_out.view(logits.shape)
    return logits, target, single, options


def cross_entropy_async(input, target, *, client, weight=None, ignore_index=-100,
                        reduction="mean", label_smoothing=0.0, z_loss_scale=0.0, softcap=0.0,
                        normalizer=0.0, grad_scale=1.0, label="logits", grad_out=None,
                        segments=None, num_segments=0, segment_reduction=None):
    """cross_entropy started now and collected later: returns a PendingLoss at once, whose
    .result() gives what cross_entropy would have returned (with autograd: loss.backward()
    downloads the gradient). The upload and Forward run on the client's thread pool with the
    GIL released, so the caller computes the next micro-batch meanwhile.

    The logits must not change until .result() returns (CPU logits are sent from where they lie).
    CUDA logits are read after the work queued on the current stream when this was called, on a
    stream of their own, so later work queued on the current stream does not delay the upload.
    Whether a gradient is formed is decided here (grad mode and input.requires_grad now).
    .cancel() follows lossd.Client's futures: nothing stays on the server."""
    logits, target, single, options = _prepare(
        input, target, weight=weight, ignore_index=ignore_index, reduction=reduction,
        label_smoothing=label_smoothing, z_loss_scale=z_loss_scale, softcap=softcap,
        normalizer=normalizer, grad_scale=grad_scale, label=label, grad_out=grad_out)
    options["extra"] = _segment_kwargs(segments, num_segments, segment_reduction)
    return _start_async(logits, target, client, options, input.requires_grad, single)


def _start_async(logits, target, client, options, requires_grad, single=False):
    """The forward of cross_entropy_async and the post-training *_async functions on the
    client's pool: a PendingLoss."""
    need_gradient = torch.is_grad_enabled() and requires_grad
    ready = None
    if logits.is_cuda:
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(logits.device))
    detached = logits.detach().contiguous()
    host_target = _host_targets(target) if target is not None else None

    def call():
        if ready is None:
            return _forward(detached, host_target, client, options, need_gradient)
        stream = _CudaScratch.of(client).stream(detached.device)
        with torch.cuda.device(detached.device), torch.cuda.stream(stream):
            stream.wait_event(ready)
            outcome = _forward(detached, host_target, client, options, need_gradient, stream)
            # The loss tensor was made on this stream; the caller's stream will read it.
            stream.synchronize()
            return outcome

    def undo(outcome):
        _, stored = outcome
        if stored is not None:
            stored.release()

    future = _futures.submit(client, call, undo)
    return PendingLoss(future, logits, client, options, need_gradient, single)


class PendingLoss:
    """A loss cross_entropy_async started: .result(timeout=None) waits for it and returns the loss
    tensor (attached to the logits' autograd graph when a gradient was asked for); .done(),
    .cancel() and .future (the concurrent.futures.Future of the server call) as futures have.
    Dropped without .result(), the server's gradient is released when it is collected."""

    def __init__(self, future, logits, client, options, need_gradient, single):
        self.future = future
        self._logits = logits
        self._client = client
        self._options = options
        self._need_gradient = need_gradient
        self._single = single
        self._loss = None

    def done(self):
        return self.future.done()

    def cancel(self):
        return self.future.cancel()

    def result(self, timeout=None):
        if self._loss is None:
            loss, stored = self.future.result(timeout)
            if self._need_gradient:
                options = dict(self._options, precomputed=(loss, stored))
                with torch.enable_grad():
                    loss = _CrossEntropy.apply(self._logits, None, self._client, options)
            if self._single and self._options["reduction"] == "none":
                loss = loss.reshape(())
            if self._options.get("extra"):
                _attach_metrics(loss, self._options.pop("result"))
            self._loss = loss
            self._logits = None
        return self._loss


class LossdCrossEntropyLoss(torch.nn.Module):
    """torch.nn.CrossEntropyLoss computed by a lossd server: LossdCrossEntropyLoss(client,
    weight=None, ignore_index=-100, reduction="mean", label_smoothing=0.0, **lossd_options)
    (z_loss_scale, softcap, normalizer, grad_scale); forward(input, target) is
    lossd.torch.cross_entropy with these options."""

    def __init__(self, client, weight=None, ignore_index=-100, reduction="mean",
                 label_smoothing=0.0, **lossd_options):
        super().__init__()
        self.client = client
        if isinstance(weight, torch.Tensor):
            self.register_buffer("weight", weight)
        else:
            self.weight = weight
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = label_smoothing
        self.lossd_options = dict(lossd_options)

    def forward(self, input, target):
        return cross_entropy(input, target, client=self.client, weight=self.weight,
                             ignore_index=self.ignore_index, reduction=self.reduction,
                             label_smoothing=self.label_smoothing, **self.lossd_options)

    def extra_repr(self):
        return "client=%r, ignore_index=%d, reduction=%r, label_smoothing=%g" % (
            self.client.target, self.ignore_index, self.reduction, self.label_smoothing)


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, client, options):
        precomputed = options.get("precomputed")
        if precomputed is not None:  # cross_entropy_async's call, finished on its pool
            loss, stored = precomputed
            loss = loss.clone()  # the node's output; the PendingLoss keeps no alias of it
        else:
            loss, stored = _forward(logits, target, client, options, need_gradient=True)
        ctx.stored = stored
        ctx.logits_meta = (logits.shape, logits.dtype, logits.device)
        ctx.grad_out = options.get("grad_out")
        ctx.reduction = options["reduction"]
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output):
        stored = ctx.stored
        if stored is None or not stored.alive:
            raise RuntimeError("lossd.torch.cross_entropy: backward ran twice; the server's "
                               "gradient was released after the first")
        meta = ctx.logits_meta
        client = stored.client
        try:
            if ctx.reduction == "none":
                scale = grad_output.detach().to("cpu", torch.float32).contiguous().reshape(-1)
                client.backward(stored.handle, scale.numpy())
            else:
                factor = float(grad_output)
                # The server's factor is 1 until a Backward records another.
                if factor != 1.0:
                    client.backward(stored.handle, factor)
            gradient = _download_gradient(client, stored.handle, meta, ctx.grad_out)
        finally:
            stored.release()
            ctx.stored = None
        return gradient, None, None, None


def _host_targets(target):
    """Class indices as a contiguous int32/int64 CPU tensor, for the request."""
    target = target.detach().to("cpu")
    if target.dtype not in (torch.int64, torch.int32):
        target = target.to(torch.int64)
    return target.contiguous()


def _store(client, tensor, label, stream=None):
    """Uploads a contiguous tensor (from the CPU without a copy, from a GPU piece by piece, its
    copies on `stream`, default the current one) and returns the _StoredTensor this process must
    release."""
    if tensor.device.type == "cpu":
        info = client.upload(_host_view(tensor), dtype=_DTYPE_NAMES[tensor.dtype], label=label)
    else:
        info = _upload_from_device(client, tensor, label, stream)
    return _StoredTensor(client, info.handle)


def _loss_tensor(result, reduction, normalizer, like):
    """The loss of a Forward or LinearForward result as torch gives it, on `like`'s device and
    dtype."""
    if reduction == "none":
        loss = torch.from_numpy(result.token_loss)
    else:
        value = result.loss
        if reduction == "mean" and result.valid_tokens == 0 and normalizer == 0:
            value = float("nan")  # torch's mean over no valid rows; lossd reports 0
        loss = torch.tensor(value, dtype=torch.float32)
    return loss.to(device=like.device, dtype=like.dtype)


def _download_gradient(client, handle, meta, out=None):
    """A tensor of meta = (shape, dtype, device), `out` or a new one, holding the server's
    gradient `handle`."""
    shape, dtype, device = meta
    gradient = out if out is not None else torch.empty(shape, dtype=dtype, device=device)
    if device.type == "cpu":
        client.download(handle, out=_host_view(gradient))
    else:
        _download_to_device(client, handle, gradient)
    return gradient


def _forward(logits, target, client, options, need_gradient, stream=None):
    """Uploads the logits, runs Forward (in place when a gradient is needed, else mode "none")
    and returns (loss tensor, _StoredTensor or None). options["extra"]: more keyword arguments
    of Client.forward (the post-training losses); a dense teacher tensor in
    options["teacher_tensor"] is uploaded for the call and released after it. The result goes
    into options["result"]."""
    logits = logits.detach().contiguous()
    target = _host_targets(target).numpy() if target is not None else None
    weight = options["weight"]
    if isinstance(weight, torch.Tensor):
        weight = weight.detach().to("cpu", torch.float32).contiguous().numpy()
    reduction = options["reduction"]
    extra = dict(options.get("extra") or {})

    stored = _store(client, logits, options["label"], stream)
    staged = []
    try:
        _stage_inputs(client, options, extra, staged, stream)
        result = client.forward(
            stored.handle, target, weight=weight, ignore_index=options["ignore_index"],
            label_smoothing=options["label_smoothing"], reduction=reduction,
            z_loss_scale=options["z_loss_scale"], softcap=options["softcap"],
            normalizer=options["normalizer"], grad_scale=options["grad_scale"],
            mode="in_place" if need_gradient else "none", token_loss=reduction == "none",
            **extra)
    except BaseException:
        stored.release()
        raise
    finally:
        for tensor in staged:
            tensor.release()
    if not need_gradient:
        stored.release()
        stored = None
    options["result"] = result

    return _loss_tensor(result, reduction, options["normalizer"], logits), stored


def _stage_inputs(client, options, extra, staged, stream=None):
    """options["teacher_tensor"] and the large inputs of `extra` uploaded and named in `extra`;
    each appended to `staged`, which the caller releases after the call."""
    if options.get("teacher_tensor") is not None:
        teacher = _store(client, options["teacher_tensor"].detach().contiguous(), "teacher",
                         stream)
        staged.append(teacher)
        extra["teacher"] = teacher.handle
    _stage_large_inputs(client, extra, staged)


class _StoredTensor:
    """A tensor on the server that this process must release: at the backward, or when the
    autograd graph holding it is freed without one (weakref.finalize)."""

    def __init__(self, client, handle):
        self.client = client
        self.handle = handle
        self._finalizer = weakref.finalize(self, _release_quietly, client, handle)
        # At interpreter exit the server may be gone; its --ttl frees what is left.
        self._finalizer.atexit = False

    @property
    def alive(self):
        return self._finalizer.alive

    def release(self):
        self._finalizer()


def _release_quietly(client, handle):
    try:
        if not client.closed:
            client.release(handle)
    except Exception:  # noqa: BLE001: a finalizer must not raise; the server's TTL frees it
        pass


def _host_view(tensor):
    """A numpy view of a contiguous CPU tensor (bf16 as int16 bits), for upload and out=."""
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy()
    return tensor.numpy()


class _CudaScratch:
    """The client's scratch buffers, registered with CUDA (cudaHostRegister) the first time each
    is seen, so that device copies to and from them are direct DMA; unregistered when the client
    closes, before they are freed. One per client."""

    def __init__(self, client):
        self._lock = threading.Lock()
        self._piece_bytes = client.piece_bytes
        self._registered = []  # (address, bytes) of registered buffers
        client._add_close_hook(self._unregister_all)

    _create_lock = threading.Lock()

    @staticmethod
    def of(client):
        with _CudaScratch._create_lock:
            scratch = getattr(client, "_lossd_cuda_scratch", None)
            if scratch is None:
                scratch = _CudaScratch(client)
                client._lossd_cuda_scratch = scratch
            return scratch

    def stream(self, device):
        """The client's side stream on `device`, for cross_entropy_async's copies: work queued
        on the caller's stream after the call does not hold them up."""
        with self._lock:
            streams = self.__dict__.setdefault("_streams", {})
            if device not in streams:
                streams[device] = torch.cuda.Stream(device)
            return streams[device]

    def register(self, address):
        """Registers the scratch buffer that starts at `address` (once)."""
        with self._lock:
            if any(start == address for start, _ in self._registered):
                return
            error = torch.cuda.cudart().cudaHostRegister(address, self._piece_bytes, 0)
            if int(error) == 0:
                self._registered.append((address, self._piece_bytes))
            # Otherwise the copies still work, through the driver's staging.

    def _unregister_all(self):
        with self._lock:
            registered, self._registered = self._registered, []
        if registered and torch.cuda.is_initialized():
            for address, _ in registered:
                torch.cuda.cudart().cudaHostUnregister(address)


def _upload_from_device(client, logits, label, stream=None):
    """Uploads a CUDA tensor through the client's scratch buffers: each piece is copied
    device-to-host into a registered scratch buffer on the transfer's thread, on `stream`
    (default: the caller's current stream)."""
    scratch = _CudaScratch.of(client)
    device = logits.device
    flat = logits.view(-1).view(torch.uint8)
    if stream is None:
        stream = torch.cuda.current_stream(device)
    # The transfer threads copy on `stream`, whose queued work must be done with the logits.
    stream.synchronize()

    def source(offset, size, buffer):
        host = torch.frombuffer(buffer, dtype=torch.uint8)
        scratch.register(host.data_ptr())
        with torch.cuda.device(device), torch.cuda.stream(stream):
            host.copy_(flat[offset:offset + size])

    return client.upload_from(source, _DTYPE_NAMES[logits.dtype], list(logits.shape),
                              label=label)


def _download_to_device(client, handle, gradient):
    """Downloads into a CUDA tensor: each piece is copied host-to-device from the client's
    buffer on the transfer's thread. Each piece lies at the start of one of the client's scratch
    buffers (client.h, DownloadSink), registered here once: direct DMA."""
    scratch = _CudaScratch.of(client)
    device = gradient.device
    flat = gradient.view(-1).view(torch.uint8)
    # The caller's stream (autograd's for the backward): on the transfer threads' own current
    # stream, the default one, each copy would wait behind the caller's unrelated work queued
    # there, e.g. the next micro-batch's forward while this gradient comes back.
    stream = torch.cuda.current_stream(device)

    def sink(offset, data):
        host = torch.frombuffer(data, dtype=torch.uint8)
        scratch.register(host.data_ptr())
        size = host.numel()
        with torch.cuda.device(device), torch.cuda.stream(stream):
            flat[offset:offset + size].copy_(host, non_blocking=False)

    def on_header(info):
        if info.bytes != flat.numel():
            raise DataLoss("the server sent %d bytes for a gradient of %d"
                               % (info.bytes, flat.numel()))

    client.download_to(handle, sink, on_header=on_header)


def linear_cross_entropy(hidden, weight_handle, target, *, client, bias_handle=None,
                         weight_grad_handle=None, bias_grad_handle=None, accumulate="add",
                         class_weights=None, ignore_index=-100, reduction="mean",
                         label_smoothing=0.0, z_loss_scale=0.0, softcap=0.0, normalizer=0.0,
                         grad_scale=1.0, label="hidden", precision="exact", segments=None,
                         num_segments=0, segment_reduction=None):
    """cross_entropy(hidden @ W.T + b, target) with the LM head W [V, H] (and bias b [V]) held by
    the lossd server behind `weight_handle` (`bias_handle`): the logits never leave the server.

    hidden: [N, H] float32, bfloat16 or float16 (W's dtype) on the CPU or a CUDA device; target:
    class indices [N]. Returns the loss as cross_entropy does ("mean" or "sum"; "none" only
    without a gradient). When a gradient will be needed, the server forms dX in place of the
    uploaded hidden states and the weight gradient in the same call: loss.backward() downloads
    dX onto hidden's device, and the weight (and bias) gradient accumulates in fp32 on the
    server into `weight_grad_handle` (`bias_grad_handle`; None = created by this call), per
    `accumulate` ("add" or "overwrite"). Their handles are set on the returned loss as
    loss.weight_grad_handle and loss.bias_grad_handle: pass them to the next micro-batch's call
    and read them with client.download(handle) (dtype "float32" or "bf16").

    The weight gradient is formed at the forward, so it carries grad_scale (fold 1/micro-batches
    or a loss scale into it) but not the grad_output of the backward, which scales dX only: with
    a grad_output other than 1 the gradients disagree (a warning says so). For a mean over
    micro-batches pass the whole batch's `normalizer`. Without a gradient (no requires_grad, or
    torch.no_grad()) it is loss-only: nothing is accumulated and nothing stays on the server.

    segments, num_segments, segment_reduction: as cross_entropy's. linear_kl_div, linear_jsd and
    linear_policy_loss: the post-training losses with the same head arguments.

    precision: "exact" (dW within ~3e-5 of fp32) or "fast" (on a CUDA server with bfloat16 or
    float16 inputs, the three products in 16 bits as the peers compute them: a ~1.1x faster
    kernel, dW 2e-4 to 2e-3 relative error on mild logits, 2e-2 on peaked ones); float32 inputs and the CPU server compute the same either way.
    """
    if not isinstance(target, torch.Tensor):
        raise TypeError("lossd.torch.linear_cross_entropy: hidden and target must be tensors")
    options = _linear_options(
        "linear_cross_entropy", hidden, target, weight_handle, bias_handle, weight_grad_handle,
        bias_grad_handle, accumulate, ignore_index, reduction, softcap, normalizer, grad_scale,
        label, precision)
    if isinstance(class_weights, torch.Tensor):
        class_weights = class_weights.detach().to("cpu", torch.float32).contiguous().numpy()
    options.update(class_weights=class_weights, label_smoothing=float(label_smoothing),
                   z_loss_scale=float(z_loss_scale))
    options["extra"] = _segment_kwargs(segments, num_segments, segment_reduction)
    return _linear_loss(hidden, target, client, options)


def _linear_options(name, hidden, target, weight_handle, bias_handle, weight_grad_handle,
                    bias_grad_handle, accumulate, ignore_index, reduction, softcap, normalizer,
                    grad_scale, label, precision):
    """The checks and options the linear_* functions share (cross-entropy options off)."""
    if not isinstance(hidden, torch.Tensor):
        raise TypeError("lossd.torch.%s: hidden must be a tensor" % name)
    if hidden.dtype not in _DTYPE_NAMES:
        raise TypeError("lossd.torch.%s: hidden must be float32, bfloat16 or float16, not %s"
                        % (name, hidden.dtype))
    if hidden.dim() != 2 or (target is not None and (
            not isinstance(target, torch.Tensor) or target.dim() != 1
            or target.shape[0] != hidden.shape[0])):
        raise ValueError("hidden [N, H] needs a target [N]; got %s and %s"
                         % (tuple(hidden.shape), None if target is None
                            else tuple(getattr(target, "shape", ()))))
    if reduction not in ("mean", "sum", "none"):
        raise ValueError("reduction must be 'mean', 'sum' or 'none', not %r" % (reduction,))
    if accumulate not in ("add", "overwrite"):
        raise ValueError("accumulate must be 'add' or 'overwrite', not %r" % (accumulate,))
    if precision not in ("exact", "fast"):
        raise ValueError("precision must be 'exact' or 'fast', not %r" % (precision,))
    if torch.is_grad_enabled() and hidden.requires_grad and reduction == "none":
        raise ValueError("lossd.torch.%s: reduction 'none' with a gradient needs the per-row "
                         "grad_output at the forward; use 'mean' or 'sum', or "
                         "client.linear_forward(..., token_grad_output=...)" % name)
    return dict(weight=weight_handle, bias=bias_handle or "",
                weight_grad=weight_grad_handle or "", bias_grad=bias_grad_handle or "",
                accumulate=accumulate, class_weights=None, ignore_index=int(ignore_index),
                reduction=reduction, label_smoothing=0.0, z_loss_scale=0.0,
                softcap=float(softcap), normalizer=float(normalizer),
                grad_scale=float(grad_scale), label=label, precision=precision)


def _linear_loss(hidden, target, client, options):
    """One LinearForward with autograd through the hidden states when a gradient is needed (the
    head's gradient accumulated on the server; its handles on the loss), else the loss alone;
    with options["extra"] the loss carries the post-training metrics."""
    if torch.is_grad_enabled() and hidden.requires_grad:
        loss = _LinearCrossEntropy.apply(hidden, target, client, options)
        loss.weight_grad_handle = options["weight_grad_out"]
        loss.bias_grad_handle = options["bias_grad_out"] or None
    else:
        loss, _ = _linear_forward(hidden, target, client, options, need_gradient=False)
    if options.get("extra"):
        _attach_metrics(loss, options.pop("result"))
    return loss


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, target, client, options):
        loss, stored = _linear_forward(hidden, target, client, options, need_gradient=True)
        ctx.stored = stored
        ctx.hidden_meta = (hidden.shape, hidden.dtype, hidden.device)
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output):
        stored = ctx.stored
        if stored is None or not stored.alive:
            raise RuntimeError("lossd.torch.linear_cross_entropy: backward ran twice; the "
                               "server's dX was released after the first")
        meta = ctx.hidden_meta
        client = stored.client
        try:
            factor = float(grad_output)
            if factor != 1.0:
                warnings.warn("lossd.torch.linear_cross_entropy: a grad_output of %g scales dX "
                              "but not the weight gradient accumulated at the forward; fold it "
                              "into grad_scale" % factor, stacklevel=2)
                client.backward(stored.handle, factor)
            gradient = _download_gradient(client, stored.handle, meta)
        finally:
            stored.release()
            ctx.stored = None
        return gradient, None, None, None


def _linear_forward(hidden, target, client, options, need_gradient):
    """Uploads the hidden states, runs LinearForward (dX in place and the weight gradient
    accumulated when a gradient is needed, else loss only) and returns (loss tensor,
    _StoredTensor or None); the accumulators' handles and the result go into options.
    options["extra"] and options["teacher_tensor"] as _forward's."""
    hidden = hidden.detach().contiguous()
    target = _host_targets(target).numpy() if target is not None else None
    reduction = options["reduction"]
    extra = dict(options.get("extra") or {})
    stored = _store(client, hidden, options["label"])
    staged = []
    try:
        _stage_inputs(client, options, extra, staged)
        result = client.linear_forward(
            stored.handle, options["weight"], target, bias=options["bias"],
            weight_grad=options["weight_grad"] if need_gradient else "",
            bias_grad=options["bias_grad"] if need_gradient else "",
            accumulate=options["accumulate"] if need_gradient else "none",
            class_weights=options["class_weights"], ignore_index=options["ignore_index"],
            label_smoothing=options["label_smoothing"], reduction=reduction,
            z_loss_scale=options["z_loss_scale"], softcap=options["softcap"],
            normalizer=options["normalizer"], grad_scale=options["grad_scale"],
            mode="in_place" if need_gradient else "none", token_loss=reduction == "none",
            precision=options["precision"], **extra)
    except BaseException:
        stored.release()
        raise
    finally:
        for tensor in staged:
            tensor.release()
    options["result"] = result.forward
    options["weight_grad_out"] = result.weight_grad
    options["bias_grad_out"] = result.bias_grad
    if not need_gradient:
        stored.release()
        stored = None
    return _loss_tensor(result, reduction, options["normalizer"], hidden), stored


# The post-training losses (docs/api.md, "Post-training losses"): each is one Forward with more
# keyword arguments, its gradient written in place of the uploaded logits as cross_entropy's.

def _segment_kwargs(segments, num_segments, segment_reduction):
    """Client.forward's segment arguments; {} without segments."""
    if segments is None:
        if segment_reduction is not None:
            raise ValueError("segment_reduction needs segments")
        return {}
    if not isinstance(segments, str):
        segments = torch.as_tensor(segments).detach().to("cpu")
        if segments.dtype not in (torch.int32, torch.int64):
            raise TypeError("segments must hold integer segment ids, not %s" % segments.dtype)
        if segments.numel() and (int(segments.min()) < 0 or int(segments.max()) >= 2 ** 31):
            raise ValueError("segment ids must be in [0, 2^31)")
        if num_segments == 0 and segments.numel():
            num_segments = int(segments.max()) + 1
        # int32, as the server takes them (also when uploaded: see _stage_large_inputs).
        segments = segments.to(torch.int32).contiguous().numpy()
    return dict(segments=segments, num_segments=int(num_segments),
                segment_reduction=segment_reduction)


# Inputs up to this size go inline in the Forward request; larger ones (a top-k teacher of many
# tokens) are uploaded for the call, as one request must stay below the channel's message limit.
_INLINE_BYTES = 4 << 20


def _stage_large_inputs(client, extra, staged):
    """Replaces the numpy inputs in `extra` (a top-k pair's too) of more than _INLINE_BYTES by
    handles of uploaded copies, appended to `staged` for release after the call."""
    def stage(value, label):
        if getattr(value, "nbytes", 0) <= _INLINE_BYTES:
            return value
        tensor = _StoredTensor(client, client.upload(value, label=label).handle)
        staged.append(tensor)
        return tensor.handle

    for key in ("advantages", "old_logprobs", "ref_logprobs", "segments"):
        if key in extra:
            extra[key] = stage(extra[key], key)
    if isinstance(extra.get("teacher"), tuple):
        extra["teacher"] = tuple(stage(part, "teacher") for part in extra["teacher"])


def _small_input(value, name):
    """A per-row input [N] (or [N, k]) as a float32 numpy array, or a handle as it is."""
    if isinstance(value, str):
        return value
    if value is None:
        return None
    tensor = torch.as_tensor(value)
    if not tensor.is_floating_point():
        raise TypeError("%s must be floating point, not %s" % (name, tensor.dtype))
    return tensor.detach().to("cpu", torch.float32).contiguous().numpy()


def _teacher_kwargs(teacher):
    """(Client.forward's teacher argument, a dense teacher tensor to upload or None)."""
    if isinstance(teacher, str):
        return teacher, None
    if isinstance(teacher, (tuple, list)):
        if len(teacher) != 2:
            raise ValueError("a top-k teacher is a pair (indices [N, k], logprobs [N, k])")
        indices, logprobs = teacher
        if not isinstance(indices, str):
            indices = torch.as_tensor(indices).detach().to("cpu")
            if indices.dtype not in (torch.int32, torch.int64):
                indices = indices.to(torch.int64)
            indices = indices.contiguous().numpy()
        return (indices, _small_input(logprobs, "teacher logprobs")), None
    if isinstance(teacher, torch.Tensor):
        if teacher.dtype not in _DTYPE_NAMES:
            raise TypeError("teacher logits must be float32, bfloat16 or float16, not %s"
                            % teacher.dtype)
        return None, teacher
    raise TypeError("teacher must be a tensor of logits [N, V], a handle of stored teacher "
                    "logits, or a pair (indices, logprobs) of a top-k teacher")


def _check_logits(input, target, name):
    if not isinstance(input, torch.Tensor):
        raise TypeError("lossd.torch.%s: input must be a tensor" % name)
    if input.dtype not in _DTYPE_NAMES:
        raise TypeError("lossd.torch.%s: logits must be float32, bfloat16 or float16, not %s"
                        % (name, input.dtype))
    if input.dim() != 2:
        raise ValueError("lossd.torch.%s takes logits [N, V], not %d-d" % (name, input.dim()))
    if target is not None and (not isinstance(target, torch.Tensor) or target.dim() != 1
                               or target.shape[0] != input.shape[0]):
        raise ValueError("lossd.torch.%s: logits [N, V] need a target [N]" % name)


def _base_options(reduction, ignore_index, softcap, normalizer, grad_scale, label):
    if reduction not in ("mean", "sum", "none"):
        raise ValueError("reduction must be 'mean', 'sum' or 'none', not %r" % (reduction,))
    return dict(weight=None, ignore_index=int(ignore_index), reduction=reduction,
                label_smoothing=0.0, z_loss_scale=0.0, softcap=float(softcap),
                normalizer=float(normalizer), grad_scale=float(grad_scale), label=label,
                grad_out=None)


def _post_training_loss(logits, target, client, options, requires_grad, asynchronous=False):
    """One Forward with options["extra"], with autograd when a gradient is needed; the loss
    carries the result's metrics as attributes. asynchronous: a PendingLoss instead."""
    if asynchronous:
        return _start_async(logits, target, client, options, requires_grad)
    if torch.is_grad_enabled() and requires_grad:
        loss = _CrossEntropy.apply(logits, target, client, options)
    else:
        loss, _ = _forward(logits, target, client, options, need_gradient=False)
    _attach_metrics(loss, options.pop("result"))
    return loss


def _attach_metrics(loss, result):
    """The post-training metrics of a ForwardResult as attributes of its loss tensor."""
    loss.distillation_loss = result.distillation_loss
    loss.policy_stats = result.policy_stats
    loss.valid_tokens = result.valid_tokens
    if result.segment_loss is not None:
        loss.segment_loss = torch.from_numpy(result.segment_loss)
        loss.segment_tokens = torch.from_numpy(result.segment_tokens)


def _distill(name, input, teacher, target, client, divergence, beta, temperature, alpha,
             top_k_tail, ignore_index, reduction, softcap, normalizer, grad_scale, segments,
             num_segments, segment_reduction, label, asynchronous=False):
    _check_logits(input, target, name)
    options = _base_options(reduction, ignore_index, softcap, normalizer, grad_scale, label)
    options["extra"], options["teacher_tensor"] = _distillation_kwargs(
        name, teacher, target, divergence, beta, temperature, alpha, top_k_tail,
        input.shape[0], input.shape)
    options["extra"].update(_segment_kwargs(segments, num_segments, segment_reduction))
    return _post_training_loss(input, target, client, options, input.requires_grad,
                               asynchronous)


def _distillation_kwargs(name, teacher, target, divergence, beta, temperature, alpha,
                         top_k_tail, rows, shape=None):
    """(Client.forward's distillation keywords, a dense teacher tensor to upload or None)."""
    if target is None and alpha != 0:
        raise ValueError("lossd.torch.%s: alpha > 0 mixes in the cross entropy against target; "
                         "pass target" % name)
    teacher_arg, teacher_tensor = _teacher_kwargs(teacher)
    if teacher_tensor is not None and (
            teacher_tensor.shape != shape if shape is not None
            else teacher_tensor.dim() != 2 or teacher_tensor.shape[0] != rows):
        raise ValueError("teacher logits %s must have the student's shape %s"
                         % (tuple(teacher_tensor.shape),
                            tuple(shape) if shape is not None else "[%d, V]" % rows))
    extra = dict(divergence=divergence, beta=float(beta), temperature=float(temperature),
                 alpha=float(alpha), top_k_tail=top_k_tail)
    if teacher_arg is not None:
        extra["teacher"] = teacher_arg
    return extra, teacher_tensor


def kl_div(input, teacher, target=None, *, client, reverse=False, temperature=1.0, alpha=0.0,
           top_k_tail="renormalize", ignore_index=-100, reduction="mean", softcap=0.0,
           normalizer=0.0, grad_scale=1.0, segments=None, num_segments=0,
           segment_reduction=None, label="logits", _asynchronous=False):
    """Distillation loss KL(q || p) (reverse=True: KL(p || q)) per row between the teacher's
    distribution q and the student's p = softmax(input / temperature), computed by the lossd
    server, with autograd (the gradient written in place of the uploaded logits, as
    cross_entropy's). Unlike torch.nn.functional.kl_div, input is the student's logits [N, V],
    not log-probabilities, and reduction "mean" divides by the counted rows (torch's
    "batchmean" when every row counts).

    teacher: the teacher's logits [N, V] (a tensor, uploaded for the call, of float32,
    bfloat16 or float16; or a handle of stored teacher logits), or a top-k teacher, a pair
    (indices [N, k] int, logprobs [N, k] float) as teacher servers send, with top_k_tail
    "renormalize" (both sides over the k classes) or "bucket" (the rest of the vocabulary as one
    class). target: class indices [N], optional: rows at ignore_index count for nothing, and
    alpha > 0 adds alpha * cross_entropy(input, target) (Liger's weight_hard_loss) to
    (1 - alpha) times the divergence. No temperature**2 factor (as TRL and Liger); fold one
    into grad_scale. segments as cross_entropy's. The loss tensor carries .distillation_loss
    (the divergence term alone, a float), .valid_tokens and, with segments, .segment_loss and
    .segment_tokens."""
    return _distill("kl_div", input, teacher, target, client,
                    "reverse_kl" if reverse else "forward_kl", 0.5, temperature, alpha,
                    top_k_tail, ignore_index, reduction, softcap, normalizer, grad_scale,
                    segments, num_segments, segment_reduction, label, _asynchronous)


def jsd(input, teacher, target=None, *, client, beta=0.5, temperature=1.0, alpha=0.0,
        top_k_tail="renormalize", ignore_index=-100, reduction="mean", softcap=0.0,
        normalizer=0.0, grad_scale=1.0, segments=None, num_segments=0, segment_reduction=None,
        label="logits", _asynchronous=False):
    """Generalized Jensen-Shannon divergence beta KL(q || m) + (1 - beta) KL(p || m),
    m = beta q + (1 - beta) p, as TRL's GKDTrainer.generalized_jsd_loss and Liger's LigerJSD
    define it (beta = 0 is forward KL, 1 reverse KL), between the teacher's q and the student's
    p = softmax(input / temperature). Arguments and result as kl_div's."""
    return _distill("jsd", input, teacher, target, client, "jsd", beta, temperature, alpha,
                    top_k_tail, ignore_index, reduction, softcap, normalizer, grad_scale,
                    segments, num_segments, segment_reduction, label, _asynchronous)


def policy_loss(input, target, advantages, old_logprobs, *, client, loss_type="ppo",
                ref_logprobs=None, epsilon_low=0.2, epsilon_high=None, kl_coef=0.0,
                kl_estimator="k3", ignore_index=-100, reduction="mean", softcap=0.0,
                normalizer=0.0, grad_scale=1.0, segments=None, num_segments=0,
                segment_reduction=None, label="logits", _asynchronous=False):
    """A per-token policy-gradient loss on the sampled tokens `target` [N] of the policy's logits
    `input` [N, V], computed by the lossd server with autograd. With r = exp(logp -
    old_logprobs) and A = advantages (float [N] each):

    loss_type "importance_sampling": -r A; "ppo": max(-r A, -clip(r, 1 - epsilon_low,
    1 + epsilon_high) A) (DAPO's clip-higher; epsilon_high None = epsilon_low); "cispo":
    -sg(clip(r)) A logp. ref_logprobs [N] and kl_coef add kl_coef * KL against a reference
    model, KL estimated by kl_estimator "k1", "k2" or "k3" (verl's low_var_kl). Rows at
    ignore_index count for nothing. reduction "mean" is verl's "token-mean"; with segments
    (sequence ids [N]) segment_reduction "seq_mean_token_sum" / "seq_mean_token_mean" are its
    other modes. The loss tensor carries .policy_stats (clipped_tokens, ratio_sum,
    approx_kl_sum, kl_sum, entropy_sum: sums over .valid_tokens), and with segments
    .segment_loss and .segment_tokens."""
    _check_logits(input, target, "policy_loss")
    options = _base_options(reduction, ignore_index, softcap, normalizer, grad_scale, label)
    extra = _policy_kwargs(loss_type, advantages, old_logprobs, ref_logprobs, epsilon_low,
                           epsilon_high, kl_coef, kl_estimator)
    extra.update(_segment_kwargs(segments, num_segments, segment_reduction))
    options["extra"] = extra
    return _post_training_loss(input, target, client, options, input.requires_grad,
                               _asynchronous)


def _policy_kwargs(loss_type, advantages, old_logprobs, ref_logprobs, epsilon_low,
                   epsilon_high, kl_coef, kl_estimator):
    """Client.forward's policy keyword arguments."""
    return dict(policy_loss=loss_type, advantages=_small_input(advantages, "advantages"),
                old_logprobs=_small_input(old_logprobs, "old_logprobs"),
                ref_logprobs=_small_input(ref_logprobs, "ref_logprobs"),
                epsilon_low=float(epsilon_low),
                epsilon_high=None if epsilon_high is None else float(epsilon_high),
                kl_coef=float(kl_coef), kl_estimator=kl_estimator)


def linear_kl_div(hidden, weight_handle, teacher, target=None, *, client, reverse=False,
                  temperature=1.0, alpha=0.0, top_k_tail="renormalize", bias_handle=None,
                  weight_grad_handle=None, bias_grad_handle=None, accumulate="add",
                  ignore_index=-100, reduction="mean", softcap=0.0, normalizer=0.0,
                  grad_scale=1.0, segments=None, num_segments=0, segment_reduction=None,
                  label="hidden", precision="exact"):
    """kl_div of the logits hidden @ W.T + b that the server forms from the LM head behind
    `weight_handle` and never sends: teacher (dense: [N, V], V the head's rows), target and
    distillation arguments as kl_div's; head arguments, autograd (dX downloaded; the head's
    gradient accumulated on the server) and loss.weight_grad_handle as linear_cross_entropy's."""
    return _linear_distill(
        "linear_kl_div", hidden, weight_handle, teacher, target, client,
        "reverse_kl" if reverse else "forward_kl", 0.5, temperature, alpha, top_k_tail,
        bias_handle, weight_grad_handle, bias_grad_handle, accumulate, ignore_index, reduction,
        softcap, normalizer, grad_scale, segments, num_segments, segment_reduction, label,
        precision)


def linear_jsd(hidden, weight_handle, teacher, target=None, *, client, beta=0.5,
               temperature=1.0, alpha=0.0, top_k_tail="renormalize", bias_handle=None,
               weight_grad_handle=None, bias_grad_handle=None, accumulate="add",
               ignore_index=-100, reduction="mean", softcap=0.0, normalizer=0.0, grad_scale=1.0,
               segments=None, num_segments=0, segment_reduction=None, label="hidden",
               precision="exact"):
    """jsd over the LM head (Liger's LigerFusedLinearJSD, with the head on the server):
    arguments and result as linear_kl_div's, beta as jsd's."""
    return _linear_distill(
        "linear_jsd", hidden, weight_handle, teacher, target, client, "jsd", beta, temperature,
        alpha, top_k_tail, bias_handle, weight_grad_handle, bias_grad_handle, accumulate,
        ignore_index, reduction, softcap, normalizer, grad_scale, segments, num_segments,
        segment_reduction, label, precision)


def _linear_distill(name, hidden, weight_handle, teacher, target, client, divergence, beta,
                    temperature, alpha, top_k_tail, bias_handle, weight_grad_handle,
                    bias_grad_handle, accumulate, ignore_index, reduction, softcap, normalizer,
                    grad_scale, segments, num_segments, segment_reduction, label, precision):
    options = _linear_options(name, hidden, target, weight_handle, bias_handle,
                              weight_grad_handle, bias_grad_handle, accumulate, ignore_index,
                              reduction, softcap, normalizer, grad_scale, label, precision)
    options["extra"], options["teacher_tensor"] = _distillation_kwargs(
        name, teacher, target, divergence, beta, temperature, alpha, top_k_tail,
        hidden.shape[0])
    options["extra"].update(_segment_kwargs(segments, num_segments, segment_reduction))
    return _linear_loss(hidden, target, client, options)


def linear_policy_loss(hidden, weight_handle, target, advantages, old_logprobs, *, client,
                       loss_type="ppo", ref_logprobs=None, epsilon_low=0.2, epsilon_high=None,
                       kl_coef=0.0, kl_estimator="k3", bias_handle=None,
                       weight_grad_handle=None, bias_grad_handle=None, accumulate="add",
                       ignore_index=-100, reduction="mean", softcap=0.0, normalizer=0.0,
                       grad_scale=1.0, segments=None, num_segments=0, segment_reduction=None,
                       label="hidden", precision="exact"):
    """policy_loss over the LM head on the server: the policy arguments as policy_loss's, the
    head arguments and the autograd as linear_kl_div's. The loss carries .policy_stats."""
    options = _linear_options("linear_policy_loss", hidden, target, weight_handle, bias_handle,
                              weight_grad_handle, bias_grad_handle, accumulate, ignore_index,
                              reduction, softcap, normalizer, grad_scale, label, precision)
    extra = _policy_kwargs(loss_type, advantages, old_logprobs, ref_logprobs, epsilon_low,
                           epsilon_high, kl_coef, kl_estimator)
    extra.update(_segment_kwargs(segments, num_segments, segment_reduction))
    options["extra"] = extra
    return _linear_loss(hidden, target, client, options)


def kl_div_async(input, teacher, target=None, **kwargs):
    """kl_div started now and collected later, as cross_entropy_async: a PendingLoss whose
    .result() is kl_div's loss (with its metrics and autograd). Same arguments as kl_div."""
    return _call_async(kl_div, input, teacher, target, **kwargs)


def jsd_async(input, teacher, target=None, **kwargs):
    """jsd started now and collected later (see kl_div_async)."""
    return _call_async(jsd, input, teacher, target, **kwargs)


def policy_loss_async(input, target, advantages, old_logprobs, **kwargs):
    """policy_loss started now and collected later (see kl_div_async)."""
    return _call_async(policy_loss, input, target, advantages, old_logprobs, **kwargs)


def _call_async(function, *args, **kwargs):
    kwargs["_asynchronous"] = True
    return function(*args, **kwargs)
