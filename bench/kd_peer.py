#!/usr/bin/env python3
"""lossd's distillation Forward beside Liger-Kernel's JSD kernel, on the same tensors, in one run.

For each shape N x V (bf16) and divergence (forward KL: beta 0; JSD: beta 0.5), the same student
and dense teacher logits are timed two ways:

  lossd   Forward with distillation {teacher_logits, alpha 0, temperature 1} on the resident
          student logits (uploaded once, as a training stack keeps them), mode OUT_OF_PLACE so
          that they stay for the next run (the gradient's traffic is the in-place one's: read the
          student and teacher once, write the gradient once), REDUCTION_MEAN over every row;
          the median of the responses' kernel_seconds, and of the RPC's wall time beside it.
          For the post-training losses kernel_seconds is the server's host time around the
          device call (its small copies and synchronizations beside the kernels), not CUDA
          events as for plain cross entropy: an upper bound on the kernels' time.
  Liger   LigerJSDFunction (liger_kernel/ops/jsd.py; Liger's JSD and its beta-0 forward KL) forward
          and backward on the same tensors, CUDA events around it, median: "kernel" times it on
          the log-softmaxes it takes (computed before, untimed), "step" adds torch's
          log_softmax of student and teacher and its backward to the logits, which a caller
          that holds logits (as lossd's does) pays too.

Then over the LM head (--linear_shapes N x H x V, bf16; the same two divergences), against
Liger's LigerFusedLinearJSD (liger_kernel/ops/fused_linear_jsd.py), on the same tensors:

  lossd   LinearForward on resident hidden states X [N, H] and head W [V, H] with distillation
          {teacher_logits} (the dense teacher's logits T = X_t W_t^T [N, V], formed once by
          torch from the same teacher tensors and uploaded: a teacher's logits are an input
          of lossd's call), dX OUT_OF_PLACE (released each run), dW overwritten in one fp32
          accumulator on the server, each --linear_precision; kernel_seconds and RPC wall
          time, medians.
  Liger   LigerFusedLinearJSDFunction forward + backward (student X, W with gradients;
          teacher X_t, W_t), CUDA events, median. It forms the teacher's logits itself, in
          chunks: the "teacher GEMM" column times X_t W_t^T alone (torch, bf16) so that a
          reader can take it off; "x Liger less GEMM" does. Liger keeps dW in bf16 (its
          accum_dtype None), lossd in fp32.

Traffic floor (the issue's): student read + gradient write + teacher read = 3 N V 2 bytes; each
row reports the bandwidth that reaches. lossd x Liger = Liger ms / lossd ms. The two losses are
printed side by side as a check that both computed the same thing.

Liger is not part of lossd: point --liger_src at a checkout's src/ folder (the GPU machine has
torch and triton). Without CUDA or Liger the lossd side runs alone (a small check on the CPU
device; its loss is compared with a float64 torch computation instead).

  on the GPU machine, in the GPU suite's tree (BUILD_DIR=build; its lib/ on the path):
    LD_LIBRARY_PATH=$PWD/build/lib python3 bench/kd_peer.py --lossd=build/server/lossd \\
        --stubs=build/tests/reference/py --device=cuda --liger_src=LIGER/src --out=$OUT/KD_PEER.md
  here (CPU device, small):
    python3 bench/kd_peer.py --lossd=build/server/lossd --stubs=build/tests/reference/py \\
        --device=cpu --shapes=64x1000,16x50257 --linear_shapes=64x64x1000 --runs=3
"""
import argparse
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                "reference"))
import lossd_testing as lt  # noqa: E402

GPU_SHAPES = "4096x128256,8192x50257,16384x32000"
GPU_LINEAR_SHAPES = "4096x4096x128256,8192x4096x128256"
DIVERGENCES = [("forward KL", "DIVERGENCE_FORWARD_KL", 0.0), ("JSD 0.5", "DIVERGENCE_JSD", 0.5)]


def parse_shapes(text):
    return [tuple(int(part) for part in shape.split("x")) for shape in text.split(",")]


def make_logits(rows, vocab, seed, device):
    """Student-like logits (normal * 3) in bf16, on `device`."""
    generator = torch.Generator(device=device).manual_seed(seed)
    return (torch.randn(rows, vocab, generator=generator, device=device) * 3.0).to(torch.bfloat16)


def make_linear(rows, hidden, vocab, seed, device):
    """Hidden states X [rows, hidden] (normal) and a head W [vocab, hidden] (normal * 3 /
    sqrt(hidden), so that the logits are about normal * 3 as make_logits'), bf16, on `device`."""
    generator = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(rows, hidden, generator=generator, device=device)
    w = torch.randn(vocab, hidden, generator=generator, device=device) * (3.0 / hidden ** 0.5)
    return x.to(torch.bfloat16), w.to(torch.bfloat16)


def bf16_bytes(tensor):
    return tensor.contiguous().view(torch.int16).cpu().numpy().tobytes()


class Lossd:
    """A lossd the bench starts, and the calls it times."""

    def __init__(self, binary, stubs, device):
        self.pb2, pb2_grpc, grpc = lt.import_stubs(stubs)
        self.server = lt.LossdServer(binary, device).__enter__()
        self.channel, self.stub = lt.connect(grpc, pb2_grpc, self.server.address)

    def close(self):
        self.channel.close()
        self.server.__exit__(None, None, None)

    def upload(self, data, shape):
        pb2 = self.pb2

        def requests():
            yield pb2.UploadRequest(header=pb2.TensorHeader(dtype=pb2.DTYPE_BFLOAT16,
                                                            shape=list(shape)))
            for start in range(0, len(data), 4 << 20):
                yield pb2.UploadRequest(chunk=data[start:start + (4 << 20)])

        return self.stub.Upload(requests()).tensor.handle

    def release(self, handle):
        self.stub.Release(self.pb2.ReleaseRequest(handle=handle))

    def time(self, student, teacher, divergence, beta, runs):
        """(median kernel_seconds ms, median RPC wall ms, loss) of `runs` Forwards (2 warm-up)."""
        pb2 = self.pb2
        request = pb2.ForwardRequest(logits=student, mode=pb2.GRADIENT_MODE_OUT_OF_PLACE)
        request.options.reduction = pb2.REDUCTION_MEAN
        self._distil(request.distillation, teacher, divergence, beta)

        def call():
            response = self.stub.Forward(request)
            self.release(response.gradient)
            return response

        return self._medians(call, runs)

    def time_linear(self, hidden, weight, teacher, divergence, beta, precision, runs):
        """As time, for LinearForward on the resident X and W: dX out of place, dW overwritten
        in one accumulator (created by the first call, released at the end)."""
        pb2 = self.pb2
        request = pb2.LinearForwardRequest(
            hidden=hidden, weight=weight, mode=pb2.GRADIENT_MODE_OUT_OF_PLACE,
            accumulate=pb2.ACCUMULATE_MODE_OVERWRITE,
            precision=pb2.LINEAR_PRECISION_FAST if precision == "fast"
            else pb2.LINEAR_PRECISION_UNSPECIFIED)
        request.options.reduction = pb2.REDUCTION_MEAN
        self._distil(request.distillation, teacher, divergence, beta)

        def call():
            response = self.stub.LinearForward(request)
            request.weight_grad = response.weight_grad
            self.release(response.result.gradient)
            return response.result

        try:
            return self._medians(call, runs)
        finally:
            if request.weight_grad:
                self.release(request.weight_grad)

    def _distil(self, distillation, teacher, divergence, beta):
        distillation.teacher_logits = teacher
        distillation.alpha = 0.0
        distillation.divergence = self.pb2.Divergence.Value(divergence)
        distillation.beta = beta

    @staticmethod
    def _medians(call, runs):
        """(median kernel_seconds ms, median wall ms, last loss) of `runs` call()s, each
        returning a ForwardResponse, after 2 warm-up calls."""
        kernel, wall, loss = [], [], None
        for run in range(runs + 2):
            start = time.perf_counter()
            response = call()
            elapsed = time.perf_counter() - start
            loss = response.loss
            if run >= 2:
                kernel.append(response.kernel_seconds * 1e3)
                wall.append(elapsed * 1e3)
        return statistics.median(kernel), statistics.median(wall), loss


def cuda_median_ms(function, runs, warmup=3):
    """Median ms of function() between CUDA events, after `warmup` calls; and its last result."""
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    samples, result = [], None
    for run in range(runs + warmup):
        torch.cuda.synchronize()
        start.record()
        result = function()
        end.record()
        end.synchronize()
        if run >= warmup:
            samples.append(start.elapsed_time(end))
    return statistics.median(samples), result


def liger_linear_time(function, x, w, x_teacher, w_teacher, beta, runs):
    """(median ms of Liger's fused linear JSD forward + backward, its loss, median ms of the
    teacher's logits GEMM alone)."""
    def step():
        student = x.detach().requires_grad_(True)
        head = w.detach().requires_grad_(True)
        loss = function.apply(student, head, x_teacher, w_teacher, None, beta, -100, 1.0)
        loss.backward()
        return loss

    liger_ms, loss = cuda_median_ms(step, runs)
    gemm_ms, _ = cuda_median_ms(lambda: x_teacher @ w_teacher.t(), runs)
    return liger_ms, float(loss.detach()), gemm_ms


def liger_time(jsd_function, student, teacher, beta, runs, with_log_softmax):
    """Median ms of Liger's JSD forward + backward (and loss) on CUDA tensors."""
    log_student = torch.log_softmax(student.float(), -1).to(student.dtype)
    log_teacher = torch.log_softmax(teacher.float(), -1).to(teacher.dtype)

    def step():
        if with_log_softmax:
            # bf16 in and out, as a model's logits would go into Liger.
            x_log = torch.log_softmax(student.detach().requires_grad_(True), -1)
            loss = jsd_function.apply(x_log, torch.log_softmax(teacher, -1), None, beta, -100)
        else:
            x = log_student.detach().requires_grad_(True)
            loss = jsd_function.apply(x, log_teacher, None, beta, -100)
        loss.backward()
        return loss

    ms, loss = cuda_median_ms(step, runs)
    return ms, float(loss.detach())


def reference_loss(student, teacher, beta):
    """The mean over rows of D in float64 (docs/api.md's formula), for the CPU check."""
    log_p = torch.log_softmax(student.double(), -1)
    log_q = torch.log_softmax(teacher.double(), -1)
    if beta == 0.0:
        rows = (log_q.exp() * (log_q - log_p)).sum(-1)
    else:
        log_m = torch.logaddexp(math.log(beta) + log_q, math.log(1 - beta) + log_p)
        rows = (beta * (log_q.exp() * (log_q - log_m)).sum(-1) +
                (1 - beta) * (log_p.exp() * (log_p - log_m)).sum(-1))
    return float(rows.mean())


def fp64_check(cells, loss, student, teacher, beta):
    """Without Liger: (the float64 loss, "fp64", whether lossd's loss missed it); the Liger
    cells filled with "-"."""
    check = reference_loss(student.cpu(), teacher.cpu(), beta)
    cells += ["-", "-", "-", "-"]
    return check, "fp64", abs(loss - check) > 1e-3 * abs(check) + 1e-5


def add_row(lines, cells, loss, check, check_name):
    """The row's last cell (both losses) and the row, printed as it comes."""
    cells.append("%.6g / %.6g (%s)" % (loss, check, check_name))
    lines.append("| " + " | ".join(cells) + " |")
    print(lines[-1], flush=True)


def linear_rows(lossd, linear_function, args, tensor_device):
    """The LinearForward table's lines (printed as they come) and whether a loss missed its
    float64 check (without Liger)."""
    lines = ["| N x H x V bf16 | divergence | lossd precision | lossd kernel ms | lossd RPC ms | "
             "Liger ms | teacher GEMM ms (in Liger's) | lossd x Liger | lossd x Liger less GEMM "
             "| loss lossd / check |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    failed = False
    for rows, hidden, vocab in parse_shapes(args.linear_shapes):
        x, w = make_linear(rows, hidden, vocab, 3, tensor_device)
        x_teacher, w_teacher = make_linear(rows, hidden, vocab, 4, tensor_device)
        teacher = x_teacher @ w_teacher.t() if tensor_device == "cuda" else (
            (x_teacher.float() @ w_teacher.float().t()).to(torch.bfloat16))
        handles = [lossd.upload(bf16_bytes(x), (rows, hidden)),
                   lossd.upload(bf16_bytes(w), (vocab, hidden)),
                   lossd.upload(bf16_bytes(teacher), (rows, vocab))]
        for name, divergence, beta in DIVERGENCES:
            liger = None
            if linear_function is not None:
                liger = liger_linear_time(linear_function, x, w, x_teacher, w_teacher, beta,
                                          args.runs)
            for precision in args.linear_precision.split(","):
                kernel_ms, wall_ms, loss = lossd.time_linear(*handles, divergence, beta,
                                                             precision, args.runs)
                cells = ["%d x %d x %d" % (rows, hidden, vocab), name, precision,
                         "%.3f" % kernel_ms, "%.3f" % wall_ms]
                if liger is not None:
                    liger_ms, check, gemm_ms = liger
                    cells += ["%.3f" % liger_ms, "%.3f" % gemm_ms, "%.2f" % (liger_ms / kernel_ms),
                              "%.2f" % ((liger_ms - gemm_ms) / kernel_ms)]
                    check_name = "Liger"
                else:
                    check, check_name, missed = fp64_check(
                        cells, loss, (x.double() @ w.double().t()).cpu(), teacher, beta)
                    failed = failed or missed
                add_row(lines, cells, loss, check, check_name)
        for handle in handles:
            lossd.release(handle)
        del x, w, x_teacher, w_teacher, teacher
        if tensor_device == "cuda":
            torch.cuda.empty_cache()
    return lines, failed


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lossd", required=True)
    parser.add_argument("--stubs", required=True)
    parser.add_argument("--device", default="cuda", help="lossd's device: cuda or cpu")
    parser.add_argument("--liger_src", default=None, help="Liger-Kernel's src/ folder")
    parser.add_argument("--shapes", default=GPU_SHAPES)
    parser.add_argument("--linear_shapes", default=GPU_LINEAR_SHAPES,
                        help="N x H x V of the LinearForward comparison; empty: none")
    parser.add_argument("--linear_precision", default="exact,fast",
                        help="LinearForward's precisions to time, comma-separated")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--out", default=None, help="also write the table to this file")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    jsd_function = linear_function = None
    if args.liger_src and cuda:
        sys.path.insert(0, args.liger_src)
        from liger_kernel.ops.fused_linear_jsd import LigerFusedLinearJSDFunction
        from liger_kernel.ops.jsd import LigerJSDFunction
        jsd_function = LigerJSDFunction
        linear_function = LigerFusedLinearJSDFunction
    else:
        print("kd_peer: Liger not run (%s)" % ("no CUDA device" if not cuda else "no --liger_src"))
    tensor_device = "cuda" if cuda else "cpu"
    if cuda:
        print("kd_peer: %s" % torch.cuda.get_device_name(0))

    lossd = Lossd(args.lossd, args.stubs, args.device)
    lines = ["| N x V bf16 | divergence | lossd kernel ms | lossd RPC ms | lossd GB/s "
             "(3NV2 B) | Liger kernel ms | Liger step ms | lossd x Liger kernel | "
             "lossd x Liger step | loss lossd / check |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    failed = False
    try:
        for rows, vocab in parse_shapes(args.shapes):
            student = make_logits(rows, vocab, 1, tensor_device)
            teacher = make_logits(rows, vocab, 2, tensor_device)
            student_handle = lossd.upload(bf16_bytes(student), (rows, vocab))
            teacher_handle = lossd.upload(bf16_bytes(teacher), (rows, vocab))
            floor_bytes = 3 * rows * vocab * 2
            for name, divergence, beta in DIVERGENCES:
                kernel_ms, wall_ms, loss = lossd.time(student_handle, teacher_handle,
                                                      divergence, beta, args.runs)
                cells = ["%d x %d" % (rows, vocab), name, "%.3f" % kernel_ms, "%.3f" % wall_ms,
                         "%.1f" % (floor_bytes / kernel_ms / 1e6)]
                if jsd_function is not None:
                    liger_kernel, check = liger_time(jsd_function, student, teacher, beta,
                                                     args.runs, with_log_softmax=False)
                    liger_step, _ = liger_time(jsd_function, student, teacher, beta, args.runs,
                                               with_log_softmax=True)
                    cells += ["%.3f" % liger_kernel, "%.3f" % liger_step,
                              "%.2f" % (liger_kernel / kernel_ms),
                              "%.2f" % (liger_step / kernel_ms)]
                    check_name = "Liger"
                else:
                    check, check_name, missed = fp64_check(cells, loss, student, teacher, beta)
                    failed = failed or missed
                add_row(lines, cells, loss, check, check_name)
            lossd.release(student_handle)
            lossd.release(teacher_handle)
            del student, teacher
            if cuda:
                torch.cuda.empty_cache()
        if args.linear_shapes:
            linear_lines, linear_failed = linear_rows(lossd, linear_function, args,
                                                      tensor_device)
            lines += [""] + linear_lines
            failed = failed or linear_failed
    finally:
        lossd.close()
    table = "\n".join(lines)
    print("\n" + table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")
    if failed:
        print("kd_peer: lossd's loss differs from the float64 check")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
