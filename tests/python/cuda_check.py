#!/usr/bin/env python3
"""The CUDA path of lossd.torch checked on a GPU machine without pytest (the device machine's
Python has torch but no pytest): test_torch.py's test_cuda_tensors as a plain script, plus
cross_entropy_async from a side stream, a backward on a side stream beside a busy default stream, gradient accumulation and linear_cross_entropy with CUDA hidden states, against a lossd it starts (--lossd; its CPU device unless --device).

  PYTHONPATH=<lossd package folder> python3 tests/python/cuda_check.py --lossd=build/server/lossd
Exits 0 when every case matches F.cross_entropy, 1 on a mismatch, 77 without a CUDA device."""

import argparse
import os
import sys
import threading

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "reference"))
from lossd_testing import LossdServer  # noqa: E402

import lossd  # noqa: E402
import lossd.torch  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
RTOL = {"fp32": 2e-5, "bf16": 2 ** -7, "fp16": 2 ** -9}


def close(actual, expected, name):
    rtol = RTOL[name]
    scale = expected.abs().max().item()
    try:
        torch.testing.assert_close(actual.double().cpu(), expected.double().cpu(), rtol=rtol,
                                   atol=rtol * scale + 1e-12)
        return None
    except AssertionError as error:
        return str(error).splitlines()[0]


def case(client, name, reduction, rows, vocab, seed):
    dtype = DTYPES[name]
    generator = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(rows, vocab, generator=generator)).to(dtype)
    target = torch.randint(0, vocab, (rows,), generator=generator)
    target[::5] = -100
    weight = torch.rand(vocab, generator=generator) + 0.5
    x = logits.cuda().requires_grad_()
    loss = lossd.torch.cross_entropy(x, target.cuda(), client=client, weight=weight.cuda(),
                                     reduction=reduction, label_smoothing=0.1)
    reference_x = logits.double().requires_grad_()
    reference = F.cross_entropy(reference_x, target, weight=weight.double(),
                                reduction=reduction, label_smoothing=0.1)
    grad_output = torch.rand(reference.shape, dtype=torch.float64, generator=generator)
    loss.backward(grad_output.to(dtype).cuda())
    reference.backward(grad_output.to(dtype).double())
    problems = []
    if loss.device != x.device or x.grad.device != x.device or x.grad.dtype != dtype:
        problems.append("device/dtype: loss on %s, grad %s on %s" % (
            loss.device, x.grad.dtype, x.grad.device))
    for what, actual, expected in (("loss", loss, reference.to(dtype)),
                                   ("gradient", x.grad, reference_x.grad.to(dtype))):
        problem = close(actual, expected, name)
        if problem:
            problems.append("%s: %s" % (what, problem))
    return problems


def overlapped(client):
    """cross_entropy_async from CUDA logits made on a side stream, with a matmul queued after
    each start (the next micro-batch's compute): every loss and gradient as F.cross_entropy's."""
    side = torch.cuda.Stream()
    weight = torch.randn(2048, 2048, device="cuda")
    pending, inputs = [], []
    for seed in range(4):
        generator = torch.Generator().manual_seed(100 + seed)
        logits = torch.randn(256, 32000, generator=generator)
        target = torch.randint(0, 32000, (256,), generator=generator)
        with torch.cuda.stream(side):
            x = (logits.cuda(non_blocking=True) * 1.0).requires_grad_()
            pending.append(lossd.torch.cross_entropy_async(x, target.cuda(), client=client))
            weight = weight @ weight.T / 2048  # queued behind the upload's start
        inputs.append((x, logits, target))
    problems = []
    for (x, logits, target), handle in zip(inputs, pending):
        handle.result().backward()
        reference_x = logits.double().requires_grad_()
        reference = F.cross_entropy(reference_x, target)
        reference.backward()
        for what, actual, expected in (("loss", handle.result(), reference.float()),
                                       ("gradient", x.grad, reference_x.grad.float())):
            problem = close(actual, expected, "fp32")
            if problem:
                problems.append("%s: %s" % (what, problem))
    return problems


def backward_beside_busy_stream(client):
    """The pattern of bench/user_step_python.py --mode=overlap: a micro-batch's loss and backward
    on a worker thread under a side stream while the default stream computes (about a second
    of matmuls). The gradient must come back before that compute ends (its copies run on the
    backward's stream, not behind the compute) and match F.cross_entropy's."""
    generator = torch.Generator().manual_seed(11)
    logits = torch.randn(256, 32000, generator=generator)
    target = torch.randint(0, 32000, (256,), generator=generator)
    x = logits.cuda().requires_grad_()
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    busy = torch.randn(4096, 4096, device="cuda")
    for _ in range(400):
        busy = busy @ busy.T / 4096
    computed = torch.cuda.Event()
    computed.record()
    outcome = {}

    def loss_step():
        with torch.cuda.stream(side):
            lossd.torch.cross_entropy(x, target.cuda(), client=client).backward()
            side.synchronize()
        outcome["compute still running"] = not computed.query()

    worker = threading.Thread(target=loss_step)
    worker.start()
    worker.join()
    torch.cuda.synchronize()
    reference_x = logits.double().requires_grad_()
    F.cross_entropy(reference_x, target).backward()
    problems = []
    if not outcome.get("compute still running"):
        problems.append("the gradient waited for the default stream's compute")
    problem = close(x.grad, reference_x.grad.float(), "fp32")
    if problem:
        problems.append("gradient: " + problem)
    return problems


def accumulation(client):
    logits = torch.randn(64, 1000)
    target = torch.randint(0, 1000, (64,))
    x = logits.cuda().requires_grad_()
    x.grad = torch.full_like(x, 0.25)
    for _ in range(2):
        lossd.torch.cross_entropy(x, target.cuda(), client=client).backward()
    reference_x = logits.double().requires_grad_()
    F.cross_entropy(reference_x, target).backward()
    problem = close(x.grad, (0.25 + 2 * reference_x.grad).float(), "fp32")
    return [problem] if problem else []


def linear(client, name):
    """linear_cross_entropy with CUDA hidden states: dX comes back on the hidden states' device,
    and the fp32 weight and bias gradients on the server match float64 torch."""
    dtype = DTYPES[name]
    generator = torch.Generator().manual_seed(7)
    hidden = torch.randn(300, 64, generator=generator).to(dtype)
    weight = (0.5 * torch.randn(1000, 64, generator=generator)).to(dtype)
    bias = (0.1 * torch.randn(1000, generator=generator)).to(dtype)
    target = torch.randint(0, 1000, (300,), generator=generator)
    target[::5] = -100

    def stored(tensor):
        tensor = tensor.contiguous()
        data = tensor.view(torch.int16).numpy() if dtype == torch.bfloat16 else tensor.numpy()
        return client.upload(data, dtype={torch.float32: "float32",
                                          torch.bfloat16: "bf16"}[dtype]).handle

    weight_handle, bias_handle = stored(weight), stored(bias)
    x = hidden.cuda().requires_grad_()
    loss = lossd.torch.linear_cross_entropy(x, weight_handle, target.cuda(), client=client,
                                            bias_handle=bias_handle, label_smoothing=0.1)
    loss.backward()
    reference = [t.double().requires_grad_() for t in (hidden, weight, bias)]
    F.cross_entropy(F.linear(*reference), target, label_smoothing=0.1).backward()
    problems = []
    if x.grad is None or x.grad.device != x.device:
        return ["dX is not on %s" % x.device]
    for what, got, want in (
            ("loss", loss.detach().reshape(1), F.cross_entropy(
                F.linear(*[t.detach() for t in reference]), target,
                label_smoothing=0.1).reshape(1)),
            ("dX", x.grad, reference[0].grad),
            ("dW", torch.from_numpy(client.download(loss.weight_grad_handle)), reference[1].grad),
            ("dbias", torch.from_numpy(client.download(loss.bias_grad_handle)),
             reference[2].grad)):
        problem = close(got, want, name)
        if problem:
            problems.append("%s: %s" % (what, problem))
    for handle in (weight_handle, bias_handle, loss.weight_grad_handle, loss.bias_grad_handle):
        client.release(handle)
    return problems


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lossd", required=True)
    parser.add_argument("--device", default="cpu", help="the lossd server's --device")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("cuda_check: skipped: torch sees no CUDA device")
        return 77
    failures = 0
    with LossdServer(args.lossd, args.device) as server:
        # Small pieces, so that even these tensors go as many pieces over data connections.
        with lossd.Client(server.address, piece_bytes=64 << 10,
                          stripe_min_bytes=1 << 20) as client:
            shapes = [(512, 4099), (3, 50257), (1024, 32000)]
            for name in sorted(DTYPES):
                for reduction in ("mean", "sum", "none"):
                    for seed, (rows, vocab) in enumerate(shapes):
                        problems = case(client, name, reduction, rows, vocab, seed)
                        status = "ok" if not problems else "FAILED " + "; ".join(problems)
                        print("%s %s %dx%d: %s" % (name, reduction, rows, vocab, status))
                        failures += bool(problems)
            problems = overlapped(client)
            print("cross_entropy_async, 4 in flight from a side stream:",
                  "ok" if not problems else problems)
            failures += bool(problems)
            problems = backward_beside_busy_stream(client)
            print("backward on a side stream beside a busy default stream:",
                  "ok" if not problems else problems)
            failures += bool(problems)
            problems = accumulation(client)
            print("accumulation into .grad:", "ok" if not problems else problems)
            failures += bool(problems)
            for name in ("fp32", "bf16"):
                problems = linear(client, name)
                print("linear_cross_entropy %s, CUDA hidden states:" % name,
                      "ok" if not problems else problems)
                failures += bool(problems)
            left = client.list().tensors
            if left:
                print("left on the server:", left)
                failures += 1
    print("cuda_check: %s" % ("all ok" if failures == 0 else "%d failed" % failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
