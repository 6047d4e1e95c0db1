"""The optimizer-thread side of asynchronous steps: running one optimizer's step jobs.

:class:`~fp16kit.master_weights.async_step.AsyncSteps` (the main thread's side) builds each job -- a frozen
:class:`~fp16kit.master_weights.sides.StepJob` -- and queues it on the optimizer thread, or runs it inline on the
main thread (:mod:`~fp16kit.master_weights.async_policy`); :class:`JobRunner` is what either thread then runs::

    run(job):  as the running job (sides.running), with the param groups it was submitted with, their changes
               written back after
      mode 1 (MasterStep):  land the step before if the job was given its landing (inline only); skip on the
                            flag; else the one-pass kernel (FusedSteps.step_job) where it takes the job, or the
                            grads into the master grads (unscaled, or left to a fused optimizer) and the step
      mode 2 (SubmittedCall): the raw grads into the master grads, then the user's function

Nothing here touches the main thread's fields (:class:`~fp16kit.master_weights.sides.MainSide`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

import torch

from ..core import kernels
from ..core.master import MasterParams
from .fused_step import FusedSteps
from .groups import MasterGroups
from .sides import Handoff, MasterStep, StepJob, SubmittedCall, running
from .snapshot import snapshot, write_back
from .step_state import StepState

__all__ = ["JobRunner", "SteppedOptimizer", "log_skipped_step", "receive"]

logger = logging.getLogger("fp16kit")


class SteppedOptimizer(Protocol):
    """What :class:`AsyncSteps` needs of the optimizer whose steps it runs.

    The wrapped optimizer, the mode, and the step on the masters. (The optimizer is
    :class:`~fp16kit.MixedPrecisionOptimizer`; naming it here would make the two modules import each other.)"""

    optimizer: torch.optim.Optimizer
    async_step: bool

    @property
    def _step_supports_amp_scaling(self) -> bool: ...  # torch's GradScaler's flag: the step takes grad_scale

    def inner_step(
        self,
        closure: Callable[[], Any] | None = None,
        *,
        grad_scale: torch.Tensor | None = None,
        found_inf: torch.Tensor | None = None,
    ) -> Any: ...


class JobRunner:
    """Runs one optimizer's step jobs (see the module docstring); built and owned by its ``AsyncSteps``."""

    def __init__(
        self, opt: SteppedOptimizer, masters: MasterParams, groups: MasterGroups, fused: FusedSteps | None
    ) -> None:
        self._opt = opt
        self._masters = masters
        self._groups = groups
        self._fused = fused  # the one-pass kernel, for the jobs it can take

    def run(self, job: StepJob) -> Any:
        """Run ``job`` as the running one, stepping with the param groups as they were when the
        step was submitted; write back what the step changed in them."""
        before = None if job.groups is None else snapshot(job.groups)  # in-place edits show
        try:
            with running(job):
                if isinstance(job.work, SubmittedCall):
                    return self._submitted_job(job.state, job.work)
                assert job.work is not None
                return self._step_job(job.work, job.groups)
        finally:
            if before is not None:
                assert job.groups is not None
                write_back(before, job.groups, self._opt.optimizer.param_groups)

    def _step_job(self, work: MasterStep, groups: list[dict[str, Any]] | None) -> Any:
        """Mode 1: receive the grads, skip or step (see :class:`~fp16kit.master_weights.sides.MasterStep`)."""
        grads = receive(work.handoff) if work.handoff is not None else None
        if work.land:  # (inline) the step before lands first: in the kernel's pass, else by the copy
            if self._kernel_job(work, grads, groups, land=True):  # landed; stepped unless work.found
                if work.on_skip is not None and work.found.item():
                    work.on_skip()
                return None
            self._masters.masters_to_model()
        if work.found.item():  # the worker may wait for the device; the main thread never does
            if work.on_skip is not None:
                work.on_skip()
            return None
        if grads is None:
            return self._opt.inner_step()
        inv, scale = work.inv, work.scale
        if work.missing_grads == "zero":
            self._masters.zero_grad(False, model=False)
        clear = work.missing_grads == "none"
        if inv is None and self._fused_unscale(scale):
            assert scale is not None
            if self._kernel_job(work, grads, groups):
                return None  # the one-pass kernel (fp16kit.master_weights.fused_step): what torch's step gives
            # A fused optimizer unscales in its own pass over the grads: copy them only.
            self._masters.grads_to_masters(None, None, grads=grads, clear_missing=clear, unscale=False)
            return self._opt.inner_step(grad_scale=scale)
        if inv is None:
            assert scale is not None
            inv = kernels.inv_scale(scale)
        found_here = kernels.new_found_inf(self._groups.flag_device())
        self._masters.grads_to_masters(inv, found_here, grads=grads, clear_missing=clear)
        return self._opt.inner_step()

    def _kernel_job(
        self,
        work: MasterStep,
        grads: list[torch.Tensor | None] | None,
        groups: list[dict[str, Any]] | None,
        *,
        land: bool = False,
    ) -> bool:
        """The job by the one-pass kernel (``FusedSteps.step_job``), or False with nothing changed: torch's ops then.

        Only when a missing grad means no grad ("zero"/"keep" read master grads the kernel does not write) and the
        grads carry a scale for the fused step to take."""
        if grads is None or work.inv is not None or work.missing_grads != "none" or self._fused is None:
            return False
        if not self._fused_unscale(work.scale):
            return False
        assert work.scale is not None
        scale = work.scale.to(self._groups.flag_device())
        # (a summed flag: the kernel skips on exactly 1, a job on any nonzero; a tensor op, not a host read)
        found = work.found.ne(0).to(torch.float32) if land else work.found
        done = self._fused.step_job(self._masters.model_params, grads, groups, scale, land=land, found_inf=found)
        return done

    def _fused_unscale(self, scale: torch.Tensor | None) -> bool:
        # Fused kernels take a float32 grad_scale on the params' device (one device here).
        return (
            scale is not None
            and scale.dtype == torch.float32
            and self._opt._step_supports_amp_scaling
            and not self._groups.direct_params()
            and len({m.device for m in self._masters.masters}) == 1
        )

    def _submitted_job(self, state: StepState, work: SubmittedCall) -> Any:
        """Mode 2: the raw grads into the master grads (copied, still scaled), then ``fn``."""
        grads = receive(work.handoff)
        if work.missing_grads == "zero":
            self._masters.zero_grad(False, model=False)
        clear = work.missing_grads == "none"
        self._masters.grads_to_masters(None, None, grads=grads, unscale=False, clear_missing=clear)
        state.handed_off()
        return work.fn()


def log_skipped_step() -> None:
    """A step skipped without a scaler (on the optimizer thread, asynchronously)."""
    logger.warning(
        "MixedPrecisionOptimizer: non-finite gradients (inf/NaN); step skipped. "
        "With fp16 use fp16kit.GradScaler; otherwise look for a diverging loss."
    )


def receive(handoff: Handoff) -> list[torch.Tensor | None]:
    """In the job: wait until the handed grads are readable here; return them."""
    if handoff.event is not None:
        handoff.event.synchronize()  # the worker may wait for the device; main never does
    if torch.cuda.is_available():
        stream = torch.cuda.current_stream()
        for g in handoff.grads:
            if g is not None and g.is_cuda:
                g.record_stream(stream)  # freed here; keep the memory until this stream is done
    return handoff.grads
