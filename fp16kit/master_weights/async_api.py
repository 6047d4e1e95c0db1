"""The public entry points of :class:`~fp16kit.MixedPrecisionOptimizer`'s asynchronous steps (docs/async.md).

The work is :class:`~fp16kit.master_weights.async_step.AsyncSteps`'; these methods check the call (main thread, the
right mode) and hand it over. A mixin of the optimizer, kept here so the optimizer's class holds its synchronous
protocol and this file the asynchronous one's surface: the two halves of mode 1 (:meth:`async_check_grads`,
:meth:`async_submit`, for loops that drive the scale themselves), mode 2 (:meth:`submit_step`), the waits
(:meth:`synchronize`, :meth:`wait_for_step`) and where the steps run (:attr:`async_policy`,
:mod:`fp16kit.master_weights.async_policy`).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from ..core.protocol import Flags
from .async_policy import check_policy
from .async_step import AsyncSteps
from .grads import MasterGrads

__all__ = ["AsyncEntryPoints"]


class AsyncEntryPoints:
    """The asynchronous half of MixedPrecisionOptimizer's public methods (module docstring)."""

    _async: AsyncSteps
    _grads: MasterGrads
    _refresh: Callable[[], None]  # adopts params unfrozen since the last step
    async_step: bool

    @property
    def async_policy(self) -> str | None:
        """Where asynchronous steps run: ``"thread"``, ``"inline"``, or ``"probing"`` while ``"auto"`` measures both.

        None with ``async_step=False``. Assign ``"thread"``, ``"inline"`` or ``"auto"`` (measure again) to change it
        from the next step on (:mod:`fp16kit.master_weights.async_policy`). The numbers are the same in every mode."""
        return self._async.policy.mode if self.async_step else None

    @async_policy.setter
    def async_policy(self, policy: str) -> None:
        if policy is None or (check_policy(policy) and not self.async_step):
            raise ValueError(
                f"async_policy = {policy!r}: assign 'auto', 'thread' or 'inline', to an optimizer built with "
                "async_step=True (a synchronous one has no asynchronous steps to place)."
            )
        self._async.require_main("async_policy", async_step=True)
        self._async.policy.set(policy)

    def async_check_grads(self, *, reduce: Callable[[Flags], Flags] | None = None, land: bool = True) -> Flags:
        """Check this step's model grads for inf/NaN on their device: the first half of an asynchronous step.

        On the main thread, with ``async_step=True``; ``reduce`` may all-reduce the flags. Returns
        ``{device: found_inf}``. No host sync. Then call :meth:`async_submit`. With ``land`` it also waits for the step
        in flight (re-raising its error) and lands its masters in the model meanwhile -- only when nothing (a retained
        autograd graph, a second loss) still needs the current weights; otherwise :meth:`async_submit` lands."""
        self._async.require_main("async_check_grads", async_step=True)
        self._refresh()
        return self._async.check_grads(reduce=reduce, land=land)

    def async_submit(
        self,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        *,
        missing_grads: str = "none",
        on_skip: Callable[[], Any] | None = None,
    ) -> Future:
        """Queue this step's job on the optimizer thread: the second half of an asynchronous step.

        After :meth:`async_check_grads`: land the previous step (if that did not), hand this step's model grads to the
        optimizer thread (the model grads are cleared) and queue the job. There it skips the step -- calling
        ``on_skip()`` -- if ``found_inf`` is set, and otherwise unscales the grads by ``inv_scale`` into the master
        grads and steps. ``missing_grads`` says what a master whose param got no grad holds: ``"none"`` (no grad: the
        optimizer skips it), ``"zero"``, or ``"keep"`` (its previous grad, as apex's FP16_Optimizer). Pending errors are
        raised before anything is handed off: the call can be repeated."""
        self._async.require_main("async_submit", async_step=True)
        fut = self._async.submit(inv_scale, found_inf, missing_grads=missing_grads, on_skip=on_skip)
        self._async.main.state.reset()
        return fut

    def submit_step(self, fn: Callable[[], Any], *, scaler: Any = None) -> Future:
        """Mode 2 (docs/async.md): run ``fn`` on the optimizer thread, beside the next forward/backward.

        ``fn`` is e.g. ``lambda: (scaler.step(opt), opt.zero_grad())``. On the main thread: wait for the previous
        submitted step (re-raising its error), copy the masters it produced into the model, move this step's raw (still
        scaled) model grads into the master grads -- the model grads are cleared, so the next backward starts from zero
        -- and submit ``fn``. Returns its Future; call :meth:`synchronize` before evaluating or exporting the model.

        ``scaler``: the :class:`fp16kit.GradScaler` whose ``step`` ``fn`` calls; it is bound to this optimizer's thread
        now (``scaler.bind(opt.thread)``), so ``scaler.update()`` right after this call knows its step runs there.
        Without it the scaler binds itself when that is unambiguous (see :mod:`fp16kit.scaler.binding`)."""
        fut = self._async.submit_step(fn, scaler=scaler, missing_grads=self._grads.missing)
        self._async.main.state.reset()
        return fut

    def synchronize(self) -> None:
        """Wait for the step in flight and copy the final masters into the model.

        Call it before evaluating or exporting an asynchronously trained model. A no-op otherwise, and inside a step job
        (which cannot wait for itself)."""
        if self._async.side().on_main:
            self._async.land()
            self._async.policy.give_back()  # the thread count the program set (async_policy: inline steps borrow)

    def wait_for_step(self) -> None:
        """Wait for the step in flight (re-raising its error) without landing its masters in the model.

        A no-op on the optimizer thread and with no step in flight."""
        if self._async.side().on_main:
            self._async.wait()
