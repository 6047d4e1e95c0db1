"""The optimizer thread: a FIFO worker that runs optimizer steps beside the main thread.

::

    thread = fp16kit.optimizer_thread()          # the process-wide worker (lazy, daemon)
    fut = thread.submit(fn, *args, **kwargs)      # -> concurrent.futures.Future, FIFO order
    thread.synchronize()                          # wait for everything submitted so far

Contract (spec/async.md):

* One worker thread, strict FIFO: jobs run one at a time in submission order.
* A job's exception is stored in its Future and re-raised on the submitting side -- with its
  original traceback -- at the next :meth:`submit` or :meth:`synchronize` (or by any fp16kit
  call that waits on that job), once. The worker keeps serving; nothing calls ``os._exit``.
* At interpreter exit pending jobs are drained; a job that hangs cannot hang the exit: the
  join is bounded (:data:`EXIT_TIMEOUT_S`), then a warning is logged.
* CUDA: jobs run on the worker's own stream. :meth:`submit` records an event on the caller's
  current stream and the worker's stream waits for it before the job runs, so a job sees
  everything the caller enqueued before submitting. A job's Future carries ``done_event``,
  recorded on the worker stream after the job; :meth:`wait_stream` makes the caller's stream
  wait for it. Never ``torch.cuda.synchronize()``.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import queue
import threading
import traceback
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from typing import Any

import torch

__all__ = [
    "EXIT_TIMEOUT_S",
    "OptimizerThread",
    "current_optimizer_thread",
    "last_step_target",
    "optimizer_thread",
]

logger = logging.getLogger("fp16kit")

EXIT_TIMEOUT_S = 60.0
"""How long interpreter exit waits for pending optimizer jobs before giving up (logged)."""

_STOP = object()
_local = threading.local()
_live: weakref.WeakSet[OptimizerThread] = weakref.WeakSet()
_names = itertools.count()
_last_step_target: weakref.ref[OptimizerThread] | None = None


def current_optimizer_thread() -> OptimizerThread | None:
    """The OptimizerThread whose worker is running the calling code, or None."""
    return getattr(_local, "owner", None)


def last_step_target() -> OptimizerThread | None:
    """The OptimizerThread that most recently received a step (see :meth:`mark_step`)."""
    return None if _last_step_target is None else _last_step_target()


class OptimizerThread:
    """A FIFO worker thread for optimizer work. See the module docstring.

    Usable as a context manager (``with OptimizerThread() as t: ...`` shuts it down, draining
    the queue, on exit).
    """

    def __init__(self, name: str | None = None) -> None:
        self.name = name or f"fp16kit-optimizer-{next(_names)}"
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._pending: list[Future] = []  # submitted, not yet known to be done
        self._unreported: list[Future] = []  # failed, exception not yet raised to the caller
        self._submitted = 0
        self._steps = 0
        self._closed = False
        self._stream: Any = None
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()
        _live.add(self)

    # ------------------------------------------------------------------ submitting side
    @property
    def submitted(self) -> int:
        """How many jobs were submitted so far (a counter callers can compare)."""
        return self._submitted

    def idle(self) -> bool:
        """True when every job submitted so far has finished (a job queued now runs at once)."""
        with self._lock:
            return all(f.done() for f in self._pending)

    def on_optimizer_thread(self) -> bool:
        """True when called from this thread's worker."""
        return threading.current_thread() is self._thread

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
        """Queue ``fn(*args, **kwargs)``; return its Future. First re-raises the error of an
        earlier job that has not been reported yet. From inside a job, runs ``fn`` inline (a
        job waiting for a later job would deadlock) and returns a completed Future."""
        if self.on_optimizer_thread():
            fut: Future = Future()
            try:
                fut.set_result(fn(*args, **kwargs))
            except BaseException as e:  # noqa: BLE001 - delivered through the Future
                fut.set_exception(e)
            return fut
        self.raise_pending_error()
        if self._closed:
            raise RuntimeError(f"{self.name} was shut down; submit work to a new OptimizerThread.")
        fut = Future()
        fut.done_event = None  # type: ignore[attr-defined]
        ready = _record_event()  # what the caller enqueued so far, for the worker stream
        with self._lock:
            self._pending.append(fut)
            self._submitted += 1
        self._queue.put((fut, ready, fn, args, kwargs))
        return fut

    @property
    def steps(self) -> int:
        """How many submitted jobs were marked as optimizer steps (:meth:`mark_step`)."""
        return self._steps

    def mark_step(self) -> None:
        """Note that the job just submitted runs an optimizer step (``submit_step`` does): a
        GradScaler uses this to tell that its steps run here and to check the call order."""
        global _last_step_target
        with self._lock:
            self._steps += 1
        _last_step_target = weakref.ref(self)

    def synchronize(self) -> None:
        """Wait for every job submitted so far; re-raise the first unreported error."""
        if self.on_optimizer_thread():
            return  # the jobs before this one are done (FIFO); later ones cannot be awaited
        with self._lock:
            pending = list(self._pending)
        for fut in pending:
            try:
                fut.result()
            except BaseException:  # noqa: BLE001 - reported below, once
                pass
        self.raise_pending_error()

    def wait_idle(self) -> None:
        """Wait for every job submitted so far to finish, leaving their errors to be reported
        by the next call that reports them, and order the caller's CUDA stream after the
        worker's. For reads of state the jobs write (a bound scaler's counters)."""
        if self.on_optimizer_thread():
            return
        with self._lock:
            pending = list(self._pending)
        futures_wait(pending)
        if self._stream is not None:
            torch.cuda.current_stream().wait_stream(self._stream)

    def wait(self, fut: Future) -> Any:
        """Wait for one job and return its result, raising its error (marked as reported)."""
        try:
            return fut.result()
        finally:
            if fut.done() and fut.exception() is not None:
                with self._lock:
                    if fut in self._unreported:
                        self._unreported.remove(fut)

    def raise_pending_error(self) -> None:
        """Re-raise (once) the exception of the oldest failed job not reported yet."""
        with self._lock:
            if not self._unreported:
                return
            fut = self._unreported.pop(0)
        exc = fut.exception()
        assert exc is not None
        raise exc

    def wait_stream(self, fut: Future, stream: Any = None) -> None:
        """Make ``stream`` (default: the caller's current CUDA stream) wait for the device
        work a finished job enqueued on the worker stream. A no-op without CUDA."""
        event = getattr(fut, "done_event", None)
        if event is not None:
            (stream or torch.cuda.current_stream()).wait_event(event)

    def shutdown(self, wait: bool = True, timeout: float | None = None) -> None:
        """Stop accepting jobs; with ``wait``, drain the queue and join the worker (at most
        ``timeout`` seconds). Idempotent."""
        with self._lock:
            if self._closed:
                closed_before = True
            else:
                closed_before = False
                self._closed = True
        if not closed_before:
            self._queue.put(_STOP)
        if wait and not self.on_optimizer_thread():
            self._thread.join(timeout)

    def __enter__(self) -> OptimizerThread:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown(wait=True)

    def __repr__(self) -> str:
        state = "closed" if self._closed else "running"
        return f"OptimizerThread({self.name!r}, {state}, {len(self._pending)} pending)"

    # ------------------------------------------------------------------ worker side
    def _run(self) -> None:
        _local.owner = self
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            fut, ready, fn, args, kwargs = item
            if not fut.set_running_or_notify_cancel():
                self._finished(fut)
                continue
            try:
                result = self._call(ready, fn, args, kwargs, fut)
            except BaseException as e:  # noqa: BLE001 - a job must never kill the worker
                if hasattr(e, "add_note"):
                    e.add_note(f"(raised on {self.name}, in {getattr(fn, '__qualname__', fn)!s})")
                with self._lock:
                    self._unreported.append(fut)
                fut.set_exception(e)
            else:
                fut.set_result(result)
            self._finished(fut)

    def _call(self, ready: Any, fn: Callable[..., Any], args: tuple, kwargs: dict, fut: Future) -> Any:
        if ready is None:
            return fn(*args, **kwargs)
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        self._stream.wait_event(ready)
        with torch.cuda.stream(self._stream):
            try:
                return fn(*args, **kwargs)
            finally:
                fut.done_event = _record_event()

    def _finished(self, fut: Future) -> None:
        with self._lock:
            if fut in self._pending:
                self._pending.remove(fut)


def _record_event() -> Any:
    """An event on the current CUDA stream, or None when CUDA is not in use."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    event = torch.cuda.Event()
    event.record()
    return event


_default: OptimizerThread | None = None
_default_lock = threading.Lock()


def optimizer_thread() -> OptimizerThread:
    """The process-wide default OptimizerThread, created on first use (a daemon thread)."""
    global _default
    with _default_lock:
        if _default is None or _default._closed:
            _default = OptimizerThread("fp16kit-optimizer")
        return _default


@atexit.register
def _drain_at_exit() -> None:
    for t in list(_live):
        if t._closed and not t._thread.is_alive():
            continue
        t.shutdown(wait=True, timeout=EXIT_TIMEOUT_S)
        if t._thread.is_alive():
            job = "a job"
            with t._lock:
                if t._pending:
                    job = f"{len(t._pending)} job(s)"
            logger.warning(
                "%s still running %s after %.0f s at interpreter exit; exiting without it.",
                t.name, job, EXIT_TIMEOUT_S,
            )
        with t._lock:
            unreported = list(t._unreported)
        for fut in unreported:
            exc = fut.exception()
            logger.error(
                "An optimizer job failed and its error was never collected (call "
                "synchronize()):\n%s",
                "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
            )
