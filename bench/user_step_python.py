#!/usr/bin/env python3
"""The user's step from Python, for bench/user_step.py: ways 1 (lossd.torch.cross_entropy from a
tensor on --device, gradient back on it) and 2 (lossd.Client from numpy, gradient into a numpy
buffer kept from step to step). Prints one JSON object a step: seconds, upload, download.

  python3 bench/user_step_python.py --mode=torch --target=127.0.0.1:50051 --rows=8192 \
      --vocab=128256 --steps=3 --device=cuda
(`import lossd` from the build's client/python, or scripts/gpu-python build's folder.)
"""
import argparse
import json
import time

import numpy as np

import lossd


def random_bf16_bits(rows, vocab, seed=0):
    """bf16 logits (standard normal times 3) as uint16 bits: a 64 MiB random block repeated,
    since drawing billions of normals would dominate the set-up."""
    rng = np.random.default_rng(seed)
    total = rows * vocab
    block = min(total, 32 << 20)
    values = (rng.standard_normal(block, dtype=np.float32) * 3).view(np.uint32)
    bits = ((values + 0x7FFF + ((values >> 16) & 1)) >> 16).astype(np.uint16)  # round to even
    out = np.empty(total, np.uint16)
    for first in range(0, total, block):
        count = min(block, total - first)
        out[first:first + count] = bits[:count]
    return out.reshape(rows, vocab)


def numpy_steps(client, args):
    logits = random_bf16_bits(args.rows, args.vocab)
    targets = np.random.default_rng(1).integers(0, args.vocab, args.rows)
    gradient = None  # kept from step to step: only the first step allocates it
    for step in range(args.steps):
        start = time.perf_counter()
        handle = client.upload(logits, dtype="bf16").handle
        targets_handle = client.upload(targets).handle
        upload = time.perf_counter() - start
        at = time.perf_counter()
        result = client.forward(handle, targets_handle)
        forward = time.perf_counter() - at
        at = time.perf_counter()
        client.backward(result.gradient, 1.0)
        if gradient is None:
            gradient = np.empty_like(logits)
        client.download(result.gradient, out=gradient)
        download = time.perf_counter() - at
        total = time.perf_counter() - start
        client.release(result.gradient)
        client.release(targets_handle)
        print(json.dumps({"step": step, "seconds": total, "upload": upload, "forward": forward,
                          "download": download, "loss": result.loss}), flush=True)


def torch_steps(client, args):
    import torch

    import lossd.torch

    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    generator = torch.Generator(device=device).manual_seed(0)
    logits = 3 * torch.randn(args.rows, args.vocab, generator=generator, device=device,
                             dtype=torch.bfloat16)
    targets = torch.randint(0, args.vocab, (args.rows,), device=device)

    def synchronize():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for step in range(args.steps):
        x = logits.detach().requires_grad_()
        synchronize()
        start = time.perf_counter()
        loss = lossd.torch.cross_entropy(x, targets, client=client)
        synchronize()
        forward = time.perf_counter() - start
        at = time.perf_counter()
        loss.backward()
        synchronize()
        backward = time.perf_counter() - at
        total = time.perf_counter() - start
        assert x.grad.device == device and x.grad.dtype == torch.bfloat16
        # "upload" is the forward call (upload, then Forward), "download" the backward call
        # (Backward, the download and its copies to the device).
        print(json.dumps({"step": step, "seconds": total, "upload": forward,
                          "download": backward, "loss": loss.item()}), flush=True)
        del x, loss


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=["torch", "numpy"], required=True)
    parser.add_argument("--target", required=True)
    parser.add_argument("--rows", type=int, required=True)
    parser.add_argument("--vocab", type=int, required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device", default="cuda", help="--mode=torch: where the logits live")
    args = parser.parse_args()
    with lossd.Client(args.target) as client:
        if args.mode == "numpy":
            numpy_steps(client, args)
        else:
            torch_steps(client, args)


if __name__ == "__main__":
    main()
