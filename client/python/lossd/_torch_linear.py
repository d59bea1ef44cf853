"""lossd.torch's losses over the LM head the server holds (LinearForward): the hidden states go
up, the logits never leave the server, dX comes back and the head's gradient accumulates there."""

import warnings

import torch

from ._torch_core import (_DTYPE_NAMES, _attach_metrics, _call_staged, _host_targets,
                          _loss_tensor, _segment_kwargs, _store, _take_gradient)
from ._torch_post_training import _distillation_kwargs, _policy_kwargs


def linear_cross_entropy(hidden, weight_handle, target, *, client, bias_handle=None,
                         weight_grad_handle=None, bias_grad_handle=None, accumulate="add",
                         class_weights=None, ignore_index=-100, reduction="mean",
                         label_smoothing=0.0, z_loss_scale=0.0, softcap=0.0, normalizer=0.0,
                         grad_scale=1.0, label="hidden", precision="exact", segments=None,
                         num_segments=0, segment_reduction=None):
    """cross_entropy(hidden @ W.T + b, target) with the LM head W [V, H] (and bias b [V]) held by
    the lossd server behind `weight_handle` (`bias_handle`): the logits never leave the server.

    hidden: [N, H] float32, bfloat16 or float16 (W's dtype) on the CPU or a CUDA device; target:
    class indices [N]. Returns the loss as cross_entropy does ("mean" or "sum"; "none" only
    without a gradient). When a gradient will be needed, the server forms dX in place of the
    uploaded hidden states and the weight gradient in the same call: loss.backward() downloads
    dX onto hidden's device, and the weight (and bias) gradient accumulates in fp32 on the
    server into `weight_grad_handle` (`bias_grad_handle`; None = created by this call), per
    `accumulate` ("add" or "overwrite"). Their handles are set on the returned loss as
    loss.weight_grad_handle and loss.bias_grad_handle: pass them to the next micro-batch's call
    and read them with client.download(handle) (dtype "float32" or "bf16").

    The weight gradient is formed at the forward, so it carries grad_scale (fold 1/micro-batches
    or a loss scale into it) but not the grad_output of the backward, which scales dX only: with
    a grad_output other than 1 the gradients disagree (a warning says so). For a mean over
    micro-batches pass the whole batch's `normalizer`. Without a gradient (no requires_grad, or
    torch.no_grad()) it is loss-only: nothing is accumulated and nothing stays on the server.

    segments, num_segments, segment_reduction: as cross_entropy's. linear_kl_div, linear_jsd and
    linear_policy_loss: the post-training losses with the same head arguments.

    precision: "exact" (dW within ~3e-5 of fp32) or "fast" (on a CUDA server with bfloat16 or
    float16 inputs, the three products in 16 bits as the peers compute them: a ~1.1x faster
    kernel, dW 2e-4 to 2e-3 relative error on mild logits, 2e-2 on peaked ones); float32 inputs and the CPU server compute the same either way.
    """
    if not isinstance(target, torch.Tensor):
        raise TypeError("lossd.torch.linear_cross_entropy: hidden and target must be tensors")
    options = _linear_options(
        "linear_cross_entropy", hidden, target, weight_handle, bias_handle, weight_grad_handle,
        bias_grad_handle, accumulate, ignore_index, reduction, softcap, normalizer, grad_scale,
        label, precision)
    if isinstance(class_weights, torch.Tensor):
        class_weights = class_weights.detach().to("cpu", torch.float32).contiguous().numpy()
    options.update(class_weights=class_weights, label_smoothing=float(label_smoothing),
                   z_loss_scale=float(z_loss_scale))
    options["extra"] = _segment_kwargs(segments, num_segments, segment_reduction)
    return _linear_loss(hidden, target, client, options)


def _linear_options(name, hidden, target, weight_handle, bias_handle, weight_grad_handle,
                    bias_grad_handle, accumulate, ignore_index, reduction, softcap, normalizer,
                    grad_scale, label, precision):
    """The checks and options the linear_* functions share (cross-entropy options off)."""
    if not isinstance(hidden, torch.Tensor):
        raise TypeError("lossd.torch.%s: hidden must be a tensor" % name)
    if hidden.dtype not in _DTYPE_NAMES:
        raise TypeError("lossd.torch.%s: hidden must be float32, bfloat16 or float16, not %s"
                        % (name, hidden.dtype))
    if hidden.dim() != 2 or (target is not None and (
            not isinstance(target, torch.Tensor) or target.dim() != 1
            or target.shape[0] != hidden.shape[0])):
        raise ValueError("hidden [N, H] needs a target [N]; got %s and %s"
                         % (tuple(hidden.shape), None if target is None
                            else tuple(getattr(target, "shape", ()))))
    if reduction not in ("mean", "sum", "none"):
        raise ValueError("reduction must be 'mean', 'sum' or 'none', not %r" % (reduction,))
    if accumulate not in ("add", "overwrite"):
        raise ValueError("accumulate must be 'add' or 'overwrite', not %r" % (accumulate,))
    if precision not in ("exact", "fast"):
        raise ValueError("precision must be 'exact' or 'fast', not %r" % (precision,))
    if torch.is_grad_enabled() and hidden.requires_grad and reduction == "none":
        raise ValueError("lossd.torch.%s: reduction 'none' with a gradient needs the per-row "
                         "grad_output at the forward; use 'mean' or 'sum', or "
                         "client.linear_forward(..., token_grad_output=...)" % name)
    return dict(weight=weight_handle, bias=bias_handle or "",
                weight_grad=weight_grad_handle or "", bias_grad=bias_grad_handle or "",
                accumulate=accumulate, class_weights=None, ignore_index=int(ignore_index),
                reduction=reduction, label_smoothing=0.0, z_loss_scale=0.0,
                softcap=float(softcap), normalizer=float(normalizer),
                grad_scale=float(grad_scale), label=label, precision=precision)


def _linear_loss(hidden, target, client, options):
    """One LinearForward with autograd through the hidden states when a gradient is needed (the
    head's gradient accumulated on the server; its handles on the loss), else the loss alone;
    with options["extra"] the loss carries the post-training metrics."""
    if torch.is_grad_enabled() and hidden.requires_grad:
        loss = _LinearCrossEntropy.apply(hidden, target, client, options)
        loss.weight_grad_handle = options["weight_grad_out"]
        loss.bias_grad_handle = options["bias_grad_out"] or None
    else:
        loss, _ = _linear_forward(hidden, target, client, options, need_gradient=False)
    if options.get("extra"):
        _attach_metrics(loss, options.pop("result"))
    return loss


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, target, client, options):
        loss, stored = _linear_forward(hidden, target, client, options, need_gradient=True)
        ctx.stored = stored
        ctx.hidden_meta = (hidden.shape, hidden.dtype, hidden.device)
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output):
        def record(client, handle):
            factor = float(grad_output)
            if factor != 1.0:
                warnings.warn("lossd.torch.linear_cross_entropy: a grad_output of %g scales dX "
                              "but not the weight gradient accumulated at the forward; fold it "
                              "into grad_scale" % factor, stacklevel=4)
                client.backward(handle, factor)

        gradient = _take_gradient(ctx, record, ctx.hidden_meta, None,
                                  "lossd.torch.linear_cross_entropy: backward ran twice; the "
                                  "server's dX was released after the first")
        return gradient, None, None, None


def _linear_forward(hidden, target, client, options, need_gradient):
    """Uploads the hidden states, runs LinearForward (dX in place and the weight gradient
    accumulated when a gradient is needed, else loss only) and returns (loss tensor,
    _StoredTensor or None); the accumulators' handles and the result go into options.
    options["extra"] and options["teacher_tensor"] as _forward's."""
    hidden = hidden.detach().contiguous()
    target = _host_targets(target).numpy() if target is not None else None
    reduction = options["reduction"]
    extra = dict(options.get("extra") or {})
    if extra:  # a server that cannot serve it is refused before the states go
        client.require_post_training("lossd.torch")
    stored = _store(client, hidden, options["label"])
    result = _call_staged(client, stored, options, extra, lambda extra: client.linear_forward(
        stored.handle, options["weight"], target, bias=options["bias"],
        weight_grad=options["weight_grad"] if need_gradient else "",
        bias_grad=options["bias_grad"] if need_gradient else "",
        accumulate=options["accumulate"] if need_gradient else "none",
        class_weights=options["class_weights"], ignore_index=options["ignore_index"],
        label_smoothing=options["label_smoothing"], reduction=reduction,
        z_loss_scale=options["z_loss_scale"], softcap=options["softcap"],
        normalizer=options["normalizer"], grad_scale=options["grad_scale"],
        mode="in_place" if need_gradient else "none", token_loss=reduction == "none",
        precision=options["precision"], **extra))
    options["result"] = result.forward
    options["weight_grad_out"] = result.weight_grad
    options["bias_grad_out"] = result.bias_grad
    if not need_gradient:
        stored.release()
        stored = None
    return _loss_tensor(result, reduction, options["normalizer"], hidden), stored


def linear_kl_div(hidden, weight_handle, teacher, target=None, *, client, reverse=False,
                  temperature=1.0, alpha=0.0, top_k_tail="renormalize", bias_handle=None,
                  weight_grad_handle=None, bias_grad_handle=None, accumulate="add",
                  ignore_index=-100, reduction="mean", softcap=0.0, normalizer=0.0,
                  grad_scale=1.0, segments=None, num_segments=0, segment_reduction=None,
                  label="hidden", precision="exact"):
    """kl_div of the logits hidden @ W.T + b that the server forms from the LM head behind
    `weight_handle` and never sends: teacher (dense: [N, V], V the head's rows), target and
    distillation arguments as kl_div's; head arguments, autograd (dX downloaded; the head's
    gradient accumulated on the server) and loss.weight_grad_handle as linear_cross_entropy's."""
    return _linear_distill(
        "linear_kl_div", hidden, weight_handle, teacher, target, client,
        "reverse_kl" if reverse else "forward_kl", 0.5, temperature, alpha, top_k_tail,
        bias_handle, weight_grad_handle, bias_grad_handle, accumulate, ignore_index, reduction,
        softcap, normalizer, grad_scale, segments, num_segments, segment_reduction, label,
        precision)


def linear_jsd(hidden, weight_handle, teacher, target=None, *, client, beta=0.5,
               temperature=1.0, alpha=0.0, top_k_tail="renormalize", bias_handle=None,
               weight_grad_handle=None, bias_grad_handle=None, accumulate="add",
               ignore_index=-100, reduction="mean", softcap=0.0, normalizer=0.0, grad_scale=1.0,
               segments=None, num_segments=0, segment_reduction=None, label="hidden",
               precision="exact"):
    """jsd over the LM head (Liger's LigerFusedLinearJSD, with the head on the server):
    arguments and result as linear_kl_div's, beta as jsd's."""
    return _linear_distill(
        "linear_jsd", hidden, weight_handle, teacher, target, client, "jsd", beta, temperature,
        alpha, top_k_tail, bias_handle, weight_grad_handle, bias_grad_handle, accumulate,
        ignore_index, reduction, softcap, normalizer, grad_scale, segments, num_segments,
        segment_reduction, label, precision)


def _linear_distill(name, hidden, weight_handle, teacher, target, client, divergence, beta,
                    temperature, alpha, top_k_tail, bias_handle, weight_grad_handle,
                    bias_grad_handle, accumulate, ignore_index, reduction, softcap, normalizer,
                    grad_scale, segments, num_segments, segment_reduction, label, precision):
    options = _linear_options(name, hidden, target, weight_handle, bias_handle,
                              weight_grad_handle, bias_grad_handle, accumulate, ignore_index,
                              reduction, softcap, normalizer, grad_scale, label, precision)
    options["extra"], options["teacher_tensor"] = _distillation_kwargs(
        name, teacher, target, divergence, beta, temperature, alpha, top_k_tail,
        hidden.shape[0])
    options["extra"].update(_segment_kwargs(segments, num_segments, segment_reduction))
    return _linear_loss(hidden, target, client, options)


def linear_policy_loss(hidden, weight_handle, target, advantages, old_logprobs, *, client,
                       loss_type="ppo", ref_logprobs=None, epsilon_low=0.2, epsilon_high=None,
                       kl_coef=0.0, kl_estimator="k3", bias_handle=None,
                       weight_grad_handle=None, bias_grad_handle=None, accumulate="add",
                       ignore_index=-100, reduction="mean", softcap=0.0, normalizer=0.0,
                       grad_scale=1.0, segments=None, num_segments=0, segment_reduction=None,
                       label="hidden", precision="exact"):
    """policy_loss over the LM head on the server: the policy arguments as policy_loss's, the
    head arguments and the autograd as linear_kl_div's. The loss carries .policy_stats."""
    options = _linear_options("linear_policy_loss", hidden, target, weight_handle, bias_handle,
                              weight_grad_handle, bias_grad_handle, accumulate, ignore_index,
                              reduction, softcap, normalizer, grad_scale, label, precision)
    extra = _policy_kwargs(loss_type, advantages, old_logprobs, ref_logprobs, epsilon_low,
                           epsilon_high, kl_coef, kl_estimator)
    extra.update(_segment_kwargs(segments, num_segments, segment_reduction))
    options["extra"] = extra
    return _linear_loss(hidden, target, client, options)
