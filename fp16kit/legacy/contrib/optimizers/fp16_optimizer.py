"""apex.contrib.optimizers.fp16_optimizer (and apex.optimizers.fp16_optimizer): the fused-era ``FP16_Optimizer``.

That BERT-era scripts (HF pytorch-pretrained-BERT, NVIDIA BERT, SpanBERT, OpenNMT-py
``-optim fusedadam``) wrap around the legacy ``FusedAdam``::

    optimizer = FusedAdam(groups, lr, bias_correction=False, max_grad_norm=1.0)
    optimizer = FP16_Optimizer(optimizer, dynamic_loss_scale=True)   # or static_loss_scale=S
    optimizer.backward(loss)      # (loss.float() * cur_scale).backward()
    optimizer.step()              # per-group norms of the scaled fp16 grads; overflow -> skip;
                                  # else the inner step unscales, clips per group, updates the
                                  # fp32 masters and writes the fp16 params
    optimizer.zero_grad()         # model grads to None

Scale rule, once per ``step()`` (apex's era-1 modulo rule = ``LossScale(rule="apex")`` with
scale_window 1000, factor 2, floor 1, no cap, kept on the device)::

    if dynamic:
        if skip: log "\\nGrad overflow on iteration", cur_iter; "Using dynamic loss scale of", cur_scale
                 cur_scale = max(cur_scale / scale_factor, 1); last_overflow_iter = cur_iter
        elif (cur_iter - last_overflow_iter) % scale_window == 0: cur_scale *= scale_factor
    elif skip: log "\\nGrad overflow on iteration", cur_iter; "Using static loss scale of", cur_scale
    cur_iter += 1

Overflow is decided from the norms (one host read of one flag per step, as apex's ``float``
of the norm). Masters: one fp32 clone per param (apex's 2019-12+ layout); checkpoints of the
flat layout (``fp32_groups_flat``) load too. Differences from apex (MIGRATION.md): fp32 and
bf16 model params train (apex never copied an fp32 master back); params without a grad are
skipped (apex crashed); messages go to the ``fp16kit.apex`` logger; ``load_state_dict`` checks the
structure first and refuses mismatches instead of truncating.
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable
from typing import Any

import torch

from ....core import kernels
from ....core.master import MasterParams
from ....core.scale import LossScale
from ....master_weights.wrapping import WrappingOptimizer
from ..._messages import apex_logger
from ...checkpoints.errors import apex_object_refused
from ...loss_scaler import check_scale
from ._checkpoint import check_state_dict, dynamic_settings, masters_from_state, optimizer_state_from

__all__ = ["FP16_Optimizer"]


class FP16_Optimizer(WrappingOptimizer):
    """The fused-era FP16_Optimizer (see the module docstring and docs/apex-others.md §1).

    Args:
        init_optimizer: ``fp16kit.legacy.optimizers.FusedAdam``, or the contrib ``FusedAdam`` /
            ``FusedSGD``: an optimizer with ``step_with_grads(grads, output_params, scale,
            grad_norms)``, built on the model's params.
        static_loss_scale: the scale when not dynamic.
        dynamic_loss_scale: apex's era-1 dynamic rule (start 2**16, window 1000).
        dynamic_loss_args: must be None (apex: ``SystemError``).
        verbose: log the dynamic-scale overflow lines (static ones are always logged, as apex).
    """

    def __init__(
        self,
        init_optimizer: torch.optim.Optimizer,
        static_loss_scale: float = 1.0,
        dynamic_loss_scale: bool = False,
        dynamic_loss_args: Any = None,
        verbose: bool = True,
    ) -> None:
        if dynamic_loss_args is not None:
            raise SystemError("Do not support dynamic loss scale args for now.")
        if not dynamic_loss_scale:
            _check_static_scale(static_loss_scale)
        if not callable(getattr(init_optimizer, "step_with_grads", None)):
            raise TypeError(
                "The fused-era FP16_Optimizer drives fp16kit.legacy.optimizers.FusedAdam or "
                "fp16kit.legacy.contrib.optimizers.FusedAdam / FusedSGD (they take the scaled fp16 "
                f"grads); got {type(init_optimizer).__name__}. For another optimizer use "
                "fp16kit.legacy.FP16_Optimizer (apex.fp16_utils) or fp16kit.MixedPrecisionOptimizer."
            )
        for i, group in enumerate(init_optimizer.param_groups):
            for j, p in enumerate(group["params"]):
                if not p.is_floating_point():
                    raise TypeError(f"FP16_Optimizer: param {j} of group {i} is {p.dtype}, not floating point.")
        super().__init__(init_optimizer)
        self.verbose = verbose
        self.fp16_groups: list[list[torch.Tensor]] = [list(g["params"]) for g in init_optimizer.param_groups]
        self._masters = [MasterParams(params) for params in self.fp16_groups]
        self.fp32_groups: list[list[torch.Tensor]] = [m.masters for m in self._masters]
        for group, masters in zip(init_optimizer.param_groups, self.fp32_groups):
            group["params"] = masters
        self.cur_iter = 0
        self.overflow = False
        self._device = next((p.device for g in self.fp16_groups for p in g), torch.device("cpu"))
        self._set_mode(dynamic_loss_scale, 2.0**16 if dynamic_loss_scale else static_loss_scale)

    def _set_mode(self, dynamic: bool, scale: float) -> None:
        self.dynamic_loss_scale = dynamic
        self._static_scale = float(scale)
        self._scale: LossScale | None = None
        if dynamic:
            self._scale = LossScale(
                scale, rule="apex", growth_factor=2.0, growth_interval=1000, dtype=torch.float64, device=self._device
            )

    # ------------------------------------------------------------------ apex's attributes
    @property
    def cur_scale(self) -> float:
        """The loss scale now; assignable (a finite number > 0)."""
        return self._scale.get_scale() if self._scale is not None else self._static_scale

    @cur_scale.setter
    def cur_scale(self, value: float) -> None:
        check_scale("cur_scale", value)  # the update divides the grads by it
        if self._scale is not None:
            self._scale.set_scale(float(value))
        else:
            self._static_scale = float(value)

    @property
    def loss_scale(self) -> float:
        """Read-only alias of ``cur_scale`` (the name apex.fp16_utils used)."""
        return self.cur_scale

    def _dynamic(self, name: str) -> LossScale:
        if self._scale is None:
            raise AttributeError(f"'FP16_Optimizer' has no attribute '{name}' with a static loss scale")
        return self._scale

    @property
    def last_overflow_iter(self) -> int:
        """The iteration of the last overflow (dynamic scale only); assignable."""
        # the apex rule's growth tracker counts the clean steps since the last overflow
        return self.cur_iter - 1 - self._dynamic("last_overflow_iter").get_growth_tracker()

    @last_overflow_iter.setter
    def last_overflow_iter(self, value: int) -> None:
        self._dynamic("last_overflow_iter").set_growth_tracker(self.cur_iter - 1 - int(value))

    @property
    def scale_factor(self) -> float:
        """The dynamic scale's factor (divides on overflow, multiplies after a clean window); assignable."""
        return self._dynamic("scale_factor").growth_factor

    @scale_factor.setter
    def scale_factor(self, value: float) -> None:
        self._dynamic("scale_factor").growth_factor = value

    @property
    def scale_window(self) -> int:
        """Clean iterations between two growths of the dynamic scale; assignable."""
        return self._dynamic("scale_window").growth_interval

    @scale_window.setter
    def scale_window(self, value: int) -> None:
        self._dynamic("scale_window").growth_interval = int(value)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise RuntimeError(
            "The fused-era FP16_Optimizer makes its fp32 masters when it is built: add the param "
            "group to the inner optimizer before wrapping it (apex had no add_param_group either)."
        )

    # ------------------------------------------------------------------ the loop
    def zero_grad(self, set_grads_to_None: bool = True, *, set_to_none: bool | None = None) -> None:  # type: ignore[override]
        """Clear the fp16 model grads (to None by default, unlike apex.fp16_utils).

        ``set_to_none`` is torch's name for ``set_grads_to_None`` and wins when given."""
        if set_to_none is not None:
            set_grads_to_None = set_to_none
        kernels.clear_grads_([p for g in self.fp16_groups for p in g], set_to_none=set_grads_to_None)

    def backward(self, loss: torch.Tensor) -> None:
        """``(loss.float() * cur_scale).backward()``."""
        if self._scale is not None:
            self._scale.materialize(self._device)  # no-op unless unpickled
            live = self._scale.scale
            assert live is not None  # materialized just above
            scaled = kernels.scale_outputs(loss.float(), lambda device: live)
        else:
            scaled = kernels.scale_outputs(loss.float(), lambda device: self._static_scale)
        scaled.backward()

    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        """One step (the closure is ignored, as apex); returns None. See the module docstring."""
        grads = [[p.grad for p in group] for group in self.fp16_groups]
        _refuse_sparse(grads)
        norms = [kernels.l2_norm([g for g in gs if g is not None], self._device) for gs in grads]
        found = kernels.combine_found_inf(
            kernels.check_finite_(norms, kernels.new_found_inf(self._device)).values(), self._device
        )
        self.overflow = bool(found.item())  # the one host read per step: skip or step
        if self._scale is not None:
            self._scale.materialize(self._device)  # no-op unless unpickled
        if not self.overflow:
            scale = self._scale.snapshot() if self._scale is not None else self._static_scale
            self.optimizer.step_with_grads(  # type: ignore[attr-defined]
                grads=grads, output_params=self.fp16_groups, scale=scale, grad_norms=norms
            )
        self._update_scale(self.overflow, found)

    def _update_scale(self, skip: bool, found: torch.Tensor) -> None:
        if skip and (self.verbose or self._scale is None):
            kind = "dynamic" if self._scale is not None else "static"
            apex_logger.warning("\nGrad overflow on iteration %s", self.cur_iter)
            apex_logger.warning("Using %s loss scale of %s", kind, self.cur_scale)
        if self._scale is not None:
            self._scale.update(found)
        self.cur_iter += 1

    # ------------------------------------------------------------------ pickling, checkpoints
    def __getstate__(self) -> dict[str, Any]:
        # apex's wrapper was a plain object: pickling (and deepcopy) keep all of it, but for
        # the functions patched onto the instance (an LR scheduler's `step` wrapper is bound to
        # this object: a copy keeping it would step the original), as torch's optimizers do
        patched = (types.FunctionType, types.MethodType)
        return {k: v for k, v in self.__dict__.items() if not isinstance(v, patched)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "_masters" not in state:  # apex's own wrapper, unpickled under fp16kit's apex alias
            raise apex_object_refused(
                "apex.contrib.optimizers.FP16_Optimizer",
                "optimizer",
                "fp16kit's FP16_Optimizer keeps its fp32 masters and loss scale in objects of its own, "
                "which apex's pickle does not hold",
            )
        self.__dict__.update(state)

    def state_dict(self) -> dict[str, Any]:
        sd: dict[str, Any] = {
            "dynamic_loss_scale": self.dynamic_loss_scale,
            "cur_scale": self.cur_scale,
            "cur_iter": self.cur_iter,
        }
        if self._scale is not None:
            sd["last_overflow_iter"] = self.last_overflow_iter
            sd["scale_factor"] = self.scale_factor
            sd["scale_window"] = self.scale_window
        sd["optimizer_state_dict"] = self.optimizer.state_dict()
        sd["fp32_groups"] = [[m.detach() for m in group] for group in self.fp32_groups]
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (or apex's, flat or per-param masters).

        Everything is checked before anything changes; masters are copied, model params left
        alone (apex)."""
        check_state_dict(state_dict, self.fp16_groups)
        pairs = masters_from_state(state_dict, self.fp32_groups)
        self.optimizer.load_state_dict(optimizer_state_from(state_dict, self.fp16_groups))
        kernels.copy_pairs_(pairs)
        self._set_mode(bool(state_dict["dynamic_loss_scale"]), float(state_dict["cur_scale"]))
        self.cur_iter = int(state_dict["cur_iter"])
        if self._scale is not None:
            self.scale_factor, self.scale_window, self.last_overflow_iter = dynamic_settings(state_dict)


def _refuse_sparse(grads: list[list[torch.Tensor | None]]) -> None:
    # apex crashed inside its norm kernel; say which param and what to do instead
    for i, group in enumerate(grads):
        for j, g in enumerate(group):
            if g is not None and g.is_sparse:
                raise RuntimeError(
                    f"FP16_Optimizer: param {j} of group {i} has a sparse gradient; the fused-era "
                    "FP16_Optimizer and its optimizers take dense gradients. Build the embedding "
                    "with sparse=False, or give the sparse params an optimizer of their own "
                    "(e.g. torch.optim.SparseAdam)."
                )


def _check_static_scale(value: Any) -> None:
    # apex divided the grads by it inside the update: 0 made every param NaN, silently
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    if not ok:
        raise ValueError(
            f"FP16_Optimizer: static_loss_scale must be a finite number > 0, got {value!r}. Pass "
            "the static scale (e.g. 128.0), or dynamic_loss_scale=True."
        )
