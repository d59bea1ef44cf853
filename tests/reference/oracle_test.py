"""PyTorch is the oracle: drives a real lossd over gRPC with random configurations covering every
loss option, every gradient mode, every logits and targets dtype, Backward and Download (with dtype
conversion), and compares with torch.nn.functional.cross_entropy plus autograd.

The reference runs in float64 on the exact values lossd received (the upcast of the uploaded
bf16/fp16 logits), with z-loss and softcap written in torch ops on top of F.cross_entropy.
Tolerances: fp32 loss relative error <= 1e-5 and gradient max abs error <= 1e-6 (relative once a
gradient exceeds 1); bf16/fp16 gradients within one rounding of the output dtype at the reference
value (one more per extra rounding the API implies), plus an fp32-level slack relative to the size
of the terms that cancel in that element. Without a seed the run picks a random one (printed)
to explore; LOSSD_ORACLE_SEED=<seed> (or --seed) fixes it (ctest does, so CI is deterministic);
--only_case=<i> reruns one case."""

import argparse
import collections
import os
import random
import sys
import time
import traceback

import numpy as np
import torch
import torch.nn.functional as F

import lossd_testing as lt

torch.set_num_threads(1)

SEED_ENV = "LOSSD_ORACLE_SEED"
FP32_EPS = 2.0 ** -23


class CheckFailure(Exception):
    pass


def check(condition, message):
    if not condition:
        raise CheckFailure(message)


def check_close(what, got, ref, atol, rtol=0.0):
    """Elementwise |got - ref| <= atol + rtol * |ref| (atol may be an array); NaN never passes."""
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    check(got.shape == ref.shape, "%s: shape %s, expected %s" % (what, got.shape, ref.shape))
    tolerance = np.asarray(atol) + rtol * np.abs(ref)
    error = np.abs(got - ref)
    bad = ~(error <= tolerance)
    if bad.any():
        index = np.unravel_index(np.argmax(np.where(bad, error - tolerance, -np.inf)), bad.shape)
        raise CheckFailure(
            "%s: %d of %d elements off; worst at %s: got %.9g, expected %.9g, |err| %.3g > tol %.3g"
            % (what, bad.sum(), bad.size, tuple(int(i) for i in index), got[index], ref[index],
               error[index], np.broadcast_to(tolerance, bad.shape)[index]))


def expect_code(grpc, what, code, call):
    """Runs call(); it must fail with grpc status `code`."""
    try:
        call()
    except grpc.RpcError as error:
        check(error.code() == code, "%s: got %s (%s), expected %s" %
              (what, error.code(), error.details(), code))
        return
    raise CheckFailure("%s: succeeded, expected %s" % (what, code))


class Oracle:
    """One server connection; run_case() draws a configuration from a seed and checks it."""

    def __init__(self, pb2, grpc, stub):
        self.pb2 = pb2
        self.grpc = grpc
        self.stub = stub
        self.coverage = collections.Counter()  # cases per dtype, mode, option, ...

    # ----- RPC helpers -----

    def upload(self, dtype_name, shape, data, chunk_bytes, label=""):
        pb2 = self.pb2

        def requests():
            yield pb2.UploadRequest(header=pb2.TensorHeader(
                dtype=pb2.DType.Value(dtype_name), shape=list(shape), label=label))
            for start in range(0, len(data), chunk_bytes):
                yield pb2.UploadRequest(chunk=data[start:start + chunk_bytes])

        info = self.stub.Upload(requests()).tensor
        check(info.handle, "Upload returned no handle")
        check(list(info.shape) == list(shape), "Upload shape %s != %s" % (info.shape, shape))
        check(info.bytes == len(data), "Upload bytes %d != %d" % (info.bytes, len(data)))
        return info.handle

    def download(self, handle, dtype_name=None, chunk_bytes=0):
        pb2 = self.pb2
        request = pb2.DownloadRequest(handle=handle, chunk_bytes=chunk_bytes)
        if dtype_name:
            request.dtype = pb2.DType.Value(dtype_name)
        responses = iter(self.stub.Download(request))
        first = next(responses)
        check(first.WhichOneof("kind") == "header", "Download: first message is not a header")
        header = first.header
        chunks = []
        for message in responses:
            check(message.WhichOneof("kind") == "chunk", "Download: a second header")
            if chunk_bytes > 0:
                check(len(message.chunk) <= chunk_bytes, "Download: chunk of %d > %d bytes" %
                      (len(message.chunk), chunk_bytes))
            chunks.append(message.chunk)
        data = b"".join(chunks)
        check(len(data) == header.bytes, "Download: %d bytes, header says %d" %
              (len(data), header.bytes))
        if dtype_name:
            check(header.dtype == pb2.DType.Value(dtype_name), "Download: header dtype %s != %s" %
                  (pb2.DType.Name(header.dtype), dtype_name))
        return header, data

    # ----- one case -----

    def run_case(self, seed):
        rng = random.Random(seed)
        nprng = np.random.default_rng(seed)
        pb2 = self.pb2
        config = {}

        vocab = rng.choice([1, 2, 3, 5, 8, 31, 128, 257, 1000, 4097, 32000, 50257])
        rows = rng.randint(1, 6) if vocab >= 32000 else rng.randint(1, 40)
        dtype = rng.choice(["fp32", "bf16", "fp16"])
        targets_dtype = rng.choice(["DTYPE_INT32", "DTYPE_INT64"])
        targets_inline = rng.random() < 0.5
        scale = rng.choice([1.0, 3.0, 8.0])
        offset = rng.choice([0.0, 0.0, -5.0, 7.5])
        ignore_choice = rng.choice(["default", "explicit-100", "in-vocab", "negative"])
        ignore_index = {"default": -100, "explicit-100": -100, "in-vocab": rng.randrange(vocab),
                        "negative": -rng.randint(1, 5)}[ignore_choice]
        ignore_fraction = rng.choice([0.0, 0.0, 0.2, 0.5, 1.0])
        label_smoothing = rng.choice([0.0, 0.0, rng.uniform(0.0, 1.0), 1.0])
        reduction = rng.choice(["REDUCTION_UNSPECIFIED", "REDUCTION_MEAN", "REDUCTION_SUM",
                                "REDUCTION_NONE"])
        z_loss_scale = rng.choice([0.0, 0.0, 1e-4, rng.uniform(0.0, 0.1)])
        softcap = rng.choice([0.0, 0.0, rng.uniform(1.0, 30.0)])
        use_weights = rng.random() < 0.3
        normalizer = rng.choice([0.0, 0.0, 0.0, rng.uniform(0.5, 2.0 * rows)])
        grad_scale = rng.choice([None, None, rng.uniform(0.25, 4.0)])
        mode = rng.choice(["GRADIENT_MODE_UNSPECIFIED", "GRADIENT_MODE_IN_PLACE",
                           "GRADIENT_MODE_OUT_OF_PLACE", "GRADIENT_MODE_NONE"])
        outputs = {name: rng.random() < 0.5 for name in ("token_loss", "token_lse", "token_argmax")}
        upload_chunk = rng.choice([1 << 20, 4 << 20, 65536, 4093])
        config.update(vocab=vocab, rows=rows, dtype=dtype, targets=targets_dtype,
                      inline=targets_inline, scale=scale, offset=offset, ignore=ignore_choice,
                      ignore_index=ignore_index, ignore_fraction=ignore_fraction,
                      label_smoothing=label_smoothing, reduction=reduction,
                      z_loss_scale=z_loss_scale, softcap=softcap, weights=use_weights,
                      normalizer=normalizer, grad_scale=grad_scale, mode=mode, outputs=outputs)
        self.config = config
        self.coverage.update([dtype, targets_dtype, mode, reduction, "ignore_" + ignore_choice])
        self.coverage.update(name for name, used in (
            ("label_smoothing", label_smoothing > 0), ("z_loss", z_loss_scale > 0),
            ("softcap", softcap > 0), ("class_weights", use_weights),
            ("normalizer", normalizer > 0),
            ("grad_scale", grad_scale is not None), ("inline_targets", targets_inline)) if used)

        # Inputs; the reference uses the values lossd received (after the dtype rounding).
        raw = (nprng.standard_normal((rows, vocab)) * scale + offset).astype(np.float32)
        logits_bytes, x_values = lt.encode_float(raw, dtype)
        targets = nprng.integers(0, vocab, size=rows)
        ignored = nprng.random(rows) < ignore_fraction
        targets[ignored] = ignore_index
        np_targets_dtype = "<i4" if targets_dtype == "DTYPE_INT32" else "<i8"
        targets_bytes = targets.astype(np_targets_dtype).tobytes()
        weights = None
        if use_weights:
            weights = nprng.uniform(0.1, 2.0, size=vocab).astype(np.float32)

        handles = []
        logits_handle = self.upload(lt.FLOAT_DTYPES[dtype][0], (rows, vocab), logits_bytes,
                                    upload_chunk, label="oracle-logits")
        handles.append(logits_handle)
        request = pb2.ForwardRequest(logits=logits_handle, mode=pb2.GradientMode.Value(mode))
        if targets_inline:
            request.targets_inline.dtype = pb2.DType.Value(targets_dtype)
            request.targets_inline.data = targets_bytes
        else:
            request.targets_handle = self.upload(targets_dtype, (rows,), targets_bytes,
                                                 upload_chunk)
            handles.append(request.targets_handle)
        options = request.options
        if ignore_choice != "default":
            options.ignore_index = ignore_index
        options.label_smoothing = label_smoothing
        options.reduction = pb2.Reduction.Value(reduction)
        options.z_loss_scale = z_loss_scale
        options.softcap = softcap
        options.normalizer = normalizer
        if grad_scale is not None:
            options.grad_scale = grad_scale
        if weights is not None:
            options.class_weights = self.upload("DTYPE_FLOAT32", (vocab,), weights.tobytes(),
                                                upload_chunk)
            handles.append(options.class_weights)
        request.outputs.token_loss = outputs["token_loss"]
        request.outputs.token_lse = outputs["token_lse"]
        request.outputs.token_argmax = outputs["token_argmax"]

        # The options as lossd reads them (floats travel as fp32).
        f32 = lambda v: float(np.float32(v))
        label_smoothing, z_loss_scale, softcap = map(f32, (label_smoothing, z_loss_scale, softcap))
        grad_scale = 1.0 if grad_scale is None else f32(grad_scale)
        reduction_kind = {"REDUCTION_UNSPECIFIED": "mean", "REDUCTION_MEAN": "mean",
                          "REDUCTION_SUM": "sum", "REDUCTION_NONE": "none"}[reduction]
        mode_kind = {"GRADIENT_MODE_UNSPECIFIED": "in_place", "GRADIENT_MODE_IN_PLACE": "in_place",
                     "GRADIENT_MODE_OUT_OF_PLACE": "out_of_place",
                     "GRADIENT_MODE_NONE": "none"}[mode]

        ref = reference(x_values, targets, weights, ignore_index, label_smoothing, reduction_kind,
                        z_loss_scale, softcap, normalizer, grad_scale)

        # An out-of-range target is INVALID_ARGUMENT and changes nothing (checked below through
        # the gradient, which would be wrong if the logits had been touched).
        if rng.random() < 0.25:
            bad = pb2.ForwardRequest()
            bad.CopyFrom(request)
            bad_targets = targets.copy()
            bad_targets[rng.randrange(rows)] = rng.choice([vocab, vocab + 7, -1000])
            bad.ClearField("targets_handle")
            bad.targets_inline.dtype = pb2.DType.Value(targets_dtype)
            bad.targets_inline.data = bad_targets.astype(np_targets_dtype).tobytes()
            expect_code(self.grpc, "Forward with an out-of-range target",
                        self.grpc.StatusCode.INVALID_ARGUMENT, lambda: self.stub.Forward(bad))

        # Evaluate streams the same rows in blocks: same loss, nothing retained.
        if reduction_kind != "none" and rng.random() < 0.3:
            self.coverage["evaluate"] += 1
            self.check_evaluate(rng, request, logits_bytes, targets_bytes, dtype, targets_dtype,
                                rows, vocab, ref, weights)

        response = self.stub.Forward(request)
        self.check_forward(response, ref, rows, vocab, reduction_kind, outputs, softcap)

        # Handle states and what happened to the logits.
        logits_info = self.stub.Describe(pb2.DescribeRequest(handle=logits_handle))
        if mode_kind == "in_place":
            check(response.gradient == logits_handle, "IN_PLACE: gradient handle %r != logits %r"
                  % (response.gradient, logits_handle))
            check(logits_info.state == pb2.TENSOR_STATE_GRADIENT, "IN_PLACE: state %s" %
                  pb2.TensorState.Name(logits_info.state))
            expect_code(self.grpc, "Forward on consumed logits",
                        self.grpc.StatusCode.FAILED_PRECONDITION,
                        lambda: self.stub.Forward(request))
        else:
            check(logits_info.state == pb2.TENSOR_STATE_LOGITS, "%s: logits state %s" %
                  (mode, pb2.TensorState.Name(logits_info.state)))
            _, kept = self.download(logits_handle, chunk_bytes=rng.choice([0, 1000, 65536]))
            check(kept == logits_bytes, "%s: the logits changed" % mode)
        if mode_kind == "none":
            check(response.gradient == "", "NONE: gradient handle %r" % response.gradient)
            expect_code(self.grpc, "Backward on logits", self.grpc.StatusCode.FAILED_PRECONDITION,
                        lambda: self.stub.Backward(pb2.BackwardRequest(gradient=logits_handle,
                                                                       scalar=1.0)))
        else:
            if mode_kind == "out_of_place":
                check(response.gradient and response.gradient != logits_handle,
                      "OUT_OF_PLACE: gradient handle %r" % response.gradient)
                handles.append(response.gradient)
            self.check_gradient(rng, response.gradient, ref, dtype, reduction_kind, rows, vocab)

        for handle in handles:
            self.stub.Release(pb2.ReleaseRequest(handle=handle))
        expect_code(self.grpc, "Release twice", self.grpc.StatusCode.NOT_FOUND,
                    lambda: self.stub.Release(pb2.ReleaseRequest(handle=logits_handle)))

    def check_forward(self, response, ref, rows, vocab, reduction, outputs, softcap):
        check_close("loss", response.loss, ref["loss"], atol=ref["loss_atol"], rtol=1e-5)
        check_close("z_loss", response.z_loss, ref["z_loss"], atol=ref["loss_atol"], rtol=1e-5)
        check(response.valid_tokens == ref["valid"], "valid_tokens %d, expected %d" %
              (response.valid_tokens, ref["valid"]))
        check(response.nonfinite_rows == 0, "nonfinite_rows %d" % response.nonfinite_rows)
        low, high = ref["correct_range"]
        check(low <= response.correct_tokens <= high, "correct_tokens %d, expected %s" %
              (response.correct_tokens, ref["correct_range"]))
        if reduction == "mean" and ref["valid"] > 0:
            check_close("denominator", response.denominator, ref["denominator"], atol=0, rtol=1e-6)

        for name in ("token_loss", "token_lse", "token_argmax"):
            got = len(getattr(response, name))
            want = rows if outputs[name] else 0
            check(got == want, "%s: %d values, expected %d" % (name, got, want))
        if outputs["token_loss"]:
            check_close("token_loss", np.array(response.token_loss), ref["token_loss"],
                        atol=ref["token_loss_atol"], rtol=1e-5)
        if outputs["token_lse"]:
            check_close("token_lse", np.array(response.token_lse), ref["lse"],
                        atol=2e-6 * (1 + np.abs(ref["lse"])))
        if outputs["token_argmax"]:
            got = np.array(response.token_argmax, dtype=np.int64)
            check(((got >= 0) & (got < vocab)).all(), "token_argmax out of range: %s" % got)
            z = ref["z"]
            if softcap == 0:
                check((got == np.argmax(z, axis=1)).all(), "token_argmax %s != first argmax %s" %
                      (got, np.argmax(z, axis=1)))
            else:
                # fp32 tanh may merge or swap nearly equal values: any index at the maximum passes.
                top = z.max(axis=1)
                picked = z[np.arange(rows), got]
                check((picked >= top - 1e-6 * (1 + np.abs(top))).all(),
                      "token_argmax picks a value below the row maximum")

    def check_evaluate(self, rng, forward, logits_bytes, targets_bytes, dtype, targets_dtype, rows,
                       vocab, ref, weights):
        pb2 = self.pb2
        row_bytes = len(logits_bytes) // rows
        target_bytes = len(targets_bytes) // rows
        block_rows = rng.randint(1, rows)

        def requests():
            header = pb2.EvaluateHeader(vocab=vocab, logits_dtype=pb2.DType.Value(
                lt.FLOAT_DTYPES[dtype][0]), targets_dtype=pb2.DType.Value(targets_dtype))
            header.options.CopyFrom(forward.options)
            yield pb2.EvaluateRequest(header=header)
            for first in range(0, rows, block_rows):
                last = min(rows, first + block_rows)
                yield pb2.EvaluateRequest(block=pb2.RowBlock(
                    logits=logits_bytes[first * row_bytes:last * row_bytes],
                    targets=targets_bytes[first * target_bytes:last * target_bytes]))

        result = self.stub.Evaluate(requests())
        what = "Evaluate (blocks of %d rows)" % block_rows
        check_close(what + " loss", result.loss, ref["loss"], atol=ref["loss_atol"], rtol=1e-5)
        check_close(what + " z_loss", result.z_loss, ref["z_loss"], atol=ref["loss_atol"],
                    rtol=1e-5)
        check(result.rows == rows, "%s rows %d != %d" % (what, result.rows, rows))
        check(result.valid_tokens == ref["valid"], "%s valid %d != %d" %
              (what, result.valid_tokens, ref["valid"]))
        low, high = ref["correct_range"]
        check(low <= result.correct_tokens <= high, "%s correct %d, expected %s" %
              (what, result.correct_tokens, ref["correct_range"]))

    def check_gradient(self, rng, handle, ref, dtype, reduction, rows, vocab):
        pb2 = self.pb2
        grad = ref["grad"]

        # As Forward left it: one rounding to the logits dtype.
        header, data = self.download(handle, chunk_bytes=rng.choice([0, 4096, 1 << 20]))
        check(header.state == pb2.TENSOR_STATE_GRADIENT, "gradient state %s" %
              pb2.TensorState.Name(header.state))
        check(header.dtype == pb2.DType.Value(lt.FLOAT_DTYPES[dtype][0]),
              "gradient dtype %s, logits were %s" % (pb2.DType.Name(header.dtype), dtype))
        check_gradient_values("gradient", lt.decode_float(data, dtype, (rows, vocab)), grad,
                              ref["grad_terms"], [(dtype, grad, 1.0)])

        # Backward records grad_output; it replaces (never compounds) the previous one.
        per_token = reduction == "none" and rng.random() < 0.5
        materialize = rng.random() < 0.3
        self.coverage.update(["backward_per_token" if per_token else "backward_scalar"] +
                             (["materialize"] if materialize else []))
        if per_token:
            factors = np.float32(np.random.default_rng(rng.getrandbits(32)).uniform(-2, 2, rows))
            factor_column = factors.astype(np.float64)[:, None]
            make = lambda m: pb2.BackwardRequest(
                gradient=handle, per_token=pb2.TokenGradOutput(values=factors.tolist()),
                materialize=m)
        else:
            factor = rng.uniform(-3.0, 3.0)
            factor_column = np.full((rows, 1), factor)
            make = lambda m: pb2.BackwardRequest(gradient=handle, scalar=factor, materialize=m)
            if reduction != "none":
                expect_code(self.grpc, "per-token Backward for reduction %s" % reduction,
                            self.grpc.StatusCode.INVALID_ARGUMENT,
                            lambda: self.stub.Backward(pb2.BackwardRequest(
                                gradient=handle,
                                per_token=pb2.TokenGradOutput(values=[1.0] * rows))))
        first_call = rng.choice(["same", "other"])
        if first_call == "same":
            self.stub.Backward(make(False))
        else:
            self.stub.Backward(pb2.BackwardRequest(gradient=handle, scalar=rng.uniform(5, 9)))
        response = self.stub.Backward(make(materialize))
        check(response.kernel_launched == materialize, "kernel_launched %s with materialize %s" %
              (response.kernel_launched, materialize))
        if not materialize:
            if per_token:
                check(response.tensor.pending_token_scale, "pending_token_scale not set")
            else:
                check_close("pending_scale", response.tensor.pending_scale, factor, atol=0,
                            rtol=1e-12)

        expected = grad * factor_column
        terms = ref["grad_terms"] * np.abs(factor_column)
        as_dtype = rng.choice([None, "fp32", "bf16", "fp16"])
        as_name = lt.FLOAT_DTYPES[as_dtype][0] if as_dtype else None
        out_dtype = as_dtype or dtype
        # Each rounding on the way costs up to one unit in the last place of its dtype at the value
        # it rounded, times the factors applied after it: the kernel's (to the logits dtype, then
        # scaled by grad_output), then the download's (scale and conversion).
        kernel_rounding = (dtype, grad, np.abs(factor_column))
        roundings = [kernel_rounding, (out_dtype, expected, 1.0)]
        header, data = self.download(handle, as_name, chunk_bytes=rng.choice([0, 3000, 1 << 20]))
        what = "gradient after Backward(%s%s), downloaded as %s" % (
            "per-token" if per_token else "scalar", ", materialize" if materialize else "",
            out_dtype)
        if materialize:
            roundings.append((dtype, expected, 1.0))  # the in-place scale
        check_gradient_values(what, lt.decode_float(data, out_dtype, (rows, vocab)), expected,
                              terms, roundings)
        if materialize:
            # The same Backward again must not compound the factor already applied.
            self.stub.Backward(make(True))
            header, data = self.download(handle)
            check_gradient_values("materialized gradient (after a repeated Backward)",
                                  lt.decode_float(data, dtype, (rows, vocab)), expected, terms,
                                  [kernel_rounding, (dtype, expected, 1.0)])


def check_gradient_values(what, got, ref, terms, roundings):
    """fp32 all the way: max abs error 1e-6 (relative beyond 1). Otherwise one unit in the last
    place per rounding, given as (dtype, value rounded, factor applied afterwards), plus fp32-level
    slack relative to the terms that cancel in the element."""
    if all(dtype == "fp32" for dtype, _, _ in roundings):
        check_close(what, got, ref, atol=1e-6 * max(1.0, float(np.abs(ref).max(initial=0))))
    else:
        atol = 64 * FP32_EPS * terms
        for dtype, value, factor in roundings:
            atol = atol + lt.ulp(value, dtype) * factor
        check_close(what, got, ref, atol=atol)


def reference(x, targets, weights, ignore_index, label_smoothing, reduction, z_loss_scale, softcap,
              normalizer, grad_scale):
    """torch float64 loss, outputs and gradient for lossd's semantics (kernels/cross_entropy.h)."""
    rows, vocab = x.shape
    x_t = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    z = softcap * torch.tanh(x_t / softcap) if softcap > 0 else x_t
    t = torch.tensor(targets, dtype=torch.int64)
    w = torch.tensor(weights, dtype=torch.float64) if weights is not None else None
    valid = t != ignore_index
    n_valid = int(valid.sum())
    common = dict(weight=w, ignore_index=ignore_index, label_smoothing=label_smoothing)

    lse = torch.logsumexp(z, dim=1)
    ce_rows = F.cross_entropy(z, t, reduction="none", **common)
    z_rows = z_loss_scale * lse ** 2 * valid
    safe_t = torch.where(valid, t, torch.zeros_like(t))
    w_target = w[safe_t] if w is not None else torch.ones(rows, dtype=torch.float64)
    weight_sum = float((w_target * valid).sum())
    denominator = normalizer if normalizer > 0 else (weight_sum if n_valid > 0 else 0.0)

    if reduction == "none":
        loss = (ce_rows + z_rows).sum()
        z_loss = z_rows.sum()
    elif reduction == "sum":
        loss = F.cross_entropy(z, t, reduction="sum", **common) + z_rows.sum()
        z_loss = z_rows.sum()
    elif n_valid == 0:
        # lossd's one documented difference: a mean over no valid rows is 0, not NaN.
        loss = (x_t * 0).sum()
        z_loss = torch.zeros(())
    elif normalizer > 0:
        loss = (F.cross_entropy(z, t, reduction="sum", **common) + z_rows.sum()) / normalizer
        z_loss = z_rows.sum() / normalizer
    else:
        loss = F.cross_entropy(z, t, reduction="mean", **common) + z_rows.sum() / weight_sum
        z_loss = z_rows.sum() / weight_sum
    loss.backward()
    grad = (x_t.grad * grad_scale).numpy()

    z_np = z.detach().numpy()
    lse_np = lse.detach().numpy()
    valid_np = valid.numpy()
    w_max = float(w.max()) if w is not None else 1.0
    per_row_scale = (np.abs(lse_np) + np.abs(z_np).max(axis=1)) * w_max * (
        1 + z_loss_scale * np.abs(lse_np))
    reduce_by = denominator if reduction == "mean" and n_valid > 0 else 1.0
    loss_atol = 1e-6 * (per_row_scale * valid_np).sum() / reduce_by + 1e-12

    # Magnitude of the terms summed in each gradient element (kernels/cross_entropy.h):
    # s * (p_c * A + (1 - eps) * w_y * [c == y] + eps * w_c / V); fp32 errors scale with it.
    s = grad_scale / (denominator if reduction == "mean" and n_valid > 0 else 1.0)
    if reduction == "mean" and n_valid == 0:
        s = 0.0
    p = torch.softmax(z.detach(), dim=1).numpy()
    w_all = weights.astype(np.float64) if weights is not None else np.ones(vocab)
    w_y = w_target.numpy()
    a = np.abs((1 - label_smoothing) * w_y + label_smoothing * w_all.sum() / vocab +
               2 * z_loss_scale * lse_np)
    one_hot = np.zeros((rows, vocab))
    one_hot[np.arange(rows), np.where(valid_np, targets, 0)] = 1.0
    terms = abs(s) * (p * a[:, None] + (1 - label_smoothing) * w_y[:, None] * one_hot +
                      label_smoothing * w_all[None, :] / vocab) * valid_np[:, None]

    # Accuracy. Without softcap lossd sees exactly these values, so the count is exact (first index
    # of the maximum). With softcap its fp32 tanh may merge or swap near ties at the top, so rows
    # within a few fp32 roundings of a tie widen the accepted range.
    safe_targets = np.where(valid_np, targets, 0)
    z_target = z_np[np.arange(rows), safe_targets]
    exact = valid_np & (np.argmax(z_np, axis=1) == safe_targets)
    if softcap > 0:
        tie = 1e-6 * (1 + np.abs(z_np).max(axis=1))
        others = z_np.copy()
        others[np.arange(rows), safe_targets] = -np.inf
        surely = valid_np & (others.max(axis=1) < z_target - tie)
        maybe = valid_np & (z_target >= z_np.max(axis=1) - tie)
        correct_range = (int(surely.sum()), int(maybe.sum()))
    else:
        correct_range = (int(exact.sum()), int(exact.sum()))

    token_loss = (ce_rows + z_rows).detach().numpy()
    return {
        "loss": float(loss), "z_loss": float(z_loss), "valid": n_valid,
        "denominator": denominator, "grad": grad, "grad_terms": terms, "lse": lse_np, "z": z_np,
        "token_loss": token_loss, "loss_atol": loss_atol,
        "token_loss_atol": 1e-6 * per_row_scale * valid_np + 1e-12,
        "correct_range": correct_range,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lossd", required=True, help="path of the lossd binary")
    parser.add_argument("--device", default="cpu", help="lossd --device (cpu, cuda)")
    parser.add_argument("--stubs", required=True, help="folder with lossd/v1/lossd_pb2*.py")
    parser.add_argument("--seed", type=int, default=None, help="master seed (or $%s)" % SEED_ENV)
    parser.add_argument("--cases", type=int, default=400)
    parser.add_argument("--only_case", type=int, default=None)
    parser.add_argument("--max_failures", type=int, default=5)
    args = parser.parse_args()

    if args.device == "cuda" and not lt.gpu_visible():
        print("oracle: no GPU visible; skipping the CUDA run")
        return lt.SKIP_EXIT_CODE

    seed = args.seed
    if seed is None and os.environ.get(SEED_ENV):
        seed = int(os.environ[SEED_ENV])
    if seed is None:
        seed = int.from_bytes(os.urandom(4), "little")
    print("oracle: seed %d (repeat with %s=%d), device %s" % (seed, SEED_ENV, seed, args.device))
    master = random.Random(seed)
    case_seeds = [master.getrandbits(32) for _ in range(args.cases)]

    pb2, pb2_grpc, grpc = lt.import_stubs(args.stubs)
    failures = 0
    started = time.monotonic()
    with lt.LossdServer(args.lossd, args.device) as server:
        channel, stub = lt.connect(grpc, pb2_grpc, server.address)
        oracle = Oracle(pb2, grpc, stub)
        for index, case_seed in enumerate(case_seeds):
            if args.only_case is not None and index != args.only_case:
                continue
            oracle.config = {}
            try:
                oracle.run_case(case_seed)
            except (CheckFailure, grpc.RpcError) as error:
                failures += 1
                detail = ("%s: %s" % (error.code(), error.details())
                          if isinstance(error, grpc.RpcError) else str(error))
                print("FAIL case %d (seed %d, repeat with %s=%d --only_case=%d)\n  config: %s\n"
                      "  %s" % (index, case_seed, SEED_ENV, seed, index, oracle.config, detail))
                if isinstance(error, grpc.RpcError):
                    traceback.print_exc(limit=3)
                if failures >= args.max_failures:
                    print("oracle: stopping after %d failures" % failures)
                    break
        channel.close()
        print("oracle: coverage (cases): " + ", ".join(
            "%s %d" % item for item in sorted(oracle.coverage.items())))
        server.stop()
        if failures:
            print("oracle: lossd log tail:\n" + server.log_tail(20))
    elapsed = time.monotonic() - started
    ran = 1 if args.only_case is not None else len(case_seeds)
    print("oracle: %d cases, %d failed, %.1f s, lossd exit code %s (seed %d)" %
          (ran, failures, elapsed, server.exit_code, seed))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
