"""apex.fp16_utils.loss_scaler: the exported ``LossScaler`` and ``DynamicLossScaler`` (era 1).

Same names, attributes and methods as apex. The dynamic rule is fp16kit's
:class:`~fp16kit.core.scale.LossScale` with ``rule="apex"``, kept in float64 on the CPU so
that every scale equals what apex computed in Python floats::

    update_scale(overflow):
        if overflow:
            cur_scale = max(cur_scale / scale_factor, 1)
            last_overflow_iter = cur_iter
        elif (cur_iter - last_overflow_iter) % scale_window == 0:
            cur_scale *= scale_factor
        cur_iter += 1

Differences from apex (fixes): ``_has_inf_or_nan`` works on an instance too (apex's lacked
``self``), and overflow is checked element by element (apex summed each tensor, so two finite
``3e38`` values counted as an overflow). ``cur_scale`` keeps apex's Python type: the int it was
given, a float after the first change, the int 1 at the floor.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ..core import kernels
from ..core.scale import LossScale

__all__ = ["LossScaler", "DynamicLossScaler", "to_python_float"]


def to_python_float(t: Any) -> float:
    """``t.item()`` for a tensor; a Python number comes back as a float."""
    if hasattr(t, "item"):
        return t.item()
    return float(t)


def _any_non_finite(tensors: Iterable[torch.Tensor]) -> bool:
    tensors = list(tensors)
    if not tensors:
        return False
    device = tensors[0].device
    flags = kernels.check_finite_(tensors, kernels.new_found_inf(device))
    return bool(kernels.combine_found_inf(flags.values(), device).item())


def _scale_grads_in(loss_scale: Any, grad_in: tuple) -> tuple:
    return tuple(
        None if g is None else kernels.scale_outputs(g, lambda _d: loss_scale) for g in grad_in
    )


class LossScaler:
    """Static loss scale: ``loss * scale`` before backward, never an overflow check."""

    def __init__(self, scale: float = 1) -> None:
        self.cur_scale = scale

    def has_overflow(self, params: Iterable[torch.Tensor]) -> bool:
        return False

    @staticmethod
    def _has_inf_or_nan(x: torch.Tensor) -> bool:
        return False

    def update_scale(self, overflow: bool) -> None:
        pass

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    def scale_gradient(self, module: Any, grad_in: tuple, grad_out: tuple) -> tuple:
        return _scale_grads_in(self.loss_scale, grad_in)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        scaled_loss = kernels.scale_outputs(loss, lambda _d: self.loss_scale)
        scaled_loss.backward(retain_graph=retain_graph)


class DynamicLossScaler:
    """apex's dynamic loss scaler (era 1): halve on overflow (floor 1), double every
    ``scale_window`` clean iterations since the last overflow (no cap)."""

    def __init__(self, init_scale: float = 2**32, scale_factor: float = 2.0, scale_window: int = 1000) -> None:
        self._state = LossScale(
            init_scale,
            rule="apex",
            growth_factor=scale_factor,
            growth_interval=scale_window,
            dtype=torch.float64,
            device="cpu",
        )
        self._cur_iter = 0
        self._int_scale = isinstance(init_scale, int)

    # apex's attributes, views of the core state
    @property
    def cur_scale(self) -> float:
        value = self._state.get_scale()
        return int(value) if self._int_scale else value

    @cur_scale.setter
    def cur_scale(self, value: float) -> None:
        self._state.set_scale(float(value))
        self._int_scale = isinstance(value, int)

    @property
    def cur_iter(self) -> int:
        return self._cur_iter

    @cur_iter.setter
    def cur_iter(self, value: int) -> None:
        last = self.last_overflow_iter  # apex kept it as it was
        self._cur_iter = int(value)
        self.last_overflow_iter = last

    @property
    def last_overflow_iter(self) -> int:
        # the rule's tracker counts the iterations since the last overflow
        return self._cur_iter - 1 - self._state.get_growth_tracker()

    @last_overflow_iter.setter
    def last_overflow_iter(self, value: int) -> None:
        self._state.set_growth_tracker(self._cur_iter - 1 - int(value))

    @property
    def scale_factor(self) -> float:
        return self._state.growth_factor

    @scale_factor.setter
    def scale_factor(self, value: float) -> None:
        self._state.growth_factor = value

    @property
    def scale_window(self) -> int:
        return self._state.growth_interval

    @scale_window.setter
    def scale_window(self, value: int) -> None:
        self._state.growth_interval = value

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    def has_overflow(self, params: Iterable[torch.Tensor]) -> bool:
        """True if any param's grad holds inf or NaN (a host read)."""
        return _any_non_finite(p.grad for p in params if p.grad is not None)

    @staticmethod
    def _has_inf_or_nan(x: torch.Tensor) -> bool:
        """True if ``x`` holds inf or NaN. Works on the class and on an instance."""
        return _any_non_finite([x.detach().clone()])

    def update_scale(self, overflow: bool) -> None:
        before = self._state.get_scale()
        self._state.update(bool(overflow))
        self._cur_iter += 1
        # Python's types, as apex's arithmetic produced them: max(s / f, 1) is the int 1 when
        # s / f < 1 and a float otherwise; s * f keeps int only for an int factor.
        if overflow:
            self._int_scale = before / self.scale_factor < 1
        elif self._state.get_scale() != before:
            self._int_scale = self._int_scale and isinstance(self.scale_factor, int)

    def scale_gradient(self, module: Any, grad_in: tuple, grad_out: tuple) -> tuple:
        return _scale_grads_in(self.loss_scale, grad_in)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        scaled_loss = kernels.scale_outputs(loss, lambda _d: self.loss_scale)
        scaled_loss.backward(retain_graph=retain_graph)

    def __getstate__(self) -> dict[str, Any]:
        # apex pickled these attributes; keep the pickle plain and readable.
        return {
            "cur_scale": self.cur_scale,
            "cur_iter": self.cur_iter,
            "last_overflow_iter": self.last_overflow_iter,
            "scale_factor": self.scale_factor,
            "scale_window": self.scale_window,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["cur_scale"], state["scale_factor"], state["scale_window"])  # type: ignore[misc]
        self.cur_iter = state["cur_iter"]
        self.last_overflow_iter = state["last_overflow_iter"]

    def __repr__(self) -> str:
        return (
            f"DynamicLossScaler(cur_scale={self.cur_scale}, cur_iter={self.cur_iter}, "
            f"last_overflow_iter={self.last_overflow_iter}, scale_factor={self.scale_factor}, "
            f"scale_window={self.scale_window})"
        )
