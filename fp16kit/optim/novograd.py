"""``fp16kit.optim.NovoGrad``: layer-wise second moments (Ginsburg et al., 2019), apex FusedNovoGrad's rule.

torch has no NovoGrad. Rule::

    t = group['step'] += 1 ; bc1 = 1-b1**t ; bc2 = sqrt(1-b2**t)   (1, 1 without bias_correction)
    b3 = 1-b1 if grad_averaging else 1
    per param with a grad:
        n = ||g||_2 (norm_type 2) or max|g| (norm_type 0)
        first step: v = 0 if init_zero else n
        v = sqrt(b2*v**2 + (1-b2)*n**2) (norm_type 2) | b2*v + (1-b2)*n (norm_type 0)
        d = v/bc2 + eps                              # v is a norm: one number per param
        reg_inside_moment False: m = b1*m + b3*g ;            p = p - lr*((m/bc1)/d + wd*p)
        reg_inside_moment True:  m = b1*m + b3*(g/d + wd*p) ; p = p - lr*(m/bc1)

The paper's NovoGrad is ``reg_inside_moment=True, grad_averaging=False``. ``v`` lives in the
group, in apex's layout: ``group['exp_avg_sq'] = [norms of the fp16/bf16 params, norms of the
fp32 params]`` (float32 1-D tensors, one entry per param that had a grad at the first step, in
group order). That set of params is fixed by the first step: a param that gets its first grad
later raises (apex asserted). Per-param state: ``exp_avg`` (fp32 here; apex: the param dtype).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..core import kernels
from .base import FusedStyleOptimizer, buckets, check_hyper, work_dtype

__all__ = ["NovoGrad"]


class NovoGrad(FusedStyleOptimizer):
    """NovoGrad with apex FusedNovoGrad's rule and defaults (see the module docstring)."""

    display_name = "NovoGrad"

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        reg_inside_moment: bool = False,
        grad_averaging: bool = True,
        norm_type: int = 2,
        init_zero: bool = False,
        *,
        set_grad_none: bool = True,
    ) -> None:
        check_hyper(lr, betas, eps, weight_decay)
        if norm_type not in (0, 2):
            raise RuntimeError(f"{self.display_name} only support l2/inf norm now.")
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            grad_averaging=grad_averaging,
            norm_type=norm_type,
            init_zero=init_zero,
        )
        self.moment_mode = 0 if reg_inside_moment else 1  # apex's attribute
        super().__init__(params, defaults, set_grad_none=set_grad_none)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found = [self.params_with_grads(group) for group in self.param_groups]
        for group, (params, _) in zip(self.param_groups, found):  # all checks before any change
            if group["norm_type"] not in (0, 2):
                raise RuntimeError(f"{self.display_name} only support l2/inf norm now.")
            self._check_norm_layout(group, params)
        self.check_state((p for params, _ in found for p in params), ("exp_avg",))
        for group, (params, grads) in zip(self.param_groups, found):
            t = self.advance_group_step(group)
            if params:
                self._step_group(group, params, grads, t)
        return loss

    def _check_norm_layout(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        if "exp_avg_sq" not in group or not params:
            return
        low, full = _split(params)
        saved = group["exp_avg_sq"]
        if len(low) != saved[0].numel() or len(full) != saved[1].numel():
            raise RuntimeError(
                f"{self.display_name} keeps one norm per param that had a grad at its first step "
                f"({saved[0].numel()} fp16/bf16 and {saved[1].numel()} fp32 in this group); at this "
                f"step {len(low)} and {len(full)} params have grads. Give every param of the group a "
                "grad at each step (e.g. zeros), or put late params in their own param group before "
                "the first step."
            )

    def _step_group(self, group: dict[str, Any], params: list[torch.Tensor], grads: list[torch.Tensor], t: int) -> None:
        beta1, beta2 = group["betas"]
        bc1, bc2 = (1 - beta1**t, (1 - beta2**t) ** 0.5) if group["bias_correction"] else (1.0, 1.0)
        beta3 = 1 - beta1 if group["grad_averaging"] else 1.0
        lr, eps, wd, l2 = group["lr"], group["eps"], group["weight_decay"], group["norm_type"] == 2
        norms = [n.to(params[0].device) for n in _norms(grads, l2)]
        v_all = self._group_norms(group, params, norms)
        # blend the norms: v = sqrt(b2*v^2 + (1-b2)*n^2) | b2*v + (1-b2)*n
        if l2:
            v_new = (beta2 * v_all.square() + (1 - beta2) * torch.stack(norms).square()).sqrt()
        else:
            v_new = beta2 * v_all + (1 - beta2) * torch.stack(norms)
        self._store_group_norms(group, params, v_new)
        denoms = list((v_new / bc2 + eps).unbind())
        ms = [self.work_state(p, "exp_avg") for p in params]
        for b, (m, d) in buckets(params, grads, (ms, denoms)):
            d = [x.to(device=b.params[0].device, dtype=b.dtype) for x in d]
            if self.moment_mode == 0:  # regularization inside the moment
                g = torch._foreach_div(b.g32, d)
                if wd != 0:
                    torch._foreach_add_(g, b.p32, alpha=wd)
                torch._foreach_mul_(m, beta1)
                torch._foreach_add_(m, g, alpha=beta3)
                torch._foreach_add_(b.p32, m, alpha=-lr / bc1)
            else:
                torch._foreach_mul_(m, beta1)
                torch._foreach_add_(m, b.g32, alpha=beta3)
                u = torch._foreach_div(m, bc1)
                torch._foreach_div_(u, d)
                if wd != 0:
                    torch._foreach_add_(u, b.p32, alpha=wd)
                torch._foreach_add_(b.p32, u, alpha=-lr)
            b.write_back()

    def _group_norms(
        self, group: dict[str, Any], params: list[torch.Tensor], norms: list[torch.Tensor]
    ) -> torch.Tensor:
        """The blended norms v of ``params`` in param order (one float32 tensor): created at the
        first step (zeros, or the first norms), then read from apex's two-tensor layout."""
        device = norms[0].device
        if "exp_avg_sq" not in group:
            if group["init_zero"]:
                return torch.zeros(len(params), dtype=torch.float32, device=device)
            return torch.stack([n.to(dtype=torch.float32) for n in norms])
        low, full = _split(params)
        saved = group["exp_avg_sq"]
        v = torch.empty(len(params), dtype=torch.float32, device=device)
        for idx, t in zip(self._index_tensors(low, full, device), saved):
            if idx.numel():
                v[idx] = t.to(device=device, dtype=torch.float32)
        return v

    def _store_group_norms(self, group: dict[str, Any], params: list[torch.Tensor], v: torch.Tensor) -> None:
        low, full = _split(params)
        group["exp_avg_sq"] = [v[idx] for idx in self._index_tensors(low, full, v.device)]

    def _index_tensors(
        self, low: list[int], full: list[int], device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``low`` and ``full`` as int64 tensors on ``device``, made once per group layout (the
        params with a grad are the same at every step): no host-to-device copy per step. Not
        pickled (a private attribute); a copy makes its own."""
        cache = self.__dict__.setdefault("_index_cache", {})
        key = (tuple(low), tuple(full), device)
        found = cache.get(key)
        if found is None:
            found = cache[key] = (
                torch.tensor(low, dtype=torch.long, device=device),
                torch.tensor(full, dtype=torch.long, device=device),
            )
        return found


def _split(params: list[torch.Tensor]) -> tuple[list[int], list[int]]:
    """Indices of the low-precision params and of the others (apex's two norm tensors)."""
    low = [i for i, p in enumerate(params) if work_dtype(p.dtype) != p.dtype]
    taken = set(low)
    return low, [i for i in range(len(params)) if i not in taken]


def _norms(grads: list[torch.Tensor], l2: bool) -> list[torch.Tensor]:
    """Each grad's L2 norm (multi-tensor, fp32 accumulation) or max-abs, as float32."""
    if l2:
        return [n.float() for n in kernels.l2_norms(grads)]
    return [n.float() for n in kernels.norms(grads, float("inf"))]
