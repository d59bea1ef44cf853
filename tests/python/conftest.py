"""Fixtures of the lossd Python package tests: a real lossd (CPU device, 127.0.0.1, a port it
picks itself) started by tests/reference's LossdServer, and clients of it. ctest passes the binary
in LOSSD_BINARY and puts the built package on PYTHONPATH (tests/python/CMakeLists.txt)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "reference"))
from lossd_testing import LossdServer  # noqa: E402

import lossd  # noqa: E402


def lossd_binary():
    binary = os.environ.get("LOSSD_BINARY")
    if not binary:
        pytest.exit("LOSSD_BINARY is not set (run through ctest)", returncode=2)
    return binary


@pytest.fixture(scope="session")
def server():
    with LossdServer(lossd_binary(), "cpu") as running:
        yield running


@pytest.fixture
def client(server):
    with lossd.Client(server.address) as connected:
        yield connected
        leftover = connected.list().tensors
        assert not leftover, "tensors left on the server: %s" % leftover
