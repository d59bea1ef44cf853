"""Each lossd.Error subclass for its gRPC code: the mapping of every code, and real errors
provoked on real lossd servers (a small memory budget, bearer tokens, mutual TLS)."""

import os
import socket
import subprocess
import tempfile

import numpy as np
import pytest

import lossd
from conftest import LossdServer, lossd_binary

CLASSES = {
    "CANCELLED": lossd.Cancelled, "UNKNOWN": lossd.Unknown,
    "INVALID_ARGUMENT": lossd.InvalidArgument, "DEADLINE_EXCEEDED": lossd.DeadlineExceeded,
    "NOT_FOUND": lossd.NotFound, "ALREADY_EXISTS": lossd.AlreadyExists,
    "PERMISSION_DENIED": lossd.PermissionDenied, "RESOURCE_EXHAUSTED": lossd.ResourceExhausted,
    "FAILED_PRECONDITION": lossd.FailedPrecondition, "ABORTED": lossd.Aborted,
    "OUT_OF_RANGE": lossd.OutOfRange, "UNIMPLEMENTED": lossd.Unimplemented,
    "INTERNAL": lossd.Internal, "UNAVAILABLE": lossd.Unavailable, "DATA_LOSS": lossd.DataLoss,
    "UNAUTHENTICATED": lossd.Unauthenticated,
}


def test_every_code_has_its_class():
    from lossd import _errors
    for name, cls in CLASSES.items():
        code = lossd.StatusCode[name]
        error = _errors.error_from_code(int(code), "why")
        assert type(error) is cls and isinstance(error, lossd.Error)
        assert error.code == code and error.code.name == name and error.message == "why"
        assert str(error) == name + ": why"
    assert issubclass(lossd.InvalidArgument, ValueError)
    assert type(_errors.error_from_code(99, "odd")) is lossd.Error


def assert_raises(cls, call):
    with pytest.raises(cls) as caught:
        call()
    assert type(caught.value) is cls
    assert caught.value.code == cls.code and caught.value.message
    return caught.value


def test_server_errors(client):
    assert_raises(lossd.NotFound, lambda: client.describe("00000000-0123456789abcdef0123456789abcdef"))
    logits = np.random.default_rng(0).standard_normal((4, 10), dtype=np.float32)
    targets = np.arange(4)
    handle = client.upload(logits).handle
    client.forward(handle, targets)
    error = assert_raises(lossd.FailedPrecondition, lambda: client.forward(handle, targets))
    assert "consumed" in error.message or "GRADIENT" in error.message
    client.release(handle)
    assert_raises(lossd.NotFound, lambda: client.release(handle))
    handle = client.upload(logits).handle
    # bad shapes: 5 targets for 4 rows; a 3-d upload
    assert_raises(lossd.InvalidArgument, lambda: client.forward(handle, np.arange(5)))
    assert_raises(lossd.InvalidArgument,
                  lambda: client.upload(np.zeros((2, 2, 2), np.float32)))
    assert_raises(lossd.FailedPrecondition, lambda: client.backward(handle, 1.0))
    small = np.empty((2, 10), np.float32)
    assert_raises(lossd.OutOfRange, lambda: client.download(handle, out=small))
    client.release(handle)


def test_malformed_handles_long_labels_and_list_pages(client):
    error = assert_raises(lossd.InvalidArgument, lambda: client.describe("not-a-handle"))
    assert "malformed handle 'not-a-handle'" in error.message
    error = assert_raises(lossd.InvalidArgument, lambda: client.describe("x" * 7000))
    assert "(7000 bytes)" in error.message and len(error.message) < 400
    one = np.zeros(1, np.float32)
    error = assert_raises(lossd.InvalidArgument, lambda: client.upload(one, label="L" * 1025))
    assert "header.label has 1025 bytes; at most 1024" in error.message
    handles = [client.upload(one, label="t%d" % i).handle for i in range(7)]
    for page_size in (2, 7, 1000):
        assert [t.handle for t in client.list(page_size=page_size).tensors] == handles
    assert_raises(lossd.InvalidArgument, lambda: client.list(page_size=0))
    for handle in handles:
        client.release(handle)


def test_resource_exhausted():
    with LossdServer(lossd_binary(), "cpu", ["--memory_budget=1M"]) as server:
        with lossd.Client(server.address) as client:
            error = assert_raises(
                lossd.ResourceExhausted,
                lambda: client.upload(np.zeros((1024, 512), np.float32)))  # 2 MiB
            assert "budget" in error.message
            assert client.list().tensors == []


def test_unavailable_and_deadline(client):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with lossd.Client("127.0.0.1:%d" % port, connect_wait=0.1) as unreachable:
        assert_raises(lossd.Unavailable, unreachable.info)
    with lossd.Client(client.target, deadline=1e-6) as hurried:
        assert_raises(lossd.DeadlineExceeded, hurried.info)


def test_client_side_invalid_argument():
    assert_raises(lossd.InvalidArgument, lambda: lossd.Client(""))
    assert_raises(lossd.InvalidArgument, lambda: lossd.Client("127.0.0.1:1", upload_streams=0))


def make_pki(directory):
    key = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes"
    script = f"""set -e; cd {directory}
openssl req -x509 {key} -keyout ca.key -out ca.pem -days 2 -subj /CN=lossd-test-ca
printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\\n' > server.ext
openssl req {key} -keyout server.key -out server.csr -subj /CN=localhost
openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 2 \
  -extfile server.ext -out server.pem
openssl req {key} -keyout alpha.key -out alpha.csr -subj /CN=alpha
openssl x509 -req -in alpha.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 2 -out alpha.pem
printf 'token-alpha alpha\\ntoken-beta beta\\n' > tokens
"""
    subprocess.run(["sh", "-c", script], check=True, capture_output=True)


def test_authentication_errors():
    with tempfile.TemporaryDirectory() as directory:
        make_pki(directory)
        path = lambda name: os.path.join(directory, name)  # noqa: E731
        flags = ["--tls_cert=" + path("server.pem"), "--tls_key=" + path("server.key"),
                 "--tls_client_ca=" + path("ca.pem"), "--tokens_file=" + path("tokens")]
        with LossdServer(lossd_binary(), "cpu", flags) as server:
            def connect(token):
                return lossd.Client(server.address, token=token, ca_file=path("ca.pem"),
                                    cert_file=path("alpha.pem"), key_file=path("alpha.key"))

            with connect("token-alpha") as alpha:
                assert alpha.info().device == "cpu"
            with connect("wrong-token") as wrong:
                assert_raises(lossd.Unauthenticated, wrong.info)
            with connect("token-beta") as mismatched:  # the certificate names alpha
                assert_raises(lossd.PermissionDenied, mismatched.info)
