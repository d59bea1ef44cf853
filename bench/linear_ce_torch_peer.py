# The chunked PyTorch peer of the linear cross-entropy (issue 19): per chunk of
# rows, cuBLAS Z = X W^T (bf16), a torch.compile'd cross-entropy gradient, dX = G W
# and an fp32 dW += G^T X; timed like bench/linear_cross_entropy_bench.cu.
#
# Usage: python3 bench/linear_ce_torch_peer.py [--chunk 4096] [--reps 10] [--out FILE.md]
import argparse
import sys

import torch


def ce_grad(z, target, scale):
    """Loss sum of the rows and the bf16 gradient of scale * sum of losses."""
    zf = z.float()
    lse = torch.logsumexp(zf, dim=-1)
    loss = (lse - zf.gather(1, target[:, None]).squeeze(1)).sum()
    g = torch.exp(zf - lse[:, None])
    g = g - torch.nn.functional.one_hot(target, z.shape[1]).float()
    return loss, (g * scale).to(z.dtype)


ce_compiled = torch.compile(ce_grad)


def fp32_mm_into(dw, a, b):
    """dw += a @ b with fp32 accumulation and output for bf16 a, b."""
    try:
        torch.addmm(dw, a, b, out_dtype=torch.float32, out=dw)
        return "addmm(out_dtype=fp32)"
    except (TypeError, RuntimeError):
        dw += torch.mm(a, b, out_dtype=torch.float32)
        return "mm(out_dtype=fp32) + add"


def step(x, w, target, dw, chunk, how):
    n = x.shape[0]
    dx = torch.empty_like(x)
    loss = torch.zeros((), device=x.device)
    for i in range(0, n, chunk):
        xc = x[i:i + chunk]
        z = xc @ w.t()
        l, g = ce_compiled(z, target[i:i + chunk], 1.0 / n)
        loss += l
        dx[i:i + chunk] = g @ w
        how[0] = fp32_mm_into(dw, g.t(), xc)
    return loss / n, dx


def median_ms(fn, warmup=2, reps=10):
    times = []
    for i in range(warmup + reps):
        start = torch.cuda.Event(enable_timing=True)
        stop = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(stop))
    times.sort()
    return times[len(times) // 2]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--chunk", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    lines = [f"\n## chunked PyTorch peer (torch {torch.__version__}, {args.chunk} rows a chunk, "
             f"torch.compile CE, fp32 dW)\n",
             "| N×H×V | ms | ratio to its three products | extra memory (peak - inputs) | "
             "dW rel. err | dX rel. err |", "|---|---|---|---|---|---|"]
    for n, h, v in [(8192, 4096, 128256), (16384, 4096, 131072)]:
        gen = torch.Generator(device="cuda").manual_seed(0)
        x = (torch.rand(n, h, device="cuda", generator=gen) * 2 - 1).mul_(1.7).bfloat16()
        w = ((torch.rand(v, h, device="cuda", generator=gen) * 2 - 1) *
             (2 * 1.7 / h ** 0.5)).bfloat16()
        target = torch.randint(0, v, (n,), device="cuda", generator=gen)
        dw = torch.zeros(v, h, device="cuda", dtype=torch.float32)
        how = [""]
        g_full = torch.randn(n, v, device="cuda").mul_(1e-4).bfloat16()

        def three():
            z = x @ w.t()
            dxx = g_full @ w
            fp32_mm_into(dw, g_full.t(), x)
            return z, dxx

        t_three = median_ms(three, reps=args.reps)
        del g_full
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t = median_ms(lambda: step(x, w, target, dw, args.chunk, how), reps=args.reps)
        extra = (torch.cuda.max_memory_allocated() - base) / 1e9
        err = ("—", "—")
        if n == 8192:
            dw.zero_()
            _, dx = step(x, w, target, dw, args.chunk, how)
            x32, w32 = x.float(), w.float()
            z32 = x32 @ w32.t()
            g32 = torch.softmax(z32, -1)
            del z32
            g32[torch.arange(n, device="cuda"), target] -= 1
            g32 /= n
            dx32 = g32 @ w32
            dw32 = g32.t() @ x32
            del g32
            err = (f"{((dw - dw32).norm() / dw32.norm()).item():.2e}",
                   f"{((dx.float() - dx32).norm() / dx32.norm()).item():.2e}")
            del dw32, dx32, x32, w32
        lines.append(f"| {n}×{h}×{v} | {t:.2f} | {t / t_three:.3f}× (three: {t_three:.2f} ms) | "
                     f"{extra:.2f} GB | {err[0]} | {err[1]} |")
        print(lines[-1], flush=True)
        del x, w, dw
        torch.cuda.empty_cache()
    lines.append(f"\nfp32 dW through {how[0]}.")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    sys.exit(main())
