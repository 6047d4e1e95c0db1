"""The optimizer thread: a FIFO worker that runs optimizer steps beside the main thread.

::

    thread = fp16kit.optimizer_thread()          # the process-wide worker (lazy, daemon)
    fut = thread.submit(fn, *args, **kwargs)      # -> JobFuture, FIFO order
    thread.synchronize()                          # wait for everything submitted so far

Contract (docs/async.md):

* One worker thread, strict FIFO: jobs run one at a time in submission order. Called from a
  job (on the worker), :meth:`~OptimizerThread.submit` runs the new job inline: a job waiting
  for a later job would deadlock, and the jobs before it are done anyway.
* The shutdown check and the enqueue happen under one lock, so a job is either queued before
  the stop marker (and runs: shutdown drains) or refused with a RuntimeError -- never left
  with a Future that does not complete.
* A job's exception is stored in its :class:`JobFuture` and raised on the submitting side,
  with its original traceback, **once**. It counts as delivered when it reached a caller
  through ``fut.result()``/``fut.exception()``, :meth:`~OptimizerThread.wait`,
  :meth:`~OptimizerThread.raise_pending_error` (which :meth:`~OptimizerThread.submit` calls
  first) or :meth:`~OptimizerThread.synchronize`; an error that was delivered is not raised
  again by a later, unrelated call. The worker keeps serving; nothing calls ``os._exit``.
* :meth:`~OptimizerThread.enqueue` queues without raising pending errors first: for callers
  that raise them themselves *before* an irreversible hand-off (grads moved into the job) and
  must then queue with no error surfacing after the hand-off (house rule 7).
* ``enqueue(..., step=True)`` counts the job as an optimizer step: per thread
  (:attr:`~OptimizerThread.steps`) and process-wide (:func:`step_serial`). The serial exists
  for a GradScaler that was not bound to a thread explicitly: it notes ``step_serial()`` at
  ``scale()`` and, at ``update()``, binds to a thread lazily only when
  :func:`threads_with_steps_since` names exactly one -- with two (several optimizers on
  several threads) "the thread that got the last step" would be a guess.
* At interpreter exit pending jobs are drained; a job that hangs cannot hang the exit: the
  join is bounded (:data:`EXIT_TIMEOUT_S` for all threads together), then a warning is
  logged. Errors never delivered are logged then.
* CUDA: jobs run on the worker's own stream. Enqueueing records an event on the caller's
  current stream and the worker's stream waits for it before the job runs, so a job sees
  everything the caller enqueued before submitting. A job's future carries ``done_event``,
  recorded on the worker stream after the job; :meth:`~OptimizerThread.wait_stream` makes the
  caller's stream wait for it. Never ``torch.cuda.synchronize()``.
"""

from __future__ import annotations

import atexit
import collections
import itertools
import logging
import queue
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterable
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "EXIT_TIMEOUT_S",
    "JobFuture",
    "OptimizerThread",
    "current_optimizer_thread",
    "optimizer_thread",
    "step_serial",
    "threads_with_steps_since",
]

logger = logging.getLogger("fp16kit")

EXIT_TIMEOUT_S = 60.0
"""How long interpreter exit waits for pending optimizer jobs before giving up (logged)."""

_STOP = object()
_local = threading.local()
_live: weakref.WeakSet[OptimizerThread] = weakref.WeakSet()
_names = itertools.count()
_delivery_lock = threading.Lock()  # guards JobFuture._delivered (a claim is test-and-set)
_serial_lock = threading.Lock()  # guards _step_serial and every thread's _last_step
_step_serial = 0


def current_optimizer_thread() -> OptimizerThread | None:
    """The OptimizerThread whose worker is running the calling code, or None."""
    return getattr(_local, "owner", None)


def step_serial() -> int:
    """How many optimizer steps were enqueued on all OptimizerThreads so far."""
    with _serial_lock:
        return _step_serial


def threads_with_steps_since(serial: int) -> list[OptimizerThread]:
    """Return the live, not closed threads that received a step after ``step_serial()`` returned ``serial``.

    Oldest last step first."""
    with _serial_lock:
        found = [t for t in list(_live) if t._last_step > serial and not t._closed]
        return sorted(found, key=lambda t: t._last_step)


class JobFuture(Future):
    """A Future that remembers whether its job's error reached a caller.

    ``result()`` (when it raises the job's error) and ``exception()`` (when it returns one)
    behave as ``concurrent.futures.Future``'s and mark the error delivered, so the thread does
    not raise it again."""

    def __init__(self) -> None:
        super().__init__()
        self.done_event: Any = None  # CUDA event on the worker stream after the job
        self._delivered = False

    def result(self, timeout: float | None = None) -> Any:
        try:
            return super().result(timeout)
        except BaseException as e:
            if e is self._error():  # not a timeout or an interrupt while waiting
                self._claim()
            raise

    def exception(self, timeout: float | None = None) -> BaseException | None:
        exc = super().exception(timeout)
        if exc is not None:
            self._claim()
        return exc

    def _error(self) -> BaseException | None:
        """The job's error if it finished with one; does not wait or mark it delivered."""
        if not self.done() or self.cancelled():
            return None
        return Future.exception(self, 0)

    def _wait_error(self) -> BaseException | None:
        """Wait for the job; its error (not marked delivered), or None. An interrupt while
        waiting changes nothing: the job stays pending and tracked."""
        try:
            return Future.exception(self)
        except CancelledError:
            return None

    def _claim(self) -> bool:
        """Mark the error delivered; True only for the first claim (the one that raises)."""
        with _delivery_lock:
            first, self._delivered = not self._delivered, True
            return first


@dataclass(frozen=True)
class _WorkItem:
    """One job as it travels from the caller to the worker."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    is_step: bool
    ready: Any  # CUDA event on the caller's stream at enqueue time (None: no CUDA, or inline)
    future: JobFuture = field(default_factory=JobFuture)


class OptimizerThread:
    """A FIFO worker thread for optimizer work. See the module docstring.

    Usable as a context manager (``with OptimizerThread() as t: ...`` shuts it down, draining
    the queue, on exit).
    """

    def __init__(self, name: str | None = None) -> None:
        self.name = name or f"fp16kit-optimizer-{next(_names)}"
        self._queue: queue.SimpleQueue[_WorkItem | object] = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards the fields below (but _last_step) and the enqueue
        self._pending: dict[JobFuture, None] = {}  # queued, not yet taken off by the worker
        self._undelivered: collections.deque[JobFuture] = collections.deque()  # failed, oldest first
        self._submitted = 0
        self._steps = 0
        self._last_step = 0  # step_serial() after this thread's latest step (_serial_lock)
        self._closed = False  # also read by older callers; the public name is `closed`
        self._stream: Any = None  # the worker's CUDA stream, created by the first CUDA job
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()
        with _serial_lock:  # threads_with_steps_since iterates _live under it
            _live.add(self)

    # ------------------------------------------------------------------ state
    @property
    def closed(self) -> bool:
        """True once :meth:`shutdown` was called: enqueueing raises RuntimeError."""
        return self._closed

    @property
    def submitted(self) -> int:
        """How many jobs were submitted so far, queued or run inline (a counter to compare)."""
        return self._submitted

    @property
    def steps(self) -> int:
        """How many jobs were enqueued here with ``step=True``."""
        return self._steps

    def idle(self) -> bool:
        """True when every job submitted so far has finished (a job queued now runs at once)."""
        with self._lock:
            return all(f.done() for f in self._pending)

    def on_optimizer_thread(self) -> bool:
        """True when called from this thread's worker."""
        return threading.current_thread() is self._thread

    # ------------------------------------------------------------------ submitting side
    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> JobFuture:
        """Raise the oldest undelivered error of an earlier job (once), then queue ``fn(*args, **kwargs)``.

        Queues as :meth:`enqueue` does; returns its future."""
        if not self.on_optimizer_thread():  # a job must not receive the main thread's errors
            self.raise_pending_error()
        return self.enqueue(fn, args, kwargs)

    def enqueue(
        self,
        fn: Callable[..., Any],
        args: Iterable[Any] = (),
        kwargs: dict[str, Any] | None = None,
        *,
        step: bool = False,
    ) -> JobFuture:
        """Queue ``fn(*args, **kwargs)`` without raising pending errors first; return its future.

        ``step=True`` counts it as an optimizer step. From inside a job, runs ``fn`` inline and returns a
        completed future. Raises RuntimeError after :meth:`shutdown`."""
        inline = self.on_optimizer_thread()
        # ready: what the caller enqueued on its CUDA stream so far, for the worker stream
        item = _WorkItem(fn, tuple(args), dict(kwargs or {}), step, None if inline else _record_event())
        if inline:  # already on the worker stream, after every job before it
            with self._lock:
                self._count(item)
            self._execute(item)
            return item.future
        with self._lock:  # the check and the put together: no job lands after the stop marker
            if self._closed:
                raise RuntimeError(f"{self.name} was shut down; submit work to a new OptimizerThread.")
            self._count(item)
            self._pending[item.future] = None
            self._queue.put(item)
        return item.future

    def record_failure(self, fut: JobFuture) -> None:
        """Track ``fut``, a failed job of this thread's that ran elsewhere (inline), as an undelivered error.

        ``fut`` ran on the main thread instead of here (``async_policy``) and finished with an error:
        :meth:`raise_pending_error`, :meth:`synchronize` and the exit report find it, and it is delivered once, as
        the error of a job run here would be."""
        with self._lock:
            self._undelivered.append(fut)

    def _count(self, item: _WorkItem) -> None:
        global _step_serial
        self._submitted += 1
        if item.is_step:
            self._steps += 1
            with _serial_lock:
                _step_serial += 1
                self._last_step = _step_serial

    # ------------------------------------------------------------------ waiting
    def synchronize(self) -> None:
        """Wait for every job submitted so far; raise the oldest undelivered error (once)."""
        self.wait_idle()
        self.raise_pending_error()

    def wait_idle(self) -> None:
        """Wait for every job submitted so far, leaving their errors to the next call that raises them.

        Also orders the caller's CUDA stream after the worker's. For reads of state the jobs write (a bound
        scaler's counters)."""
        if self.on_optimizer_thread():
            return  # the jobs before this one are done (FIFO); later ones cannot be awaited
        with self._lock:
            pending = list(self._pending)
        for fut in pending:
            fut._wait_error()
        if self._stream is not None:
            torch.cuda.current_stream().wait_stream(self._stream)

    def wait(self, fut: Future) -> Any:
        """Wait for one job and return its result.

        Its error is raised if no caller received it yet (then it counts as delivered); an error delivered
        before gives None."""
        if not isinstance(fut, JobFuture):
            return fut.result()
        if self.on_optimizer_thread():
            with self._lock:
                queued_behind = fut in self._pending and not fut.done()
            if queued_behind:
                raise RuntimeError(
                    f"A job on {self.name} waited for a job queued after it (a deadlock); "
                    "submit the inner work from the job itself, where it runs inline."
                )
        exc = fut._wait_error()
        if exc is None:
            return fut.result()
        if fut._claim():
            raise exc
        return None

    def raise_pending_error(self) -> None:
        """Raise the exception of the oldest failed job whose error was not delivered yet, marking it delivered.

        Returns when there is none."""
        with self._lock:
            while self._undelivered:
                fut = self._undelivered.popleft()
                if fut._claim():
                    break
            else:
                return
        exc = fut._wait_error()  # the worker queues a failure just before setting it
        assert exc is not None
        raise exc

    def wait_stream(self, fut: Future, stream: Any = None) -> None:
        """Make ``stream`` wait for the device work a finished job enqueued on the worker stream.

        ``stream`` defaults to the caller's current CUDA stream. A no-op without CUDA."""
        event = getattr(fut, "done_event", None)
        if event is not None:
            (stream or torch.cuda.current_stream()).wait_event(event)

    # ------------------------------------------------------------------ lifetime
    def shutdown(self, wait: bool = True, timeout: float | None = None) -> None:
        """Stop accepting jobs; with ``wait``, drain the queue and join the worker (at most ``timeout`` seconds).

        Idempotent."""
        with self._lock:  # the same lock as the enqueue: the marker is the last item
            if not self._closed:
                self._closed = True
                self._queue.put(_STOP)
        if wait and not self.on_optimizer_thread():
            self._thread.join(timeout)

    def __enter__(self) -> OptimizerThread:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown(wait=True)

    def __repr__(self) -> str:
        state = "closed" if self._closed else "running"
        with self._lock:
            pending = len(self._pending)
        return f"OptimizerThread({self.name!r}, {state}, {pending} pending)"

    def _undelivered_errors(self) -> list[BaseException]:
        with self._lock:
            failed = [f for f in self._undelivered if not f._delivered]
        return [e for e in (f._error() for f in failed) if e is not None]

    # ------------------------------------------------------------------ worker side
    def _run(self) -> None:
        _local.owner = self
        while (item := self._queue.get()) is not _STOP:
            assert isinstance(item, _WorkItem)
            if item.future.set_running_or_notify_cancel():
                self._execute(item)
            with self._lock:
                del self._pending[item.future]

    def _execute(self, item: _WorkItem) -> None:
        try:
            result = self._call(item)
        except BaseException as e:  # noqa: BLE001 - a job must never kill the worker
            if hasattr(e, "add_note"):  # Python 3.11+
                what = "step" if item.is_step else "job"
                e.add_note(f"(raised on {self.name}, in {what} {getattr(item.fn, '__qualname__', item.fn)!s})")
            with self._lock:  # tracked before it is set: whoever sees it done finds it here
                self._undelivered.append(item.future)
            item.future.set_exception(e)
        else:
            item.future.set_result(result)

    def _call(self, item: _WorkItem) -> Any:
        if item.ready is None:  # no CUDA work to wait for (or inline: on the worker stream)
            return item.fn(*item.args, **item.kwargs)
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        self._stream.wait_event(item.ready)
        with torch.cuda.stream(self._stream):
            try:
                return item.fn(*item.args, **item.kwargs)
            finally:
                item.future.done_event = _record_event()


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
        if _default is None or _default.closed:
            _default = OptimizerThread("fp16kit-optimizer")
        return _default


@atexit.register
def _drain_at_exit() -> None:
    threads = list(_live)
    for t in threads:  # stop them all first: they drain side by side, within one deadline
        t.shutdown(wait=False)
    deadline = time.monotonic() + EXIT_TIMEOUT_S
    for t in threads:
        t._thread.join(max(0.0, deadline - time.monotonic()))
        if t._thread.is_alive():
            with t._lock:
                job = f"{len(t._pending)} job(s)" if t._pending else "a job"
            logger.warning(
                "%s still running %s after %.0f s at interpreter exit; exiting without it.",
                t.name,
                job,
                EXIT_TIMEOUT_S,
            )
        for exc in t._undelivered_errors():
            logger.error(
                "An optimizer job failed and its error was never collected (call synchronize()):\n%s",
                "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
            )
