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
given, a float after the first change, the int 1 at the floor. Settings that cannot train are
refused at the call, and when written, with ValueError naming the setting and its range: a scale
that is not a finite number > 0 (apex trained a scale of 0, NaN or inf into NaN weights), a
``scale_factor`` <= 1 (it never backs off: every step is skipped once the scale overflows; torch's
GradScaler wants its growth factor > 1 too), a ``scale_window`` that is not an int >= 1 (apex's
modulo raised ZeroDivisionError at 0).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from ..core import kernels
from ..core.floor import FLOOR_POLICIES
from ..core.interrupts import hold_interrupts
from ..core.scale import LossScale
from ..core.scale_rules import rule_named
from .checkpoints.records import CLASS_KEY, FP16KIT_SCALER_CLASSES

__all__ = ["LossScaler", "DynamicLossScaler", "to_python_float", "SavedScalerRefused"]


# ---------------------------------------------------------------- reading pickled attributes
# A scaler's __setstate__ gets whatever the file holds (torch.load's weights-only unpickler lets
# these classes through under fp16kit's apex alias): each attribute read is checked to be what
# apex pickled there, and nothing else is read.
def _real(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and abs(v) < 2**63


PICKLED_KINDS = {
    "scale": ("a finite number > 0", lambda v: _is_scale(v)),
    "factor": ("a finite number > 1", lambda v: _is_factor(v)),
    "cap": ("a number > 0 (inf or None: no cap)", lambda v: v is None or (_real(v) and v > 0)),  # NaN > 0 is False
    "floor": (
        "a finite number >= 0 (0 or None: no floor)",
        lambda v: v is None or (_real(v) and math.isfinite(v) and v >= 0),
    ),
    "window": ("a whole number >= 1", lambda v: _is_window(v)),
    "count": ("an int >= 0", lambda v: _int(v) and v >= 0),
    "iteration": ("an int", _int),
    "flag": ("True or False", lambda v: isinstance(v, bool)),
    "tensor": ("a tensor (apex's int overflow buffer) or None", lambda v: v is None or isinstance(v, torch.Tensor)),
    "floor policy": (f"one of {sorted(FLOOR_POLICIES)}", lambda v: isinstance(v, str) and v in FLOOR_POLICIES),
}
_REQUIRED = object()


def pickled_as(obj: Any) -> str:
    """The apex (or Megatron) class ``obj``'s class stands for, for messages."""
    cls = type(obj)
    return FP16KIT_SCALER_CLASSES.get(f"{cls.__module__}.{cls.__qualname__}", cls.__qualname__)


def pickled_attributes(obj: Any, state: Any, required: Iterable[str]) -> dict[str, Any]:
    """Return ``state`` as the attribute dict apex pickled, checked to hold ``required``.

    ``state`` (what pickle hands ``obj.__setstate__``) as the attribute dict apex pickled, with
    ``required`` in it; ValueError naming what is wrong otherwise."""
    if not isinstance(state, dict):
        raise ValueError(f"{_not_apex(obj)}: it holds a {type(state).__name__}, not a dict of attributes. {_LOOK}")
    missing = [k for k in required if k not in state]
    if missing:
        raise ValueError(
            f"the {pickled_as(obj)} in this file was pickled without {missing} (it holds "
            f"{sorted(map(str, state))}): it is not one apex wrote. {_LOOK}"
        )
    return state


def pickled(obj: Any, state: dict[str, Any], name: str, kind: str, *, default: Any = _REQUIRED) -> Any:
    """Return ``state[name]``, checked to be of ``kind``.

    ``state[name]`` (``default`` when absent, if given), checked to be of ``kind`` (a key of
    :data:`PICKLED_KINDS`)."""
    if name not in state and default is not _REQUIRED:
        return default
    _check_pickled(pickled_as(obj), name, state[name], kind)
    return state[name]


class SavedScalerRefused(ValueError):
    """A saved apex scaler whose attribute ``name`` holds a value apex never wrote there.

    A saved apex scaler (a pickled object, or the record ``load_checkpoint`` returns) whose
    attribute ``name`` holds ``value``, not ``what`` apex wrote there; ``path`` is the apex class.
    A ValueError: torch's weights-only reader rewrites a ``pickle.UnpicklingError`` raised while it
    unpickles into its own advice (``add_safe_globals``), and passes this through as it is."""

    def __init__(self, path: str, name: str, value: Any, what: str) -> None:
        super().__init__(f"{_not_apex(path)}: its {name} is {value!r:.80}, not {what}. {_LOOK}")
        self.path, self.name, self.value, self.what = path, name, value, what


def _check_pickled(path: str, name: str, value: Any, kind: str) -> None:
    what, ok = PICKLED_KINDS[kind]
    try:
        passes = ok(value)
    except OverflowError:  # an int too large for a float (math.isfinite(10**400))
        passes = False
    if not passes:
        raise SavedScalerRefused(path, name, value, what)


def _not_apex(obj: Any) -> str:
    return f"the {obj if isinstance(obj, str) else pickled_as(obj)} in this file is not one apex pickled"


# The attributes each apex scaler pickled, and what apex could have written there. A record
# (what load_checkpoint returns) is checked against these before its numbers are used: an era-1
# scale_window of 0 would be a ZeroDivisionError, a NaN scale would be trained with.
_RECORD_FIELDS = {
    "apex.fp16_utils.loss_scaler.LossScaler": {"cur_scale": "scale"},
    "apex.fp16_utils.loss_scaler.DynamicLossScaler": {
        "cur_scale": "scale",
        "scale_factor": "factor",
        "scale_window": "window",
        "cur_iter": "iteration",
        "last_overflow_iter": "iteration",
    },
    "apex.amp.scaler.LossScaler": {
        "dynamic": "flag",
        "_loss_scale": "scale",
        "_scale_seq_len": "window",
        "_unskipped": "count",
        "_min_loss_scale": "floor",
        "_max_loss_scale": "cap",
    },
}


def check_saved_scaler(saved: Any) -> None:
    """Raise ValueError if the saved apex scaler ``saved`` holds a value no apex run can write.

    ValueError naming the attribute if ``saved`` -- an apex scaler as
    :func:`fp16kit.legacy.load_checkpoint` returns it (a dict with ``"__apex_class__"``), or a
    live apex object -- holds a value no apex run can write there (a scale that is NaN, 0,
    negative or inf; a ``scale_window`` below 1 or not whole; a negative count): a
    :class:`SavedScalerRefused`. Attributes it lacks, and every other form, are left to the
    reader. Changes nothing."""
    path: Any  # a record's class key holds whatever was pickled; only known paths have fields
    if isinstance(saved, dict):
        path, attributes = saved.get(CLASS_KEY), saved
    else:
        cls = type(saved)
        path, attributes = f"{cls.__module__}.{cls.__qualname__}", getattr(saved, "__dict__", {})
    for name, kind in _RECORD_FIELDS.get(path, {}).items():
        if name in attributes:
            _check_pickled(path, name, attributes[name], kind)


# ---------------------------------------------------------------- settings a scaler runs with
def check_scale(name: str, value: Any) -> None:
    """Raise ValueError unless ``value`` is a finite number > 0.

    ValueError unless ``value`` is a finite number > 0: a loss scale of 0 makes every
    unscaled grad inf or NaN, inf or NaN makes every grad non-finite, and a negative one is
    nothing apex ever ran with (its dynamic rules grow it without bound)."""
    if not _is_scale(value):
        raise ValueError(f"{name} must be a finite number > 0 (e.g. 128.0), got {value!r:.80}.")


def check_factor(name: str, value: Any) -> None:
    """Raise ValueError unless ``value`` is a finite number > 1.

    ValueError unless ``value`` is a finite number > 1 (as torch's GradScaler requires of its
    growth factor): the scale is divided by it at an overflow and multiplied by it to grow, so a
    factor <= 1 never backs off and skips every step once the scale overflows."""
    if not _is_factor(value):
        raise ValueError(
            f"{name} must be a finite number > 1 (the scale is divided by it at an overflow), got {value!r:.80}."
        )


def check_window(name: str, value: Any) -> None:
    """Raise ValueError unless ``value`` is a whole number >= 1.

    ValueError unless ``value`` is a whole number >= 1 (an int, or an integral float such
    as 2000.0): the clean steps between two growths of the scale."""
    if not _is_window(value):
        raise ValueError(
            f"{name} must be a whole number >= 1 (the clean steps between two growths of the scale), got {value!r:.80}."
        )


def _finite_real(value: Any) -> bool:
    try:
        return _real(value) and math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


# one rule per kind of setting, for the constructors' checks and for pickled attributes alike
def _is_scale(value: Any) -> bool:
    return _finite_real(value) and value > 0


def _is_factor(value: Any) -> bool:
    return _finite_real(value) and value > 1


def _is_window(value: Any) -> bool:
    return _finite_real(value) and value >= 1 and value == int(value)


_LOOK = (
    "To see what the file holds without running it, read it with fp16kit.legacy.load_checkpoint(path), "
    "which returns each scaler's attributes as plain data."
)


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
    return tuple(None if g is None else kernels.scale_outputs(g, lambda _d: loss_scale) for g in grad_in)


class LossScaler:
    """Static loss scale: ``loss * scale`` before backward, never an overflow check."""

    def __init__(self, scale: float = 1) -> None:
        check_scale("scale", scale)
        self.cur_scale = scale

    def __setstate__(self, state: Any) -> None:
        """apex pickled ``cur_scale`` only: it is read (a finite number > 0), nothing else is."""
        self.cur_scale = pickled(self, pickled_attributes(self, state, ["cur_scale"]), "cur_scale", "scale")

    def has_overflow(self, params: Iterable[torch.Tensor]) -> bool:
        """Always False: a static scale never checks the grads (apex's)."""
        return False

    @staticmethod
    def _has_inf_or_nan(x: torch.Tensor) -> bool:
        return False

    def update_scale(self, overflow: bool) -> None:
        """Nothing: a static scale never changes."""

    @property
    def loss_scale(self) -> float:
        """The scale (``cur_scale``)."""
        return self.cur_scale

    def scale_gradient(self, module: Any, grad_in: tuple, grad_out: tuple) -> tuple:
        """apex's backward hook: ``grad_in`` multiplied by the scale (None entries kept)."""
        return _scale_grads_in(self.loss_scale, grad_in)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        """``(loss * loss_scale).backward()``, as one commit.

        ``(loss * loss_scale).backward()``, one commit: once it has added to the grads, a
        Ctrl-C is raised saying so (repeating it would add again)."""
        with hold_interrupts("loss_scaler.backward(loss)"):
            scaled_loss = kernels.scale_outputs(loss, lambda _d: self.loss_scale)
            scaled_loss.backward(retain_graph=retain_graph)


_ERA1_DYNAMIC = ("cur_scale", "cur_iter", "last_overflow_iter", "scale_factor", "scale_window")


class DynamicLossScaler:
    """apex's dynamic loss scaler (era 1).

    Halve on overflow (floor 1), double every ``scale_window`` clean iterations since the
    last overflow (no cap)."""

    def __init__(self, init_scale: float = 2**32, scale_factor: float = 2.0, scale_window: int = 1000) -> None:
        check_scale("init_scale", init_scale)
        check_factor("scale_factor", scale_factor)
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
        """The scale now (an int when the initial scale was one, as apex's arithmetic kept it); assignable."""
        value = self._state.get_scale()
        return int(value) if self._int_scale else value

    @cur_scale.setter
    def cur_scale(self, value: float) -> None:
        check_scale("cur_scale", value)
        self._state.set_scale(float(value))
        self._int_scale = isinstance(value, int)

    @property
    def cur_iter(self) -> int:
        """Iterations (``update_scale`` calls) so far; assignable."""
        return self._cur_iter

    @cur_iter.setter
    def cur_iter(self, value: int) -> None:
        last = self.last_overflow_iter  # apex kept it as it was
        self._cur_iter = int(value)
        self.last_overflow_iter = last

    @property
    def last_overflow_iter(self) -> int:
        """The iteration of the last overflow (-1 before any); assignable."""
        # the rule's tracker counts the iterations since the last overflow
        return self._cur_iter - 1 - self._state.get_growth_tracker()

    @last_overflow_iter.setter
    def last_overflow_iter(self, value: int) -> None:
        self._state.set_growth_tracker(self._cur_iter - 1 - int(value))

    @property
    def scale_factor(self) -> float:
        """What the scale is divided by on overflow and multiplied by after a clean window; assignable."""
        return self._state.growth_factor

    @scale_factor.setter
    def scale_factor(self, value: float) -> None:
        check_factor("scale_factor", value)
        self._state.growth_factor = value

    @property
    def scale_window(self) -> int:
        """Clean iterations between two growths (an int >= 1); assignable."""
        return self._state.growth_interval

    @scale_window.setter
    def scale_window(self, value: int) -> None:
        rule_named("apex").check(value)  # the rule's modulo needs an int >= 1
        self._state.growth_interval = value

    @property
    def loss_scale(self) -> float:
        """The scale (``cur_scale``)."""
        return self.cur_scale

    def has_overflow(self, params: Iterable[torch.Tensor]) -> bool:
        """True if any param's grad holds inf or NaN (a host read)."""
        return _any_non_finite(p.grad for p in params if p.grad is not None)

    @staticmethod
    def _has_inf_or_nan(x: torch.Tensor) -> bool:
        """True if ``x`` holds inf or NaN. Works on the class and on an instance."""
        return _any_non_finite([x.detach().clone()])

    def update_scale(self, overflow: bool) -> None:
        """One step of the rule (module docstring), as one commit.

        One step of the rule (module docstring): one commit, a Ctrl-C during it is raised
        when the scale, the iteration count and the last overflow agree again."""
        with hold_interrupts("loss_scaler.update_scale()"):
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
        """apex's backward hook: ``grad_in`` multiplied by the scale (None entries kept)."""
        return _scale_grads_in(self.loss_scale, grad_in)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        """``(loss * loss_scale).backward()``, as one commit.

        ``(loss * loss_scale).backward()``, one commit: once it has added to the grads, a
        Ctrl-C is raised saying so (repeating it would add again)."""
        with hold_interrupts("loss_scaler.backward(loss)"):
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

    def __setstate__(self, state: Any) -> None:
        """apex's five attributes, each checked (ValueError naming a bad one); nothing else is read."""
        a = pickled_attributes(self, state, _ERA1_DYNAMIC)
        window = pickled(self, a, "scale_window", "window")
        self.__init__(  # type: ignore[misc]
            pickled(self, a, "cur_scale", "scale"),
            pickled(self, a, "scale_factor", "factor"),
            int(window),  # (an integral float: a window of that many iterations)
        )
        self.cur_iter = pickled(self, a, "cur_iter", "iteration")
        self.last_overflow_iter = pickled(self, a, "last_overflow_iter", "iteration")

    def __repr__(self) -> str:
        return (
            f"DynamicLossScaler(cur_scale={self.cur_scale}, cur_iter={self.cur_iter}, "
            f"last_overflow_iter={self.last_overflow_iter}, scale_factor={self.scale_factor}, "
            f"scale_window={self.scale_window})"
        )
