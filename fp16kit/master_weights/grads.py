"""This step's gradients into what a MixedPrecisionOptimizer steps, by the stage of the step.

::

    transfer(inv_scale, found_inf)          # the building block (records nothing)
        master.grad = float(model.grad) * inv_scale     for the fp16/bf16 params
        param.grad *= inv_scale                         for the direct (fp32) params
        one non-finite check over all -> {device: found_inf}
    read(state, inv_scale, found_inf)       # by a scaler's unscale_, or by step() at scale 1
        HANDED_OFF: the raw grads are in the masters already: unscale them there
        UNSCALED at scale 1 from the current model grads (clip_grad_norm_ before
            scaler.unscale_, as torch allows): unscale them there, clipped as they are
        otherwise:  transfer(), remembering which model grads were read
        -> state UNSCALED
    ensure(state)                           # before a step or clipping
        UNSCALED but the model grads changed since: an error if a scaler unscaled them
            (clipping model.parameters() after scaler.unscale_), else read them again
        HANDED_OFF: check the raw grads at scale 1;  MODEL_GRADS: read them at scale 1
    for_async_step(state, scale, ...)       # before a step is submitted to the thread
        the flags of grads already in the masters (scaler.unscale_ ran; or clip_grad_norm_
        read them at scale 1: with a scale they are unscaled there now), or None: the model
        grads are handed off to the job
    closure(state, fn)                      # an LBFGS-style step: each evaluation of fn that
        ran a backward re-reads the grads at scale 1 (one that did not -- torch's
        scaler.step(opt, closure) -- keeps the unscaled ones); non-finite ones raise FloatingPointError (a step
        cannot be skipped inside the optimizer); from the second evaluation on, the model
        first gets the masters' current values

``settle`` runs first in ``read`` and ``ensure``: after a step the fused kernel took, it makes the master
grads that step left (:mod:`fp16kit.master_weights.fused_step`). ``before_write`` runs before the master
grads are written: it adopts params unfrozen since the last step and, with asynchronous steps, waits for
the job that still reads the masters.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..core import kernels
from ..core.master import MasterParams
from ..core.protocol import Flags
from .groups import MasterGroups
from .step_state import Stage, StepState, TransferRecord

__all__ = ["MasterGrads", "RESET_SINCE_UNSCALE"]

RESET_SINCE_UNSCALE = (
    "scaler.unscale_(optimizer) ran this iteration, but the optimizer's gradients were reset since "
    "(zero_grad(), load_state_dict(), or a step(closure)). Call zero_grad() before the backward, then "
    "scaler.unscale_(optimizer) and scaler.step(optimizer)."
)


class MasterGrads:
    """Moves a step's grads into the masters (see the module docstring)."""

    def __init__(
        self,
        masters: MasterParams,
        groups: MasterGroups,
        before_write: Callable[[], None],
        *,
        hands_off: bool,
        settle: Callable[[StepState], None] = lambda state: None,
    ) -> None:
        self._masters = masters
        self._groups = groups
        self._before_write = before_write
        self._settle = settle  # makes the master grads of a step the fused kernel took (fused_step.settle)
        self._hands_off = hands_off  # every step hands the model grads off (async_step)
        self.missing = "none"  # main thread only: see zeroed()

    def zeroed(self, set_to_none: bool) -> None:
        """Record ``zero_grad(set_to_none)`` on the main thread, for model grads that are handed off.

        Handed off: asynchronous steps, submit_step. Applied to the masters at the next transfer -- with
        ``set_to_none=False`` a master whose param gets no grad keeps a zero grad and is stepped (momentum,
        weight decay), as torch steps a zeroed grad; with True it has none and is skipped."""
        self.missing = "none" if set_to_none else "zero"

    def transfer(self, inv_scale: torch.Tensor, found_inf: torch.Tensor, *, clear_missing: bool | None = None) -> Flags:
        self._before_write()
        if clear_missing is None:  # as the last zero_grad() said
            # (without hand-offs a zeroed model grad is there to be copied: nothing to do)
            zero = self._hands_off and self.missing == "zero"
            if zero:
                self._masters.zero_grad(False, model=False)
            clear_missing = not zero
        return kernels.flag_nonfinite_scale_(
            kernels.merge_found_inf(
                self._masters.grads_to_masters(inv_scale, found_inf, clear_missing=clear_missing),
                kernels.unscale_grads_(self._groups.direct_params(), inv_scale, found_inf, allow_fp16=True),
            ),
            inv_scale,
        )

    def present(self) -> list[torch.Tensor]:
        """The master grads that exist."""
        return [m.grad for m in self._masters.masters if m.grad is not None]

    def read(self, state: StepState, inv_scale: torch.Tensor, found_inf: torch.Tensor, *, by_scaler: bool) -> Flags:
        self._settle(state)
        if state.stage is Stage.HANDED_OFF:  # submit_step moved the raw grads in already
            flags = kernels.unscale_(self.present(), inv_scale, found_inf)
        elif state.in_masters and not state.by_scaler and state.current(self._masters.model_params):
            # Read at scale 1 already (clip_grad_norm_ before scaler.unscale_, as torch allows:
            # it clipped the scaled grads): unscale what is in the masters, clipped as it is.
            flags = kernels.merge_found_inf(
                kernels.unscale_(self.present(), inv_scale, found_inf),
                kernels.unscale_grads_(self._groups.direct_params(), inv_scale, found_inf, allow_fp16=True),
            )
        else:
            flags = self.transfer(inv_scale, found_inf)
            # Only the fp16/bf16 model grads: fp32 params' grads are the unscaled ones and may
            # be clipped in place after unscale_.
            state.unscaled(flags, by_scaler=by_scaler, transfer=TransferRecord(self._masters.model_params))
            return flags
        flags = kernels.flag_nonfinite_scale_(flags, inv_scale)  # as transfer() does
        state.unscaled(flags, by_scaler=by_scaler)
        return flags

    def ensure(self, state: StepState) -> None:
        self._settle(state)
        if state.in_masters and not state.current(self._masters.model_params):
            if state.spent:
                state.reset()  # a new backward after the last step: this step's grads
            else:
                # Read this iteration by unscale_ or a clip: re-reading would silently undo
                # what was done to the masters' grads since (the clip).
                when = "scaler.unscale_(optimizer)" if state.by_scaler else "optimizer.clip_grad_norm_()"
                raise RuntimeError(
                    f"The model's gradients changed after {when}. With MixedPrecisionOptimizer the "
                    "gradients the step uses live on the masters from then on: clip or edit the params "
                    "in optimizer.param_groups (or call optimizer.clip_grad_norm_), not "
                    "model.parameters(), and run every backward before unscaling or clipping."
                )
        device = self._groups.flag_device()
        if state.stage is Stage.HANDED_OFF:  # raw grads at scale 1: only check them
            state.unscaled(kernels.check_finite_(self.present(), kernels.new_found_inf(device)), by_scaler=False)
        elif not state.in_masters:
            self.read(state, kernels.one(device), kernels.new_found_inf(device), by_scaler=False)

    def closure(self, state: StepState, closure: Callable[[], Any]) -> Callable[[], Any]:
        first = [True]

        def wrapped() -> Any:
            # The optimizer may evaluate the closure at several points (LBFGS's line search):
            # from the second call on, the model must see the masters' current values.
            if not first[0]:
                self._masters.masters_to_model()
            first[0] = False
            with torch.enable_grad():
                loss = closure()
            if not state.current(self._masters.model_params):
                state.reset()  # the closure ran a backward: its grads, at scale 1
            self.ensure(state)  # (no backward, e.g. after scaler.unscale_: the masters' stand)
            combined = state.found_inf(self._groups.flag_device())
            if combined is not None and combined.item():
                raise FloatingPointError(
                    "The closure produced non-finite gradients (inf/NaN) at scale 1; the step "
                    "cannot be skipped inside the optimizer. Check the loss and the inputs."
                )
            return loss

        return wrapped

    def for_async_step(
        self,
        state: StepState,
        scale: torch.Tensor | None,
        reduce: Callable[[Flags], Flags] | None,
        unscaled_flags: Flags | None,
    ) -> Flags | None:
        if unscaled_flags is not None:  # the scaler unscaled them: they must still be there
            if not state.in_masters:
                raise RuntimeError(RESET_SINCE_UNSCALE)
            self.ensure(state)  # raises if the model grads changed since
            return unscaled_flags
        if state.in_masters and state.current(self._masters.model_params):
            if scale is not None and not state.by_scaler:
                # clip_grad_norm_ read (and clipped) the scaled grads at scale 1: unscale them
                # there, as the scaler's unscale_ would have
                flags = self.read(state, kernels.inv_scale(scale), kernels.new_found_inf(scale.device), by_scaler=True)
                return reduce(flags) if reduce is not None else flags
            return state.flags
        if state.in_masters and state.by_scaler:
            self.ensure(state)  # raises: the model grads changed after scaler.unscale_
        state.reset()
        return None
