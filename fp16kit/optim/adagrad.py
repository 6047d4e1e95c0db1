"""``fp16kit.optim.Adagrad``: Adagrad with apex FusedAdagrad's W mode (decoupled decay).

Rule (per param with a grad; state ``sum`` only, fp32 for fp16/bf16 params)::

    L2 mode (adagrad_w_mode=False):  g = g + wd*p ; s = s + g*g ; p = p - lr*g/(sqrt(s) + eps)
    W mode  (adagrad_w_mode=True):   s = s + g*g ; p = p - lr*(g/(sqrt(s) + eps) + wd*p)

L2 mode is ``torch.optim.Adagrad(lr, lr_decay=0, weight_decay=wd, initial_accumulator_value=0,
eps=1e-10)`` (torch also keeps a ``step``); W mode has no torch equivalent.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .base import FusedStyleOptimizer, buckets, check_hyper

__all__ = ["Adagrad"]


class Adagrad(FusedStyleOptimizer):
    """Adagrad, L2 or decoupled ("W") weight decay (see the module docstring)."""

    display_name = "Adagrad"

    def __init__(
        self,
        params: Any,
        lr: float = 1e-2,
        eps: float = 1e-10,
        weight_decay: float = 0.0,
        adagrad_w_mode: bool = False,
        *,
        set_grad_none: bool = True,
    ) -> None:
        check_hyper(lr, None, eps, weight_decay)
        super().__init__(params, dict(lr=lr, eps=eps, weight_decay=weight_decay), set_grad_none=set_grad_none)
        self.adagrad_w_mode = adagrad_w_mode

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found = [self.params_with_grads(group) for group in self.param_groups]  # checks first
        self.check_state((p for params, _ in found for p in params), ("sum",))
        for group, (params, grads) in zip(self.param_groups, found):
            if not params:
                continue
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            sums = [self.work_state(p, "sum") for p in params]
            for b, (s,) in buckets(params, grads, (sums,)):
                g: tuple[torch.Tensor, ...] | list[torch.Tensor] = b.g32
                if not self.adagrad_w_mode and wd != 0:
                    g = torch._foreach_add(g, b.p32, alpha=wd)
                torch._foreach_addcmul_(s, g, g)
                denom = torch._foreach_sqrt(s)
                torch._foreach_add_(denom, eps)
                u = torch._foreach_div(g, denom)
                if self.adagrad_w_mode and wd != 0:
                    torch._foreach_add_(u, b.p32, alpha=wd)
                torch._foreach_add_(b.p32, u, alpha=-lr)
                b.write_back()
        return loss
