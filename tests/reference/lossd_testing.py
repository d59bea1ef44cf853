"""Shared helpers of the tests/reference Python tests: start and stop a real lossd process, reach it
over gRPC with the stubs CMake generated, move tensors and reproduce lossd's dtype rounding in
torch. Kept apart so that each test file reads as its checks only."""

import glob
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

# Raised limits on both ends of the channel; lossd accepts up to 64 MiB messages.
MAX_MESSAGE_BYTES = 64 << 20

# Exit code that ctest reports as "skipped" (SKIP_RETURN_CODE in tests/reference/CMakeLists.txt).
SKIP_EXIT_CODE = 77


def import_stubs(stubs_dir):
    """Imports the generated lossd.v1 modules from stubs_dir; returns (pb2, pb2_grpc, grpc)."""
    sys.path.insert(0, stubs_dir)
    import grpc  # noqa: E402 (Debian's python3-grpcio)
    from lossd.v1 import lossd_pb2, lossd_pb2_grpc  # noqa: E402
    return lossd_pb2, lossd_pb2_grpc, grpc


def gpu_visible():
    """True when an NVIDIA device node exists; Debian's torch is CPU-only, so it cannot tell."""
    return bool(glob.glob("/dev/nvidia[0-9]*"))


class LossdServer:
    """A lossd process on 127.0.0.1 with a port it picked itself (--port=0 --port_file).

    Use as a context manager: the process is stopped with SIGTERM (SIGKILL after 30 s) on exit,
    and its stderr is kept in a temporary file for failure messages."""

    def __init__(self, binary, device, extra_flags=()):
        self._binary = binary
        self._device = device
        self._extra_flags = list(extra_flags)
        self._tmp = tempfile.mkdtemp(prefix="lossd-test-")
        self._log_path = os.path.join(self._tmp, "lossd.log")
        self._process = None
        self.port = None
        self.exit_code = None

    def __enter__(self):
        port_file = os.path.join(self._tmp, "port")
        command = [self._binary, "--port=0", "--port_file=" + port_file,
                   "--host=127.0.0.1", "--device=" + self._device,
                   "--metrics_port=-1", "--data_port=0"] + self._extra_flags
        with open(self._log_path, "wb") as log:
            self._process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        # lossd writes the port file once it serves; a poll with a deadline (not a fixed sleep)
        # is the only way to learn a port that the server chose itself.
        deadline = time.monotonic() + 60
        while self.port is None:
            if self._process.poll() is not None:
                raise RuntimeError("lossd exited with %d before serving:\n%s" %
                                   (self._process.returncode, self.log_tail()))
            if time.monotonic() > deadline:
                raise RuntimeError("lossd wrote no port file within 60 s:\n" + self.log_tail())
            try:
                with open(port_file) as f:
                    text = f.read()
                if text.strip().isdigit() and int(text) > 0:
                    self.port = int(text)
                    break
            except FileNotFoundError:
                pass
            time.sleep(0.01)
        return self

    def __exit__(self, *exc):
        self.stop()
        shutil.rmtree(self._tmp, ignore_errors=True)
        return False

    @property
    def address(self):
        return "127.0.0.1:%d" % self.port

    def stop(self):
        if self._process is None or self.exit_code is not None:
            return
        if self._process.poll() is None:
            self._process.send_signal(signal.SIGTERM)
            try:
                self._process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self.exit_code = self._process.returncode

    def log_tail(self, lines=40):
        try:
            with open(self._log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return "(no log)"


def connect(grpc, pb2_grpc, address):
    """A channel with raised message limits, ready (or an exception after 30 s), and its stub."""
    channel = grpc.insecure_channel(address, options=[
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ])
    grpc.channel_ready_future(channel).result(timeout=30)
    return channel, pb2_grpc.LossdStub(channel)


# Logits dtypes by name: (proto enum name, torch dtype, numpy storage dtype).
FLOAT_DTYPES = {
    "fp32": ("DTYPE_FLOAT32", torch.float32, np.float32),
    "bf16": ("DTYPE_BFLOAT16", torch.bfloat16, np.int16),
    "fp16": ("DTYPE_FLOAT16", torch.float16, np.float16),
}


def encode_float(values, name):
    """Rounds float64/float32 values to dtype `name` (round to nearest even, torch's conversion)
    and returns (little-endian bytes, the rounded values as a float64 numpy array)."""
    _, torch_dtype, storage = FLOAT_DTYPES[name]
    rounded = torch.as_tensor(np.asarray(values, dtype=np.float32)).to(torch_dtype)
    raw = rounded.view(torch.int16) if name == "bf16" else rounded
    data = raw.numpy().astype(np.dtype(storage).newbyteorder("<"), copy=False).tobytes()
    return data, rounded.to(torch.float64).numpy()


def decode_float(data, name, shape):
    """Little-endian bytes of dtype `name` -> float64 numpy array of `shape`."""
    _, torch_dtype, storage = FLOAT_DTYPES[name]
    array = np.frombuffer(data, dtype=np.dtype(storage).newbyteorder("<")).astype(storage)
    tensor = torch.from_numpy(array.copy())
    if name == "bf16":
        tensor = tensor.view(torch.bfloat16)
    return tensor.to(torch.float64).numpy().reshape(shape)


def ulp(values, name):
    """Spacing of dtype `name` at |values| (float64 array); subnormal spacing near zero."""
    mantissa_bits, min_exponent = {"fp32": (23, -126), "bf16": (7, -126), "fp16": (10, -14)}[name]
    magnitude = np.abs(values)
    exponent = np.floor(np.log2(np.where(magnitude > 0, magnitude, 1.0)))
    exponent = np.maximum(np.where(magnitude > 0, exponent, min_exponent), min_exponent)
    return np.exp2(exponent - mantissa_bits)
