"""The package against a server that does not serve the post-training losses: a lossd started with
--advertise_features= lists no features (as a server from before ServerInfo.features), so
Client.forward and lossd.torch refuse a distillation, policy loss or segments with
lossd.FailedPrecondition before sending it (lossd.torch before uploading the logits), and a plain
cross entropy still runs."""

import numpy as np
import pytest
import torch

import lossd
import lossd.torch
from conftest import lossd_binary
from lossd_testing import LossdServer


@pytest.fixture(scope="module")
def older_server():
    with LossdServer(lossd_binary(), "cpu", extra_flags=["--advertise_features="]) as running:
        yield running


@pytest.fixture
def older_client(older_server):
    with lossd.Client(older_server.address) as connected:
        yield connected
        assert connected.list().tensors == []


def top_k(rows, vocab, k):
    teacher = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(1))
    logprobs, indices = torch.log_softmax(teacher, -1).topk(k, -1)
    return indices.to(torch.int32), logprobs


def test_info_lists_features(client, older_client):
    assert "post_training" in client.info().features
    assert older_client.info().features == []
    client.require_post_training("a step")
    with pytest.raises(lossd.FailedPrecondition, match="a step with distillation"):
        older_client.require_post_training("a step")


def test_torch_losses_raise_failed_precondition(older_client, older_server):
    rows, vocab = 6, 11
    x = torch.randn(rows, vocab).requires_grad_()
    target = torch.randint(0, vocab, (rows,))
    with pytest.raises(lossd.FailedPrecondition, match="does not serve post-training losses") as e:
        lossd.torch.jsd(x, top_k(rows, vocab, 3), client=older_client)
    assert older_server.address in str(e.value)
    with pytest.raises(lossd.FailedPrecondition, match="Upgrade lossd"):
        lossd.torch.cross_entropy(x, target, client=older_client,
                                  segments=torch.zeros(rows, dtype=torch.int32))
    with pytest.raises(lossd.FailedPrecondition):
        lossd.torch.policy_loss(x, target, torch.ones(rows), torch.zeros(rows),
                                client=older_client)
    assert x.grad is None
    # Plain cross entropy needs no feature.
    lossd.torch.cross_entropy(x, target, client=older_client).backward()
    assert x.grad is not None


def test_client_forward_changes_nothing(older_client):
    logits = np.linspace(-2, 2, 4 * 5, dtype=np.float32).reshape(4, 5)
    handle = older_client.upload(logits).handle
    try:
        indices, logprobs = top_k(4, 5, 2)
        with pytest.raises(lossd.FailedPrecondition):
            older_client.forward(handle, np.array([0, 1, 2, 3], dtype=np.int32),
                                 teacher=(indices.numpy(), logprobs.numpy()))
        np.testing.assert_array_equal(older_client.download(handle), logits)
        assert len(older_client.list().tensors) == 1
    finally:
        older_client.release(handle)


def test_check_can_be_turned_off(older_server):
    with lossd.Client(older_server.address, check_server_features=False) as unchecked:
        x = torch.randn(5, 7).requires_grad_()
        loss = lossd.torch.cross_entropy(x, torch.tensor([0, 1, 2, 3, 4]), client=unchecked,
                                         segments=torch.tensor([0, 0, 1, 1, 1], dtype=torch.int32))
        assert loss.segment_tokens.tolist() == [2, 3]
