"""The user's step from host memory, timed piece by piece against a lossd on loopback (not a test:
a measurement; the numbers go to the report of issue 27). Each piece's median of --runs:
upload, forward (in place), download into fresh memory (numpy.empty, first touch during the
transfer), download into a reused out= buffer, the same two for lossd.torch's step from CPU
tensors (grad_out=), and first touch of fresh memory alone.

    python3 tests/python/host_memory_bench.py --lossd build/server/lossd --rows 4096 --vocab 32000
"""

import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "reference"))
from lossd_testing import LossdServer  # noqa: E402

import lossd  # noqa: E402
import lossd.torch  # noqa: E402


def timed(function, runs):
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lossd", required=True)
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--target", default="", help="a running lossd instead of --lossd's")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((args.rows, args.vocab), dtype=np.float32)
    targets = rng.integers(0, args.vocab, args.rows)
    gib = logits.nbytes / 2**30

    server = None if args.target else LossdServer(args.lossd, "cpu").__enter__()
    address = args.target or server.address
    try:
        client = lossd.Client(address)
        results = {}
        handle = client.upload(logits).handle
        results["upload"] = timed(lambda: client.upload(logits, overwrite=handle), args.runs)

        def forward():
            client.upload(logits, overwrite=handle)
            client.forward(handle, targets)
        results["upload+forward"] = timed(forward, args.runs)
        results["download, fresh numpy.empty"] = timed(lambda: client.download(handle), args.runs)
        out = np.empty_like(logits)
        results["download, reused out="] = timed(lambda: client.download(handle, out=out),
                                                 args.runs)
        results["first touch alone (np.empty + fill)"] = timed(
            lambda: np.empty_like(logits).fill(1.0), args.runs)
        client.release(handle)

        # lossd.torch's step from CPU tensors (upload, forward, backward's download), the
        # gradient taken with autograd.grad so that nothing but lossd allocates per step.
        leaf = torch.from_numpy(logits).requires_grad_()
        target_tensor = torch.from_numpy(targets)
        buffer = torch.empty_like(leaf)

        def torch_step(**kwargs):
            loss = lossd.torch.cross_entropy(leaf, target_tensor, client=client, **kwargs)
            (gradient,) = torch.autograd.grad(loss, [leaf])
            assert kwargs.get("grad_out") is None or gradient.data_ptr() == buffer.data_ptr()
        results["lossd.torch step, gradient into fresh memory"] = timed(torch_step, args.runs)
        results["lossd.torch step, grad_out= reused"] = timed(
            lambda: torch_step(grad_out=buffer), args.runs)
        client.close()
    finally:
        if server is not None:
            server.__exit__(None, None, None)

    print("%d x %d float32 = %.2f GiB, median of %d runs, CPU device on loopback"
          % (args.rows, args.vocab, gib, args.runs))
    for name, seconds in results.items():
        print("  %-58s %7.3f s  %6.2f GiB/s" % (name, seconds, gib / seconds))


if __name__ == "__main__":
    main()
