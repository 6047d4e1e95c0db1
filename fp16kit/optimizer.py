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

* Construction walks the wrapped optimizer's param groups. Every trainable fp16/bf16 param is
  replaced *in place* in its group by an fp32 master (``master_dtype``, on ``master_device``
  or the param's device); its optimizer state moves to the master and is re-cast. Other params
  (fp32, fp64, frozen) stay as they are: the optimizer updates fp32 params directly.
* Unscale (``scaler.unscale_``/``scaler.step`` through :class:`fp16kit.GradScaler`, or
  ``step()`` alone): ``master.grad = float(model.grad) * (1/scale)`` and fp32 params' grads are
  unscaled in place, all with one non-finite check (:mod:`fp16kit.core.kernels`).
* Step: the wrapped optimizer steps the masters; the masters are copied back into the model.
  Fused optimizers (``fused=True``) receive ``grad_scale``/``found_inf`` and skip on the device:
  no host sync. Otherwise the skip decision reads the flag on the host (as torch's scaler does).
* Without a scaler, ``step()`` unscales with scale 1 and still refuses non-finite grads: the
  step is skipped (logged) -- or, with a closure, ``FloatingPointError`` is raised.

The unscaled gradients live on the masters: clip ``opt.param_groups``' params (or call
:meth:`clip_grad_norm_`), not ``model.parameters()``, whose fp16 grads are still scaled.
Changing the model grads after ``scaler.unscale_(opt)`` raises at ``step()``.

Checkpoints: :meth:`state_dict` holds the wrapped optimizer's state dict and the masters
(plain data, ``torch.load(weights_only=True)`` reads it); :meth:`load_state_dict` restores
both exactly and leaves the model params to ``model.load_state_dict`` (load the model first).
"""

from __future__ import annotations

import logging
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from .async_step import AsyncSteps, Handoff
from .core import kernels
from .core.master import LOW_PRECISION, MasterParams, needs_master
from .core.thread import OptimizerThread

__all__ = [
    "MasterGroup",
    "MixedPrecisionOptimizer",
    "WrappingOptimizer",
    "MatchedMasters",
    "match_saved_masters",
    "validate_optimizer_groups",
]

logger = logging.getLogger("fp16kit")

_STATE_KEYS = ("optimizer", "masters")


@dataclass
class MasterGroup:
    """One param group's params, by role: ``model_params[i]`` is mastered by ``masters[i]``;
    ``direct`` params (fp32, fp64) are optimized as they are."""

    model_params: list[torch.Tensor] = field(default_factory=list)
    masters: list[torch.Tensor] = field(default_factory=list)
    direct: list[torch.Tensor] = field(default_factory=list)


class WrappingOptimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` whose param groups and state are those of a wrapped
    optimizer (``self.optimizer``): LR schedulers, step hooks and ``isinstance`` checks work on
    the wrapper, and changes to ``param_groups`` (e.g. the lr) reach the wrapped optimizer."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        # torch.optim.Optimizer.__init__ minus the param groups, which live in the wrapped
        # optimizer: hooks, the profiled step, and the flags torch reads.
        self.optimizer = optimizer
        self._optimizer_step_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict = OrderedDict()
        self._optimizer_state_dict_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_state_dict_post_hooks: OrderedDict = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: OrderedDict = OrderedDict()
        self._patch_step_function()
        self._warned_capturable_if_run_uncaptured = True

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value


class MixedPrecisionOptimizer(WrappingOptimizer):
    """Wrap ``optimizer`` (built on the model's params) so it steps fp32 masters of the model's
    fp16/bf16 params. See the module docstring for the algorithm and the contract.

    Args:
        optimizer: any ``torch.optim.Optimizer`` over the model's parameters.
        master_dtype: dtype of the masters (default ``torch.float32``).
        master_device: device of the masters (default: each param's own device); e.g.
            ``"cpu"`` keeps masters and optimizer state in host memory for a CUDA model. Then
            fp32 params get masters too: everything the optimizer touches lives there.
        flat: keep each device's masters in one contiguous buffer (per-param views).
        async_step: run each step on the optimizer thread beside the next forward/backward
            (spec/async.md, mode 1): ``step()`` lands the previous step's masters in the model,
            checks this step's grads on their device, hands them to the thread and returns
            None at once. The model trains with a one-step delayed update. Every trainable
            param gets a master. Call :meth:`synchronize` before evaluating or exporting.
            Each step uses the hyperparameters (lr, ...) it was submitted with, stepping a
            shallow copy of the wrapped optimizer over them: step hooks registered on the
            wrapped optimizer receive that copy.
        thread: the :class:`~fp16kit.core.thread.OptimizerThread` for asynchronous steps
            (default: the process-wide ``fp16kit.optimizer_thread()``).

    :meth:`submit_step` (mode 2) runs a function of yours -- typically
    ``scaler.step(opt); opt.zero_grad()`` -- on the optimizer thread.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        master_dtype: torch.dtype = torch.float32,
        master_device: torch.device | str | None = None,
        flat: bool = False,
        async_step: bool = False,
        thread: OptimizerThread | None = None,
    ) -> None:
        if isinstance(optimizer, MixedPrecisionOptimizer):
            raise TypeError("This optimizer is already a MixedPrecisionOptimizer; wrap the inner optimizer once.")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"MixedPrecisionOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}. "
                "Build the optimizer on the model's parameters first, then wrap it."
            )
        # Asynchronous steps and offloaded masters need a master for every trainable param:
        # the optimizer thread must never write a tensor the forward pass reads.
        self._all_masters = async_step or master_device is not None
        if self._all_masters:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.requires_grad and p.dtype not in (*LOW_PRECISION, torch.float32):
                        raise TypeError(
                            f"With async_step=True or a master_device, every trainable param gets a "
                            f"{master_dtype} master; got a {p.dtype} param of shape {tuple(p.shape)}. "
                            "Keep it out of this optimizer or convert it to float32."
                        )
        super().__init__(optimizer)
        self.async_step = async_step
        self._masters = MasterParams([], master_dtype=master_dtype, master_device=master_device, flat=flat)
        self._async = AsyncSteps(self._masters, thread)
        self.groups: list[MasterGroup] = []
        self._flags: dict[torch.device, torch.Tensor] = {}
        self._transfer: _TransferRecord | None = None
        self._unscaled_by_scaler = False
        self._handed_off = False  # the master grads hold this step's raw grads (submit_step)
        # In a step job: the param groups as they were when the step was submitted
        self._submitted_groups: list[dict[str, Any]] | None = None
        for group in optimizer.param_groups:
            self._adopt_group(group)
        if optimizer.state:
            # Re-cast moved state (e.g. fp16 momentum) to the masters' dtype and device, the
            # way apex did: torch's load_state_dict casts floating state to its param's dtype.
            optimizer.load_state_dict(optimizer.state_dict())

    def _adopt_group(self, group: dict[str, Any]) -> None:
        params = group["params"]
        low = [
            i
            for i, p in enumerate(params)
            if needs_master(p) or (self._all_masters and p.requires_grad and p.dtype == torch.float32)
        ]
        masters = self._masters.add([params[i] for i in low])
        info = MasterGroup()
        for i, m in zip(low, masters):
            p = params[i]
            params[i] = m  # in place: LBFGS caches this very list
            if p in self.optimizer.state:
                self.optimizer.state[m] = self.optimizer.state.pop(p)
            info.model_params.append(p)
            info.masters.append(m)
        mastered = {id(m) for m in masters}
        info.direct = [p for p in params if p.requires_grad and id(p) not in mastered]
        self.groups.append(info)

    # ------------------------------------------------------------------ torch.optim surface
    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """The wrapped optimizer's param groups; inside a step job, the snapshot that job
        steps (taken when it was submitted), so what the job's own code sets (a warm-up lr in
        a ``submit_step`` function) applies to this step and is then written back."""
        submitted = self._submitted_groups
        if submitted is not None and self._async.on_optimizer_thread():
            return submitted
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def _step_supports_amp_scaling(self) -> bool:
        # Fused inner optimizers take grad_scale/found_inf from GradScaler and skip on device.
        return bool(getattr(self.optimizer, "_step_supports_amp_scaling", False))

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the wrapped optimizer; its fp16/bf16 params get masters."""
        self.wait_for_step()  # the step in flight reads the groups and the masters
        self.optimizer.add_param_group(param_group)
        self._adopt_group(self.optimizer.param_groups[-1])

    @property
    def master_params(self) -> list[torch.Tensor]:
        return list(self._masters.masters)

    @property
    def model_params(self) -> list[torch.Tensor]:
        return list(self._masters.model_params)

    def _direct_params(self) -> list[torch.Tensor]:
        return [p for g in self.groups for p in g.direct]

    # ------------------------------------------------------------------ grads
    def grads_to_masters(
        self, inv_scale: torch.Tensor, found_inf: torch.Tensor, *, clear_missing: bool = True
    ) -> dict[torch.device, torch.Tensor]:
        """Unscale this iteration's grads onto what the optimizer steps: fp16/bf16 model grads
        into fp32 master grads, fp32 params' grads in place; one non-finite check over all.
        A master whose model param has no grad loses its grad (``clear_missing=False`` keeps
        it, as apex did). Returns ``{device: found_inf}``. No host sync."""
        flags = kernels.merge_found_inf(
            self._masters.grads_to_masters(inv_scale, found_inf, clear_missing=clear_missing),
            kernels.unscale_grads_(self._direct_params(), inv_scale, found_inf, allow_fp16=True),
        )
        self._flags = flags
        # Only the fp16/bf16 model grads: fp32 params' grads are the unscaled ones and may be
        # clipped in place after unscale_.
        self._transfer = _TransferRecord.of(self._masters.model_params)
        return flags

    def masters_to_model(self) -> None:
        """Copy the masters into the model params (rounded to their dtype)."""
        self._async.apply_deferred()
        self._masters.masters_to_model()

    def _fp16kit_unscale_grads_(
        self, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool
    ) -> dict[torch.device, torch.Tensor]:
        """The hook :class:`fp16kit.GradScaler` calls instead of unscaling param grads in place."""
        if self._handed_off:  # submit_step moved the raw grads into the masters already
            flags = kernels.unscale_(self._present_master_grads(), inv_scale, found_inf)
            self._flags = flags
        else:
            if self.async_step and not self._async.on_optimizer_thread():
                self._async.land()  # the previous step's job must be done with the masters
            flags = self.grads_to_masters(inv_scale, found_inf)
        self._unscaled_by_scaler = True
        return flags

    def _present_master_grads(self) -> list[torch.Tensor]:
        return [m.grad for m in self._masters.masters if m.grad is not None]

    def _ensure_master_grads(self) -> None:
        """Make the master grads current for this step (see the module docstring)."""
        if self._handed_off:
            if not self._unscaled_by_scaler:  # raw grads at scale 1: only check them
                found = kernels.new_found_inf(self._flag_device())
                self._flags = kernels.check_finite_(self._present_master_grads(), found)
            return
        record = self._transfer
        current = record is not None and record.matches(self._masters.model_params)
        if self._unscaled_by_scaler:
            if not current:
                raise RuntimeError(
                    "The model's gradients changed after scaler.unscale_(optimizer). With "
                    "MixedPrecisionOptimizer the unscaled gradients live on the masters: clip or "
                    "edit the params in optimizer.param_groups (or call optimizer.clip_grad_norm_), "
                    "not model.parameters(), and run every backward before unscale_()."
                )
            return
        if not current:
            self._grads_to_masters_unscaled()

    def _grads_to_masters_unscaled(self) -> None:
        """No scaler: the grads as they are (scale 1), with the non-finite check."""
        device = self._flag_device()
        self.grads_to_masters(kernels.one(device), kernels.new_found_inf(device))

    def _flag_device(self) -> torch.device:
        for p in (*self._masters.masters, *self._direct_params()):
            return p.device
        return torch.device("cpu")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the grads of the model's fp16/bf16 params, their masters and the other params.

        With asynchronous steps each thread clears its own: on the main thread the model's
        grads (the job in flight owns the master grads), on the optimizer thread the masters'."""
        on_thread = self._async.on_optimizer_thread()
        if on_thread or not (self.async_step or self._async.inflight is not None):
            self._masters.zero_grad(set_to_none, model=not on_thread)
            self.optimizer.zero_grad(set_to_none)
        else:
            self._masters.zero_grad(set_to_none, masters=False)
        self._transfer = None
        self._unscaled_by_scaler = False
        self._flags = {}

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Clip the unscaled grads the optimizer will use (masters and fp32 params) by their
        total norm, as ``torch.nn.utils.clip_grad_norm_``; returns the total norm. Call after
        ``scaler.unscale_(optimizer)`` (or with no scaler, at any point after backward)."""
        self._ensure_master_grads()
        params = [p for g in self.param_groups for p in g["params"]]
        return kernels.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite)

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Unscale (if no scaler did), step the masters, copy them into the model.

        Returns the wrapped optimizer's return value, or None when the step was skipped for
        non-finite gradients -- and None with ``async_step=True``, whose step runs later on the
        optimizer thread (its errors surface at the next call that waits for it)."""
        if self.async_step and not self._async.on_optimizer_thread():
            if closure is not None:
                raise RuntimeError(
                    "Closures are not supported with async_step=True: the step runs later on the "
                    "optimizer thread, but a closure must re-evaluate the model now. Build the "
                    "MixedPrecisionOptimizer with async_step=False for LBFGS-style optimizers."
                )
            self._async_step(None, reduce=None)
            return None
        if closure is not None:
            return self._step_with_closure(closure)
        self._ensure_master_grads()
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        try:
            if found_inf is not None or grad_scale is not None:
                # GradScaler's fused path: hand its tensors to the fused inner optimizer.
                return self.inner_step(grad_scale=grad_scale, found_inf=found_inf)
            combined = self._combined_flag()
            if self._step_supports_amp_scaling:
                return self.inner_step(found_inf=combined)  # skips on the device
            if self.__dict__.pop("_fp16kit_skip_decided", False):
                return self.inner_step()  # GradScaler read these flags already: no second read
            if combined is not None and combined.item():
                logger.warning(
                    "MixedPrecisionOptimizer: non-finite gradients (inf/NaN); step skipped. "
                    "With fp16 use fp16kit.GradScaler; otherwise look for a diverging loss."
                )
                return None
            return self.inner_step()
        finally:
            self._unscaled_by_scaler = False
            self.__dict__.pop("_fp16kit_skip_decided", None)

    def _combined_flag(self) -> torch.Tensor | None:
        if not self._flags:
            return None
        return kernels.combine_found_inf(self._flags.values(), self._flag_device())

    def inner_step(
        self,
        closure: Callable[[], Any] | None = None,
        *,
        grad_scale: torch.Tensor | None = None,
        found_inf: torch.Tensor | None = None,
    ) -> Any:
        """Step the wrapped optimizer on the master grads as they are, then copy the masters
        into the model. ``grad_scale``/``found_inf`` go to a fused optimizer (which unscales
        and skips on the device). No unscale, no check: the building block of :meth:`step`."""
        self._async.apply_deferred()
        inner = self.optimizer
        submitted = self._submitted_groups if self._async.on_optimizer_thread() else None
        view = None if submitted is None else _StepView(inner, submitted)
        if view is not None:
            inner = view.optimizer
        if found_inf is not None or grad_scale is not None:
            inner.grad_scale = grad_scale  # type: ignore[attr-defined]
            inner.found_inf = found_inf  # type: ignore[attr-defined]
        try:
            ret = inner.step(closure) if closure is not None else inner.step()
        finally:
            for name in ("grad_scale", "found_inf"):
                if name in inner.__dict__:
                    delattr(inner, name)
            if view is not None:
                view.write_back()
        if self._async.on_optimizer_thread():
            self._async.land_pending = True  # the main thread copies them (land) between steps
        else:
            self._masters.masters_to_model()
        return ret

    # ------------------------------------------------------------------ asynchronous steps
    def _async_step(
        self,
        scale: torch.Tensor | None,
        *,
        reduce: Callable[[dict[torch.device, torch.Tensor]], dict[torch.device, torch.Tensor]] | None,
        unscaled_flags: dict[torch.device, torch.Tensor] | None = None,
    ) -> dict[torch.device, torch.Tensor]:
        """Mode 1 on the main thread (see :mod:`fp16kit.async_step`). Returns the device flags
        of this step's grads (for GradScaler.update); never reads them on the host."""
        if unscaled_flags is not None:
            # scaler.unscale_ already put this step's unscaled grads into the masters (it
            # landed the previous job first): only the skip decision and the step are left.
            self._masters.zero_grad(model=True, masters=False)
            self._submit_async_job(None, self._found(unscaled_flags), hand_off=False)
            return unscaled_flags
        flags = self.async_check_grads(reduce=reduce)
        found = self._found(flags)
        if scale is None:  # no scaler: the grads as they are
            self._submit_async_job(kernels.one(self._grad_device()), found)
        else:  # the update after this step changes the scale in place: keep its value
            self._submit_async_job(None, found, scale=scale.clone())
        return flags

    def async_check_grads(
        self,
        *,
        reduce: Callable[[dict[torch.device, torch.Tensor]], dict[torch.device, torch.Tensor]] | None = None,
        land: bool = True,
    ) -> dict[torch.device, torch.Tensor]:
        """First half of an asynchronous step (``async_step=True``), on the main thread: check
        this step's model grads for inf/NaN on their device (``reduce`` may all-reduce the
        flags); returns ``{device: found_inf}``. No host sync. Then call :meth:`async_submit`.

        With ``land`` it also waits for the step in flight (re-raising its error) and lands
        its masters in the model meanwhile -- only when nothing (a retained autograd graph, a
        second loss) still needs the current weights; otherwise :meth:`async_submit` lands."""
        self._require_async("async_check_grads")
        if land:
            self._async.land_begin()
        try:  # the grads, not the params: the landing copy may still be writing those
            grads = [p.grad for p in self._masters.model_params if p.grad is not None]
            flags = kernels.check_finite_(grads, kernels.new_found_inf(self._grad_device()))
            return reduce(flags) if reduce is not None else flags
        finally:
            self._async.land_end()

    def async_submit(
        self,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        *,
        missing_grads: str = "none",
        on_skip: Callable[[], Any] | None = None,
    ) -> Future:
        """Second half of an asynchronous step, after :meth:`async_check_grads`: land the
        previous step (if that did not), hand this step's model grads to the optimizer thread
        (the model grads are cleared) and queue the job. There it skips the step -- calling
        ``on_skip()`` -- if ``found_inf`` is set, and otherwise unscales the grads by
        ``inv_scale`` into the master grads and steps. ``missing_grads`` says what a master
        whose param got no grad holds: ``"none"`` (no grad: the optimizer skips it),
        ``"zero"``, or ``"keep"`` (its previous grad, as apex's FP16_Optimizer)."""
        self._require_async("async_submit")
        if missing_grads not in _MISSING_GRADS:
            raise ValueError(f"missing_grads must be one of {_MISSING_GRADS}, got {missing_grads!r}.")
        return self._submit_async_job(inv_scale, found_inf, missing_grads, on_skip)

    def _require_async(self, name: str) -> None:
        if not self.async_step:
            raise RuntimeError(f"{name}() is part of an asynchronous step; build the optimizer with async_step=True.")
        if self._async.on_optimizer_thread():
            raise RuntimeError(f"{name}() must be called from the main thread, not from a step job.")

    def _found(self, flags: dict[torch.device, torch.Tensor]) -> torch.Tensor:
        return kernels.combine_found_inf(flags.values(), self._grad_device())

    def _submit_async_job(
        self,
        inv: torch.Tensor | None,
        found: torch.Tensor,
        missing_grads: str = "none",
        on_skip: Callable[[], Any] | None = None,
        *,
        scale: torch.Tensor | None = None,
        hand_off: bool = True,
    ) -> Future:
        # ``scale`` instead of ``inv``: the job takes the reciprocal (off the main thread).
        # ``hand_off=False``: the masters hold this step's unscaled grads already.
        handoff = None
        if hand_off:
            self._async.land()
            handoff = self._async.hand_off(self._masters.model_params)
        self._transfer = None
        self._unscaled_by_scaler = False
        self._note_step_taken()
        return self._async.submit(
            self._run_submitted, self._groups_for_job(),
            self._async_job, handoff, inv, found, missing_grads, on_skip, scale,
        )

    def _groups_for_job(self) -> list[dict[str, Any]] | None:
        if not _StepView.applies_to(self.optimizer):
            return None
        return _snapshot(self.optimizer.param_groups)

    def _note_step_taken(self) -> None:
        # As LR schedulers' call-order trackers do (on this wrapper or the wrapped optimizer):
        # the step is taken now, so scheduler.step() may follow at once without a warning.
        self._opt_called = True
        self.optimizer._opt_called = True  # type: ignore[attr-defined]

    def _run_submitted(self, groups: list[dict[str, Any]] | None, job: Callable[..., Any], *args: Any) -> Any:
        """On the optimizer thread: run ``job`` stepping with the param groups (lr, momentum,
        ...) as they were when the step was submitted -- an LR scheduler on the main thread
        already sets the next step's values. Values the inner optimizer itself writes into
        its groups (e.g. D-Adaptation's estimates) are written back to the live groups."""
        if groups is None:  # an optimizer that steps its live groups (_StepView.applies_to)
            return job(*args)
        before = _snapshot(groups)  # tensor values copied again: in-place edits show
        self._submitted_groups = groups
        try:
            return job(*args)
        finally:
            self._submitted_groups = None
            _write_back(before, groups, self.optimizer.param_groups)

    def _async_job(
        self,
        handoff: Handoff | None,
        inv: torch.Tensor | None,
        found: torch.Tensor,
        missing_grads: str,
        on_skip: Callable[[], Any] | None,
        scale: torch.Tensor | None,
    ) -> Any:
        """Mode 1 on the optimizer thread: receive the grads, skip or step."""
        grads = AsyncSteps.receive(handoff) if handoff is not None else None
        if found.item():  # the worker may wait for the device; the main thread never does
            if on_skip is not None:
                on_skip()
            return None
        if grads is None:
            return self.inner_step()
        if missing_grads == "zero":
            self._masters.zero_grad(False, model=False)
        clear = missing_grads == "none"
        if inv is None and self._fused_unscale(scale):
            # A fused optimizer unscales in its own pass over the grads: copy them only.
            assert scale is not None
            self._masters.grads_to_masters(None, None, grads=grads, clear_missing=clear, unscale=False)
            return self.inner_step(grad_scale=scale.to(self._flag_device()))
        if inv is None:
            assert scale is not None
            inv = kernels.inv_scale(scale)
        device = self._flag_device()
        self._masters.grads_to_masters(inv, kernels.new_found_inf(device), grads=grads, clear_missing=clear)
        return self.inner_step()

    def _fused_unscale(self, scale: torch.Tensor | None) -> bool:
        # Fused kernels take a float32 grad_scale on the params' device (one device here).
        return (
            scale is not None
            and scale.dtype == torch.float32
            and self._step_supports_amp_scaling
            and not self._direct_params()
            and len({m.device for m in self._masters.masters}) == 1
        )

    def _grad_device(self) -> torch.device:
        for p in self._masters.model_params:
            return p.device
        return self._flag_device()

    def _fp16kit_async_step_(
        self,
        scale: torch.Tensor,
        *,
        unscaled_flags: dict[torch.device, torch.Tensor] | None,
        reduce: Callable[[dict[torch.device, torch.Tensor]], dict[torch.device, torch.Tensor]],
    ) -> dict[torch.device, torch.Tensor]:
        """GradScaler.step's hook for ``async_step=True``: submit this step, return its flags."""
        return self._async_step(scale, reduce=reduce, unscaled_flags=unscaled_flags)

    def submit_step(self, fn: Callable[[], Any]) -> Future:
        """Mode 2 (spec/async.md): run ``fn`` -- e.g. ``lambda: (scaler.step(opt), opt.zero_grad())``
        -- on the optimizer thread, beside the next forward/backward.

        On the main thread: wait for the previous submitted step (re-raising its error), copy
        the masters it produced into the model, move this step's raw (still scaled) model grads
        into the master grads -- the model grads are cleared, so the next backward starts from
        zero -- and submit ``fn``. Returns its Future; call :meth:`synchronize` before
        evaluating or exporting the model."""
        if self._async.on_optimizer_thread():
            raise RuntimeError("submit_step() must be called from the main thread, not from a step job.")
        if self.async_step:
            raise RuntimeError(
                "This optimizer already steps asynchronously (async_step=True): call step() (or "
                "scaler.step(opt)), or build it with async_step=False to use submit_step()."
            )
        direct = self._direct_params()
        if direct:
            raise RuntimeError(
                f"submit_step() needs a master for every trainable param ({len(direct)} float32 "
                "params have none: the thread would update them while the forward pass reads "
                "them). Build the MixedPrecisionOptimizer with master_device=... (e.g. 'cpu')."
            )
        self._async.land()
        handoff = self._async.hand_off(self._masters.model_params)
        self._note_step_taken()
        fut = self._async.submit(self._run_submitted, self._groups_for_job(), self._submitted_job, handoff, fn)
        self._async.thread.mark_step()
        return fut

    def _submitted_job(self, handoff: Handoff, fn: Callable[[], Any]) -> Any:
        grads = AsyncSteps.receive(handoff)
        one = kernels.one(self._grad_device())
        self._masters.grads_to_masters(one, kernels.new_found_inf(self._flag_device()), grads=grads)
        self._handed_off = True
        self._unscaled_by_scaler = False
        try:
            return fn()
        finally:
            self._handed_off = False
            self._unscaled_by_scaler = False

    def synchronize(self) -> None:
        """Wait for the step in flight and copy the final masters into the model (call before
        evaluating or exporting an asynchronously trained model). A no-op otherwise."""
        self._async.land()

    def _step_with_closure(self, closure: Callable[[], Any]) -> Any:
        if getattr(self, "found_inf", None) is not None:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        first = [True]

        def wrapped() -> Any:
            # The optimizer may evaluate the closure at several points (LBFGS's line search):
            # from the second call on, the model must see the masters' current values.
            if not first[0]:
                self._masters.masters_to_model()
            first[0] = False
            with torch.enable_grad():
                loss = closure()
            self._grads_to_masters_unscaled()
            combined = self._combined_flag()
            if combined is not None and combined.item():
                raise FloatingPointError(
                    "The closure produced non-finite gradients (inf/NaN) at scale 1; the step "
                    "cannot be skipped inside the optimizer. Check the loss and the inputs."
                )
            return loss

        return self.inner_step(wrapped)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """``{"optimizer": wrapped optimizer's state dict, "masters": [[master, ...] per group]}``:
        plain data, exact fp32 masters (no fp16 round trip). Waits for a step in flight but
        does not write the model params (their own state dict holds what the next forward
        uses)."""
        self.wait_for_step()
        return {
            "optimizer": self.optimizer.state_dict(),
            "masters": [[m.detach() for m in g.masters] for g in self.groups],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Restore the wrapped optimizer's state and the masters exactly. The model params are
        not touched: load them with ``model.load_state_dict``, before or after this (but before
        the optimizer is next used: see :func:`match_saved_masters`). Structure is checked
        before anything changes: a mismatch raises ValueError naming the group."""
        if not isinstance(state_dict, dict) or set(state_dict) != set(_STATE_KEYS):
            got = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
            raise ValueError(
                f"MixedPrecisionOptimizer.load_state_dict expects the keys {list(_STATE_KEYS)} "
                f"(from MixedPrecisionOptimizer.state_dict()), got {got}."
            )
        validate_optimizer_groups(state_dict["optimizer"], self.optimizer)
        self.wait_for_step()
        matched = match_saved_masters(state_dict["masters"], self.groups, self.optimizer.param_groups)
        self.optimizer.load_state_dict(state_dict["optimizer"])
        self.restore_masters(matched)
        self._transfer = None
        self._unscaled_by_scaler = False

    def wait_for_step(self) -> None:
        """Wait for the step in flight (re-raising its error) without landing its masters in
        the model. A no-op on the optimizer thread and with no step in flight."""
        if not self._async.on_optimizer_thread():
            self._async.wait()

    def restore_masters(self, matched: MatchedMasters) -> None:
        """Copy checkpointed masters in (see :func:`match_saved_masters`). Asynchronously
        trained (``async_step`` or ``submit_step``), they are a step ahead of the saved model
        params: the next asynchronous step lands them, exactly as in the uninterrupted run.
        (A synchronous step never lands: there the model already holds them.)"""
        kernels.copy_pairs_(matched.now)
        self._async.defer_copies(matched.deferred)
        self._async.land_pending = True

    def __getstate__(self) -> dict[str, Any]:
        raise RuntimeError(
            "MixedPrecisionOptimizer cannot be pickled or deep-copied (it refers to the model's "
            "params); save it with state_dict() and restore it with load_state_dict()."
        )

    def __repr__(self) -> str:
        d = self._masters.describe()
        return (
            f"MixedPrecisionOptimizer({d['count']} masters, {d['numel']} elements, "
            f"{d['master_dtype']} on {', '.join(d['devices']) or '-'}{', flat' if d['flat'] else ''}; "
            f"wrapping {self.optimizer!r})"
        )


def validate_optimizer_groups(saved: Any, optimizer: torch.optim.Optimizer) -> None:
    """Check a saved torch optimizer state dict against the live optimizer's param groups
    (torch's own check does not say which group differs). Raises ValueError; changes nothing."""
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    if not isinstance(groups, list) or "state" not in saved:
        raise ValueError(
            "The saved optimizer state is not a torch optimizer state dict (no 'state' and "
            "'param_groups'): pass the dict from state_dict()."
        )
    live = optimizer.param_groups
    if len(groups) != len(live):
        raise ValueError(
            f"The checkpoint has {len(groups)} param groups, this optimizer has {len(live)}: it "
            "was written for a different optimizer layout."
        )
    for gi, (s, g) in enumerate(zip(groups, live)):
        n = len(s.get("params", ())) if isinstance(s, dict) else -1
        if n != len(g["params"]):
            raise ValueError(
                f"Param group {gi}: the checkpoint has {n} params, this optimizer has "
                f"{len(g['params'])} in that group."
            )


class MatchedMasters(NamedTuple):
    """Saved masters matched to what they restore: ``(source, target)`` copies to make now,
    and ones to make at the next step (values that come from, or go into, the model)."""

    now: list[tuple[torch.Tensor, torch.Tensor]]
    deferred: list[tuple[torch.Tensor, torch.Tensor]]


def match_saved_masters(
    saved: Any, groups: list[MasterGroup], param_groups: list[dict[str, Any]]
) -> MatchedMasters:
    """Match saved masters (a list per group) to what they restore. Checks counts and shapes
    first; raises ValueError naming the group; changes nothing.

    A checkpoint written with and one written without ``async_step``/``master_device`` differ
    in the fp32 params: with them every trainable param has a master (saved in group order),
    without them only the fp16/bf16 params do and the fp32 params are stepped in place. Both
    load either way: saved without, the fp32 params' masters come from the model params;
    saved with, the fp32 masters go into the fp32 params. Those copies wait until the
    optimizer is next used (a step, ``state_dict()``, ``synchronize()``...), so the model may
    be loaded before or after the optimizer -- but before that next use. (Saved masters map
    to the params that are trainable now: change no ``requires_grad`` between saving and
    loading.)"""
    if not isinstance(saved, (list, tuple)) or len(saved) != len(groups):
        n = len(saved) if isinstance(saved, (list, tuple)) else type(saved).__name__
        raise ValueError(
            f"Saved masters have {n} param groups, this optimizer has {len(groups)}: the "
            "checkpoint was written for a different optimizer layout."
        )
    now: list[tuple[torch.Tensor, torch.Tensor]] = []
    deferred: list[tuple[torch.Tensor, torch.Tensor]] = []
    for gi, (s, g, pg) in enumerate(zip(saved, groups, param_groups)):
        if not isinstance(s, (list, tuple)):
            raise ValueError(f"Param group {gi}: expected a list of master tensors, got {type(s).__name__}.")
        low = [m for m, p in zip(g.masters, g.model_params) if p.dtype in LOW_PRECISION]
        trainable = [p for p in pg["params"] if p.requires_grad]
        later: list[tuple[Any, torch.Tensor]] = []
        if len(s) == len(g.masters):
            targets = list(zip(s, g.masters))
        elif len(s) == len(low) < len(g.masters):  # saved without masters for fp32 params
            targets = list(zip(s, low))
            later = [(p, m) for m, p in zip(g.masters, g.model_params) if p.dtype not in LOW_PRECISION]
        elif len(s) == len(trainable) > len(g.masters):  # saved with them; stepped in place here
            mastered = {id(m) for m in g.masters}
            targets = [(t, p) for t, p in zip(s, trainable) if id(p) in mastered]
            later = [(t, p) for t, p in zip(s, trainable) if id(p) not in mastered]
        else:
            raise ValueError(
                f"Param group {gi}: the checkpoint has {len(s)} master tensors, this optimizer has "
                f"{len(g.masters)} masters ({len(low)} fp16/bf16 params, {len(trainable)} trainable "
                "params) in that group: it was written for a different model or param groups."
            )
        for i, (t, target) in enumerate(targets + later):
            if not isinstance(t, torch.Tensor) or t.shape != target.shape:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(
                    f"Param group {gi}, master {i}: the checkpoint has shape {got}, the "
                    f"param has shape {tuple(target.shape)}."
                )
        now.extend(targets)
        deferred.extend(later)
    return MatchedMasters(now, deferred)


def _snapshot(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The param groups' values now: the params lists stay shared; tensor values (an lr
    tensor, which LR schedulers update in place) are copied."""
    return [{k: v if k == "params" else _frozen(v) for k, v in g.items()} for g in groups]


def _frozen(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, tuple) and any(isinstance(v, torch.Tensor) for v in value):
        return tuple(_frozen(v) for v in value)
    return value


class _StepView:
    """The wrapped optimizer stepping a snapshot of its param groups (taken when the step was
    submitted), so the live groups stay the main thread's: an LR scheduler there already sets
    the next step's values. A shallow copy of the optimizer object (same state dict, same
    hooks); attributes the step sets on itself (counters) are written back afterwards."""

    def __init__(self, optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> None:
        self.original = optimizer
        view = object.__new__(type(optimizer))
        view.__dict__.update(optimizer.__dict__)
        view.param_groups = groups
        if "step" in view.__dict__:  # an LR scheduler's tracker (see applies_to); noted at submit
            del view.__dict__["step"]
        self.optimizer = view
        self._attrs = dict(view.__dict__)

    @staticmethod
    def applies_to(optimizer: torch.optim.Optimizer) -> bool:
        """Can ``optimizer`` step a snapshot? Not when its groups are a property (they live
        elsewhere) or its ``step`` was replaced on the object (bound to it): those step with
        their live groups, read when the step runs."""
        if isinstance(getattr(type(optimizer), "param_groups", None), property):
            return False
        step = optimizer.__dict__.get("step")
        if step is None:
            return True
        # Only an LR scheduler's call-order tracker around the class's own step may go.
        return bool(getattr(step, "_wrapped_by_lr_sched", False)) and (
            getattr(step, "__wrapped__", None) is getattr(type(optimizer), "step", None)
        )

    def write_back(self) -> None:
        for key, value in self.optimizer.__dict__.items():
            if key != "param_groups" and self._attrs.get(key, _UNSET) is not value:
                self.original.__dict__[key] = value


def _write_back(before: list[dict[str, Any]], stepped: list[dict[str, Any]], live: list[dict[str, Any]]) -> None:
    """Write what a job changed in its snapshot of the param groups into the live groups: a
    new value, or new contents of a tensor value (copied into the live tensor)."""
    for old, new, target in zip(before, stepped, live):
        for key, value in new.items():
            if key == "params":
                continue
            previous = old.get(key, _UNSET)
            if isinstance(value, torch.Tensor) and isinstance(previous, torch.Tensor):
                if not torch.equal(value, previous):  # changed in place (a scheduler's fill_)
                    live_value = target.get(key)
                    if isinstance(live_value, torch.Tensor) and live_value.shape == value.shape:
                        live_value.copy_(value)
                    else:
                        target[key] = value
            elif previous is not value:
                target[key] = value


_UNSET = object()
_MISSING_GRADS = ("none", "zero", "keep")


class _TransferRecord:
    """Which grad tensors (identity and version) the last unscale read, so a later step can
    tell whether the model grads changed since (a new backward, an in-place edit)."""

    def __init__(self, entries: list[tuple[Any, int]]) -> None:
        self.entries = entries

    @classmethod
    def of(cls, params: Iterable[torch.Tensor]) -> _TransferRecord:
        entries: list[tuple[Any, int]] = []
        for p in params:
            g = p.grad
            entries.append((None, -1) if g is None else (weakref.ref(g), g._version))
        return cls(entries)

    def matches(self, params: Iterable[torch.Tensor]) -> bool:
        params = list(params)
        if len(params) != len(self.entries):
            return False
        for p, (ref, version) in zip(params, self.entries):
            g = p.grad
            if g is None:
                if ref is not None:
                    return False
            elif ref is None or ref() is not g or g._version != version:
                return False
        return True
