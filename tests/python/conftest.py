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


def pytest_sessionfinish(session, exitstatus):
    """With LOSSD_SKIPPED_EXIT_CODE set (the GPU tests' ctest entry), a session whose tests were
    all skipped exits with that code, so that ctest reports the test as skipped, not passed."""
    code = os.environ.get("LOSSD_SKIPPED_EXIT_CODE")
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if code and exitstatus == 0 and reporter is not None:
        if reporter.stats.get("skipped") and not reporter.stats.get("passed"):
            session.exitstatus = int(code)
