#!/usr/bin/env python3
"""The user's step from Python, for bench/user_step.py. Modes:
  torch    lossd.torch.cross_entropy from a tensor on --device, the gradient back on it (CPU
           tensors: a GPU-less client, the gradient received into host memory: a fresh tensor
           at the first step, the same grad_out tensor after it);
  kd       the distillation step: lossd.torch.kl_div of the student's logits on --device
           against a top-k teacher as a teacher server sends it (--top_k indices int32 and
           logprobs float32 per token, on --device; 90% of the teacher's mass on them), with
           the targets (--alpha mixes in their cross entropy), the gradient back on the device;
  numpy    lossd.Client from numpy, the gradient into a numpy buffer kept from step to step;
  overlap  4 micro-batches (--micro_batches) of rows / 4, each one a "compute" (a timed matmul
           on --device standing in for the model's forward) and then its loss through
           lossd.torch: with --overlap, micro-batch k's upload, forward and download
           (cross_entropy_async, collected and backpropagated on a worker thread) run while
           micro-batch k+1 computes; without, one after the other. --matmuls 0 sizes the
           compute to the transfer of one micro-batch and prints it ({"calibration": ...}).
Prints one JSON object a step: seconds, upload, download (overlap: compute, transfer).
--single_stream: the client sends and receives over one gRPC stream (no data connections, no
stripes), as bench/python_server.py needs.

  python3 bench/user_step_python.py --mode=torch --target=127.0.0.1:50051 --rows=8192 \
      --vocab=128256 --steps=3 --device=cuda
(`import lossd` from the build's client/python, or a scripts/gpu-python install.)
"""
import argparse
import contextlib
import json
import statistics
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


def random_logits(rows, vocab, device, seed=0):
    """bf16 logits on `device`: drawn there on a GPU, from random_bf16_bits on the CPU."""
    import torch

    if device.type == "cuda":
        generator = torch.Generator(device=device).manual_seed(seed)
        return 3 * torch.randn(rows, vocab, generator=generator, device=device,
                               dtype=torch.bfloat16)
    return torch.from_numpy(random_bf16_bits(rows, vocab, seed).view(np.int16)).view(
        torch.bfloat16)


def torch_device(name):
    import torch

    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def synchronize(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def top_k_teacher(rows, vocab, k, device, seed=3):
    """A top-k teacher as a teacher server sends it: k distinct indices [rows, k] int32 (a random
    start and a stride of vocab // k, so distinct without a sort) and their logprobs [rows, k]
    float32, summing to 90% of the mass."""
    import torch

    generator = torch.Generator(device=device).manual_seed(seed)
    start = torch.randint(0, vocab, (rows, 1), generator=generator, device=device)
    steps = torch.arange(k, device=device) * max(1, vocab // k)
    indices = ((start + steps) % vocab).to(torch.int32)
    spread = 2 * torch.randn(rows, k, generator=generator, device=device)
    logprobs = torch.log_softmax(spread, -1) + float(np.log(0.9))
    return indices, logprobs


def torch_steps(client, args):
    import torch

    import lossd.torch

    device = torch_device(args.device)
    logits = random_logits(args.rows, args.vocab, device)
    targets = torch.randint(0, args.vocab, (args.rows,), device=device)
    if args.mode == "kd":
        teacher = top_k_teacher(args.rows, args.vocab, args.top_k, device)

        def loss_of(x, grad_out):  # kl_div takes no grad_out: a fresh gradient each step
            return lossd.torch.kl_div(x, teacher, targets, client=client, alpha=args.alpha,
                                      top_k_tail=args.top_k_tail)
    else:
        def loss_of(x, grad_out):
            return lossd.torch.cross_entropy(x, targets, client=client, grad_out=grad_out)
    # Host memory: the first step receives the gradient into a fresh tensor (first-touch page
    # faults), the later ones into the one kept, as numpy_steps' out= buffer.
    grad_out = None
    for step in range(args.steps):
        x = logits.detach().requires_grad_()
        synchronize(device)
        start = time.perf_counter()
        loss = loss_of(x, grad_out)
        synchronize(device)
        forward = time.perf_counter() - start
        at = time.perf_counter()
        loss.backward()
        synchronize(device)
        backward = time.perf_counter() - at
        total = time.perf_counter() - start
        assert x.grad.device == device and x.grad.dtype == torch.bfloat16
        if device.type == "cpu":
            grad_out = x.grad
        # "upload" is the forward call (upload, then Forward), "download" the backward call
        # (Backward, the download and its copies to the device).
        record = {"step": step, "seconds": total, "upload": forward, "download": backward,
                  "loss": loss.item()}
        if args.mode == "kd":
            record["distillation_loss"] = loss.distillation_loss
        print(json.dumps(record), flush=True)
        del x, loss


class Compute:
    """The stand-in for a micro-batch's model forward: `count` products of two square matrices
    (4096 x 4096 bf16 on a GPU, 512 x 512 float32 on the CPU), waited for. Returns its
    seconds."""

    def __init__(self, device, count):
        import torch

        side = 4096 if device.type == "cuda" else 512
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        generator = torch.Generator(device=device).manual_seed(2)
        self.a = torch.randn(side, side, generator=generator, device=device, dtype=dtype)
        self.out = torch.empty_like(self.a)
        self.device = device
        self.count = count

    def __call__(self):
        import torch

        start = time.perf_counter()
        for _ in range(self.count):
            torch.matmul(self.a, self.a, out=self.out)
        synchronize(self.device)
        return time.perf_counter() - start


def overlap_steps(client, args):
    import concurrent.futures

    import torch

    import lossd.torch

    device = torch_device(args.device)
    rows = args.rows // args.micro_batches
    logits = [random_logits(rows, args.vocab, device, seed=k) for k in range(args.micro_batches)]
    targets = torch.randint(0, args.vocab, (args.micro_batches, rows), device=device)
    side = torch.cuda.Stream(device) if device.type == "cuda" else None

    def transfer(pending):
        """Collects a micro-batch's loss and downloads its gradient (on the side stream, so the
        copies do not queue behind the next compute); its seconds from the start of the
        upload."""
        context = torch.cuda.stream(side) if side is not None else contextlib.nullcontext()
        with context:
            loss = pending.result()
            loss.backward()
            if side is not None:
                side.synchronize()
        return time.perf_counter() - pending.started

    def start(k):
        x = logits[k].detach().requires_grad_()
        pending = lossd.torch.cross_entropy_async(x, targets[k], client=client)
        pending.started = time.perf_counter()
        return pending

    # Calibrated on a burst: one product waited for alone takes about twice its share of many.
    compute = Compute(device, args.matmuls or 50)
    compute()  # warm-up: the GEMM's workspace and kernel choice
    transfer(start(0))  # warm-up: connections and scratch buffers
    if args.matmuls == 0:
        one_matmul = compute() / compute.count
        one_transfer = statistics.median(transfer(start(k)) for k in range(args.micro_batches))
        compute.count = max(1, round(one_transfer / one_matmul))
        print(json.dumps({"calibration": True, "matmuls": compute.count,
                          "matmul_seconds": one_matmul, "transfer_seconds": one_transfer}),
              flush=True)
    with concurrent.futures.ThreadPoolExecutor(1) as worker:
        for step in range(args.steps):
            synchronize(device)
            begin = time.perf_counter()
            computed, transfers, waiting = 0.0, [], []
            for k in range(args.micro_batches):
                computed += compute()
                pending = start(k)
                if args.overlap:
                    waiting.append(worker.submit(transfer, pending))
                else:
                    transfers.append(transfer(pending))
            transfers += [future.result() for future in waiting]
            synchronize(device)
            total = time.perf_counter() - begin
            print(json.dumps({"step": step, "seconds": total, "compute": computed,
                              "transfer": sum(transfers), "matmuls": compute.count,
                              "overlap": args.overlap}), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=["torch", "kd", "numpy", "overlap"], required=True)
    parser.add_argument("--target", required=True)
    parser.add_argument("--rows", type=int, required=True)
    parser.add_argument("--vocab", type=int, required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device", default="cuda",
                        help="--mode=torch and overlap: where the logits (and the compute) live")
    parser.add_argument("--micro_batches", type=int, default=4)
    parser.add_argument("--overlap", type=int, default=1, help="--mode=overlap: 1 or 0")
    parser.add_argument("--matmuls", type=int, default=0,
                        help="--mode=overlap: products a micro-batch's compute; 0 = calibrate")
    parser.add_argument("--top_k", type=int, default=64, help="--mode=kd: the teacher's k")
    parser.add_argument("--top_k_tail", default="bucket", choices=["bucket", "renormalize"],
                        help="--mode=kd: what the teacher's tail mass means")
    parser.add_argument("--alpha", type=float, default=0.0,
                        help="--mode=kd: the weight of the cross entropy against the targets")
    parser.add_argument("--single_stream", action="store_true",
                        help="one gRPC stream each way (for bench/python_server.py)")
    args = parser.parse_args()
    options = {}
    if args.single_stream:
        options = dict(upload_streams=1, data_connection=False, chunk_bytes=4 << 20)
    with lossd.Client(args.target, **options) as client:
        if args.mode == "numpy":
            numpy_steps(client, args)
        elif args.mode == "overlap":
            overlap_steps(client, args)
        else:
            torch_steps(client, args)


if __name__ == "__main__":
    main()
