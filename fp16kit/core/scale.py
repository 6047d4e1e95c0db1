"""The loss-scale state machine, kept on the device.

:class:`LossScale` holds a dynamic loss scale and its trackers as 0-dim device tensors and
updates them with device ops only, so a training loop never waits for the device to learn
whether a step overflowed. Contract::

    ls = LossScale(init_scale, rule="torch" | "apex" | "apex_amp", ...)
    ls.materialize(device)          # the device state, built once from the host values
    ls.update(found_inf)            # one step of the rule; device ops only
    ls.get_scale(), ls.skipped_steps(), ...   # host reads, for logging and checkpoints

The pieces, one module each:

* :mod:`fp16kit.core.scale_rules` -- the rules, one object each, with their pseudo-code:
  torch's ``GradScaler`` (the default), apex's ``fp16_utils.DynamicLossScaler`` and apex's
  ``amp.scaler.LossScaler`` (used by apex's FP16_Optimizer from 2019 on), plus hysteresis
  and min/max bounds, which all three share;
* :mod:`fp16kit.core.skip_counter` -- the skipped-step counts;
* :mod:`fp16kit.core.floor` -- the policy for overflows at ``min_scale``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, overload

import torch

from .floor import FLOOR_POLICIES, FloorPolicy, FloorWatch
from .floor import LaggedReader as _LaggedReader  # noqa: F401  older pickles name it here
from .scale_rules import RULES, Rule, ScaleRule, rule_named
from .skip_counter import SkipCounter

__all__ = ["LossScale", "ScaleState", "Rule", "FloorPolicy", "RULES", "FLOOR_POLICIES"]

_SETTINGS = (
    "growth_factor",
    "backoff_factor",
    "growth_interval",
    "hysteresis",
    "consecutive_hysteresis",
    "min_scale",
    "max_scale",
    "on_min_scale",
)
_STATE_KEYS = ("scale", "growth_tracker", "hysteresis_tracker", "rule", *_SETTINGS)
# Keys a state dict saved before they existed may lack, and the value that behaves as it did.
_STATE_DEFAULTS = {"consecutive_hysteresis": False}


@dataclass
class ScaleState:
    """Everything a :class:`LossScale` keeps on the device.

    :meth:`LossScale.materialize` builds it whole from the host values; pickling drops it whole
    (``ScaleState()``).

    The three tensors are also LossScale attributes that code written for torch's GradScaler
    assigns one by one, before the first ``scale()`` too, so each may be None or a tensor
    set from outside, as torch's ``_scale`` and ``_growth_tracker`` may."""

    scale: torch.Tensor | None = None  # dtype
    growth_tracker: torch.Tensor | None = None  # int32: clean updates counted by the rule
    hysteresis_tracker: torch.Tensor | None = None  # int32: overflows still tolerated
    skips: SkipCounter | None = None
    floor: FloorWatch | None = None


class _DeviceField:
    """A LossScale attribute that reads and writes the field of the same name in its
    :class:`ScaleState`."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, objtype: type | None = None) -> _DeviceField: ...

    @overload
    def __get__(self, obj: LossScale, objtype: type | None = None) -> torch.Tensor | None: ...

    def __get__(self, obj: LossScale | None, objtype: type | None = None) -> Any:
        return self if obj is None else getattr(obj._device_state, self.name)

    def __set__(self, obj: LossScale, value: torch.Tensor | None) -> None:
        setattr(obj._device_state, self.name, value)


class LossScale:
    """A dynamic loss scale whose state lives on the device and updates without a host sync.

    State: a :class:`ScaleState` (``scale`` in ``dtype`` -- float32; float64 where
    Python-float arithmetic must be reproduced bit for bit, as in apex's scalers -- the int32
    ``growth_tracker`` and ``hysteresis_tracker``, the skip counts and the floor watch),
    created by :meth:`materialize` -- lazily, so a scaler can be built before the device of
    the loss is known. Until then, and in a pickle, the host values ``init_scale``,
    ``init_growth_tracker`` and ``init_hysteresis_tracker`` stand for it.

    ``update(found_inf)`` applies the rule named by ``rule`` (``found_inf`` != 0 means the
    step overflowed and was skipped): see :mod:`fp16kit.core.scale_rules` for each rule's
    pseudo-code, and for hysteresis (``hysteresis = N`` tolerates N - 1 overflows between
    growths, or in a row with ``consecutive_hysteresis=True``) and the bounds, which all
    rules share. The settings are read at every update,
    so assigning e.g. ``growth_factor`` takes effect at the next one.

    Bounds: the initial scale starts inside ``[min_scale, max_scale]`` unless the rule says
    otherwise (apex's era-1 scaler started where it was told). ``set_scale`` and
    ``load_state_dict`` set exactly the value given: bounds govern the rule's own moves.

    Floor policy (``on_min_scale``; needs a floor): see :mod:`fp16kit.core.floor`.

    Hot path: with the torch rule, ``hysteresis=1`` and no bounds, ``update`` is torch's own
    fused ``_amp_update_scale_`` plus one tiny op for the skip count; otherwise a handful of
    0-dim ``torch.where`` ops. No ``.item()``, ``bool()`` or ``float()`` of a tensor.
    """

    scale = _DeviceField()
    growth_tracker = _DeviceField()
    hysteresis_tracker = _DeviceField()

    def __init__(
        self,
        init_scale: float = 2.0**16,
        *,
        rule: Rule = "torch",
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        hysteresis: int = 1,
        consecutive_hysteresis: bool = False,
        min_scale: float | None = None,
        max_scale: float | None = None,
        on_min_scale: FloorPolicy = "ignore",
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        scale_rule = rule_named(rule)
        min_scale, max_scale = scale_rule.bounds(min_scale, max_scale)
        if max_scale is not None and max_scale == math.inf:
            max_scale = None  # no cap
        _validate_settings(
            scale_rule,
            growth_interval=growth_interval,
            hysteresis=hysteresis,
            consecutive_hysteresis=consecutive_hysteresis,
            min_scale=min_scale,
            max_scale=max_scale,
            on_min_scale=on_min_scale,
        )
        if dtype not in (torch.float32, torch.float64):
            raise ValueError(f"LossScale dtype must be torch.float32 or torch.float64, got {dtype}.")
        self.rule: str = rule  # the name, not the object: checkpoints store it
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self.consecutive_hysteresis = consecutive_hysteresis
        self.min_scale = None if min_scale is None else float(min_scale)
        self.max_scale = None if max_scale is None else float(max_scale)
        self.on_min_scale: str = on_min_scale
        self.dtype = dtype

        self.init_scale = scale_rule.initial_scale(init_scale, self.min_scale, self.max_scale)
        self.init_growth_tracker = 0
        self.init_hysteresis_tracker = hysteresis
        self._init_skipped = 0
        self._init_consecutive = 0
        self._device_state = ScaleState()
        if device is not None:
            self.materialize(device)

    # ------------------------------------------------------------------ placement
    @property
    def is_materialized(self) -> bool:
        """Whether the device state exists (after :meth:`materialize`, or the first update)."""
        return self.scale is not None

    @property
    def device(self) -> torch.device | None:
        """The device the scale lives on; None before :meth:`materialize`."""
        return None if self.scale is None else self.scale.device

    def materialize(self, device: torch.device | str) -> None:
        """Build the device state on ``device`` from the host values.

        Once: a no-op while a scale exists, also one assigned from outside."""
        if self.scale is not None:
            return
        self._device_state = ScaleState(
            scale=torch.full((), self.init_scale, dtype=self.dtype, device=device),
            growth_tracker=torch.full((), self.init_growth_tracker, dtype=torch.int32, device=device),
            hysteresis_tracker=torch.full((), self.init_hysteresis_tracker, dtype=torch.int32, device=device),
            skips=SkipCounter(device, skipped=self._init_skipped, consecutive=self._init_consecutive),
            floor=FloorWatch(device),
        )

    def _require(self, what: str) -> torch.Tensor:
        if self.scale is None:
            raise RuntimeError(
                f"LossScale.{what}() needs the scale on a device: call materialize(device) "
                "first (GradScaler does this in its first scale() call)."
            )
        return self.scale

    # ------------------------------------------------------------------ the rule
    @property
    def _rule(self) -> ScaleRule:
        return rule_named(self.rule)

    def update(self, found_inf: torch.Tensor | bool, *, used_scale: torch.Tensor | None = None) -> None:
        """Apply one step of the rule.

        ``found_inf``: a tensor (any device, nonzero means the step overflowed) or a Python bool. Device ops
        only; see the class docstring.

        ``used_scale``: the scale the overflowing loss was actually multiplied by, when that
        can differ from the current one (steps that lag the scale, on the optimizer thread).
        A back-off then starts from it and never goes above the current scale::

            backed_off = min(scale, backoff(used_scale))

        so one overflowing scale is never backed off twice. Equal to the current scale, this
        is the plain rule."""
        device = self._require("update").device
        state = self._device_state
        if not isinstance(found_inf, torch.Tensor):
            found_inf = torch.full((), float(bool(found_inf)), device=device)
        found_inf = found_inf.to(device=device, dtype=torch.float32, non_blocking=True)
        if used_scale is not None:
            self._update_generic(found_inf != 0, used_scale.to(device=device, dtype=torch.float64))
        elif not self._rule.update_fused(state, found_inf, self):
            self._update_generic(found_inf != 0)
        assert state.skips is not None and state.floor is not None
        state.skips.record(found_inf)
        state.floor.report(self.on_min_scale, self.min_scale)

    def _update_generic(self, found: torch.Tensor, used: torch.Tensor | None = None) -> None:
        state = self._device_state
        step = self._rule.step(state, found, self, used_scale=used)  # reads this update's settings
        if self.on_min_scale != "ignore":
            assert self.min_scale is not None and state.floor is not None
            # before the copy-back: with a float64 scale, scale_before *is* the scale tensor
            state.floor.count(step.backed_off, step.scale_before, self.min_scale)
        assert state.scale is not None and state.growth_tracker is not None
        assert state.hysteresis_tracker is not None
        state.scale.copy_(step.scale)
        state.growth_tracker.copy_(step.growth_tracker)
        state.hysteresis_tracker.copy_(step.hysteresis_tracker)

    # ------------------------------------------------------------------ reads and writes
    def snapshot(self) -> torch.Tensor:
        """Return a copy of the scale tensor as it is now (a device op, no sync).

        A later update does not change it, so another thread can read it afterwards."""
        return self._require("snapshot").clone()

    def get_scale(self) -> float:
        """The scale as a Python float (reads the device: a host sync on GPU)."""
        return float(self.init_scale) if self.scale is None else float(self.scale.item())

    def get_growth_tracker(self) -> int:
        """The growth tracker (a host read; before materialize(), the value as it was set)."""
        if self.growth_tracker is None:
            return self.init_growth_tracker
        return int(self.growth_tracker.item())

    def get_hysteresis_tracker(self) -> int:
        """Return the overflows still absorbed before the next back-off.

        A host read; before materialize(), the value as it was set."""
        if self.hysteresis_tracker is None:
            return self.init_hysteresis_tracker
        return int(self.hysteresis_tracker.item())

    def set_scale(self, value: float | torch.Tensor) -> None:
        """Overwrite the scale (trackers untouched). A tensor is copied, not aliased."""
        if self.scale is None:
            self.init_scale = float(value) if not isinstance(value, torch.Tensor) else value.item()
        elif isinstance(value, torch.Tensor):
            self.scale.copy_(value)  # as torch: a 0-dim tensor (shape (1,) does not broadcast)
        else:
            self.scale.fill_(value)

    def set_growth_tracker(self, value: int) -> None:
        """Overwrite the growth tracker (on the device too, once materialized)."""
        self.init_growth_tracker = value
        if self.growth_tracker is not None:
            self.growth_tracker.fill_(value)

    def set_hysteresis_tracker(self, value: int) -> None:
        """Overwrite the hysteresis tracker (on the device too, once materialized)."""
        self.init_hysteresis_tracker = value
        if self.hysteresis_tracker is not None:
            self.hysteresis_tracker.fill_(value)

    def last_found_inf(self) -> torch.Tensor | None:
        """0-dim bool device tensor: did the last :meth:`update` see an overflow?

        (no sync); None before the first update."""
        skips = self._device_state.skips
        return None if skips is None else skips.last_found_inf()

    def skipped_steps(self) -> int:
        """Updates that saw an overflow since construction (host read)."""
        skips = self._device_state.skips
        return self._init_skipped if skips is None else skips.skipped()

    def consecutive_skipped_steps(self) -> int:
        """Overflowing updates in a row, up to the last one (host read)."""
        skips = self._device_state.skips
        return self._init_consecutive if skips is None else skips.consecutive()

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Plain data: the scale, the trackers and the settings (reads the device)."""
        return {
            "scale": self.get_scale(),
            "growth_tracker": self.get_growth_tracker(),
            "hysteresis_tracker": self.get_hysteresis_tracker(),
            "rule": self.rule,
            **{key: getattr(self, key) for key in _SETTINGS},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output.

        Everything is checked before anything changes: a missing or unknown key or a bad setting raises
        ``ValueError`` naming it."""
        _check_state_dict(state_dict, self.rule)
        state_dict = {**_STATE_DEFAULTS, **state_dict}
        for key in _SETTINGS:
            setattr(self, key, state_dict[key])
        self.init_scale = state_dict["scale"]
        if self.scale is not None:
            self.scale.fill_(state_dict["scale"])
        self.set_growth_tracker(state_dict["growth_tracker"])
        self.set_hysteresis_tracker(state_dict["hysteresis_tracker"])

    def __getstate__(self) -> dict[str, Any]:
        # Host values only; the device state is re-created on the next materialize() (torch's
        # GradScaler pickles the same way, and locks and CUDA events cannot be pickled).
        state = self.__dict__.copy()
        state["init_scale"] = self.init_scale if self.scale is None else self.scale.item()
        state["init_growth_tracker"] = self.get_growth_tracker()
        state["init_hysteresis_tracker"] = self.get_hysteresis_tracker()
        state["_init_skipped"] = self.skipped_steps()
        state["_init_consecutive"] = self.consecutive_skipped_steps()
        state["_device_state"] = ScaleState()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "_device_state" not in state:  # pickled before the device state was one record
            state = {k: v for k, v in state.items() if k not in _OLD_DEVICE_FIELDS}
            state["_device_state"] = ScaleState()
        self.__dict__.update({**_STATE_DEFAULTS, **state})

    def __repr__(self) -> str:
        where = "lazy" if self.scale is None else str(self.scale.device)
        return (
            f"LossScale(rule={self.rule!r}, init_scale={self.init_scale!r}, "
            f"growth_factor={self.growth_factor}, backoff_factor={self.backoff_factor}, "
            f"growth_interval={self.growth_interval}, hysteresis={self.hysteresis}, "
            + ("consecutive_hysteresis=True, " if self.consecutive_hysteresis else "")
            + f"min_scale={self.min_scale}, max_scale={self.max_scale}, "
            f"on_min_scale={self.on_min_scale!r}, dtype={self.dtype}, {where})"
        )


# What a LossScale pickled by fp16kit before ScaleState held in its __dict__ (all None or empty).
_OLD_DEVICE_FIELDS = (
    "scale",
    "growth_tracker",
    "hysteresis_tracker",
    "_skipped",
    "_consecutive",
    "_history",
    "_slots",
    "_recorded",
    "_last_slot",
    "_count_lock",
    "_floor_hits",
    "_floor_reader",
    "_floor_hits_reported",
)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_state_dict(state_dict: Any, rule: str) -> None:
    if not isinstance(state_dict, dict):
        raise TypeError(
            f"LossScale.load_state_dict expects a dict from LossScale.state_dict(), got {type(state_dict).__name__}."
        )
    missing = [k for k in _STATE_KEYS if k not in state_dict and k not in _STATE_DEFAULTS]
    unknown = [k for k in state_dict if k not in _STATE_KEYS]
    if missing or unknown:
        raise ValueError(
            "LossScale state dict does not match: "
            + (f"missing keys {missing}" if missing else "")
            + ("; " if missing and unknown else "")
            + (f"unknown keys {unknown}" if unknown else "")
            + ". Pass the dict returned by LossScale.state_dict()."
        )
    if state_dict["rule"] != rule:
        raise ValueError(
            f"LossScale state dict was saved with rule={state_dict['rule']!r} but this "
            f"scale uses rule={rule!r}; build LossScale(rule={state_dict['rule']!r}) "
            "to load it."
        )
    _validate_settings(
        rule_named(rule),
        growth_interval=state_dict["growth_interval"],
        hysteresis=state_dict["hysteresis"],
        consecutive_hysteresis=state_dict.get("consecutive_hysteresis", False),
        min_scale=state_dict["min_scale"],
        max_scale=state_dict["max_scale"],
        on_min_scale=state_dict["on_min_scale"],
    )
    for key in ("scale", "growth_factor", "backoff_factor"):
        if not _is_number(state_dict[key]):
            raise ValueError(f"LossScale state dict: {key} must be a number, got {state_dict[key]!r}.")
    for key in ("growth_tracker", "hysteresis_tracker", "growth_interval"):
        if not _is_number(state_dict[key]) or float(state_dict[key]) != int(state_dict[key]):
            raise ValueError(f"LossScale state dict: {key} must be an integer, got {state_dict[key]!r}.")


def _validate_settings(
    rule: ScaleRule,
    *,
    growth_interval: Any,
    hysteresis: Any,
    consecutive_hysteresis: Any,
    min_scale: Any,
    max_scale: Any,
    on_min_scale: Any,
) -> None:
    rule.check(growth_interval)
    if isinstance(hysteresis, bool) or not isinstance(hysteresis, int) or hysteresis < 1:
        raise ValueError(f"hysteresis must be an int >= 1 (1 backs off at every overflow), got {hysteresis!r}.")
    if not isinstance(consecutive_hysteresis, bool):
        raise ValueError(
            "consecutive_hysteresis must be True (any clean step re-arms the hysteresis) or "
            f"False (only a growth does), got {consecutive_hysteresis!r}."
        )
    for name, value in (("min_scale", min_scale), ("max_scale", max_scale)):
        if value is not None and (
            not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0
        ):
            raise ValueError(f"{name} must be None or a finite number >= 0, got {value!r}.")
    if max_scale is not None and max_scale <= 0:
        raise ValueError(f"max_scale must be > 0, got {max_scale!r}.")
    if min_scale is not None and max_scale is not None and min_scale > max_scale:
        raise ValueError(f"min_scale ({min_scale}) is above max_scale ({max_scale}); pass min_scale <= max_scale.")
    if on_min_scale not in FLOOR_POLICIES:
        raise ValueError(f"on_min_scale must be one of {FLOOR_POLICIES}, got {on_min_scale!r}.")
    if on_min_scale != "ignore" and min_scale is None:
        raise ValueError(
            f"on_min_scale={on_min_scale!r} needs a floor to watch: also pass min_scale "
            "(the smallest scale you accept, e.g. min_scale=1.0)."
        )
