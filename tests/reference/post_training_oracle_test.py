"""PyTorch is the oracle of the post-training losses: drives a real lossd over gRPC with random
distillation (dense and top-k teachers, every divergence and tail, tau != 1, alpha), policy-gradient
(importance sampling, PPO-clip, CISPO, each KL estimator) and segment (empty and one-token
segments, both segment reductions) configurations, on fp32/bf16/fp16 logits of odd V with ignored
rows, and compares the loss, the response's statistics and the downloaded gradient with a float64
reference written from the formulas of docs/api.md ("Post-training losses"), its gradient by
autograd. The reference runs on the exact values lossd received. Tolerances: the loss within 1e-5
relative plus 1e-6 (2e-4 and 1e-5 on a GPU); the gradient within one ulp of its dtype at the
reference value plus 2e-6 of the row's largest element on the CPU device (fp64 rows), or plus
--gpu_tolerance of it and 2^-18 of the row's factor s_i for a device with fp32 rows. LOSSD_ORACLE_SEED=<seed> or --seed fixes the seed
(ctest does); --only_case=<i> reruns one case."""

import argparse
import collections
import math
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


class CheckFailure(Exception):
    pass


def check(condition, message):
    if not condition:
        raise CheckFailure(message)


def check_close(what, got, ref, atol, rtol=0.0):
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    check(got.shape == ref.shape, "%s: shape %s, expected %s" % (what, got.shape, ref.shape))
    tolerance = np.asarray(atol) + rtol * np.abs(ref)
    error = np.abs(got - ref)
    bad = ~(error <= tolerance) & ~(np.isnan(got) & np.isnan(ref))
    if bad.any():
        index = np.unravel_index(np.argmax(np.where(bad, error - tolerance, -np.inf)), bad.shape)
        raise CheckFailure(
            "%s: %d of %d elements off; worst at %s: got %.9g, expected %.9g, |err| %.3g > tol %.3g"
            % (what, bad.sum(), bad.size, tuple(int(i) for i in index), got[index], ref[index],
               error[index], np.broadcast_to(tolerance, bad.shape)[index]))


# ----- the reference, from the formulas -----

def divergence(log_p, log_q, kind, beta):
    """Per-row D over the last axis (buckets); masses of 0 add nothing."""
    p, q = log_p.exp(), log_q.exp()
    if kind == "JSD" and beta == 0.0:
        kind = "FORWARD_KL"
    if kind == "JSD" and beta == 1.0:
        kind = "REVERSE_KL"
    zero = torch.zeros((), dtype=torch.float64)
    if kind == "FORWARD_KL":
        return torch.where(q > 0, q * (log_q - log_p), zero).sum(-1)
    if kind == "REVERSE_KL":
        return torch.where(p > 0, p * (log_p - log_q), zero).sum(-1)
    log_m = torch.logsumexp(torch.stack([log_q + math.log(beta), log_p + math.log1p(-beta)]), 0)
    return (beta * torch.where(q > 0, q * (log_q - log_m), zero).sum(-1) +
            (1 - beta) * torch.where(p > 0, p * (log_p - log_m), zero).sum(-1))


def reference(x, case):
    """Per-row losses l_i (float64, differentiable in x) and extras, for the valid rows."""
    z = x if case["softcap"] == 0 else case["softcap"] * torch.tanh(x / case["softcap"])
    rows, vocab = z.shape
    log_softmax = F.log_softmax(z, dim=-1)
    targets = case["targets"]
    valid = (torch.ones(rows, dtype=torch.bool) if targets is None
             else torch.as_tensor(targets != case["ignore_index"]))
    y = (torch.zeros(rows, dtype=torch.long) if targets is None
         else torch.as_tensor(np.where(valid.numpy(), targets, 0)))
    logp = log_softmax.gather(1, y[:, None])[:, 0]
    lse = torch.logsumexp(z, dim=-1)
    eps = case.get("label_smoothing", 0.0)
    # torch's label smoothing: (1 - eps) NLL + eps mean_c(-log p_c).
    ce = -(1 - eps) * logp + (eps * (lse - z.mean(-1)) if eps > 0 else 0.0)
    extras = {}
    family = case["family"]
    if family == "policy":
        pg = case["policy"]
        adv = torch.as_tensor(pg["advantages"], dtype=torch.float64)
        old = torch.as_tensor(pg["sampling"], dtype=torch.float64)
        ratio = torch.exp(logp - old)
        clipped_ratio = torch.clamp(ratio, 1 - pg["eps_low"], 1 + pg["eps_high"])
        if pg["loss"] == "IMPORTANCE_SAMPLING":
            loss = -ratio * adv
            clipped = torch.zeros(rows, dtype=torch.bool)
        elif pg["loss"] == "PPO_CLIP":
            loss = torch.maximum(-ratio * adv, -clipped_ratio * adv)
            clipped = (-clipped_ratio * adv) > (-ratio * adv)
        else:
            loss = -clipped_ratio.detach() * adv * logp
            clipped = clipped_ratio != ratio
        kl = torch.zeros(rows, dtype=torch.float64)
        if pg["reference"] is not None:
            d = torch.as_tensor(pg["reference"], dtype=torch.float64) - logp
            kl = {"K1": -d, "K2": 0.5 * d * d, "K3": torch.exp(d) - d - 1}[pg["estimator"]]
            loss = loss + pg["kl_coef"] * kl
        p = log_softmax.exp()
        entropy = -(torch.where(p > 0, p * log_softmax, torch.zeros((), dtype=torch.float64))).sum(-1)
        v = valid.numpy()
        extras.update(clipped=int(clipped.numpy()[v].sum()),
                      ratio_sum=float(ratio.detach().numpy()[v].sum()),
                      approx_kl_sum=float((old - logp).detach().numpy()[v].sum()),
                      kl_sum=float(kl.detach().numpy()[v].sum()),
                      entropy_sum=float(entropy.detach().numpy()[v].sum()),
                      ratio_rows=np.where(v, ratio.detach().numpy(), 0.0),
                      clipped_rows=v & clipped.numpy())
        distill = torch.zeros(rows, dtype=torch.float64)
    elif family == "distillation":
        kd = case["kd"]
        tau = kd["temperature"]
        u = z / tau
        log_p = F.log_softmax(u, dim=-1)
        if kd["teacher"] == "dense":
            log_q = F.log_softmax(torch.as_tensor(kd["teacher_values"]) / tau, dim=-1)
            distill = divergence(log_p, log_q, kd["divergence"], kd["beta"])
        else:
            idx = torch.as_tensor(kd["indices"], dtype=torch.long)
            lp = torch.as_tensor(kd["logprobs"], dtype=torch.float64)
            k = idx.shape[1]
            if kd["tail"] == "RENORMALIZE":
                bucket_p = F.log_softmax(u.gather(1, idx), dim=-1)
                bucket_q = F.log_softmax(lp, dim=-1)
            else:
                bucket_p = log_p.gather(1, idx)
                bucket_q = lp
                if k < vocab:
                    support = torch.zeros(rows, vocab, dtype=torch.bool)
                    support.scatter_(1, idx, True)
                    tail_p = torch.logsumexp(log_p.masked_fill(support, -math.inf), dim=-1)
                    tail_q = torch.log(torch.clamp(1 - lp.exp().sum(-1), min=0))
                    bucket_p = torch.cat([bucket_p, tail_p[:, None]], 1)
                    bucket_q = torch.cat([bucket_q, tail_q[:, None]], 1)
            distill = divergence(bucket_p, bucket_q, kd["divergence"], kd["beta"])
        loss = (1 - kd["alpha"]) * distill
        if kd["alpha"] > 0:
            loss = loss + kd["alpha"] * ce
    else:
        loss = ce
        distill = torch.zeros(rows, dtype=torch.float64)
    z_loss = case.get("z_loss_scale", 0.0) * lse * lse
    loss = loss + z_loss
    extras["z_loss"] = z_loss.detach()
    has_target = valid if targets is not None else torch.zeros(rows, dtype=torch.bool)
    extras["logp"] = torch.where(has_target, logp, torch.zeros((), dtype=torch.float64)).detach()
    p = log_softmax.exp()
    extras["entropy"] = -(torch.where(p > 0, p * log_softmax,
                                      torch.zeros((), dtype=torch.float64))).sum(-1).detach()
    return loss, distill, valid, extras


def reduce(values, valid, case):
    """The reduced loss (differentiable), its denominator, segment sums and counts."""
    values = torch.where(valid, values, torch.zeros((), dtype=torch.float64))
    segments = case["segments"]
    seg_loss = seg_tokens = None
    if segments is not None:
        ids = torch.as_tensor(segments["ids"], dtype=torch.long)
        count = segments["count"]
        seg_loss = torch.zeros(count, dtype=torch.float64).index_add(0, ids, values)
        seg_tokens = torch.zeros(count, dtype=torch.long).index_add(0, ids, valid.long())
    if segments is not None and segments["reduction"] != "UNSPECIFIED":
        nonempty = seg_tokens > 0
        denominator = case["normalizer"] if case["normalizer"] > 0 else float(nonempty.sum())
        per = seg_loss if segments["reduction"] == "SEQ_MEAN_TOKEN_SUM" else \
            seg_loss / torch.clamp(seg_tokens, min=1)
        total = per[nonempty].sum()
        loss = total / denominator if nonempty.any() else total * 0
        return loss, (denominator if (nonempty.any() or case["normalizer"] > 0) else 0.0), \
            seg_loss, seg_tokens
    total = values.sum()
    if case["reduction"] in ("MEAN", "UNSPECIFIED"):
        count = int(valid.sum())
        denominator = case["normalizer"] if case["normalizer"] > 0 else float(count)
        loss = total / denominator if count > 0 else total * 0
        return loss, (denominator if (count > 0 or case["normalizer"] > 0) else 0.0), \
            seg_loss, seg_tokens
    return total, 0.0, seg_loss, seg_tokens


class Oracle:
    def __init__(self, pb2, grpc, stub, gpu_tolerance, linear_fraction):
        self.pb2 = pb2
        self.linear_fraction = linear_fraction
        self.grpc = grpc
        self.stub = stub
        self.gpu_tolerance = gpu_tolerance
        # Losses: fp64 rows on the CPU device; fp32 rows (and sums) on a GPU.
        self.loss_atol = 1e-6 if gpu_tolerance == 0 else 1e-5
        self.loss_rtol = 1e-5 if gpu_tolerance == 0 else 2e-4
        self.coverage = collections.Counter()
        self.config = {}

    def upload(self, dtype_name, shape, data):
        pb2 = self.pb2

        def requests():
            yield pb2.UploadRequest(header=pb2.TensorHeader(
                dtype=pb2.DType.Value(dtype_name), shape=list(shape)))
            for start in range(0, len(data), 1 << 20):
                yield pb2.UploadRequest(chunk=data[start:start + (1 << 20)])
            if not data:
                return

        return self.stub.Upload(requests()).tensor.handle

    def download(self, handle):
        chunks = []
        for message in self.stub.Download(self.pb2.DownloadRequest(handle=handle)):
            if message.WhichOneof("kind") == "chunk":
                chunks.append(message.chunk)
        return b"".join(chunks)

    def small(self, rng, holder, field, dtype_name, array, shape):
        """Sets `field` of message `holder` to `array` inline or by handle."""
        data = np.ascontiguousarray(array).tobytes()
        if rng.random() < 0.5:
            inline = getattr(holder, field + "_inline")
            inline.dtype = self.pb2.DType.Value(dtype_name)
            inline.data = data
        else:
            setattr(holder, field + "_handle", self.upload(dtype_name, shape, data))

    def run_case(self, seed):
        rng = random.Random(seed)
        nprng = np.random.default_rng(seed)
        pb2 = self.pb2
        family = rng.choice(["distillation", "distillation", "policy", "policy", "segments"])
        vocab = rng.choice([1, 2, 3, 5, 8, 31, 128, 257, 1000])
        if family == "distillation" and vocab == 1:
            vocab = 3
        rows = rng.randint(1, 24)
        dtype = rng.choice(["fp32", "bf16", "fp16"])
        scale = rng.choice([1.0, 3.0])
        # The reference takes the float32 the request carries: the float64 draw would move z by
        # up to ~1e-6 and the gradient by ~40 fp32 ulps (seed 13 with 600 cases: case 252).
        softcap = float(np.float32(rng.choice([0.0, 0.0, rng.uniform(2.0, 20.0)])))
        ignore_fraction = rng.choice([0.0, 0.3])
        mode = rng.choice(["GRADIENT_MODE_IN_PLACE", "GRADIENT_MODE_OUT_OF_PLACE",
                           "GRADIENT_MODE_NONE"])
        reduction = rng.choice(["UNSPECIFIED", "MEAN", "SUM", "NONE"])
        normalizer = rng.choice([0.0, 0.0, rng.uniform(0.5, 2.0 * rows)])
        grad_scale = rng.choice([None, rng.uniform(0.25, 4.0)])
        case = dict(family=family, softcap=softcap, ignore_index=-100, normalizer=normalizer,
                    reduction=reduction, segments=None)
        config = dict(family=family, vocab=vocab, rows=rows, dtype=dtype, softcap=softcap,
                      mode=mode, reduction=reduction, normalizer=normalizer,
                      grad_scale=grad_scale, ignore_fraction=ignore_fraction)
        self.config = config

        head = None
        if rng.random() < self.linear_fraction:
            # LinearForward: Z = X W^T of the same size as the logits, X and W in the dtype.
            width = rng.choice([1, 4, 16])
            x_bytes, x_rows = lt.encode_float(nprng.standard_normal((rows, width)), dtype)
            w_bytes, w_rows = lt.encode_float(
                nprng.standard_normal((vocab, width)) * scale / math.sqrt(width), dtype)
            head = dict(width=width, x=x_rows, w=w_rows, x_bytes=x_bytes,
                        hidden=self.upload(lt.FLOAT_DTYPES[dtype][0], (rows, width), x_bytes),
                        weight=self.upload(lt.FLOAT_DTYPES[dtype][0], (vocab, width), w_bytes))
            x_values = x_rows @ w_rows.T
            logits_bytes = None
            logits_handle = head["hidden"]
            config["linear_width"] = width
            self.coverage.update(["linear"])
        else:
            raw = (nprng.standard_normal((rows, vocab)) * scale).astype(np.float32)
            logits_bytes, x_values = lt.encode_float(raw, dtype)
        targets = nprng.integers(0, vocab, size=rows)
        targets[nprng.random(rows) < ignore_fraction] = -100
        if head is None:
            logits_handle = self.upload(lt.FLOAT_DTYPES[dtype][0], (rows, vocab), logits_bytes)
        request = pb2.ForwardRequest(logits=logits_handle, mode=pb2.GradientMode.Value(mode))
        request.options.reduction = pb2.Reduction.Value("REDUCTION_" + reduction)
        request.options.softcap = softcap
        request.options.normalizer = normalizer
        # Label smoothing (not with a policy) and z-loss compose with the losses.
        label_smoothing = 0.0 if family == "policy" else rng.choice([0.0, 0.0, 0.1])
        z_loss_scale = rng.choice([0.0, 0.0, 0.01])
        request.options.label_smoothing = label_smoothing
        request.options.z_loss_scale = z_loss_scale
        case.update(label_smoothing=float(np.float32(label_smoothing)),
                    z_loss_scale=float(np.float32(z_loss_scale)))
        config.update(label_smoothing=label_smoothing, z_loss_scale=z_loss_scale)
        self.coverage.update(["label_smoothing"] * (label_smoothing > 0) +
                             ["z_loss"] * (z_loss_scale > 0))
        if grad_scale is not None:
            request.options.grad_scale = grad_scale
        request.outputs.token_loss = True
        request.outputs.token_logprob = True
        request.outputs.token_entropy = True
        request.outputs.token_ratio = rng.random() < 0.5
        request.outputs.token_clipped = request.outputs.token_ratio

        send_targets = True
        if family == "distillation":
            kd = request.distillation
            alpha = rng.choice([0.0, 0.0, 0.3, 1.0])
            tau = rng.choice([1.0, 0.5, 2.0])
            div = rng.choice(["FORWARD_KL", "REVERSE_KL", "JSD"])
            beta = rng.choice([0.0, 0.3, 0.5, 1.0]) if div == "JSD" else 0.0
            teacher = rng.choice(["dense", "top_k"])
            kd.alpha = alpha
            if tau != 1.0 or rng.random() < 0.5:
                kd.temperature = tau
            kd.divergence = pb2.Divergence.Value("DIVERGENCE_" + div)
            kd.beta = beta
            spec = dict(alpha=float(np.float32(alpha)), temperature=tau, divergence=div,
                        beta=float(np.float32(beta)), teacher=teacher)
            teacher_raw = (nprng.standard_normal((rows, vocab)) * 2.0).astype(np.float32)
            if teacher == "dense":
                teacher_dtype = rng.choice(["fp32", "bf16", "fp16"])
                teacher_bytes, teacher_values = lt.encode_float(teacher_raw, teacher_dtype)
                kd.teacher_logits = self.upload(lt.FLOAT_DTYPES[teacher_dtype][0],
                                                (rows, vocab), teacher_bytes)
                spec.update(teacher_values=teacher_values, teacher_dtype=teacher_dtype)
                config["teacher_dtype"] = teacher_dtype
            else:
                limit = min(vocab, 512)
                k = rng.choice([1, limit, rng.randint(1, limit)])
                tail = rng.choice(["RENORMALIZE", "BUCKET"])
                order = np.argsort(-teacher_raw, axis=1, kind="stable")[:, :k]
                log_q = torch.log_softmax(torch.as_tensor(teacher_raw, dtype=torch.float64), -1)
                logprobs = np.take_along_axis(log_q.numpy(), order, 1).astype(np.float32)
                indices_dtype = rng.choice(["DTYPE_INT32", "DTYPE_INT64"])
                indices = order.astype("<i4" if indices_dtype == "DTYPE_INT32" else "<i8")
                top_k = kd.teacher_top_k
                top_k.tail = pb2.TopKTail.Value("TOP_K_TAIL_" + tail)
                self.small(rng, top_k, "indices", indices_dtype, indices, (rows, k))
                self.small(rng, top_k, "logprobs", "DTYPE_FLOAT32", logprobs, (rows, k))
                if (top_k.WhichOneof("indices") == "indices_inline" or
                        top_k.WhichOneof("logprobs") == "logprobs_inline" or rng.random() < 0.5):
                    top_k.k = k
                spec.update(indices=order, logprobs=logprobs.astype(np.float64), tail=tail)
                config.update(k=k, tail=tail)
            case["kd"] = spec
            config.update(alpha=alpha, tau=tau, divergence=div, beta=beta, teacher=teacher)
            send_targets = alpha > 0 or rng.random() < 0.5
            self.coverage.update([div, teacher, "tau!=1" if tau != 1 else "tau=1"])
        elif family == "policy":
            pg = request.policy
            loss = rng.choice(["IMPORTANCE_SAMPLING", "PPO_CLIP", "CISPO"])
            pg.loss = pb2.PolicyLoss.Value("POLICY_LOSS_" + loss)
            z = torch.as_tensor(x_values)
            zc = z if softcap == 0 else softcap * torch.tanh(z / softcap)
            logp = F.log_softmax(zc, -1).gather(1, torch.as_tensor(
                np.where(targets >= 0, targets, 0))[:, None])[:, 0].numpy()
            advantages = nprng.standard_normal(rows).astype(np.float32)
            sampling = (logp + 0.3 * nprng.standard_normal(rows)).astype(np.float32)
            eps_low = rng.choice([None, 0.1, 0.2])
            eps_high = rng.choice([None, 0.28, 0.0])
            if eps_low is not None:
                pg.epsilon_low = eps_low
            if eps_high is not None:
                pg.epsilon_high = eps_high
            eps_low_v = 0.2 if eps_low is None else eps_low
            eps_high_v = eps_low_v if eps_high is None else eps_high
            self.small(rng, pg, "advantages", "DTYPE_FLOAT32", advantages, (rows,))
            self.small(rng, pg, "sampling_logprobs", "DTYPE_FLOAT32", sampling, (rows,))
            reference_lp = None
            estimator = rng.choice(["K1", "K2", "K3"])
            kl_coef = 0.0
            if rng.random() < 0.5:
                reference_lp = (logp + 0.2 * nprng.standard_normal(rows)).astype(np.float32)
                self.small(rng, pg, "reference_logprobs", "DTYPE_FLOAT32", reference_lp, (rows,))
                kl_coef = rng.choice([0.0, 0.05])
                pg.kl_coef = kl_coef
                pg.kl_estimator = pb2.KlEstimator.Value("KL_ESTIMATOR_" + estimator)
            case["policy"] = dict(loss=loss, advantages=advantages.astype(np.float64),
                                  sampling=sampling.astype(np.float64),
                                  eps_low=float(np.float32(eps_low_v)),
                                  eps_high=float(np.float32(eps_high_v)),
                                  reference=None if reference_lp is None
                                  else reference_lp.astype(np.float64),
                                  kl_coef=float(np.float32(kl_coef)), estimator=estimator)
            config.update(loss=loss, eps_low=eps_low, eps_high=eps_high,
                          reference=reference_lp is not None, kl_coef=kl_coef,
                          estimator=estimator)
            self.coverage.update([loss])
        if family == "segments" or rng.random() < 0.4:
            count = rng.randint(1, rows)
            ids = np.sort(nprng.integers(0, count, size=rows)).astype("<i4")
            seg_reduction = rng.choice(["UNSPECIFIED", "SEQ_MEAN_TOKEN_MEAN",
                                        "SEQ_MEAN_TOKEN_SUM"])
            if seg_reduction != "UNSPECIFIED":
                reduction = rng.choice(["UNSPECIFIED", "MEAN"])
                case["reduction"] = reduction
                config["reduction"] = reduction
                request.options.reduction = pb2.Reduction.Value("REDUCTION_" + reduction)
            request.segments.count = count
            request.segments.reduction = pb2.SegmentReduction.Value(
                "SEGMENT_REDUCTION_" + seg_reduction)
            self.small(rng, request.segments, "ids", "DTYPE_INT32", ids, (rows,))
            case["segments"] = dict(ids=ids.astype(np.int64), count=count,
                                    reduction=seg_reduction)
            config.update(segments=count, segment_reduction=seg_reduction)
            self.coverage.update(["segments", seg_reduction])
        if send_targets:
            if rng.random() < 0.5:
                request.targets_inline.dtype = pb2.DTYPE_INT64
                request.targets_inline.data = targets.astype("<i8").tobytes()
            else:
                request.targets_handle = self.upload("DTYPE_INT32", (rows,),
                                                     targets.astype("<i4").tobytes())
            case["targets"] = targets
        else:
            case["targets"] = None
        config["targets"] = send_targets
        self.coverage.update([dtype, family, mode])

        if head is None:
            response = self.stub.Forward(request)
            x = torch.tensor(x_values, dtype=torch.float64, requires_grad=True)
        else:
            response = self.linear_forward(request, head, rows, reduction, mode).result
            x = torch.tensor(x_values, dtype=torch.float64, requires_grad=True)
        per_row, distill, valid, extras = reference(x, case)
        loss, denominator, seg_loss, seg_tokens = reduce(per_row, valid, case)
        distill_loss, _, _, _ = reduce(distill.detach(), valid, case)
        loss_ref = float(loss)
        check_close("loss", response.loss, loss_ref, self.loss_atol, self.loss_rtol)
        if family == "distillation":
            check_close("distillation_loss", response.distillation_loss, float(distill_loss),
                        self.loss_atol, self.loss_rtol)
        z_loss_ref = float(reduce(extras["z_loss"], valid, case)[0])
        check_close("z_loss", response.z_loss, z_loss_ref, self.loss_atol, self.loss_rtol)
        check(response.valid_tokens == int(valid.sum()),
              "valid_tokens %d != %d" % (response.valid_tokens, int(valid.sum())))
        check_close("denominator", response.denominator, denominator, 1e-9, 1e-9)
        v = valid.numpy()
        token_ref = np.where(v, per_row.detach().numpy(), 0.0)
        check_close("token_loss", response.token_loss, token_ref, self.loss_rtol, self.loss_rtol)
        check_close("token_logprob", response.token_logprob, extras["logp"].numpy(), self.loss_rtol, self.loss_rtol)
        check_close("token_entropy", response.token_entropy, extras["entropy"].numpy(),
                    self.loss_rtol, self.loss_rtol)
        if seg_loss is not None:
            check(list(response.segment_tokens) == seg_tokens.tolist(),
                  "segment_tokens %s != %s" % (list(response.segment_tokens), seg_tokens.tolist()))
            check_close("segment_loss", response.segment_loss, seg_loss.detach().numpy(),
                        self.loss_rtol, self.loss_rtol)
        if request.outputs.token_ratio:
            ratio_ref = extras.get("ratio_rows", np.zeros(rows))
            clipped_ref = extras.get("clipped_rows", np.zeros(rows, dtype=bool))
            check_close("token_ratio", response.token_ratio, ratio_ref, self.loss_rtol,
                        self.loss_rtol)
            check(list(response.token_clipped) == clipped_ref.tolist(),
                  "token_clipped %s != %s" % (list(response.token_clipped), clipped_ref.tolist()))
        if family == "policy":
            stats = response.policy_stats
            check(stats.clipped_tokens == extras["clipped"],
                  "clipped_tokens %d != %d" % (stats.clipped_tokens, extras["clipped"]))
            for name in ("ratio_sum", "approx_kl_sum", "kl_sum", "entropy_sum"):
                check_close(name, getattr(stats, name), extras[name], self.loss_rtol, self.loss_rtol)

        if case["reduction"] != "NONE":
            self.evaluate_case(rng, case, request, head, rows, vocab, dtype, logits_bytes, targets,
                               send_targets, float(loss.detach()), float(distill_loss),
                               denominator, seg_loss, seg_tokens, int(valid.sum()), extras)

        if mode != "GRADIENT_MODE_NONE":
            scale_factor = 1.0 if grad_scale is None else float(np.float32(grad_scale))
            # s_i: the factor of row i's loss in the scaled, reduced loss.
            row_factor = torch.autograd.grad(loss * scale_factor, per_row,
                                             retain_graph=True)[0].abs().numpy()[:, None]
            (loss * scale_factor).backward()
            ref = x.grad.numpy()
            if head is not None:
                def grad_at(z_values):
                    z = torch.tensor(z_values, dtype=torch.float64, requires_grad=True)
                    values, _, rows_valid, _ = reference(z, case)
                    (reduce(values, rows_valid, case)[0] * scale_factor).backward()
                    return z.grad.numpy()
                # A device with fp32 rows: its allowance on each element of G (as below).
                g_allowance = (self.gpu_tolerance * np.abs(ref).max(axis=1, keepdims=True) +
                               2.0 ** -18 * row_factor if self.gpu_tolerance > 0 else 0.0)
                self.check_linear_gradients(response, head, ref, grad_at, nprng, rows, vocab,
                                            dtype, g_allowance)
                return
            check(response.gradient, "no gradient handle")
            got = lt.decode_float(self.download(response.gradient), dtype, (rows, vocab))
            row_max = np.abs(ref).max(axis=1, keepdims=True)
            tolerance = lt.ulp(ref, dtype) + (self.gpu_tolerance if self.gpu_tolerance > 0
                                              else 2e-6) * row_max
            if self.gpu_tolerance > 0:
                # fp32 row math: a few ulps of lse move every p_c (docs/api.md).
                tolerance = tolerance + 2.0 ** -18 * row_factor
            check_close("gradient", got, ref, tolerance)
        for handle in [logits_handle] + ([] if head is None else [head["weight"]]):
            self.stub.Release(pb2.ReleaseRequest(handle=handle))

    def linear_forward(self, forward, head, rows, reduction, mode):
        """The Forward request's loss as a LinearForward of the head (a new fp32 dW accumulator
        with a gradient; reduction NONE with a gradient takes token_grad_output of ones)."""
        pb2 = self.pb2
        request = pb2.LinearForwardRequest(hidden=head["hidden"], weight=head["weight"],
                                           mode=forward.mode)
        for field in ("options", "outputs", "distillation", "policy", "segments"):
            if forward.HasField(field):
                getattr(request, field).CopyFrom(getattr(forward, field))
        if forward.WhichOneof("targets") == "targets_handle":
            request.targets_handle = forward.targets_handle
        elif forward.WhichOneof("targets") == "targets_inline":
            request.targets_inline.CopyFrom(forward.targets_inline)
        if reduction == "NONE" and mode != "GRADIENT_MODE_NONE":
            request.token_grad_output.extend([1.0] * rows)
        response = self.stub.LinearForward(request)
        head["weight_grad"] = response.weight_grad
        return response

    def check_linear_gradients(self, response, head, g, grad_at, nprng, rows, vocab, dtype,
                               g_allowance):
        """dX and dW against G W and G^T X, G the reference gradient over Z = X W^T. The server's
        Z, G and products are fp32: the allowance is 1e-5 of the terms' magnitude (|G| |W|,
        |G|^T |X|) plus 8x how far G moves when Z moves by 4 fp32 roundings of its terms (the
        most of three such moves: the loss's own sensitivity, large where a KL penalty's
        d = log p_ref - log p is small) and `g_allowance` (a GPU's fp32 rows; its dX also takes
        G rounded to dX's dtype), plus one rounding of dX's dtype."""
        x_rows, w_rows = head["x"], head["w"]
        width = head["width"]
        terms = np.abs(x_rows) @ np.abs(w_rows).T
        moved = np.zeros_like(g)
        for signs in (nprng.choice([-1.0, 1.0], size=terms.shape),
                      nprng.choice([-1.0, 1.0], size=terms.shape), np.ones_like(terms)):
            shifted = grad_at(x_rows @ w_rows.T + 2.0 ** -22 * terms * signs)
            moved = np.maximum(moved, np.abs(shifted - g))
        check(response.gradient, "no dX handle")
        got_dx = lt.decode_float(self.download(response.gradient), dtype, (rows, width))
        ref_dx = g @ w_rows
        g_error = 1e-5 * np.abs(g) + 8 * moved + g_allowance
        # A GPU's dX is G rounded to 16 bits times W (docs/api.md, LinearForward's precision).
        dx_g_error = g_error + (lt.ulp(g, dtype) if self.gpu_tolerance > 0 else 0.0)
        check_close("dX", got_dx, ref_dx, lt.ulp(ref_dx, dtype) + dx_g_error @ np.abs(w_rows))
        check(head["weight_grad"], "no dW handle")
        got_dw = np.frombuffer(self.download(head["weight_grad"]), "<f4").astype(
            np.float64).reshape(vocab, width)
        ref_dw = g.T @ x_rows
        check_close("dW", got_dw, ref_dw, g_error.T @ np.abs(x_rows) + 1e-30)
        for handle in {head["hidden"], head["weight"], head["weight_grad"], response.gradient}:
            self.stub.Release(self.pb2.ReleaseRequest(handle=handle))

    def evaluate_case(self, rng, case, forward, head, rows, vocab, dtype, logits_bytes, targets,
                      send_targets, loss_ref, distill_ref, denominator, seg_loss, seg_tokens,
                      valid_tokens, extras):
        """The same rows through Evaluate in 1-3 blocks, the teacher, the policy's inputs and
        the ids in the blocks; over the hidden states against the head's weight for a linear
        case."""
        pb2 = self.pb2
        header = pb2.EvaluateHeader(vocab=vocab,
                                    logits_dtype=pb2.DType.Value(lt.FLOAT_DTYPES[dtype][0]),
                                    targets_dtype=pb2.DTYPE_INT64)
        if head is not None:
            header.weight = head["weight"]
            logits_bytes = head["x_bytes"]
            self.coverage.update(["evaluate linear"])
        header.options.CopyFrom(forward.options)
        teacher_rows = None
        if case["family"] == "distillation":
            kd = case["kd"]
            header.distillation.CopyFrom(forward.distillation)
            header.distillation.ClearField("teacher")
            if kd["teacher"] == "dense":
                header.teacher_logits_dtype = pb2.DType.Value(lt.FLOAT_DTYPES[kd["teacher_dtype"]][0])
                teacher_rows = lt.encode_float(kd["teacher_values"], kd["teacher_dtype"])[0]
            else:
                header.teacher_top_k = kd["indices"].shape[1]
                header.teacher_indices_dtype = pb2.DTYPE_INT64
                header.teacher_top_k_tail = pb2.TopKTail.Value("TOP_K_TAIL_" + kd["tail"])
        policy = case.get("policy")
        if policy is not None:
            header.policy.CopyFrom(forward.policy)
            for field in ("advantages", "sampling_logprobs", "reference_logprobs"):
                header.policy.ClearField(field)
            header.policy_reference_logprobs = policy["reference"] is not None
        if case["segments"] is not None:
            header.segments.count = case["segments"]["count"]
            header.segments.reduction = forward.segments.reduction
        cuts = sorted(rng.sample(range(1, rows), min(rows - 1, rng.randint(0, 2))))
        bounds = [0] + cuts + [rows]
        row_bytes = len(logits_bytes) // rows

        def requests():
            yield pb2.EvaluateRequest(header=header)
            for start, end in zip(bounds[:-1], bounds[1:]):
                block = pb2.RowBlock(logits=logits_bytes[start * row_bytes:end * row_bytes])
                if send_targets:
                    block.targets = targets[start:end].astype("<i8").tobytes()
                if teacher_rows is not None:
                    t_bytes = len(teacher_rows) // rows
                    block.teacher_logits = teacher_rows[start * t_bytes:end * t_bytes]
                elif case["family"] == "distillation":
                    kd = case["kd"]
                    block.teacher_indices = kd["indices"][start:end].astype("<i8").tobytes()
                    block.teacher_logprobs = kd["logprobs"][start:end].astype("<f4").tobytes()
                if policy is not None:
                    block.advantages = policy["advantages"][start:end].astype("<f4").tobytes()
                    block.sampling_logprobs = policy["sampling"][start:end].astype(
                        "<f4").tobytes()
                    if policy["reference"] is not None:
                        block.reference_logprobs = policy["reference"][start:end].astype(
                            "<f4").tobytes()
                if case["segments"] is not None:
                    block.segment_ids = case["segments"]["ids"][start:end].astype(
                        "<i4").tobytes()
                yield pb2.EvaluateRequest(block=block)

        response = self.stub.Evaluate(requests())
        check_close("evaluate loss", response.loss, loss_ref, self.loss_atol, self.loss_rtol)
        check_close("evaluate distillation_loss", response.distillation_loss, distill_ref,
                    self.loss_atol, self.loss_rtol)
        check_close("evaluate denominator", response.denominator, denominator, 1e-9, 1e-9)
        check(response.valid_tokens == valid_tokens, "evaluate valid_tokens %d != %d" %
              (response.valid_tokens, valid_tokens))
        if seg_loss is not None:
            check(list(response.segment_tokens) == seg_tokens.tolist(),
                  "evaluate segment_tokens differ")
            check_close("evaluate segment_loss", response.segment_loss,
                        seg_loss.detach().numpy(), self.loss_rtol, self.loss_rtol)
        if policy is not None:
            stats = response.policy_stats
            check(stats.clipped_tokens == extras["clipped"], "evaluate clipped_tokens %d != %d" %
                  (stats.clipped_tokens, extras["clipped"]))
            for name in ("ratio_sum", "approx_kl_sum", "kl_sum", "entropy_sum"):
                check_close("evaluate " + name, getattr(stats, name), extras[name],
                            self.loss_rtol, self.loss_rtol)
            self.coverage.update(["evaluate policy"])
        self.coverage.update(["evaluate"])

    def boundary_case(self):
        """A ratio of exactly 1 against epsilon 0: at the boundary, not clipped."""
        pb2 = self.pb2
        data, _ = lt.encode_float(np.array([[0.0, -np.inf], [0.0, -np.inf]]), "fp32")
        handle = self.upload("DTYPE_FLOAT32", (2, 2), data)
        request = pb2.ForwardRequest(logits=handle, mode=pb2.GRADIENT_MODE_NONE)
        request.targets_inline.dtype = pb2.DTYPE_INT32
        request.targets_inline.data = np.array([0, 0], "<i4").tobytes()
        pg = request.policy
        pg.loss = pb2.POLICY_LOSS_PPO_CLIP
        pg.epsilon_low = 0.0
        pg.epsilon_high = 0.0
        pg.advantages_inline.dtype = pb2.DTYPE_FLOAT32
        pg.advantages_inline.data = np.array([1.0, -1.0], "<f4").tobytes()
        pg.sampling_logprobs_inline.dtype = pb2.DTYPE_FLOAT32
        pg.sampling_logprobs_inline.data = np.array([0.0, 0.0], "<f4").tobytes()
        response = self.stub.Forward(request)
        check(response.policy_stats.clipped_tokens == 0,
              "ratio exactly at 1 + eps counted as clipped")
        pg.sampling_logprobs_inline.data = np.array([-1e-6, 1e-6], "<f4").tobytes()
        response = self.stub.Forward(request)
        check(response.policy_stats.clipped_tokens == 2, "ratios past eps not clipped")
        self.stub.Release(pb2.ReleaseRequest(handle=handle))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lossd", required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--stubs", required=True)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--cases", type=int, default=150)
    parser.add_argument("--only_case", type=int, default=None)
    parser.add_argument("--max_failures", type=int, default=5)
    parser.add_argument("--gpu_tolerance", type=float, default=0.0,
                        help="gradient allowance relative to the row's largest element "
                             "(0: the CPU device's 2e-6)")
    parser.add_argument("--linear_fraction", type=float, default=0.25,
                        help="share of the cases run as a LinearForward of a random head")
    args = parser.parse_args()
    if args.device == "cuda" and not lt.gpu_visible():
        print("post-training oracle: no GPU visible; skipping the CUDA run")
        return lt.SKIP_EXIT_CODE
    seed = args.seed
    if seed is None and os.environ.get(SEED_ENV):
        seed = int(os.environ[SEED_ENV])
    if seed is None:
        seed = int.from_bytes(os.urandom(4), "little")
    print("post-training oracle: seed %d, device %s" % (seed, args.device))
    master = random.Random(seed)
    case_seeds = [master.getrandbits(32) for _ in range(args.cases)]
    pb2, pb2_grpc, grpc = lt.import_stubs(args.stubs)
    failures = 0
    started = time.monotonic()
    with lt.LossdServer(args.lossd, args.device) as server:
        channel, stub = lt.connect(grpc, pb2_grpc, server.address)
        oracle = Oracle(pb2, grpc, stub, args.gpu_tolerance, args.linear_fraction)
        try:
            oracle.boundary_case()
        except (CheckFailure, grpc.RpcError) as error:
            failures += 1
            print("FAIL boundary case: %s" % error)
        for index, case_seed in enumerate(case_seeds):
            if args.only_case is not None and index != args.only_case:
                continue
            try:
                oracle.run_case(case_seed)
            except (CheckFailure, grpc.RpcError) as error:
                failures += 1
                detail = ("%s: %s" % (error.code(), error.details())
                          if isinstance(error, grpc.RpcError) else str(error))
                print("FAIL case %d (--seed=%d --only_case=%d)\n  config: %s\n  %s" %
                      (index, seed, index, oracle.config, detail))
                if isinstance(error, grpc.RpcError):
                    traceback.print_exc(limit=3)
                if failures >= args.max_failures:
                    break
        channel.close()
        print("post-training oracle: coverage: " + ", ".join(
            "%s %d" % item for item in sorted(oracle.coverage.items())))
        server.stop()
    ran = 1 if args.only_case is not None else len(case_seeds)
    print("post-training oracle: %d cases, %d failed, %.1f s (seed %d)" %
          (ran, failures, time.monotonic() - started, seed))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
