"""The two sides of a MixedPrecisionOptimizer with asynchronous steps, and what each owns.

A call runs on one of two sides, and each side writes only objects of its own::

    main thread: MainSide (one per optimizer)      optimizer thread: StepJob (one per step)
    --------------------------------------------   --------------------------------------------
    state     the step being built (StepState)      state   the job's own StepState
    inflight  the job of the last step, until       groups  the param groups it steps (a snapshot
              waited for                                    of the hyperparameters, or None)
    landing, land_pending, deferred, staging,       work    its arguments, one record:
    handed_off  (see AsyncSteps)                            MasterStep (mode 1) | SubmittedCall (mode 2)

Which side: :meth:`~fp16kit.master_weights.async_step.AsyncSteps.side` is the one place that says
it. A job publishes itself in a :class:`contextvars.ContextVar` for as long as it runs (a context
is per thread, so the main thread never sees it): code the job runs -- ``scaler.step(opt)``,
``opt.zero_grad()`` in a ``submit_step`` function -- gets that job. Code on the optimizer thread
outside a job of this optimizer (a bound scaler's step run there for a waiting main thread,
another optimizer's job) gets the optimizer's *standing* job, a StepJob with no work. Everything
else is the main side.

Ownership by structure: a :class:`StepJob` is frozen -- made on the main thread with its
arguments, then only its ``state`` changes, on the optimizer thread -- and a :class:`MainSide` is
reached only through ``side()`` on the main thread. Shared by design (set once, from either
thread): the warn-once :class:`threading.Event` latches.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from .step_state import StepState

__all__ = ["Handoff", "MainSide", "MasterStep", "StepJob", "SubmittedCall", "running_job"]


@dataclass
class Handoff:
    """This step's gradients, owned by the job: per model param a tensor or None."""

    grads: list[torch.Tensor | None]
    event: Any = None  # CUDA event after the copies into pinned buffers (CPU offload)


@dataclass(frozen=True)
class MasterStep:
    """Mode 1's job: skip on ``found``, else unscale the handed-off grads into the masters and step.

    ``handoff`` None: the masters hold this step's unscaled grads already (``scaler.unscale_``). Else
    the grads are unscaled by ``inv`` (1/scale), or -- ``inv`` None -- by the reciprocal of
    ``scale``, which the job takes off the main thread (or hands to a fused optimizer).
    ``missing_grads``: what a master whose param got no grad holds (``"none"``, ``"zero"``,
    ``"keep"``); ``on_skip`` runs when the step is skipped. ``land``: the job first lands the step
    before it (the masters into the model params), skipped or not -- only a job run inline, whose
    landing :class:`~fp16kit.master_weights.async_step.AsyncSteps` left to it (the kernel does both
    in one pass)."""

    handoff: Handoff | None
    found: torch.Tensor
    missing_grads: str = "none"
    on_skip: Callable[[], Any] | None = None
    inv: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    land: bool = False


@dataclass(frozen=True)
class SubmittedCall:
    """Mode 2's job: the raw (still scaled) grads into the master grads, then ``fn()``."""

    handoff: Handoff
    fn: Callable[[], Any]
    missing_grads: str = "none"


@dataclass(frozen=True)
class StepJob:
    """The optimizer-thread side: one step job (or, with no ``work``, an optimizer's standing job).

    ``owner``: the AsyncSteps whose step it is. ``groups``: the param groups it steps (None: the
    optimizer's live groups, see ``StepView.applies_to``)."""

    owner: Any
    work: MasterStep | SubmittedCall | None = None
    groups: list[dict[str, Any]] | None = None
    state: StepState = field(default_factory=StepState)
    on_main: ClassVar[bool] = False

    @property
    def in_job(self) -> bool:
        """True for a running step job; False for the standing one."""
        return self.work is not None


@dataclass
class MainSide:
    """The main-thread side of one optimizer: the step being built and the job in flight."""

    state: StepState = field(default_factory=StepState)
    inflight: Future | None = None  # the last step's job, until waited for
    land_pending: bool = False  # the masters are newer than the model params
    landing: Future | None = None  # land_begin's copy on the optimizer thread
    staging: list[torch.Tensor] | None = None  # pinned buffers for grads bound for another device
    deferred: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # see defer_copies
    handed_off: bool = False  # the model grads went to a job; no zero_grad() since
    on_main: ClassVar[bool] = True
    in_job: ClassVar[bool] = False
    groups: ClassVar[None] = None  # the main side steps the live param groups


_running: ContextVar[StepJob | None] = ContextVar("fp16kit_running_step_job", default=None)


def running_job() -> StepJob | None:
    """The step job the calling code runs in (any optimizer's), or None."""
    return _running.get()


@contextlib.contextmanager
def running(job: StepJob) -> Iterator[None]:
    """Publish ``job`` as the running one for the calling thread while the block runs."""
    token = _running.set(job)
    try:
        yield
    finally:
        _running.reset(token)
