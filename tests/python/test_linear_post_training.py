"""lossd.torch.linear_kl_div, linear_jsd, linear_policy_loss and linear_cross_entropy's segments=
on a real lossd (CPU device): the loss, dX (loss.backward()) and the head's gradient accumulated
on the server against float64 torch through Z = X W^T, with the formulas of docs/api.md written
in test_post_training.py. The server's Z and products are fp32: 1e-4 of the largest element."""

import numpy as np
import pytest
import torch

import lossd
import lossd.torch
from test_post_training import (make_target, reduce, reference_distillation, reference_policy,
                                top_k_of)

ROWS, HIDDEN, VOCAB = 12, 8, 37
RTOL = 1e-4


def make_head(client, seed):
    """Hidden states [ROWS, HIDDEN], a stored weight [VOCAB, HIDDEN] (its handle) and the same
    weight as float64 with requires_grad, for the reference."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(ROWS, HIDDEN, generator=generator)
    weight = torch.randn(VOCAB, HIDDEN, generator=generator)
    handle = client.upload(weight.numpy()).handle
    return hidden, handle, weight.double().requires_grad_()


def check(client, loss, x, hidden, handle, expected, w64, grad_scale=1.0):
    """The loss, dX and dW (grad_scale times the reference's) against the float64 reference
    `expected` of Z = x64 W^T, then the server's tensors released."""
    (expected * grad_scale).backward()
    loss.backward()
    assert loss.item() == pytest.approx(expected.item(), rel=RTOL, abs=1e-6)
    scale = hidden.grad.abs().max().item()
    torch.testing.assert_close(x.grad.double(), hidden.grad, rtol=RTOL, atol=RTOL * scale)
    got_dw = torch.from_numpy(client.download(loss.weight_grad_handle, dtype="float32").copy())
    scale = w64.grad.abs().max().item()
    torch.testing.assert_close(got_dw.double(), w64.grad, rtol=RTOL, atol=RTOL * scale)
    client.release(loss.weight_grad_handle)
    client.release(handle)


@pytest.mark.parametrize("reverse", [False, True])
def test_linear_kl_div_dense_teacher(client, reverse):
    hidden, handle, w64 = make_head(client, seed=50)
    teacher = 2.0 * torch.randn(ROWS, VOCAB, generator=torch.Generator().manual_seed(51))
    target = make_target(ROWS, VOCAB, seed=50)
    x = hidden.clone().requires_grad_()
    loss = lossd.torch.linear_kl_div(x, handle, teacher, target, client=client, reverse=reverse,
                                     temperature=2.0, alpha=0.3)
    x64 = hidden.double().requires_grad_()
    per_row, valid, kd = reference_distillation(
        x64 @ w64.T, teacher, target, kind="reverse_kl" if reverse else "forward_kl", beta=0.5,
        temperature=2.0, alpha=0.3, tail=None)
    assert loss.distillation_loss == pytest.approx(reduce(kd, valid, "mean").item(), rel=RTOL)
    assert loss.valid_tokens == int(valid.sum())
    check(client, loss, x, x64, handle, reduce(per_row, valid, "mean"), w64)


@pytest.mark.parametrize("tail", ["renormalize", "bucket"])
def test_linear_jsd_top_k_teacher_without_target(client, tail):
    hidden, handle, w64 = make_head(client, seed=52)
    teacher = 2.0 * torch.randn(ROWS, VOCAB, generator=torch.Generator().manual_seed(53))
    indices, logprobs = top_k_of(teacher, 5)
    x = hidden.clone().requires_grad_()
    loss = lossd.torch.linear_jsd(x, handle, (indices, logprobs), client=client, beta=0.3,
                                  top_k_tail=tail, reduction="sum", grad_scale=0.5)
    x64 = hidden.double().requires_grad_()
    per_row, valid, _ = reference_distillation(
        x64 @ w64.T, (indices, logprobs), None, kind="jsd", beta=0.3, temperature=1.0,
        alpha=0.0, tail=tail)
    # grad_scale scales the gradients (dX and dW), not the loss.
    check(client, loss, x, x64, handle, reduce(per_row, valid, "sum"), w64, grad_scale=0.5)


@pytest.mark.parametrize("loss_type", ["importance_sampling", "ppo", "cispo"])
def test_linear_policy_loss_with_segments(client, loss_type):
    hidden, handle, w64 = make_head(client, seed=54)
    target = make_target(ROWS, VOCAB, seed=54)
    generator = torch.Generator().manual_seed(55)
    z = hidden.double() @ w64.detach().T
    logp = torch.log_softmax(z, -1).gather(1, target.clamp(min=0).unsqueeze(1)).squeeze(1)
    old = (logp + 0.3 * torch.randn(ROWS, generator=generator, dtype=torch.float64)).float()
    ref = (logp + 0.3 * torch.randn(ROWS, generator=generator, dtype=torch.float64)).float()
    advantages = torch.randn(ROWS, generator=generator)
    segments = torch.arange(ROWS) // 5
    x = hidden.clone().requires_grad_()
    loss = lossd.torch.linear_policy_loss(
        x, handle, target, advantages, old, client=client, loss_type=loss_type,
        ref_logprobs=ref, epsilon_high=0.28, kl_coef=0.1, segments=segments,
        segment_reduction="seq_mean_token_sum")
    x64 = hidden.double().requires_grad_()
    per_row, valid, _, ratio = reference_policy(
        x64 @ w64.T, target, advantages, old, ref, loss_type=loss_type, eps_low=0.2,
        eps_high=0.28, kl_coef=0.1)
    assert loss.policy_stats.ratio_sum == pytest.approx(ratio[valid].sum().item(), rel=RTOL)
    tokens = torch.zeros(3, dtype=torch.int64).index_add(0, segments, valid.long())
    assert loss.segment_tokens.tolist() == tokens.tolist()
    check(client, loss, x, x64, handle,
          reduce(per_row, valid, "mean", segments, "seq_mean_token_sum"), w64)


def test_linear_cross_entropy_segments_and_no_grad(client):
    """segment_reduction over the head, and without a gradient the loss and metrics alone
    (nothing accumulated, nothing left on the server)."""
    hidden, handle, w64 = make_head(client, seed=56)
    target = make_target(ROWS, VOCAB, seed=56)
    segments = torch.tensor([0, 0, 0, 2, 2, 2, 2, 2, 3, 3, 3, 3])  # segment 1 is empty
    x = hidden.clone().requires_grad_()
    loss = lossd.torch.linear_cross_entropy(x, handle, target, client=client, segments=segments,
                                            segment_reduction="seq_mean_token_mean")
    x64 = hidden.double().requires_grad_()
    per_row = torch.nn.functional.cross_entropy(x64 @ w64.T, target, reduction="none")
    valid = target != -100
    assert loss.segment_tokens[1] == 0
    with torch.no_grad():
        alone = lossd.torch.linear_cross_entropy(x, handle, target, client=client,
                                                 segments=segments,
                                                 segment_reduction="seq_mean_token_mean")
    assert alone.item() == pytest.approx(loss.item(), rel=1e-6)
    assert np.array_equal(alone.segment_tokens.numpy(), loss.segment_tokens.numpy())
    assert not hasattr(alone, "weight_grad_handle")
    check(client, loss, x, x64, handle,
          reduce(per_row, valid, "mean", segments, "seq_mean_token_mean"), w64)


def test_linear_post_training_bad_arguments(client):
    hidden, handle, _ = make_head(client, seed=57)
    target = make_target(ROWS, VOCAB, seed=57)
    with pytest.raises(ValueError, match="must have the student's shape"):
        lossd.torch.linear_kl_div(hidden, handle, torch.zeros(ROWS + 1, VOCAB), client=client)
    with pytest.raises(ValueError, match="alpha > 0"):
        lossd.torch.linear_jsd(hidden, handle, torch.zeros(ROWS, VOCAB), client=client,
                               alpha=0.5)
    with pytest.raises(lossd.InvalidArgument):  # a NaN advantage
        lossd.torch.linear_policy_loss(hidden.requires_grad_(), handle, target,
                                       torch.full((ROWS,), float("nan")),
                                       torch.full((ROWS,), -2.0), client=client)
    client.release(handle)
