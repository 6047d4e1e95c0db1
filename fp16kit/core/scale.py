"""The loss-scale state machine, kept on the device.

One class, :class:`LossScale`, holds a dynamic loss scale and its trackers as 0-dim device
tensors and updates them with device ops only, so a training loop never waits for the device
to learn whether a step overflowed. Its rules reproduce three scalers exactly: torch's
``GradScaler`` (the default), apex's ``fp16_utils.DynamicLossScaler`` and apex's
``amp.scaler.LossScaler`` (used by apex's FP16_Optimizer from 2019 on).
"""

from __future__ import annotations

import logging
import math
import threading
from collections import deque
from typing import Any, Literal

import torch

__all__ = ["LossScale", "Rule", "FloorPolicy", "RULES", "FLOOR_POLICIES"]

logger = logging.getLogger("fp16kit")

Rule = Literal["torch", "apex", "apex_amp"]
FloorPolicy = Literal["ignore", "warn", "raise"]
RULES: tuple[str, ...] = ("torch", "apex", "apex_amp")
FLOOR_POLICIES: tuple[str, ...] = ("ignore", "warn", "raise")

_STATE_KEYS = (
    "scale",
    "growth_tracker",
    "hysteresis_tracker",
    "rule",
    "growth_factor",
    "backoff_factor",
    "growth_interval",
    "hysteresis",
    "min_scale",
    "max_scale",
    "on_min_scale",
)


class LossScale:
    """A dynamic loss scale whose state lives on the device and updates without a host sync.

    State (0-dim tensors on one device, created by :meth:`materialize` -- lazily, so a scaler
    can be built before the device of the loss is known)::

        scale               dtype (float32; float64 where Python-float arithmetic must be
                            reproduced bit for bit, as in apex's scalers)
        growth_tracker      int32  clean updates counted by the rule (see below)
        hysteresis_tracker  int32  overflows still tolerated before backing off
        skipped, consecutive int64 updates that saw an overflow, in total / in a row

    ``update(found_inf)`` applies one of three rules (``found_inf`` != 0 means the step
    overflowed and was skipped). In every rule, with ``hysteresis = H`` (default 1)::

        on overflow:  hysteresis_tracker = max(hysteresis_tracker - 1, 0)
                      back off only if hysteresis_tracker == 0
        on growth:    hysteresis_tracker = H
        floor:        a back-off never goes below min_scale (when given)

    so H = 1 backs off at every overflow; H = N tolerates N - 1 overflows between growths
    (Megatron-LM's and DeepSpeed's hysteresis).

    ``rule="torch"`` -- torch.amp.GradScaler (``torch._amp_update_scale_``)::

        if overflow:
            growth_tracker = 0
            if backing off: scale = max(scale * backoff_factor, min_scale)
        else:
            growth_tracker += 1
            if growth_tracker == growth_interval:
                growth_tracker = 0
                new = min(scale * growth_factor, max_scale)
                if isfinite(new): scale = new          # never grow to inf

    ``rule="apex"`` -- apex.fp16_utils.DynamicLossScaler (``growth_factor`` is apex's
    ``scale_factor``, ``growth_interval`` its ``scale_window``; growth_tracker equals
    apex's ``cur_iter - last_overflow_iter - 1``; ``min_scale`` defaults to 1)::

        if overflow:
            growth_tracker = 0
            if backing off: scale = max(scale / growth_factor, min_scale)
        else:
            growth_tracker += 1                        # not reset on growth: a modulo rule
            if growth_tracker % growth_interval == 0:
                scale = min(scale * growth_factor, max_scale)    # no cap by default

    ``rule="apex_amp"`` -- apex.amp.scaler.LossScaler, driven by apex's FP16_Optimizer
    (``max_scale`` defaults to 2**24 -- ``float("inf")`` for no cap -- and a ``min_scale`` of
    0 means none, as in apex)::

        if overflow:
            growth_tracker = 0
            if backing off: scale = max(scale / growth_factor, min_scale)
        else:
            growth_tracker += 1
        if growth_tracker == growth_interval:          # checked after either branch
            growth_tracker = 0
            scale = min(scale * growth_factor, max_scale)

    Products and quotients are taken in float64 and rounded once to ``dtype``, which is what
    torch's kernel does (float scale times double factor) and what Python floats did in apex.

    Bounds: the initial scale is clamped into ``[min_scale, max_scale]`` (not with the apex
    rule, whose scaler started where it was told). ``set_scale`` and ``load_state_dict`` set
    exactly the value given: bounds govern the rule's own moves.

    Floor policy (``on_min_scale``; needs a floor): when a step overflows while the scale is
    already at ``min_scale`` the scaler cannot adapt any more -- the loss is probably not
    finite at any scale. ``"warn"`` logs a warning, ``"raise"`` raises ``FloatingPointError``
    (after the update completes). The check reads a device counter through a pinned host
    copy and an event, so it never blocks: on CPU it reports in the same ``update()``, on a
    GPU as soon as the copy has landed (usually by the next ``update()``).

    Hot path: with the torch rule, ``hysteresis=1`` and no bounds, ``update`` is torch's own
    fused ``_amp_update_scale_`` plus three tiny ops for the counters; otherwise a handful of
    0-dim ``torch.where`` ops. No ``.item()``, ``bool()`` or ``float()`` of a tensor.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        *,
        rule: Rule = "torch",
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        hysteresis: int = 1,
        min_scale: float | None = None,
        max_scale: float | None = None,
        on_min_scale: FloorPolicy = "ignore",
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        if rule == "apex" and min_scale is None:
            min_scale = 1.0
        if rule == "apex_amp":
            if not min_scale:
                min_scale = None  # apex tested `if self._min_loss_scale:`, so 0 meant no floor
            if max_scale is None:
                max_scale = 2.0**24
        if max_scale is not None and max_scale == math.inf:
            max_scale = None  # no cap
        _validate_settings(
            rule=rule,
            growth_interval=growth_interval,
            hysteresis=hysteresis,
            min_scale=min_scale,
            max_scale=max_scale,
            on_min_scale=on_min_scale,
        )
        if dtype not in (torch.float32, torch.float64):
            raise ValueError(
                f"LossScale dtype must be torch.float32 or torch.float64, got {dtype}."
            )
        self.rule: str = rule
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self.min_scale = None if min_scale is None else float(min_scale)
        self.max_scale = None if max_scale is None else float(max_scale)
        self.on_min_scale: str = on_min_scale
        self.dtype = dtype

        # Host values used until the tensors exist (and after unpickling). The initial scale
        # starts inside the bounds (apex's amp scaler took min(max_loss_scale, init_scale));
        # apex's fp16_utils scaler started where it was told.
        if rule != "apex":
            if self.max_scale is not None and init_scale > self.max_scale:
                init_scale = self.max_scale
            if self.min_scale is not None and init_scale < self.min_scale:
                init_scale = self.min_scale
        self.init_scale = init_scale
        self.init_growth_tracker = 0
        self.init_hysteresis_tracker = hysteresis
        self._init_skipped = 0
        self._init_consecutive = 0

        self.scale: torch.Tensor | None = None
        self.growth_tracker: torch.Tensor | None = None
        self.hysteresis_tracker: torch.Tensor | None = None
        self._skipped: torch.Tensor | None = None
        self._consecutive: torch.Tensor | None = None
        # The found-inf flags of the last updates, counted into _skipped/_consecutive every
        # _HISTORY updates or when read: one device op per update instead of four.
        self._history: torch.Tensor | None = None
        self._slots: list[torch.Tensor] = []
        self._recorded = 0
        self._last_slot: torch.Tensor | None = None  # the flag of the last update
        # update() may run on the optimizer thread while the main thread reads the counters
        self._count_lock = threading.Lock()
        self._floor_hits: torch.Tensor | None = None
        self._floor_reader = _LaggedReader()
        self._floor_hits_reported = 0
        if device is not None:
            self.materialize(device)

    # ------------------------------------------------------------------ placement
    @property
    def is_materialized(self) -> bool:
        return self.scale is not None

    @property
    def device(self) -> torch.device | None:
        return None if self.scale is None else self.scale.device

    def materialize(self, device: torch.device | str) -> None:
        """Create the state tensors on ``device`` from the host values (once)."""
        if self.scale is not None:
            return
        self.scale = torch.full((), self.init_scale, dtype=self.dtype, device=device)
        self.growth_tracker = torch.full(
            (), self.init_growth_tracker, dtype=torch.int32, device=device
        )
        self.hysteresis_tracker = torch.full(
            (), self.init_hysteresis_tracker, dtype=torch.int32, device=device
        )
        self._skipped = torch.full((), self._init_skipped, dtype=torch.int64, device=device)
        self._consecutive = torch.full(
            (), self._init_consecutive, dtype=torch.int64, device=device
        )
        self._history = torch.zeros(_HISTORY, dtype=torch.float32, device=device)
        self._slots = list(self._history.unbind(0))
        self._recorded = 0
        self._floor_hits = torch.zeros((), dtype=torch.int64, device=device)

    def _require(self, what: str) -> torch.Tensor:
        if self.scale is None:
            raise RuntimeError(
                f"LossScale.{what}() needs the scale on a device: call materialize(device) "
                "first (GradScaler does this in its first scale() call)."
            )
        return self.scale

    # ------------------------------------------------------------------ the rule
    @property
    def _is_torch_fast_path(self) -> bool:
        return (
            self.rule == "torch"
            and self.hysteresis == 1
            and self.min_scale is None
            and self.max_scale is None
            and self.dtype == torch.float32
        )

    def update(
        self, found_inf: torch.Tensor | bool, *, used_scale: torch.Tensor | None = None
    ) -> None:
        """Apply one step of the rule. ``found_inf``: a tensor (any device, nonzero means the
        step overflowed) or a Python bool. Device ops only; see the class docstring.

        ``used_scale``: the scale the overflowing loss was actually multiplied by, when that
        can differ from the current one (steps that lag the scale, on the optimizer thread).
        A back-off then starts from it and never goes above the current scale::

            backed_off = min(scale, backoff(used_scale))

        so one overflowing scale is never backed off twice. Equal to the current scale, this
        is the plain rule."""
        scale = self._require("update")
        if not isinstance(found_inf, torch.Tensor):
            found_inf = torch.full((), float(bool(found_inf)), device=scale.device)
        found_inf = found_inf.to(device=scale.device, dtype=torch.float32, non_blocking=True)
        if used_scale is not None:
            self._update_generic(found_inf != 0, used_scale.to(device=scale.device, dtype=torch.float64))
        elif self._is_torch_fast_path:
            torch._amp_update_scale_(
                scale,
                self.growth_tracker,
                found_inf,
                self.growth_factor,
                self.backoff_factor,
                self.growth_interval,
            )
        else:
            self._update_generic(found_inf != 0)
        with self._count_lock:
            self._last_slot = self._slots[self._recorded]
            self._last_slot.copy_(found_inf)
            self._recorded += 1
            if self._recorded == _HISTORY:
                self._count_skips()
        self._poll_floor()

    def _count_skips(self) -> None:
        """Fold the recorded flags into the counters (device ops, no sync; under the lock)::

            skipped     += number of overflowing updates
            consecutive  = overflows after the last clean update, or consecutive + n if none
        """
        n = self._recorded
        if n == 0:
            return
        assert self._history is not None and self._skipped is not None and self._consecutive is not None
        overflow = self._history[:n] != 0
        self._skipped.add_(overflow.sum())
        positions = torch.arange(n, device=overflow.device)
        last_clean = torch.where(overflow, -1, positions).max()
        self._consecutive.copy_(torch.where(last_clean >= 0, n - 1 - last_clean, self._consecutive + n))
        self._recorded = 0

    def _update_generic(self, found: torch.Tensor, used: torch.Tensor | None = None) -> None:
        assert self.scale is not None and self.growth_tracker is not None
        assert self.hysteresis_tracker is not None
        s = self.scale.double()
        hyst = torch.where(found, (self.hysteresis_tracker - 1).clamp_min(0), self.hysteresis_tracker)
        backoff = found & (hyst == 0)

        base = s if used is None else used
        backed = base * self.backoff_factor if self.rule == "torch" else base / self.growth_factor
        if used is not None:
            backed = torch.minimum(backed, s)
        if self.min_scale is not None:
            backed = backed.clamp_min(self.min_scale)
        after_backoff = torch.where(backoff, backed, s)

        counted = torch.where(found, 0, self.growth_tracker + 1)
        if self.rule == "torch":
            grow = ~found & (counted == self.growth_interval)
        elif self.rule == "apex":
            grow = ~found & (counted % self.growth_interval == 0)
        else:  # apex_amp
            grow = counted == self.growth_interval
        grown = after_backoff * self.growth_factor
        if self.max_scale is not None:
            grown = grown.clamp_max(self.max_scale)
        apply_growth = grow
        if self.rule == "torch":  # torch never grows the (float32) scale to inf
            apply_growth = grow & torch.isfinite(grown.to(self.dtype))
        new_scale = torch.where(apply_growth, grown, after_backoff)
        new_tracker = counted if self.rule == "apex" else torch.where(grow, 0, counted)
        new_hyst = torch.where(grow, self.hysteresis, hyst)

        if self.on_min_scale != "ignore":
            assert self.min_scale is not None and self._floor_hits is not None
            self._floor_hits.add_(backoff & (s <= self.min_scale))
            self._floor_reader.push(self._floor_hits)
        self.scale.copy_(new_scale)
        self.growth_tracker.copy_(new_tracker)
        self.hysteresis_tracker.copy_(new_hyst)

    # ------------------------------------------------------------------ floor policy
    def _poll_floor(self) -> None:
        if self.on_min_scale == "ignore":
            return
        hits = self._floor_reader.poll()
        if hits is None or hits <= self._floor_hits_reported:
            return
        new = hits - self._floor_hits_reported
        self._floor_hits_reported = hits
        msg = (
            f"Gradients overflowed {new} more time(s) with the loss scale already at its floor "
            f"(min_scale={self.min_scale:g}): the loss is probably exploding, not just "
            "overflowing fp16. Try a lower learning rate, gradient clipping, checking the "
            "inputs for inf/NaN, or training in bfloat16."
        )
        if self.on_min_scale == "raise":
            raise FloatingPointError(msg)
        logger.warning(msg)

    # ------------------------------------------------------------------ reads and writes
    def snapshot(self) -> torch.Tensor:
        """A copy of the scale tensor as it is now (a device op, no sync): a later update does
        not change it, so another thread can read it afterwards."""
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
        self.init_growth_tracker = value
        if self.growth_tracker is not None:
            self.growth_tracker.fill_(value)

    def set_hysteresis_tracker(self, value: int) -> None:
        self.init_hysteresis_tracker = value
        if self.hysteresis_tracker is not None:
            self.hysteresis_tracker.fill_(value)

    def last_found_inf(self) -> torch.Tensor | None:
        """0-dim bool device tensor: did the last :meth:`update` see an overflow? (no sync);
        None before the first update."""
        return None if self._last_slot is None else self._last_slot != 0

    def skipped_steps(self) -> int:
        """Updates that saw an overflow since construction (host read)."""
        if self._skipped is None:
            return self._init_skipped
        with self._count_lock:
            self._count_skips()
            return int(self._skipped.item())

    def consecutive_skipped_steps(self) -> int:
        """Overflowing updates in a row, up to the last one (host read)."""
        if self._consecutive is None:
            return self._init_consecutive
        with self._count_lock:
            self._count_skips()
            return int(self._consecutive.item())

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Plain data: the scale, the trackers and the settings (reads the device)."""
        return {
            "scale": self.get_scale(),
            "growth_tracker": self.get_growth_tracker(),
            "hysteresis_tracker": self.get_hysteresis_tracker(),
            "rule": self.rule,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "hysteresis": self.hysteresis,
            "min_scale": self.min_scale,
            "max_scale": self.max_scale,
            "on_min_scale": self.on_min_scale,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output. Everything is checked before anything changes:
        a missing or unknown key or a bad setting raises ``ValueError`` naming it."""
        if not isinstance(state_dict, dict):
            raise TypeError(
                f"LossScale.load_state_dict expects a dict from LossScale.state_dict(), "
                f"got {type(state_dict).__name__}."
            )
        missing = [k for k in _STATE_KEYS if k not in state_dict]
        unknown = [k for k in state_dict if k not in _STATE_KEYS]
        if missing or unknown:
            raise ValueError(
                "LossScale state dict does not match: "
                + (f"missing keys {missing}" if missing else "")
                + ("; " if missing and unknown else "")
                + (f"unknown keys {unknown}" if unknown else "")
                + ". Pass the dict returned by LossScale.state_dict()."
            )
        if state_dict["rule"] != self.rule:
            raise ValueError(
                f"LossScale state dict was saved with rule={state_dict['rule']!r} but this "
                f"scale uses rule={self.rule!r}; build LossScale(rule={state_dict['rule']!r}) "
                "to load it."
            )
        _validate_settings(
            rule=self.rule,
            growth_interval=state_dict["growth_interval"],
            hysteresis=state_dict["hysteresis"],
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
        self.growth_factor = state_dict["growth_factor"]
        self.backoff_factor = state_dict["backoff_factor"]
        self.growth_interval = state_dict["growth_interval"]
        self.hysteresis = state_dict["hysteresis"]
        self.min_scale = state_dict["min_scale"]
        self.max_scale = state_dict["max_scale"]
        self.on_min_scale = state_dict["on_min_scale"]
        self.init_scale = state_dict["scale"]
        if self.scale is not None:
            self.scale.fill_(state_dict["scale"])
        self.set_growth_tracker(state_dict["growth_tracker"])
        self.set_hysteresis_tracker(state_dict["hysteresis_tracker"])

    def __getstate__(self) -> dict[str, Any]:
        # Pickle host values only; the tensors are re-created lazily on the next materialize()
        # (torch's GradScaler pickles the same way, and CUDA events cannot be pickled).
        state = self.__dict__.copy()
        state["init_scale"] = self.init_scale if self.scale is None else self.scale.item()
        state["init_growth_tracker"] = self.get_growth_tracker()
        state["init_hysteresis_tracker"] = self.get_hysteresis_tracker()
        state["_init_skipped"] = self.skipped_steps()
        state["_init_consecutive"] = self.consecutive_skipped_steps()
        for name in (
            "scale",
            "growth_tracker",
            "hysteresis_tracker",
            "_skipped",
            "_consecutive",
            "_history",
            "_last_slot",
            "_floor_hits",
        ):
            state[name] = None
        state["_slots"] = []
        state["_recorded"] = 0
        state["_count_lock"] = None
        state["_floor_reader"] = _LaggedReader()
        state["_floor_hits_reported"] = 0
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._count_lock = threading.Lock()

    def __repr__(self) -> str:
        where = "lazy" if self.scale is None else str(self.scale.device)
        return (
            f"LossScale(rule={self.rule!r}, init_scale={self.init_scale!r}, "
            f"growth_factor={self.growth_factor}, backoff_factor={self.backoff_factor}, "
            f"growth_interval={self.growth_interval}, hysteresis={self.hysteresis}, "
            f"min_scale={self.min_scale}, max_scale={self.max_scale}, "
            f"on_min_scale={self.on_min_scale!r}, dtype={self.dtype}, {where})"
        )


_HISTORY = 64  # updates between two folds of the skip counters (LossScale._count_skips)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _validate_settings(
    *,
    rule: str,
    growth_interval: Any,
    hysteresis: Any,
    min_scale: Any,
    max_scale: Any,
    on_min_scale: Any,
) -> None:
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}.")
    if rule == "apex" and (not isinstance(growth_interval, int) or growth_interval < 1):
        raise ValueError(
            f"The apex rule grows the scale every `scale_window` clean steps (a modulo), so "
            f"scale_window must be an int >= 1, got {growth_interval!r}."
        )
    if isinstance(hysteresis, bool) or not isinstance(hysteresis, int) or hysteresis < 1:
        raise ValueError(
            f"hysteresis must be an int >= 1 (1 backs off at every overflow), got {hysteresis!r}."
        )
    for name, value in (("min_scale", min_scale), ("max_scale", max_scale)):
        if value is not None and (
            not isinstance(value, (int, float)) or isinstance(value, bool)
            or not math.isfinite(value) or value < 0
        ):
            raise ValueError(f"{name} must be None or a finite number >= 0, got {value!r}.")
    if max_scale is not None and max_scale <= 0:
        raise ValueError(f"max_scale must be > 0, got {max_scale!r}.")
    if min_scale is not None and max_scale is not None and min_scale > max_scale:
        raise ValueError(
            f"min_scale ({min_scale}) is above max_scale ({max_scale}); pass min_scale <= max_scale."
        )
    if on_min_scale not in FLOOR_POLICIES:
        raise ValueError(f"on_min_scale must be one of {FLOOR_POLICIES}, got {on_min_scale!r}.")
    if on_min_scale != "ignore" and min_scale is None:
        raise ValueError(
            f"on_min_scale={on_min_scale!r} needs a floor to watch: also pass min_scale "
            "(the smallest scale you accept, e.g. min_scale=1.0)."
        )


class _LaggedReader:
    """Reads a small device tensor on the host without ever waiting for the device.

    ``push(t)`` starts a copy of ``t`` into host memory: on CUDA pinned, non-blocking and
    followed by an event; elsewhere a plain copy. ``poll()`` returns the value of the newest
    copy that has landed, or None if none has. Values are counters, so a newer copy
    supersedes the older ones still in flight.
    """

    _MAX_PENDING = 16

    def __init__(self) -> None:
        self._pending: deque[tuple[torch.Tensor, Any]] = deque()

    def push(self, t: torch.Tensor) -> None:
        if t.device.type == "cuda":
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._pending.append((host, event))
        else:
            self._pending.append((t.to("cpu", copy=True), None))
        while len(self._pending) > self._MAX_PENDING:
            self._pending.popleft()

    def poll(self) -> int | None:
        value: int | None = None
        while self._pending:
            host, event = self._pending[0]
            if event is not None and not event.query():
                break
            self._pending.popleft()
            value = int(host.item())  # a landed host copy: no device sync
        return value

