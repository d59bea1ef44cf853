"""upload(..., idempotency_key=...) against a real lossd with two tenants (bearer tokens): a retry
with the key returns the first upload's tensor, another header under the key is AlreadyExists, keys
are per tenant and live as long as their tensor."""

import os
import tempfile

import numpy as np
import pytest

import lossd
from conftest import lossd_binary
from lossd_testing import LossdServer


@pytest.fixture(scope="module")
def tenants():
    directory = tempfile.mkdtemp(prefix="lossd-keys-")
    tokens = os.path.join(directory, "tokens")
    with open(tokens, "w") as f:
        f.write("token-alpha alpha\ntoken-beta beta\n")
    with LossdServer(lossd_binary(), "cpu", ["--tokens_file=" + tokens]) as server:
        with lossd.Client(server.address, token="token-alpha") as alpha, \
                lossd.Client(server.address, token="token-beta") as beta:
            yield alpha, beta
            for client in (alpha, beta):
                for tensor in client.list().tensors:
                    client.release(tensor.handle)


def test_a_retry_gets_the_first_tensor(tenants):
    alpha, _ = tenants
    logits = np.arange(12, dtype=np.float32).reshape(3, 4)
    first = alpha.upload(logits, label="l", idempotency_key="py-retry-1")
    used = alpha.info().used_bytes
    again = alpha.upload(logits, label="l", idempotency_key="py-retry-1")
    assert again.handle == first.handle
    assert alpha.info().used_bytes == used
    # upload_from: the same key, the same tensor.
    def source(offset, size, scratch):
        scratch[:] = logits.tobytes()[offset:offset + size]
    from_source = alpha.upload_from(source, "float32", [3, 4], label="l",
                                    idempotency_key="py-retry-1")
    assert from_source.handle == first.handle
    # No key: a new tensor each time.
    assert alpha.upload(logits).handle != alpha.upload(logits).handle


def test_another_header_under_the_key_is_already_exists(tenants):
    alpha, _ = tenants
    first = alpha.upload(np.zeros((2, 3), np.float32), idempotency_key="py-conflict")
    with pytest.raises(lossd.AlreadyExists, match=first.handle):
        alpha.upload(np.zeros((3, 2), np.float32), idempotency_key="py-conflict")
    with pytest.raises(lossd.InvalidArgument, match="idempotency_key"):
        alpha.upload(np.zeros(4, np.float32), idempotency_key="not a key!")


def test_two_tenants_with_one_key_get_their_own_tensors(tenants):
    alpha, beta = tenants
    data = np.ones(8, np.float32)
    mine = alpha.upload(data, idempotency_key="py-shared")
    theirs = beta.upload(data, idempotency_key="py-shared")
    assert mine.handle != theirs.handle
    assert (mine.tenant, theirs.tenant) == ("alpha", "beta")
    assert alpha.upload(data, idempotency_key="py-shared").handle == mine.handle
    assert beta.upload(data, idempotency_key="py-shared").handle == theirs.handle


def test_a_released_tensor_takes_its_key_with_it(tenants):
    alpha, _ = tenants
    data = np.ones(8, np.float32)
    first = alpha.upload(data, idempotency_key="py-released")
    alpha.release(first.handle)
    second = alpha.upload(data, idempotency_key="py-released")
    assert second.handle != first.handle
