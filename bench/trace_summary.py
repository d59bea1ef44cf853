#!/usr/bin/env python3
"""Summarizes the v9 item traces of `cross_entropy_bench --trace=DIR`.

Each trace_<dtype>_<rows>x<vocab>.bin holds 5 little-endian u64 words an
item (rows x 32 items at most; items not taken are zero): %globaltimer at the
take, after the piece's statistics (= its publish), after the row wait, after
the gradient, then (SM id << 32 | block index). Prints, per file, where a
block's time goes and what a row's wait is made of: the wait for the row's
slowest piece, and the latency from that piece's publish to the waiter.

Usage: python3 bench/trace_summary.py DIR   (needs numpy)
"""
import glob
import os
import re
import sys

import numpy as np


def pct(a, q):
    return float(np.percentile(a, q)) if len(a) else float("nan")


def summarize(path):
    m = re.search(r"trace_([a-z0-9]+)_(\d+)x(\d+)", os.path.basename(path))
    rows = int(m.group(2))
    w = np.fromfile(path, dtype=np.uint64).reshape(-1, 5)
    taken = w[:, 0] != 0
    items = int(taken.sum())
    if items == 0 or items % rows:
        print(f"{path}: {items} items for {rows} rows (not a v9 launch?)")
        return
    per_row = items // rows
    w = w[:items].astype(np.int64)
    t0 = w[:, 0] - w[:, 0].min()
    t = [(w[:, i] - w[:, 0].min()) / 1e3 for i in range(4)]  # us
    block = w[:, 4] & 0xFFFFFFFF
    sm = w[:, 4] >> 32
    span = t[3].max() - t[0].min()
    read, wait, grad = t[1] - t[0], t[2] - t[1], t[3] - t[2]
    # Time between a block's previous item's end and this take.
    order = np.lexsort((t[0], block))
    b_sorted = block[order]
    gap = np.full(items, np.nan)
    same = b_sorted[1:] == b_sorted[:-1]
    gap_vals = t[0][order][1:] - t[3][order][:-1]
    gap[order[1:][same]] = gap_vals[same]
    gap = gap[~np.isnan(gap)]
    pub = t[1].reshape(rows, per_row)
    take = t[0].reshape(rows, per_row)
    last_pub = pub.max(axis=1, keepdims=True)
    slowest = (last_pub - pub).ravel()
    notify = (t[2].reshape(rows, per_row) - last_pub).ravel()
    # The last publisher's own wait (its first poll finds every slot full).
    last = pub.argmax(axis=1)
    self_notify = (t[2].reshape(rows, per_row)[np.arange(rows), last] -
                   pub[np.arange(rows), last])
    spread_pub = (pub.max(axis=1) - pub.min(axis=1))
    spread_take = (take.max(axis=1) - take.min(axis=1))
    last_taken_is_last = np.mean(pub.argmax(axis=1) == take.argmax(axis=1))
    res = np.diff(np.unique(t0[:20000]))
    blocks = len(np.unique(block))
    busy = (read + wait + grad).sum()
    print(f"== {os.path.basename(path)}: {rows} rows x {per_row} pieces, "
          f"{blocks} blocks on {len(np.unique(sm))} SMs, span {span:.1f} us, "
          f"timer step {res[res > 0].min() if len(res) else 0} ns")
    print(f"  per item (us)      mean   p10   p50   p90   share of block time")
    for name, a, share in (("take gap", gap, gap.sum()),
                           ("read+stats", read, read.sum()),
                           ("row wait", wait, wait.sum()),
                           ("gradient", grad, grad.sum())):
        print(f"  {name:<16} {a.mean():6.2f} {pct(a, 10):5.2f} {pct(a, 50):5.2f} "
              f"{pct(a, 90):5.2f}   {100 * share / (busy + gap.sum()):5.1f}%")
    print(f"  wait = slowest piece {slowest.mean():.2f} + notify "
          f"{notify.mean():.2f} us (notify p50 {pct(notify, 50):.2f}, "
          f"p90 {pct(notify, 90):.2f}); the last publisher's own "
          f"{self_notify.mean():.2f} (p50 {pct(self_notify, 50):.2f})")
    print(f"  row spread: takes {spread_take.mean():.2f} us, publishes "
          f"{spread_pub.mean():.2f} us (p90 {pct(spread_pub, 90):.2f}); "
          f"last taken = last published in {100 * last_taken_is_last:.0f}% "
          f"of rows")
    # Rate over the middle 80% of the span (the ends ramp up and drain).
    lo, hi = t[3].min() + 0.1 * span, t[3].min() + 0.9 * span
    mid = (t[3] >= lo) & (t[3] < hi)
    print(f"  items finished per us (middle 80%): {mid.sum() / (hi - lo):.2f}; "
          f"whole run {items / span:.2f}")


def main():
    d = sys.argv[1] if len(sys.argv) > 1 else "."
    for path in sorted(glob.glob(os.path.join(d, "trace_*.bin"))):
        summarize(path)


if __name__ == "__main__":
    main()
