"""Asynchronous steps for :class:`fp16kit.MixedPrecisionOptimizer` (spec/async.md).

The optimizer step on the fp32 masters runs on an :class:`~fp16kit.core.thread.OptimizerThread`
while the main thread computes the next forward/backward. This module holds the hand-offs
between the two; the optimizer decides what runs where::

    main thread, step k                          optimizer thread, job k
    ----------------------------------------     ----------------------------------------
    land():  wait for job k-1 (re-raise its      (job k-1 done)
             error); masters -> model params     (host masters: this copy runs here, while
                                                  the main thread checks the grads)
    hand_off(): model grads -> the job (on
             CPU offload a non-blocking copy
             into pinned buffers + an event);
             model grads cleared
    submit(job k)                          --->  receive(): wait for the copies; unscale
                                                 into the master grads; step the masters
    forward/backward k+1 (weights of job k-1)

So forward k+1 sees the weights of step k-1: a one-step delayed update. Every device hand-off
is ordered by events (the thread's submit event, the hand-off event); the main thread never
waits for the device, only for the previous job.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from .core import kernels
from .core.master import MasterParams
from .core.thread import OptimizerThread, current_optimizer_thread, optimizer_thread

__all__ = ["AsyncSteps", "Handoff"]


@dataclass
class Handoff:
    """This step's gradients, owned by the job: per model param a tensor or None."""

    grads: list[torch.Tensor | None]
    event: Any = None  # CUDA event after the copies into pinned buffers (CPU offload)


class AsyncSteps:
    """The in-flight job of one optimizer and the hand-offs around it."""

    def __init__(self, masters: MasterParams, thread: OptimizerThread | None = None) -> None:
        self._masters = masters
        self._thread = thread
        self.inflight: Future | None = None
        self.land_pending = False  # the masters are newer than the model params
        self._staging: list[torch.Tensor] | None = None
        self._landing: Future | None = None  # land_begin's copy on the optimizer thread
        # (source, target) copies a checkpoint left for the next step: see defer_copies()
        self._deferred: list[tuple[torch.Tensor, torch.Tensor]] = []

    @property
    def thread(self) -> OptimizerThread:
        if self._thread is None:
            self._thread = optimizer_thread()
        return self._thread

    def on_optimizer_thread(self) -> bool:
        return current_optimizer_thread() is not None

    # ------------------------------------------------------------------ main thread
    def wait(self) -> None:
        """Wait for the job in flight (re-raising its error); the masters then are newer than
        the model params until :meth:`land`. Then apply the deferred copies."""
        self.land_end()
        fut, self.inflight = self.inflight, None
        if fut is not None:
            self.land_pending = True
            self.thread.wait(fut)
            self.thread.wait_stream(fut)
        self.apply_deferred()

    def defer_copies(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy ``source -> target`` for each pair just before the masters or the model are
        next used (the next wait, landing or step), not now: a checkpoint whose values come
        from the model, or go into it, then does not depend on whether the user loads the
        model before or after the optimizer."""
        self._deferred = list(pairs)

    def apply_deferred(self) -> None:
        pairs, self._deferred = self._deferred, []
        kernels.copy_pairs_(pairs)

    def land(self) -> None:
        """Wait for the job in flight and copy the masters into the model params."""
        self.land_begin(overlap=False)

    def land_begin(self, *, overlap: bool = True) -> None:
        """Start :meth:`land`; the main thread may do other work (not touching the model
        params) until :meth:`land_end`.

        Copying host masters into host params is real work for whichever thread does it, so
        with ``overlap`` and an optimizer thread that has nothing else queued, the copy runs
        there while the main thread goes on (e.g. checking the next grads). Otherwise -- a
        device copy, which the main thread merely enqueues, or a busy shared thread whose
        queue the copy would wait behind -- it runs here, before returning."""
        self.wait()
        if not self.land_pending:
            return
        if overlap and self._landing_on_host() and self.thread.idle():
            self._landing = self.thread.submit(self._masters.masters_to_model)
        else:
            self._masters.masters_to_model(non_blocking=True)
            self.land_pending = False

    def land_end(self) -> None:
        """Wait for the copy :meth:`land_begin` started (re-raising its error)."""
        fut, self._landing = self._landing, None
        if fut is not None:
            self.thread.wait(fut)
            self.land_pending = False

    def _landing_on_host(self) -> bool:
        return all(p.device.type == "cpu" for p in self._masters.model_params)

    def hand_off(self, params: Sequence[torch.Tensor]) -> Handoff:
        """Give this step's grads of ``params`` to the job and clear them on the model. Grads
        bound for masters on another device are copied (non-blocking) into pinned buffers."""
        grads = [p.grad for p in params]
        masters = self._masters.masters
        crossing = [
            i for i, g in enumerate(grads) if g is not None and g.device != masters[i].device
        ]
        event = None
        if crossing:
            staging = self._staging_buffers(params)
            kernels.copy_to_([grads[i] for i in crossing], [staging[i] for i in crossing], non_blocking=True)
            for i in crossing:
                grads[i] = staging[i]
        if any(m.device != p.device for p, m in zip(params, masters)) and torch.cuda.is_available():
            # Orders the job after these copies and after land()'s copy out of the masters.
            event = torch.cuda.Event()
            event.record()
        for p in params:
            p.grad = None  # the next backward starts from zero
        return Handoff(grads, event)

    def _staging_buffers(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        # Reused every step: the job of the previous step has finished with them (land()).
        if self._staging is None or len(self._staging) != len(params):
            self._staging = [
                torch.empty(p.shape, dtype=p.dtype, device=m.device, pin_memory=m.device.type == "cpu")
                for p, m in zip(params, self._masters.masters)
            ]
        return self._staging

    def submit(self, fn: Any, *args: Any) -> Future:
        """Queue ``fn(*args)`` as this optimizer's job (one in flight at a time)."""
        if self.inflight is not None:
            raise RuntimeError("internal: a step job is already in flight; call land() first")
        self.inflight = self.thread.submit(fn, *args)
        return self.inflight

    # ------------------------------------------------------------------ optimizer thread
    @staticmethod
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
