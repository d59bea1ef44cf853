"""lossd.torch: torch.nn.functional.cross_entropy computed by a lossd server, as an autograd
function, so that a training loop swaps one call and keeps its loss.backward().

The logits go to the server once; Forward writes the gradient over them there, in place, and
loss.backward() fetches it (with the incoming grad_output applied by the server) into a gradient
tensor of the logits' dtype on the logits' device. Host memory: CPU logits are sent from, and
their gradient received into, the tensors themselves; CUDA tensors move through the client's few
scratch buffers (kept for the client's life and registered with CUDA once, so the device copies
are direct DMA), the next piece's copy overlapping the current piece's send.

The post-training losses (kl_div, jsd, policy_loss) live in _torch_post_training, the losses over
the server's LM head (linear_*) in _torch_linear, the transfers and the autograd function they
all share in _torch_core; this module is their one public face.
"""

import torch

from ._torch_core import (_DTYPE_NAMES, PendingLoss, _CrossEntropy, _forward,
                          _post_training_loss, _segment_kwargs, _start_async)
from ._torch_linear import linear_cross_entropy, linear_jsd, linear_kl_div, linear_policy_loss
from ._torch_post_training import (jsd, jsd_async, kl_div, kl_div_async, policy_loss,
                                   policy_loss_async)

__all__ = ["cross_entropy", "cross_entropy_async", "PendingLoss", "LossdCrossEntropyLoss",
           "linear_cross_entropy", "kl_div", "jsd", "policy_loss", "kl_div_async", "jsd_async",
           "policy_loss_async", "linear_kl_div", "linear_jsd", "linear_policy_loss"]


def cross_entropy(input, target, *, client, weight=None, ignore_index=-100, reduction="mean",
                  label_smoothing=0.0, z_loss_scale=0.0, softcap=0.0, normalizer=0.0,
                  grad_scale=1.0, label="logits", grad_out=None, segments=None,
                  num_segments=0, segment_reduction=None):
    """torch.nn.functional.cross_entropy(input, target, weight, ignore_index=ignore_index,
    reduction=reduction, label_smoothing=label_smoothing), computed by the lossd server that
    `client` (a lossd.Client) talks to.

    input: logits [N, V] (or [V] with a 0-d target) of float32, bfloat16 or float16, on the CPU
    or a CUDA device; target: class indices [N] (int64 or int32; ignore_index rows count for
    nothing); weight: class weights [V] (a tensor, sent as float32) or a handle of a stored
    float32 [V] tensor. Returns what F.cross_entropy returns: a 0-d tensor for "mean" and "sum",
    per-row losses [N] for "none", in the logits' dtype and on their device. One difference: a
    "mean" over zero valid rows is NaN as in torch, and its gradient 0.

    lossd's own options: z_loss_scale (adds z_loss_scale * lse^2 per valid row), softcap (the
    logits become softcap * tanh(x / softcap) first), normalizer (a "mean" divides by this
    instead of the valid-row count or weight sum), grad_scale (multiplies the gradient).

    grad_out: a contiguous tensor of the input's shape, dtype and device that the backward
    writes the gradient into and hands to autograd, instead of a new tensor. Pass the same one
    every step to skip fresh memory's first-touch page faults (CPU logits: on the build machine
    a download into fresh memory took 1.1-1.8 s against 0.14-0.28 s into reused memory, 0.49
    GiB). Only safe while nothing keeps the previous step's gradient: fine for logits computed
    from a model (the gradient is consumed by the backward of the ops before), not for leaf
    logits whose .grad would be this tensor.

    When a gradient will be needed (input.requires_grad with grad mode on), the server computes
    it in place during the forward and loss.backward() downloads it; the server tensor is freed
    after the backward, or when the graph is dropped without one. Otherwise the loss alone is
    computed and nothing stays on the server. Raises lossd.Error subclasses (e.g.
    lossd.InvalidArgument for a target outside [0, V)).

    segments: the segment (document) id [N] of each row of packed sequences; the loss then
    carries .segment_loss (each segment's loss sum, float64 [num_segments]) and
    .segment_tokens (its valid rows), e.g. per-document perplexity exp(segment_loss /
    segment_tokens). num_segments: 0 = max id + 1. segment_reduction: None (the reduction over
    tokens), "seq_mean_token_mean" or "seq_mean_token_sum" (verl's loss_agg_mode; needs
    reduction "mean").
    """
    logits, target, single, options = _prepare(
        input, target, weight=weight, ignore_index=ignore_index, reduction=reduction,
        label_smoothing=label_smoothing, z_loss_scale=z_loss_scale, softcap=softcap,
        normalizer=normalizer, grad_scale=grad_scale, label=label, grad_out=grad_out)
    options["extra"] = _segment_kwargs(segments, num_segments, segment_reduction)
    if options["extra"]:
        return _post_training_loss(logits, target, client, options, input.requires_grad)
    if torch.is_grad_enabled() and input.requires_grad:
        loss = _CrossEntropy.apply(logits, target, client, options)
    else:
        loss, _ = _forward(logits, target, client, options, need_gradient=False)
    return loss.reshape(()) if single and reduction == "none" else loss


def _prepare(input, target, *, weight, ignore_index, reduction, label_smoothing, z_loss_scale,
             softcap, normalizer, grad_scale, label, grad_out):
    """cross_entropy's checks: (logits [N, V], target [N], whether input was [V], options)."""
    if not isinstance(input, torch.Tensor) or not isinstance(target, torch.Tensor):
        raise TypeError("lossd.torch.cross_entropy: input and target must be tensors")
    if input.dtype not in _DTYPE_NAMES:
        raise TypeError("lossd.torch.cross_entropy: logits must be float32, bfloat16 or float16, "
                        "not %s" % input.dtype)
    if target.is_floating_point():
        raise ValueError("lossd.torch.cross_entropy: class probabilities as targets are not "
                         "supported; pass class indices")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError("reduction must be 'mean', 'sum' or 'none', not %r" % (reduction,))
    single = input.dim() == 1
    if single:
        if target.dim() != 0:
            raise ValueError("logits [V] need a 0-d target, got target of shape %s"
                             % (tuple(target.shape),))
        logits, target = input.unsqueeze(0), target.reshape(1)
    elif input.dim() == 2:
        if target.dim() != 1 or target.shape[0] != input.shape[0]:
            raise ValueError("logits [N, V] need a target [N]; got %s and %s"
                             % (tuple(input.shape), tuple(target.shape)))
        logits = input
    else:
        raise ValueError("lossd.torch.cross_entropy takes logits [N, V] or [V], not %d-d"
                         % input.dim())
    options = dict(weight=weight, ignore_index=int(ignore_index), reduction=reduction,
                   label_smoothing=float(label_smoothing), z_loss_scale=float(z_loss_scale),
                   softcap=float(softcap), normalizer=float(normalizer),
                   grad_scale=float(grad_scale), label=label, grad_out=None)
    if grad_out is not None:
        if (not isinstance(grad_out, torch.Tensor) or grad_out.shape != input.shape
                or grad_out.dtype != input.dtype or grad_out.device != input.device
                or not grad_out.is_contiguous()):
            raise ValueError("grad_out must be a contiguous tensor of the input's shape, dtype "
                             "and device (%s %s on %s)"
                             % (tuple(input.shape), input.dtype, input.device))
        options["grad_out"] = grad_out.view(logits.shape)
    return logits, target, single, options


def cross_entropy_async(input, target, *, client, weight=None, ignore_index=-100,
                        reduction="mean", label_smoothing=0.0, z_loss_scale=0.0, softcap=0.0,
                        normalizer=0.0, grad_scale=1.0, label="logits", grad_out=None,
                        segments=None, num_segments=0, segment_reduction=None):
    """cross_entropy started now and collected later: returns a PendingLoss at once, whose
    .result() gives what cross_entropy would have returned (with autograd: loss.backward()
    downloads the gradient). The upload and Forward run on the client's thread pool with the
    GIL released, so the caller computes the next micro-batch meanwhile.

    The logits must not change until .result() returns (CPU logits are sent from where they lie).
    CUDA logits are read after the work queued on the current stream when this was called, on a
    stream of their own, so later work queued on the current stream does not delay the upload.
    Whether a gradient is formed is decided here (grad mode and input.requires_grad now).
    .cancel() follows lossd.Client's futures: nothing stays on the server."""
    logits, target, single, options = _prepare(
        input, target, weight=weight, ignore_index=ignore_index, reduction=reduction,
        label_smoothing=label_smoothing, z_loss_scale=z_loss_scale, softcap=softcap,
        normalizer=normalizer, grad_scale=grad_scale, label=label, grad_out=grad_out)
    options["extra"] = _segment_kwargs(segments, num_segments, segment_reduction)
    return _start_async(logits, target, client, options, input.requires_grad, single)


class LossdCrossEntropyLoss(torch.nn.Module):
    """torch.nn.CrossEntropyLoss computed by a lossd server: LossdCrossEntropyLoss(client,
    weight=None, ignore_index=-100, reduction="mean", label_smoothing=0.0, **lossd_options)
    (z_loss_scale, softcap, normalizer, grad_scale); forward(input, target) is
    lossd.torch.cross_entropy with these options."""

    def __init__(self, client, weight=None, ignore_index=-100, reduction="mean",
                 label_smoothing=0.0, **lossd_options):
        super().__init__()
        self.client = client
        if isinstance(weight, torch.Tensor):
            self.register_buffer("weight", weight)
        else:
            self.weight = weight
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = label_smoothing
        self.lossd_options = dict(lossd_options)

    def forward(self, input, target):
        return cross_entropy(input, target, client=self.client, weight=self.weight,
                             ignore_index=self.ignore_index, reduction=self.reduction,
                             label_smoothing=self.label_smoothing, **self.lossd_options)

    def extra_repr(self):
        return "client=%r, ignore_index=%d, reduction=%r, label_smoothing=%g" % (
            self.client.target, self.ignore_index, self.reduction, self.label_smoothing)


# Shown as lossd.torch.X (help(), reprs, tracebacks) rather than the private modules defining them.
for _public in (PendingLoss, linear_cross_entropy, linear_kl_div, linear_jsd, linear_policy_loss,
                kl_div, jsd, policy_loss, kl_div_async, jsd_async, policy_loss_async):
    _public.__module__ = __name__
del _public
