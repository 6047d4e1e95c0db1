"""``fp16kit.optim.SGD``: torch's SGD, plus apex FusedSGD's ``wd_after_momentum`` and fp32 math on fp16/bf16 params.

Rule (torch's, with apex's option; ``inv_scale`` is 1 unless a wrapper supplies scaled grads)::

    g = g * inv_scale ;  if maximize: g = -g
    if wd and not wd_after_momentum: g = g + wd*p
    if momentum:
        buf = g if the param has no buffer yet else momentum*buf + (1-dampening)*g
        g = g + momentum*buf if nesterov else buf
    if wd and wd_after_momentum: g = g + wd*p        # decay joins the update, not the buffer
    p = p - lr*g

With fp32/fp64 params and ``wd_after_momentum=False`` the step *is* ``torch.optim.SGD.step``
(same numbers, same checkpoint). Otherwise fp16kit's own multi-tensor path runs it, in fp32 for
fp16/bf16 params (``momentum_buffer`` kept in fp32). "No buffer yet" is decided per param
(torch's rule; apex decided once per kernel launch -- see MIGRATION.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable

import torch

from ..core import kernels
from .base import ApexConventions, buckets, work_dtype

__all__ = ["SGD", "sgd_step"]


class SGD(ApexConventions, torch.optim.SGD):
    """``torch.optim.SGD`` with ``wd_after_momentum`` (apex FusedSGD) and fp32 math for low-precision params.

    ``zero_grad(set_to_none=None)`` follows ``set_grad_none``."""

    display_name = "SGD"
    sparse_error = (
        "{name} does not support sparse gradients with fp16/bf16 params or wd_after_momentum: "
        "give the sparse (fp32) params a torch.optim.SGD of their own."
    )

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        momentum: float = 0,
        dampening: float = 0,
        weight_decay: float = 0,
        nesterov: bool = False,
        wd_after_momentum: bool = False,
        *,
        maximize: bool = False,
        set_grad_none: bool = False,
    ) -> None:
        super().__init__(
            params,
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
            maximize=maximize,
        )
        self.wd_after_momentum = wd_after_momentum
        self.set_grad_none = set_grad_none

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        if not self._needs_own_path():
            # torch's step changes group 0 before it reads group 1's buffers: check them first
            self.check_state(
                (p for g in self.param_groups if g["momentum"] != 0 for p in g["params"] if p.grad is not None),
                ("momentum_buffer",),
            )
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        sgd_step(self, wd_after_momentum=self.wd_after_momentum)
        return loss

    def _needs_own_path(self) -> bool:
        if self.wd_after_momentum and any(g["weight_decay"] != 0 for g in self.param_groups):
            return True
        return any(
            p.grad is not None and p.is_floating_point() and work_dtype(p.dtype) != p.dtype
            for g in self.param_groups
            for p in g["params"]
        )

    def check_dtype(self, p: torch.Tensor) -> None:
        # the own path's working copies are real: a complex param would lose its imaginary part
        if not p.is_floating_point():
            raise RuntimeError(
                f"{self.display_name} with wd_after_momentum (or fp16/bf16 params in the same "
                f"optimizer) steps floating-point params, got {p.dtype}: give the {p.dtype} params "
                "a torch.optim.SGD of their own."
            )


def sgd_step(
    opt: SGD,
    *,
    wd_after_momentum: bool,
    grads: Sequence[Sequence[torch.Tensor | None] | None] | None = None,
    outputs: Sequence[Sequence[torch.Tensor | None] | None] | None = None,
    scale: float | torch.Tensor = 1.0,
) -> None:
    """One step of the rule over every group of ``opt`` (state: ``momentum_buffer``).

    ``grads[i]`` (one list per group, or None) replace group i's params' ``.grad``; ``outputs[i]`` receive the
    updated params (rounded to their dtype), as apex's contrib FusedSGD's ``output_params``; ``scale``: the
    grads are scaled by it (they are multiplied by ``1/scale``, the reciprocal taken in float64). Supplied
    lists are zipped with the groups and each group's params, as apex did (the shortest decides). Every group
    is checked (sparse grads, buffer shapes) before any param or buffer changes."""
    groups = opt.param_groups
    grads = [None] * len(groups) if grads is None else list(grads)
    outputs = [None] * len(groups) if outputs is None else list(outputs)
    work = [opt.with_grads(group, g, o) for group, g, o in zip(groups, grads, outputs)]
    opt.check_state(
        (p for group, (params, _, _) in zip(groups, work) if group["momentum"] != 0 for p in params),
        ("momentum_buffer",),
    )
    inv_scale: float | torch.Tensor = (
        kernels.inv_scale(scale.detach()) if isinstance(scale, torch.Tensor) else 1.0 / scale
    )
    for group, (params, found, outs) in zip(groups, work):
        if params:
            _group_step(opt, group, params, found, outs, inv_scale, wd_after_momentum)


def _group_step(
    opt: SGD,
    group: dict[str, Any],
    params: list[torch.Tensor],
    found: list[torch.Tensor],
    outs: list[torch.Tensor | None],
    inv_scale: float | torch.Tensor,
    wd_after_momentum: bool,
) -> None:
    lr, wd = group["lr"], group["weight_decay"]
    momentum, dampening, nesterov = group["momentum"], group["dampening"], group["nesterov"]
    is_new = [opt.state[p].get("momentum_buffer") is None for p in params]
    bufs = [_buffer(opt, p) for p in params] if momentum != 0 else [None] * len(params)
    for b, (buf, new, out) in buckets(params, found, (bufs, is_new, outs)):
        factor = inv_scale if not isinstance(inv_scale, torch.Tensor) else inv_scale.to(b.params[0].device, b.dtype)
        g: tuple[torch.Tensor, ...] | list[torch.Tensor] = torch._foreach_mul(
            b.g32, -factor if group.get("maximize") else factor
        )
        if wd != 0 and not wd_after_momentum:
            torch._foreach_add_(g, b.p32, alpha=wd)
        if momentum != 0:
            old = [x for x, f in zip(buf, new) if not f]
            if old:
                torch._foreach_mul_(old, momentum)
                torch._foreach_add_(old, [x for x, f in zip(g, new) if not f], alpha=1 - dampening)
            if any(new):
                kernels.copy_to_([x for x, f in zip(g, new) if f], [x for x, f in zip(buf, new) if f])
            if nesterov:
                torch._foreach_add_(g, buf, alpha=momentum)
            else:
                g = list(buf)
        if wd != 0 and wd_after_momentum:
            g = torch._foreach_add(g, b.p32, alpha=wd)
        if isinstance(lr, torch.Tensor):
            torch._foreach_sub_(b.p32, torch._foreach_mul(g, lr))
        else:
            torch._foreach_add_(b.p32, g, alpha=-lr)
        b.write_back(out)


def _buffer(opt: SGD, p: torch.Tensor) -> torch.Tensor:
    state = opt.state[p]
    dtype = work_dtype(p.dtype)
    buf = state.get("momentum_buffer")
    if buf is None:
        buf = state["momentum_buffer"] = torch.zeros_like(p, dtype=dtype)
    elif buf.dtype != dtype:
        buf = state["momentum_buffer"] = buf.to(dtype)
    return buf
