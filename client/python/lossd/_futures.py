"""lossd.Client's asynchronous calls: upload_async, forward_async, download_async, evaluate_async,
linear_forward_async and backward_async return a concurrent.futures.Future at once and run the
call on a pool of threads of the client. The calls release the GIL while they wait, so Python (and
the GPU work it queues) goes on while bytes move: micro-batch k's logits go up while k+1 is
computed."""

import concurrent.futures
import os
import threading

# Threads of one client's pool: enough for the four data-moving calls of two micro-batches in
# flight; each call spreads its own bytes over the client's data connections.
_WORKERS = int(os.environ.get("LOSSD_ASYNC_WORKERS", "8"))


class CallFuture(concurrent.futures.Future):
    """The Future of one lossd call, cancelled as gRPC cancels a call: cancel() succeeds while the
    call is queued or running (a concurrent.futures.Future refuses once running) and result() then
    raises concurrent.futures.CancelledError. A call cancelled while it runs is let finish (the
    bindings hold no gRPC context to cancel) and what it created on the server (an uploaded
    tensor, an out-of-place gradient, an accumulator) is released when it returns, so nothing
    stays; what it changed in place (a forward's gradient over stored logits, a sum into an
    existing accumulator) stays changed, as a gRPC call the server had finished does."""

    def __init__(self):
        super().__init__()
        # Set once the call has returned and anything undone: a cancelled future is done at
        # once, its call not yet (tests wait on this instead of polling the server).
        self._settled = threading.Event()

    def cancel(self):
        with self._condition:
            if self._state == concurrent.futures._base.RUNNING:
                # Future.cancel() turns only PENDING into CANCELLED; _run() sees the cancellation
                # when it tries to set the result and undoes the call instead.
                self._state = concurrent.futures._base.PENDING
        return super().cancel()


class _Pool:
    """One client's threads and its futures not yet done (cancelled when the client closes)."""

    def __init__(self):
        self.pid = os.getpid()
        self.executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=_WORKERS, thread_name_prefix="lossd-async")
        self.lock = threading.Lock()
        self.pending = set()

    def close(self):
        with self.lock:
            pending, self.pending = self.pending, set()
        for future in pending:
            running = future.running()
            future.cancel()
            if not running:  # never to start: shutdown() below drops its queued run()
                future._settled.set()
        self.executor.shutdown(wait=False, cancel_futures=True)


_pool_lock = threading.Lock()


def _pool(client):
    with _pool_lock:
        pool = getattr(client, "_lossd_pool", None)
        # A pool inherited through fork() has no threads in the child; the call itself then
        # raises the client's after-fork error.
        if pool is None or pool.pid != os.getpid():
            pool = _Pool()
            client._lossd_pool = pool
            client._add_close_hook(pool.close)
        return pool


def submit(client, call, undo=None):
    """Runs call() on the client's pool; returns its CallFuture. undo(result) releases what a
    call that was cancelled while it ran left on the server. Raises ValueError at once when the
    client is closed, as its blocking calls do."""
    if client.closed:
        raise ValueError("the lossd.Client is closed")
    pool = _pool(client)
    future = CallFuture()
    with pool.lock:
        pool.pending.add(future)
    future.add_done_callback(lambda done: _forget(pool, done))

    def run():
        try:
            if future.set_running_or_notify_cancel():
                settle(call)
        finally:
            future._settled.set()

    def settle(call):
        try:
            result = call()
        except BaseException as error:  # noqa: BLE001: handed to the future's owner
            try:
                future.set_exception(error)
            except concurrent.futures.InvalidStateError:
                pass  # cancelled while running: the error goes nowhere, as the result would
            return
        try:
            future.set_result(result)
        except concurrent.futures.InvalidStateError:
            if undo is not None:
                _quietly(undo, result)

    try:
        pool.executor.submit(run)
    except RuntimeError:  # the pool was shut down: the client closed meanwhile
        future.cancel()
        future._settled.set()
    return future


def _forget(pool, future):
    with pool.lock:
        pool.pending.discard(future)


def _quietly(undo, result):
    try:
        undo(result)
    except Exception:  # noqa: BLE001: the server's TTL frees what a failed release leaves
        pass


def _release(client, *handles):
    for handle in handles:
        if handle and not client.closed:
            client.release(handle)


def upload_async(self, data, **kwargs):
    """upload() on the client's pool: a Future of the TensorInfo. `data` must stay unchanged
    until the future is done (it is sent from where it lies). Cancelled while running, the
    stored tensor is released (with overwrite=, the overwritten contents stay)."""
    def undo(info):
        if kwargs.get("overwrite") is None:
            _release(self, info.handle)
    return submit(self, lambda: self.upload(data, **kwargs), undo)


def download_async(self, handle, **kwargs):
    """download() on the client's pool: a Future of the array (or of `out`, filled in place;
    leave it alone until the future is done)."""
    return submit(self, lambda: self.download(handle, **kwargs))


def evaluate_async(self, logits, target, **kwargs):
    """evaluate() on the client's pool: a Future of the EvaluateResult (nothing is stored)."""
    return submit(self, lambda: self.evaluate(logits, target, **kwargs))


def backward_async(self, handle, grad_output=1.0, **kwargs):
    """backward() on the client's pool: a Future of the BackwardResult."""
    return submit(self, lambda: self.backward(handle, grad_output, **kwargs))


def _with_input(self, value, label, call, mode):
    """Runs call(handle) for an input given as a handle or a buffer; a buffer is uploaded first
    (its handle released on failure, and after any call but an in-place one: the caller never
    sees it)."""
    if isinstance(value, str):
        return call(value)
    handle = self.upload(value, label=label).handle
    try:
        result = call(handle)
    except BaseException:
        _quietly(lambda _: _release(self, handle), None)
        raise
    if mode != "in_place":
        _release(self, handle)
    return result


def forward_async(self, logits, target, **kwargs):
    """forward() on the client's pool: a Future of the ForwardResult. logits and target as
    forward() takes them (a buffer must stay unchanged until the future is done). Cancelled
    while running: an uploaded buffer and an out-of-place gradient are released; an in-place
    forward on a stored handle has still consumed its logits."""
    mode = kwargs.get("mode", "in_place")

    def call():
        return _with_input(self, logits, "logits",
                           lambda handle: self.forward(handle, target, **kwargs), mode)

    def undo(result):
        if mode == "out_of_place" or not isinstance(logits, str):
            _release(self, result.gradient)
    return submit(self, call, undo)


def linear_forward_async(self, hidden, weight, target, **kwargs):
    """linear_forward() on the client's pool: a Future of the LinearForwardResult. Cancelled while
    running: an uploaded buffer, an out-of-place dX and accumulators this call created are
    released; a sum into an existing accumulator stays."""
    mode = kwargs.get("mode", "in_place")

    def call():
        return _with_input(self, hidden, "hidden",
                           lambda handle: self.linear_forward(handle, weight, target, **kwargs),
                           mode)

    def undo(result):
        if mode == "out_of_place" or not isinstance(hidden, str):
            _release(self, result.gradient)
        if not kwargs.get("weight_grad"):
            _release(self, result.weight_grad)
        if not kwargs.get("bias_grad"):
            _release(self, result.bias_grad)
    return submit(self, call, undo)


METHODS = {f.__name__: f for f in (upload_async, download_async, forward_async, evaluate_async,
                                   linear_forward_async, backward_async)}
