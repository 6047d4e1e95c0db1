"""The one contract between a loss scaler and an optimizer that keeps master weights.

``torch.amp.GradScaler`` unscales ``param.grad`` in place and then calls ``optimizer.step()``.
An optimizer that steps fp32 *masters* of fp16/bf16 params (fp16kit's
``MixedPrecisionOptimizer``, the legacy ``FP16_Optimizer``) must instead receive the unscaled
gradients in its masters, and may run its step on another thread. :class:`MasterWeightOptimizer`
is what such an optimizer offers, and what :class:`fp16kit.GradScaler` calls::

    scaler.unscale_(opt)   ->  flags = opt.unscale_grads_(inv_scale, found_inf)
                               (model grads * inv_scale into the masters; fp32 params' grads
                               in place; {device: found_inf}; no host sync)
    scaler.step(opt)       ->  if opt.submits_steps():            # asynchronous (mode 1)
                                   flags = opt.submit_scaled_step(scale, unscaled_flags=...,
                                                                  reduce=...)
                               else:
                                   unscale_ (above) unless done; read the flags on the host
                                   if clean: opt.skip_decided(); opt.step(*args)

``skip_decided()`` tells the optimizer that the scaler read this iteration's flags and found
them clean, so its ``step()`` does not read them a second time. ``opt.step()`` is still what
runs the step (code that wraps ``optimizer.step`` -- profilers, Accelerate -- sees it).

Optimizers with torch's own protocol (``_step_supports_amp_scaling``, ``grad_scale`` /
``found_inf`` attributes: the fused Adam/AdamW/SGD) keep it; a master-weight optimizer over a
fused inner optimizer speaks both.

:class:`ScaledIterations` lets an optimizer notice the mistake the two objects can only see
together: ``scaler.scale(loss).backward()`` followed by ``opt.step()`` instead of
``scaler.step(opt)`` (the grads are applied ``scale`` times too large).
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch

if sys.version_info >= (3, 10):
    from typing import TypeGuard
else:  # a dependency of torch
    from typing_extensions import TypeGuard

__all__ = ["MasterWeightOptimizer", "ScaledIterations", "scaled_iterations", "speaks_master_protocol"]

Flags = dict[torch.device, torch.Tensor]


@runtime_checkable
class MasterWeightOptimizer(Protocol):
    """An optimizer that steps master copies of the model params (see the module docstring)."""

    def unscale_grads_(self, inv_scale: torch.Tensor, found_inf: torch.Tensor) -> Flags:
        """Put this iteration's grads, times ``inv_scale``, where the optimizer steps them.

        Flags inf/NaN; returns ``{device: found_inf}``. No host sync."""
        ...

    def skip_decided(self) -> None:
        """Record that the scaler read this iteration's flags and found them clean.

        The next ``step()`` steps without reading them again."""
        ...

    def submits_steps(self) -> bool:
        """Say whether ``step()`` called from here hands the step to an optimizer thread.

        When True, the scaler calls :meth:`submit_scaled_step` instead of reading any flag on the host."""
        ...

    def submit_scaled_step(
        self,
        scale: torch.Tensor,
        *,
        unscaled_flags: Flags | None,
        reduce: Callable[[Flags], Flags],
    ) -> Flags:
        """Check this iteration's grads on their device and hand them to the optimizer thread; return the flags.

        ``reduce`` may all-reduce the flags. On the thread the grads are unscaled with ``scale`` and stepped
        unless a flag is set. ``unscaled_flags``: ``unscale_grads_`` ran already (they are its flags). No host
        sync."""
        ...


_SPEAKS: dict[type, bool] = {}


def speaks_master_protocol(optimizer: object) -> TypeGuard[MasterWeightOptimizer]:
    """Return ``isinstance(optimizer, MasterWeightOptimizer)``, cached per type.

    A runtime-checkable Protocol check looks up every method (tens of microseconds), and GradScaler asks
    several times per step. (The protocol's methods are the class's; an instance that gains them as attributes
    later is not seen.)"""
    kind = type(optimizer)
    speaks = _SPEAKS.get(kind)
    if speaks is None:
        speaks = _SPEAKS[kind] = isinstance(optimizer, MasterWeightOptimizer)
    return speaks


class ScaledIterations:
    """Which scalers have scaled a loss since their last ``update()``, per process.

    A scaler calls :meth:`opened` from ``scale()`` and :meth:`closed` from ``update()``; a
    master-weight optimizer whose ``step()`` runs with no scaler involved asks :meth:`any_open`
    to warn that the gradients are probably still scaled. Weak references: a scaler that is
    dropped mid-iteration is forgotten."""

    def __init__(self) -> None:
        self._open: weakref.WeakSet[Any] = weakref.WeakSet()
        self._lock = threading.Lock()

    def opened(self, scaler: Any) -> None:
        if scaler not in self._open:  # the common case reads only
            with self._lock:
                self._open.add(scaler)

    def closed(self, scaler: Any) -> None:
        with self._lock:
            self._open.discard(scaler)

    def any_open(self) -> bool:
        with self._lock:
            return len(self._open) > 0


scaled_iterations = ScaledIterations()
"""The process-wide registry :class:`fp16kit.GradScaler` reports to."""
