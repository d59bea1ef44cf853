"""lossd.torch.cross_entropy against torch.nn.functional.cross_entropy: the loss and the gradient
that loss.backward() gives, for every option, reduction and logits dtype, on a real lossd (CPU
device). The oracle is F.cross_entropy in float64 on the same (rounded) logits."""

import contextlib
import gc
import types

import pytest
import torch
import torch.nn.functional as F

import lossd
import lossd.torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# One rounding of a value to the dtype, twice over (the server rounds the gradient once, and
# once more when a grad_output other than 1 is applied at download).
RTOL = {"fp32": 2e-5, "bf16": 2 ** -7, "fp16": 2 ** -9}

OPTIONS = {
    "plain": {},
    "ignore_index": {"ignore_index": 3},
    "label_smoothing": {"label_smoothing": 0.1},
    "weight": {"weight": True},
    "all": {"ignore_index": 3, "label_smoothing": 0.2, "weight": True},
}


def make_case(dtype, rows=24, vocab=1001, seed=0, ignore_index=None):
    generator = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(rows, vocab, generator=generator)).to(dtype)
    target = torch.randint(0, vocab, (rows,), generator=generator)
    if ignore_index is not None:
        target[::5] = ignore_index  # some rows (and the target class 3 elsewhere) ignored
        target[1] = 3 if ignore_index != 3 else 4
    weight = torch.rand(vocab, generator=generator) + 0.5
    return logits, target, weight


def assert_close(actual, expected, name, reference_scale=None):
    rtol = RTOL[name]
    scale = expected.abs().max().item() if reference_scale is None else reference_scale
    torch.testing.assert_close(actual.double(), expected.double(), rtol=rtol,
                               atol=rtol * scale + 1e-12)


@pytest.mark.parametrize("name", sorted(DTYPES))
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_matches_torch(client, name, reduction, option):
    dtype = DTYPES[name]
    kwargs = dict(OPTIONS[option])
    logits, target, weight = make_case(dtype, ignore_index=kwargs.get("ignore_index"))
    if kwargs.pop("weight", False):
        kwargs["weight"] = weight

    x = logits.clone().requires_grad_()
    loss = lossd.torch.cross_entropy(x, target, client=client, reduction=reduction, **kwargs)
    reference_x = logits.double().requires_grad_()
    reference_kwargs = dict(kwargs)
    if "weight" in reference_kwargs:
        reference_kwargs["weight"] = weight.double()
    reference = F.cross_entropy(reference_x, target, reduction=reduction, **reference_kwargs)

    assert loss.dtype == dtype and loss.shape == reference.shape
    assert_close(loss, reference.to(dtype), name)
    if reduction == "none":
        grad_output = torch.rand(logits.shape[0], generator=torch.Generator().manual_seed(1))
        loss.backward(grad_output.to(dtype))
        reference.backward(grad_output.to(dtype).double())
    else:
        loss.backward(torch.tensor(0.75, dtype=dtype))
        reference.backward(torch.tensor(0.75, dtype=torch.float64))
    assert x.grad.dtype == dtype and x.grad.shape == logits.shape
    assert_close(x.grad, reference_x.grad.to(dtype), name)


def test_lossd_options_match_their_formulas(client):
    logits, target, _ = make_case(torch.float32, ignore_index=-100)
    z_loss_scale, softcap = 1e-3, 5.0
    x = logits.clone().requires_grad_()
    loss = lossd.torch.cross_entropy(x, target, client=client, z_loss_scale=z_loss_scale,
                                     softcap=softcap)
    loss.backward()
    reference_x = logits.double().requires_grad_()
    capped = softcap * torch.tanh(reference_x / softcap)
    valid = target != -100
    rows = F.cross_entropy(capped, target, reduction="none")
    rows = rows + z_loss_scale * torch.logsumexp(capped, dim=1) ** 2 * valid
    reference = rows.sum() / valid.sum()
    reference.backward()
    assert_close(loss, reference.float(), "fp32")
    assert_close(x.grad, reference_x.grad.float(), "fp32")


def test_normalizer_and_grad_scale(client):
    logits, target, _ = make_case(torch.float32)
    x = logits.clone().requires_grad_()
    loss = lossd.torch.cross_entropy(x, target, client=client, normalizer=100.0, grad_scale=0.5)
    loss.backward()
    reference_x = logits.double().requires_grad_()
    reference = F.cross_entropy(reference_x, target, reduction="sum") / 100.0
    (0.5 * reference).backward()
    assert_close(loss, reference.float(), "fp32")
    assert_close(x.grad, reference_x.grad.float(), "fp32")


def test_gradient_accumulates_into_existing_grad(client):
    logits, target, _ = make_case(torch.float32)
    x = logits.clone().requires_grad_()
    x.grad = torch.full_like(logits, 0.25)
    for step in range(3):
        lossd.torch.cross_entropy(x, target, client=client, label_smoothing=0.1).backward()
    reference_x = logits.double().requires_grad_()
    F.cross_entropy(reference_x, target, label_smoothing=0.1).backward()
    assert_close(x.grad, (0.25 + 3 * reference_x.grad).float(), "fp32")


def test_logits_used_twice_in_one_graph(client):
    logits, target, _ = make_case(torch.float32)
    x = logits.clone().requires_grad_()
    loss = (lossd.torch.cross_entropy(x, target, client=client) +
            2 * lossd.torch.cross_entropy(x * 2, target, client=client, reduction="sum"))
    loss.backward()
    reference_x = logits.double().requires_grad_()
    (F.cross_entropy(reference_x, target) +
     2 * F.cross_entropy(reference_x * 2, target, reduction="sum")).backward()
    assert_close(x.grad, reference_x.grad.float(), "fp32")


def test_single_sample_and_module(client):
    logits, target, weight = make_case(torch.float32, rows=1)
    x = logits[0].clone().requires_grad_()
    for reduction in ("mean", "none"):
        loss = lossd.torch.cross_entropy(x, target[0], client=client, reduction=reduction)
        reference = F.cross_entropy(x.detach().double(), target[0], reduction=reduction)
        assert loss.shape == reference.shape
        assert_close(loss, reference.float(), "fp32")
    module = lossd.torch.LossdCrossEntropyLoss(client, weight=weight, label_smoothing=0.1)
    logits, target, _ = make_case(torch.float32)
    x = logits.clone().requires_grad_()
    module(x, target).backward()
    reference_x = logits.double().requires_grad_()
    torch.nn.CrossEntropyLoss(weight=weight.double(), label_smoothing=0.1)(
        reference_x, target).backward()
    assert_close(x.grad, reference_x.grad.float(), "fp32")


def test_mean_over_no_valid_rows_is_nan_as_in_torch(client):
    logits, _, _ = make_case(torch.float32)
    target = torch.full((logits.shape[0],), -100)
    x = logits.clone().requires_grad_()
    loss = lossd.torch.cross_entropy(x, target, client=client)
    assert torch.isnan(loss) and torch.isnan(F.cross_entropy(logits, target))
    loss.backward()
    assert torch.count_nonzero(x.grad) == 0


def test_without_gradient_nothing_stays(client):
    logits, target, _ = make_case(torch.float32)
    reference = F.cross_entropy(logits.double(), target).float()
    assert_close(lossd.torch.cross_entropy(logits, target, client=client), reference, "fp32")
    x = logits.clone().requires_grad_()
    with torch.no_grad():
        loss = lossd.torch.cross_entropy(x, target, client=client)
    assert loss.grad_fn is None
    assert_close(loss, reference, "fp32")
    assert client.list().tensors == []


def test_forward_without_backward_releases_on_collection(client):
    logits, target, _ = make_case(torch.float32)
    x = logits.clone().requires_grad_()
    loss = lossd.torch.cross_entropy(x, target, client=client)
    assert len(client.list().tensors) == 1
    del loss
    gc.collect()
    assert client.list().tensors == []


def test_backward_twice_is_an_error(client):
    logits, target, _ = make_case(torch.float32)
    x = logits.clone().requires_grad_()
    loss = lossd.torch.cross_entropy(x, target, client=client)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


def test_server_errors_surface_and_leave_nothing(client):
    logits, target, _ = make_case(torch.float32)
    target[0] = logits.shape[1] + 5  # outside [0, V)
    x = logits.clone().requires_grad_()
    with pytest.raises(lossd.InvalidArgument):
        lossd.torch.cross_entropy(x, target, client=client)
    assert client.list().tensors == []


def test_non_contiguous_logits(client):
    logits, target, _ = make_case(torch.float32)
    x = logits.t().contiguous().t().requires_grad_()  # a transposed leaf: strided
    assert not x.is_contiguous()
    loss = lossd.torch.cross_entropy(x, target, client=client)
    loss.backward()
    reference_x = logits.double().requires_grad_()
    reference = F.cross_entropy(reference_x, target)
    reference.backward()
    assert_close(loss, reference.float(), "fp32")
    assert_close(x.grad, reference_x.grad.float(), "fp32")


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="no CUDA device: the CUDA path of lossd.torch (upload_from with "
                           "device-to-host copies, download_to into the device) runs on a GPU "
                           "machine only")
@pytest.mark.parametrize("name", sorted(DTYPES))
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_cuda_tensors(server, name, reduction):
    with lossd.Client(server.address, piece_bytes=64 << 10, stripe_min_bytes=1 << 20) as client:
        dtype = DTYPES[name]
        logits, target, weight = make_case(dtype, rows=512, vocab=4099, ignore_index=-100)
        x = logits.cuda().requires_grad_()
        loss = lossd.torch.cross_entropy(x, target.cuda(), client=client, weight=weight.cuda(),
                                         reduction=reduction, label_smoothing=0.1)
        assert loss.device == x.device
        reference_x = logits.double().requires_grad_()
        reference = F.cross_entropy(reference_x, target, weight=weight.double(),
                                    reduction=reduction, label_smoothing=0.1)
        assert_close(loss.cpu(), reference.to(dtype), name)
        grad_output = torch.rand(reference.shape, dtype=torch.float64)
        loss.backward(grad_output.to(dtype).cuda())
        reference.backward(grad_output.to(dtype).double())
        assert x.grad.device == x.device and x.grad.dtype == dtype
        assert_close(x.grad.cpu(), reference_x.grad.to(dtype), name)
        assert client.list().tensors == []


class FakeCudart:
    """Stands in for torch.cuda.cudart() to record which host buffers would be registered."""

    def __init__(self):
        self.registered, self.unregistered = [], []

    def cudaHostRegister(self, address, size, flags):  # noqa: N802 (CUDA's name)
        self.registered.append((address, size, flags))
        return 0

    def cudaHostUnregister(self, address):  # noqa: N802
        self.unregistered.append(address)
        return 0


@pytest.mark.filterwarnings("ignore:The given buffer is not writable")  # as lossd.torch does
def test_device_transfer_pieces_on_the_cpu(server, monkeypatch):
    """The piece arithmetic of the CUDA path (byte offsets into the flat tensor, the scratch
    registration, its undoing at close), run with CPU tensors and the CUDA calls stubbed out,
    since no GPU is here; the real device copies run in test_cuda_tensors on a GPU machine."""
    cudart = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device=None: types.SimpleNamespace(synchronize=lambda: None))
    piece = 64 << 10
    client = lossd.Client(server.address, piece_bytes=piece, stripe_min_bytes=1 << 20)
    for dtype in (torch.float32, torch.bfloat16):
        logits, _, _ = make_case(dtype, rows=300, vocab=3001)  # pieces do not divide it
        info = lossd._torch_core._upload_from_device(client, logits, "logits")
        assert info.shape == (300, 3001)
        assert info.dtype == lossd._torch_core._DTYPE_NAMES[dtype]
        gradient = torch.empty_like(logits)
        lossd._torch_core._download_to_device(client, info.handle, gradient)
        assert torch.equal(gradient, logits)
        client.release(info.handle)
    assert cudart.registered and all(size == piece for _, size, _ in cudart.registered)
    assert len({address for address, _, _ in cudart.registered}) == len(cudart.registered)
    client.close()
    assert sorted(cudart.unregistered) == sorted(a for a, _, _ in cudart.registered)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grad_out_is_reused(client, dtype):
    """grad_out: the backward writes the gradient into the caller's tensor and hands that very
    tensor to autograd, step after step (no fresh memory per step)."""
    torch.manual_seed(3)
    buffer = torch.full((24, 70), float("nan"), dtype=dtype)
    for step in range(2):
        leaf = torch.randn(24, 70).to(dtype).requires_grad_()
        targets = torch.randint(0, 70, (24,))
        loss = lossd.torch.cross_entropy(leaf, targets, client=client, grad_out=buffer)
        (gradient,) = torch.autograd.grad(loss * 3.0, [leaf])
        assert gradient.data_ptr() == buffer.data_ptr()
        reference = leaf.detach().float().requires_grad_()
        (F.cross_entropy(reference, targets) * 3.0).backward()
        tolerance = 1e-6 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(buffer.float(), reference.grad, rtol=tolerance, atol=tolerance)
    with pytest.raises(ValueError, match="grad_out"):
        lossd.torch.cross_entropy(leaf, targets, client=client,
                                  grad_out=torch.empty(24, 71, dtype=dtype))
