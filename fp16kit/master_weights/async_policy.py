"""Where an asynchronous step runs: on the optimizer thread, or inline on the main thread -- measured, not guessed.

An asynchronous step (``async_step=True``, mode 1) is a one-step delayed update: forward k+1 sees the weights of
step k-1. That is what the numbers depend on, not where the job runs. The job may run on the optimizer thread
beside forward/backward k+1 (the overlap), or *inline*: on the main thread, inside ``step()``, its masters landing
in the model at the next step as before -- the same numbers bit for bit, with no overlap. Overlap pays when the two
sides do not compete for the same cores; when forward/backward and the step both scale with the cores (a
matmul-heavy model on a CPU), splitting the cores between two threads loses to running each part on all of them.
So the policy measures::

    requested "thread" | "inline": every step so, always
    requested "auto" (the default):
        warm-up   WARMUP steps on the thread, not measured
        probe     ROUNDS rounds of SLOT steps per mode, thread first in even rounds, inline first in odd ones
                  sample = the main thread's time from one step's job being queued (or run inline) to the next's:
                           it holds that job and the next forward/backward, whichever side ran them
        decide    the thread if its median sample is at least MARGIN (5%) below inline's, else inline, for
                  good; one INFO line names both medians

On a CPU, an inline step leaves the optimizer thread idle, so under "auto" the main thread borrows its intra-op
threads while steps run inline (``torch.set_num_threads(main + worker)``, at most the cores this process may use,
set again at each inline step) and gets the program's count back when steps go to the thread again and at
``synchronize()`` (one record per process: several optimizers may borrow at once).

Contract: the mode changes only which thread runs a job, never the order of anything the numbers depend on; a job
run inline fails as a job on the thread does -- its error one of the thread's undelivered ones, raised once by the
next call that waits for the step or asks the thread, reported at exit otherwise (:func:`run_inline`). Mode 2
(``submit_step(fn)``) always runs on the thread (its scaler is bound there). ``optimizer.async_policy`` reads
``"thread"``, ``"inline"`` or ``"probing"``; assigning ``"thread"``, ``"inline"`` or ``"auto"`` (probe again) sets it.
The default (``async_policy=None``) is ``$FP16KIT_ASYNC_POLICY`` when set -- a test run can put every asynchronous
step of a suite on one side -- else ``"auto"``.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ..core.interrupts import abandoned
from ..core.thread import JobFuture, OptimizerThread

__all__ = ["AsyncPolicy", "POLICIES", "check_policy", "run_inline"]

logger = logging.getLogger("fp16kit")

POLICIES: tuple[str, ...] = ("auto", "thread", "inline")


def check_policy(policy: object) -> str:
    """Return ``policy`` if it is one of :data:`POLICIES` (None: ``$FP16KIT_ASYNC_POLICY``, else ``"auto"``).

    Anything else: ValueError naming them."""
    if policy is None:
        policy = os.environ.get("FP16KIT_ASYNC_POLICY") or "auto"
        if policy not in POLICIES:
            raise ValueError(
                f"The environment sets FP16KIT_ASYNC_POLICY={policy!r:.80}, which is not one of {POLICIES}: "
                "unset it, or set it to one of them."
            )
    if not isinstance(policy, str) or policy not in POLICIES:
        raise ValueError(
            f"async_policy must be one of {POLICIES}, got {policy!r:.80}: 'auto' measures both and keeps the faster "
            "(the default), 'thread' runs every step on the optimizer thread, 'inline' on the main thread."
        )
    return policy


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


class AsyncPolicy:
    """One optimizer's choice between steps on the optimizer thread and inline steps (module docstring)."""

    WARMUP = 3
    SLOT = 4
    ROUNDS = 3
    #: the thread must beat inline steps by this share of their median to be kept: an inline step costs what a
    #: synchronous one does, while the thread's gain is measured under noise and its contention varies
    MARGIN = 0.05

    def __init__(
        self,
        policy: str | None = None,
        *,
        worker_threads: Callable[[], int],
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._worker_threads = worker_threads  # the optimizer thread's intra-op threads (asked once per probe)
        self._clock = clock
        self.requested = check_policy(policy)
        self.samples: dict[str, list[float]] = {"thread": [], "inline": []}
        self._schedule: list[str] = []
        self._index = 0
        self._last: tuple[str, float] | None = None  # the mode and queue time of the last step
        self._worker: int | None = None
        self._decided: str | None = None
        self.set(policy)

    @property
    def mode(self) -> str:
        """``"thread"`` or ``"inline"`` once chosen; ``"probing"`` while ``"auto"`` measures."""
        if self.requested != "auto":
            return self.requested
        return self._decided or "probing"

    def set(self, policy: str | None) -> None:
        """Use ``policy`` from the next step on; ``"auto"`` measures both modes again."""
        self.requested = policy = check_policy(policy)
        self._decided = None
        self._last = None
        self.samples = {"thread": [], "inline": []}
        rounds = []
        for r in range(self.ROUNDS):
            pair = ["thread"] * self.SLOT + ["inline"] * self.SLOT
            rounds += pair if r % 2 == 0 else pair[::-1]
        self._schedule = ["thread"] * self.WARMUP + rounds
        self._index = 0
        self._give_back_threads()
        self._worker = None

    def next_inline(self) -> bool:
        """Called as each mode-1 job is queued, on the main thread: should this one run inline?

        Records the time since the last job's queueing against that job's mode, and decides when the probe is over."""
        if self.requested != "auto":
            return self.requested == "inline"
        now = self._clock()
        if self._decided is None:
            if self._last is not None and self._index > self.WARMUP:
                self.samples[self._last[0]].append(now - self._last[1])
            if self._index >= len(self._schedule):
                self._decide()
        mode = self._decided or self._schedule[self._index]
        self._index += 1
        self._last = (mode, now)
        if mode == "inline":
            self._lend_threads()
        else:
            self._give_back_threads()
        return mode == "inline"

    def peek_inline(self) -> bool:
        """Will the next :meth:`next_inline` say inline? Records nothing.

        False when it cannot know yet (the probe's last sample decides): the caller then plans for the thread."""
        if self.requested != "auto":
            return self.requested == "inline"
        if self._decided is not None:
            return self._decided == "inline"
        return self._index < len(self._schedule) and self._schedule[self._index] == "inline"

    def _decide(self) -> None:
        thread, inline = (statistics.median(self.samples[m]) for m in ("thread", "inline"))
        self._decided = "thread" if thread < inline * (1 - self.MARGIN) else "inline"
        logger.info(
            "fp16kit: async_policy='auto' chose %s steps: %.3g ms per iteration inline, %.3g ms with the step on the "
            "optimizer thread (medians of %d). Pass async_policy='thread' or 'inline' to choose.",
            self._decided,
            inline * 1e3,
            thread * 1e3,
            len(self.samples["inline"]),
        )

    # ------------------------------------------------------------------ the main thread's intra-op threads
    def _lend_threads(self) -> None:
        if self._worker is None:  # asked once per set()
            self._worker = self._worker_threads()
        _LENDING.lend(self, self._worker)

    def _give_back_threads(self) -> None:
        _LENDING.give_back(self)

    def give_back(self) -> None:
        """Give the main thread its own intra-op thread count back (``synchronize()``: training may be over).

        The next inline step borrows again."""
        _LENDING.give_back(self)

    def __repr__(self) -> str:
        medians = ", ".join(f"{m} {statistics.median(s) * 1e3:.3g} ms" for m, s in self.samples.items() if s)
        return f"AsyncPolicy({self.requested!r} -> {self.mode}{'; ' + medians if medians else ''})"


class _Lending:
    """The main thread's intra-op threads while inline steps borrow the optimizer threads': one record per process.

    Several optimizers may borrow at once: the count the program set (``own``) is read when the first one borrows
    and set back when the last one gives back."""

    def __init__(self) -> None:
        self.own: int | None = None
        self.borrowers: weakref.WeakSet[AsyncPolicy] = weakref.WeakSet()

    def lend(self, policy: AsyncPolicy, worker: int) -> None:
        if self.own is None or not self.borrowers:
            self.own = torch.get_num_threads()
        lent = min(self.own + worker, max(self.own, _cores()))
        if lent == self.own:
            return
        self.borrowers.add(policy)
        if torch.get_num_threads() != lent:  # (again at each step: the program may have set a count since)
            torch.set_num_threads(lent)

    def give_back(self, policy: AsyncPolicy) -> None:
        if policy not in self.borrowers:
            return
        self.borrowers.discard(policy)
        if not self.borrowers and self.own is not None:
            torch.set_num_threads(self.own)
            self.own = None


_LENDING = _Lending()


def run_inline(run: Callable[[Any], Any], job: Any, thread: OptimizerThread) -> JobFuture:
    """Run ``run(job)`` here, on the main thread, as a job of ``thread``; return its finished future.

    Its error is one of ``thread``'s undelivered errors (:meth:`~fp16kit.core.thread.OptimizerThread.record_failure`),
    raised once by the next call that waits for the step or asks the thread for pending errors, and reported at exit
    if nothing did -- as a job's error on the thread would be. That includes a KeyboardInterrupt the job's code
    raises (a hook's): on the thread it is the job's error, so here too -- the step call returns, the scaler records
    its flags, and the next step raises it before anything changes. A real Ctrl-C is held to the end of the step
    (fp16kit.core.interrupts) and does not land here; a second one, which breaks the hold, goes on up at once."""
    fut = JobFuture()
    try:
        fut.set_result(run(job))
    except BaseException as e:
        if not isinstance(e, Exception) and (abandoned(e) or not isinstance(e, KeyboardInterrupt)):
            raise  # (the user insisting on a stop; SystemExit, GeneratorExit: not the job's to keep)
        if hasattr(e, "add_note"):  # Python 3.11+
            e.add_note("(raised in an asynchronous step run inline on the main thread: async_policy)")
        thread.record_failure(fut)  # (tracked before it is set, as the thread does)
        fut.set_exception(e)
    return fut
