"""Where one training step's gradients are: the stage of a MixedPrecisionOptimizer's step.

One :class:`StepState` per side: the main thread's (the iteration being built) is owned by the
optimizer, and a step job running on the optimizer thread owns one of its own (created by the
job, see :mod:`fp16kit.master_weights.async_step`), so no field is ever written by both threads. Only the
methods below write the fields::

    MODEL_GRADS ---- unscaled(flags) ----> UNSCALED ---- skip_decided() ----> SKIP_DECIDED
         |                                  ^     (a scaler read the flags: clean)
         +-- handed_off() --> HANDED_OFF ---+
             (submit_step: the raw, still scaled grads are in the masters)

    stepped(): SKIP_DECIDED/UNSCALED -> UNSCALED by the optimizer (a second step() applies
               the same unscaled grads, as torch's; a new backward is read again)
    reset(): back to MODEL_GRADS (zero_grad(), a hand-off to a job, a checkpoint load)

``UNSCALED`` records who unscaled (``by_scaler``: a GradScaler with its scale, or the optimizer
itself at scale 1) and which model grads were read (a :class:`TransferRecord`), so a step can
tell that the model grads changed since -- a new backward after ``scaler.unscale_(opt)``, or
clipping ``model.parameters()`` instead of the masters.
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Iterable
from typing import Any

import torch

from ..core import kernels

__all__ = ["Stage", "StepState", "TransferRecord"]


class Stage(enum.Enum):
    MODEL_GRADS = "the grads are in the model params"
    HANDED_OFF = "the raw (still scaled) grads are in the masters"
    UNSCALED = "the unscaled grads are in the masters, checked"
    SKIP_DECIDED = "checked, and a scaler found them clean"


class TransferRecord:
    """Which grad tensors (identity and version) an unscale read.

    So a later step can tell whether the model grads changed since (a new backward, an in-place edit)."""

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        self.entries: list[tuple[Any, int]] = []
        for p in params:
            g = p.grad
            self.entries.append((None, -1) if g is None else (weakref.ref(g), g._version))

    def matches(self, params: Iterable[torch.Tensor]) -> bool:
        params = list(params)
        if len(params) != len(self.entries):
            return False
        for p, (ref, version) in zip(params, self.entries):
            g = p.grad
            if g is None:
                if ref is not None:
                    return False
            elif ref is None or ref() is not g or g._version != version:
                return False
        return True


class StepState:
    """The stage of one step (see the module docstring)."""

    __slots__ = ("stage", "flags", "by_scaler", "transfer", "spent")

    def __init__(self) -> None:
        self.stage = Stage.MODEL_GRADS
        self.flags: dict[torch.device, torch.Tensor] = {}
        self.by_scaler = False
        self.transfer: TransferRecord | None = None
        self.spent = False  # the grads in the masters were stepped with already

    def reset(self) -> None:
        self.stage = Stage.MODEL_GRADS
        self.flags = {}
        self.by_scaler = False
        self.transfer = None
        self.spent = False

    def stepped(self) -> None:
        """Record a synchronous step: the masters keep their grads, no check or decision carries over.

        The masters keep the grads read from the model, as a plain optimizer's params keep theirs -- a second
        ``step()`` with no new backward applies them again (as torch) -- but no scaler's check or decision
        carries over."""
        if self.in_masters:
            self.stage = Stage.UNSCALED
            self.by_scaler = False
            self.spent = True
        else:
            self.reset()

    def handed_off(self) -> None:
        self.reset()
        self.stage = Stage.HANDED_OFF

    def unscaled(
        self,
        flags: dict[torch.device, torch.Tensor],
        *,
        by_scaler: bool,
        transfer: TransferRecord | None = None,
    ) -> None:
        self.stage = Stage.UNSCALED
        self.flags = flags
        self.by_scaler = by_scaler
        self.spent = False
        if transfer is not None:
            self.transfer = transfer

    def skip_decided(self) -> None:
        if self.stage is not Stage.UNSCALED:
            raise RuntimeError(f"internal: a skip was decided for grads that were not unscaled ({self.stage.name})")
        self.stage = Stage.SKIP_DECIDED

    @property
    def in_masters(self) -> bool:
        """Do the masters hold this step's unscaled, checked grads?"""
        return self.stage in (Stage.UNSCALED, Stage.SKIP_DECIDED)

    def current(self, params: Iterable[torch.Tensor]) -> bool:
        """Were the grads in the masters read from the model grads ``params`` hold now?

        (True when they were never read from the model: handed off.)"""
        return self.transfer is None or self.transfer.matches(params)

    def found_inf(self, device: torch.device) -> torch.Tensor | None:
        """The flags combined onto ``device`` (a new tensor), or None before any check."""
        if not self.flags:
            return None
        return kernels.combine_found_inf(self.flags.values(), device)

    def __repr__(self) -> str:
        who = " by the scaler" if self.by_scaler else ""
        return f"StepState({self.stage.name}{who if self.in_masters else ''})"
