"""lossd.torch.kl_div, jsd and policy_loss, cross_entropy's segments=, and Client.forward's and
evaluate's post-training keyword arguments on a real lossd (CPU device): the loss and the
gradient loss.backward() gives against a float64 torch implementation written here from
docs/api.md's formulas ("Post-training losses"), on the same (rounded) logits."""

import numpy as np
import pytest
import torch

import lossd
import lossd.torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# One rounding of the gradient to the dtype (the server computes in float64).
RTOL = {"fp32": 2e-5, "bf16": 2 ** -7, "fp16": 2 ** -9}


def make_logits(dtype, rows, vocab, seed, scale=2.0):
    generator = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(rows, vocab, generator=generator)).to(dtype)


def make_target(rows, vocab, seed, ignored=True):
    generator = torch.Generator().manual_seed(seed + 1000)
    target = torch.randint(0, vocab, (rows,), generator=generator)
    if ignored:
        target[::4] = -100
    return target


def assert_close(actual, expected, rtol):
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual.double(), expected.double(), rtol=rtol,
                               atol=rtol * scale + 1e-9)


def reduce(rows_loss, valid, reduction, segments=None, segment_reduction=None):
    """The reduction of docs/api.md over float64 per-row losses (0 for rows not counted)."""
    rows_loss = torch.where(valid, rows_loss, torch.zeros_like(rows_loss))
    if reduction == "none":
        return rows_loss
    if reduction == "sum":
        return rows_loss.sum()
    if segment_reduction is None:
        return rows_loss.sum() / max(int(valid.sum()), 1)
    count = int(segments.max()) + 1
    sums = torch.zeros(count, dtype=torch.float64).index_add(0, segments, rows_loss)
    tokens = torch.zeros(count, dtype=torch.float64).index_add(0, segments, valid.double())
    present = tokens > 0
    if segment_reduction == "seq_mean_token_mean":
        per = sums[present] / tokens[present]
    else:
        per = sums[present]
    return per.sum() / max(int(present.sum()), 1)


def divergence(logp, logq, kind, beta):
    """Sum over the last dimension of D(q, p) for bucket log-masses logp, logq."""
    p, q = logp.exp(), logq.exp()
    zero = torch.zeros_like(p)
    # docs/api.md (as TRL and Liger): JSD at beta 0 is forward KL, at 1 reverse KL, where the
    # mixture formula itself would give 0.
    if kind == "jsd" and beta in (0.0, 1.0):
        kind = "forward_kl" if beta == 0.0 else "reverse_kl"
    if kind == "forward_kl":
        return torch.where(q > 0, q * (logq - logp), zero).sum(-1)
    if kind == "reverse_kl":
        return torch.where(p > 0, p * (logp - logq), zero).sum(-1)
    m = beta * q + (1 - beta) * p
    logm = m.log()
    return (beta * torch.where(q > 0, q * (logq - logm), zero)
            + (1 - beta) * torch.where(p > 0, p * (logp - logm), zero)).sum(-1)


def reference_distillation(z, teacher, target, *, kind, beta, temperature, alpha, tail):
    """Per-row alpha * CE + (1 - alpha) * D and the row mask, in float64."""
    logp_tau = torch.log_softmax(z / temperature, -1)
    if isinstance(teacher, tuple):
        indices, logprobs = teacher
        logprobs = logprobs.double()
        gathered = logp_tau.gather(1, indices)
        if tail == "renormalize":
            logp_b = gathered - torch.logsumexp(gathered, -1, keepdim=True)
            logq_b = logprobs - torch.logsumexp(logprobs, -1, keepdim=True)
        else:
            outside = torch.ones_like(z, dtype=torch.bool).scatter(1, indices, False)
            p_tail = torch.where(outside, logp_tau.exp(), torch.zeros_like(z)).sum(-1)
            q_tail = (1 - logprobs.exp().sum(-1)).clamp(min=0)
            if indices.shape[1] < z.shape[1]:
                logp_b = torch.cat([gathered, p_tail.log().unsqueeze(1)], 1)
                logq_b = torch.cat([logprobs, q_tail.log().unsqueeze(1)], 1)
            else:
                logp_b, logq_b = gathered, logprobs
    else:
        logp_b = logp_tau
        logq_b = torch.log_softmax(teacher.double() / temperature, -1)
    rows = divergence(logp_b, logq_b, kind, beta)
    if target is None:
        return rows, torch.ones(z.shape[0], dtype=torch.bool), rows
    valid = target != -100
    ce = -torch.log_softmax(z, -1).gather(1, target.clamp(min=0).unsqueeze(1)).squeeze(1)
    return alpha * ce + (1 - alpha) * rows, valid, rows


def top_k_of(teacher_logits, k):
    logq = torch.log_softmax(teacher_logits.double(), -1)
    values, indices = logq.topk(k, -1)
    return indices, values.float()


@pytest.mark.parametrize("name", sorted(DTYPES))
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("temperature,alpha", [(1.0, 0.0), (2.0, 0.3)])
def test_kl_div_dense_teacher_matches_float64(client, name, reverse, temperature, alpha):
    dtype = DTYPES[name]
    rows, vocab = 12, 257
    logits = make_logits(dtype, rows, vocab, seed=1)
    teacher = make_logits(torch.float32, rows, vocab, seed=2)
    target = make_target(rows, vocab, seed=1)

    x = logits.clone().requires_grad_()
    loss = lossd.torch.kl_div(x, teacher, target, client=client, reverse=reverse,
                              temperature=temperature, alpha=alpha)
    loss.backward()

    z = logits.double().requires_grad_()
    per_row, valid, kd = reference_distillation(
        z, teacher, target, kind="reverse_kl" if reverse else "forward_kl", beta=0.5,
        temperature=temperature, alpha=alpha, tail=None)
    expected = reduce(per_row, valid, "mean")
    expected.backward()
    assert loss.dtype == dtype and loss.shape == ()
    assert loss.item() == pytest.approx(expected.item(), rel=RTOL[name] * 4, abs=1e-6)
    assert loss.distillation_loss == pytest.approx(reduce(kd, valid, "mean").item(), rel=1e-5)
    assert loss.valid_tokens == int(valid.sum())
    assert_close(x.grad, z.grad, RTOL[name])


@pytest.mark.parametrize("tail", ["renormalize", "bucket"])
@pytest.mark.parametrize("k", [1, 5, 31])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_jsd_top_k_teacher_matches_float64(client, tail, k, beta):
    rows, vocab = 10, 31
    logits = make_logits(torch.float32, rows, vocab, seed=3)
    indices, logprobs = top_k_of(make_logits(torch.float32, rows, vocab, seed=4), k)

    x = logits.clone().requires_grad_()
    loss = lossd.torch.jsd(x, (indices, logprobs), client=client, beta=beta, temperature=1.5,
                           top_k_tail=tail, reduction="sum")
    loss.backward()

    z = logits.double().requires_grad_()
    per_row, valid, _ = reference_distillation(
        z, (indices, logprobs), None, kind="jsd", beta=beta, temperature=1.5, alpha=0.0,
        tail=tail)
    expected = reduce(per_row, valid, "sum")
    expected.backward()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-6)
    assert_close(x.grad, z.grad, RTOL["fp32"])


def reference_policy(z, target, advantages, old, ref, *, loss_type, eps_low, eps_high, kl_coef):
    valid = target != -100
    logp = torch.log_softmax(z, -1).gather(1, target.clamp(min=0).unsqueeze(1)).squeeze(1)
    ratio = (logp - old.double()).exp()
    a = advantages.double()
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high)
    if loss_type == "importance_sampling":
        rows = -ratio * a
    elif loss_type == "ppo":
        rows = torch.maximum(-ratio * a, -clipped * a)
    else:
        rows = -clipped.detach() * a * logp
    if ref is not None:
        d = ref.double() - logp
        rows = rows + kl_coef * (d.exp() - d - 1)
    return rows, valid, logp, ratio


@pytest.mark.parametrize("loss_type", ["importance_sampling", "ppo", "cispo"])
@pytest.mark.parametrize("segment_reduction", [None, "seq_mean_token_sum",
                                               "seq_mean_token_mean"])
def test_policy_loss_matches_float64(client, loss_type, segment_reduction):
    rows, vocab = 16, 101
    logits = make_logits(torch.float32, rows, vocab, seed=5, scale=1.0)
    target = make_target(rows, vocab, seed=5)
    generator = torch.Generator().manual_seed(6)
    advantages = torch.randn(rows, generator=generator)
    logp = torch.log_softmax(logits.double(), -1).gather(
        1, target.clamp(min=0).unsqueeze(1)).squeeze(1)
    old = (logp + 0.3 * torch.randn(rows, generator=generator, dtype=torch.float64)).float()
    ref = (logp + 0.3 * torch.randn(rows, generator=generator, dtype=torch.float64)).float()
    # One ratio exactly at 1 (no clip), whatever the epsilons.
    old[1] = logp[1].float()
    segments = torch.tensor([0] * 3 + [1] * 6 + [3] * 7, dtype=torch.int64)  # 2 is empty
    seg = dict(segments=segments, segment_reduction=segment_reduction) if segment_reduction \
        else {}

    x = logits.clone().requires_grad_()
    loss = lossd.torch.policy_loss(x, target, advantages, old, client=client,
                                   loss_type=loss_type, ref_logprobs=ref, epsilon_low=0.2,
                                   epsilon_high=0.28, kl_coef=0.1, **seg)
    loss.backward()

    z = logits.double().requires_grad_()
    per_row, valid, ref_logp, ratio = reference_policy(
        z, target, advantages, old, ref, loss_type=loss_type, eps_low=0.2, eps_high=0.28,
        kl_coef=0.1)
    expected = reduce(per_row, valid, "mean", segments, segment_reduction)
    expected.backward()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-6)
    assert_close(x.grad, z.grad, RTOL["fp32"])
    stats = loss.policy_stats
    assert stats.ratio_sum == pytest.approx(ratio[valid].sum().item(), rel=1e-5)
    assert stats.approx_kl_sum == pytest.approx(
        (old.double() - ref_logp)[valid].sum().item(), rel=1e-5, abs=1e-5)
    if segment_reduction is not None:
        tokens = torch.zeros(4, dtype=torch.int64).index_add(0, segments, valid.long())
        assert loss.segment_tokens.tolist() == tokens.tolist()
        assert loss.segment_tokens[2] == 0


def test_cross_entropy_segments_give_per_document_sums(client):
    rows, vocab = 14, 53
    logits = make_logits(torch.float32, rows, vocab, seed=7)
    target = make_target(rows, vocab, seed=7)
    segments = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2], dtype=torch.int32)
    x = logits.clone().requires_grad_()
    loss = lossd.torch.cross_entropy(x, target, client=client, segments=segments,
                                     segment_reduction="seq_mean_token_mean")
    loss.backward()

    z = logits.double().requires_grad_()
    rows_loss = torch.nn.functional.cross_entropy(z, target, reduction="none")
    valid = target != -100
    expected = reduce(rows_loss, valid, "mean", segments.long(), "seq_mean_token_mean")
    expected.backward()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    assert_close(x.grad, z.grad, RTOL["fp32"])
    sums = torch.zeros(3, dtype=torch.float64).index_add(
        0, segments.long(), torch.where(valid, rows_loss, 0).detach())
    torch.testing.assert_close(loss.segment_loss, sums, rtol=1e-5, atol=1e-6)
    tokens = torch.zeros(3, dtype=torch.int64).index_add(0, segments.long(), valid.long())
    assert loss.segment_tokens.tolist() == tokens.tolist()


def test_without_gradient_nothing_stays(client):
    rows, vocab = 6, 17
    logits = make_logits(torch.float32, rows, vocab, seed=8)
    teacher = make_logits(torch.float16, rows, vocab, seed=9)
    with torch.no_grad():
        loss = lossd.torch.kl_div(logits.requires_grad_(), teacher, client=client)
    per_row, valid, _ = reference_distillation(
        logits.double(), teacher, None, kind="forward_kl", beta=0.5, temperature=1.0,
        alpha=0.0, tail=None)
    assert loss.item() == pytest.approx(reduce(per_row, valid, "mean").item(), rel=1e-5)
    assert client.list().tensors == []


def test_client_evaluate_with_teacher_and_segments_equals_forward(client):
    rows, vocab, k = 21, 29, 4
    logits = make_logits(torch.float32, rows, vocab, seed=10).numpy()
    target = make_target(rows, vocab, seed=10).numpy()
    indices, logprobs = top_k_of(make_logits(torch.float32, rows, vocab, seed=11), k)
    indices, logprobs = indices.numpy(), logprobs.numpy()
    segments = (torch.arange(rows) // 5).numpy()
    kwargs = dict(alpha=0.25, temperature=2.0, divergence="reverse_kl", top_k_tail="bucket",
                  segment_reduction="seq_mean_token_sum")
    forward = client.forward(logits, target, mode="none", teacher=(indices, logprobs),
                             segments=segments, **kwargs)
    assert client.list().tensors == []  # the logits uploaded for the call were released
    for block_rows in (1, 6, 0):
        evaluated = client.evaluate(logits, target, teacher=(indices, logprobs),
                                    segments=segments, block_rows=block_rows, **kwargs)
        assert evaluated.rows == rows
        assert evaluated.loss == pytest.approx(forward.loss, rel=1e-9)
        assert evaluated.distillation_loss == pytest.approx(forward.distillation_loss, rel=1e-9)
        assert evaluated.segment_tokens.tolist() == forward.segment_tokens.tolist()
        assert evaluated.segment_loss == pytest.approx(forward.segment_loss, rel=1e-9)


def test_client_evaluate_with_policy_equals_forward(client):
    """Evaluate's policy metrics (loss, statistics, segments) over blocks of any size are
    Forward's in mode none over the same rows; advantages without a policy_loss are refused."""
    rows, vocab = 19, 17
    logits = make_logits(torch.float32, rows, vocab, seed=40)
    target = make_target(rows, vocab, seed=40)
    generator = torch.Generator().manual_seed(41)
    logp = torch.log_softmax(logits.double(), -1).gather(
        1, target.clamp(min=0).unsqueeze(1)).squeeze(1)
    old = (logp + 0.3 * torch.randn(rows, generator=generator, dtype=torch.float64)).float()
    ref = (logp + 0.2 * torch.randn(rows, generator=generator, dtype=torch.float64)).float()
    advantages = torch.randn(rows, generator=generator).numpy()
    segments = (torch.arange(rows) // 4).numpy()
    kwargs = dict(policy_loss="ppo", advantages=advantages, old_logprobs=old.numpy(),
                  ref_logprobs=ref.numpy(), kl_coef=0.05, epsilon_high=0.28,
                  segments=segments, segment_reduction="seq_mean_token_mean")
    forward = client.forward(logits.numpy(), target.numpy(), mode="none", **kwargs)
    for block_rows in (1, 5, 0):
        evaluated = client.evaluate(logits.numpy(), target.numpy(), block_rows=block_rows,
                                    **kwargs)
        assert evaluated.rows == rows
        assert evaluated.loss == pytest.approx(forward.loss, rel=1e-9)
        assert evaluated.valid_tokens == forward.valid_tokens
        got, want = evaluated.policy_stats, forward.policy_stats
        assert got.clipped_tokens == want.clipped_tokens
        for name in ("ratio_sum", "approx_kl_sum", "kl_sum", "entropy_sum"):
            assert getattr(got, name) == pytest.approx(getattr(want, name), rel=1e-9)
        assert evaluated.segment_loss == pytest.approx(forward.segment_loss, rel=1e-9)
    with pytest.raises(lossd.InvalidArgument, match="need a policy_loss"):
        client.evaluate(logits.numpy(), target.numpy(), advantages=advantages)
    with pytest.raises(lossd.InvalidArgument, match="not finite"):
        client.evaluate(logits.numpy(), target.numpy(), policy_loss="cispo",
                        advantages=np.full(rows, np.nan, np.float32),
                        old_logprobs=old.numpy())


def test_client_forward_policy_outputs_and_async(client):
    rows, vocab = 8, 19
    logits = make_logits(torch.float32, rows, vocab, seed=12)
    target = make_target(rows, vocab, seed=12, ignored=False)
    logp = torch.log_softmax(logits.double(), -1).gather(1, target.unsqueeze(1)).squeeze(1)
    entropy = -(torch.softmax(logits.double(), -1) * torch.log_softmax(logits.double(), -1)).sum(-1)
    handle = client.upload(logits.numpy()).handle
    future = client.forward_async(
        handle, target.numpy(), mode="none", policy_loss="importance_sampling",
        advantages=torch.ones(rows).numpy(), old_logprobs=logp.float().numpy(),
        token_logprob=True, token_entropy=True, reduction="sum")
    result = future.result()
    client.release(handle)
    assert result.loss == pytest.approx(-rows, rel=1e-5)
    assert result.policy_stats.ratio_sum == pytest.approx(rows, rel=1e-5)
    torch.testing.assert_close(torch.from_numpy(result.token_logprob).double(), logp,
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.from_numpy(result.token_entropy).double(), entropy,
                               rtol=1e-5, atol=1e-5)
    assert result.token_ratio is None and result.token_clipped is None


def test_client_forward_token_ratio_and_clipped(client):
    """PPO's per-token ratio and clip flag: ratios of e^0.5, 1 and e^-0.5 against epsilon 0.2,
    with advantages that clip the first (A > 0 past 1 + eps) and the last (A < 0 below 1 - eps)."""
    rows, vocab = 4, 7
    logits = make_logits(torch.float32, rows, vocab, seed=21)
    target = make_target(rows, vocab, seed=21, ignored=False)
    target[2] = -100
    logp = torch.log_softmax(logits.double(), -1).gather(
        1, target.clamp(min=0).unsqueeze(1)).squeeze(1)
    shift = torch.tensor([0.5, 0.0, 0.0, -0.5], dtype=torch.float64)
    old = (logp - shift).float()
    ratio = torch.exp(logp - old.double())
    result = client.forward(
        logits.numpy(), target.numpy(), mode="none", policy_loss="ppo",
        advantages=np.array([1.0, 1.0, 1.0, -1.0], np.float32), old_logprobs=old.numpy(),
        token_ratio=True)
    assert result.token_clipped.dtype == np.bool_
    assert result.token_clipped.tolist() == [True, False, False, True]
    expected = torch.where(target >= 0, ratio, torch.zeros((), dtype=torch.float64))
    torch.testing.assert_close(torch.from_numpy(result.token_ratio).double(), expected,
                               rtol=1e-5, atol=1e-6)
    assert result.policy_stats.clipped_tokens == 2


def test_bad_arguments_raise_invalid_argument(client):
    rows, vocab = 4, 9
    logits = make_logits(torch.float32, rows, vocab, seed=13).requires_grad_()
    target = make_target(rows, vocab, seed=13, ignored=False)
    indices = torch.randint(0, vocab, (rows, vocab + 1))
    with pytest.raises(lossd.InvalidArgument):  # k > V
        lossd.torch.kl_div(logits, (indices, torch.full((rows, vocab + 1), -3.0)),
                           client=client)
    with pytest.raises(lossd.InvalidArgument):  # a NaN advantage
        lossd.torch.policy_loss(logits, target, torch.tensor([1.0, float("nan"), 0.0, 1.0]),
                                torch.full((rows,), -2.0), client=client)
    with pytest.raises(lossd.InvalidArgument):
        client.forward(logits.detach().numpy(), target.numpy(), policy_loss="grpo",
                       advantages=torch.ones(rows).numpy(),
                       old_logprobs=torch.ones(rows).numpy())


@pytest.mark.parametrize("requires_grad", [True, False])
def test_async_variants_equal_the_blocking_ones(client, requires_grad):
    rows, vocab = 10, 41
    logits = make_logits(torch.float32, rows, vocab, seed=14)
    teacher = make_logits(torch.bfloat16, rows, vocab, seed=15)
    target = make_target(rows, vocab, seed=14)
    segments = torch.arange(rows) // 4
    advantages = torch.linspace(-1, 1, rows)
    old = torch.full((rows,), -3.5)
    calls = [
        (lossd.torch.kl_div, lossd.torch.kl_div_async, (teacher, target),
         dict(temperature=2.0, alpha=0.5)),
        (lossd.torch.jsd, lossd.torch.jsd_async, (teacher,), dict(beta=0.3)),
        (lossd.torch.policy_loss, lossd.torch.policy_loss_async, (target, advantages, old),
         dict(loss_type="cispo", segments=segments, segment_reduction="seq_mean_token_mean")),
        (lossd.torch.cross_entropy, lossd.torch.cross_entropy_async, (target,),
         dict(segments=segments)),
    ]
    for blocking, asynchronous, args, kwargs in calls:
        x = logits.clone().requires_grad_(requires_grad)
        expected = blocking(x, *args, client=client, **kwargs)
        y = logits.clone().requires_grad_(requires_grad)
        got = asynchronous(y, *args, client=client, **kwargs).result()
        assert got.item() == expected.item(), blocking.__name__
        if "segments" in kwargs:
            assert torch.equal(got.segment_loss, expected.segment_loss)
        if requires_grad:
            expected.backward()
            got.backward()
            assert torch.equal(x.grad, y.grad), blocking.__name__


def test_client_evaluate_with_dense_teacher_equals_forward(client):
    rows, vocab = 13, 23
    logits = make_logits(torch.float32, rows, vocab, seed=16).numpy()
    teacher = make_logits(torch.float32, rows, vocab, seed=17).numpy()
    target = make_target(rows, vocab, seed=16).numpy()
    teacher_handle = client.upload(teacher).handle
    logits_handle = client.upload(logits).handle
    kwargs = dict(alpha=0.4, temperature=1.5, divergence="jsd", beta=0.25)
    forward = client.forward(logits_handle, target, mode="none", teacher=teacher_handle,
                             **kwargs)
    client.release(teacher_handle)
    client.release(logits_handle)
    evaluated = client.evaluate(logits, target, teacher=teacher, block_rows=4, **kwargs)
    assert evaluated.loss == pytest.approx(forward.loss, rel=1e-9)
    assert evaluated.distillation_loss == pytest.approx(forward.distillation_loss, rel=1e-9)
    assert evaluated.valid_tokens == forward.valid_tokens


def test_large_top_k_teacher_goes_by_handle(client, monkeypatch):
    """Top-k tensors over the inline limit are uploaded for the call (and released): the same
    loss and gradient as inline."""
    rows, vocab, k = 16, 64, 8
    logits = make_logits(torch.float32, rows, vocab, seed=18)
    indices, logprobs = top_k_of(make_logits(torch.float32, rows, vocab, seed=19), k)
    losses, grads = [], []
    for limit in (1 << 20, 16):
        monkeypatch.setattr(lossd._torch_core, "_INLINE_BYTES", limit)
        x = logits.clone().requires_grad_()
        loss = lossd.torch.kl_div(x, (indices, logprobs), client=client, top_k_tail="bucket",
                                  segments=torch.arange(rows) // 3)
        loss.backward()
        losses.append(loss.item())
        grads.append(x.grad)
    assert losses[0] == losses[1]
    assert torch.equal(grads[0], grads[1])


def test_linear_forward_takes_the_post_training_keywords(client):
    """A top-k distillation and a PPO loss through linear_forward on X = I (Z = W^T exactly)
    equal forward() on the logits W^T; an unknown keyword is a TypeError."""
    rows, vocab = 5, 11
    weight = make_logits(torch.float32, vocab, rows, seed=31)
    logits = weight.t().contiguous()
    identity = torch.eye(rows, dtype=torch.float32)
    target = make_target(rows, vocab, seed=31, ignored=False)
    weight_handle = client.upload(weight.numpy()).handle
    indices = torch.topk(logits, 3, dim=-1).indices.to(torch.int32)
    logprobs = torch.log_softmax(logits.double() * 0.5, -1).gather(1, indices.long()).float()
    old = torch.log_softmax(logits.double(), -1).gather(1, target.unsqueeze(1)).squeeze(1)
    cases = [dict(teacher=(indices.numpy(), logprobs.numpy()), top_k_tail="bucket", alpha=0.2,
                  temperature=2.0, divergence="jsd"),
             dict(policy_loss="ppo", advantages=np.linspace(-1, 1, rows, dtype=np.float32),
                  old_logprobs=(old + 0.3).float().numpy(), token_ratio=True)]
    for kwargs in cases:
        want = client.forward(logits.numpy(), target.numpy(), mode="none", **kwargs)
        got = client.linear_forward(identity.numpy(), weight_handle, target.numpy(),
                                    mode="none", **kwargs).forward
        assert got.loss == pytest.approx(want.loss, rel=1e-12)
        assert got.distillation_loss == pytest.approx(want.distillation_loss, rel=1e-12)
        assert got.policy_stats.clipped_tokens == want.policy_stats.clipped_tokens
        if want.token_ratio is not None:
            np.testing.assert_array_equal(got.token_ratio, want.token_ratio)
            np.testing.assert_array_equal(got.token_clipped, want.token_clipped)
    with pytest.raises(TypeError, match="unexpected keyword argument 'teachr'"):
        client.linear_forward(identity.numpy(), weight_handle, target.numpy(), teachr=None)
    client.release(weight_handle)


def _result_numbers(result):
    stats = result.policy_stats
    numbers = [result.loss, result.z_loss, result.rows, result.valid_tokens,
               result.correct_tokens, result.denominator, result.distillation_loss]
    if stats is not None:
        numbers += [stats.clipped_tokens, stats.ratio_sum, stats.approx_kl_sum, stats.kl_sum,
                    stats.entropy_sum]
    for name in ("segment_loss", "segment_tokens"):
        values = getattr(result, name)
        numbers += [] if values is None else values.tolist()
    return numbers


def test_evaluate_over_data_connections_equals_the_stream(server):
    """evaluate() and linear_evaluate() with the post-training keywords send their blocks over
    data connections when the client allows it (every evaluation counts as large here): the
    same numbers, bit for bit, as the blocks over the gRPC stream, for a top-k teacher without
    targets, a PPO loss with reference logprobs and segments, and a dense teacher over hidden
    states."""
    rows, vocab, hidden, k = 23, 31, 5, 3
    logits = make_logits(torch.float32, rows, vocab, seed=50)
    target = make_target(rows, vocab, seed=50)
    generator = torch.Generator().manual_seed(51)
    indices, logprobs = top_k_of(make_logits(torch.float32, rows, vocab, seed=52), k)
    segments = (torch.arange(rows) // 4).numpy().astype(np.int32)
    advantages = torch.randn(rows, generator=generator).numpy()
    old = (-1.0 - torch.rand(rows, generator=generator)).numpy()
    ref = (-1.0 - torch.rand(rows, generator=generator)).numpy()
    hidden_states = torch.randn(rows, hidden, generator=generator).numpy()
    weight = (0.5 * torch.randn(vocab, hidden, generator=generator)).numpy()
    teacher = make_logits(torch.float32, rows, vocab, seed=53).numpy()
    with lossd.Client(server.address, data_connection=False) as streamed, \
            lossd.Client(server.address, stripe_min_bytes=1, upload_streams=3) as over:
        assert over.info().data_port > 0
        head = streamed.upload(weight).handle
        calls = [
            lambda c: c.evaluate(logits.numpy(), None, teacher=(indices.numpy(), logprobs.numpy()),
                                 top_k_tail="bucket", temperature=2.0, block_rows=4),
            lambda c: c.evaluate(logits.numpy(), target.numpy(), policy_loss="ppo",
                                 advantages=advantages, old_logprobs=old, ref_logprobs=ref,
                                 kl_coef=0.1, segments=segments,
                                 segment_reduction="seq_mean_token_sum", block_rows=5),
            lambda c: c.linear_evaluate(hidden_states, head, target.numpy(), teacher=teacher,
                                        alpha=0.5, divergence="jsd", beta=0.4, block_rows=6),
        ]
        for call in calls:
            want = call(streamed)
            assert want.rows == rows
            assert _result_numbers(call(over)) == _result_numbers(want)
        streamed.release(head)
        assert streamed.list().tensors == []
