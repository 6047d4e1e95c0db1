"""Which ``MixedPrecisionOptimizer`` steps an optimizer from ``configure_optimizers``.

``MasterWeightsPrecision.connect`` wraps each plain optimizer in a MixedPrecisionOptimizer, which
puts the fp32 masters into the optimizer's param groups in place. An optimizer that comes back
from ``configure_optimizers`` in a later fit (built once in ``__init__``/``setup`` and returned
again: ``trainer.fit`` twice, a new Trainer on the same module) already steps masters: wrapping it
again would build a wrapper with no masters (the fp16 grads would never reach the optimizer: fp16
raised "No inf checks were recorded", bf16 silently stopped training). :func:`wrap` returns the
wrapper made for it before (state and masters continue), refusing other master options.
"""

from __future__ import annotations

from .._requires import require

require("lightning.pytorch", extra="lightning", tested=("2.6", "2.7"))

import weakref  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from lightning.pytorch.core.optimizer import LightningOptimizer, _MockOptimizer  # noqa: E402

from ... import MixedPrecisionOptimizer  # noqa: E402

__all__ = ["is_mock", "master_optimizer", "state_to_masters", "wrap", "wrapped_before"]

# inner optimizer -> (its wrapper, the options it was built with); weak both ways
_Entry = tuple["weakref.ref[MixedPrecisionOptimizer]", dict[str, Any]]
_WRAPPED: weakref.WeakKeyDictionary[torch.optim.Optimizer, _Entry] = weakref.WeakKeyDictionary()


def wrap(optimizer: torch.optim.Optimizer, options: dict[str, Any]) -> MixedPrecisionOptimizer:
    """The MixedPrecisionOptimizer over ``optimizer``: the one made before, or a new one."""
    before = wrapped_before(optimizer, options)
    if before is not None:
        return before
    opt = MixedPrecisionOptimizer(optimizer, **options)
    _WRAPPED[optimizer] = (weakref.ref(opt), dict(options))
    return opt


def wrapped_before(optimizer: Any, options: dict[str, Any]) -> MixedPrecisionOptimizer | None:
    """The wrapper an earlier fit made for ``optimizer`` (None if none).

    Other options raise ValueError (call it for every optimizer before wrapping any:
    nothing changes then)."""
    try:
        entry = _WRAPPED.get(optimizer)
    except TypeError:  # not weak-referenceable: never wrapped here
        return None
    if entry is None:
        return None
    before = entry[0]()
    if before is not None and entry[1] != options:
        raise ValueError(
            f"configure_optimizers returned a {type(optimizer).__name__} that an earlier fit "
            f"wrapped with master options {entry[1]}; this MasterWeightsPrecision asks for "
            f"{options}. Use the same options, or build a new optimizer in configure_optimizers."
        )
    return before


def is_mock(optimizer: Any) -> bool:
    """Whether ``optimizer`` is Lightning's stand-in for a fit without an optimizer.

    Whether ``optimizer`` is what Lightning steps when ``configure_optimizers`` returned None
    (``lightning.pytorch.core.optimizer._MockOptimizer``, lightning 2.6.6: a private name; the
    test of a fit without an optimizer fails if it moves). Not wrapped: nothing to step."""
    opt = optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
    return isinstance(opt, _MockOptimizer)


def master_optimizer(optimizer: Any) -> MixedPrecisionOptimizer:
    opt = optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
    if not isinstance(opt, MixedPrecisionOptimizer):
        raise TypeError(
            f"MasterWeightsPrecision steps MixedPrecisionOptimizers, got {type(opt).__name__}: it "
            "wraps the optimizers from configure_optimizers at setup; an optimizer made after "
            "that must be wrapped by you (fp16kit.MixedPrecisionOptimizer(opt))."
        )
    return opt


def state_to_masters(opt: MixedPrecisionOptimizer) -> None:
    """Move optimizer state back next to the masters when something moved it.

    Lightning's ``_optimizer_to_device`` moves it after loading, and its teardown: torch's
    load_state_dict re-places
    each param's floating state on its param's device, as MixedPrecisionOptimizer's own
    constructor does."""
    inner = opt.optimizer
    moved = any(
        isinstance(v, torch.Tensor) and k != "step" and v.device != p.device
        for p, s in inner.state.items()
        if isinstance(p, torch.Tensor) and isinstance(s, dict)
        for k, v in s.items()
    )
    if moved:
        inner.load_state_dict(inner.state_dict())
