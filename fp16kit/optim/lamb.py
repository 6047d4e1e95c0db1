"""``fp16kit.optim.LAMB``: layer-wise adaptive moments (You et al., 2019), apex FusedLAMB's rule.

torch has no LAMB. The rule (apex 2020-04 onward)::

    G = sqrt(sum of ||g||^2 over every grad of every group)      # global, on the device
    M = defaults['max_grad_norm']                                # per-group values ignored, as apex
    c = max(G/M, 1) if M > 0 else 1                              # FIX: M <= 0 means no clipping
    per group: t = group['step'] += 1 ; bc1, bc2 = 1-b1**t, 1-b2**t (1, 1 without bias_correction)
               b3 = 1-b1 if grad_averaging else 1
    per param with a grad (pn = ||p|| before the update):
        g' = g/c ;  if not adam_w_mode: g' = g' + wd*p
        m = b1*m + b3*g' ;  v = b2*v + (1-b2)*g'*g'
        u = (m/bc1)/(sqrt(v/bc2) + eps) ;  if adam_w_mode: u = u + wd*p
        r = lr*pn/||u|| if (use_nvlamb or wd != 0) and pn != 0 and ||u|| != 0 else lr   # no clamp
        p = p - r*u

Everything runs on the device (norms, clip factor and trust ratios are tensors): no host read.
A non-finite G makes every update NaN, as in apex: skip such steps (a GradScaler, or
MixedPrecisionOptimizer's own check) before they reach the optimizer.
Differences from apex: moments are fp32 for fp16/bf16 params (apex: the param dtype), and
``p.grad`` is left as it was (apex's kernel overwrote it with ``u``).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..core import kernels
from .base import FusedStyleOptimizer, buckets, check_hyper

__all__ = ["LAMB"]


class LAMB(FusedStyleOptimizer):
    """LAMB with apex FusedLAMB's rule and defaults (see the module docstring)."""

    display_name = "LAMB"

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        adam_w_mode: bool = True,
        grad_averaging: bool = True,
        max_grad_norm: float = 1.0,
        use_nvlamb: bool = False,
        *,
        set_grad_none: bool = True,
    ) -> None:
        check_hyper(lr, betas, eps, weight_decay)
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            grad_averaging=grad_averaging,
            max_grad_norm=max_grad_norm,
        )
        self.adam_w_mode = adam_w_mode
        self.use_nvlamb = use_nvlamb
        super().__init__(params, defaults, set_grad_none=set_grad_none)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found = [self.params_with_grads(group) for group in self.param_groups]
        self.check_state((p for params, _ in found for p in params), ("exp_avg", "exp_avg_sq"))
        all_grads = [g for _, grads in found for g in grads]
        clip = self._clip_factor(all_grads)
        for group, (params, grads) in zip(self.param_groups, found):
            t = self.advance_group_step(group)
            if params:
                self._step_group(group, params, grads, t, clip)
        return loss

    def _clip_factor(self, grads: list[torch.Tensor]) -> torch.Tensor | None:
        max_norm = self.defaults["max_grad_norm"]
        if not grads or max_norm is None or max_norm <= 0:
            return None
        total = kernels.l2_norm(grads)
        return torch.clamp(total / max_norm, min=1.0)

    def _step_group(
        self,
        group: dict[str, Any],
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        t: int,
        clip: torch.Tensor | None,
    ) -> None:
        beta1, beta2 = group["betas"]
        bc1, bc2 = (1 - beta1**t, 1 - beta2**t) if group["bias_correction"] else (1.0, 1.0)
        beta3 = 1 - beta1 if group["grad_averaging"] else 1.0
        lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
        trust = self.use_nvlamb or wd != 0
        ms = [self.work_state(p, "exp_avg") for p in params]
        vs = [self.work_state(p, "exp_avg_sq") for p in params]
        for b, (m, v) in buckets(params, grads, (ms, vs)):
            device = b.params[0].device
            g = b.g32 if clip is None else torch._foreach_div(b.g32, clip.to(device=device, dtype=b.dtype))
            if not self.adam_w_mode and wd != 0:
                g = torch._foreach_add(g, b.p32, alpha=wd)
            p_norms = torch._foreach_norm(b.p32) if trust else []
            torch._foreach_mul_(m, beta1)
            torch._foreach_add_(m, g, alpha=beta3)
            torch._foreach_mul_(v, beta2)
            torch._foreach_addcmul_(v, g, g, value=1 - beta2)
            denom = torch._foreach_div(v, bc2)
            torch._foreach_sqrt_(denom)
            torch._foreach_add_(denom, eps)
            u = torch._foreach_div(m, bc1)
            torch._foreach_div_(u, denom)
            if self.adam_w_mode and wd != 0:
                torch._foreach_add_(u, b.p32, alpha=wd)
            if trust:
                u_norms = torch._foreach_norm(u)
                ratios = [
                    torch.where((pn != 0) & (un != 0), lr * pn / un, torch.full_like(pn, lr))
                    for pn, un in zip(p_norms, u_norms)
                ]
                torch._foreach_mul_(u, ratios)
            else:
                torch._foreach_mul_(u, lr)
            torch._foreach_sub_(b.p32, u)
            b.write_back()
