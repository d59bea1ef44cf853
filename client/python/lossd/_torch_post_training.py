"""lossd.torch's post-training losses (docs/api.md, "Post-training losses"): kl_div, jsd and
policy_loss, each one Forward with more keyword arguments, its gradient written in place of the
uploaded logits as cross_entropy's."""

import torch

from ._torch_core import _DTYPE_NAMES, _post_training_loss, _segment_kwargs


def _small_input(value, name):
    """A per-row input [N] (or [N, k]) as a float32 numpy array, or a handle as it is."""
    if isinstance(value, str):
        return value
    if value is None:
        return None
    tensor = torch.as_tensor(value)
    if not tensor.is_floating_point():
        raise TypeError("%s must be floating point, not %s" % (name, tensor.dtype))
    return tensor.detach().to("cpu", torch.float32).contiguous().numpy()


def _teacher_kwargs(teacher):
    """(Client.forward's teacher argument, a dense teacher tensor to upload or None)."""
    if isinstance(teacher, str):
        return teacher, None
    if isinstance(teacher, (tuple, list)):
        if len(teacher) != 2:
            raise ValueError("a top-k teacher is a pair (indices [N, k], logprobs [N, k])")
        indices, logprobs = teacher
        if not isinstance(indices, str):
            indices = torch.as_tensor(indices).detach().to("cpu")
            if indices.dtype not in (torch.int32, torch.int64):
                indices = indices.to(torch.int64)
            indices = indices.contiguous().numpy()
        return (indices, _small_input(logprobs, "teacher logprobs")), None
    if isinstance(teacher, torch.Tensor):
        if teacher.dtype not in _DTYPE_NAMES:
            raise TypeError("teacher logits must be float32, bfloat16 or float16, not %s"
                            % teacher.dtype)
        return None, teacher
    raise TypeError("teacher must be a tensor of logits [N, V], a handle of stored teacher "
                    "logits, or a pair (indices, logprobs) of a top-k teacher")


def _check_logits(input, target, name):
    if not isinstance(input, torch.Tensor):
        raise TypeError("lossd.torch.%s: input must be a tensor" % name)
    if input.dtype not in _DTYPE_NAMES:
        raise TypeError("lossd.torch.%s: logits must be float32, bfloat16 or float16, not %s"
                        % (name, input.dtype))
    if input.dim() != 2:
        raise ValueError("lossd.torch.%s takes logits [N, V], not %d-d" % (name, input.dim()))
    if target is not None and (not isinstance(target, torch.Tensor) or target.dim() != 1
                               or target.shape[0] != input.shape[0]):
        raise ValueError("lossd.torch.%s: logits [N, V] need a target [N]" % name)


def _base_options(reduction, ignore_index, softcap, normalizer, grad_scale, label):
    if reduction not in ("mean", "sum", "none"):
        raise ValueError("reduction must be 'mean', 'sum' or 'none', not %r" % (reduction,))
    return dict(weight=None, ignore_index=int(ignore_index), reduction=reduction,
                label_smoothing=0.0, z_loss_scale=0.0, softcap=float(softcap),
                normalizer=float(normalizer), grad_scale=float(grad_scale), label=label,
                grad_out=None)


def _distill(name, input, teacher, target, client, divergence, beta, temperature, alpha,
             top_k_tail, ignore_index, reduction, softcap, normalizer, grad_scale, segments,
             num_segments, segment_reduction, label, asynchronous=False):
    _check_logits(input, target, name)
    options = _base_options(reduction, ignore_index, softcap, normalizer, grad_scale, label)
    options["extra"], options["teacher_tensor"] = _distillation_kwargs(
        name, teacher, target, divergence, beta, temperature, alpha, top_k_tail,
        input.shape[0], input.shape)
    options["extra"].update(_segment_kwargs(segments, num_segments, segment_reduction))
    return _post_training_loss(input, target, client, options, input.requires_grad,
                               asynchronous)


def _distillation_kwargs(name, teacher, target, divergence, beta, temperature, alpha,
                         top_k_tail, rows, shape=None):
    """(Client.forward's distillation keywords, a dense teacher tensor to upload or None)."""
    if target is None and alpha != 0:
        raise ValueError("lossd.torch.%s: alpha > 0 mixes in the cross entropy against target; "
                         "pass target" % name)
    teacher_arg, teacher_tensor = _teacher_kwargs(teacher)
    if teacher_tensor is not None and (
            teacher_tensor.shape != shape if shape is not None
            else teacher_tensor.dim() != 2 or teacher_tensor.shape[0] != rows):
        raise ValueError("teacher logits %s must have the student's shape %s"
                         % (tuple(teacher_tensor.shape),
                            tuple(shape) if shape is not None else "[%d, V]" % rows))
    extra = dict(divergence=divergence, beta=float(beta), temperature=float(temperature),
                 alpha=float(alpha), top_k_tail=top_k_tail)
    if teacher_arg is not None:
        extra["teacher"] = teacher_arg
    return extra, teacher_tensor


def kl_div(input, teacher, target=None, *, client, reverse=False, temperature=1.0, alpha=0.0,
           top_k_tail="renormalize", ignore_index=-100, reduction="mean", softcap=0.0,
           normalizer=0.0, grad_scale=1.0, segments=None, num_segments=0,
           segment_reduction=None, label="logits", _asynchronous=False):
    """Distillation loss KL(q || p) (reverse=True: KL(p || q)) per row between the teacher's
    distribution q and the student's p = softmax(input / temperature), computed by the lossd
    server, with autograd (the gradient written in place of the uploaded logits, as
    cross_entropy's). Unlike torch.nn.functional.kl_div, input is the student's logits [N, V],
    not log-probabilities, and reduction "mean" divides by the counted rows (torch's
    "batchmean" when every row counts).

    teacher: the teacher's logits [N, V] (a tensor, uploaded for the call, of float32,
    bfloat16 or float16; or a handle of stored teacher logits), or a top-k teacher, a pair
    (indices [N, k] int, logprobs [N, k] float) as teacher servers send, with top_k_tail
    "renormalize" (both sides over the k classes) or "bucket" (the rest of the vocabulary as one
    class). target: class indices [N], optional: rows at ignore_index count for nothing, and
    alpha > 0 adds alpha * cross_entropy(input, target) (Liger's weight_hard_loss) to
    (1 - alpha) times the divergence. No temperature**2 factor (as TRL and Liger); fold one
    into grad_scale. segments as cross_entropy's. The loss tensor carries .distillation_loss
    (the divergence term alone, a float), .valid_tokens and, with segments, .segment_loss and
    .segment_tokens."""
    return _distill("kl_div", input, teacher, target, client,
                    "reverse_kl" if reverse else "forward_kl", 0.5, temperature, alpha,
                    top_k_tail, ignore_index, reduction, softcap, normalizer, grad_scale,
                    segments, num_segments, segment_reduction, label, _asynchronous)


def jsd(input, teacher, target=None, *, client, beta=0.5, temperature=1.0, alpha=0.0,
        top_k_tail="renormalize", ignore_index=-100, reduction="mean", softcap=0.0,
        normalizer=0.0, grad_scale=1.0, segments=None, num_segments=0, segment_reduction=None,
        label="logits", _asynchronous=False):
    """Generalized Jensen-Shannon divergence beta KL(q || m) + (1 - beta) KL(p || m),
    m = beta q + (1 - beta) p, as TRL's GKDTrainer.generalized_jsd_loss and Liger's LigerJSD
    define it (beta = 0 is forward KL, 1 reverse KL), between the teacher's q and the student's
    p = softmax(input / temperature). Arguments and result as kl_div's."""
    return _distill("jsd", input, teacher, target, client, "jsd", beta, temperature, alpha,
                    top_k_tail, ignore_index, reduction, softcap, normalizer, grad_scale,
                    segments, num_segments, segment_reduction, label, _asynchronous)


def policy_loss(input, target, advantages, old_logprobs, *, client, loss_type="ppo",
                ref_logprobs=None, epsilon_low=0.2, epsilon_high=None, kl_coef=0.0,
                kl_estimator="k3", ignore_index=-100, reduction="mean", softcap=0.0,
                normalizer=0.0, grad_scale=1.0, segments=None, num_segments=0,
                segment_reduction=None, label="logits", _asynchronous=False):
    """A per-token policy-gradient loss on the sampled tokens `target` [N] of the policy's logits
    `input` [N, V], computed by the lossd server with autograd. With r = exp(logp -
    old_logprobs) and A = advantages (float [N] each):

    loss_type "importance_sampling": -r A; "ppo": max(-r A, -clip(r, 1 - epsilon_low,
    1 + epsilon_high) A) (DAPO's clip-higher; epsilon_high None = epsilon_low); "cispo":
    -sg(clip(r)) A logp. ref_logprobs [N] and kl_coef add kl_coef * KL against a reference
    model, KL estimated by kl_estimator "k1", "k2" or "k3" (verl's low_var_kl). Rows at
    ignore_index count for nothing. reduction "mean" is verl's "token-mean"; with segments
    (sequence ids [N]) segment_reduction "seq_mean_token_sum" / "seq_mean_token_mean" are its
    other modes. The loss tensor carries .policy_stats (clipped_tokens, ratio_sum,
    approx_kl_sum, kl_sum, entropy_sum: sums over .valid_tokens), and with segments
    .segment_loss and .segment_tokens."""
    _check_logits(input, target, "policy_loss")
    options = _base_options(reduction, ignore_index, softcap, normalizer, grad_scale, label)
    extra = _policy_kwargs(loss_type, advantages, old_logprobs, ref_logprobs, epsilon_low,
                           epsilon_high, kl_coef, kl_estimator)
    extra.update(_segment_kwargs(segments, num_segments, segment_reduction))
    options["extra"] = extra
    return _post_training_loss(input, target, client, options, input.requires_grad,
                               _asynchronous)


def _policy_kwargs(loss_type, advantages, old_logprobs, ref_logprobs, epsilon_low,
                   epsilon_high, kl_coef, kl_estimator):
    """Client.forward's policy keyword arguments."""
    return dict(policy_loss=loss_type, advantages=_small_input(advantages, "advantages"),
                old_logprobs=_small_input(old_logprobs, "old_logprobs"),
                ref_logprobs=_small_input(ref_logprobs, "ref_logprobs"),
                epsilon_low=float(epsilon_low),
                epsilon_high=None if epsilon_high is None else float(epsilon_high),
                kl_coef=float(kl_coef), kl_estimator=kl_estimator)


def kl_div_async(input, teacher, target=None, **kwargs):
    """kl_div started now and collected later, as cross_entropy_async: a PendingLoss whose
    .result() is kl_div's loss (with its metrics and autograd). Same arguments as kl_div."""
    return _call_async(kl_div, input, teacher, target, **kwargs)


def jsd_async(input, teacher, target=None, **kwargs):
    """jsd started now and collected later (see kl_div_async)."""
    return _call_async(jsd, input, teacher, target, **kwargs)


def policy_loss_async(input, target, advantages, old_logprobs, **kwargs):
    """policy_loss started now and collected later (see kl_div_async)."""
    return _call_async(policy_loss, input, target, advantages, old_logprobs, **kwargs)


def _call_async(function, *args, **kwargs):
    kwargs["_asynchronous"] = True
    return function(*args, **kwargs)
