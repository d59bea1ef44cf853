"""Data connections from a second, independent client: plain Python sockets that follow
docs/api.md ("Upload over data connections", "Download over data connections") against a real
lossd, with torch as the oracle.

- Upload fp32 logits over 3 connections (an element count that 3 does not divide), Forward in
  place against torch's cross_entropy, Backward 0.5, then Download the gradient over 2
  connections, as stored and as bf16: the bytes equal those of a plain gRPC Download, and the
  gradient matches 0.5 * torch's within fp32 rounding.
- Evaluate of the same rows over 3 connections (blocks of 5 rows, frames round-robin) gives
  torch's loss.
- A connection that ends short fails the upload with INVALID_ARGUMENT and stores nothing.
Seed random per run, printed, fixed with LOSSD_DATA_SEED=<seed>."""

import argparse
import os
import secrets
import socket
import struct
import sys
import threading

import numpy as np
import torch
import torch.nn.functional as F

import lossd_testing as lt

SEED_ENV = "LOSSD_DATA_SEED"
MAGIC = b"LOSSDDC1"


def part(elements, i, count):
    """Elements [floor(i*E/K), floor((i+1)*E/K)) of connection i of K."""
    return elements * i // count, elements * (i + 1) // count


def preamble(token, index):
    return MAGIC + token + struct.pack("<I", index)


def data_sockets(port, count):
    sockets = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(count)]
    return sockets


def upload(stub, pb, port, array, dtype, count, short=False):
    """Uploads `array` over `count` data connections; the last one stops half-way when `short`.
    Returns the Upload RPC's response, or raises its grpc.RpcError."""
    token = secrets.token_bytes(16)
    data = array.tobytes()
    element_bytes = array.dtype.itemsize
    sockets = data_sockets(port, count)
    header = pb.TensorHeader(dtype=dtype, shape=array.shape, data_token=token,
                             data_connections=count)
    future = stub.Upload.future(iter([pb.UploadRequest(header=header)]))

    def send(i):
        first, end = part(array.size, i, count)
        payload = data[first * element_bytes:end * element_bytes]
        if short and i == count - 1:
            payload = payload[:len(payload) // 2]
        try:
            sockets[i].sendall(preamble(token, i) + payload)
            sockets[i].shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the server ended the transfer: the RPC says why

    senders = [threading.Thread(target=send, args=(i,)) for i in range(count)]
    for sender in senders:
        sender.start()
    for sender in senders:
        sender.join()
    try:
        return future.result(timeout=60)
    finally:
        for s in sockets:
            s.close()


def download(stub, pb, port, handle, count, dtype=0):
    """Downloads `handle` (converted to `dtype`, 0 = as stored) over `count` data connections;
    returns (header, bytes)."""
    token = secrets.token_bytes(16)
    stream = stub.Download(pb.DownloadRequest(handle=handle, dtype=dtype, data_token=token,
                                              data_connections=count))
    header = next(stream).header
    # Connected once the header came: the transfer is registered by then.
    sockets = data_sockets(port, count)
    element_bytes = {pb.DTYPE_FLOAT32: 4, pb.DTYPE_BFLOAT16: 2, pb.DTYPE_FLOAT16: 2}[header.dtype]
    elements = header.bytes // element_bytes
    out = bytearray(header.bytes)

    def receive(i):
        first, end = part(elements, i, count)
        view = memoryview(out)[first * element_bytes:end * element_bytes]
        sockets[i].sendall(preamble(token, i))
        got = 0
        while got < len(view):
            n = sockets[i].recv_into(view[got:])
            if n == 0:
                raise RuntimeError("data connection %d ended after %d of %d bytes" %
                                   (i, got, len(view)))
            got += n

    receivers = [threading.Thread(target=receive, args=(i,)) for i in range(count)]
    for receiver in receivers:
        receiver.start()
    for receiver in receivers:
        receiver.join()
    for _ in stream:  # the stream ends once every connection's bytes are sent
        pass
    for s in sockets:
        s.close()
    return header, bytes(out)


def evaluate(stub, pb, port, logits, targets, count, block_rows):
    """Evaluates fp32 `logits` with int64 `targets` in blocks of `block_rows` rows, block b over
    connection b mod `count` as frames (8-byte little-endian row count, rows, targets)."""
    token = secrets.token_bytes(16)
    header = pb.EvaluateHeader(vocab=logits.shape[1], logits_dtype=pb.DTYPE_FLOAT32,
                               targets_dtype=pb.DTYPE_INT64, data_token=token,
                               data_connections=count)
    future = stub.Evaluate.future(iter([pb.EvaluateRequest(header=header)]))
    frames = [[] for _ in range(count)]
    for b, first in enumerate(range(0, len(targets), block_rows)):
        rows = min(block_rows, len(targets) - first)
        frames[b % count].append(struct.pack("<q", rows) +
                                 logits[first:first + rows].tobytes() +
                                 targets[first:first + rows].tobytes())
    sockets = data_sockets(port, count)
    for i, s in enumerate(sockets):
        s.sendall(preamble(token, i) + b"".join(frames[i]))
        s.shutdown(socket.SHUT_WR)
    try:
        return future.result(timeout=60)
    finally:
        for s in sockets:
            s.close()


def grpc_download(stub, pb, handle, dtype=0):
    stream = stub.Download(pb.DownloadRequest(handle=handle, dtype=dtype))
    next(stream)
    return b"".join(m.chunk for m in stream)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lossd", required=True)
    parser.add_argument("--stubs", required=True)
    args = parser.parse_args()
    seed = int(os.environ.get(SEED_ENV, secrets.randbits(31)))
    print("seed %d (%s=%d repeats it)" % (seed, SEED_ENV, seed))
    rng = np.random.default_rng(seed)
    pb, pb_grpc, grpc = lt.import_stubs(args.stubs)
    failures = []

    rows, vocab = 37, 1001  # 37037 elements: 3 does not divide them
    logits = (rng.standard_normal((rows, vocab)) * 3).astype("<f4")
    targets = rng.integers(0, vocab, rows).astype("<i8")
    targets[rng.random(rows) < 0.1] = -100

    with lt.LossdServer(args.lossd, "cpu") as server:
        _, stub = lt.connect(grpc, pb_grpc, server.address)
        port = stub.GetServerInfo(pb.GetServerInfoRequest()).data_port
        if port <= 0:
            print("FAIL: the server reports no data port")
            return 1

        uploaded = upload(stub, pb, port, logits, pb.DTYPE_FLOAT32, 3).tensor
        if uploaded.bytes != logits.nbytes:
            failures.append("upload: %d bytes, expected %d" % (uploaded.bytes, logits.nbytes))
        # Back as stored: the very bytes that went up.
        _, back = download(stub, pb, port, uploaded.handle, 2)
        if back != logits.tobytes():
            failures.append("download of the uploaded logits: bytes differ")

        result = stub.Forward(pb.ForwardRequest(
            logits=uploaded.handle,
            targets_inline=pb.InlineTensor(dtype=pb.DTYPE_INT64, data=targets.tobytes())))
        x = torch.from_numpy(logits.astype(np.float64)).requires_grad_()
        loss = F.cross_entropy(x, torch.from_numpy(targets))
        loss.backward()
        if abs(result.loss - float(loss)) > 1e-5 * max(1.0, abs(float(loss))):
            failures.append("forward: loss %.8f, torch %.8f" % (result.loss, float(loss)))
        stub.Backward(pb.BackwardRequest(gradient=result.gradient, scalar=0.5))

        # The same rows evaluated over 3 connections in blocks of 5 (not kept).
        evaluated = evaluate(stub, pb, port, logits, targets, 3, 5)
        if evaluated.rows != rows or evaluated.valid_tokens != int((targets != -100).sum()):
            failures.append("evaluate: %d rows, %d valid" % (evaluated.rows,
                                                              evaluated.valid_tokens))
        if abs(evaluated.loss - float(loss)) > 1e-5 * max(1.0, abs(float(loss))):
            failures.append("evaluate: loss %.8f, torch %.8f" % (evaluated.loss, float(loss)))

        expected = 0.5 * x.grad.numpy()
        for name, dtype in (("fp32", pb.DTYPE_FLOAT32), ("bf16", pb.DTYPE_BFLOAT16)):
            header, data = download(stub, pb, port, result.gradient, 2, dtype)
            if data != grpc_download(stub, pb, result.gradient, dtype):
                failures.append("gradient as %s: bytes differ from a gRPC Download" % name)
            if header.pending_scale != 0.5:
                failures.append("gradient as %s: pending_scale %g" % (name, header.pending_scale))
            grad = lt.decode_float(data, name, (rows, vocab))
            # The kernel's fp32 gradient, then (bf16) one more rounding.
            tolerance = 4 * lt.ulp(expected, "fp32") + 1e-9
            if name == "bf16":
                tolerance = tolerance + lt.ulp(expected, "bf16")
            worst = float(np.max(np.abs(grad - expected) - tolerance))
            if worst > 0:
                failures.append("gradient as %s: off by up to %.3g beyond its tolerance" %
                                (name, worst))
        stub.Release(pb.ReleaseRequest(handle=result.gradient))

        # A connection that ends short: INVALID_ARGUMENT, nothing kept.
        try:
            upload(stub, pb, port, logits, pb.DTYPE_FLOAT32, 3, short=True)
            failures.append("short connection: the upload succeeded")
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.INVALID_ARGUMENT:
                failures.append("short connection: %s %s" % (error.code(), error.details()))
        listed = stub.List(pb.ListRequest()).tensors
        if listed:
            failures.append("left behind: %d tensors" % len(listed))

    for failure in failures:
        print("FAIL: " + failure)
    if not failures:
        print("data connections from Python: upload, forward, backward, downloads and evaluate agree")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
