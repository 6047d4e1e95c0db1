"""apex.amp.scaler: ``LossScaler``, apex amp's dynamic (or static) loss scale.

The scale lives in a :class:`fp16kit.core.scale.LossScale` (``rule="apex_amp"``, float64 as
apex's Python float), on the device of the first loss scaled. The rule (docs/apex-amp.md §7), once per
non-delayed ``scale_loss`` exit::

    if dynamic and this backward's grads held inf/NaN:  scale = max(min_loss_scale, scale / 2)
                                                        unskipped = 0        (skip the step)
    else:                                               unskipped += 1
    if dynamic and unskipped == scale_window:           scale = min(max_loss_scale, 2 * scale)
                                                        unskipped = 0

``scale_factor`` is ignored (always 2), as in apex. Overflow flags stay on the device: the
skip is decided when ``optimizer.step()`` runs (one host read per step, not per backward).

FIX (opt-in, ``on_min_scale``, keyword-only, default ``"ignore"`` = apex): with a floor
(``min_loss_scale``), overflows that keep happening at the floor log a warning (``"warn"``) or
raise ``FloatingPointError`` (``"raise"``) through the core's floor policy
(:mod:`fp16kit.core.floor`), instead of apex's silent halving-and-skipping forever.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from ...core import kernels
from ...core.floor import FLOOR_POLICIES
from ...core.interrupts import hold_interrupts
from ..fp16_optimizer import AmpLossScaler, check_amp_settings
from ..loss_scaler import check_scale, check_window, pickled, pickled_attributes
from ._amp_state import _amp_state

__all__ = ["LossScaler", "refuse_if_broken"]

# the attributes every apex.amp.scaler.LossScaler pickled (also _min_loss_scale from 2019 on,
# _has_overflow and _overflow_buf, which a restored scaler does not need)
_PICKLED = ("dynamic", "_loss_scale", "_max_loss_scale", "_scale_seq_len", "_unskipped")


class LossScaler(AmpLossScaler):
    """apex's ``apex.amp.scaler.LossScaler`` (see the module docstring).

    Attributes scripts use: ``loss_scale()``, ``_loss_scale`` (read and write), ``_unskipped``,
    ``_scale_seq_len`` (read and write), ``dynamic``, ``_min_loss_scale``, ``_max_loss_scale``,
    ``update_scale()``, ``clear_overflow_state()``, ``_overflow_buf`` (read and write; see below).
    ``_min_loss_scale`` / ``_max_loss_scale`` (read and write) take what ``amp.initialize``
    takes (FIX: apex took NaN, negative or 0 bounds, which reached the scale at the next
    overflow or growth): a ValueError naming the valid range leaves them as they were. As in
    apex, a new bound applies at the next overflow or growth.

    ``_overflow_buf``: apex's int ``noop_flag`` buffer that ``update_scale()`` read. Here the
    scaler's own overflow flags live elsewhere; this buffer is an extra flag that
    ``update_scale()`` / the step's skip decision also honor (nonzero = overflow), and that
    ``clear_overflow_state()`` zeroes. Scripts swap their own in (NVIDIA's BERT
    ``run_pretraining.py``: ``scaler._overflow_buf = overflow_buf; scaler.update_scale()``
    after ``multi_tensor_applier(amp_C.multi_tensor_scale, overflow_buf, ...)``)."""

    warned_unscaling_non_fp32_grad = False

    def __init__(
        self,
        loss_scale: float | str,
        init_scale: float = 2.0**16,
        scale_factor: float = 2.0,
        scale_window: int = 2000,
        min_loss_scale: float | None = None,
        max_loss_scale: float = 2.0**24,
        *,
        on_min_scale: str = "ignore",
    ) -> None:
        _check_floor_policy(on_min_scale, min_loss_scale)
        # device=None: the scale is put on the device of the first loss it scales
        super().__init__(
            loss_scale,
            init_scale,
            2.0,
            scale_window,
            min_loss_scale,
            max_loss_scale,
            device=None,
            on_min_scale=on_min_scale,
        )
        self._flags: list[dict[torch.device, torch.Tensor]] = []  # this backward's found-inf flags
        self._static_scale = None if self.dynamic else float(loss_scale)  # host copy (never updated)
        self._overflow_buf_tensor: torch.Tensor | None = None  # apex's _overflow_buf, made on first read
        self._deferred: list[torch.Tensor] = []  # found flags of delay_overflow_check exits, not yet applied
        self.broken_by: str | None = None  # the call a second Ctrl-C broke off half way (see mark_broken)

    @property
    def _overflow_buf(self) -> torch.Tensor:
        if self._overflow_buf_tensor is None:
            self._overflow_buf_tensor = kernels.new_overflow_buf(self._device())
        return self._overflow_buf_tensor

    @_overflow_buf.setter
    def _overflow_buf(self, value: torch.Tensor) -> None:
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"LossScaler._overflow_buf must be a tensor (apex's int noop_flag), got {type(value).__name__}."
            )
        self._overflow_buf_tensor = value

    # ------------------------------------------------------------------ apex's attributes
    @property
    def _loss_scale(self) -> float:
        return self._state.get_scale()

    @_loss_scale.setter
    def _loss_scale(self, value: float) -> None:
        check_scale("_loss_scale", value)
        self._state.set_scale(float(value))
        self._static_scale = float(value)

    def is_static_one(self) -> bool:
        """A static scale of exactly 1.0 (scale_loss's short-circuit), without a device read."""
        return not self.dynamic and self._static_scale == 1.0

    @property
    def _unskipped(self) -> int:
        return self._state.get_growth_tracker() if self.dynamic else self._static_unskipped

    @_unskipped.setter
    def _unskipped(self, value: int) -> None:
        if self.dynamic:
            self._state.set_growth_tracker(int(value))
        else:
            self._static_unskipped = int(value)

    @property
    def _scale_seq_len(self) -> int:
        return self._state.growth_interval

    @_scale_seq_len.setter
    def _scale_seq_len(self, value: int) -> None:
        check_window("_scale_seq_len", value)
        self._state.growth_interval = int(value)

    @property
    def _min_loss_scale(self) -> float | None:
        return self._state.min_scale

    @_min_loss_scale.setter
    def _min_loss_scale(self, value: float | None) -> None:
        self._check_bounds(value, self._max_loss_scale)
        self._state.min_scale = float(value) if value else None

    @property
    def _max_loss_scale(self) -> float | None:
        return self._state.max_scale

    @_max_loss_scale.setter
    def _max_loss_scale(self, value: float | None) -> None:
        self._check_bounds(self._min_loss_scale, value)
        self._state.max_scale = None if value is None or value == math.inf else float(value)

    def _check_bounds(self, floor: float | None, cap: float | None) -> None:
        """ValueError, with amp.initialize's wording, for a floor or cap it refuses (a floor
        that is NaN, inf or negative; a cap that is NaN or <= 0; a floor above the cap), or no
        floor for an ``on_min_scale`` policy that watches one; nothing is changed then."""
        # the other settings passed are valid ones: only the floor and the cap are checked
        check_amp_settings("dynamic", 1.0, 2.0, 1, floor, cap)
        _check_floor_policy(self._state.on_min_scale, floor)

    # ------------------------------------------------------------------ one backward
    def scale_on(self, device: torch.device) -> torch.Tensor:
        """The scale tensor, materialized on ``device`` the first time."""
        self._state.materialize(device)
        return self.scale_tensor()

    def inv_scale(self) -> torch.Tensor:
        """float32 ``1/scale`` (device op)."""
        return kernels.inv_scale(self.scale_on(self._device()))

    def new_flag(self) -> torch.Tensor:
        """A fresh found-inf flag for this backward's unscale; recorded, checked by the update."""
        flag = kernels.new_found_inf(self._device())
        self._flags.append({flag.device: flag})
        return flag

    def record(self, flags: dict[torch.device, torch.Tensor]) -> None:
        if flags:
            self._flags.append(flags)

    def _device(self) -> torch.device:
        d = self._state.device
        return torch.device("cpu") if d is None else d

    def clear_overflow_state(self) -> None:
        self._flags = []
        if self._overflow_buf_tensor is not None:
            kernels.clear_overflow_buf_(self._overflow_buf_tensor)

    def take_found(self) -> torch.Tensor | None:
        """Return this backward's found-inf flag (a device tensor) when dynamic, None when static.

        This backward's found-inf flag (a device tensor, no host read) when dynamic, None
        when static (never skips); the recorded flags are consumed. Pass it to :meth:`update`."""
        flags = [f for per in self._flags for f in per.values()]
        self._flags = []
        if not self.dynamic:
            return None
        self._state.materialize(self._device())
        if self._overflow_buf_tensor is not None:
            flags.append(kernels.overflow_buf_as_found_inf(self._overflow_buf_tensor, self._device()))
        return kernels.combine_found_inf(flags, self._device())

    def update_async(self) -> torch.Tensor | None:
        """:meth:`take_found`, then one update of the rule on the device. Returns the flag."""
        found = self.take_found()
        self.update(found)
        return found

    def update_scale(self) -> bool:
        """apex's ``update_scale()``: apply the rule; return whether the step must be skipped.

        Reads the flag on the host. Flags deferred by ``scale_loss(...,
        delay_overflow_check=True)`` count here, once: they are consumed (zeroed in place, so the
        optimizer's next ``step()`` does not skip for them again) -- the script that delayed the
        check decided with this call (NVIDIA's BERT: no ``step()`` on overflow). One commit
        (a Ctrl-C during it is raised when it is whole; see :meth:`mark_broken`)."""
        refuse_if_broken([self])
        with hold_interrupts(_UPDATE, on_abandon=functools.partial(self.mark_broken, _UPDATE)):
            found = self.take_found()
            if found is not None and self._deferred:
                deferred, self._deferred = self._deferred, []
                found = kernels.combine_found_inf([found, *deferred], self._device())
                for flag in deferred:
                    kernels.clear_overflow_buf_(flag)
            self.update(found)
            return found is not None and bool(found.item())

    def defer(self, found: torch.Tensor) -> None:
        """Keep the found flag of a ``scale_loss(..., delay_overflow_check=True)`` exit for a later update.

        A ``scale_loss(..., delay_overflow_check=True)`` exit: keep its found flag for the
        script's own ``update_scale()`` (apex: no update at that exit), or, if the script calls
        ``step()`` first, for :meth:`apply_deferred` there (FIX: apex never updated then)."""
        self._deferred.append(found)

    def apply_deferred(self) -> None:
        """At ``optimizer.step()``: one scale update for the flags deferred since the last update.

        The step itself skips on them through the optimizer's pending flags."""
        if self._deferred:  # (inside the step's commit: a second Ctrl-C from here on marks this scaler)
            with hold_interrupts(
                "optimizer.step()", on_abandon=functools.partial(self.mark_broken, "optimizer.step()")
            ):
                deferred, self._deferred = self._deferred, []
                self.update(kernels.combine_found_inf(deferred, self._device()))

    # ------------------------------------------------------------------ a second Ctrl-C
    def mark_broken(self, what: str) -> None:
        """Mark this scaler broken: a second Ctrl-C broke off ``what`` half way.

        A second Ctrl-C broke off ``what`` (an amp commit that changes this scaler) half way:
        the scale and its counters are part old, part new. Until ``amp.load_state_dict`` restores
        this scaler (:meth:`restored`), amp's calls refuse (:func:`refuse_if_broken`)."""
        self.broken_by = what

    def restored(self) -> None:
        """Loaded from a checkpoint: whole again, with no backward in progress."""
        self.broken_by = None
        self._flags = []
        self._deferred = []

    def state_dict(self) -> dict[str, Any]:
        return super().state_dict()

    # ------------------------------------------------------------------ pickling
    def __getstate__(self) -> dict[str, Any]:
        """apex's attributes, as its ``LossScaler`` pickled them (plain data; ``on_min_scale``
        too when it is not the default): a pickle of this scaler reads as one of apex's, in
        :func:`fp16kit.legacy.load_checkpoint` and every ``load_state_dict``. Overflow flags of
        a backward in progress are not kept (apex cleared its own at the next backward)."""
        buf = self._overflow_buf_tensor
        state: dict[str, Any] = {
            "dynamic": self.dynamic,
            "_loss_scale": self._loss_scale,
            "_max_loss_scale": self._max_loss_scale,
            "_min_loss_scale": self._min_loss_scale,
            "_scale_seq_len": self._scale_seq_len,
            "_unskipped": self._unskipped,
            "_has_overflow": False,
            "_overflow_buf": kernels.new_overflow_buf(self._device()) if buf is None else buf,
        }
        if self._state.on_min_scale != "ignore":
            state["on_min_scale"] = self._state.on_min_scale
        return state

    def __setstate__(self, state: Any) -> None:
        """A working scaler from apex's attributes: what ``pickle`` (``torch.load(...,
        weights_only=False)``) makes of an ``apex.amp.scaler.LossScaler`` under fp16kit's apex
        alias (``fp16kit run``), and -- the alias puts this class on torch's weights-only list --
        what ``torch.load(f)``'s default makes of it there; also this class's own pickles. The
        scale is restored exactly (above ``max_loss_scale`` too, as apex kept it); apex's pickles
        from before it had ``min_loss_scale`` have no floor, as that apex had none.

        Only the attributes below are read, each checked to be what apex pickled (ValueError
        naming the one that is not): ``dynamic`` (a bool), ``_loss_scale`` (a finite number > 0),
        ``_max_loss_scale`` (> 0, inf or None: no cap), ``_min_loss_scale`` (absent, None or >= 0),
        ``_scale_seq_len`` (a whole number >= 1), ``_unskipped`` (an int >= 0), ``on_min_scale``
        (fp16kit's, absent or one of its policies) and ``_overflow_buf`` (absent, None or a tensor)."""
        a = pickled_attributes(self, state, _PICKLED)
        scale = pickled(self, a, "_loss_scale", "scale")
        buf = pickled(self, a, "_overflow_buf", "tensor", default=None)
        self.__init__(  # type: ignore[misc]
            "dynamic" if pickled(self, a, "dynamic", "flag") else scale,
            init_scale=scale,
            scale_window=int(pickled(self, a, "_scale_seq_len", "window")),
            min_loss_scale=pickled(self, a, "_min_loss_scale", "floor", default=None) or None,
            max_loss_scale=pickled(self, a, "_max_loss_scale", "cap"),
            on_min_scale=pickled(self, a, "on_min_scale", "floor policy", default="ignore"),
        )
        self._loss_scale = scale
        self._unskipped = pickled(self, a, "_unskipped", "count")
        if buf is not None:
            # a cleared buffer on the file's device, never the file's tensor itself: that one may
            # share storage with another tensor of the same file (clearing it would write there),
            # and apex cleared its flag at the next backward anyway
            self._overflow_buf = kernels.new_overflow_buf(buf.device)

    def __repr__(self) -> str:
        return f"LossScaler(dynamic={self.dynamic}, loss_scale={self.loss_scale()}, unskipped={self._unskipped})"


_UPDATE = "loss_scaler.update_scale()"
BROKEN = (
    "A second Ctrl-C broke off {what} half way, so {name} is part old, part new. "
    "Restore amp from the last checkpoint before training on: amp.load_state_dict(checkpoint['amp']) "
    "(and the optimizer's and the model's load_state_dict, as for a resumed run)."
)


def refuse_if_broken(scalers: list[LossScaler]) -> None:
    """Raise RuntimeError naming the fix if one of ``scalers`` was broken off by a second Ctrl-C.

    RuntimeError naming the fix if one of ``scalers`` was broken off by a second Ctrl-C
    (:meth:`LossScaler.mark_broken`); changes nothing."""
    for scaler in scalers:
        if getattr(scaler, "broken_by", None) is not None:
            index = next((i for i, s in enumerate(getattr(_amp_state, "loss_scalers", [])) if s is scaler), None)
            name = "amp's loss scaler" if index is None else f"amp's loss_scaler{index}"
            raise RuntimeError(BROKEN.format(what=scaler.broken_by, name=name))


def _check_floor_policy(on_min_scale: str, min_loss_scale: float | None) -> None:
    """A missing floor, named in amp's terms (apex's ``min_loss_scale=0`` meant no floor); the
    core checks the rest when the scaler is built (ValueError naming the choices)."""
    if on_min_scale != "ignore" and on_min_scale in FLOOR_POLICIES and not min_loss_scale:
        raise ValueError(
            f"on_min_scale={on_min_scale!r} needs a floor to watch: also pass min_loss_scale > 0 "
            "(the smallest loss scale you accept, e.g. min_loss_scale=1.0), or leave "
            "on_min_scale='ignore'."
        )
