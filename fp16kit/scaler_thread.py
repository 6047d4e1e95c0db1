"""GradScaler's state when its steps run on the optimizer thread (spec/async.md, mode 2).

Once a scaler is used from an :class:`~fp16kit.core.thread.OptimizerThread` (typically
``opt.submit_step(lambda: (scaler.step(opt), opt.zero_grad()))``), it is *bound* to that
thread and keeps one record per iteration::

    main thread                                  optimizer thread (FIFO)
    -------------------------------------------  -------------------------------------------
    scale(loss_k)   -> record k opens with the
                       forward scale S_k
    submit_step(fn_k) ---------------------------> fn_k: scaler.step(opt) unscales with S_k
                                                   (the head record), skips or steps
    update()        -> waits for update job k-1,
                       publishes its scale as the
                       forward scale (S_{k+1} = R_{k-1})
                    -> queues update job k -------> update job k: R_k = rule(R_{k-1}, found_k,
                                                   used_scale=S_k); pops record k

So the loss of iteration k+1 is scaled with the result of iteration k-1 (one iteration of
lag), the scale that multiplies a loss is the one its gradients are unscaled with, and a back-
off starts from the scale that overflowed and never backs off one scale twice
(:meth:`LossScale.update` with ``used_scale``). ``update(is_async=False)`` waits for job k
and publishes R_k at once: torch's trajectory.
"""

from __future__ import annotations

import threading
from collections import defaultdict, deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .core.thread import OptimizerThread

__all__ = ["IterationRecord", "ThreadBinding"]


@dataclass
class IterationRecord:
    """One iteration's forward scale and its per-optimizer states (torch's dicts)."""

    scale: torch.Tensor
    states: defaultdict = field(default_factory=lambda: defaultdict(dict))


class ThreadBinding:
    """A bound scaler's thread, forward scale and iteration records (see module docstring)."""

    def __init__(self, thread: OptimizerThread, scale: torch.Tensor, refresh: Callable[[], dict]) -> None:
        self.thread = thread
        self.forward_scale = scale.detach().clone()
        self.records: deque[IterationRecord] = deque()
        self.open: IterationRecord | None = None  # the record main is filling this iteration
        self.last_update: Future | None = None
        self.mark: int | None = thread.steps  # steps submitted up to the last update()
        self.lock = threading.Lock()
        self._refresh = refresh

    def _new_record(self) -> IterationRecord:
        return IterationRecord(self.forward_scale.clone(), defaultdict(self._refresh))

    def open_record(self) -> IterationRecord:
        """Main thread: the record of the iteration being built (created on first use)."""
        with self.lock:
            if self.open is None:
                self.open = self._new_record()
                self.records.append(self.open)
            return self.open

    def head(self) -> IterationRecord:
        """Optimizer thread: the record of the step being run (the oldest not yet updated)."""
        with self.lock:
            if not self.records:
                self.open = self._new_record()
                self.records.append(self.open)
            return self.records[0]

    def close_open(self) -> IterationRecord:
        rec = self.open_record()
        with self.lock:
            self.open = None
        return rec

    def pop(self, rec: IterationRecord) -> None:
        with self.lock:
            if not self.records or self.records[0] is not rec:
                raise RuntimeError("internal: GradScaler iteration records out of order")
            self.records.popleft()

    def steps_submitted(self) -> bool:
        """Main thread: was a step submitted to the thread since the last update()?"""
        return self.mark is None or self.thread.steps > self.mark

    def publish(self, fut: Future) -> None:
        """Main thread: wait for an update job and make its scale the forward scale."""
        new_scale = self.thread.wait(fut)
        self.thread.wait_stream(fut)
        self.forward_scale.copy_(new_scale)

    def reset(self, scale: torch.Tensor) -> None:
        """After a load: forget the records and start from ``scale`` on both sides."""
        with self.lock:
            self.records.clear()
            self.open = None
        self.forward_scale.copy_(scale)
        self.last_update = None
        self.mark = self.thread.steps

    def __getstate__(self) -> Any:
        raise TypeError("internal: a ThreadBinding is never pickled")

