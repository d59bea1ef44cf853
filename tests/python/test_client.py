"""lossd.Client against a real lossd (CPU device): uploads from every kind of buffer, downloads
into new arrays and callers' buffers, forward/backward/evaluate, metadata calls, and the
piece-wise upload_from / download_to with Python callbacks."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import lossd


def random_logits(rows, vocab, seed=0):
    return np.random.default_rng(seed).standard_normal((rows, vocab), dtype=np.float32)


def test_metadata_calls(client):
    assert client.health() is True
    assert client.health(lossd.LOSSD_SERVICE) is True
    info = client.info()
    assert info.device == "cpu" and info.budget_bytes > 0
    logits = random_logits(4, 10)
    stored = client.upload(logits, label="mine")
    assert (stored.dtype, stored.shape, stored.bytes, stored.state, stored.label) == (
        "float32", (4, 10), 160, "LOGITS", "mine")
    described = client.describe(stored.handle)
    assert described.handle == stored.handle and described.created > 0
    listed = client.list()
    assert [t.handle for t in listed.tensors] == [stored.handle]
    assert listed.server.used_bytes >= 160
    assert client.release(stored.handle) == 160
    assert client.target.startswith("127.0.0.1:")


@pytest.mark.parametrize("kind", ["numpy", "torch", "memoryview", "bytes"])
def test_upload_download_round_trip(client, kind):
    logits = random_logits(3, 7)
    data = {"numpy": logits, "torch": torch.from_numpy(logits), "memoryview": memoryview(logits),
            "bytes": logits.tobytes()}[kind]
    shape = (3, 7) if kind == "bytes" else None
    handle = client.upload(data, dtype="float32" if kind == "bytes" else None, shape=shape).handle
    np.testing.assert_array_equal(client.download(handle), logits)
    out = np.empty_like(logits)
    assert client.download(handle, out=out) is out
    np.testing.assert_array_equal(out, logits)
    out_tensor = torch.empty(3, 7)
    client.download(handle, out=out_tensor)
    np.testing.assert_array_equal(out_tensor.numpy(), logits)
    client.release(handle)


def test_dtypes_and_conversion(client):
    values = torch.from_numpy(random_logits(5, 9))
    bf16 = values.to(torch.bfloat16)
    handle = client.upload(bf16).handle  # a torch.bfloat16 tensor goes as bf16
    assert client.describe(handle).dtype == "bf16"
    bits = client.download(handle)
    assert bits.dtype == np.uint16
    assert torch.equal(torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16), bf16)
    as_float = client.download(handle, dtype="float32")  # the server converts
    assert as_float.dtype == np.float32
    np.testing.assert_array_equal(as_float, bf16.float().numpy())
    client.release(handle)
    # bf16 bits in a numpy uint16 array, with dtype given
    handle = client.upload(bf16.view(torch.int16).numpy().view(np.uint16), dtype="bf16").handle
    np.testing.assert_array_equal(client.download(handle, dtype=torch.float32),
                                  bf16.float().numpy())
    client.release(handle)
    half = values.half().numpy()
    handle = client.upload(half).handle
    assert client.describe(handle).dtype == "float16"
    np.testing.assert_array_equal(client.download(handle), half)
    client.release(handle)
    targets = np.arange(6, dtype=np.int32)
    handle = client.upload(targets).handle
    assert client.describe(handle).dtype == "int32"
    client.release(handle)


def test_refused_buffers(client):
    with pytest.raises(lossd.InvalidArgument, match="dtype"):
        client.upload(np.zeros((2, 3)))  # float64
    with pytest.raises(lossd.InvalidArgument):
        client.upload(np.zeros((2, 3), np.float32), shape=(2, 4))
    with pytest.raises(ValueError, match="contiguous"):
        client.upload(np.zeros((4, 4), np.float32)[:, ::2])  # not contiguous
    with pytest.raises(TypeError):
        client.upload(object())
    with pytest.raises(lossd.InvalidArgument, match="big-endian"):
        client.upload(np.zeros((2, 3), ">f4"))


def test_forward_backward_download(client):
    logits = random_logits(16, 33)
    targets = np.random.default_rng(1).integers(0, 33, 16)
    weight = np.random.default_rng(2).random(33, dtype=np.float32) + 0.5
    handle = client.upload(logits).handle
    result = client.forward(handle, targets, weight=weight, label_smoothing=0.1,
                            token_loss=True, token_lse=True, token_argmax=True)
    assert result.gradient == handle and result.valid_tokens == 16
    x = torch.from_numpy(logits).double().requires_grad_()
    reference = F.cross_entropy(x, torch.from_numpy(targets), weight=torch.from_numpy(weight).double(),
                                label_smoothing=0.1)
    reference.backward()
    assert result.loss == pytest.approx(reference.item(), rel=1e-5)
    assert result.token_loss.shape == (16,) and result.token_argmax.dtype == np.int32
    np.testing.assert_array_equal(result.token_argmax, logits.argmax(axis=1))
    backward = client.backward(handle, 0.5)
    assert backward.tensor.pending_scale == 0.5 and backward.tensor.state == "GRADIENT"
    np.testing.assert_allclose(client.download(handle), 0.5 * x.grad.numpy(), rtol=1e-4,
                               atol=1e-7)
    client.release(handle)

    # Out of place from a buffer: the logits stay; a per-token grad_output for reduction none.
    result = client.forward(client.upload(logits).handle, targets, reduction="none",
                            mode="out_of_place")
    scale = np.linspace(0, 1, 16, dtype=np.float32)
    client.backward(result.gradient, scale)
    x.grad = None
    (F.cross_entropy(x, torch.from_numpy(targets), reduction="none") *
     torch.from_numpy(scale).double()).sum().backward()
    np.testing.assert_allclose(client.download(result.gradient), x.grad.numpy(), rtol=1e-4,
                               atol=1e-7)
    for tensor in client.list().tensors:
        client.release(tensor.handle)


def test_evaluate(client):
    logits = random_logits(300, 50)
    targets = np.random.default_rng(3).integers(0, 50, 300)
    result = client.evaluate(logits, targets, block_rows=64)
    reference = F.cross_entropy(torch.from_numpy(logits).double(), torch.from_numpy(targets))
    assert result.rows == 300 and result.loss == pytest.approx(reference.item(), rel=1e-5)
    bf16 = torch.from_numpy(logits).bfloat16()
    result = client.evaluate(bf16, targets, reduction="sum")
    reference = F.cross_entropy(bf16.double(), torch.from_numpy(targets), reduction="sum")
    assert result.loss == pytest.approx(reference.item(), rel=1e-4)


# upload_from / download_to: odd sizes (pieces not dividing the tensor), pieces of the minimum
# size, and tensors above stripe_min_bytes, whose pieces run over several data connections.
PIECE = 64 << 10


@pytest.fixture(params=["data_connections", "grpc_stripes"])
def piece_client(server, request):
    with lossd.Client(server.address, piece_bytes=PIECE, stripe_min_bytes=1 << 20,
                      data_connection=request.param == "data_connections") as connected:
        yield connected
        assert connected.list().tensors == []


@pytest.mark.parametrize("rows,vocab", [(1, 1), (3, 12347), (37, 30011), (129, 2049)])
def test_upload_from_download_to_round_trip(piece_client, rows, vocab):
    logits = random_logits(rows, vocab, seed=rows)
    raw = logits.reshape(-1).view(np.uint8)
    calls = []

    def source(offset, size, scratch):
        assert size <= PIECE and size % 4 == 0 and len(scratch) == size
        calls.append((offset, size))
        scratch[:] = raw[offset:offset + size]

    stored = piece_client.upload_from(source, "float32", [rows, vocab])
    assert sorted(calls)[0][0] == 0 and sum(size for _, size in calls) == raw.size
    assert stored.shape == (rows, vocab)
    np.testing.assert_array_equal(piece_client.download(stored.handle), logits)

    received = np.zeros(raw.size, np.uint8)
    headers = []

    def sink(offset, data):
        assert data.readonly and len(data) <= PIECE
        received[offset:offset + len(data)] = np.frombuffer(data, np.uint8)

    info = piece_client.download_to(stored.handle, sink, on_header=headers.append)
    assert info.bytes == raw.size and headers[0].bytes == raw.size
    np.testing.assert_array_equal(received, raw)

    halves = np.zeros(rows * vocab, np.uint16)  # converted on the server: bf16 bits

    def sink_bf16(offset, data):
        halves[offset // 2:(offset + len(data)) // 2] = np.frombuffer(data, np.uint16)

    piece_client.download_to(stored.handle, sink_bf16, dtype="bf16")
    expected = torch.from_numpy(logits).bfloat16().view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(halves, expected.reshape(-1))
    piece_client.release(stored.handle)


def test_upload_from_with_returned_buffers(piece_client):
    logits = random_logits(40, 5000)
    raw = logits.reshape(-1).view(np.uint8)
    stored = piece_client.upload_from(lambda offset, size, scratch: raw[offset:offset + size],
                                      "float32", [40, 5000])
    np.testing.assert_array_equal(piece_client.download(stored.handle), logits)
    piece_client.release(stored.handle)

    def fill_and_return(offset, size, scratch):
        scratch[:] = raw[offset:offset + size]
        return scratch

    stored = piece_client.upload_from(fill_and_return, "float32", [40, 5000])
    np.testing.assert_array_equal(piece_client.download(stored.handle), logits)
    piece_client.release(stored.handle)
    with pytest.raises(ValueError, match="returned 4 bytes"):
        piece_client.upload_from(lambda offset, size, scratch: b"abcd", "float32", [40, 5000])


class Boom(Exception):
    pass


def test_callbacks_that_raise(piece_client):
    logits = random_logits(64, 20000)  # 5 MiB: several pieces on each data connection
    raw = logits.reshape(-1).view(np.uint8)

    def source(offset, size, scratch):
        if offset >= 3 * PIECE:
            raise Boom("source failed at %d" % offset)
        scratch[:] = raw[offset:offset + size]

    with pytest.raises(Boom, match="source failed"):
        piece_client.upload_from(source, "float32", [64, 20000])
    assert piece_client.list().tensors == []

    handle = piece_client.upload(logits).handle

    def sink(offset, data):
        raise Boom("sink failed")

    with pytest.raises(Boom, match="sink failed"):
        piece_client.download_to(handle, sink)
    with pytest.raises(Boom):
        piece_client.download_to(handle, lambda o, d: None,
                                 on_header=lambda info: (_ for _ in ()).throw(Boom("header")))
    # The tensor is intact and still downloadable.
    np.testing.assert_array_equal(piece_client.download(handle), logits)
    piece_client.release(handle)


def test_closed_client(server):
    client = lossd.Client(server.address)
    client.close()
    assert client.closed
    with pytest.raises(ValueError, match="closed"):
        client.health()


def test_docstrings():
    for method in ("upload", "upload_from", "download", "download_to", "forward", "backward",
                   "evaluate", "describe", "list", "release", "info", "health"):
        doc = getattr(lossd.Client, method).__doc__
        assert doc and method + "(" in doc, method
    assert "ignore_index" in lossd.Client.forward.__doc__
    assert "label_smoothing" in lossd.Client.forward.__doc__


def test_calls_from_several_threads(client):
    """One client shared by threads: each call runs on its own RPC, with the GIL released."""
    import threading

    logits = random_logits(64, 3001)
    errors = []

    def work(seed):
        try:
            for _ in range(5):
                handle = client.upload(logits * seed).handle
                np.testing.assert_array_equal(client.download(handle), logits * seed)
                client.forward(handle, np.arange(64))
                client.release(handle)
        except Exception as error:  # noqa: BLE001: reported below with its thread
            errors.append((seed, error))

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(1, 5)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert repr(client).startswith("lossd.Client('127.0.0.1:")
