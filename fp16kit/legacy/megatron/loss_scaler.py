"""Megatron-LM v1 ``fp16/loss_scaler.py``: ``LossScaler`` and ``DynamicLossScaler``.

Megatron-LM v1 ``fp16/loss_scaler.py`` (``megatron/fp16/loss_scaler.py``): ``LossScaler`` and
``DynamicLossScaler`` with Megatron's ``min_scale``, ``delayed_shift`` hysteresis and
``consecutive_hysteresis``.

The dynamic rule is the core :class:`~fp16kit.core.scale.LossScale` (``rule="apex"``,
``hysteresis=delayed_shift``, ``consecutive_hysteresis``, ``min_scale``), in float64 on the CPU
so every scale is the Python float Megatron computed::

    update_scale(overflow):
        if overflow:
            if delayed_shift == 1 or cur_hysteresis == 1:
                cur_scale = max(cur_scale / scale_factor, min_scale)
            else:
                cur_hysteresis -= 1                 # absorb this overflow, keep the scale
            last_overflow_iter = cur_iter           # the growth window restarts either way
        else:
            if consecutive_hysteresis: cur_hysteresis = delayed_shift       # any clean step re-arms
            if (cur_iter - last_overflow_iter) % scale_window == 0:
                if not consecutive_hysteresis: cur_hysteresis = delayed_shift   # only a growth re-arms
                cur_scale *= scale_factor           # no cap
        cur_iter += 1

``cur_scale`` keeps the Python type Megatron's arithmetic gave it (it shows in messages and in
old pickles): as given at first (the int ``2**32``), a float after a growth or a reduction,
unchanged by an absorbed overflow, and ``min_scale`` itself (an int if given as one) when a
reduction is held at the floor: ``max(2.0 / 2., 2)`` is the int 2.

Differences (fixes): ``has_overflow`` checks elements (Megatron summed each tensor, so two finite
``3e38`` values counted as an overflow) and all-reduces the flag (MAX) over
``model_parallel_group`` only when one is given and ``torch.distributed`` is initialised (Megatron
always reduced over ``mpu``'s model-parallel group, as a CUDA byte tensor).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable
from typing import Any

import torch

from ...core import kernels
from ...core.scale import LossScale
from .. import loss_scaler as _era1
from ..checkpoints.records import saved_scaler

__all__ = ["LossScaler", "DynamicLossScaler", "to_python_float", "scaler_from_state"]

to_python_float = _era1.to_python_float

_DYNAMIC_ATTRS = (
    "cur_scale",
    "cur_iter",
    "last_overflow_iter",
    "scale_factor",
    "scale_window",
    "min_scale",
    "delayed_shift",
    "cur_hysteresis",
    "consecutive_hysteresis",
)
# What objects pickled by older code (Megatron 2019, apex era 1, sentiment-discovery) lack.
OLD_PICKLE_DEFAULTS = {"min_scale": 1, "delayed_shift": 1, "cur_hysteresis": 1, "consecutive_hysteresis": True}
# load_checkpoint's "__apex_class__" paths (Megatron aliased fp16.* itself when loading).
SCALER_CLASSES = {
    f"{module}.{name}": name
    for module in ("megatron.fp16.loss_scaler", "fp16.loss_scaler", "apex.fp16_utils.loss_scaler")
    for name in ("LossScaler", "DynamicLossScaler")
}


def _backward(scale: Any, output_tensor: Any, retain_graph: bool, output_tensor_grad: Any) -> None:
    """Megatron 2020: scale the output and back-propagate it; with ``output_tensor_grad`` (a
    pipeline middle stage) back-propagate those grads, which later stages already scaled."""
    if output_tensor_grad is None:
        torch.autograd.backward(kernels.scale_outputs(output_tensor, lambda _d: scale), retain_graph=retain_graph)
    else:
        torch.autograd.backward(output_tensor, grad_tensors=output_tensor_grad, retain_graph=retain_graph)


class LossScaler(_era1.LossScaler):
    """Megatron's static scaler: ``loss * scale`` before backward, never an overflow."""

    def backward(self, output_tensor: Any, retain_graph: bool = False, output_tensor_grad: Any = None) -> None:
        _backward(self.loss_scale, output_tensor, retain_graph, output_tensor_grad)

    def state_dict(self) -> dict[str, Any]:
        """The attributes Megatron pickled, as plain data."""
        return {"cur_scale": self.cur_scale}

    def __getstate__(self) -> dict[str, Any]:
        return self.state_dict()

    # __setstate__: the era-1 parent's (reads cur_scale, checked to be a finite number > 0)

    def __repr__(self) -> str:
        return f"LossScaler(cur_scale={self.cur_scale})"


class DynamicLossScaler(_era1.DynamicLossScaler):
    """Megatron's dynamic scaler; see the module docstring for the rule.

    Args:
        init_scale, scale_factor, scale_window: as apex's era-1 scaler (``scale_window`` may be
            an integral float, as Megatron's ``--loss-scale-window`` was).
        min_scale: the floor of a reduction (Megatron's ``--min-loss-scale``).
        delayed_shift: overflows it takes to reduce the scale (Megatron's ``--hysteresis``).
        consecutive_hysteresis: re-arm the hysteresis at every clean step (True) or only when
            the scale grows (False).
        model_parallel_group: ``has_overflow`` max-reduces its answer over this
            ``torch.distributed`` group (keyword only; Megatron used ``mpu``'s group).
    """

    def __init__(
        self,
        init_scale: float = 2**32,
        scale_factor: float = 2.0,
        scale_window: float = 1000,
        min_scale: float = 1,
        delayed_shift: int = 1,
        consecutive_hysteresis: bool = False,
        *,
        model_parallel_group: Any = None,
    ) -> None:
        window = _window(scale_window)
        check_number("init_scale", init_scale, positive=True)
        _era1.check_factor("scale_factor", scale_factor)
        check_number("min_scale", min_scale, positive=False)
        _check_count("delayed_shift", delayed_shift)
        # (the era-1 parent's state, built here with Megatron's extra settings)
        self._state = LossScale(
            init_scale,
            rule="apex",
            growth_factor=scale_factor,
            growth_interval=window,
            hysteresis=delayed_shift,
            consecutive_hysteresis=bool(consecutive_hysteresis),
            min_scale=min_scale,
            dtype=torch.float64,
            device="cpu",
        )
        self._cur_iter = 0
        self._int_scale = isinstance(init_scale, int)
        self._min_scale = min_scale
        self._scale_window = scale_window
        self.model_parallel_group = model_parallel_group

    # ---------------------------------------------------------------- Megatron's attributes
    @property  # type: ignore[override]  # Megatron's window is a float; apex's is an int attribute
    def scale_window(self) -> float:
        """Clean iterations between two growths, as given (Megatron allows a float); assignable."""
        return self._scale_window

    @scale_window.setter
    def scale_window(self, value: float) -> None:
        self._state.growth_interval = _window(value)
        self._scale_window = value

    @property
    def min_scale(self) -> float:
        """The floor an overflow never takes the scale below; assignable."""
        return self._min_scale

    @min_scale.setter
    def min_scale(self, value: float) -> None:
        check_number("min_scale", value, positive=False)
        self._state.min_scale = float(value)
        self._min_scale = value

    @property
    def delayed_shift(self) -> int:
        """Overflows absorbed before the scale is reduced (1: every overflow reduces); assignable."""
        return self._state.hysteresis

    @delayed_shift.setter
    def delayed_shift(self, value: int) -> None:
        _check_count("delayed_shift", value)
        self._state.hysteresis = value

    @property
    def cur_hysteresis(self) -> int:
        """Overflows left to absorb before the next reduction (Megatron's counter, never below 1); assignable."""
        # the core's tracker reaches 0 where Megatron's counter stays at 1; both then reduce
        return max(self._state.get_hysteresis_tracker(), 1)

    @cur_hysteresis.setter
    def cur_hysteresis(self, value: int) -> None:
        _check_count("cur_hysteresis", value)
        # with delayed_shift 1 Megatron reduces whatever the counter says
        self._state.set_hysteresis_tracker(value if self.delayed_shift != 1 else 1)

    @property
    def consecutive_hysteresis(self) -> bool:
        """Whether a clean iteration refills the hysteresis counter (only overflows in a row reduce); assignable."""
        return self._state.consecutive_hysteresis

    @consecutive_hysteresis.setter
    def consecutive_hysteresis(self, value: bool) -> None:
        self._state.consecutive_hysteresis = bool(value)

    # ---------------------------------------------------------------- the rule
    def update_scale(self, overflow: bool) -> None:
        """One step of Megatron's rule (the module docstring) with this iteration's ``overflow``."""
        before = self.cur_scale
        reduces = bool(overflow) and (self.delayed_shift == 1 or self.cur_hysteresis == 1)
        self._state.update(bool(overflow))
        self._cur_iter += 1
        # Python's types, as Megatron's arithmetic produced them: max(s / f, m) is m itself
        # when s / f < m (an int if m is one), else the float quotient; s * f keeps int only
        # for an int factor; an absorbed overflow leaves cur_scale as it was.
        if reduces:
            self._int_scale = isinstance(self._min_scale, int) and before / self.scale_factor < self._min_scale
        elif not overflow and self._state.get_scale() != before:
            self._int_scale = self._int_scale and isinstance(self.scale_factor, int)

    def has_overflow(self, params: Iterable[torch.Tensor]) -> bool:
        """True if any param's grad holds inf or NaN, on this rank or on any rank of the model-parallel group.

        True if any param's grad holds inf or NaN, on this rank or (with a
        ``model_parallel_group`` and ``torch.distributed`` initialised) on any rank of the group."""
        grads = [p.grad for p in params if p.grad is not None]
        device = grads[0].device if grads else torch.device("cpu")
        flags = kernels.check_finite_(grads, kernels.new_found_inf(device)) if grads else {}
        group = self.model_parallel_group
        if group is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
            flags = kernels.all_reduce_found_inf(flags, device, group)
        return bool(kernels.combine_found_inf(flags.values(), device).item())

    def backward(self, output_tensor: Any, retain_graph: bool = False, output_tensor_grad: Any = None) -> None:
        _backward(self.loss_scale, output_tensor, retain_graph, output_tensor_grad)

    # ---------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The attributes Megatron pickled, as plain data (``torch.load(weights_only=True)``)."""
        return {name: getattr(self, name) for name in _DYNAMIC_ATTRS}

    @classmethod
    def from_attributes(cls, attrs: dict[str, Any], *, model_parallel_group: Any = None) -> DynamicLossScaler:
        """A scaler with the saved attributes (defaults for those older code did not pickle).

        A scaler with the saved attributes; those older code did not pickle take
        :data:`OLD_PICKLE_DEFAULTS` (``consecutive_hysteresis=True``, unlike the constructor).
        Raises ``ValueError`` naming what is missing or invalid."""
        missing = [k for k in _DYNAMIC_ATTRS[:5] if k not in attrs]
        if missing:
            raise ValueError(f"a DynamicLossScaler needs {missing}")
        a = {**OLD_PICKLE_DEFAULTS, **attrs}
        check_number("cur_scale", a["cur_scale"], positive=True)  # (named as saved, not as init_scale)
        for key in ("cur_iter", "last_overflow_iter"):
            # their difference is counted on the device in int32 (10**400 raised OverflowError there)
            if isinstance(a[key], bool) or not isinstance(a[key], int) or not -_MAX_ITER <= a[key] <= _MAX_ITER:
                raise ValueError(f"{key} must be an int (a step count, at most 2**30 in size), got {a[key]!r:.80}")
        scaler = cls(
            a["cur_scale"],
            a["scale_factor"],
            a["scale_window"],
            a["min_scale"],
            a["delayed_shift"],
            a["consecutive_hysteresis"],
            model_parallel_group=model_parallel_group,
        )
        scaler.cur_hysteresis = a["cur_hysteresis"]
        scaler.cur_iter = a["cur_iter"]
        scaler.last_overflow_iter = a["last_overflow_iter"]
        return scaler

    def __getstate__(self) -> dict[str, Any]:
        return self.state_dict()

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(vars(DynamicLossScaler.from_attributes(state)))

    def __repr__(self) -> str:
        attrs = ", ".join(f"{k}={v!r}" for k, v in self.state_dict().items())
        return f"DynamicLossScaler({attrs})"


def scaler_from_state(saved: Any, *, model_parallel_group: Any = None) -> LossScaler | DynamicLossScaler:
    """A Megatron scaler from any saved form.

    This module's ``state_dict()``, fp16kit's plain apex-scaler state (a converted file's), the
    dict ``fp16kit.legacy.load_checkpoint`` makes of a pickled ``megatron.fp16.loss_scaler.*`` /
    ``fp16.loss_scaler.*`` / ``apex.fp16_utils.loss_scaler.*`` object (``{"__apex_class__":
    path, attributes...}``), or a live scaler object (also one fp16kit's apex alias unpickled an
    apex or Megatron scaler as). Raises ``ValueError`` for anything else."""
    saved = saved_scaler(saved) or saved
    if isinstance(saved, _era1.DynamicLossScaler):
        saved = saved.__getstate__()
    elif isinstance(saved, _era1.LossScaler):
        saved = {"cur_scale": saved.cur_scale}
    if not isinstance(saved, dict):
        raise ValueError(f"a {type(saved).__name__} is not a saved Megatron loss scaler")
    if "loss_scale" in saved and "__apex_class__" not in saved:
        saved = _from_plain_form(saved)
    path = saved.get("__apex_class__")
    attrs = {k: v for k, v in saved.items() if k != "__apex_class__"}
    if path is not None and path not in SCALER_CLASSES:
        raise ValueError(f"{path} is not a Megatron loss scaler (expected one of {sorted(SCALER_CLASSES)})")
    dynamic = SCALER_CLASSES[path] == "DynamicLossScaler" if path is not None else "cur_iter" in attrs
    if dynamic:
        return DynamicLossScaler.from_attributes(attrs, model_parallel_group=model_parallel_group)
    if "cur_scale" not in attrs:
        raise ValueError("a LossScaler needs 'cur_scale'")
    check_number("cur_scale", attrs["cur_scale"], positive=True)
    return LossScaler(attrs["cur_scale"])


def _from_plain_form(saved: dict[str, Any]) -> dict[str, Any]:
    """The attributes of the Megatron scaler equal to fp16kit's plain apex-scaler state (what
    ``fp16kit convert-checkpoint`` writes for an ``apex.fp16_utils`` scaler): the same scale,
    factor, window and floor, and the same growth phase -- ``unskipped`` clean steps since the
    last overflow (``cur_iter - last_overflow_iter - 1``)."""
    if not saved.get("dynamic", False):
        return {"cur_scale": saved["loss_scale"]}
    if saved.get("max_loss_scale") is not None:
        raise ValueError(
            "an apex.amp scaler (capped at max_loss_scale) cannot become a Megatron scaler, which has "
            "no cap: load this state into fp16kit.legacy.FP16_Optimizer instead"
        )
    unskipped = saved.get("unskipped", 0)
    return {
        "cur_scale": saved["loss_scale"],
        "cur_iter": unskipped,
        "last_overflow_iter": -1,
        "scale_factor": saved.get("scale_factor", 2.0),
        "scale_window": saved.get("scale_window", 1000),
        "min_scale": saved.get("min_loss_scale") or 1,
    }


def _window(value: Any) -> int:
    """The core's growth interval for ``scale_window``. ``float('inf')`` never grows the scale,
    as in Megatron (``n % inf == n``, never 0): an interval no count reaches."""
    if isinstance(value, float) and value == math.inf:
        return sys.maxsize
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return min(value, sys.maxsize)  # one no count reaches (10**400 is no float: math.isfinite overflows)
    if (
        isinstance(value, bool)
        or not isinstance(value, float)
        or not math.isfinite(value)
        or value < 1
        or value != int(value)
    ):
        raise ValueError(
            f"scale_window must be a whole number >= 1 (an int, or a float such as 1000.0; "
            f"float('inf') never grows the scale), got {value!r}."
        )
    return int(value)


def check_number(name: str, value: Any, *, positive: bool) -> None:
    """Raise ValueError unless ``value`` is a finite int or float > 0 (or >= 0).

    ValueError unless ``value`` is a finite int or float > 0 (``positive``) or >= 0 (an int too
    large for a float, such as 10**400, is none: no scale Megatron computed)."""
    try:
        ok = (
            not isinstance(value, bool)
            and isinstance(value, (int, float))
            and math.isfinite(value)
            and value >= 0
            and not (positive and value == 0)
        )
    except OverflowError:  # math.isfinite(10**400)
        ok = False
    if not ok:
        raise ValueError(f"{name} must be a finite number {'> 0' if positive else '>= 0'}, got {value!r:.80}.")


_MAX_COUNT = 2**31 - 1  # the core's trackers are int32 device tensors
_MAX_ITER = 2**30  # cur_iter - last_overflow_iter fits one


def _check_count(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= _MAX_COUNT:
        raise ValueError(
            f"{name} must be an int >= 1 (1 reduces the scale at every overflow; at most 2**31 - 1), got {value!r:.80}."
        )
