"""lossd.Client's futures (upload_async, forward_async, download_async, evaluate_async,
linear_forward_async, backward_async) and lossd.torch.cross_entropy_async against a real lossd
(CPU device): results equal the blocking calls', errors arrive through the future, cancellation
leaves nothing on the server (the client fixture checks), and a deadline fails the call."""

import concurrent.futures
import gc
import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import lossd
import lossd.torch


def random_logits(rows, vocab, seed=0):
    return np.random.default_rng(seed).standard_normal((rows, vocab), dtype=np.float32)


def test_futures_give_the_blocking_calls_results(client):
    logits = random_logits(16, 50)
    targets = np.random.default_rng(1).integers(0, 50, 16)
    upload = client.upload_async(logits, label="async")
    assert isinstance(upload, concurrent.futures.Future)
    handle = upload.result(timeout=60).handle
    evaluated = client.evaluate_async(logits, targets).result(timeout=60)
    forward = client.forward_async(handle, targets).result(timeout=60)
    assert forward.gradient == handle
    assert forward.loss == pytest.approx(evaluated.loss, rel=1e-6)
    expected = F.cross_entropy(torch.from_numpy(logits), torch.from_numpy(targets))
    assert forward.loss == pytest.approx(expected.item(), rel=1e-5)
    client.backward_async(handle, 0.5).result(timeout=60)
    out = np.empty_like(logits)
    assert client.download_async(handle, out=out).result(timeout=60) is out
    reference = torch.from_numpy(logits).requires_grad_()
    (F.cross_entropy(reference, torch.from_numpy(targets)) * 0.5).backward()
    np.testing.assert_allclose(out, reference.grad.numpy(), atol=1e-6)
    client.release(handle)


def test_forward_async_of_a_buffer_leaves_only_the_gradient(client):
    logits = random_logits(8, 30)
    targets = np.arange(8)
    result = client.forward_async(logits, targets).result(timeout=60)
    assert [t.handle for t in client.list().tensors] == [result.gradient]
    client.release(result.gradient)
    # mode "none" of a buffer: the upload made for the call is released after it.
    loss_only = client.forward_async(logits, targets, mode="none").result(timeout=60)
    assert loss_only.loss == pytest.approx(result.loss)
    assert client.list().tensors == []
    # Out of place: only the new gradient stays, not the upload the caller never saw.
    apart = client.forward_async(logits, targets, mode="out_of_place").result(timeout=60)
    assert [t.handle for t in client.list().tensors] == [apart.gradient]
    client.release(apart.gradient)


def test_blocking_forward_of_a_buffer_leaves_only_what_it_returns(client):
    logits = random_logits(8, 30)
    targets = np.arange(8)
    for mode in ("none", "out_of_place"):
        result = client.forward(logits, targets, mode=mode)
        left = [t.handle for t in client.list().tensors]
        assert left == ([result.gradient] if mode == "out_of_place" else []), mode
        for handle in left:
            client.release(handle)
    hidden = np.random.default_rng(4).standard_normal((6, 8), dtype=np.float32)
    weight = client.upload(np.ones((20, 8), dtype=np.float32)).handle
    result = client.linear_forward(hidden, weight, np.arange(6), mode="none")
    assert [t.handle for t in client.list().tensors] == [weight]
    client.release(weight)


def test_linear_forward_async(client):
    rng = np.random.default_rng(2)
    hidden = rng.standard_normal((6, 8), dtype=np.float32)
    weight = client.upload(rng.standard_normal((20, 8), dtype=np.float32)).handle
    targets = rng.integers(0, 20, 6)
    result = client.linear_forward_async(hidden, weight, targets).result(timeout=60)
    logits = torch.from_numpy(hidden) @ torch.from_numpy(client.download(weight)).T
    assert result.loss == pytest.approx(F.cross_entropy(logits, torch.from_numpy(targets)).item(),
                                        rel=1e-5)
    for handle in (result.gradient, result.weight_grad, weight):
        client.release(handle)


def test_errors_arrive_through_the_future(client):
    missing = client.download_async("00000000-" + "0" * 32)
    with pytest.raises(lossd.NotFound):
        missing.result(timeout=60)
    assert isinstance(missing.exception(), lossd.NotFound)
    logits = random_logits(4, 10)
    bad = client.forward_async(logits, np.array([0, 1, 2, 10]))  # a target outside [0, V)
    with pytest.raises(lossd.InvalidArgument):
        bad.result(timeout=60)
    # the upload made for the failed call was released (the fixture checks the server is empty)


def test_cancel_before_start(client):
    """A future still queued is cancelled without reaching the server."""
    gate = threading.Event()
    logits = random_logits(4, 10)
    # Occupy every worker with uploads whose source waits on the gate.
    def held(offset, size, scratch):
        gate.wait(60)
        scratch[:] = logits.tobytes()[offset:offset + size]
    blockers = [lossd._futures.submit(client, lambda: client.upload_from(
                    held, "float32", [4, 10]).handle) for _ in range(lossd._futures._WORKERS)]
    queued = client.upload_async(logits)
    assert queued.cancel() and queued.cancelled()
    gate.set()
    for blocker in blockers:
        client.release(blocker.result(timeout=60))
    with pytest.raises(concurrent.futures.CancelledError):
        queued.result(timeout=1)
    assert client.list().tensors == []


def test_cancel_while_running_leaves_nothing(client):
    """gRPC's semantics: a running call can be cancelled; result() raises CancelledError and the
    tensor the call stored is released when it returns."""
    inside = threading.Event()
    gate = threading.Event()
    logits = random_logits(64, 100)
    data = logits.tobytes()

    def source(offset, size, scratch):
        inside.set()
        gate.wait(60)
        scratch[:] = data[offset:offset + size]

    running = lossd._futures.submit(
        client, lambda: client.upload_from(source, "float32", [64, 100]),
        undo=lambda info: client.release(info.handle))
    assert inside.wait(60) and running.running()
    assert running.cancel() and running.cancelled()
    with pytest.raises(concurrent.futures.CancelledError):
        running.result(timeout=1)
    gate.set()
    assert running._settled.wait(60)  # the call returned on its thread and undid itself
    assert client.list().tensors == []


def test_cancel_running_forward_of_a_buffer(client):
    """A forward of a buffer cancelled while running: its uploaded logits (holding the gradient)
    are released when the call returns."""
    logits = random_logits(2048, 2048)
    targets = np.zeros(2048, dtype=np.int64)
    future = client.forward_async(logits, targets)
    cancelled = future.cancel()
    if not cancelled:  # it finished before the cancel: then the caller owns the gradient
        client.release(future.result().gradient)
    else:
        with pytest.raises(concurrent.futures.CancelledError):
            future.result(timeout=60)
    assert future._settled.wait(60)
    assert client.list().tensors == []


def test_deadline_fails_the_call(server):
    """Client(deadline=) bounds each call, futures' included: a call that cannot finish in time
    raises DeadlineExceeded through its future, and nothing stays."""
    with lossd.Client(server.address, deadline=1e-4) as hurried:
        future = hurried.upload_async(random_logits(1024, 4096))
        with pytest.raises(lossd.DeadlineExceeded):
            future.result(timeout=60)
    with lossd.Client(server.address) as client:
        assert client.list().tensors == []


def test_close_cancels_queued_futures(server):
    client = lossd.Client(server.address)
    gate = threading.Event()
    blockers = [lossd._futures.submit(client, lambda: gate.wait(60))
                for _ in range(lossd._futures._WORKERS)]
    queued = client.upload_async(random_logits(2, 2))
    client.close()
    # close() cancels every future of the client: queued ones never start, running ones are
    # cancelled as gRPC cancels a call and undone when they return.
    assert queued.cancelled() and all(blocker.cancelled() for blocker in blockers)
    gate.set()
    for future in blockers + [queued]:
        assert future._settled.wait(60)
    with pytest.raises(ValueError, match="closed"):
        client.upload_async(random_logits(2, 2))


@pytest.mark.parametrize("requires_grad", [True, False])
def test_cross_entropy_async_matches_torch(client, requires_grad):
    torch.manual_seed(0)
    logits = torch.randn(32, 77, requires_grad=requires_grad)
    targets = torch.randint(0, 77, (32,))
    pending = lossd.torch.cross_entropy_async(logits, targets, client=client,
                                              label_smoothing=0.1)
    expected = F.cross_entropy(logits, targets, label_smoothing=0.1)
    loss = pending.result(timeout=60)
    assert pending.done() and pending.result() is loss
    torch.testing.assert_close(loss, expected.detach() if not requires_grad else expected,
                               rtol=1e-5, atol=1e-6)
    assert loss.requires_grad == requires_grad
    if requires_grad:
        (loss * 2).backward()
        reference = logits.detach().clone().requires_grad_()
        (F.cross_entropy(reference, targets, label_smoothing=0.1) * 2).backward()
        torch.testing.assert_close(logits.grad, reference.grad, rtol=1e-5, atol=1e-6)


def test_cross_entropy_async_overlaps_micro_batches(client):
    """Four micro-batches in flight at once, collected in order, each with its own gradient."""
    torch.manual_seed(1)
    batches = [(torch.randn(64, 300, requires_grad=True), torch.randint(0, 300, (64,)))
               for _ in range(4)]
    pending = [lossd.torch.cross_entropy_async(x, t, client=client, reduction="sum")
               for x, t in batches]
    total = sum(p.result(timeout=60) for p in pending)
    total.backward()
    for x, t in batches:
        reference = x.detach().clone().requires_grad_()
        F.cross_entropy(reference, t, reduction="sum").backward()
        torch.testing.assert_close(x.grad, reference.grad, rtol=1e-5, atol=1e-6)


def test_cross_entropy_async_cancelled_or_dropped_leaves_nothing(client):
    logits = torch.randn(16, 40, requires_grad=True)
    targets = torch.randint(0, 40, (16,))
    cancelled = lossd.torch.cross_entropy_async(logits, targets, client=client)
    if cancelled.cancel():
        with pytest.raises(concurrent.futures.CancelledError):
            cancelled.result(timeout=60)
    else:
        cancelled.result()  # already done: dropped below
    assert cancelled.future._settled.wait(60)
    dropped = lossd.torch.cross_entropy_async(logits, targets, client=client)
    dropped.future.result(timeout=60)  # done, but its loss never collected
    del cancelled, dropped
    gc.collect()  # the server's gradient is released with the last reference to it
    assert client.list().tensors == []


def test_cross_entropy_async_error(client):
    logits = torch.randn(4, 10, requires_grad=True)
    pending = lossd.torch.cross_entropy_async(logits, torch.tensor([0, 1, 2, 99]), client=client)
    with pytest.raises(lossd.InvalidArgument):
        pending.result(timeout=60)
    with pytest.raises(ValueError):  # shapes are checked before anything is sent
        lossd.torch.cross_entropy_async(logits, torch.tensor([0]), client=client)
