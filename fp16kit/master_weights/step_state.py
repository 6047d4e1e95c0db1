"""Where one training step's gradients are: the step-state machine of a master-weight optimizer.

One :class:`StepState` per side: the main thread's (the iteration being built) is owned by the
optimizer, and a step job running on the optimizer thread owns one of its own (created with the
job, see :mod:`fp16kit.master_weights.async_step`), so no field is ever written by both threads.
The legacy ``FP16_Optimizer`` keeps its step in one too.

Stages and events. Every change of stage goes through :meth:`StepState._move`, which looks the
edge up in this table (``TRANSITIONS``); an edge that is not there raises ``RuntimeError("internal:
...")`` -- a bug of ours, never a user's misuse (misuse is refused before the state is touched)::

    event            from                                                  to
    ---------------  ----------------------------------------------------  ------------
    reset            any                                                   MODEL_GRADS
    handed_off       MODEL_GRADS                                           HANDED_OFF
    checked          any                                                   CHECKED
    unscaled         any                                                   UNSCALED
    skip_decided     UNSCALED                                              SKIP_DECIDED
                     STEPPED                                               STEPPED
    stepped          CHECKED, UNSCALED, SKIP_DECIDED, STEPPED              STEPPED
                     MODEL_GRADS, HANDED_OFF                               MODEL_GRADS
    submitted        CHECKED                                               STEPPED

    MODEL_GRADS --handed_off--> HANDED_OFF --unscaled--+
        |  +----------------------unscaled-------------+--> UNSCALED --skip_decided--> SKIP_DECIDED
        |                                                      |                         |
        +--checked--> CHECKED --submitted--> STEPPED <--stepped+-------------------------+
                                             (a new backward: unscaled or checked again)
    reset (zero_grad, a hand-off, a checkpoint load): any stage --> MODEL_GRADS

* ``reset``: ``zero_grad()`` (``cleared=`` says how), a hand-off to a job, a checkpoint load.
* ``handed_off``: in a ``submit_step`` job, the raw (still scaled) grads are in the masters.
* ``checked``: the model grads were checked for inf/NaN where they are and nothing moved yet
  (the legacy ``update_master_grads`` with ``async_step``); ``prepared`` holds what the step
  will submit. From any stage, as ``unscaled``: grads read again replace what was read.
* ``unscaled``: the unscaled grads are in the masters, checked. It records who unscaled
  (``by_scaler``: a GradScaler with its scale, or the optimizer itself at scale 1) and which
  model grads were read (a :class:`TransferRecord`), so a step can tell that the model grads
  changed since -- a new backward after ``scaler.unscale_(opt)``, or clipping
  ``model.parameters()`` instead of the masters. From any stage: grads read again (a second
  backward, a closure's evaluation, a new iteration after a step taken around this state by
  a wrapper that calls ``inner_step`` -- the legacy ``FP16_Optimizer``) replace what was read.
* ``skip_decided``: a scaler read the flags and found them clean; the step reads none. In
  STEPPED (``scaler.unscale_(opt)``, ``opt.step()``, then ``scaler.step(opt)``) the grads were
  stepped with already and stay so: the next step applies them again, as torch's would.
* ``stepped``: a synchronous step ran (from CHECKED: the fused kernel took the grads from the model,
  :mod:`fp16kit.master_weights.fused_step`). The masters keep the grads it read, as a plain
  optimizer's params keep theirs -- a second ``step()`` with no new backward applies them
  again (as torch) -- but no scaler's check or decision carries over. ``submitted``: a checked
  step went to the optimizer thread.

Two values outlive the stage, as apex's attributes do: ``verdict`` (the last check's inf/NaN
result, apex's ``overflow``, read from the device once) and ``cleared`` (how ``zero_grad()``
cleared the grads since the last step, until that step is taken). ``first_closure`` is apex's
``first_closure_call_this_step``: False from a closure's first evaluation to the end of its
``step(closure)``; no event changes it.
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Iterable
from typing import Any

import torch

from ..core import kernels

__all__ = ["Stage", "StepState", "TransferRecord", "TRANSITIONS"]


class Stage(enum.Enum):
    """The stages of a step (see the module docstring)."""

    MODEL_GRADS = "the grads are in the model params"
    HANDED_OFF = "the raw (still scaled) grads are in the masters"
    CHECKED = "the model grads were checked where they are; nothing moved yet"
    UNSCALED = "the unscaled grads are in the masters, checked"
    SKIP_DECIDED = "checked, and a scaler found them clean"
    STEPPED = "a step applied the grads in the masters"


_ANY = frozenset(Stage)
_M, _H, _C, _U, _S, _T = (
    Stage.MODEL_GRADS,
    Stage.HANDED_OFF,
    Stage.CHECKED,
    Stage.UNSCALED,
    Stage.SKIP_DECIDED,
    Stage.STEPPED,
)
TRANSITIONS: dict[str, dict[Stage, Stage]] = {
    "reset": dict.fromkeys(_ANY, _M),
    "handed_off": {_M: _H},
    "checked": dict.fromkeys(_ANY, _C),
    "unscaled": dict.fromkeys(_ANY, _U),
    "skip_decided": {_U: _S, _T: _T},
    "stepped": {**dict.fromkeys((_C, _U, _S, _T), _T), _M: _M, _H: _M},
    "submitted": {_C: _T},
}
"""``event -> {from stage: to stage}``: the machine's every edge (the module docstring's table)."""


class TransferRecord:
    """Which grad tensors (identity and version) an unscale read.

    So a later step can tell whether the model grads changed since (a new backward, an in-place edit)."""

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        self.entries: list[tuple[Any, int]] = []
        for p in params:
            g = p.grad
            self.entries.append((None, -1) if g is None else (weakref.ref(g), g._version))

    def matches(self, params: Iterable[torch.Tensor]) -> bool:
        """Do ``params`` hold the very grads (same tensors, same versions) this record read?"""
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
    """The stage of one step and what it carries (see the module docstring)."""

    __slots__ = ("stage", "flags", "by_scaler", "transfer", "prepared", "cleared", "first_closure", "_verdict")

    def __init__(self) -> None:
        self.stage = Stage.MODEL_GRADS
        self.flags: dict[torch.device, torch.Tensor] = {}
        self.by_scaler = False
        self.transfer: TransferRecord | None = None
        self.prepared: Any = None  # CHECKED: what the step will submit
        self.cleared: str | None = None  # "none" / "zero": how zero_grad() cleared the grads since the last step
        self.first_closure = True  # apex's first_closure_call_this_step (see the module docstring)
        self._verdict: bool | torch.Tensor = False

    def _move(self, event: str) -> None:
        """Take ``event``'s edge from the current stage (the one place the stage changes)."""
        to = TRANSITIONS[event].get(self.stage)
        if to is None:
            raise RuntimeError(f"internal: step-state event {event!r} is not allowed in stage {self.stage.name}")
        self.stage = to

    # ------------------------------------------------------------------ events
    def reset(self, *, cleared: str | None = None) -> None:
        """Back to MODEL_GRADS: nothing of this step is in the masters (``cleared``: by ``zero_grad()``, how)."""
        self._move("reset")
        self.flags = {}
        self.by_scaler = False
        self.transfer = None
        self.prepared = None
        self.cleared = cleared

    def handed_off(self) -> None:
        """The raw, still scaled grads were moved into the masters (a ``submit_step`` job)."""
        self._move("handed_off")

    def checked(
        self,
        flags: dict[torch.device, torch.Tensor],
        *,
        prepared: Any,
        verdict: Any,
        transfer: TransferRecord | None = None,
    ) -> None:
        """The model grads were checked where they are (``flags``); ``prepared`` is what the step will submit.

        ``transfer``: which model grads were checked, when the step takes them from the model (the fused kernel)."""
        self._move("checked")
        self.flags = flags
        self.prepared = prepared
        self._verdict = verdict
        self.transfer = transfer

    def unscaled(
        self,
        flags: dict[torch.device, torch.Tensor],
        *,
        by_scaler: bool,
        transfer: TransferRecord | None = None,
        verdict: Any = None,
    ) -> None:
        """The unscaled grads are in the masters, checked (``flags``); see the module docstring."""
        self._move("unscaled")
        self.flags = flags
        self.by_scaler = by_scaler
        if transfer is not None:
            self.transfer = transfer
        if verdict is not None:
            self._verdict = verdict

    def skip_decided(self) -> None:
        """A scaler read the flags and found them clean."""
        self._move("skip_decided")

    def stepped(self) -> None:
        """Record a synchronous step (see the module docstring); from MODEL_GRADS or HANDED_OFF, a reset."""
        if self.stage in (Stage.MODEL_GRADS, Stage.HANDED_OFF):
            self.reset()
            self._move("stepped")
            return
        self._move("stepped")
        self.by_scaler = False
        self._end_of_step()

    def submitted(self) -> None:
        """A CHECKED step went to the optimizer thread; its verdict stays readable."""
        self._move("submitted")
        self.flags = {}
        self.transfer = None
        self._end_of_step()

    def _end_of_step(self) -> None:
        self.prepared = None
        self.cleared = None

    # ------------------------------------------------------------------ reading
    @property
    def in_masters(self) -> bool:
        """Do the masters hold this step's unscaled, checked grads?"""
        return self.stage in (Stage.UNSCALED, Stage.SKIP_DECIDED, Stage.STEPPED)

    @property
    def spent(self) -> bool:
        """Were the grads in the masters stepped with already?"""
        return self.stage is Stage.STEPPED

    @property
    def read_since_step(self) -> bool:
        """Were grads read (checked or unscaled) since the last step?"""
        return self.stage in (Stage.CHECKED, Stage.UNSCALED, Stage.SKIP_DECIDED)

    @property
    def verdict(self) -> bool:
        """The last check's result (True: inf/NaN), read from the device once."""
        if isinstance(self._verdict, torch.Tensor):
            self._verdict = bool(self._verdict.item())
        return self._verdict

    @verdict.setter
    def verdict(self, value: bool) -> None:
        self._verdict = bool(value)

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
        who = " by the scaler" if self.by_scaler and self.in_masters else ""
        return f"StepState({self.stage.name}{who})"
