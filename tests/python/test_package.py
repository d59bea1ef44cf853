"""The lossd package as installed: its version, its shipped gRPC stubs (lossd.v1.lossd_pb2 and
lossd_pb2_grpc) beside Python's grpcio and protobuf in one process, in both import orders, and an
extension that exports nothing but its entry point (so its own gRPC cannot clash with grpcio's)."""

import os
import re
import subprocess
import sys
import textwrap

import pytest

import lossd

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def test_version_is_the_projects():
    with open(os.path.join(ROOT, "CMakeLists.txt")) as f:
        version = re.search(r"project\(\s*lossd\s+VERSION\s+([0-9.]+)", f.read()).group(1)
    assert lossd.__version__ == version


def test_installed_where_expected():
    """Under ctest's pip tests LOSSD_EXPECT_PREFIX names the venv: the package under test must
    be the installed one, not the build folder or the sources."""
    prefix = os.environ.get("LOSSD_EXPECT_PREFIX")
    if not prefix:
        pytest.skip("LOSSD_EXPECT_PREFIX is not set (the build folder's package is tested)")
    assert os.path.realpath(lossd.__file__).startswith(os.path.realpath(prefix) + os.sep)


def test_extension_exports_only_its_entry_point():
    """The version script leaves PyInit__lossd the only defined dynamic symbol; a gRPC or
    protobuf symbol there would interpose on (or be taken from) the grpcio and protobuf
    modules' copies."""
    extension = lossd._lossd.__file__
    listing = subprocess.run(["nm", "-D", "--defined-only", extension], capture_output=True,
                             text=True, check=True).stdout
    names = [line.split()[-1] for line in listing.splitlines() if line.strip()]
    assert names == ["PyInit__lossd"], names[:20]
    needed = subprocess.run(["objdump", "-p", extension], capture_output=True, text=True,
                            check=True).stdout
    libraries = re.findall(r"NEEDED\s+(\S+)", needed)
    # gRPC is linked in; protobuf and Abseil are Debian's shared libraries (their static
    # archives are not position-independent), the same ones python3-protobuf loads.
    assert not [name for name in libraries if re.match(r"lib(grpc|gpr|upb|cares)", name)], \
        libraries
    if os.environ.get("LOSSD_EXPECT_PREFIX"):  # installed by pip: the others travel with it
        folder = os.path.join(os.path.dirname(extension), "lib")
        carried = sorted(os.listdir(folder))
        assert "libprotobuf.so.32" in carried and any(n.startswith("libabsl_") for n in carried)
        assert re.search(r"R(UN)?PATH\s+\$ORIGIN/lib", needed), needed


# One process per order: what is imported first decides which copies are loaded.
RAW_THEN_CLIENT = """
import grpc
from google.protobuf import __version__ as protobuf_version
from lossd.v1 import lossd_pb2, lossd_pb2_grpc
channel = grpc.insecure_channel(ADDRESS)
stub = lossd_pb2_grpc.LossdStub(channel)
info = stub.GetServerInfo(lossd_pb2.GetServerInfoRequest(), timeout=30)
assert info.device == "cpu", info
import lossd
import numpy as np
with lossd.Client(ADDRESS) as client:
    handle = client.upload(np.arange(12, dtype=np.float32).reshape(3, 4), label="order").handle
    described = stub.Describe(lossd_pb2.DescribeRequest(handle=handle), timeout=30)
    assert list(described.shape) == [3, 4] and described.label == "order", described
    assert client.release(handle) == 48
print("ok", grpc.__version__, protobuf_version)
"""

CLIENT_THEN_RAW = """
import lossd
import numpy as np
client = lossd.Client(ADDRESS)
handle = client.upload(np.arange(12, dtype=np.float32).reshape(3, 4), label="order").handle
assert client.info().device == "cpu"
import grpc
from google.protobuf import __version__ as protobuf_version
from google.protobuf import timestamp_pb2
from lossd.v1 import lossd_pb2, lossd_pb2_grpc
channel = grpc.insecure_channel(ADDRESS)
stub = lossd_pb2_grpc.LossdStub(channel)
listed = stub.List(lossd_pb2.ListRequest(), timeout=30)
assert [t.handle for t in listed.tensors] == [handle], listed
assert isinstance(listed.tensors[0].created, timestamp_pb2.Timestamp)
stub.Release(lossd_pb2.ReleaseRequest(handle=handle), timeout=30)
assert client.list().tensors == []
client.close()
print("ok", grpc.__version__, protobuf_version)
"""


@pytest.mark.parametrize("script", [RAW_THEN_CLIENT, CLIENT_THEN_RAW],
                         ids=["grpc_first", "lossd_first"])
def test_stubs_and_client_in_one_process(server, script):
    code = "ADDRESS = %r\n%s" % (server.address, textwrap.dedent(script))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("ok"), result.stdout


def test_stubs_are_the_packages():
    from lossd.v1 import lossd_pb2, lossd_pb2_grpc
    package = os.path.dirname(lossd.__file__)
    assert os.path.dirname(lossd_pb2.__file__) == os.path.join(package, "v1")
    assert lossd_pb2.DESCRIPTOR.package == "lossd.v1"
    assert hasattr(lossd_pb2_grpc, "LossdStub") and hasattr(lossd_pb2_grpc, "LossdServicer")
