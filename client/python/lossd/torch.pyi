# Type stubs of lossd.torch.
from concurrent.futures import Future
from typing import Any, Optional, Tuple, Union

import torch

from ._lossd import Client

def cross_entropy(input: torch.Tensor, target: torch.Tensor, *, client: Client,
                  weight: Union[None, str, torch.Tensor] = None, ignore_index: int = -100,
                  reduction: str = "mean", label_smoothing: float = 0.0,
                  z_loss_scale: float = 0.0, softcap: float = 0.0, normalizer: float = 0.0,
                  grad_scale: float = 1.0, label: str = "logits",
                  grad_out: Optional[torch.Tensor] = None,
                  segments: Union[None, str, torch.Tensor] = None, num_segments: int = 0,
                  segment_reduction: Optional[str] = None) -> torch.Tensor: ...

class PendingLoss:
    future: Future[Any]
    def done(self) -> bool: ...
    def cancel(self) -> bool: ...
    def result(self, timeout: Optional[float] = None) -> torch.Tensor: ...

def cross_entropy_async(input: torch.Tensor, target: torch.Tensor, *, client: Client,
                        weight: Union[None, str, torch.Tensor] = None, ignore_index: int = -100,
                        reduction: str = "mean", label_smoothing: float = 0.0,
                        z_loss_scale: float = 0.0, softcap: float = 0.0, normalizer: float = 0.0,
                        grad_scale: float = 1.0, label: str = "logits",
                        grad_out: Optional[torch.Tensor] = None,
                        segments: Union[None, str, torch.Tensor] = None, num_segments: int = 0,
                        segment_reduction: Optional[str] = None) -> PendingLoss: ...

def linear_cross_entropy(hidden: torch.Tensor, weight_handle: str, target: torch.Tensor, *,
                         client: Client, bias_handle: Optional[str] = None,
                         weight_grad_handle: Optional[str] = None,
                         bias_grad_handle: Optional[str] = None, accumulate: str = "add",
                         class_weights: Union[None, str, torch.Tensor] = None,
                         ignore_index: int = -100, reduction: str = "mean",
                         label_smoothing: float = 0.0, z_loss_scale: float = 0.0,
                         softcap: float = 0.0, normalizer: float = 0.0,
                         grad_scale: float = 1.0, label: str = "hidden",
                         precision: str = "exact",
                         segments: Union[None, str, torch.Tensor] = None,
                         num_segments: int = 0,
                         segment_reduction: Optional[str] = None) -> torch.Tensor: ...

class LossdCrossEntropyLoss(torch.nn.Module):
    client: Client
    weight: Optional[torch.Tensor]
    ignore_index: int
    reduction: str
    label_smoothing: float
    lossd_options: dict[str, Any]
    def __init__(self, client: Client, weight: Optional[torch.Tensor] = None,
                 ignore_index: int = -100, reduction: str = "mean",
                 label_smoothing: float = 0.0, **lossd_options: float) -> None: ...
    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor: ...

# A dense teacher (logits [N, V], or the handle of stored ones) or a top-k teacher
# (indices [N, k], logprobs [N, k]).
Teacher = Union[str, torch.Tensor, Tuple[Union[str, torch.Tensor], Union[str, torch.Tensor]]]

def kl_div(input: torch.Tensor, teacher: Teacher, target: Optional[torch.Tensor] = None, *,
           client: Client, reverse: bool = False, temperature: float = 1.0, alpha: float = 0.0,
           top_k_tail: str = "renormalize", ignore_index: int = -100, reduction: str = "mean",
           softcap: float = 0.0, normalizer: float = 0.0, grad_scale: float = 1.0,
           segments: Union[None, str, torch.Tensor] = None, num_segments: int = 0,
           segment_reduction: Optional[str] = None, label: str = "logits") -> torch.Tensor: ...

def jsd(input: torch.Tensor, teacher: Teacher, target: Optional[torch.Tensor] = None, *,
        client: Client, beta: float = 0.5, temperature: float = 1.0, alpha: float = 0.0,
        top_k_tail: str = "renormalize", ignore_index: int = -100, reduction: str = "mean",
        softcap: float = 0.0, normalizer: float = 0.0, grad_scale: float = 1.0,
        segments: Union[None, str, torch.Tensor] = None, num_segments: int = 0,
        segment_reduction: Optional[str] = None, label: str = "logits") -> torch.Tensor: ...

def policy_loss(input: torch.Tensor, target: torch.Tensor,
                advantages: Union[str, torch.Tensor], old_logprobs: Union[str, torch.Tensor], *,
                client: Client, loss_type: str = "ppo",
                ref_logprobs: Union[None, str, torch.Tensor] = None, epsilon_low: float = 0.2,
                epsilon_high: Optional[float] = None, kl_coef: float = 0.0,
                kl_estimator: str = "k3", ignore_index: int = -100, reduction: str = "mean",
                softcap: float = 0.0, normalizer: float = 0.0, grad_scale: float = 1.0,
                segments: Union[None, str, torch.Tensor] = None, num_segments: int = 0,
                segment_reduction: Optional[str] = None,
                label: str = "logits") -> torch.Tensor: ...

# kl_div, jsd and policy_loss started on the client's pool, as cross_entropy_async: the same
# arguments; .result() gives their loss.
def kl_div_async(input: torch.Tensor, teacher: Teacher, target: Optional[torch.Tensor] = None,
                 **kwargs: Any) -> PendingLoss: ...
def jsd_async(input: torch.Tensor, teacher: Teacher, target: Optional[torch.Tensor] = None,
              **kwargs: Any) -> PendingLoss: ...
def policy_loss_async(input: torch.Tensor, target: torch.Tensor,
                      advantages: Union[str, torch.Tensor],
                      old_logprobs: Union[str, torch.Tensor], **kwargs: Any) -> PendingLoss: ...

# The post-training losses over the LM head on the server (linear_cross_entropy's head
# arguments; the teacher, target and policy arguments as kl_div's, jsd's and policy_loss's).
def linear_kl_div(hidden: torch.Tensor, weight_handle: str, teacher: Teacher,
                  target: Optional[torch.Tensor] = None, *, client: Client,
                  reverse: bool = False, temperature: float = 1.0, alpha: float = 0.0,
                  top_k_tail: str = "renormalize", bias_handle: Optional[str] = None,
                  weight_grad_handle: Optional[str] = None,
                  bias_grad_handle: Optional[str] = None, accumulate: str = "add",
                  ignore_index: int = -100, reduction: str = "mean", softcap: float = 0.0,
                  normalizer: float = 0.0, grad_scale: float = 1.0,
                  segments: Union[None, str, torch.Tensor] = None, num_segments: int = 0,
                  segment_reduction: Optional[str] = None, label: str = "hidden",
                  precision: str = "exact") -> torch.Tensor: ...
def linear_jsd(hidden: torch.Tensor, weight_handle: str, teacher: Teacher,
               target: Optional[torch.Tensor] = None, *, client: Client, beta: float = 0.5,
               temperature: float = 1.0, alpha: float = 0.0, top_k_tail: str = "renormalize",
               bias_handle: Optional[str] = None, weight_grad_handle: Optional[str] = None,
               bias_grad_handle: Optional[str] = None, accumulate: str = "add",
               ignore_index: int = -100, reduction: str = "mean", softcap: float = 0.0,
               normalizer: float = 0.0, grad_scale: float = 1.0,
               segments: Union[None, str, torch.Tensor] = None, num_segments: int = 0,
               segment_reduction: Optional[str] = None, label: str = "hidden",
               precision: str = "exact") -> torch.Tensor: ...
def linear_policy_loss(hidden: torch.Tensor, weight_handle: str, target: torch.Tensor,
                       advantages: Union[str, torch.Tensor],
                       old_logprobs: Union[str, torch.Tensor], *, client: Client,
                       loss_type: str = "ppo",
                       ref_logprobs: Union[None, str, torch.Tensor] = None,
                       epsilon_low: float = 0.2, epsilon_high: Optional[float] = None,
                       kl_coef: float = 0.0, kl_estimator: str = "k3",
                       bias_handle: Optional[str] = None,
                       weight_grad_handle: Optional[str] = None,
                       bias_grad_handle: Optional[str] = None, accumulate: str = "add",
                       ignore_index: int = -100, reduction: str = "mean", softcap: float = 0.0,
                       normalizer: float = 0.0, grad_scale: float = 1.0,
                       segments: Union[None, str, torch.Tensor] = None, num_segments: int = 0,
                       segment_reduction: Optional[str] = None, label: str = "hidden",
                       precision: str = "exact") -> torch.Tensor: ...
