"""The machinery under lossd.torch's losses: the transfers of a tensor to and from the server
(CPU tensors in place, CUDA tensors through the client's registered scratch buffers), the
autograd function whose backward downloads the gradient, and the staging of a call's inputs."""

import threading
import warnings
import weakref

import torch

from . import _futures
from ._errors import DataLoss

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bf16", torch.float16: "float16"}

# Pieces of a download arrive in read-only memory of the client; torch.frombuffer warns about
# that although lossd.torch only reads them.
warnings.filterwarnings("ignore", message="The given buffer is not writable", module=__name__)


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
        def record(client, handle):
            if ctx.reduction == "none":
                scale = grad_output.detach().to("cpu", torch.float32).contiguous().reshape(-1)
                client.backward(handle, scale.numpy())
            else:
                factor = float(grad_output)
                # The server's factor is 1 until a Backward records another.
                if factor != 1.0:
                    client.backward(handle, factor)

        gradient = _take_gradient(ctx, record, ctx.logits_meta, ctx.grad_out,
                                  "lossd.torch.cross_entropy: backward ran twice; the server's "
                                  "gradient was released after the first")
        return gradient, None, None, None


def _take_gradient(ctx, record, meta, out, twice):
    """The backward of lossd.torch's autograd functions: record(client, handle) sends the
    grad_output, then the server's gradient behind ctx.stored comes down into a tensor of
    meta = (shape, dtype, device) (`out` or a new one) and is released, also on failure.
    twice: the error of a second backward, whose gradient is gone."""
    stored = ctx.stored
    if stored is None or not stored.alive:
        raise RuntimeError(twice)
    try:
        record(stored.client, stored.handle)
        return _download_gradient(stored.client, stored.handle, meta, out)
    finally:
        stored.release()
        ctx.stored = None


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
    if extra:  # a server that cannot serve it is refused before the logits go
        client.require_post_training("lossd.torch")

    stored = _store(client, logits, options["label"], stream)
    result = _call_staged(client, stored, options, extra, lambda extra: client.forward(
        stored.handle, target, weight=weight, ignore_index=options["ignore_index"],
        label_smoothing=options["label_smoothing"], reduction=reduction,
        z_loss_scale=options["z_loss_scale"], softcap=options["softcap"],
        normalizer=options["normalizer"], grad_scale=options["grad_scale"],
        mode="in_place" if need_gradient else "none", token_loss=reduction == "none",
        **extra), stream)
    if not need_gradient:
        stored.release()
        stored = None
    options["result"] = result

    return _loss_tensor(result, reduction, options["normalizer"], logits), stored


def _call_staged(client, stored, options, extra, call, stream=None):
    """call(extra) with the call's inputs staged by _stage_inputs (released after it); the
    uploaded `stored` released when it fails."""
    staged = []
    try:
        _stage_inputs(client, options, extra, staged, stream)
        return call(extra)
    except BaseException:
        stored.release()
        raise
    finally:
        for tensor in staged:
            tensor.release()


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
