"""``fp16kit.optim.Adam``: Adam / AdamW with apex's ``FusedAdam`` conventions.

torch's ``AdamW(lr, betas, eps, weight_decay)`` (``adam_w_mode=True``) and ``Adam``
(``adam_w_mode=False``) compute the same rule in exact arithmetic; this class adds what they
cannot express, as apex's FusedAdam did:

* ``bias_correction=False`` (BERT's Adam without bias correction);
* fp32 moments and fp32 math for fp16/bf16 params (torch keeps fp16 moments for fp16 params);
* one step count per param group, ``param_groups[i]['step']`` (a param that gets its first
  grad late is bias-corrected with the group's count; torch counts per param).

Rule (per group, every ``step()``; params without a grad are skipped)::

    t = group['step'] += 1 ; bc1 = 1-b1**t ; bc2 = 1-b2**t       (both 1 without bias_correction)
    if not adam_w_mode: g = g + wd*p
    m = b1*m + (1-b1)*g ;  v = b2*v + (1-b2)*g*g
    u = (m/bc1) / (sqrt(v/bc2) + eps)
    if adam_w_mode: u = u + wd*p
    p = p - lr*u
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .base import FusedStyleOptimizer, buckets, check_hyper

__all__ = ["Adam", "adam_update_"]


class Adam(FusedStyleOptimizer):
    """Adam(W) with apex FusedAdam's rule (see the module docstring).

    Checkpoint: ``param_groups[i]['step']`` (int) and per-param ``exp_avg``, ``exp_avg_sq``.
    To load it into torch's Adam(W), copy the group step into each ``state[p]['step']``.
    """

    display_name = "Adam"

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        *,
        set_grad_none: bool = True,
    ) -> None:
        check_hyper(lr, betas, eps, weight_decay)
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay)
        self.adam_w_mode = adam_w_mode
        super().__init__(params, defaults, set_grad_none=set_grad_none)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found = [self.params_with_grads(group) for group in self.param_groups]  # checks first
        self.check_state((p for params, _ in found for p in params), ("exp_avg", "exp_avg_sq"))
        for group, (params, grads) in zip(self.param_groups, found):
            t = self.advance_group_step(group)  # also for groups without grads
            if params:
                self._step_group(group, params, grads, t)
        return loss

    def _step_group(self, group: dict[str, Any], params: list[torch.Tensor], grads: list[torch.Tensor], t: int) -> None:
        beta1, beta2 = group["betas"]
        ms = [self.work_state(p, "exp_avg") for p in params]
        vs = [self.work_state(p, "exp_avg_sq") for p in params]
        adam_update_(
            params,
            grads,
            ms,
            vs,
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            eps=group["eps"],
            step=t,
            adam_w_mode=self.adam_w_mode,
            bias_correction=group["bias_correction"],
            weight_decay=group["weight_decay"],
        )


def adam_update_(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    *,
    lr: float | torch.Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    step: int,
    adam_w_mode: bool,
    bias_correction: bool,
    weight_decay: float,
) -> None:
    """Apply one step of the module docstring's rule at step count ``step``, in place, on lists of tensors.

    The params may be fp16/bf16/fp32 (fp32 math, one rounding), their moments are in the work dtype (float32
    for fp16/bf16/fp32 params). Also apex's ``amp_C.multi_tensor_adam``."""
    bc1, bc2 = (1 - beta1**step, 1 - beta2**step) if bias_correction else (1.0, 1.0)
    wd = weight_decay
    for b, (m, v) in buckets(params, grads, (exp_avgs, exp_avg_sqs)):
        g: tuple[torch.Tensor, ...] | list[torch.Tensor] = b.g32
        if not adam_w_mode and wd != 0:
            g = torch._foreach_add(g, b.p32, alpha=wd)
        torch._foreach_mul_(m, beta1)
        torch._foreach_add_(m, g, alpha=1 - beta1)
        torch._foreach_mul_(v, beta2)
        torch._foreach_addcmul_(v, g, g, value=1 - beta2)
        denom = torch._foreach_div(v, bc2)
        torch._foreach_sqrt_(denom)
        torch._foreach_add_(denom, eps)
        u = torch._foreach_div(m, bc1)
        torch._foreach_div_(u, denom)
        if adam_w_mode and wd != 0:
            torch._foreach_add_(u, b.p32, alpha=wd)
        # a tensor lr (set by an LR scheduler) is read as a Scalar: torch's stubs say Number only
        torch._foreach_add_(b.p32, u, alpha=-lr)  # type: ignore[arg-type]
        b.write_back()
