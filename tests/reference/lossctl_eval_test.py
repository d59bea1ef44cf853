"""The README's promise, checked: `lossctl eval` on a generated 2048x32000 fp32 batch (.npy files)
against a fresh lossd prints the loss and accuracy that torch computes for the same files.

Loss within relative 1e-6 of torch (float64 and torch's own float32 result both), accuracy within
the printed precision, token count exact. Seed random per run, printed, fixed with
LOSSD_EVAL_SEED=<seed>."""

import argparse
import os
import re
import subprocess
import sys
import tempfile

import numpy as np
import torch
import torch.nn.functional as F

import lossd_testing as lt

SEED_ENV = "LOSSD_EVAL_SEED"
ROWS, VOCAB = 2048, 32000


def torch_reference(logits, targets):
    """(loss in float64, loss as torch computes it in float32, correct count, valid count)."""
    t = torch.from_numpy(targets)
    valid = t != -100
    loss32 = float(F.cross_entropy(torch.from_numpy(logits), t))
    # float64 in row blocks keeps the peak memory small on CI machines.
    total, correct = 0.0, 0
    for first in range(0, ROWS, 256):
        x = torch.from_numpy(logits[first:first + 256]).to(torch.float64)
        tt = t[first:first + 256]
        total += float(F.cross_entropy(x, tt, reduction="sum"))
        correct += int(((x.argmax(dim=1) == tt) & (tt != -100)).sum())
    return total / int(valid.sum()), loss32, correct, int(valid.sum())


def parse_number(output, name):
    match = re.search(r"\b%s\s*[=:]?\s*([-+0-9.eE]+|nan|inf)" % name, output)
    if not match:
        raise AssertionError("no %r in lossctl output:\n%s" % (name, output))
    return match.group(1)


def run_eval(lossctl, address, logits_path, targets_path, extra):
    command = [lossctl, "--server=" + address, "eval", logits_path, targets_path] + extra
    result = subprocess.run(command, capture_output=True, text=True, timeout=240)
    if result.returncode != 0:
        raise AssertionError("%s exited %d\nstdout:\n%s\nstderr:\n%s" %
                             (" ".join(command), result.returncode, result.stdout, result.stderr))
    return result.stdout


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lossd", required=True)
    parser.add_argument("--lossctl", required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args()
    if args.device == "cuda" and not lt.gpu_visible():
        print("lossctl eval: no GPU visible; skipping the CUDA run")
        return lt.SKIP_EXIT_CODE

    seed = args.seed if args.seed is not None else int(
        os.environ.get(SEED_ENV) or int.from_bytes(os.urandom(4), "little"))
    print("lossctl eval: seed %d (repeat with %s=%d)" % (seed, SEED_ENV, seed))
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((ROWS, VOCAB), dtype=np.float32) * 2.0)
    targets = rng.integers(0, VOCAB, size=ROWS, dtype=np.int64)
    # Make some predictions right (an accuracy of ~0 checks little) and ignore a few rows.
    hits = rng.random(ROWS) < 0.3
    logits[hits, targets[hits]] += 12.0
    targets[rng.random(ROWS) < 0.05] = -100
    ref_loss, torch32_loss, ref_correct, valid = torch_reference(logits, targets)

    failures = []
    with tempfile.TemporaryDirectory(prefix="lossctl-eval-") as tmp:
        logits_path = os.path.join(tmp, "logits.npy")
        targets_path = os.path.join(tmp, "targets.npy")
        np.save(logits_path, logits)
        np.save(targets_path, targets)
        del logits
        with lt.LossdServer(args.lossd, args.device) as server:
            for extra in ([], ["--block_rows=100"]):
                output = run_eval(args.lossctl, server.address, logits_path, targets_path, extra)
                loss = float(parse_number(output, "loss"))
                accuracy_text = parse_number(output, "accuracy")
                tokens = int(parse_number(output, "tokens"))
                decimals = len(accuracy_text.split(".")[1]) if "." in accuracy_text else 0
                ref_accuracy = ref_correct / valid
                what = "lossctl eval %s" % " ".join(extra)
                print("%s: loss %.10f (torch float64 %.10f, float32 %.10f), accuracy %s "
                      "(torch %.6f), tokens %d (%d)" % (what, loss, ref_loss, torch32_loss,
                                                        accuracy_text, ref_accuracy, tokens, valid))
                if not abs(loss - ref_loss) <= 1e-6 * abs(ref_loss):
                    failures.append("%s: loss %.10f, torch float64 %.10f" % (what, loss, ref_loss))
                if not abs(loss - torch32_loss) <= 1e-6 * abs(torch32_loss):
                    failures.append("%s: loss %.10f, torch float32 %.10f" %
                                    (what, loss, torch32_loss))
                if not abs(float(accuracy_text) - ref_accuracy) <= 0.5 * 10.0 ** -decimals + 1e-12:
                    failures.append("%s: accuracy %s, torch %.8f" %
                                    (what, accuracy_text, ref_accuracy))
                if tokens != valid:
                    failures.append("%s: tokens %d, expected %d" % (what, tokens, valid))
    for failure in failures:
        print("FAIL " + failure + " (seed %d)" % seed)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
