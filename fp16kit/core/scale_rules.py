"""The loss-scale rules: one small object per scaler whose arithmetic fp16kit reproduces.

A rule is a pure function from the device state to the next one: given the scale, the two
trackers (0-dim tensors) and the step's overflow flag, :meth:`ScaleRule.step` returns the next
values, built with device ops only (``torch.where``, never a host read). The owner
(:class:`fp16kit.core.scale.LossScale`) copies them back in place.

What every rule shares is written once, in :meth:`ScaleRule.step`; a rule decides only what
differs, each with its pseudo-code in its docstring:

* its defaults for the bounds, and whether the initial scale starts inside them;
* its backed-off value, its growth condition and its growth-tracker update;
* (torch's) whether torch's fused kernel can do the whole update.

Products and quotients are taken in float64 and rounded once to the scale's dtype by the
owner's ``copy_``: what torch's kernel does (float scale times double factor) and what Python
floats did in apex.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal, NamedTuple, Protocol

import torch

__all__ = [
    "Rule",
    "RULES",
    "ScaleRule",
    "TorchRule",
    "ApexRule",
    "ApexAmpRule",
    "ScaleSettings",
    "FixedSettings",
    "Trackers",
    "Step",
    "rule_named",
]

Rule = Literal["torch", "apex", "apex_amp"]


class ScaleSettings(Protocol):
    """The knobs a rule reads at each update.

    A :class:`~fp16kit.core.scale.LossScale` itself (so assigning e.g. its ``growth_factor`` takes effect at
    the next update), or :class:`FixedSettings` to use a rule on its own. ``consecutive_hysteresis`` may be
    absent (objects written before it existed): it then counts as False."""

    growth_factor: float
    backoff_factor: float
    growth_interval: int
    hysteresis: int
    consecutive_hysteresis: bool
    min_scale: float | None
    max_scale: float | None
    dtype: torch.dtype


@dataclass(frozen=True)
class FixedSettings:
    """A :class:`ScaleSettings` that does not change.

    ``consecutive_hysteresis`` comes last, so positional arguments written before it existed keep their
    meaning."""

    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    hysteresis: int = 1
    min_scale: float | None = None
    max_scale: float | None = None
    dtype: torch.dtype = torch.float32
    consecutive_hysteresis: bool = False


class Trackers(Protocol):
    """The device state a rule reads: 0-dim tensors."""

    scale: torch.Tensor | None
    growth_tracker: torch.Tensor | None
    hysteresis_tracker: torch.Tensor | None


class Step(NamedTuple):
    """One update's result, not yet written back."""

    scale: torch.Tensor  # float64; the owner rounds it to its dtype
    growth_tracker: torch.Tensor  # int32
    hysteresis_tracker: torch.Tensor  # int32
    backed_off: torch.Tensor  # bool: this step backed off (the floor watch counts these)
    scale_before: torch.Tensor  # float64 view of the scale the step started from


class ScaleRule:
    """What all rules share, around the hooks each rule fills in.

    The hooks: ``backed_off``, ``grows``, ``next_tracker``, ``accepts``. With ``hysteresis = H`` (default 1)
    and ``used_scale`` (default: the scale itself)::

        hysteresis_tracker = max(hysteresis_tracker - 1, 0) if overflow else hysteresis_tracker
        backing_off = overflow and hysteresis_tracker == 0
        backed = rule.backed_off(used_scale)
        if used_scale was given: backed = min(backed, scale)   # never back one scale off twice
        if backing_off: scale = max(backed, min_scale)          # min_scale: when set
        counted = 0 if overflow else growth_tracker + 1
        grow = rule.grows(overflow, counted)
        if grow and rule.accepts(new := min(scale * growth_factor, max_scale)):
            scale = new
        if grow or (consecutive_hysteresis and not overflow):
            hysteresis_tracker = H                                 # re-armed
        growth_tracker = rule.next_tracker(grow, counted)

    so H = 1 backs off at every overflow; H = N tolerates N - 1 overflows between growths
    (Megatron-LM's and DeepSpeed's hysteresis), or, with ``consecutive_hysteresis``, N - 1
    overflows in a row (any clean step re-arms it: their ``consecutive_hysteresis=True``).
    """

    name: ClassVar[str]

    # ---------------------------------------------------------------- settings
    def bounds(self, min_scale: float | None, max_scale: float | None) -> tuple[float | None, float | None]:
        """The bounds after this rule's defaults (``None``: unbounded)."""
        return min_scale, max_scale

    def initial_scale(self, init_scale: float, min_scale: float | None, max_scale: float | None) -> float:
        """Where the scale starts: inside the bounds (apex's amp scaler took ``min(max_loss_scale, init_scale)``)."""
        if max_scale is not None and init_scale > max_scale:
            init_scale = max_scale
        if min_scale is not None and init_scale < min_scale:
            init_scale = min_scale
        return init_scale

    def check(self, growth_interval: object) -> None:
        """Raise ``ValueError`` if this rule cannot work with these settings."""

    # ---------------------------------------------------------------- the update
    def update_fused(self, state: Trackers, found_inf: torch.Tensor, settings: ScaleSettings) -> bool:
        """Do the whole update in one fused kernel if one exists for these settings (in place).

        Returns False if not, and :meth:`step` must do it."""
        return False

    def step(
        self,
        state: Trackers,
        found: torch.Tensor,
        settings: ScaleSettings,
        *,
        used_scale: torch.Tensor | None = None,
    ) -> Step:
        """One update (see the class docstring).

        ``found``: 0-dim bool, the step overflowed; ``used_scale``: float64, the scale the overflowing loss
        was multiplied by."""
        assert state.scale is not None and state.growth_tracker is not None
        assert state.hysteresis_tracker is not None
        k = settings
        s = state.scale.double()
        hyst = torch.where(found, (state.hysteresis_tracker - 1).clamp_min(0), state.hysteresis_tracker)
        backoff = found & (hyst == 0)

        backed = self.backed_off(s if used_scale is None else used_scale, k)
        if used_scale is not None:
            backed = torch.minimum(backed, s)
        if k.min_scale is not None:
            backed = backed.clamp_min(k.min_scale)
        after_backoff = torch.where(backoff, backed, s)

        # counted in int64: compared with an int32 tensor, a growth_interval >= 2**31 wrapped
        # around (sys.maxsize became -1: the scale grew at every clean step)
        counted = torch.where(found, 0, state.growth_tracker.long() + 1)
        grow = self.grows(found, counted, k)
        grown = after_backoff * k.growth_factor
        if k.max_scale is not None:
            grown = grown.clamp_max(k.max_scale)
        new_scale = torch.where(self.accepts(grow, grown, k), grown, after_backoff)
        # a settings object written before the setting existed lacks it: False, as it behaved
        rearm = (grow | ~found) if getattr(k, "consecutive_hysteresis", False) else grow
        new_hyst = torch.where(rearm, k.hysteresis, hyst)
        return Step(new_scale, self.next_tracker(grow, counted).int(), new_hyst, backoff, s)

    # ---------------------------------------------------------------- the hooks
    def backed_off(self, scale: torch.Tensor, settings: ScaleSettings) -> torch.Tensor:
        """The scale after one back-off from ``scale`` (float64), before the bounds."""
        raise NotImplementedError

    def grows(self, found: torch.Tensor, counted: torch.Tensor, settings: ScaleSettings) -> torch.Tensor:
        """Whether the scale grows now; ``counted``: the growth tracker with this step counted (0 after an overflow)."""
        raise NotImplementedError

    def next_tracker(self, grow: torch.Tensor, counted: torch.Tensor) -> torch.Tensor:
        """The growth tracker after the step: counting starts again at each growth."""
        return torch.where(grow, 0, counted)

    def accepts(self, grow: torch.Tensor, grown: torch.Tensor, settings: ScaleSettings) -> torch.Tensor:
        """Whether a growth is applied (it always is, unless the rule says otherwise)."""
        return grow

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class TorchRule(ScaleRule):
    """torch.amp.GradScaler (``torch._amp_update_scale_``)::

        if overflow:
            growth_tracker = 0
            if backing off: scale = max(scale * backoff_factor, min_scale)
        else:
            growth_tracker += 1
            if growth_tracker == growth_interval:
                growth_tracker = 0
                new = min(scale * growth_factor, max_scale)
                if isfinite(new): scale = new          # never grow to inf

    With ``hysteresis=1``, no bounds and a float32 scale this is exactly torch's fused
    kernel, which then does the update.
    """

    name = "torch"

    def fuses(self, settings: ScaleSettings) -> bool:
        """Whether torch's kernel does exactly this update: none of fp16kit's extras on."""
        k = settings
        return k.hysteresis == 1 and k.min_scale is None and k.max_scale is None and k.dtype == torch.float32

    def update_fused(self, state: Trackers, found_inf: torch.Tensor, settings: ScaleSettings) -> bool:
        if not self.fuses(settings):
            return False
        k = settings
        assert state.scale is not None and state.growth_tracker is not None
        torch._amp_update_scale_(
            state.scale, state.growth_tracker, found_inf, k.growth_factor, k.backoff_factor, k.growth_interval
        )
        return True

    def backed_off(self, scale: torch.Tensor, settings: ScaleSettings) -> torch.Tensor:
        return scale * settings.backoff_factor

    def grows(self, found: torch.Tensor, counted: torch.Tensor, settings: ScaleSettings) -> torch.Tensor:
        return ~found & (counted == settings.growth_interval)

    def accepts(self, grow: torch.Tensor, grown: torch.Tensor, settings: ScaleSettings) -> torch.Tensor:
        # torch's kernel refuses a growth to inf in the scale's own dtype (float32)
        return grow & torch.isfinite(grown.to(settings.dtype))


class ApexRule(ScaleRule):
    """The rule of apex.fp16_utils.DynamicLossScaler.

    ``growth_factor`` is apex's ``scale_factor``, ``growth_interval`` its ``scale_window``; growth_tracker
    equals apex's ``cur_iter - last_overflow_iter - 1``; ``min_scale`` defaults to 1; the initial scale is
    taken as given, even outside the bounds::

        if overflow:
            growth_tracker = 0
            if backing off: scale = max(scale / growth_factor, min_scale)
        else:
            growth_tracker += 1                        # not reset on growth: a modulo rule
            if growth_tracker % growth_interval == 0:
                scale = min(scale * growth_factor, max_scale)    # no cap by default
    """

    name = "apex"

    def bounds(self, min_scale: float | None, max_scale: float | None) -> tuple[float | None, float | None]:
        return (1.0 if min_scale is None else min_scale), max_scale

    def initial_scale(self, init_scale: float, min_scale: float | None, max_scale: float | None) -> float:
        return init_scale  # apex's fp16_utils scaler started where it was told

    def check(self, growth_interval: object) -> None:
        if not isinstance(growth_interval, int) or growth_interval < 1:
            raise ValueError(
                f"The apex rule grows the scale every `scale_window` clean steps (a modulo), so "
                f"scale_window must be an int >= 1, got {growth_interval!r}."
            )

    def backed_off(self, scale: torch.Tensor, settings: ScaleSettings) -> torch.Tensor:
        return scale / settings.growth_factor

    def grows(self, found: torch.Tensor, counted: torch.Tensor, settings: ScaleSettings) -> torch.Tensor:
        return ~found & (counted % settings.growth_interval == 0)

    def next_tracker(self, grow: torch.Tensor, counted: torch.Tensor) -> torch.Tensor:
        return counted


class ApexAmpRule(ScaleRule):
    """The rule of apex.amp.scaler.LossScaler, driven by apex's FP16_Optimizer.

    ``max_scale`` defaults to 2**24 (``float("inf")`` for no cap), and a ``min_scale`` of 0 means none, as in
    apex::

        if overflow:
            growth_tracker = 0
            if backing off: scale = max(scale / growth_factor, min_scale)
        else:
            growth_tracker += 1
        if growth_tracker == growth_interval:          # checked after either branch
            growth_tracker = 0
            scale = min(scale * growth_factor, max_scale)
    """

    name = "apex_amp"

    def bounds(self, min_scale: float | None, max_scale: float | None) -> tuple[float | None, float | None]:
        # apex tested `if self._min_loss_scale:`, so 0 meant no floor
        return (min_scale or None), (2.0**24 if max_scale is None else max_scale)

    def backed_off(self, scale: torch.Tensor, settings: ScaleSettings) -> torch.Tensor:
        return scale / settings.growth_factor

    def grows(self, found: torch.Tensor, counted: torch.Tensor, settings: ScaleSettings) -> torch.Tensor:
        return counted == settings.growth_interval


_BY_NAME: dict[str, ScaleRule] = {r.name: r for r in (TorchRule(), ApexRule(), ApexAmpRule())}
RULES: tuple[str, ...] = tuple(_BY_NAME)


def rule_named(name: str) -> ScaleRule:
    """The rule object for ``LossScale(rule=name)``; ``ValueError`` naming the choices."""
    try:
        return _BY_NAME[name]
    except (KeyError, TypeError):
        raise ValueError(f"rule must be one of {RULES}, got {name!r}.") from None
