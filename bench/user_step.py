#!/usr/bin/env python3
"""The user's training step every way, each in a fresh process, in one run.

For each shape (bf16 logits [rows, vocab], int64 targets): upload, forward in
place, backward, the gradient back where the user wants it. The ways:
  1. lossd.torch.cross_entropy from a CUDA tensor, gradient on the device;
  2. lossd.torch from CPU tensors (a GPU-less client: logits in host memory,
     the gradient received into host memory; skipped with --device=cpu, where
     way 1 is this);
  3. the Python client (lossd.Client) from numpy, gradient into numpy;
  4. lossctl with .npy files (fp32 file sent as bf16, gradient written back
     into a new float32 .npy file), or .safetensors files (the gradient as sent,
     bf16) with --lossctl_formats; with --lossctl=old=PATH,new=PATH, once with
     each of several lossctl builds;
  5. lossd::Client (bench/user_step_bench);
  6. the overlapped step: 4 micro-batches of rows / 4, each a "compute" (a
     timed matmul on --device standing in for the model) and its loss through
     lossd.torch, (a) one after the other and (b) with micro-batch k's upload,
     forward and download running during micro-batch k+1's compute
     (bench/user_step_python.py --mode=overlap; the compute is sized to one
     micro-batch's transfer; (b)'s transfer column counts its waits too);
  7. the Python server (bench/python_server.py: grpcio + torch), driven by
     the same C++ client over one gRPC stream each way;
  8. the distillation step: lossd.torch.kl_div of the CUDA (--device) logits
     against a top-k teacher as a teacher server sends it (--top_k indices
     int32 and logprobs float32 per token, on the device), forward KL with
     the --top_k_tail treatment, the gradient back on the device; beside
     way 1, the logits step of the same shape;
  9. the same distillation step against the Python server (its Forward
     written from the formulas in float32 torch), the client over one gRPC
     stream each way.
Raw TCP over loopback with the same bytes is the transport's ceiling. Every
way reports its first step and its steady state (median of the later steps),
and its ratio to the Python server's step; the targets of issue 27 are checked
on the steady step.

  python3 bench/user_step.py --build build-gpu --out $OUT/USER_STEP.md
(on the GPU machine after a scripts/gpu-python install; here, a smoke run of
every way in about a minute:
  python3 bench/user_step.py --build build-gpu --device=cpu --shapes=512x4096 --steps=2;
--ways=4,5,7 runs only lossctl, lossd::Client and the Python server, which need no Python
package)
"""
import argparse
import json
import os
import re
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time

from bench_server import start_server, stop

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_json(cmd, env=None, timeout=900):
    """Runs `cmd` and returns the JSON objects it printed, one a line."""
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    print(os.path.basename(cmd[1] if cmd[0] == sys.executable else cmd[0]), cmd[2:], results,
          flush=True)
    return results


def summary(steps):
    """(first step, steady state) seconds from a list of per-step dicts."""
    seconds = [s["seconds"] for s in steps]
    later = seconds[1:] or seconds
    return seconds[0], statistics.median(later)


def write_logits(folder, rows, vocab, fmt, rng):
    """An fp32 [rows, vocab] logits file in `folder` (.npy, or .safetensors with the tensor
    "logits"), written in row blocks of one random block repeated: never a second full-size array
    in this process, and no minutes spent drawing billions of normals. Returns lossctl's argument
    for it."""
    import numpy as np

    if fmt == "npy":
        path = os.path.join(folder, "logits.npy")
        out = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(rows, vocab))
        argument = path
    else:
        path = os.path.join(folder, "logits.safetensors")
        header = json.dumps({"logits": {"dtype": "F32", "shape": [rows, vocab],
                                        "data_offsets": [0, rows * vocab * 4]}}).encode()
        header += b" " * (-len(header) % 8)
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(header)) + header)
            f.truncate(8 + len(header) + rows * vocab * 4)
        out = np.memmap(path, dtype=np.float32, mode="r+", offset=8 + len(header),
                        shape=(rows, vocab))
        argument = path + ":logits"
    block = max(1, (256 << 20) // (4 * vocab))
    values = rng.standard_normal((min(block, rows), vocab), dtype=np.float32) * 3
    for first in range(0, rows, block):
        count = min(block, rows - first)
        out[first:first + count] = values[:count]
    out.flush()
    del out
    return argument


def lossctl_steps(lossctl, target, rows, vocab, steps, folder, fmt="npy"):
    """The README's lossctl step on files in `folder` (fp32 logits in a .npy or .safetensors
    file, the gradient back into a new file of the same format: float32 .npy, or bf16 as sent in
    .safetensors), timed per step."""
    import numpy as np

    rng = np.random.default_rng(0)
    logits_path = write_logits(folder, rows, vocab, fmt, rng)
    targets_path = os.path.join(folder, "targets.npy")
    gradient_path = os.path.join(folder, "gradient." + fmt)
    np.save(targets_path, rng.integers(0, vocab, rows))
    base = [lossctl, f"--server={target}"]

    def call(*args):
        done = subprocess.run(base + list(args), capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise RuntimeError(f"lossctl {' '.join(args)}: {done.stderr[-2000:]}")
        return done.stdout.strip()

    results = []
    for step in range(steps):
        if os.path.exists(gradient_path):
            os.unlink(gradient_path)  # each step writes a new file, as a user's would
        start = time.perf_counter()
        logits = call("upload", logits_path, "--dtype=bf16")
        targets = call("upload", targets_path)
        uploaded = time.perf_counter()
        call("forward", logits, targets)
        call("backward", logits, "--grad_output=1")
        computed = time.perf_counter()
        call("download", logits, gradient_path, "--dtype=bf16")
        end = time.perf_counter()
        call("rm", logits, targets)
        results.append({"step": step, "seconds": end - start, "upload": uploaded - start,
                        "download": end - computed})
    print("lossctl", fmt, results, flush=True)
    for name in os.listdir(folder):
        os.unlink(os.path.join(folder, name))
    return results


def scratch_folder(need_bytes):
    """/dev/shm when it holds the files (as the issue measures), else a temp folder."""
    shm = "/dev/shm"
    if os.path.isdir(shm) and shutil.disk_usage(shm).free > need_bytes * 1.2:
        return tempfile.mkdtemp(dir=shm, prefix="user_step_")
    return tempfile.mkdtemp(prefix="user_step_")


def overlap_lines(serial, overlapped, calibration):
    """The overlapped step against the serial one: the time it hides against the transfer time
    (both from the serial process, where each is measured alone)."""
    serial_steady = summary(serial)[1]
    overlapped_steady = summary(overlapped)[1]
    later = serial[1:] or serial
    compute = statistics.median(s["compute"] for s in later)
    transfer = statistics.median(s["transfer"] for s in later)
    hidden = serial_steady - overlapped_steady
    return [
        f"Overlapped step (6a/6b): 4 micro-batches, each {calibration['matmuls']} matmuls "
        f"({calibration['matmul_seconds'] * 1e3:.2f} ms each) of compute. One after the other "
        f"(steady): compute {compute:.3f} s + transfer {transfer:.3f} s = {serial_steady:.3f} s; "
        f"overlapped {overlapped_steady:.3f} s: **{hidden:.3f} s hidden**, "
        f"{100 * hidden / transfer:.0f}% of the transfer time. Besides the compute, micro-batch "
        f"k+1's upload and forward run beside micro-batch k's download (they overlap each "
        f"other): hidden beyond the compute time {max(0.0, hidden - compute):.3f} s.",
        ""]


# Issue 27's targets: (way's number, least ratio of the Python server's step to its steady step).
TARGETS = (("1.", 20), ("2.", 15), ("3.", 15), ("4.", 8))


def target_lines(ways, python_steady):
    """One line: each target of issue 27, met or missed, on the steady step; [] without the
    Python server's step (way 7)."""
    if python_steady != python_steady:  # NaN: way 7 not run
        return []
    checks = []
    for prefix, least in TARGETS:
        for name, steps in ways.items():
            # Way 1's target is for CUDA tensors (with --device=cpu it is the CPU tensors' way).
            if name.startswith(prefix) and (prefix != "1." or "cuda" in name):
                ratio = python_steady / summary(steps)[1]
                label = re.sub(r" \((fp32|GPU)[^)]*\).*", "", name)
                checks.append(f"{label} {ratio:.1f}x (>= {least}x: "
                              f"{'met' if ratio >= least else 'MISSED'})")
    return ["Targets, steady step vs the Python server: " + "; ".join(checks) + ".", ""]


def distillation_lines(ways, kd_name, kd_python_name, args):
    """The distillation step (way 8) against the logits step (way 1) and against the Python
    server's distillation (way 9), on the steady step; [] without way 8."""
    if kd_name not in ways:
        return []
    kd_first, kd_steady = summary(ways[kd_name])
    parts = [f"Distillation step (8: forward KL, top-{args.top_k} teacher, {args.top_k_tail} "
             f"tail, alpha 0) steady {kd_steady:.3f} s, first {kd_first:.3f} s"]
    logits_way = next((name for name in ways if name.startswith("1.")), None)
    if logits_way is not None:
        parts.append(f"{kd_steady / summary(ways[logits_way])[1]:.2f}x the logits step (1)")
    if kd_python_name in ways:
        python_first, python_steady = summary(ways[kd_python_name])
        parts.append(f"{python_steady / kd_steady:.1f}x faster than the Python server's "
                     f"distillation (9; first steps {python_first / kd_first:.1f}x)")
        losses = (ways[kd_name][-1].get("distillation_loss"),
                  ways[kd_python_name][-1].get("distillation_loss"))
        if None not in losses:
            parts.append("distillation losses lossd / Python server %.6g / %.6g" % losses)
    return ["; ".join(parts) + ".", ""]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", default="build-gpu", help="the build folder (lossd, lossctl, user_step_bench)")
    parser.add_argument("--python_package", default=None,
                        help="folder to put on PYTHONPATH for `import lossd` (default: BUILD/client/python; "
                        "'installed': the package pip installed into this Python)")
    parser.add_argument("--shapes", default="16384x131072,8192x128256")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--python_server_steps", type=int, default=1)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default=None, help="append the markdown table here")
    parser.add_argument("--ways", default="1,2,3,4,5,6,7,8,9",
                        help="the ways to run, by number (the ratios need 5 and 7)")
    parser.add_argument("--lossctl", default="",
                        help="way 4 with each of these lossctl binaries, comma-separated, each PATH "
                        "or NAME=PATH (default: BUILD/client/lossctl)")
    parser.add_argument("--lossctl_formats", default="npy",
                        help="way 4's file formats, comma-separated: npy, safetensors")
    parser.add_argument("--top_k", type=int, default=64, help="ways 8, 9: the teacher's k")
    parser.add_argument("--top_k_tail", default="bucket", choices=["bucket", "renormalize"])
    args = parser.parse_args()

    build = os.path.abspath(args.build)
    lossctl_binaries = [tuple(b.split("=", 1)) if "=" in b else ("", b)
                        for b in args.lossctl.split(",") if b] or [("", os.path.join(build, "client", "lossctl"))]
    env = dict(os.environ)
    if args.python_package != "installed":
        package = os.path.abspath(args.python_package or os.path.join(build, "client", "python"))
        env["PYTHONPATH"] = package + os.pathsep + os.environ.get("PYTHONPATH", "")
    lines = [f"Command: `python3 bench/user_step.py {' '.join(sys.argv[1:])}`", ""]
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip() if shutil.which("nvidia-smi") else ""
    lines.append(f"Machine: {os.cpu_count()} CPUs{'; GPU ' + gpu if gpu else ''}; "
                 f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    lines.append("")

    port_file = tempfile.mktemp(prefix="user_step_lossd_")
    server, target = start_server(
        [os.path.join(build, "server", "lossd"), "--host=127.0.0.1", "--port=0",
         f"--port_file={port_file}", f"--device={args.device}", "--metrics_port=-1", "--data_port=0"],
        port_file)
    try:
        for shape in args.shapes.split(","):
            rows, vocab = (int(x) for x in shape.split("x"))
            gb = rows * vocab * 2 / 1e9
            bench = os.path.join(build, "bench", "user_step_bench")
            sizes = [f"--rows={rows}", f"--vocab={vocab}"]
            tcp = {k: run_json([bench, f"--tcp_connections={k}"] + sizes)[0]["seconds"] for k in (1, 4)}
            python_step = [sys.executable, os.path.join(ROOT, "bench", "user_step_python.py"),
                           f"--target={target}", f"--steps={args.steps}"] + sizes
            ways = {}
            wanted = set(args.ways.split(","))
            if "1" in wanted:
                ways[f"1. lossd.torch from a {args.device} tensor"] = run_json(
                    python_step + ["--mode=torch", f"--device={args.device}"], env=env)
            if "2" in wanted and args.device != "cpu":
                ways["2. lossd.torch from CPU tensors (GPU-less client)"] = run_json(
                    python_step + ["--mode=torch", "--device=cpu"], env=env)
            if "3" in wanted:
                ways["3. Python client from numpy"] = run_json(python_step + ["--mode=numpy"], env=env)
            if "4" in wanted:
                folder = scratch_folder(rows * vocab * 8)
                try:
                    for fmt in args.lossctl_formats.split(","):
                        for name, lossctl in lossctl_binaries:
                            label = f" ({name})" if name else ""
                            ways[f"4. lossctl{label}, .{fmt} files (fp32 sent as bf16) in "
                                 f"{os.path.dirname(folder)}"] = lossctl_steps(
                                     lossctl, target, rows, vocab, args.steps, folder, fmt)
                finally:
                    shutil.rmtree(folder, ignore_errors=True)
            if "5" in wanted:
                ways["5. lossd::Client"] = run_json([bench, f"--target={target}", f"--steps={args.steps}"] + sizes)
            serial = overlapped = None
            if "6" in wanted:
                serial = run_json(python_step + ["--mode=overlap", f"--device={args.device}", "--overlap=0"],
                                  env=env)
                calibration = next(s for s in serial if "calibration" in s)
                serial = [s for s in serial if "calibration" not in s]
                overlapped = run_json(python_step + ["--mode=overlap", f"--device={args.device}", "--overlap=1",
                                                     f"--matmuls={calibration['matmuls']}"], env=env)
                ways["6a. 4 micro-batches + compute, one after the other"] = serial
                ways["6b. 4 micro-batches + compute, overlapped"] = overlapped
            kd = [f"--top_k={args.top_k}", f"--top_k_tail={args.top_k_tail}"]
            kd_name = f"8. lossd.torch.kl_div, top-{args.top_k} teacher, from a {args.device} tensor"
            kd_python_name = "9. Python server (grpcio + torch), the same distillation"
            if "8" in wanted:
                ways[kd_name] = run_json(python_step + ["--mode=kd", f"--device={args.device}"] + kd,
                                         env=env)
            if "7" in wanted or "9" in wanted:
                python_port = tempfile.mktemp(prefix="user_step_python_")
                python, python_target = start_server(
                    [sys.executable, os.path.join(ROOT, "bench", "python_server.py"),
                     f"--stubs={os.path.join(build, 'tests', 'reference', 'py')}", f"--port_file={python_port}",
                     f"--device={args.device}"], python_port)
                try:
                    if "7" in wanted:
                        ways["7. Python server (grpcio + torch)"] = run_json(
                            [bench, f"--target={python_target}", f"--steps={args.python_server_steps}",
                             "--single_stream"] + sizes)
                    if "9" in wanted:
                        ways[kd_python_name] = run_json(
                            [sys.executable, os.path.join(ROOT, "bench", "user_step_python.py"),
                             f"--target={python_target}", f"--steps={args.python_server_steps}",
                             "--mode=kd", f"--device={args.device}", "--single_stream"] + sizes + kd,
                            env=env)
                finally:
                    stop(python)
            nan = float("nan")
            python_first, python_steady = summary(ways.get("7. Python server (grpcio + torch)", [{"seconds": nan}]))
            client_steady = summary(ways.get("5. lossd::Client", [{"seconds": nan}]))[1]
            lines.append(f"### {rows} x {vocab} bf16 ({gb:.2f} GB each way)")
            lines.append("")
            lines.append(f"Raw TCP over loopback, the same bytes once: 1 connection {tcp[1]:.3f} s "
                         f"({gb / tcp[1]:.2f} GB/s), 4 connections {tcp[4]:.3f} s ({gb / tcp[4]:.2f} GB/s). "
                         "A step moves the bytes twice: its floor is 2 x the 4-connection time.")
            lines.append("")
            lines.append("| way | first step | steady step | vs Python server (first / steady) | "
                         "steady vs lossd::Client | steady vs 2x raw TCP (4 conn.) | upload / download (steady) |")
            lines.append("|---|---|---|---|---|---|---|")
            for name, steps in ways.items():
                first, steady = summary(steps)
                later = steps[1:] or steps
                # The overlapped step's columns: its compute and transfer (micro-batches summed).
                up_key, down_key = ("compute", "transfer") if "compute" in later[0] else ("upload", "download")
                up = statistics.median(s.get(up_key, float("nan")) for s in later)
                down = statistics.median(s.get(down_key, float("nan")) for s in later)
                parts = "" if up_key == "upload" else " (compute / transfer)"
                lines.append(f"| {name} | {first:.3f} s | {steady:.3f} s | {python_first / first:.1f}x / "
                             f"{python_steady / steady:.1f}x | {steady / client_steady:.2f} | "
                             f"{steady / (2 * tcp[4]):.2f} | {up:.3f} / {down:.3f} s{parts} |")
            lines.append("")
            if serial is not None:
                lines += overlap_lines(serial, overlapped, calibration)
            lines += target_lines(ways, python_steady)
            lines += distillation_lines(ways, kd_name, kd_python_name, args)
            print("\n".join(lines[-len(ways) - 14:]), flush=True)
            if args.out:  # each shape as it is done: a run cut short keeps the shapes it did
                with open(args.out, "a") as f:
                    f.write("\n".join(lines) + "\n")
                lines = []
    finally:
        stop(server)


if __name__ == "__main__":
    main()
