#!/usr/bin/env python3
"""Liger-Kernel's cross entropy beside lossd's kernel, option set by option set.

Runs Liger's Triton cross entropy (forward + backward in place, bf16, mean, as
its users call it) on the shapes and option sets of `cross_entropy_bench
--option_sets`, then joins the bench's table (its --out file) with Liger's
times: lossd x Liger = Liger ms / lossd ms.

Liger is not part of lossd: point --liger_src at a checkout's src/ folder (the
GPU machine has torch and triton). Usage, on the GPU machine:
  cross_entropy_bench --option_sets --bf16 --gradient --out=RESULTS.md
  python3 bench/options_peer.py --liger_src=LIGER/src --lossd_results=RESULTS.md
"""
import argparse
import re
import sys

SETS = [
    # name, label_smoothing, softcap, class weights, z-loss
    ("plain", 0.0, None, False, 0.0),
    ("smoothing 0.1", 0.1, None, False, 0.0),
    ("softcap 30", 0.0, 30.0, False, 0.0),
    ("class weights", 0.0, None, True, 0.0),
    ("z-loss 1e-4", 0.0, None, False, 1e-4),
    ("all four", 0.1, 30.0, True, 1e-4),
]
SHAPES = [(8192, 128256), (16384, 131072), (4096, 262144), (8192, 50257),
          (8192, 32000)]


def liger_times(src, runs):
    sys.path.insert(0, src)
    import torch
    from liger_kernel.ops.cross_entropy import LigerCrossEntropyFunction

    times = {}
    for rows, vocab in SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(42)
        pristine = (torch.rand(rows, vocab, device="cuda", generator=gen,
                               dtype=torch.float32) * 16 - 8).to(torch.bfloat16)
        target = torch.randint(0, vocab, (rows,), device="cuda", generator=gen)
        target[49::50] = -100  # 2% ignored, as the kernel bench
        weight = 0.25 + 1.75 * torch.rand(vocab, device="cuda", generator=gen)
        work = torch.empty_like(pristine)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        for name, eps, cap, weighted, zls in SETS:
            samples = []
            for i in range(runs + 5):
                work.copy_(pristine)  # Liger writes the gradient in place
                x = work.requires_grad_(True)
                start.record()
                loss = LigerCrossEntropyFunction.apply(
                    x, target, weight if weighted else None, -100, zls, eps,
                    "mean", cap, False, False, False)[0]
                loss.backward()
                end.record()
                end.synchronize()
                x.requires_grad_(False)
                if i >= 5:
                    samples.append(start.elapsed_time(end))
            samples.sort()
            times[(rows, vocab, name)] = samples[len(samples) // 2]
            print(f"liger {rows}x{vocab} {name}: {times[(rows, vocab, name)]:.3f} ms",
                  flush=True)
        del pristine, work
        torch.cuda.empty_cache()
    return times


def lossd_times(path):
    """(rows, vocab, options) -> ms from the bench's fwd+grad bf16 rows."""
    out = {}
    row = re.compile(r"^\| (\d+) x (\d+) \| bf16 \| fwd\+grad \| ([^|]+) \| auto "
                     r"\| ([0-9.]+) \|")
    with open(path) as f:
        for line in f:
            m = row.match(line)
            if m:
                out[(int(m[1]), int(m[2]), m[3].strip())] = float(m[4])
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--liger_src", required=True)
    ap.add_argument("--lossd_results", required=True)
    ap.add_argument("--runs", type=int, default=20)
    args = ap.parse_args()
    liger = liger_times(args.liger_src, args.runs)
    lossd = lossd_times(args.lossd_results)
    print("\n| N x V bf16 | options | Liger ms | lossd ms | lossd x Liger |")
    print("|---|---|---|---|---|")
    for rows, vocab in SHAPES:
        for name, *_ in SETS:
            key = (rows, vocab, name)
            if key not in liger or key not in lossd:
                continue
            print(f"| {rows} x {vocab} | {name} | {liger[key]:.3f} | "
                  f"{lossd[key]:.3f} | {liger[key] / lossd[key]:.2f} |")


if __name__ == "__main__":
    main()
