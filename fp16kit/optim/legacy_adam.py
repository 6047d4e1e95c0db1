"""``fp16kit.optim.LegacyAdam``: the 2018-2019 FusedAdam rule (BERT-era fp16 training).

The Adam that apex's fused-era ``FP16_Optimizer`` drove: it takes the *scaled* low-precision
grads and the norms of each group's grads, unscales and clips inside the update, and writes the
result into low-precision output params. Rule::

    step(closure=None, grads=None, output_params=None, scale=1., grad_norms=None)
    per group (grads / output_params: per-group lists, or one flat list = one group; zipped
    with the groups and each group's params as apex did: the shortest list decides):
        combined = scale
        if max_grad_norm > 0:                                   # per param group
            clip = (grad_norm/scale + 1e-6) / max_grad_norm
            combined = clip*scale if clip > 1 else scale        # on the device, no host read
        per param with a grad (the supplied one, else p.grad); state['step'] += 1 (per param):
            g = grad / combined
            m = b1*m + (1-b1)*g ;  v = b2*v + (1-b2)*g*g          # v never bias-corrected
            denom = sqrt(v + eps) if eps_inside_sqrt else sqrt(v) + eps
            step_size = lr*sqrt(1-b2**t)/(1-b1**t) if bias_correction else lr
            p = p - step_size*(m/denom + weight_decay*p)          # decay times step_size
            output param given: out = round_to_its_dtype(p)

``bias_correction=False`` is BertAdam's update. Differences from apex: a group with
``max_grad_norm > 0`` and no supplied norm has its norm computed here (apex raised TypeError);
output params of any dtype are written (apex wrote fp16 ones only: an fp32 model param
silently stopped training); a checkpoint of the current FusedAdam (one ``step`` per group)
continues its count in each param's state instead of restarting bias correction at 1.
"""

from __future__ import annotations

import numbers
import types
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from ..core import kernels
from .base import FusedStyleOptimizer, buckets, check_hyper

__all__ = ["LegacyAdam", "StepWithGrads", "legacy_adam_step", "per_group"]


class LegacyAdam(FusedStyleOptimizer):
    """The 2018-2019 FusedAdam rule (see the module docstring).

    State per param: ``step`` (int), ``exp_avg``, ``exp_avg_sq``; groups carry ``max_grad_norm`` and
    ``bias_correction``."""

    display_name = "FusedAdam"

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
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
            max_grad_norm=max_grad_norm,
        )
        self.eps_inside_sqrt = eps_inside_sqrt
        super().__init__(params, defaults, set_grad_none=set_grad_none)

    @torch.no_grad()
    def step(
        self,
        closure: Callable[[], Any] | None = None,
        grads: Any = None,
        output_params: Any = None,
        scale: float | torch.Tensor = 1.0,
        grad_norms: Sequence[Any] | None = None,
    ) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        legacy_adam_step(self, grads, output_params, scale, grad_norms, eps_inside_sqrt=self.eps_inside_sqrt)
        return loss


class StepWithGrads:
    """``step_with_grads(grads, output_params, scale, grad_norms)``: the step apex's fused-era FP16_Optimizer calls.

    FP16_Optimizer calls it on the legacy inner optimizers (apex.contrib FusedAdam and FusedSGD,
    apex.optimizers.FusedAdam). It goes through ``step`` with the legacy keywords, as apex's wrapper did,
    so that an LR scheduler or step hooks on the inner optimizer see the step. While it runs, ``_driven_by_wrapper`` is True
    (apex.optimizers.FusedAdam accepts the legacy keywords then). A flag, not a keyword of ``step``:
    subclasses that override ``step`` with apex's fixed signature (fairseq's FusedAdamV2) keep working under
    the wrapper."""

    _driven_by_wrapper = False

    def step_with_grads(
        self,
        grads: Any = None,
        output_params: Any = None,
        scale: float | torch.Tensor = 1.0,
        grad_norms: Sequence[Any] | None = None,
    ) -> None:
        self._driven_by_wrapper = True
        try:
            # a mixin: the optimizer it is mixed into (before a FusedStyleOptimizer) defines step
            self.step(  # type: ignore[attr-defined]
                None,
                grads=grads,
                output_params=output_params,
                scale=scale,
                grad_norms=grad_norms,
            )
        finally:
            self._driven_by_wrapper = False


def per_group(value: Any, n_groups: int) -> list[Any]:
    """Read ``grads`` / ``output_params`` as apex did: one list (or None) per group.

    None -> one None per group; a generator or a list whose first item is not a list -> one group; else
    per-group lists."""
    if value is None:
        return [None] * n_groups
    if isinstance(value, types.GeneratorType):
        return [list(value)]
    value = list(value)
    if value and not isinstance(value[0], (list, tuple)):
        return [value]
    return [None if v is None else list(v) for v in value]


def legacy_adam_step(
    opt: FusedStyleOptimizer,
    grads: Any = None,
    output_params: Any = None,
    scale: float | torch.Tensor = 1.0,
    grad_norms: Sequence[Any] | None = None,
    *,
    eps_inside_sqrt: bool = False,
) -> None:
    """Apply one step of the rule over ``opt``'s param groups and state.

    The optimizer's own ``step``, and apex.optimizers.FusedAdam's when driven with the legacy keywords."""
    groups = opt.param_groups
    grads_per = per_group(grads, len(groups))
    outs_per = per_group(output_params, len(groups))
    norms = [None] * len(groups) if grad_norms is None else list(grad_norms)
    work = [opt.with_grads(group, g_list, o_list) for group, g_list, o_list in zip(groups, grads_per, outs_per)]
    opt.check_state((p for params, _, _ in work for p in params), ("exp_avg", "exp_avg_sq"))
    combined = [
        _combined_scale(group, found, scale, norm, params[0].device) if params else None
        for group, (params, found, _), norm in zip(groups, work, norms)
    ]
    for group, (params, found, outs), c in zip(groups, work, combined):  # all checked: now step
        _adopt_group_step(opt, group)
        if c is not None:  # None exactly for a group without params to step
            _step_group(opt, group, params, found, outs, c, eps_inside_sqrt)


def _adopt_group_step(opt: FusedStyleOptimizer, group: dict[str, Any]) -> None:
    """A group loaded from a checkpoint that counts per group (apex's current FusedAdam): its
    params with state continue from that count (this rule counts per param); the group count
    is dropped so that it cannot go stale."""
    if "step" not in group:
        return
    count = int(group.pop("step"))
    for p in group["params"]:
        state = opt.state.get(p)
        if state and "step" not in state:
            state["step"] = count


def _step_group(
    opt: FusedStyleOptimizer,
    group: dict[str, Any],
    params: list[torch.Tensor],
    found: list[torch.Tensor],
    outs: list[Any],
    combined: torch.Tensor,
    eps_inside_sqrt: bool,
) -> None:
    beta1, beta2 = group["betas"]
    lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
    steps = []
    for p in params:
        state = opt.state[p]
        state["step"] = int(state.get("step", 0)) + 1
        t = state["step"]
        steps.append(lr * (1 - beta2**t) ** 0.5 / (1 - beta1**t) if group["bias_correction"] else lr)
    ms = [opt.work_state(p, "exp_avg") for p in params]
    vs = [opt.work_state(p, "exp_avg_sq") for p in params]
    for b, (m, v, step_sizes, out) in buckets(params, found, (ms, vs, steps, outs)):
        g = torch._foreach_div(b.g32, combined.to(device=b.params[0].device, dtype=b.dtype))
        torch._foreach_mul_(m, beta1)
        torch._foreach_add_(m, g, alpha=1 - beta1)
        torch._foreach_mul_(v, beta2)
        torch._foreach_addcmul_(v, g, g, value=1 - beta2)
        if eps_inside_sqrt:
            denom = torch._foreach_add(v, eps)
            torch._foreach_sqrt_(denom)
        else:
            denom = torch._foreach_sqrt(v)
            torch._foreach_add_(denom, eps)
        u = torch._foreach_div(m, denom)
        if wd != 0:
            torch._foreach_add_(u, b.p32, alpha=wd)
        torch._foreach_mul_(u, step_sizes)
        torch._foreach_sub_(b.p32, u)
        b.write_back(out)


def _combined_scale(
    group: dict[str, Any],
    grads: Iterable[torch.Tensor],
    scale: float | torch.Tensor,
    grad_norm: Any,
    device: torch.device,
) -> torch.Tensor:
    """``scale``, times the clip factor when the group clips: a float64 0-dim device tensor
    (a Python number is filled in on the device: no host-to-device copy)."""
    s = _on_device(scale, device)
    max_norm = group.get("max_grad_norm", 0.0)
    if max_norm is None or max_norm <= 0:
        return s
    if grad_norm is None:
        grad_norm = kernels.l2_norm(list(grads), device)
    norm = _on_device(grad_norm, device).reshape(())
    clip = (norm / s + 1e-6) / max_norm
    return torch.where(clip > 1, clip * s, s)


def _on_device(value: Any, device: torch.device) -> torch.Tensor:
    """``value`` as a float64 tensor on ``device``: a Python number filled in there, a tensor
    converted (the same value as ``torch.as_tensor(value, dtype=torch.float64)``)."""
    if isinstance(value, numbers.Real) and not isinstance(value, torch.Tensor):
        return torch.full((), float(value), dtype=torch.float64, device=device)
    return torch.as_tensor(value, dtype=torch.float64).to(device)
