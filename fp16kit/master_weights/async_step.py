"""Asynchronous steps for :class:`fp16kit.MixedPrecisionOptimizer` (docs/async.md).

The optimizer step on the fp32 masters runs on an :class:`~fp16kit.core.thread.OptimizerThread`
while the main thread computes the next forward/backward. :class:`AsyncSteps` owns one
optimizer's job in flight, the hand-offs around it and the landing of its masters::

    main thread, step k                          optimizer thread, job k
    ----------------------------------------     ----------------------------------------
    raise any pending error (nothing handed
             off yet: step() can be retried)
    land():  wait for job k-1 (re-raise its      (job k-1 done)
             error); masters -> model params     (host masters: this copy runs here, while
                                                  the main thread checks the grads)
    check the grads on their device (mode 1)
    hand_off(): model grads -> the job (on
             CPU offload a non-blocking copy
             into pinned buffers + an event);
             model grads cleared
    enqueue(job k)                         --->  receive(): wait for the copies; unscale
                                                 into the master grads; step the masters
    forward/backward k+1 (weights of job k-1)

So forward k+1 sees the weights of step k-1: a one-step delayed update. Every device hand-off
is ordered by events (the thread's submit event, the hand-off event); the main thread never
waits for the device, only for the previous job.

Ownership (:mod:`fp16kit.master_weights.sides`): the main thread's fields (the step being
built, ``inflight``, the landing, the deferred copies) are one :class:`MainSide`, written on the
main thread only; a job is a frozen :class:`StepJob` -- its arguments as one record, its own
:class:`~fp16kit.master_weights.step_state.StepState` and the param groups it was submitted
with -- whose state only the optimizer thread moves. :meth:`AsyncSteps.side` says which side a
call runs on. A job is forgotten only after it finished: a Ctrl-C while waiting leaves it
tracked, so ``state_dict()`` and ``synchronize()`` still wait for it.

Mode 1 (``async_step=True``): :meth:`AsyncSteps.step` -- the grads are checked on their device
on the main thread (the scale updates with no lag), then unscaled and stepped by the job -- on
the thread, or inline on the main thread, as :attr:`AsyncSteps.policy` says
(:mod:`~fp16kit.master_weights.async_policy`: the same numbers either way). Where the one-pass
kernel can take the job (:meth:`~fp16kit.master_weights.fused_step.FusedSteps.step_job`), the
check reads the 16-bit grads with it and the job goes from them to the masters in one pass.
Mode 2 (``submit_step(fn)``): :meth:`AsyncSteps.submit_step` -- the raw grads are handed off
and ``fn`` (typically ``scaler.step(opt); opt.zero_grad()``) runs on the thread. What a job does,
on either thread, is :class:`~fp16kit.master_weights.async_job.JobRunner`'s.

An inline job the kernel can take is also given the landing (:meth:`AsyncSteps._job_lands`):
nothing reads the model params between the landing's place and the job's, so the kernel writes
the masters as they were into the model params and steps them in one pass (28 B/param, where the
copy and the job took 32).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from ..core import kernels
from ..core.master import SPARSE_GRADS, MasterParams
from ..core.thread import OptimizerThread, current_optimizer_thread, optimizer_thread
from .async_job import JobRunner, SteppedOptimizer, log_skipped_step
from .async_policy import AsyncPolicy, run_inline
from .fused_step import FusedSteps
from .groups import MasterGroups
from .misuse import watch_clips
from .sides import Handoff, MainSide, MasterStep, StepJob, SubmittedCall, running_job
from .snapshot import StepView, snapshot
from .step_state import StepState

__all__ = ["AsyncSteps", "MISSING_GRADS"]

logger = logging.getLogger("fp16kit")

Flags = dict[torch.device, torch.Tensor]
Reduce = Callable[[Flags], Flags]
MISSING_GRADS = ("none", "zero", "keep")


class AsyncSteps:
    """One optimizer's asynchronous steps (see the module docstring)."""

    def __init__(
        self,
        opt: SteppedOptimizer,
        masters: MasterParams,
        groups: MasterGroups,
        thread: OptimizerThread | None = None,
        *,
        refresh: Callable[[], None] = lambda: None,
        policy: str | None = None,
        fused: FusedSteps | None = None,
    ) -> None:
        self._opt = opt
        self._fused = fused  # the one-pass kernel, for the jobs it can take
        self._jobs = JobRunner(opt, masters, groups, fused)  # what runs them, on either thread
        self._refresh = refresh  # adopts params unfrozen since the last step (master_groups)
        self._masters = masters
        self._groups = groups
        self._thread = thread
        self._default_thread = thread is None  # follow fp16kit.optimizer_thread() when it is re-made
        self.main = MainSide()
        self._standing = StepJob(self)  # this optimizer's calls on the thread outside its own jobs
        self._warned_clip = threading.Event()  # set once, from either thread
        # where mode-1 jobs run; it may ask the optimizer thread's intra-op threads (each thread has its own count)
        self.policy = AsyncPolicy(
            policy, worker_threads=lambda: int(self.thread.wait(self.thread.enqueue(torch.get_num_threads)))
        )

    @property
    def thread(self) -> OptimizerThread:
        if self._thread is None or (self._default_thread and self._thread.closed and self.main.inflight is None):
            self._thread = optimizer_thread()  # the default one, made anew after a shutdown
        return self._thread

    def side(self) -> MainSide | StepJob:
        """The side the calling code runs on (the one place that decides it; see :mod:`~fp16kit.master_weights.sides`).

        This optimizer's running job; on the optimizer thread outside such a job, its standing job; else the main
        side."""
        job = running_job()
        if job is not None and job.owner is self:
            return job
        if current_optimizer_thread() is not None:
            return self._standing
        return self.main

    def running(self) -> StepJob | None:
        """This optimizer's step job the calling code runs in, or None (a cheap test: no thread lookup)."""
        job = running_job()
        return job if job is not None and job.owner is self else None

    # ------------------------------------------------------------------ waiting and landing
    def wait(self) -> None:
        """Wait for the job in flight (re-raising its error), then apply the deferred copies.

        The masters then are newer than the model params until :meth:`land`."""
        self.land_end()
        main = self.main
        fut = main.inflight
        if fut is not None:
            main.land_pending = True  # whatever happens now, the masters may have moved
            try:
                self.thread.wait(fut)
            finally:
                if fut.done():  # not on a KeyboardInterrupt: the job is still running
                    main.inflight = None
                    self.thread.wait_stream(fut)
        self.apply_deferred()

    def masters_changed(self) -> None:
        """Record that the masters were written on the main thread (a checkpoint load).

        The next landing copies them into the model."""
        self.main.land_pending = True

    def defer_copies(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy ``source -> target`` for each pair just before the masters or the model are next used.

        That is at the next wait, landing or step, not now: a checkpoint whose values come from the model, or
        go into it, then does not depend on whether the user loads the model before or after the optimizer."""
        self.main.deferred = list(pairs)

    def apply_deferred(self) -> None:
        """Do the copies :meth:`defer_copies` recorded (main thread)."""
        main = self.main
        pairs, main.deferred = main.deferred, []
        kernels.copy_pairs_(pairs)

    def land(self) -> None:
        """Wait for the job in flight and copy the masters into the model params."""
        self.land_begin(overlap=False)

    def land_begin(self, *, overlap: bool = True) -> None:
        """Start :meth:`land`; the main thread may do other work (not touching the model params) until :meth:`land_end`.

        Copying host masters into host params is real work for whichever thread does it, so
        with ``overlap`` and an optimizer thread that has nothing else queued, the copy runs
        there while the main thread goes on (e.g. checking the next grads). Otherwise -- a
        device copy, which the main thread merely enqueues, or a busy shared thread whose
        queue the copy would wait behind -- it runs here, before returning."""
        self.wait()
        main = self.main
        if not main.land_pending:
            return
        if overlap and self._landing_on_host() and self.thread.idle():
            main.landing = self.thread.enqueue(self._masters.masters_to_model)
        else:
            self._masters.masters_to_model(non_blocking=True)
            main.land_pending = False

    def land_end(self) -> None:
        """Wait for the copy :meth:`land_begin` started (re-raising its error)."""
        main = self.main
        fut = main.landing
        if fut is None:
            return
        landed = False
        try:
            self.thread.wait(fut)
            landed = True
        finally:
            if fut.done():
                main.landing = None
                main.land_pending = main.land_pending and not landed

    def _landing_on_host(self) -> bool:
        return {p.device.type for p in self._masters.model_params} <= {"cpu"}  # (a set: no generator per step)

    # ------------------------------------------------------------------ hand-off
    def _hand_off(self) -> Handoff:
        """Give this step's model grads to the job and clear them on the model. Grads bound
        for masters on another device are copied (non-blocking) into pinned buffers."""
        params = self._masters.model_params
        grads = [p.grad for p in params]
        masters = self._masters.masters
        crossing = [i for i, g in enumerate(grads) if g is not None and g.device != masters[i].device]
        event = None
        if crossing:
            staging = self._staging_buffers(params)
            sources = [g for g in (grads[i] for i in crossing) if g is not None]  # all are: see crossing
            kernels.copy_to_(sources, [staging[i] for i in crossing], non_blocking=True)
            for i in crossing:
                grads[i] = staging[i]
        if [m.device for m in masters] != [p.device for p in params] and torch.cuda.is_available():
            # Orders the job after these copies and after land()'s copy out of the masters.
            event = torch.cuda.Event()
            event.record()
        for p in params:
            p.grad = None  # the next backward starts from zero
        self.main.handed_off = True
        watch_clips(self)
        return Handoff(grads, event)

    # ------------------------------------------------------------------ clipping the model params
    # torch.nn.utils.clip_grad_norm_(model.parameters()) finds no grad after a hand-off
    # (fp16kit.master_weights.misuse watches it).
    def grads_cleared(self) -> None:
        """Record ``zero_grad()`` on the main thread.

        The model params hold no grads by the user's doing now, as in torch, not because they were handed off."""
        self.main.handed_off = False

    def clip_finds_none(self, params: Sequence[torch.Tensor]) -> str | None:
        """Return the warning for ``torch.nn.utils.clip_grad_norm_(params)`` now, if it misses this optimizer's grads.

        On the main thread when none of ``params`` has a grad and some are model params whose grads were
        handed off (it returns 0); in this optimizer's step job when any is a model param (the model grads
        belong to the main thread)."""
        side = self.side()
        if not side.on_main:
            if not side.in_job:
                return None
            message = _CLIP_IN_JOB
        elif not self.main.handed_off or any(p.grad is not None for p in params):
            return None
        else:
            message = _CLIP_AFTER_HANDOFF
        mastered = {id(p) for p in self._masters.model_params}
        return message if any(id(p) in mastered for p in params) else None

    def warned_clip(self) -> bool:
        warned = self._warned_clip.is_set()
        self._warned_clip.set()
        return warned

    def _staging_buffers(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        # Reused every step: the job of the previous step has finished with them (land()).
        main = self.main
        if main.staging is None or len(main.staging) != len(params):
            main.staging = [
                torch.empty(p.shape, dtype=p.dtype, device=m.device, pin_memory=m.device.type == "cpu")
                for p, m in zip(params, self._masters.masters)
            ]
        return main.staging

    def _enqueue(self, work: MasterStep | SubmittedCall) -> Future:
        """Queue ``work`` as this optimizer's step job. Never raises a pending error: callers
        raised those before handing anything off."""
        main = self.main
        if main.inflight is not None:
            raise RuntimeError("internal: a step job is already in flight; call land() first")
        groups = None
        if StepView.applies_to(self._opt.optimizer):
            groups = snapshot(self._opt.optimizer.param_groups, leave_out=self._groups.watched_ids())
        _note_step_taken(self._opt)
        inline = isinstance(work, MasterStep) and self.policy.next_inline()
        if isinstance(work, MasterStep) and work.land and not inline:  # (peek_inline said otherwise: not expected)
            self.land()  # on the thread the job would write the params forward k+1 reads
            work = dataclasses.replace(work, land=False)
        job = StepJob(self, work, groups)
        if inline:
            main.inflight = run_inline(self._jobs.run, job, self.thread)
        else:
            main.inflight = self.thread.enqueue(self._jobs.run, (job,), step=isinstance(work, SubmittedCall))
        return main.inflight

    def _prepare(self) -> None:
        """Before a hand-off: raise any pending error -- this optimizer's last job's (by
        waiting for it) or another job's on the shared thread -- while nothing has changed."""
        self.wait()
        self.thread.raise_pending_error()
        if self._groups.watched_ids() and not StepView.applies_to(self._opt.optimizer):
            raise RuntimeError(
                "This optimizer's step() was replaced on the object (or its param_groups is a "
                "property), so an asynchronous step must step its live param groups -- which hold "
                "frozen params the worker would step with their scaled grads if they were "
                "unfrozen while the job runs. Keep frozen params out of the optimizer, wrap step "
                "in a subclass instead of on the object, or use async_step=False."
            )
        if self.thread.closed:
            raise RuntimeError(
                f"{self.thread.name}, this optimizer's thread, was shut down: build the "
                "MixedPrecisionOptimizer with a running OptimizerThread (thread=...)."
            )

    # ------------------------------------------------------------------ mode 1, main thread
    def check_grads(self, *, reduce: Reduce | None = None, land: bool = True, job_lands: bool = False) -> Flags:
        """Check this step's model grads for inf/NaN on their device (``reduce`` may all-reduce the flags).

        With ``land``, land the previous step meanwhile. ``job_lands``: the landing is left to this step's job
        (:meth:`_job_lands`; no job is in flight). No host sync."""
        grads = [p.grad for p in self._masters.model_params if p.grad is not None]
        if any([g.is_sparse for g in grads]):  # (a list: a generator resumes once per grad, every step)
            raise TypeError(SPARSE_GRADS)
        land = land and not job_lands
        if land:
            self.land_begin()
        try:  # the grads, not the params: the landing copy may still be writing those
            found_inf = kernels.new_found_inf(self._groups.grad_device())
            if (land or job_lands) and self._fused is not None and self._fused.check_job_grads(found_inf):
                flags = {found_inf.device: found_inf}  # (no job runs: land_begin, or _prepare, waited for it)
            else:
                flags = kernels.check_finite_(grads, found_inf)
            return reduce(flags) if reduce is not None else flags
        finally:
            self.land_end()

    def step(
        self,
        state: StepState,
        *,
        scale: torch.Tensor | None,
        reduce: Reduce | None,
        flags: Flags | None = None,
        missing_grads: str = "none",
    ) -> Flags:
        """Run a mode-1 step from the main thread, by ``step()`` or ``scaler.step(opt)``.

        ``scale``: the scale this iteration's loss was multiplied by; None without a scaler. ``state`` is the main thread's step state:
        when the masters already hold this step's unscaled grads (``scaler.unscale_(opt)``,
        ``clip_grad_norm_``), only the skip decision and the step are left (``flags``: the scaler's, reduced
        over its process group; default: the state's; ``missing_grads``: see :meth:`submit`). Returns this
        step's flags (for the scaler's update); reads none."""
        if state.in_masters:
            on_skip = log_skipped_step if scale is None else None
            flags = state.flags if flags is None else flags
            self._prepare()
            self._masters.zero_grad(model=True, masters=False)
            self._enqueue(MasterStep(None, self._found(flags), on_skip=on_skip))
            return flags
        self._prepare()
        job_lands = scale is not None and missing_grads == "none" and self._job_lands()
        flags = self.check_grads(reduce=reduce, job_lands=job_lands)
        if scale is not None:  # a scale that underflowed to 0 would unscale into NaN
            flags = kernels.flag_nonfinite_scale_(flags, kernels.inv_scale(scale))
        found = self._found(flags)
        if scale is None:  # no scaler: the grads as they are
            self._submit(found, missing_grads, log_skipped_step, inv=kernels.one(self._groups.grad_device()))
        else:  # the update after this step changes the scale in place: keep its value
            self._submit(found, missing_grads, scale=scale.clone(), job_lands=job_lands)
        return flags

    def _job_lands(self) -> bool:
        """Can this step's job land the step before it, in the kernel's pass (``MasterStep.land``)?

        When there is a landing to do, on the host, and the job will run inline (so nothing else reads the model
        params between the landing's usual place and the job's) and the kernel may take it."""
        main = self.main
        return (
            main.land_pending
            and main.inflight is None
            and main.landing is None
            and self._fused is not None
            and self._fused.job_candidate
            and self.policy.peek_inline()
            and self._landing_on_host()
        )

    def submit(
        self,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        *,
        missing_grads: str = "none",
        on_skip: Callable[[], Any] | None = None,
    ) -> Future:
        """The second half of a step after :meth:`check_grads` (see ``MixedPrecisionOptimizer.async_submit``)."""
        if missing_grads not in MISSING_GRADS:
            raise ValueError(f"missing_grads must be one of {MISSING_GRADS}, got {missing_grads!r}.")
        self._refresh()
        self._prepare()
        return self._submit(found_inf, missing_grads, on_skip, inv=inv_scale)

    def _submit(
        self,
        found: torch.Tensor,
        missing_grads: str = "none",
        on_skip: Callable[[], Any] | None = None,
        *,
        inv: torch.Tensor | None = None,
        scale: torch.Tensor | None = None,
        job_lands: bool = False,
    ) -> Future:
        # ``scale`` instead of ``inv``: the job takes the reciprocal (off the main thread).
        if not job_lands:
            self.land()
        work = MasterStep(self._hand_off(), found, missing_grads, on_skip, inv=inv, scale=scale, land=job_lands)
        return self._enqueue(work)

    def _found(self, flags: Flags) -> torch.Tensor:
        return kernels.combine_found_inf(flags.values(), self._groups.grad_device())

    def require_main(self, name: str, *, async_step: bool) -> None:
        """``name()`` needs the main thread and ``async_step`` as given (else RuntimeError)."""
        if not self.side().on_main:
            raise RuntimeError(f"{name}() must be called from the main thread, not from a step job.")
        if async_step and not self._opt.async_step:
            raise RuntimeError(f"{name}() is part of an asynchronous step; build the optimizer with async_step=True.")
        if not async_step and self._opt.async_step:
            raise RuntimeError(
                "This optimizer already steps asynchronously (async_step=True): call step() (or "
                f"scaler.step(opt)), or build it with async_step=False to use {name}()."
            )

    # ------------------------------------------------------------------ mode 2, main thread
    def submit_step(self, fn: Callable[[], Any], *, scaler: Any, missing_grads: str = "none") -> Future:
        """Mode 2 (see ``MixedPrecisionOptimizer.submit_step``).

        Everything is checked, and pending errors raised, before anything is handed off."""
        if not callable(fn):
            raise TypeError(
                f"submit_step expects a callable, got {type(fn).__name__}: e.g. "
                "opt.submit_step(lambda: (scaler.step(opt), opt.zero_grad()), scaler=scaler)."
            )
        self.require_main("submit_step", async_step=False)
        if scaler is not None and not callable(getattr(scaler, "bind", None)):
            raise TypeError(f"scaler must be an fp16kit.GradScaler, got {type(scaler).__name__}.")
        self._refresh()
        direct = self._groups.direct_params()
        if direct:
            raise RuntimeError(
                f"submit_step() needs a master for every trainable param ({len(direct)} float32 "
                "params have none: the thread would update them while the forward pass reads "
                "them). Build the MixedPrecisionOptimizer with master_device=... (e.g. 'cpu')."
            )
        self._prepare()
        if scaler is not None:
            scaler.bind(self.thread, step_of=self._opt)
        self.land()
        return self._enqueue(SubmittedCall(self._hand_off(), fn, missing_grads))

    # ------------------------------------------------------------------ optimizer thread


_CLIP_FIX = (
    "Clip with optimizer.clip_grad_norm_(max_norm) before the step -- after "
    "scaler.unscale_(optimizer), or after the backward without a scaler; with submit_step, in the "
    "submitted function: it clips the unscaled fp32 master grads the step uses and returns their "
    "norm (max_norm=float('inf') only measures it). (Warned once per optimizer.)"
)
_CLIP_AFTER_HANDOFF = (
    "torch.nn.utils.clip_grad_norm_ was called on the model's parameters after an asynchronous "
    "step (async_step=True or submit_step) handed their gradients to the optimizer thread: they "
    "hold none now, so it clipped nothing and returned 0. " + _CLIP_FIX
)
_CLIP_IN_JOB = (
    "torch.nn.utils.clip_grad_norm_ was called on the model's parameters inside a step job "
    "(submit_step): the step's gradients were handed to the job, and the model's are the main "
    "thread's (empty, or the next backward's). In the job, call "
    "optimizer.clip_grad_norm_(max_norm) after scaler.unscale_(optimizer): it clips the master "
    "grads the step uses. (Warned once per optimizer.)"
)


def _note_step_taken(opt: SteppedOptimizer) -> None:
    # As LR schedulers' call-order trackers do (on the wrapper and the wrapped optimizer): the
    # step is taken now, so scheduler.step() may follow at once without a warning.
    opt._opt_called = True  # type: ignore[attr-defined]
    opt.optimizer._opt_called = True  # type: ignore[attr-defined]
