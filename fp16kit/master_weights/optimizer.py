"""``fp16kit.MixedPrecisionOptimizer``: fp32 master weights for fp16/bf16 models, torch.amp style.

``torch.amp.GradScaler`` refuses fp16 gradients, so a model kept in fp16 (or bf16) has no
torch-native way to train with fp32 master weights. This optimizer adds them::

    model = model.half()                                   # or .bfloat16()
    opt = fp16kit.MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    scaler = fp16kit.GradScaler("cuda")
    for x, y in loader:
        opt.zero_grad()
        scaler.scale(loss_fn(model(x), y)).backward()
        scaler.step(opt)      # fp16 grads -> fp32 master grads * 1/scale; step; masters -> model
        scaler.update()

How it works (the algorithm apex's FP16_Optimizer used, on fp16kit's core):

* Construction walks the wrapped optimizer's param groups (:mod:`fp16kit.master_weights.groups`).
  Every trainable fp16/bf16 param is replaced *in place* in its group by an fp32 master
  (``master_dtype``, on ``master_device`` or the param's device); its optimizer state moves to
  the master and is re-cast. Other trainable params (fp32, fp64) are stepped as they are.
  Params frozen then are watched: unfrozen later, they are adopted at the next step (torch's
  rule: whatever has a grad at step time is unscaled and checked).
* Unscale (``scaler.unscale_``/``scaler.step`` through :class:`fp16kit.GradScaler`, which
  speaks :class:`~fp16kit.core.protocol.MasterWeightOptimizer` with it, or ``step()`` alone):
  ``master.grad = float(model.grad) * (1/scale)`` and fp32 params' grads are unscaled in
  place, all with one non-finite check (:mod:`fp16kit.core.kernels`). Where the grads are in a
  step is one :class:`~fp16kit.master_weights.step_state.StepState`.
* Step: the wrapped optimizer steps the masters; the masters are copied back into the model.
  Fused optimizers (``fused=True``) receive ``grad_scale``/``found_inf`` and skip on the device:
  no host sync. Otherwise the skip decision reads the flag on the host (as torch's scaler does).
* Without a scaler, ``step()`` unscales with scale 1 and still refuses non-finite grads: the
  step is skipped (logged) -- or, with a closure, ``FloatingPointError`` is raised. Called
  while a GradScaler has scaled a loss it has not updated yet, it warns (once): the grads are
  probably scaled, and ``scaler.step(opt)`` is the call.
* Asynchronous steps (``async_step=True``, or :meth:`submit_step`): :mod:`fp16kit.master_weights.async_step`.

The unscaled gradients live on the masters: clip ``opt.param_groups``' params (or call
:meth:`clip_grad_norm_`), not ``model.parameters()``, whose fp16 grads are still scaled.
Changing the model grads after ``scaler.unscale_(opt)`` or ``opt.clip_grad_norm_()`` raises at
``step()`` (re-reading them would drop the clip).

Checkpoints: :meth:`state_dict` holds the wrapped optimizer's state dict and the masters
(plain data, ``torch.load(weights_only=True)`` reads it); :meth:`load_state_dict` restores
both exactly and leaves the model params to ``model.load_state_dict``
(:mod:`fp16kit.master_weights.checkpoint` checks the structure first).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from ..core import kernels
from ..core.interrupts import commit_methods
from ..core.master import LOW_PRECISION, MasterParams
from ..core.protocol import Flags
from ..core.thread import OptimizerThread
from .async_api import AsyncEntryPoints
from .async_job import log_skipped_step
from .async_policy import check_policy
from .async_step import AsyncSteps
from .checkpoint import MatchedMasters, check_state_dict
from .fused_step import FUSED, FusedSteps
from .grads import RESET_SINCE_UNSCALE, MasterGrads
from .groups import (
    LatePolicy,
    MasterGroup,
    MasterGroups,
    check_distinct_groups,
    check_not_wrapped,
    check_params,
    drop_repeats,
    mark_wrapped,
)
from .misuse import TORCH_STEP_READER, TORCH_UNSCALE_READER, torch_scaler_error, warn_if_scaled
from .snapshot import StepView
from .step_state import Stage, StepState
from .wrapping import WrappingOptimizer

__all__ = ["MixedPrecisionOptimizer", "MasterGroup"]

logger = logging.getLogger("fp16kit")


class MixedPrecisionOptimizer(WrappingOptimizer, AsyncEntryPoints):
    """Wrap ``optimizer`` (built on the model's params) so it steps fp32 masters of the model's fp16/bf16 params.

    See the module docstring for the algorithm and the contract; :meth:`submit_step` (mode 2) runs a function of yours
    -- typically ``scaler.step(opt); opt.zero_grad()`` -- on the optimizer thread.

    Args:
        optimizer: any ``torch.optim.Optimizer`` over the model's parameters.
        master_dtype: dtype of the masters (default ``torch.float32``; a name such as ``"float32"`` is accepted).
        master_device: device of the masters (default: each param's own device); e.g. ``"cpu"`` keeps masters and
            optimizer state in host memory for a CUDA model. Then fp32 params get masters too: everything the optimizer
            touches lives there.
        flat: keep each device's masters in one contiguous buffer (per-param views).
        async_step: run each step on the optimizer thread beside the next forward/backward, a one-step delayed update
            (:mod:`fp16kit.master_weights.async_step`; every trainable param gets a master). ``step()`` hands the model
            grads to the thread (``p.grad`` is None after it). Call :meth:`synchronize` before evaluating or exporting.
            Each step uses the hyperparameters it was submitted with (:mod:`fp16kit.master_weights.snapshot`).
        thread: the :class:`~fp16kit.core.thread.OptimizerThread` for asynchronous steps (default: the process-wide
            ``fp16kit.optimizer_thread()``).
        async_policy: where asynchronous steps run: ``"auto"`` (measure both, keep the faster), ``"thread"`` or
            ``"inline"`` (:mod:`fp16kit.master_weights.async_policy`; the numbers are the same). Default:
            ``$FP16KIT_ASYNC_POLICY``, else ``"auto"``.
        unfrozen: params frozen when wrapped and trainable later: ``"adopt"`` them at the next step (default), or
            ``"refuse"`` to step them (apex's construction-time rule).
        apex_groups: take the groups as apex's FP16_Optimizer did (the legacy face): a master per listing of a repeated
            param, and no warning about the groups.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        master_dtype: torch.dtype | str = torch.float32,
        master_device: torch.device | str | None = None,
        flat: bool = False,
        async_step: bool = False,
        thread: OptimizerThread | None = None,
        async_policy: str | None = None,
        unfrozen: LatePolicy = "adopt",
        apex_groups: bool = False,
    ) -> None:
        if isinstance(optimizer, MixedPrecisionOptimizer):
            raise TypeError("This optimizer is already a MixedPrecisionOptimizer; wrap the inner optimizer once.")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"MixedPrecisionOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}. "
                "Build the optimizer on the model's parameters first, then wrap it."
            )
        _check_options(unfrozen, thread, async_policy, async_step)
        check_not_wrapped(optimizer)
        master_dtype = _as_dtype(master_dtype)
        # Asynchronous steps and offloaded masters need a master for every trainable param:
        # the optimizer thread must never write a tensor the forward pass reads.
        all_masters = async_step or master_device is not None
        _prepare_groups(optimizer.param_groups, all_masters, master_dtype, as_apex=apex_groups)
        self._masters = MasterParams([], master_dtype=master_dtype, master_device=master_device, flat=flat)
        super().__init__(optimizer)
        self.async_step = async_step
        self._groups = MasterGroups(optimizer, self._masters, all_masters=all_masters, late=unfrozen)
        self._fused = FusedSteps(optimizer, self._groups, async_step=async_step)
        self._async = AsyncSteps(
            self,
            self._masters,
            self._groups,
            thread,
            refresh=self._refresh,
            policy=async_policy if async_step else "thread",  # (mode 2's jobs always run on the thread)
            fused=self._fused,
        )
        self._grads = MasterGrads(
            self._masters, self._groups, self._before_grads, hands_off=async_step, settle=self._fused.settle
        )
        self._warned_unscaled_step = threading.Event()  # set once, from either thread
        for group in optimizer.param_groups:
            self._groups.adopt(group)
        mark_wrapped(optimizer)
        if optimizer.state:
            # Re-cast moved state (e.g. fp16 momentum) to the masters' dtype and device, the
            # way apex did: torch's load_state_dict casts floating state to its param's dtype.
            optimizer.load_state_dict(optimizer.state_dict())

    # ------------------------------------------------------------------ torch.optim surface
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's param groups; inside a step job, the snapshot it steps.

        See :mod:`fp16kit.master_weights.snapshot`. Read by torch's GradScaler: TypeError (optimizer_misuse)."""
        if sys._getframe(1).f_code is TORCH_UNSCALE_READER:
            raise torch_scaler_error(sys._getframe(1), "unscale_", self._masters.model_params)
        job = self._async.running()  # (cheaper than side(): read by torch at every step)
        if job is not None and job.groups is not None:
            return job.groups
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self._groups.check_assignment(value)
        self.optimizer.param_groups = value

    @property
    def _step_supports_amp_scaling(self) -> bool:
        # Fused inner optimizers take grad_scale/found_inf from GradScaler and skip on device.
        # (torch's GradScaler.step reads this first: refused there, see optimizer_misuse)
        if sys._getframe(1).f_code is TORCH_STEP_READER:
            raise torch_scaler_error(sys._getframe(1), "step", self._masters.model_params)
        return bool(getattr(self.optimizer, "_step_supports_amp_scaling", False))

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the wrapped optimizer; its fp16/bf16 params get masters.

        The params are checked as in the constructor before anything changes."""
        if not isinstance(param_group, dict) or "params" not in param_group:
            raise TypeError("add_param_group expects a dict with a 'params' entry.")
        params = param_group["params"]
        param_group["params"] = params = [params] if isinstance(params, torch.Tensor) else list(params)
        _drop_repeats(params, where="the new param group")
        self._groups.check(params, new_group=True)
        self.wait_for_step()  # the step in flight reads the groups and the masters
        self.optimizer.add_param_group(param_group)
        self._groups.adopt(self.optimizer.param_groups[-1])

    @property
    def groups(self) -> list[MasterGroup]:
        """Per param group: the model params with masters, the masters, the direct params."""
        return self._groups.groups

    @property
    def master_params(self) -> list[torch.Tensor]:
        """The fp32 masters, in the order of :attr:`model_params` (what the wrapped optimizer steps)."""
        return list(self._masters.masters)

    @property
    def model_params(self) -> list[torch.Tensor]:
        """The model params that have masters (fp16/bf16 ones; all with async_step or master_device)."""
        return list(self._masters.model_params)

    @property
    def thread(self) -> OptimizerThread:
        """The optimizer thread asynchronous steps run on."""
        return self._async.thread

    def _state(self) -> StepState:
        """The step state of the calling side (:meth:`AsyncSteps.side`): the running job's in a step job."""
        return self._async.side().state

    def _refresh(self) -> None:
        """Adopt params unfrozen since the last step (waits for a step in flight first). On
        the main side only: a job steps the params its step was submitted with."""
        if self._async.side().on_main:
            self._groups.refresh(self.wait_for_step)

    # ------------------------------------------------------------------ grads
    def grads_to_masters(
        self, inv_scale: torch.Tensor, found_inf: torch.Tensor, *, clear_missing: bool = True
    ) -> Flags:
        """Unscale this iteration's grads onto what the optimizer steps, with one non-finite check over all.

        fp16/bf16 model grads go into fp32 master grads, fp32 params' grads are unscaled in place. A master whose model
        param has no grad loses its grad (``clear_missing=False`` keeps it, as apex did). Returns
        ``{device: found_inf}``. No host sync. (The building block; it records nothing in the step state.)"""
        return self._grads.transfer(inv_scale, found_inf, clear_missing=clear_missing)

    def _before_grads(self) -> None:  # MasterGrads' before_write
        self._refresh()
        if self.async_step and self._async.side().on_main:
            self._async.land()  # the previous step's job must be done with the masters

    def masters_to_model(self) -> None:
        """Copy the masters into the model params (rounded to their dtype)."""
        self._async.apply_deferred()
        self._masters.masters_to_model()

    # ------------------------------------------------------------------ the scaler protocol
    def unscale_grads_(self, inv_scale: torch.Tensor, found_inf: torch.Tensor) -> Flags:
        """``scaler.unscale_(opt)`` (:class:`~fp16kit.core.protocol.MasterWeightOptimizer`)."""
        return self._grads.read(self._state(), inv_scale, found_inf, by_scaler=True)

    def check_grads_(self, inv_scale: torch.Tensor, found_inf: torch.Tensor) -> Flags:
        """The scaler's check before a fused step, at scale 1 (``GradScaler._check_inf_per_device``).

        The grads stay in the model when the fused kernel takes the step (:mod:`fp16kit.master_weights.fused_step`);
        otherwise as :meth:`unscale_grads_`."""
        self._refresh()  # (after a step the kernel took, its check declines: unscale_grads_ settles that step)
        flags = self._fused.check(self._state(), found_inf) if self._async.side().on_main else None
        return flags if flags is not None else self.unscale_grads_(inv_scale, found_inf)

    def skip_decided(self) -> None:
        """The scaler read the flags and found them clean: the next ``step()`` reads none.

        RuntimeError (nothing changes) when the grads the scaler unscaled are gone: reset since."""
        state = self._state()
        if not state.in_masters:
            raise RuntimeError(RESET_SINCE_UNSCALE)
        state.skip_decided()

    def submits_steps(self) -> bool:
        """True when ``step()`` from the calling thread submits to the optimizer thread."""
        return self.async_step and self._async.side().on_main

    def submit_scaled_step(
        self, scale: torch.Tensor, *, unscaled_flags: Flags | None, reduce: Callable[[Flags], Flags]
    ) -> Flags:
        """Do ``scaler.step(opt)`` with ``async_step=True``: check the grads on their device, submit the step.

        Returns its flags (the scaler's update uses them on the device)."""
        return self._submit_async(self._async.main.state, scale=scale, reduce=reduce, unscaled_flags=unscaled_flags)

    def _submit_async(
        self, state: StepState, *, scale: torch.Tensor | None, reduce: Any, unscaled_flags: Flags | None = None
    ) -> Flags:
        flags = self._grads.for_async_step(state, scale, reduce, unscaled_flags)
        if flags is None:
            self._refresh()
        flags = self._async.step(state, scale=scale, reduce=reduce, flags=flags, missing_grads=self._grads.missing)
        state.reset()
        return flags

    # ------------------------------------------------------------------ zero_grad, clipping
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the grads of the model's fp16/bf16 params, their masters and the other params.

        With asynchronous steps each thread clears its own: on the main thread the model's grads (the job in flight owns
        the master grads), on the optimizer thread the masters'."""
        side = self._async.side()
        if not side.on_main:
            # the masters' and direct params' only: a watched (frozen-when-wrapped) param's
            # grad belongs to the main thread's next step
            kernels.clear_grads_([*self._masters.masters, *self._groups.direct_params()], set_to_none=set_to_none)
        elif self.async_step or self._async.main.inflight is not None:
            self._masters.zero_grad(set_to_none, masters=False)
        else:
            self._masters.zero_grad(set_to_none)
            self.optimizer.zero_grad(set_to_none)
        if side.on_main:
            self._fused.forget()
            self._grads.zeroed(set_to_none)  # for grads handed off to a job (master_grads)
            self._async.grads_cleared()
        side.state.reset()

    def clip_grad_norm_(
        self,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        *,
        params: Iterable[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Clip the unscaled grads the optimizer will use (masters and fp32 params) by their total norm.

        As ``torch.nn.utils.clip_grad_norm_``; returns the total norm. Call after ``scaler.unscale_(optimizer)`` (or
        with no scaler, at any point after backward). ``params`` (default: everything this optimizer steps) restricts
        the clip to those tensors, each model param standing for its master: ``params=model.parameters()`` clips what
        ``torch.nn.utils.clip_grad_norm_(model.parameters())`` would under torch.amp (tensors this optimizer does not
        step are clipped as they are)."""
        state = self._state()
        self._refresh()
        self._grads.ensure(state)
        if params is None:
            tensors = [p for g in self.param_groups for p in g["params"]]
        else:
            master_of = {id(p): m for p, m in zip(self._masters.model_params, self._masters.masters)}
            tensors = [master_of.get(id(p), p) for p in ([params] if isinstance(params, torch.Tensor) else params)]
        return kernels.clip_grad_norm_(tensors, max_norm, norm_type, error_if_nonfinite)

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Unscale (if no scaler did), step the masters, copy them into the model.

        Returns the wrapped optimizer's return value, or None when the step was skipped for non-finite gradients -- and
        None with ``async_step=True``, whose step runs later on the optimizer thread (its errors surface at the next
        call that waits for it)."""
        state = self._state()
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        if grad_scale is None and found_inf is None and not state.in_masters:
            warn_if_scaled(self._warned_unscaled_step)
        if self.submits_steps():
            if closure is not None:
                raise RuntimeError(_NO_ASYNC_CLOSURE)
            self._submit_async(state, scale=None, reduce=None)
            return None
        if closure is not None:
            if found_inf is not None:
                raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
            try:
                return self.inner_step(self._grads.closure(state, closure))
            finally:
                state.reset()
        self._refresh()
        if grad_scale is None and found_inf is None:  # no scaler (bf16): the fused kernel may check here
            self._fused.check(state)
        if state.prepared is FUSED:  # the check left the grads to the fused kernel
            self._async.apply_deferred()
            return self._fused.step(state, grad_scale, found_inf)
        self._grads.ensure(state)
        try:
            if found_inf is not None or grad_scale is not None:
                # GradScaler's fused path: hand its tensors to the fused inner optimizer.
                return self.inner_step(grad_scale=grad_scale, found_inf=found_inf)
            combined = state.found_inf(self._groups.flag_device())
            if self._step_supports_amp_scaling:
                return self.inner_step(found_inf=combined)  # skips on the device
            if state.stage is Stage.SKIP_DECIDED:
                return self.inner_step()  # GradScaler read these flags already: no second read
            if combined is not None and combined.item():
                log_skipped_step()
                return None
            return self.inner_step()
        finally:
            state.stepped()

    def inner_step(
        self,
        closure: Callable[[], Any] | None = None,
        *,
        grad_scale: torch.Tensor | None = None,
        found_inf: torch.Tensor | None = None,
    ) -> Any:
        """Step the wrapped optimizer on the master grads as they are, then copy the masters into the model.

        In a step job of this optimizer, the next landing copies them; a step run on the thread for a waiting main
        thread -- a bound scaler's -- copies them there. ``grad_scale`` / ``found_inf`` go to a fused optimizer (which
        unscales and skips on the device). No unscale, no check: the building block of :meth:`step`."""
        side = self._async.side()
        if side.on_main:  # (a job's were applied before it was submitted)
            self._async.apply_deferred()
            self._fused.settle(side.state)
            # the master grads as they are, the step and the copy into the model in one kernel pass, if it can
            if (
                closure is None
                and grad_scale is None
                and side.groups is None
                and self._fused.from_master_grads(found_inf)
            ):
                return None
        with _stepping(self.optimizer, side.groups, grad_scale, found_inf) as inner:
            ret = inner.step(closure) if closure is not None else inner.step()
        if not side.in_job:
            self._masters.masters_to_model()
        return ret

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Return ``{"optimizer": wrapped optimizer's state dict, "masters": [[master, ...] per group]}``.

        Plain data, exact fp32 masters (no fp16 round trip). Waits for a step in flight but does not write the model
        params (their own state dict holds what the next forward uses)."""
        self.wait_for_step()
        return {
            "optimizer": self.optimizer.state_dict(),
            "masters": [[m.detach() for m in g.masters] for g in self._groups],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the wrapped optimizer's state and the masters exactly.

        The model params are not touched: load them with ``model.load_state_dict``, before or after this (but before the
        optimizer is next used: see :func:`~fp16kit.master_weights.checkpoint.match_saved_masters`). Structure and
        shapes are checked before anything changes: a mismatch raises ValueError naming the group and the index."""
        matched = check_state_dict(state_dict, self.optimizer, self._groups.groups)
        self.wait_for_step()
        self.optimizer.load_state_dict(state_dict["optimizer"])
        self.restore_masters(matched)
        self._async.main.state.reset()

    def restore_masters(self, matched: MatchedMasters) -> None:
        """Copy checkpointed masters in (see :func:`~fp16kit.master_weights.checkpoint.match_saved_masters`).

        Asynchronously trained (``async_step`` or ``submit_step``), they are a step ahead of the saved model params: the
        next asynchronous step lands them, exactly as in the uninterrupted run. (A synchronous step never lands: there
        the model already holds them.)"""
        kernels.copy_pairs_(matched.now)
        self._async.defer_copies(matched.deferred)
        self._async.masters_changed()

    def __getstate__(self) -> dict[str, Any]:
        raise RuntimeError(_NO_PICKLE)

    def __repr__(self) -> str:
        return f"MixedPrecisionOptimizer({self._masters.summary()}; wrapping {self.optimizer!r})"


# Each of these calls is one commit: a Ctrl-C inside it is held to its end (fp16kit.core.interrupts).
commit_methods(
    MixedPrecisionOptimizer,
    {
        "add_param_group": "optimizer.add_param_group()",
        "grads_to_masters": "optimizer.grads_to_masters()",
        "masters_to_model": "optimizer.masters_to_model()",
        "unscale_grads_": "the unscale of the optimizer's grads",
        "check_grads_": "the scaler's check of the optimizer's grads",
        "skip_decided": "the scaler's skip decision",
        "submit_scaled_step": "the hand-off of the step to the optimizer thread",
        "zero_grad": "optimizer.zero_grad()",
        "clip_grad_norm_": "optimizer.clip_grad_norm_()",
        "inner_step": "optimizer.inner_step()",
        "async_check_grads": "optimizer.async_check_grads()",
        "async_submit": "optimizer.async_submit()",
        "submit_step": "optimizer.submit_step()",
        "synchronize": "optimizer.synchronize()",
        "wait_for_step": "optimizer.wait_for_step()",
        "state_dict": "optimizer.state_dict()",
        "load_state_dict": "optimizer.load_state_dict()",
        "restore_masters": "optimizer.restore_masters()",
    },
    recovers=("load_state_dict",),
)


_NO_ASYNC_CLOSURE = (
    "Closures are not supported with async_step=True: the step runs later on the optimizer thread, but a closure "
    "must re-evaluate the model now. Build the MixedPrecisionOptimizer with async_step=False for LBFGS-style optimizers."
)
_NO_PICKLE = (
    "MixedPrecisionOptimizer cannot be pickled or deep-copied (it refers to the model's params); "
    "save it with state_dict() and restore it with load_state_dict()."
)


def _prepare_groups(
    param_groups: list[dict[str, Any]], all_masters: bool, master_dtype: torch.dtype, *, as_apex: bool
) -> None:
    """Check the groups of the optimizer to wrap (nothing changes on error); then, unless
    ``as_apex``, keep each param once in its group and warn when no param would get a master."""
    check_distinct_groups(param_groups)
    for gi, group in enumerate(param_groups):
        check_params(group["params"], all_masters, master_dtype, where=f" in param group {gi}")
    if as_apex:
        return
    for gi, group in enumerate(param_groups):
        _drop_repeats(group["params"], where=f"param group {gi}")
    if not all_masters:
        _warn_if_nothing_to_master(param_groups)


def _drop_repeats(params: list[torch.Tensor], *, where: str) -> None:
    """Keep each param of a group once (:func:`~fp16kit.master_weights.groups.drop_repeats`), warning."""
    repeats = drop_repeats(params)
    if repeats:
        logger.warning(
            f"MixedPrecisionOptimizer: {where} lists {len(repeats)} param(s) a second time (at "
            f"positions {repeats}). Each is kept once -- one fp32 master, stepped once per step -- "
            "where torch.optim steps a param at every listing (and warns that this will become an "
            "error). List each param once: e.g. build the group from model.parameters(), which "
            "yields a shared (tied) param once."
        )


def _warn_if_nothing_to_master(param_groups: list[dict[str, Any]]) -> None:
    """Warn when no param is fp16/bf16 (frozen ones count: unfrozen later, they get masters)."""
    if any(p.dtype in LOW_PRECISION for g in param_groups for p in g["params"]):
        return
    logger.warning(
        "MixedPrecisionOptimizer: none of the optimizer's params is float16 or bfloat16, so it keeps "
        "no fp32 masters and adds nothing to the optimizer it wraps. If the model is meant to stay "
        "float32 (autocast), step the optimizer itself: scaler = fp16kit.GradScaler(device) (or "
        "torch.amp.GradScaler); scaler.scale(loss).backward(); scaler.step(optimizer); "
        "scaler.update(). To keep the model in 16 bits with fp32 masters, convert it first -- "
        "model.half() or model.to(torch.bfloat16) -- and wrap the optimizer after that: params "
        "converted after wrapping have no masters and are stepped in 16 bits."
    )


@contextlib.contextmanager
def _stepping(
    optimizer: torch.optim.Optimizer,
    groups: list[dict[str, Any]] | None,
    grad_scale: torch.Tensor | None,
    found_inf: torch.Tensor | None,
) -> Iterator[torch.optim.Optimizer]:
    """The optimizer to step: a view of ``optimizer`` on a job's snapshot ``groups`` (written
    back after), carrying a GradScaler's ``grad_scale``/``found_inf`` for a fused optimizer
    (removed after, whatever the step raises)."""
    view = None if groups is None else StepView(optimizer, groups)
    inner = optimizer if view is None else view.optimizer
    if found_inf is not None or grad_scale is not None:
        inner.grad_scale = grad_scale  # type: ignore[attr-defined]
        inner.found_inf = found_inf  # type: ignore[attr-defined]
    try:
        yield inner
    finally:
        for name in ("grad_scale", "found_inf"):
            if name in inner.__dict__:
                delattr(inner, name)
        if view is not None:
            view.write_back()


def _check_options(unfrozen: Any, thread: Any, async_policy: Any, async_step: bool) -> None:
    """Refuse an ``unfrozen=`` or ``async_policy=`` that is not one (a policy other than the default needs
    ``async_step=True``), and a ``thread=`` that is neither None nor an fp16kit OptimizerThread: a step job
    needs its FIFO, its step count, its error hand-back and (on CUDA) its stream, which no other executor
    has. Changes nothing."""
    if unfrozen not in ("adopt", "refuse"):
        raise ValueError(f"unfrozen must be 'adopt' or 'refuse', got {unfrozen!r}.")
    if async_policy is not None and check_policy(async_policy) != "auto" and not async_step:
        raise ValueError(
            f"async_policy={async_policy!r} says where asynchronous steps run, but this optimizer steps "
            "synchronously: pass async_step=True too, or leave async_policy out."
        )
    if thread is not None and not isinstance(thread, OptimizerThread):
        raise TypeError(
            f"thread must be an fp16kit.OptimizerThread (or None for the process-wide "
            f"fp16kit.optimizer_thread()), got {type(thread).__module__}.{type(thread).__qualname__}. "
            "Other executors (concurrent.futures.ThreadPoolExecutor, ...) lack what asynchronous steps "
            "use: pass thread=fp16kit.OptimizerThread() for a thread of this optimizer's own."
        )


def _as_dtype(value: Any) -> torch.dtype:
    """A dtype, or its name (``"float32"``, ``"torch.float32"``)."""
    found = value
    if isinstance(value, str):
        found = getattr(torch, value[len("torch.") :] if value.startswith("torch.") else value, None)
    if isinstance(found, torch.dtype) and found.is_floating_point:
        return found
    raise TypeError(
        f"master_dtype must be a floating torch.dtype such as torch.float32 (or its name, 'float32'), got {value!r}."
    )
