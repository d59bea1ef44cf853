"""lossd.torch.linear_cross_entropy and Client.linear_forward against torch in float64
(F.linear + F.cross_entropy) on a real lossd (CPU device): the loss, dX from loss.backward(), the
weight and bias gradients read with the client, micro-batch accumulation, overwrite uploads of the
weight, the loss-only path, the precision option (FAST computes the same on the CPU), and
Client.linear_evaluate (hidden states streamed against the stored weight)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import lossd
import lossd.torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
RTOL = {"fp32": 1e-4, "bf16": 2 ** -6}


def make_case(dtype, rows=20, width=16, vocab=37, seed=0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, width, generator=generator).to(dtype)
    weight = (0.5 * torch.randn(vocab, width, generator=generator)).to(dtype)
    bias = (0.1 * torch.randn(vocab, generator=generator)).to(dtype)
    target = torch.randint(0, vocab, (rows,), generator=generator)
    target[::7] = -100
    return hidden, weight, bias, target


def oracle(hidden, weight, bias, target, **options):
    """Loss and gradients in float64 from the (rounded) inputs."""
    x = hidden.double().requires_grad_()
    w = weight.double().requires_grad_()
    b = bias.double().requires_grad_() if bias is not None else None
    loss = F.cross_entropy(F.linear(x, w, b), target, **options)
    loss.sum().backward()
    return loss.detach(), x.grad, w.grad, (b.grad if b is not None else None)


def host(tensor):
    """A numpy view for upload (bf16 as int16 bits)."""
    tensor = tensor.contiguous()
    return tensor.view(torch.int16).numpy() if tensor.dtype == torch.bfloat16 else tensor.numpy()


def upload(client, tensor):
    name = {torch.float32: "float32", torch.bfloat16: "bf16"}[tensor.dtype]
    return client.upload(host(tensor), dtype=name).handle


def close(got, want, rtol, what):
    got = got.detach().double() if isinstance(got, torch.Tensor) else \
        torch.as_tensor(np.asarray(got)).double()
    scale = want.abs().max().item()
    error = (got - want).abs().max().item()
    assert error <= rtol * max(scale, 1e-3), "%s: max error %g, scale %g" % (what, error, scale)


@pytest.mark.parametrize("name", sorted(DTYPES))
@pytest.mark.parametrize("with_bias", [False, True])
def test_autograd_matches_torch(client, name, with_bias):
    dtype = DTYPES[name]
    hidden, weight, bias, target = make_case(dtype, seed=1 + with_bias)
    weight_handle = upload(client, weight)
    bias_handle = upload(client, bias) if with_bias else None
    x = hidden.clone().requires_grad_()
    loss = lossd.torch.linear_cross_entropy(x, weight_handle, target, client=client,
                                            bias_handle=bias_handle)
    assert loss.dtype == dtype and loss.shape == ()
    loss.backward()
    want_loss, want_dx, want_dw, want_db = oracle(hidden, weight, bias if with_bias else None,
                                                  target)
    close(loss.detach(), want_loss, RTOL[name], "loss")
    assert x.grad.dtype == dtype and x.grad.shape == hidden.shape
    close(x.grad, want_dx, RTOL[name], "dX")
    dw = client.download(loss.weight_grad_handle)
    assert dw.dtype == np.float32 and dw.shape == tuple(weight.shape)
    close(dw, want_dw, RTOL[name], "dW")
    if with_bias:
        close(client.download(loss.bias_grad_handle), want_db, RTOL[name], "dbias")
        client.release(loss.bias_grad_handle)
        client.release(bias_handle)
    else:
        assert loss.bias_grad_handle is None
    client.release(loss.weight_grad_handle)
    client.release(weight_handle)


def test_micro_batches_add_into_one_accumulator(client):
    hidden, weight, bias, target = make_case(torch.float32, rows=32, seed=3)
    weight_handle = upload(client, weight)
    valid = int((target != -100).sum())
    handle = None
    grads = []
    for part in range(4):
        x = hidden[part * 8:(part + 1) * 8].clone().requires_grad_()
        loss = lossd.torch.linear_cross_entropy(
            x, weight_handle, target[part * 8:(part + 1) * 8], client=client,
            weight_grad_handle=handle, normalizer=valid)
        loss.backward()
        assert handle is None or loss.weight_grad_handle == handle
        handle = loss.weight_grad_handle
        grads.append(x.grad)
    _, want_dx, want_dw, _ = oracle(hidden, weight, None, target)
    close(torch.cat(grads), want_dx, 1e-4, "dX")
    close(client.download(handle), want_dw, 1e-4, "dW of 4 micro-batches")
    # bf16 download of the fp32 accumulator (Download's conversion).
    assert client.download(handle, dtype="bf16").shape == tuple(weight.shape)
    client.release(handle)
    client.release(weight_handle)


def test_overwrite_updates_the_weight_in_place(client):
    hidden, weight, _, target = make_case(torch.float32, seed=4)
    weight_handle = upload(client, weight)
    used = client.info().used_bytes
    updated = weight - 0.1 * torch.ones_like(weight)
    info = client.upload(host(updated), overwrite=weight_handle)
    assert info.handle == weight_handle and client.info().used_bytes == used
    with torch.no_grad():
        loss = lossd.torch.linear_cross_entropy(hidden, weight_handle, target, client=client)
    close(loss, oracle(hidden, updated, None, target)[0], 1e-4, "loss after overwrite")
    with pytest.raises(lossd.InvalidArgument):
        client.upload(np.zeros((3, 3), np.float32), overwrite=weight_handle)
    client.release(weight_handle)


@pytest.mark.parametrize("data_connection", [True, False], ids=["data_connections", "stripes"])
def test_overwrite_of_a_size_that_stripes(server, data_connection):
    """A weight of at least stripe_min_bytes is overwritten as its upload went, over data
    connections or gRPC stripes: bit for bit, under the same handle, label and memory."""
    rng = np.random.default_rng(9)
    weight = rng.standard_normal((1024, 520)).astype(np.float32)  # 2 MiB: several pieces each
    with lossd.Client(server.address, piece_bytes=64 << 10, stripe_min_bytes=1 << 20,
                      data_connection=data_connection) as striping:
        handle = striping.upload(weight, label="head").handle
        used = striping.info().used_bytes
        updated = rng.standard_normal(weight.shape).astype(np.float32)
        info = striping.upload(updated, overwrite=handle)
        assert info.handle == handle and info.label == "head"
        assert striping.info().used_bytes == used
        np.testing.assert_array_equal(striping.download(handle), updated)
        with pytest.raises(lossd.InvalidArgument, match="shape"):
            striping.upload(np.ascontiguousarray(updated.T), overwrite=handle)
        with pytest.raises(lossd.NotFound):
            striping.upload(updated, overwrite="00000000-0123456789abcdef0123456789abcdef")
        np.testing.assert_array_equal(striping.download(handle), updated)
        striping.release(handle)


def test_loss_only_leaves_nothing(client):
    hidden, weight, _, target = make_case(torch.float32, seed=5)
    weight_handle = upload(client, weight)
    before = client.info().tensors
    loss = lossd.torch.linear_cross_entropy(hidden, weight_handle, target, client=client,
                                            reduction="sum")
    close(loss, oracle(hidden, weight, None, target, reduction="sum")[0], 1e-4, "sum loss")
    per_row = lossd.torch.linear_cross_entropy(hidden, weight_handle, target, client=client,
                                               reduction="none")
    close(per_row, oracle(hidden, weight, None, target, reduction="none")[0], 1e-4, "per row")
    assert client.info().tensors == before
    client.release(weight_handle)


def test_client_linear_forward_out_of_place_and_errors(client):
    hidden, weight, bias, target = make_case(torch.float32, seed=6)
    weight_handle = upload(client, weight)
    bias_handle = upload(client, bias)
    hidden_handle = upload(client, hidden)
    result = client.linear_forward(hidden_handle, weight_handle, target.numpy(),
                                   bias=bias_handle, mode="out_of_place", accumulate="overwrite",
                                   grad_scale=0.5)
    want_loss, want_dx, want_dw, want_db = oracle(hidden, weight, bias, target)
    close(result.loss, want_loss, 1e-4, "loss")
    assert result.gradient not in ("", hidden_handle)
    close(client.download(result.gradient), 0.5 * want_dx, 1e-4, "dX")
    close(client.download(result.weight_grad), 0.5 * want_dw, 1e-4, "dW")
    close(client.download(result.bias_grad), 0.5 * want_db, 1e-4, "dbias")
    assert client.describe(hidden_handle).state == "LOGITS"
    with pytest.raises(lossd.InvalidArgument):
        client.linear_forward(hidden_handle, hidden_handle, target.numpy())
    with pytest.raises(lossd.InvalidArgument):
        client.linear_forward(hidden_handle, weight_handle, target.numpy(),
                              weight_grad=bias_handle)
    with pytest.raises(lossd.InvalidArgument):
        client.linear_forward(hidden_handle, weight_handle, target.numpy(), accumulate="sum")
    for handle in (result.gradient, result.weight_grad, result.bias_grad, hidden_handle,
                   bias_handle, weight_handle):
        client.release(handle)


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_fast_precision_is_exact_on_the_cpu(client, name):
    # The CPU server computes in fp32 under either precision.
    dtype = DTYPES[name]
    hidden, weight, bias, target = make_case(dtype, seed=7)
    weight_handle = upload(client, weight)
    bias_handle = upload(client, bias)
    x = hidden.clone().requires_grad_()
    loss = lossd.torch.linear_cross_entropy(x, weight_handle, target, client=client,
                                            bias_handle=bias_handle, precision="fast")
    loss.backward()
    want_loss, want_dx, want_dw, want_db = oracle(hidden, weight, bias, target)
    close(loss.detach(), want_loss, RTOL[name], "loss")
    close(x.grad, want_dx, RTOL[name], "dX")
    close(client.download(loss.weight_grad_handle), want_dw, RTOL[name], "dW")
    close(client.download(loss.bias_grad_handle), want_db, RTOL[name], "dbias")
    for handle in (loss.weight_grad_handle, loss.bias_grad_handle, bias_handle, weight_handle):
        client.release(handle)


def test_unknown_precision_is_refused(client):
    hidden, weight, _, target = make_case(torch.float32, seed=8)
    weight_handle = upload(client, weight)
    hidden_handle = upload(client, hidden)
    result = client.linear_forward(hidden_handle, weight_handle, target.numpy(), mode="none",
                                   precision="fast")
    close(result.loss, oracle(hidden, weight, None, target)[0], 1e-4, "loss")
    with pytest.raises(lossd.InvalidArgument, match="precision"):
        client.linear_forward(hidden_handle, weight_handle, target.numpy(), precision="half")
    with pytest.raises(ValueError, match="precision"):
        lossd.torch.linear_cross_entropy(hidden, weight_handle, target, client=client,
                                         precision="half")
    assert client.describe(hidden_handle).state == "LOGITS"
    client.release(hidden_handle)
    client.release(weight_handle)


# Client.linear_evaluate: hidden states streamed against the stored weight, nothing stored.
EVALUATE_OPTIONS = [
    {},
    {"reduction": "sum", "label_smoothing": 0.1},
    {"label_smoothing": 0.2, "class_weights": True},
    {"ignore_index": 3},
]


@pytest.mark.parametrize("name", sorted(DTYPES))
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("which", range(len(EVALUATE_OPTIONS)))
def test_linear_evaluate_matches_torch(client, name, with_bias, which):
    dtype = DTYPES[name]
    hidden, weight, bias, target = make_case(dtype, rows=45, seed=20 + which)
    options = dict(EVALUATE_OPTIONS[which])
    if "ignore_index" in options:
        target[target == -100] = options["ignore_index"]
    class_weights = None
    if options.pop("class_weights", False):
        generator = torch.Generator().manual_seed(9)
        class_weights = torch.rand(weight.shape[0], generator=generator) + 0.5
    weight_handle = upload(client, weight)
    bias_handle = upload(client, bias) if with_bias else ""
    try:
        before = client.info()
        result = client.linear_evaluate(
            hidden, weight_handle, target.numpy(), bias=bias_handle, block_rows=8,
            class_weights=None if class_weights is None else class_weights.numpy(), **options)
        after = client.info()
    finally:
        for handle in (weight_handle, bias_handle):
            if handle:
                client.release(handle)
    logits = F.linear(hidden.double(), weight.double(), bias.double() if with_bias else None)
    want = F.cross_entropy(logits, target, **options,
                           weight=None if class_weights is None else class_weights.double())
    close(result.loss, want, 1e-5 if name == "fp32" else 1e-4, "loss")
    assert result.rows == 45
    assert (after.tensors, after.used_bytes) == (before.tensors, before.used_bytes)


def test_linear_evaluate_is_linear_forward_without_gradient(client):
    hidden, weight, bias, target = make_case(torch.bfloat16, rows=33, seed=30)
    weight_handle = upload(client, weight)
    bias_handle = upload(client, bias)
    hidden_handle = upload(client, hidden)
    stored = client.linear_forward(hidden_handle, weight_handle, target.numpy(),
                                   bias=bias_handle, mode="none", label_smoothing=0.05)
    streamed = client.linear_evaluate(hidden, weight_handle, target.numpy(), bias=bias_handle,
                                      label_smoothing=0.05, block_rows=5)
    assert streamed.loss == pytest.approx(stored.loss, rel=1e-6)
    assert (streamed.valid_tokens, streamed.correct_tokens) == \
        (stored.valid_tokens, stored.correct_tokens)
    for handle in (hidden_handle, bias_handle, weight_handle):
        client.release(handle)


def test_linear_evaluate_post_training_is_linear_forward_without_gradient(client):
    """A top-k distillation with segments, and PPO, over hidden states: the rows' teacher, policy
    inputs and segment ids go in the blocks; the numbers are LinearForward's without a gradient."""
    hidden, weight, bias, target = make_case(torch.float32, rows=21, seed=32)
    rows, vocab = hidden.shape[0], weight.shape[0]
    generator = torch.Generator().manual_seed(33)
    indices = torch.stack([torch.randperm(vocab, generator=generator)[:4] for _ in range(rows)])
    logprobs = torch.log_softmax(torch.randn(rows, 4, generator=generator), -1) - 0.2
    segments = (torch.arange(rows) // 8).to(torch.int32)
    advantages = torch.randn(rows, generator=generator)
    old_logprobs = -2.0 - torch.rand(rows, generator=generator)
    weight_handle, bias_handle, hidden_handle = (upload(client, t) for t in (weight, bias, hidden))
    losses = [
        dict(teacher=(indices.to(torch.int32).numpy(), logprobs.float().numpy()),
             temperature=2.0, alpha=0.25, top_k_tail="bucket"),
        dict(policy_loss="ppo", advantages=advantages.numpy(), old_logprobs=old_logprobs.numpy()),
    ]
    try:
        for loss in losses:
            common = dict(bias=bias_handle, segments=segments.numpy(), num_segments=3, **loss)
            stored = client.linear_forward(hidden_handle, weight_handle, target.numpy(),
                                           mode="none", **common)
            streamed = client.linear_evaluate(hidden.numpy(), weight_handle, target.numpy(),
                                              block_rows=5, **common)
            want = stored.forward
            assert streamed.loss == pytest.approx(want.loss, rel=1e-6)
            assert streamed.distillation_loss == pytest.approx(want.distillation_loss,
                                                               rel=1e-6, abs=1e-12)
            assert list(streamed.segment_tokens) == list(want.segment_tokens)
            assert list(streamed.segment_loss) == pytest.approx(list(want.segment_loss),
                                                                rel=1e-6)
            assert streamed.policy_stats.ratio_sum == pytest.approx(
                want.policy_stats.ratio_sum, rel=1e-6)
        with pytest.raises(TypeError, match="linear_evaluate.*token_logprob"):
            client.linear_evaluate(hidden.numpy(), weight_handle, target.numpy(),
                                   token_logprob=True)
    finally:
        for handle in (hidden_handle, bias_handle, weight_handle):
            client.release(handle)


def test_linear_evaluate_errors(client):
    hidden, weight, _, target = make_case(torch.bfloat16, seed=31)
    weight_handle = upload(client, weight)
    with pytest.raises(lossd.InvalidArgument, match="header.logits_dtype is DTYPE_FLOAT32 but "
                                                    "header.weight is bfloat16"):
        client.linear_evaluate(hidden.float(), weight_handle, target.numpy())
    with pytest.raises(lossd.InvalidArgument, match="whole number of rows"):
        client.linear_evaluate(hidden[:, :-1].contiguous(), weight_handle, target.numpy())
    unknown = weight_handle[:-1] + ("b" if weight_handle[-1] == "a" else "a")
    with pytest.raises(lossd.NotFound, match="header.weight: unknown handle"):
        client.linear_evaluate(hidden, unknown, target.numpy())
    with pytest.raises(lossd.NotFound, match="header.bias: unknown handle"):
        client.linear_evaluate(hidden, weight_handle, target.numpy(), bias=unknown)
    with pytest.raises(lossd.InvalidArgument, match="weight must name"):
        client.linear_evaluate(hidden, "", target.numpy())
    assert "linear_evaluate(" in lossd.Client.linear_evaluate.__doc__
    client.release(weight_handle)
