"""LARC: layer-wise adaptive rate control around any optimizer (You et al. 2017).

apex.parallel.LARC, docs/apex-others.md §4.4.

    step():
        for each group:
            wd = group.get("weight_decay", 0); group["weight_decay"] = 0   # LARC applies it
            for each param p with a grad g:
                pn, gn = ||p||, ||g||
                if pn != 0 and gn != 0:
                    a = trust_coefficient * pn / (gn + pn * wd + eps)
                    if clip: a = min(a / group["lr"], 1)   # lr * a == min(local lr, lr)
                    g = (g + wd * p) * a                    # else: g as it was, no decay
        inner.step(); every group's weight_decay restored (also if the step raised)
    sparse grads: ValueError before anything changes

Each value is computed with the same torch ops as apex's, in the param's dtype, so the numbers
are apex's bit for bit; the ``pn != 0 and gn != 0`` test and the clip run on the device
(``torch.where``/``clamp``), so a step never waits for the device.

LARC is a view of the optimizer it wraps (``larc.optim``): ``param_groups``, ``state``,
``defaults``, ``state_dict``, ``load_state_dict``, ``zero_grad`` and ``add_param_group`` are
that optimizer's. FIX: it is also a ``torch.optim.Optimizer`` (apex's was a plain object, so
``StepLR(larc)`` raised ``TypeError: LARC is not an Optimizer``): LR schedulers, step hooks,
``isinstance`` checks and ``MixedPrecisionOptimizer(LARC(opt))`` work on it; a scheduler built
on ``larc`` or on ``larc.optim`` changes the same lr.
"""

from __future__ import annotations

import pickle
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from ..master_weights.wrapping import WrappingOptimizer

__all__ = ["LARC"]

# apex's LARC.__getstate__ returned the wrapped optimizer's (torch's defaults / state /
# param_groups): torch.save(larc) wrote neither that optimizer's class nor LARC's settings, and
# apex's own __setstate__ failed on it (it forwards to self.optim, which the new object lacks)
_APEX_PICKLE = (
    "The file holds a whole apex.parallel.LARC.LARC object apex pickled (torch.save(optimizer), not "
    "optimizer.state_dict()); apex's LARC pickled only the param groups and state of the optimizer it "
    "wrapped, not which optimizer that was nor trust_coefficient, clip and eps, so it cannot be rebuilt "
    "(apex could not load it either). Build it in the script as the run did, "
    "LARC(torch.optim.SGD(model.parameters(), lr=...), trust_coefficient=..., clip=..., eps=...), and "
    "save larc.state_dict() from now on (larc.load_state_dict reads it back)."
)
_HOOKS = (
    "_optimizer_step_pre_hooks",
    "_optimizer_step_post_hooks",
    "_optimizer_state_dict_pre_hooks",
    "_optimizer_state_dict_post_hooks",
    "_optimizer_load_state_dict_pre_hooks",
    "_optimizer_load_state_dict_post_hooks",
)


class LARC(WrappingOptimizer):
    """``LARC(optimizer, trust_coefficient=0.02, clip=True, eps=1e-8)``: see the module docstring."""

    def __init__(
        self, optimizer: torch.optim.Optimizer, trust_coefficient: float = 0.02, clip: bool = True, eps: float = 1e-8
    ) -> None:
        if not hasattr(optimizer, "param_groups") or not callable(getattr(optimizer, "step", None)):
            raise TypeError(
                f"LARC wraps an optimizer (an object with param_groups and step()), got "
                f"{type(optimizer).__name__}; pass e.g. torch.optim.SGD(model.parameters(), lr=0.1)."
            )
        from ..master_weights.optimizer import MixedPrecisionOptimizer

        if isinstance(optimizer, MixedPrecisionOptimizer):
            # its fp32 master grads are made inside its own step(), after LARC would have run:
            # LARC would rescale nothing and the step would be plain SGD, silently
            raise TypeError(
                "LARC must wrap the optimizer that MixedPrecisionOptimizer wraps, not the other way: "
                "MixedPrecisionOptimizer(LARC(optimizer)) (LARC then rescales the fp32 master grads)."
            )
        super().__init__(optimizer)
        self.trust_coefficient = trust_coefficient
        self.eps = eps
        self.clip = clip

    @property
    def optim(self) -> Any:
        """The wrapped optimizer (apex's attribute name)."""
        return self.optimizer

    @optim.setter
    def optim(self, value: Any) -> None:
        self.optimizer = value

    def __repr__(self) -> str:
        return repr(self.optim)

    def __getstate__(self) -> dict[str, Any]:
        # torch's Optimizer pickles only defaults/state/param_groups, which are the wrapped
        # optimizer's here: keep the wrapper's own attributes, drop the hooks (as torch does)
        # (and a "step" an LR scheduler or amp set on the instance, as torch's pickle loses it)
        return {k: v for k, v in self.__dict__.items() if k not in _HOOKS and k != "step"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "optimizer" not in state and "param_groups" in state:
            raise pickle.UnpicklingError(_APEX_PICKLE)
        self.__dict__.update(state)
        for name in _HOOKS:
            setattr(self, name, OrderedDict())

    def state_dict(self) -> dict[str, Any]:
        return self.optim.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optim.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optim.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optim.add_param_group(param_group)

    def _check_dense(self) -> None:
        for gi, group in enumerate(self.optim.param_groups):
            for p in group["params"]:
                if p.grad is not None and p.grad.is_sparse:
                    raise ValueError(
                        f"LARC needs dense gradients (a norm and weight decay per param); param group {gi} "
                        f"has a sparse gradient of shape {tuple(p.grad.shape)}: build nn.Embedding/EmbeddingBag "
                        "with sparse=False, or keep that parameter in an optimizer outside LARC."
                    )

    @torch.no_grad()
    def _scale_grads(self, weight_decays: list[Any]) -> None:
        for group in self.optim.param_groups:
            wd = group.get("weight_decay", 0)
            weight_decays.append(wd)
            group["weight_decay"] = 0
            for p in group["params"]:
                if p.grad is None:
                    continue
                p.grad.copy_(self._larc_grad(p, p.grad, wd, group["lr"]))

    def _larc_grad(self, p: torch.Tensor, g: torch.Tensor, wd: float, lr: float) -> torch.Tensor:
        param_norm = torch.norm(p)
        grad_norm = torch.norm(g)
        adaptive_lr = self.trust_coefficient * param_norm / (grad_norm + param_norm * wd + self.eps)
        if self.clip:
            adaptive_lr = torch.clamp(adaptive_lr / lr, max=1)
        scaled = (g + wd * p) * adaptive_lr
        return torch.where((param_norm != 0) & (grad_norm != 0), scaled, g)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Rescale every grad (module docstring), then step the wrapped optimizer.

        A ``closure`` (not in apex) is evaluated first, with grad enabled, and its loss returned."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_dense()  # before anything changes
        weight_decays: list[Any] = []
        try:
            self._scale_grads(weight_decays)
            self.optim.step()
        finally:
            for group, wd in zip(self.optim.param_groups, weight_decays):
                group["weight_decay"] = wd
        return loss
