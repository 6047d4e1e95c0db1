"""The optimizer :class:`~fp16kit.integrations.accelerate.MasterWeightsAccelerator` prepares.

Accelerate's ``AcceleratedOptimizer`` around a :class:`fp16kit.MixedPrecisionOptimizer`,
whose step and skipped-step signal go through fp16kit's scaler.

Accelerate 1.15 (``accelerate/optimizer.py``: ``AcceleratedOptimizer.step``,
``patch_optimizer_step``) decides that a step was skipped when ``scaler.step(optimizer)`` did
not call the optimizer's (temporarily patched) ``step``. With ``async_step=True`` the scaler
hands every step to the optimizer thread without calling ``step()`` on the main thread, so
that test reads "skipped" for every step, or "stepped" for one the thread will skip. Here the
answer is the scaler's own flag instead. At each hook:

* ``step()`` on a micro-step of gradient accumulation (Accelerate's
  ``GradientState.sync_gradients`` is False): nothing, as Accelerate (the grads keep
  accumulating in the model's fp16/bf16 ``.grad``).
* ``step()`` on a sync step, fp16 (a :class:`fp16kit.GradScaler`)::

      scaler.step(mixed_precision_optimizer)    # unscale into the fp32 masters (unless a clip
                                                # did), skip on inf/NaN, step, masters -> model
      owed update                               # scaler.update() runs once, later
      flag = scaler.last_step_skipped_tensor()  # a device tensor: no host sync here

  The update is not run here: another optimizer may step on the same grads, and must unscale
  them with this iteration's scale (torch.amp: step every optimizer, then update once). The
  step marks it owed (:mod:`fp16kit.integrations._scale_updates`; shared by one accelerator's
  optimizers): it runs right here once every prepared optimizer has stepped since the last
  update (one optimizer: after each step), else at the next ``accelerator.backward`` /
  ``save_state`` / ``load_state`` / ``settle_scale()``. The skip flag is read before the
  update, from this iteration's checked grads.
* ``step()`` on a sync step, bf16 (no scaler; or a disabled one): ``flag`` = a non-finite check of the grads the
  step will use (model grads, and in a synchronous step the masters' if a clip read them
  already), then ``MixedPrecisionOptimizer.step()`` -- which skips the step on exactly that
  condition.
* ``step_was_skipped`` (read by Accelerate's ``AcceleratedScheduler`` and
  ``accelerator.optimizer_step_was_skipped``): ``flag.item()``, one host read per call, and no
  wait for an asynchronous step: the flag is computed on the main thread before the step is
  handed off. False before the first step; micro-steps keep the last sync step's answer (as
  Accelerate's flag does).
* ``zero_grad()``: Accelerate's (only on sync steps). After a clip unscaled the grads of a
  step the user then skipped (no ``step()``; e.g. on a non-finite norm): the step counts as
  skipped and the scaler's update is owed (see :meth:`MasterWeightsAcceleratedOptimizer.zero_grad`).
"""

from __future__ import annotations

from .._requires import require

require("accelerate", extra="accelerate", tested=("1.15", "1.16"))

from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from accelerate.optimizer import AcceleratedOptimizer  # noqa: E402

from ... import GradScaler, MixedPrecisionOptimizer  # noqa: E402
from ...core import kernels  # noqa: E402
from .._scale_updates import OwedUpdate  # noqa: E402

__all__ = ["MasterWeightsAcceleratedOptimizer", "UnscaledThisIteration"]


class UnscaledThisIteration:
    """The prepared optimizers a clip unscaled this iteration and that have not stepped yet.

    Shared by one accelerator's optimizers (main thread only)."""

    def __init__(self) -> None:
        self._pending: set[int] = set()
        self._done: set[int] = set()  # stepped (or skipped by zero_grad) since the last backward
        self.owed = OwedUpdate()  # the iteration's scaler.update() (see _scale_updates)
        self.members: Callable[[], list[Any]] = list  # the optimizers sharing the scaler

    def unscale(self, scaler: GradScaler, optimizer: MixedPrecisionOptimizer) -> None:
        """``scaler.unscale_(optimizer)`` once per iteration (a second clip reuses it).

        Refused after that optimizer's step, before the next backward: its grads are
        spent, and a second unscale would update the scaler twice in one iteration."""
        if id(optimizer) in self._done:
            raise RuntimeError(
                "accelerator.clip_grad_norm_/clip_grad_value_/unscale_gradients() after "
                "optimizer.step() (or zero_grad()) and before the next accelerator.backward(): this "
                "iteration's grads were used already. Clip between backward and optimizer.step(); "
                "its return value is the (unscaled) norm to log."
            )
        if id(optimizer) not in self._pending:
            scaler.unscale_(optimizer)
            self._pending.add(id(optimizer))

    def backward(self) -> None:
        """A new backward: the stepped optimizers get new grads."""
        self._done.clear()

    def clear(self) -> None:
        """Forget the iteration (a load or ``free_memory`` abandoned it)."""
        self._pending.clear()
        self._done.clear()

    def any_pending(self) -> bool:
        """Is any optimizer unscaled this iteration and not stepped (or zeroed) yet?"""
        return bool(self._pending)

    def pending(self, optimizer: MixedPrecisionOptimizer) -> bool:
        """Was ``optimizer`` unscaled this iteration, with its step still to come?"""
        return id(optimizer) in self._pending

    def stepped(self, optimizer: MixedPrecisionOptimizer) -> bool:
        """Record the step of ``optimizer``; True when no unscaled optimizer still has to step.

        The scaler may update now."""
        self._pending.discard(id(optimizer))
        self._done.add(id(optimizer))
        return not self._pending


class MasterWeightsAcceleratedOptimizer(AcceleratedOptimizer):
    """``AcceleratedOptimizer`` whose ``step`` runs ``scaler.step``/``scaler.update`` on a MixedPrecisionOptimizer.

    Its ``step_was_skipped`` reads the scaler's flag (see the module docstring).
    ``optimizer.optimizer`` is the :class:`fp16kit.MixedPrecisionOptimizer`;
    ``optimizer.optimizer.optimizer`` the torch optimizer it steps on the masters."""

    def __init__(
        self,
        optimizer: MixedPrecisionOptimizer,
        scaler: GradScaler | None,
        unscaled: UnscaledThisIteration,
    ) -> None:
        # No scaler for the base class: it would patch optimizer.step (the test this class
        # replaces). No device placement: the masters and their state were made on the
        # params' device, after prepare placed the model.
        super().__init__(optimizer, device_placement=False, scaler=None)
        self.scaler = scaler
        self._unscaled = unscaled
        self._skipped: torch.Tensor | None = None

    def step(self, closure: Callable[[], Any] | None = None) -> None:
        """Step on a sync step (see the module docstring); a no-op on an accumulation micro-step."""
        if not self.gradient_state.sync_gradients:
            return
        if closure is not None:
            raise RuntimeError(
                "MasterWeightsAccelerator's optimizer.step() takes no closure (torch's GradScaler "
                "refuses closures too). For LBFGS-style optimizers use fp16kit.MixedPrecisionOptimizer "
                "without Accelerate."
            )
        opt = self.optimizer
        if self.scaler is not None and self.scaler.is_enabled():
            self.scaler.step(opt)
            self._unscaled.stepped(opt)
            self._skipped = self.scaler.last_step_skipped_tensor()  # known before the update
            self._unscaled.owed.stepped(self.scaler, opt, self._unscaled.members())
        else:
            self._skipped = _nonfinite(opt)
            opt.step()

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Accelerate's ``zero_grad``, counting a step that never came as skipped.

        Accelerate's. On a sync step whose grads a clip unscaled but that never stepped (the
        user skipped it, e.g. on a non-finite clipped norm): that step counts as skipped, and
        the scaler updates once no unscaled optimizer is left to step -- what torch.amp's
        ``scaler.update()`` after ``unscale_`` does: the scale halves if the grads held
        inf/NaN. (Left pending, the next iteration would reuse this one's unscale and its
        inf flag: a scaled norm and a lost step.)"""
        opt = self.optimizer
        if self.gradient_state.sync_gradients and self._unscaled.pending(opt):
            self._unscaled.stepped(opt)
            if self.scaler is not None:
                self._unscaled.owed.stepped(self.scaler, opt, self._unscaled.members())
            self._skipped = torch.ones((), dtype=torch.bool)
        super().zero_grad(set_to_none)

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last sync step was skipped for inf/NaN gradients (a host read)."""
        return bool(self._skipped is not None and self._skipped.item())

    def __getstate__(self) -> dict[str, Any]:
        raise RuntimeError(
            "A prepared MixedPrecisionOptimizer cannot be pickled (it refers to the model's params); "
            "use accelerator.save_state(dir) / accelerator.load_state(dir)."
        )


def _nonfinite(opt: MixedPrecisionOptimizer) -> torch.Tensor:
    """0-dim bool device tensor: does any grad this step uses hold inf/NaN? No host sync, and
    the grads are only read (an in-place check would count as an edit of the model grads).

    The model grads always (bf16 grads are finite exactly when their fp32 copies are); the
    optimizer's own (masters, fp32 params) only in a synchronous step, where a clip may have
    read the grads into them already -- with ``async_step`` they belong to the step in flight.
    The max-abs norm of a tensor is non-finite exactly when one of its values is."""
    tensors = [p.grad for p in opt.model_params if p.grad is not None]
    if not opt.async_step:
        tensors += [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
    if not tensors:
        return torch.zeros((), dtype=torch.bool)
    device = tensors[0].device
    maxima = [kernels.move(n, device, torch.float32) for n in kernels.norms(tensors, float("inf"))]
    return torch.stack(maxima).isfinite().all().logical_not()
