"""A GradScaler whose steps run on the optimizer thread (docs/async.md §4, mode 2).

A :class:`fp16kit.GradScaler` is *bound* to an :class:`~fp16kit.core.thread.OptimizerThread`
explicitly -- ``opt.submit_step(fn, scaler=scaler)`` or ``scaler.bind(thread)`` -- or lazily
where that is unambiguous: when it is first used from inside a job on that thread, or when
``update()`` finds no step of its own recorded and exactly one thread received steps since
this iteration's ``scale()`` (:func:`~fp16kit.core.thread.threads_with_steps_since`). Bound, it
keeps one record per iteration in a :class:`ThreadBinding`::

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

Each side sees its own scale and per-optimizer states (:meth:`ThreadBinding.scale_for_caller`,
:meth:`ThreadBinding.states_for_caller`): the step being run on the optimizer thread, the next
forward's on the main thread. The records are shared between the two threads under a lock.

All of a GradScaler's thread routing lives here, so that its methods read like torch's plus one
call where threads matter: its ``_threads`` (:class:`ThreadSide`) is a :class:`ScalerThreads`, and
``scale()`` calls :meth:`~ScalerThreads.scaled`; ``unscale_()`` and ``step()``,
:meth:`~ScalerThreads.route`; ``update()``, :meth:`~ScalerThreads.update`; ``bind()``,
:meth:`~ScalerThreads.bind_explicitly`; the settings, :meth:`~ScalerThreads.apply` (``set_*``)
and :meth:`~ScalerThreads.read` (``get_*``);
the skip counters, :meth:`~ScalerThreads.after`; its checkpoints and copies
(:mod:`fp16kit.scaler.checkpoint`), :meth:`~ScalerThreads.saved`, :meth:`~ScalerThreads.load`
and :meth:`~ScalerThreads.pickled`. Its ``_scale`` and ``_per_optimizer_states`` are the
per-thread views :class:`ScaleField` and :class:`StatesField`.
"""

from __future__ import annotations

import math
import threading
from collections import defaultdict, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, overload

import torch
from torch.amp.grad_scaler import _refresh_per_optimizer_state

from ..core import kernels
from ..core.scale import LossScale
from ..core.thread import OptimizerThread, current_optimizer_thread, step_serial, threads_with_steps_since
from .fields import LossScaleField
from .skips import recorded_flags

__all__ = ["IterationRecord", "ScaleField", "ScalerThreads", "StatesField", "ThreadBinding", "ThreadSide"]

# Where a scaler keeps its ScalerThreads (never pickled), and the lag a pickled copy carries.
THREADS_KEY = "_thread_side"
LAG_KEY = "_lagged_next_scale"

_ORDER = (
    "With steps on the optimizer thread the order is: loss = scaler.scale(loss); "
    "loss.backward(); opt.submit_step(lambda: (scaler.step(opt), opt.zero_grad()), "
    "scaler=scaler); scaler.update()."
)


@dataclass
class IterationRecord:
    """One iteration's forward scale and its per-optimizer states (torch's dicts)."""

    scale: torch.Tensor
    states: defaultdict = field(default_factory=lambda: defaultdict(dict))


class ThreadBinding:
    """A bound scaler's thread, forward scale and iteration records (see module docstring)."""

    def __init__(
        self,
        thread: OptimizerThread,
        loss_scale: LossScale,
        refresh: Callable[[], Any],
        *,
        mark: int | None,
    ) -> None:
        assert loss_scale.scale is not None
        self.thread = thread
        self.loss_scale = loss_scale
        self.forward_scale = loss_scale.scale.detach().clone()
        self.records: deque[IterationRecord] = deque()
        self.open: IterationRecord | None = None  # the record main is filling this iteration
        self.last_update: Future | None = None
        # Steps enqueued on the thread up to the last update(); None: not known (bound from
        # inside a job, the first update cannot tell which of the jobs so far were steps).
        self.mark = mark
        # ids of the optimizers that submit_step(fn, scaler=) submitted since the last
        # update() (main thread only)
        self.submitted: set[int] = set()
        # a loaded "next_scale" until the first update() hands it to its job (main thread only)
        self.resumed_scale: float | None = None
        self.lock = threading.Lock()
        self._refresh = refresh

    # ------------------------------------------------------------------ per-side views
    def on_thread(self) -> bool:
        return self.thread.on_optimizer_thread()

    def scale_for_caller(self) -> torch.Tensor:
        """The scale of the step being run on the optimizer thread; the next forward's here."""
        return self.head().scale if self.on_thread() else self.forward_scale

    def states_for_caller(self) -> Any:
        """On the optimizer thread, the per-optimizer states of the step being run.

        None elsewhere (the scaler's own)."""
        return self.head().states if self.on_thread() else None

    # ------------------------------------------------------------------ records
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

    def _close_open(self) -> IterationRecord:
        rec = self.open_record()
        with self.lock:
            self.open = None
        return rec

    def _pop(self, rec: IterationRecord) -> None:
        with self.lock:
            if not self.records or self.records[0] is not rec:
                raise RuntimeError("internal: GradScaler iteration records out of order")
            self.records.popleft()

    def mid_iteration(self) -> bool:
        """Say whether a step was submitted or recorded that no ``update()`` has consumed yet.

        Main thread, after waiting for the thread. (Then the scaler may not be pickled, as torch's.)"""
        with self.lock:
            return bool(self.submitted) or any(len(r.states) for r in self.records)

    def reset(self, scale: torch.Tensor) -> None:
        """After a load or a new scale: forget the records, start from ``scale`` on both sides."""
        with self.lock:
            self.records.clear()
            self.open = None
        self.forward_scale.copy_(scale)
        self.last_update = None
        self.resumed_scale = None
        self.mark = self.thread.steps
        self.submitted = set()

    # ------------------------------------------------------------------ main-thread calls
    def run_there(self, fn: Callable[..., Any], *args: Any, step: bool = False, **kwargs: Any) -> None:
        """Run ``fn`` on the optimizer thread, behind the queued work, and wait (main thread).

        Raises a pending error first; ``step``: it is an optimizer step."""
        self.thread.raise_pending_error()
        self.thread.wait(self.thread.enqueue(fn, args, kwargs, step=step))

    def queue(self, fn: Callable[..., Any], *args: Any) -> None:
        """Main thread: queue ``fn`` behind the pending jobs (a setting for later steps)."""
        self.thread.submit(fn, *args)

    def submitting(self, optimizer: Any) -> None:
        """Refuse a second submitted step of ``optimizer`` with no ``update()`` since its last one.

        Main thread, before ``submit_step(fn, scaler=)`` hands anything off."""
        if id(optimizer) in self.submitted:
            raise RuntimeError(
                "This optimizer already submitted a step since the last scaler.update(): call "
                "scaler.update() once per iteration, after the steps. " + _ORDER
            )
        self.submitted.add(id(optimizer))

    def update(self, is_async: bool) -> None:
        """Main thread: ``scaler.update()`` (see the module docstring).

        The waits come before anything changes, so a Ctrl-C in one leaves the records as they were."""
        if self.mark is not None and self.thread.steps <= self.mark:
            raise RuntimeError("scaler.update() was called before this iteration's step. " + _ORDER)
        self.thread.raise_pending_error()
        if self.last_update is not None:
            self._publish(self.last_update)  # the next loss uses iteration k-1's result
            self.last_update = None
        record = self._close_open()
        resumed, self.resumed_scale = self.resumed_scale, None
        self.last_update = self.thread.enqueue(self._update_job, (record, resumed))
        self.mark = self.thread.steps
        self.submitted = set()
        if not is_async:
            self._publish(self.last_update)

    def set_scale(self, new_scale: float | torch.Tensor) -> None:
        """Main thread: ``update(new_scale)``: after the queued work, on both sides."""
        self.thread.synchronize()
        self._close_open()
        self.loss_scale.set_scale(new_scale)
        assert self.loss_scale.scale is not None
        self.reset(self.loss_scale.scale)

    def _publish(self, fut: Future) -> None:
        """Wait for an update job and make its scale the forward scale."""
        new_scale = self.thread.wait(fut)
        self.thread.wait_stream(fut)
        if new_scale is not None:  # None: its error was delivered already
            self.forward_scale.copy_(new_scale)

    def _update_job(self, record: IterationRecord, resumed: float | None) -> torch.Tensor:
        """On the optimizer thread, after the iteration's step: the scale update (from
        ``resumed``, the saved ``next_scale``, in the first one after a load)."""
        self._pop(record)
        found_infs = recorded_flags(record.states)
        if not found_infs:
            raise RuntimeError(
                "No inf checks were recorded prior to update(): this iteration's submitted step "
                "did not call scaler.step(optimizer) (or scaler.unscale_). " + _ORDER
            )
        scale = self.loss_scale.scale
        assert scale is not None
        if resumed is not None:
            scale.fill_(resumed)
        found = kernels.combine_found_inf(found_infs, scale.device)
        self.loss_scale.update(found, used_scale=record.scale)
        return scale.clone()

    def wait_idle(self) -> None:
        """Wait for the queued work without consuming its errors (for reads of counters)."""
        self.thread.wait_idle()

    def synchronize(self) -> None:
        if not self.on_thread():
            self.thread.synchronize()

    def resume(self, next_scale: float) -> None:
        """Restore the lag after a load of a checkpoint saved mid-lag (main thread).

        See :meth:`ScalerThreads.saved`. The loaded scale stays the forward one; ``next_scale`` -- what the update queued before the save computed -- is
        the one the next ``update()`` publishes, and the one its job starts from. (Not written into the scale
        now: this iteration's loss may have been multiplied by that very tensor, and autograd refuses it
        changed before backward.)"""
        scale = self.loss_scale.scale
        assert scale is not None
        self.resumed_scale = next_scale
        done: Future = Future()
        done.set_result(torch.full_like(scale, next_scale))
        self.last_update = done

    def __getstate__(self) -> Any:
        raise TypeError("internal: a ThreadBinding is never pickled")


class ScalerThreads:
    """A GradScaler's side of the optimizer threads.

    Its :class:`ThreadBinding` once bound, a binding asked for before the first ``scale()`` (made there), and
    the step serial at this iteration's ``scale()`` (for the unambiguous lazy binding in ``update()``). A copy
    or an unpickled scaler starts with a fresh one: unbound."""

    def __init__(self) -> None:
        self.binding: ThreadBinding | None = None
        self._pending: tuple[OptimizerThread, int | None] | None = None
        self._serial: int | None = None
        # "next_scale" of a loaded checkpoint, for the binding made next (None: not saved mid-lag)
        self._next_scale: float | None = None
        self._lock = threading.Lock()

    def bind(self, thread: OptimizerThread, loss_scale: LossScale, *, mark: int | None) -> ThreadBinding | None:
        """Bind to ``thread`` (see ``GradScaler.bind``); None while there is no scale yet."""
        with self._lock:
            binding = self.binding
            if binding is not None and binding.thread is not thread and binding.thread.closed:
                binding = self.binding = None  # its thread was shut down (drained): start over
            if binding is not None:
                if binding.thread is not thread:
                    raise RuntimeError(
                        f"This GradScaler steps on {binding.thread.name}; it cannot also be used "
                        f"from {thread.name}. Use one optimizer thread per scaler."
                    )
                return binding
            if loss_scale.scale is None:  # no scale() yet: bind at the first one
                self._pending = (thread, mark)
                return None
            binding = ThreadBinding(thread, loss_scale, _refresh_per_optimizer_state, mark=mark)
            if not binding.on_thread():
                # This iteration's record, with the scale its loss was (or will be) scaled with:
                # made later, it could see one that this iteration's update() publishes.
                binding.open_record()
            if self._next_scale is not None:  # before it is published: main may read it at once
                binding.resume(self._next_scale)
                self._next_scale = None
            self.binding = binding
            self._pending = None
            return binding

    def bind_explicitly(self, thread: Any, loss_scale: LossScale, *, step_of: Any = None) -> None:
        """``GradScaler.bind(thread, step_of=)``: check ``thread``, bind to it, and note the submitted step of ``step_of``.

        See :meth:`ThreadBinding.submitting`; with no scale yet the binding, and that check, wait for ``scale()``."""
        if not isinstance(thread, OptimizerThread):
            raise TypeError(f"bind() takes an fp16kit.OptimizerThread, got {type(thread).__name__}.")
        binding = self.bind(thread, loss_scale, mark=thread.steps)
        if binding is not None and step_of is not None:
            binding.submitting(step_of)

    def for_caller(self, loss_scale: LossScale) -> ThreadBinding | None:
        """The binding; made when the scaler is first used from inside an optimizer job (it steps there, unambiguously).

        ``loss_scale`` must be materialized then."""
        owner = current_optimizer_thread()
        if owner is not None:
            return self.bind(owner, loss_scale, mark=None)
        return self.binding

    def main(self) -> ThreadBinding | None:
        """The binding, when called on the main thread of a bound scaler."""
        binding = self.binding
        return None if binding is None or binding.on_thread() else binding

    def scaled(self, loss_scale: LossScale) -> None:
        """After ``scale()``: open this iteration's record (bound), or note the step serial."""
        if current_optimizer_thread() is not None:
            self.for_caller(loss_scale)
            return
        if self._pending is not None:
            thread, mark = self._pending
            self.bind(thread, loss_scale, mark=mark)
        if self.binding is not None:
            self.binding.open_record()  # this iteration's loss is scaled with the forward scale
        else:
            self._serial = step_serial()

    def for_update(self, loss_scale: LossScale, *, has_checks: bool) -> ThreadBinding | None:
        """Return the binding for ``update()`` on the main thread, binding lazily where that is unambiguous.

        The binding, or -- with no inf checks recorded here and exactly one thread that received steps since
        ``scale()`` -- a lazy one to it."""
        if self.binding is not None or has_checks or self._serial is None or loss_scale.scale is None:
            if self.binding is None:
                self._next_scale = None  # an update without a thread: a loaded lag is over
            return self.binding
        threads = threads_with_steps_since(self._serial)
        if len(threads) > 1:
            raise RuntimeError(
                f"scaler.update() found no step of this iteration, and steps went to "
                f"{len(threads)} optimizer threads since scaler.scale(): bind the scaler to the "
                "one its steps run on, with opt.submit_step(fn, scaler=scaler) or "
                "scaler.bind(opt.thread)."
            )
        if not threads:
            self._next_scale = None
            return None
        return self.bind(threads[0], loss_scale, mark=None)

    def update(
        self,
        loss_scale: LossScale,
        new_scale: float | torch.Tensor | None,
        *,
        is_async: bool,
        has_checks: Callable[[], bool],
        check_new_scale: Callable[[float | torch.Tensor], None],
    ) -> bool:
        """``GradScaler.update()``'s thread side. True: the binding did the update; False: the scaler does it.

        Refuses a call from an optimizer thread. Bound -- or bound now by :meth:`for_update`, when
        ``has_checks()`` (an inf check recorded by the scaler) is False -- it sets ``new_scale``, checked by
        ``check_new_scale`` first (:meth:`ThreadBinding.set_scale`), or updates (:meth:`ThreadBinding.update`)."""
        if current_optimizer_thread() is not None:
            raise RuntimeError(
                "scaler.update() must be called from the main thread, once per iteration after "
                "the step: loss = scaler.scale(loss); loss.backward(); "
                "opt.submit_step(lambda: scaler.step(opt), scaler=scaler); scaler.update()."
            )
        binding = self.for_update(loss_scale, has_checks=has_checks())
        if binding is None:
            return False
        if new_scale is not None:
            check_new_scale(new_scale)
            binding.set_scale(new_scale)
        else:
            binding.update(is_async)
        return True

    def route(
        self, loss_scale: LossScale, fn: Callable[..., Any], *args: Any, step: bool = False, **kwargs: Any
    ) -> bool:
        """Run ``fn`` on the optimizer thread and wait, from the main thread of a bound scaler.

        Returns False when not bound or already there (the caller runs it inline)."""
        binding = self.for_caller(loss_scale) if loss_scale.scale is not None else self.binding
        if binding is None or binding.on_thread():
            return False
        binding.run_there(fn, *args, step=step, **kwargs)
        return True

    def after(self, read: Callable[[], Any]) -> Any:
        """``read()`` after the queued work of a bound scaler (its errors stay for update())."""
        if self.binding is not None:
            self.binding.wait_idle()
        return read()

    def apply(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)``; from the main thread of a bound scaler, queued behind the pending jobs instead.

        (A setting for the steps still to run there.)"""
        if (binding := self.main()) is not None:
            binding.queue(fn, *args)
        else:
            fn(*args)

    def read(self, fn: Callable[..., Any], *args: Any, up_to_date: bool) -> Any:
        """``fn(*args)``; with ``up_to_date``, after the queued work of a bound scaler (a queued setting included).

        Waiting, it raises the queued jobs' errors (:meth:`synchronize`)."""
        if up_to_date:
            self.synchronize()
        return fn(*args)

    def synchronize(self) -> None:
        if self.binding is not None:
            self.binding.synchronize()

    # ------------------------------------------------------------------ checkpoints
    def saved(self, loss_scale: LossScale, unbound_scale: float) -> tuple[float, dict[str, Any]]:
        """``state_dict()``'s scale entries, after :meth:`synchronize`: ``"scale"``, and the entries that go last.

        Unbound, ``"scale"`` is ``unbound_scale`` (``get_scale()``); on the optimizer thread, the thread's. On
        the main thread between an ``update()`` and the next, it is the forward scale -- what the next loss is
        multiplied with -- and the newer one the queued update computed, which the next ``update()`` publishes
        (the lag), is saved as ``"next_scale"``: a run resumed from the checkpoint in mode 2 goes on bit for
        bit. (torch's ``load_state_dict`` ignores the key; a resume without a thread starts from ``"scale"``.)"""
        binding = self.binding
        if binding is None:  # (a lag loaded for the binding made next is kept)
            return unbound_scale, ({} if self._next_scale is None else {"next_scale": self._next_scale})
        latest = loss_scale.get_scale()
        if binding.on_thread():
            return latest, {}
        if binding.resumed_scale is not None:  # loaded, no update() yet
            latest = binding.resumed_scale
        forward = float(binding.forward_scale.item())
        return forward, ({} if latest == forward else {"next_scale": latest})

    def mid_iteration(self) -> bool:
        """Bound, :meth:`ThreadBinding.mid_iteration` (after :meth:`synchronize`); False when not bound."""
        return self.binding is not None and self.binding.mid_iteration()

    def pickled(self, state: dict[str, Any], loss_scale: LossScale, unbound_scale: float | None) -> float | None:
        """``__getstate__``'s thread side, on a copy of the scaler's ``__dict__`` (after :meth:`synchronize`).

        The copy starts unbound: this side is dropped (a binding holds a thread). Given ``unbound_scale``
        (enabled: ``get_scale()``), returns the scale the copy starts from, :meth:`saved`'s, and leaves the lag
        in ``state``, for the copy's :class:`ThreadSide` to restore as a load would."""
        state.pop(THREADS_KEY, None)
        if unbound_scale is None:
            return None
        scale, lag = self.saved(loss_scale, unbound_scale)
        state[LAG_KEY] = lag.get("next_scale")
        return scale

    @staticmethod
    def check_loaded(state_dict: dict[str, Any]) -> float | None:
        """The ``"next_scale"`` of a state dict being loaded, checked (before anything changes)."""
        value = state_dict.get("next_scale")
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise ValueError(
                f"GradScaler state dict: next_scale must be a finite number > 0 (the scale the "
                f"update queued before the save computed), got {value!r}; load a state dict "
                'saved by GradScaler.state_dict(), or drop the key to resume from "scale".'
            )
        return float(value)

    def load(self, loss_scale: LossScale, state_dict: dict[str, Any], load: Callable[[], None]) -> None:
        """``load_state_dict``'s thread side: after the queued work, check the saved lag, ``load()``, then :meth:`loaded`.

        ``load()`` loads ``state_dict`` into ``loss_scale``, checking it all before it changes anything."""
        self.synchronize()
        next_scale = self.check_loaded(state_dict)
        load()
        self.loaded(loss_scale, next_scale)

    def loaded(self, loss_scale: LossScale, next_scale: float | None) -> None:
        """Restart a binding from the loaded scale after ``load_state_dict``.

        Also restores a saved lag now (bound) or at the binding made next."""
        self._next_scale = next_scale
        binding = self.binding
        if binding is not None and loss_scale.scale is not None:
            binding.reset(loss_scale.scale)
            if next_scale is not None:
                binding.resume(next_scale)
                self._next_scale = None

    def __getstate__(self) -> Any:
        raise TypeError("internal: a scaler's thread side is never pickled (copies start unbound)")


class ThreadSide:
    """``GradScaler._threads``: the scaler's :class:`ScalerThreads`, made at its first use.

    Also for a scaler unpickled from an older version. A pickled copy's lag (:meth:`ScalerThreads.pickled`) is
    restored then, as a loaded state dict's is."""

    @overload
    def __get__(self, obj: None, objtype: type | None = None) -> ThreadSide: ...

    @overload
    def __get__(self, obj: object, objtype: type | None = None) -> ScalerThreads: ...

    def __get__(self, obj: Any, objtype: type | None = None) -> ThreadSide | ScalerThreads:
        if obj is None:
            return self
        threads = obj.__dict__.get(THREADS_KEY)
        if threads is None:
            threads = obj.__dict__[THREADS_KEY] = ScalerThreads()
            threads.loaded(obj._loss_scale, obj.__dict__.pop(LAG_KEY, None))
        return threads


class ScaleField(LossScaleField):
    """``_scale``: bound to an optimizer thread, each side sees its own scale -- the step being
    run on the optimizer thread, the next forward's on the main thread (docs/async.md)."""

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        threads = obj.__dict__.get(THREADS_KEY)
        if threads is not None and threads.binding is not None:
            return threads.binding.scale_for_caller()
        return super().__get__(obj, objtype)


class StatesField:
    """torch's ``_per_optimizer_states``: the scaler's own, except in a job on the optimizer thread it is bound to.

    There a step records into its iteration's states (:meth:`ThreadBinding.states_for_caller`)."""

    @overload
    def __get__(self, obj: None, objtype: type | None = None) -> StatesField: ...

    @overload
    def __get__(self, obj: object, objtype: type | None = None) -> dict[int, dict[str, Any]]: ...

    def __get__(self, obj: Any, objtype: type | None = None) -> StatesField | dict[int, dict[str, Any]]:
        if obj is None:
            return self
        threads = obj.__dict__.get(THREADS_KEY)
        if (
            threads is not None
            and threads.binding is not None
            and (states := threads.binding.states_for_caller()) is not None
        ):
            return states
        try:
            return obj.__dict__["_opt_states"]
        except KeyError:
            raise AttributeError(f"'{type(obj).__name__}' object has no attribute '_per_optimizer_states'") from None

    def __set__(self, obj: Any, value: dict[int, dict[str, Any]]) -> None:
        obj.__dict__["_opt_states"] = value
