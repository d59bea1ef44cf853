#!/usr/bin/env python3
"""The orchestrator's step with the LM head on the server against the logits step, in one run.

For each shape rows x hidden x vocab (bf16), bench/linear_step_bench times through one
lossd::Client over loopback: the linear step (upload hidden states [N, H] and targets,
LinearForward in place with dW accumulated in fp32 on the server, Backward, download dX; dW
downloaded as bf16 once per 8 steps) and the logits step (upload logits [N, V] and targets,
Forward in place, Backward, download the gradient). It reports each way's first step and steady
state (median of the later steps, the dW download amortised over its 8 steps) and their ratio.
--precision picks LinearForward's precision (exact: the split dW; fast: 16-bit products as the
peers compute them); both runs the linear step twice, exact then fast, against one logits step,
one row and one ratio each.

  python3 bench/linear_step.py --build build-gpu --out $OUT/LINEAR_STEP.md   (the H200)
  python3 bench/linear_step.py --build build --small                         (CPU, here)
  python3 bench/linear_step.py --build build-gpu --precision=both            (exact and fast)
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from bench_server import start_server, stop

SMALL_SHAPES = "256x64x2048,128x128x1000"
GPU_SHAPES = "16384x4096x131072,8192x4096x128256"


def steady(steps, dw_every):
    """(first step, steady state) seconds; the steady state adds the dW download's share."""
    seconds = [s["seconds"] - s.get("download_dw", 0.0) for s in steps]
    later = seconds[1:] or seconds
    dw = [s["download_dw"] for s in steps if s.get("download_dw", 0.0) > 0]
    share = statistics.median(dw) / dw_every if dw else 0.0
    return steps[0]["seconds"], statistics.median(later) + share


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", default="build-gpu", help="the build folder (lossd, bench)")
    parser.add_argument("--shapes", default=None, help=f"default {GPU_SHAPES} ({SMALL_SHAPES} "
                        "with --small)")
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument("--dw_every", type=int, default=8)
    parser.add_argument("--device", default=None, help="lossd --device (default cuda; cpu with "
                        "--small)")
    parser.add_argument("--small", action="store_true", help="small shapes on the CPU device")
    parser.add_argument("--overwrite_weight", action="store_true",
                        help="also re-upload W in place before each linear step (timed apart)")
    parser.add_argument("--precision", default="exact", choices=("exact", "fast", "both"),
                        help="LinearForward's precision; both: exact and fast in one run")
    parser.add_argument("--out", default=None, help="append the markdown table here")
    args = parser.parse_args()
    shapes = args.shapes or (SMALL_SHAPES if args.small else GPU_SHAPES)
    precisions = ("exact", "fast") if args.precision == "both" else (args.precision,)
    device = args.device or ("cpu" if args.small else "cuda")

    build = os.path.abspath(args.build)
    lines = [f"Command: `python3 bench/linear_step.py {' '.join(sys.argv[1:])}`", ""]
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version",
                          "--format=csv,noheader"], capture_output=True,
                         text=True).stdout.strip() if shutil.which("nvidia-smi") else ""
    lines.append(f"Machine: {os.cpu_count()} CPUs{'; GPU ' + gpu if gpu else ''}; device "
                 f"{device}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    lines += ["", "| rows x hidden x vocab (bf16) | way | precision | first step s | steady s | "
              "upload | forward | download | kernel | logits / linear |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    port_file = tempfile.mktemp(prefix="linear_step_lossd_")
    server, target = start_server(
        [os.path.join(build, "server", "lossd"), "--host=127.0.0.1", "--port=0",
         f"--port_file={port_file}", f"--device={device}", "--metrics_port=-1",
         "--data_port=0"], port_file)
    try:
        for shape in shapes.split(","):
            rows, hidden, vocab = (int(x) for x in shape.split("x"))
            results = []
            for i, precision in enumerate(precisions):
                cmd = [os.path.join(build, "bench", "linear_step_bench"), f"--target={target}",
                       f"--rows={rows}", f"--hidden={hidden}", f"--vocab={vocab}",
                       f"--steps={args.steps}", f"--dw_every={args.dw_every}",
                       f"--precision={precision}"]
                if args.overwrite_weight:
                    cmd.append("--overwrite_weight")
                if i + 1 < len(precisions):
                    cmd.append("--nologits_step")  # one logits step, with the last precision
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
                if done.returncode != 0:
                    raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
                results += [json.loads(line) for line in done.stdout.splitlines()
                            if line.startswith("{")]
            by_way = {way: [r for r in results if r["way"] == way] for way in ("linear", "logits")}
            print(json.dumps({"shape": shape, **by_way}), flush=True)
            _, logits_steady = steady(by_way["logits"], args.dw_every)
            rows_out = [("linear", precision,
                         [r for r in by_way["linear"] if r["precision"] == precision])
                        for precision in precisions]
            rows_out.append(("logits", "", by_way["logits"]))
            for way, precision, steps in rows_out:
                first, value = steady(steps, args.dw_every)
                later = steps[1:] or steps
                med = {k: statistics.median(s[k] for s in later)
                       for k in ("upload", "forward", "download", "kernel")}
                ratio = f"{logits_steady / value:.2f}x" if way == "linear" else ""
                lines.append(f"| {shape} | {way} | {precision} | {first:.3f} | {value:.3f} | "
                             f"{med['upload']:.3f} | {med['forward']:.3f} | "
                             f"{med['download']:.3f} | {med['kernel']:.3f} | {ratio} |")
                if way == "linear" and args.overwrite_weight:
                    overwrite = statistics.median(s["overwrite_weight"] for s in steps)
                    lines.append(f"| {shape} | W overwrite (per step) | {precision} | | "
                                 f"{overwrite:.3f} | | | | | |")
    finally:
        stop(server)
    table = "\n".join(lines) + "\n"
    print(table)
    if args.out:
        with open(args.out, "a") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
