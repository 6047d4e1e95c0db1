"""apex.fp16_utils.fp16_optimizer: ``FP16_Optimizer``, as apex shipped it from 2019 to 2025.

A facade over :class:`fp16kit.MixedPrecisionOptimizer` (the masters) and
:class:`fp16kit.core.scale.LossScale` (the scale, apex amp's era-2 rule in float64). The
loop apex documented::

    optimizer = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr), dynamic_loss_scale=True)
    optimizer.zero_grad()
    loss = criterion(model(x), y)
    optimizer.backward(loss)    # (loss.float() * scale).backward(); fp16 grads -> fp32 masters
    optimizer.step()            # skipped (and logged) on overflow; masters -> fp16 params

With ``async_step=True`` (docs/async.md §3, mode 1) ``step()`` runs on the optimizer thread
beside the next forward/backward, a one-step delayed update; ``update_master_grads`` checks
the grads and updates the scale on their device with no lag and no host sync, and the worker
logs apex's overflow message. ``master_device="cpu"`` keeps the fp32 masters and optimizer
state in host memory.

Differences from apex (fixes, listed in MIGRATION.md): CPU and bf16 params are accepted;
``scale_factor`` in ``dynamic_loss_args`` is honoured; it is a ``torch.optim.Optimizer`` (LR
schedulers work); ``state_dict()`` is plain data; ``load_state_dict`` reads both apex forms
and refuses mismatched groups instead of truncating them; closure retries are bounded;
apex's printed lines go to the ``fp16kit.apex`` logger (stdout, as apex printed them). A scale
setting that cannot train -- ``static_loss_scale`` 0, negative, NaN or inf, and the
``dynamic_loss_args`` of :func:`check_amp_settings` -- is refused at construction (ValueError
naming it and its range) before the optimizer is wrapped; so is ``loss_scale = value`` and, in
``load_state_dict``, a saved scaler holding one (apex trained into NaN weights, or skipped every
step, or raised ZeroDivisionError later).
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from typing import Any

import torch

from ..core import kernels
from ..core.interrupts import commit_methods
from ..core.scale import LossScale
from ..master_weights.optimizer import MixedPrecisionOptimizer
from ..master_weights.step_state import Stage, StepState
from ..master_weights.wrapping import WrappingOptimizer
from ._messages import apex_logger, float_or_half
from .checkpoints.load import scaler_state

# apex's 2018 module (until 2018-07) defined these beside FP16_Optimizer: a whole model pickled
# then (torch.save(model)) names apex.fp16_utils.fp16_optimizer.FP16_Module
from .fp16_module import FP16_Module, conversion_helper, fp16_to_fp32, fp32_to_fp16  # noqa: F401
from .fp16util import clip_grad_norm
from .loss_scaler import check_factor, check_saved_scaler, check_scale, check_window

__all__ = ["FP16_Optimizer", "AmpLossScaler"]

logger = logging.getLogger("fp16kit")  # fp16kit's own notes; apex's lines: apex_logger

_DYNAMIC_ARGS = ("init_scale", "scale_factor", "scale_window", "min_loss_scale", "max_loss_scale")
_STATE_KEYS = (
    "loss_scaler",
    "dynamic_loss_scale",
    "overflow",
    "first_closure_call_this_step",
    "optimizer_state_dict",
    "fp32_from_fp16",
)


class AmpLossScaler:
    """apex's era-2 ``apex.amp.scaler.LossScaler`` interface over a :class:`LossScale`.

    The interface of apex's ``apex.amp.scaler.LossScaler`` (``FP16_Optimizer.loss_scaler``)
    on a :class:`LossScale` with apex amp's rule, in float64 on the params' device.

    ``loss_scale()`` is a method here, as in apex's era-2 scaler."""

    def __init__(
        self,
        loss_scale: float | str,
        init_scale: float = 2.0**16,
        scale_factor: float = 2.0,
        scale_window: int = 2000,
        min_loss_scale: float | None = None,
        max_loss_scale: float | None = 2.0**24,
        *,
        device: torch.device | str | None = "cpu",
        unskipped: int = 0,
        on_min_scale: str = "ignore",
    ) -> None:
        check_amp_settings(loss_scale, init_scale, scale_factor, scale_window, min_loss_scale, max_loss_scale)
        self.dynamic = loss_scale == "dynamic"
        if max_loss_scale is None:
            max_loss_scale = float("inf")  # no cap
        if self.dynamic:
            init = min(max_loss_scale, init_scale)
        else:
            init = float(loss_scale)
        self._state = LossScale(
            init,
            rule="apex_amp",
            growth_factor=scale_factor,
            growth_interval=scale_window,
            min_scale=min_loss_scale,
            max_scale=max_loss_scale,
            on_min_scale=on_min_scale,  # type: ignore[arg-type]
            dtype=torch.float64,
            device=device,
        )
        self._state.set_scale(init)  # exactly: apex clamped only a dynamic init to the max
        self._state.set_growth_tracker(unskipped)
        self._static_unskipped = unskipped  # apex counted clean updates even when static

    def loss_scale(self) -> float:
        """The scale now (a host read)."""
        return self._state.get_scale()

    def scale_snapshot(self) -> torch.Tensor:
        """The scale now, as a tensor later updates leave alone (no host sync)."""
        return self._state.snapshot()

    def scale_tensor(self) -> torch.Tensor:
        assert self._state.scale is not None
        return self._state.scale

    def update(self, found_inf: torch.Tensor | None) -> None:
        """One scale update (device op); a static scale never changes (it only counts)."""
        if self.dynamic:
            assert found_inf is not None
            self._state.update(found_inf)
        else:
            self._static_unskipped += 1

    # apex's attribute names
    @property
    def _loss_scale(self) -> float:
        return self._state.get_scale()

    @_loss_scale.setter
    def _loss_scale(self, value: float) -> None:
        check_scale("loss_scale", value)
        self._state.set_scale(float(value))

    def place(self, device: torch.device | str) -> None:
        """Put the scale on ``device`` (once; a scaler built with ``device=None`` waits for this)."""
        self._state.materialize(device)

    @property
    def _unskipped(self) -> int:
        return self._state.get_growth_tracker() if self.dynamic else self._static_unskipped

    @property
    def _scale_seq_len(self) -> int:
        return self._state.growth_interval

    @property
    def _min_loss_scale(self) -> float | None:
        return self._state.min_scale

    @property
    def _max_loss_scale(self) -> float | None:
        return self._state.max_scale

    def state_dict(self) -> dict[str, Any]:
        s = self._state
        return {
            "dynamic": self.dynamic,
            "loss_scale": s.get_scale(),
            "scale_factor": s.growth_factor,
            "scale_window": s.growth_interval,
            "min_loss_scale": s.min_scale,
            "max_loss_scale": s.max_scale,
            "unskipped": self._unskipped,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any], device: torch.device | str) -> AmpLossScaler:
        check_scale("loss_scale", state["loss_scale"])
        if isinstance(state["unskipped"], bool) or not isinstance(state["unskipped"], int) or state["unskipped"] < 0:
            raise ValueError(f"unskipped (clean steps counted) must be an int >= 0, got {state['unskipped']!r:.80}.")
        scaler = cls(
            "dynamic" if state["dynamic"] else state["loss_scale"],
            scale_factor=state["scale_factor"],
            scale_window=state["scale_window"],
            min_loss_scale=state["min_loss_scale"],
            max_loss_scale=state["max_loss_scale"],
            device=device,
            unskipped=state["unskipped"],
        )
        # The saved scale as it was, even above max_loss_scale (set through loss_scale, or an
        # era-1 scale): only init_scale is capped, as in apex.
        scaler._state.set_scale(float(state["loss_scale"]))
        return scaler

    def __repr__(self) -> str:
        return f"AmpLossScaler({self.state_dict()})"


def check_amp_settings(
    loss_scale: Any, init_scale: Any, scale_factor: Any, scale_window: Any, min_loss_scale: Any, max_loss_scale: Any
) -> None:
    """Raise ValueError naming the first setting of apex amp's scaler that cannot train.

    ValueError naming the first setting of apex amp's scaler that cannot train: a loss scale
    that is not ``"dynamic"`` or a finite number > 0, an ``init_scale`` that is NaN or <= 0 (or
    inf with no ``max_loss_scale`` to start at), a ``scale_factor`` <= 1, a ``scale_window``
    that is not a whole number >= 1, a floor that is NaN or negative, a cap that is NaN or <= 0,
    or a floor above the cap. Changes nothing."""
    if loss_scale != "dynamic":
        try:
            check_scale("loss_scale", float(loss_scale))
        except (TypeError, ValueError, OverflowError):
            raise ValueError(
                f'loss_scale must be "dynamic" or a finite number > 0 (e.g. 128.0), got {loss_scale!r:.80}.'
            ) from None
    cap = math.inf if max_loss_scale is None else max_loss_scale
    if max_loss_scale is not None and not (_real(max_loss_scale) and max_loss_scale > 0):  # NaN > 0 is False
        raise ValueError(f"max_loss_scale must be a number > 0 (inf or None: no cap), got {max_loss_scale!r:.80}.")
    if min_loss_scale is not None and not (
        _real(min_loss_scale) and math.isfinite(min_loss_scale) and min_loss_scale >= 0
    ):
        raise ValueError(
            f"min_loss_scale must be None or a finite number >= 0 (0 or None: no floor), got {min_loss_scale!r:.80}."
        )
    if min_loss_scale and min_loss_scale > cap:
        raise ValueError(
            f"min_loss_scale ({min_loss_scale}) is above max_loss_scale ({max_loss_scale}); pass min_loss_scale <= max_loss_scale."
        )
    check_scale("init_scale", min(cap, init_scale) if _real(init_scale) and init_scale > 0 else init_scale)
    check_factor("scale_factor", scale_factor)
    check_window("scale_window", scale_window)


def _real(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check_param_types(optimizer: torch.optim.Optimizer) -> None:
    for group in optimizer.param_groups:
        _check_param_types_of(group["params"])


def _check_param_types_of(params: Any) -> None:
    if isinstance(params, torch.Tensor):
        params = [params]
    for param in list(params):
        if param.requires_grad and param.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise TypeError(f"Wrapped parameters must be either {float_or_half(param)}. Received {param.type()}")


def check_dynamic_loss_args(dynamic_loss_args: dict[str, Any] | None, accepted: tuple[str, ...]) -> None:
    """TypeError naming the accepted keys if ``dynamic_loss_args`` has others (nothing changes)."""
    unknown = sorted(set(dynamic_loss_args or ()) - set(accepted))
    if unknown:
        raise TypeError(f"dynamic_loss_args got unknown keys {unknown}; accepted keys: {list(accepted)}.")


_NO_BACKWARD = (
    "FP16_Optimizer.step() was called with no optimizer.backward(loss) since the last step, so the "
    "fp32 master grads are not this iteration's (a plain loss.backward() leaves them untouched) and "
    "the step applies old or zero gradients, as apex did. Call optimizer.backward(loss) instead of "
    "loss.backward(). (Warned once.)"
)


class _MasterProtocolByDelegation:
    """The scaler <-> master-weight optimizer protocol (:mod:`fp16kit.core.protocol`) for an
    optimizer that keeps its masters in a MixedPrecisionOptimizer ``self._mpo``: an
    ``FP16_Optimizer`` driven by ``fp16kit.GradScaler`` instead of its own loss scaler."""

    _mpo: MixedPrecisionOptimizer
    _step: StepState

    def unscale_grads_(self, inv_scale: torch.Tensor, found_inf: torch.Tensor) -> dict[torch.device, torch.Tensor]:
        """The masters' :meth:`~MixedPrecisionOptimizer.unscale_grads_`; a step is now pending."""
        flags = self._mpo.unscale_grads_(inv_scale, found_inf)
        self._step.unscaled(flags, by_scaler=True)
        return flags

    def skip_decided(self) -> None:
        """The masters' :meth:`~MixedPrecisionOptimizer.skip_decided`."""
        self._mpo.skip_decided()

    def submits_steps(self) -> bool:
        """The masters' :meth:`~MixedPrecisionOptimizer.submits_steps`."""
        return self._mpo.submits_steps()

    def submit_scaled_step(self, scale: torch.Tensor, *, unscaled_flags: Any, reduce: Any) -> Any:
        """The masters' :meth:`~MixedPrecisionOptimizer.submit_scaled_step`."""
        return self._mpo.submit_scaled_step(scale, unscaled_flags=unscaled_flags, reduce=reduce)


class FP16_Optimizer(_MasterProtocolByDelegation, WrappingOptimizer):
    """apex's FP16_Optimizer (era 2). See the module docstring and ``docs/apex-fp16-optimizer.md``.

    Args:
        init_optimizer: a torch optimizer over the (fp16/bf16/fp32) model params.
        static_loss_scale: the scale when ``dynamic_loss_scale`` is False.
        dynamic_loss_scale: use apex amp's dynamic rule (overrides ``static_loss_scale``).
        dynamic_loss_args: any of ``init_scale, scale_factor, scale_window, min_loss_scale,
            max_loss_scale``.
        verbose: log apex's ingestion messages (at INFO).
        async_step: step on the optimizer thread (see the module docstring). Then every
            trainable param (fp32 ones too) gets a master, closures are refused, and
            :meth:`clip_master_grads` / :meth:`inspect_master_grad_data` raise (the master
            grads are computed on the thread). Call :meth:`synchronize` before evaluating.
        master_device: device of the masters and the optimizer state (e.g. ``"cpu"`` for a
            CUDA model); fp32 params get masters there too.
        async_policy: with ``async_step``, where the steps run: ``"auto"``, ``"thread"`` or
            ``"inline"`` (:mod:`fp16kit.master_weights.async_policy`; the numbers are the same).

    With ``async_step`` or ``master_device`` the ``fp32_from_fp16`` groups (and the saved
    ``fp32_from_fp16``) hold the masters of the fp32 params too. Checkpoints load either way
    (see :meth:`load_state_dict`).
    """

    DYNAMIC_LOSS_ARGS: tuple[str, ...] = _DYNAMIC_ARGS
    """The keys ``dynamic_loss_args`` accepts (others raise TypeError naming these)."""

    MAX_CLOSURE_RETRIES = 32
    """Overflowing closure evaluations tolerated in one step before FloatingPointError (each
    halves the scale; 32 halvings take 2**24 below 1)."""

    def __init__(
        self,
        init_optimizer: torch.optim.Optimizer,
        static_loss_scale: float = 1.0,
        dynamic_loss_scale: bool = False,
        dynamic_loss_args: dict[str, Any] | None = None,
        verbose: bool = True,
        *,
        async_step: bool = False,
        master_device: torch.device | str | None = None,
        async_policy: str | None = None,
    ) -> None:
        if not isinstance(init_optimizer, torch.optim.Optimizer):
            raise TypeError(f"FP16_Optimizer wraps a torch.optim.Optimizer, got {type(init_optimizer).__name__}.")
        _check_param_types(init_optimizer)
        check_dynamic_loss_args(dynamic_loss_args, type(self).DYNAMIC_LOSS_ARGS)
        # built (its settings checked) before anything changes; put on the params' device below
        scaler = self._new_loss_scaler(static_loss_scale, bool(dynamic_loss_scale), dynamic_loss_args)
        self.verbose = verbose
        for i, group in enumerate(init_optimizer.param_groups):
            self.maybe_print(f"FP16_Optimizer processing param group {i}:")
            for param in group["params"]:
                if param.requires_grad:
                    self.maybe_print(f"FP16_Optimizer received {param.type()} with {param.size()}")

        super().__init__(init_optimizer)
        # apex's construction-time rule: params frozen now are never trained (refused, not
        # corrupted, if they get a grad later; see fp16kit.master_weights.groups)
        self._mpo = MixedPrecisionOptimizer(
            init_optimizer,
            async_step=async_step,
            master_device=master_device,
            async_policy=async_policy,
            unfrozen="refuse",
            apex_groups=True,
        )
        self._index_groups()

        self._device = _scale_device(self)
        self.dynamic_loss_scale = bool(dynamic_loss_scale)
        if isinstance(scaler, AmpLossScaler):
            scaler.place(self._device)
        self.loss_scaler = scaler
        # apex's overflow, first_closure_call_this_step, and the step in progress: whether grads
        # were read since the last step(), what update_master_grads prepared for an asynchronous
        # step() -- (1/scale, found_inf, the scale after the update) -- and how zero_grad cleared
        self._step = StepState()
        self._warned_no_backward = False

    def _new_loss_scaler(
        self, static_loss_scale: float, dynamic_loss_scale: bool, dynamic_loss_args: dict[str, Any] | None
    ) -> Any:
        """The scaler this optimizer drives (apex amp's, era 2), not yet on a device. ValueError
        naming the setting if it cannot train (see :func:`check_amp_settings`)."""
        if dynamic_loss_scale:
            return AmpLossScaler("dynamic", **(dynamic_loss_args or {}), device=None)
        try:
            check_scale("static_loss_scale", float(static_loss_scale))
        except (TypeError, ValueError, OverflowError):
            raise ValueError(
                f"static_loss_scale must be a finite number > 0, got {static_loss_scale!r:.80}. Pass the "
                "static scale (e.g. 128.0), or dynamic_loss_scale=True."
            ) from None
        return AmpLossScaler(static_loss_scale, device=None)

    @property
    def async_step(self) -> bool:
        """Whether steps run on the optimizer thread (the ``async_step=`` it was built with)."""
        return self._mpo.async_step

    def synchronize(self) -> None:
        """Wait for the step in flight and copy the final masters into the model.

        Call it before evaluating or saving the model with ``async_step=True``; a no-op otherwise."""
        self._mpo.synchronize()

    def maybe_print(self, msg: str) -> None:
        """apex's ``maybe_print``: ``msg`` at INFO on the ``fp16kit.apex`` logger when ``verbose``."""
        if self.verbose:
            apex_logger.info(msg)

    def __getstate__(self) -> dict[str, Any]:
        raise RuntimeError("FP16_Optimizer should be serialized using state_dict().")

    def __setstate__(self, state: dict[str, Any]) -> None:
        raise RuntimeError("FP16_Optimizer should be deserialized using load_state_dict().")

    # ------------------------------------------------------------------ apex's attributes
    @property
    def overflow(self) -> bool:
        """Did the last ``update_master_grads`` see inf/NaN?

        Reading it syncs with the device, once per iteration; the flag itself is computed on the device."""
        return self._step.verdict

    @overflow.setter
    def overflow(self, value: bool) -> None:
        self._step.verdict = bool(value)

    @property
    def first_closure_call_this_step(self) -> bool:
        """apex's flag: True except inside ``step(closure)`` after the closure's first evaluation."""
        return self._step.first_closure

    @first_closure_call_this_step.setter
    def first_closure_call_this_step(self, value: bool) -> None:
        self._step.first_closure = bool(value)

    @property
    def loss_scale(self) -> float:
        """The loss scaler's scale now; assignable (a finite number > 0)."""
        return self.loss_scaler.loss_scale()

    @loss_scale.setter
    def loss_scale(self, value: float) -> None:
        self.loss_scaler._loss_scale = value

    # ------------------------------------------------------------------ the loop
    def zero_grad(self, set_grads_to_None: bool = False, *, set_to_none: bool | None = None) -> None:  # type: ignore[override]
        """Zero (or set to None) the grads of every param the optimizer owns and of the fp16 model params.

        ``set_to_none`` is torch's name for apex's ``set_grads_to_None`` (loops written for
        torch optimizers call ``zero_grad(set_to_none=True)``); it wins when given. With
        ``async_step`` the masters' grads belong to the step in flight: the next step's job
        clears them before it writes this iteration's grads."""
        if set_to_none is not None:
            set_grads_to_None = set_to_none
        if self.async_step:
            kernels.clear_grads_(self.all_fp16_params, set_to_none=set_grads_to_None)
            # those grads are gone (step() needs a new backward); the job clears the masters' so
            self._step.reset(cleared="none" if set_grads_to_None else "zero")
            return
        owned = [p for group in self.optimizer.param_groups for p in group["params"]]
        kernels.clear_grads_(owned + self.all_fp16_params, set_to_none=set_grads_to_None)

    def backward(self, loss: torch.Tensor, update_master_grads: bool = True, retain_graph: bool = False) -> None:
        """Backward the scaled loss, then :meth:`update_master_grads` unless told not to.

        ``(loss.float() * loss_scale).backward(retain_graph=retain_graph)``, then
        :meth:`update_master_grads` unless ``update_master_grads=False`` (for several losses:
        ``backward(l1, False); backward(l2, False); update_master_grads()``).

        One commit, the autograd backward included: once that has added to the grads, repeating
        the call would add again (and a Ctrl-C during the C++ backward runs when it returns)."""
        scaled_loss = kernels.scale_outputs(loss.float(), lambda _d: self.loss_scaler.scale_tensor())
        scaled_loss.backward(retain_graph=retain_graph)
        if update_master_grads:
            self.update_master_grads()

    def update_master_grads(self) -> None:
        """Unscale the model grads into the master grads and check them for inf/NaN.

        fp16 model grads -> fp32 master grads * 1/scale, fp32 params' grads * 1/scale in
        place, one non-finite check; with a dynamic scale, the scale update (on the device).

        With ``async_step``: check the model grads and update the scale on their device; the
        transfer into the master grads runs in the step's job. (The model keeps its weights
        until ``step()``, as in apex: a second loss may still backpropagate through them.)"""
        scale = self.loss_scaler.scale_tensor()
        if self.async_step:
            self._prepare_async_step(scale)
            return
        flags = self._mpo.grads_to_masters(
            kernels.inv_scale(scale), kernels.new_found_inf(scale.device), clear_missing=False
        )
        if self.dynamic_loss_scale:
            found_inf = kernels.combine_found_inf(flags.values(), scale.device)
            self.loss_scaler.update(found_inf)
            self._step.unscaled(flags, by_scaler=False, verdict=found_inf != 0)
        else:
            self.loss_scaler.update(None)
            self._step.unscaled(flags, by_scaler=False, verdict=False)  # apex never checked with a static scale

    def _prepare_async_step(self, scale: torch.Tensor) -> None:
        inv = kernels.inv_scale(scale)
        if self.dynamic_loss_scale:
            flags = self._mpo.async_check_grads(land=False)
            found_inf = kernels.combine_found_inf(flags.values(), scale.device)
            self.loss_scaler.update(found_inf)
            self._step.checked(
                flags, prepared=(inv, found_inf, self.loss_scaler.scale_snapshot()), verdict=found_inf != 0
            )
        else:
            self.loss_scaler.update(None)
            # apex never checked with a static scale
            self._step.checked({}, prepared=(inv, kernels.new_found_inf(scale.device), None), verdict=False)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Skip the step if the last backward overflowed; else step the masters and copy them into the model.

        A skip logs apex's message; the masters step with the closure if given; the copy is into the fp16 params.

        With ``async_step``: hand the grads to the optimizer thread and return None at once
        (no host read of the overflow flag); the job skips or steps, and its errors surface
        at the next call that waits for it."""
        if self.async_step:
            return self._submit_step(closure)
        if closure is None and not self._step.read_since_step:
            self._warn_no_backward()
        self._step.stepped()
        if self.overflow:
            _log_overflow(self.loss_scaler.loss_scale())
            return None
        if closure is not None:
            return self._step_with_closure(closure)
        return self._mpo.inner_step()

    def _warn_no_backward(self) -> None:
        if self._warned_no_backward:
            return
        self._warned_no_backward = True
        logger.warning(_NO_BACKWARD)

    # ------------------------------------------------------------------ fp16kit.GradScaler
    def _submit_step(self, closure: Callable[[], Any] | None) -> None:
        if closure is not None:
            raise RuntimeError(
                "Closures are not supported with async_step=True: the step runs later on the "
                "optimizer thread, but a closure must re-evaluate the model now. Build the "
                "FP16_Optimizer with async_step=False for LBFGS-style optimizers."
            )
        if self._step.stage is not Stage.CHECKED:
            raise RuntimeError(
                "FP16_Optimizer(async_step=True).step() found no prepared gradients: call "
                "optimizer.backward(loss) (or, after backward(loss, update_master_grads=False), "
                "optimizer.update_master_grads()) before each step()."
            )
        inv, found_inf, scale_after = self._step.prepared
        on_skip = None if scale_after is None else functools.partial(_log_overflow, scale_after)
        # (raises the previous step's error, if any, before anything changes: call step() again)
        self._mpo.async_submit(inv, found_inf, missing_grads=self._step.cleared or "keep", on_skip=on_skip)
        self._step.submitted()

    def _step_with_closure(self, closure: Callable[[], Any]) -> Any:
        def wrapped_closure() -> Any:
            if self.first_closure_call_this_step:
                self.first_closure_call_this_step = False
            else:
                # The optimizer may re-evaluate at new points (LBFGS): the fp16 model must
                # see the masters it moved.
                self._mpo.masters_to_model()
            temp_loss = closure()
            retries = 0
            while self.overflow:
                retries += 1
                if retries > self.MAX_CLOSURE_RETRIES:
                    raise FloatingPointError(
                        f"The closure's backward overflowed {self.MAX_CLOSURE_RETRIES} times in a "
                        f"row (loss scale now {self.loss_scaler.loss_scale()}): the loss is not "
                        "finite at any scale. Check the loss and the inputs for inf/NaN."
                    )
                apex_logger.warning(
                    f"OVERFLOW within closure! Skipping step, reducing loss scale to {self.loss_scaler.loss_scale()}"
                )
                temp_loss = closure()
            return temp_loss

        try:
            return self._mpo.inner_step(wrapped_closure)
        finally:
            self.first_closure_call_this_step = True

    def clip_grad_norm(self, parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
        """apex's ``clip_grad_norm`` (:mod:`fp16kit.legacy.fp16util`), what :meth:`clip_master_grads` calls."""
        return clip_grad_norm(parameters, max_norm, norm_type)

    def clip_master_grads(self, max_norm: float, norm_type: float = 2) -> Any:
        """Clip the grads of every param in ``param_groups`` by their total norm.

        These are the fp32 masters and fp32 params; returns that norm, or ``-1`` if the last backward overflowed."""
        self._refuse_when_async("clip_master_grads")
        if self.overflow:
            return -1
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        return self.clip_grad_norm(params, max_norm, norm_type)

    def inspect_master_grad_data(self) -> list[list[torch.Tensor | None]] | None:
        """The master grads per group (None where a param has none), or None while in an overflow state."""
        self._refuse_when_async("inspect_master_grad_data")
        if self.overflow:
            apex_logger.warning(
                "Warning:  calling FP16_Optimizer.inspect_master_grad_data while in an overflow "
                "state.  Gradients are currently invalid (may be inf, nan, or stale).  Returning None."
            )
            return None
        return [
            [p.grad.data if p.grad is not None else None for p in group["params"]]
            for group in self.optimizer.param_groups
        ]

    def _refuse_when_async(self, name: str) -> None:
        if self.async_step:
            raise RuntimeError(
                f"FP16_Optimizer.{name}() needs this iteration's master grads, but with "
                "async_step=True they are computed later, on the optimizer thread. Build the "
                "FP16_Optimizer with async_step=False to clip or inspect the master grads."
            )

    def _master_params_to_model_params(self) -> None:
        if self.async_step:
            self._mpo.synchronize()
        else:
            self._mpo.masters_to_model()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group (apex had no such method): its fp16/bf16 params get fp32 masters, as at construction."""
        if isinstance(param_group, dict) and "params" in param_group:
            params = param_group["params"]  # a generator is read once: keep the list
            param_group["params"] = [params] if isinstance(params, torch.Tensor) else list(params)
        _check_param_types_of(param_group.get("params", []))
        self._mpo.add_param_group(param_group)
        self._index_groups()

    def _index_groups(self) -> None:
        """apex's per-group and flat lists, read off the MixedPrecisionOptimizer's groups."""
        groups = self._mpo.groups
        self.fp16_groups = [g.model_params for g in groups]
        self.fp32_from_fp16_groups = [g.masters for g in groups]
        self.fp32_from_fp32_groups = [g.direct for g in groups]
        self.all_fp16_params = [p for g in groups for p in g.model_params]
        self.all_fp32_from_fp16_params = [p for g in groups for p in g.masters]
        self.all_fp32_from_fp32_params = [p for g in groups for p in g.direct]

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Return apex's six keys, as plain data (``torch.load(weights_only=True)`` reads it).

        ``loss_scaler`` is a dict, ``fp32_from_fp16`` the exact fp32 masters per group. Waits
        for a step in flight; does not write the model params."""
        self._mpo.wait_for_step()
        return {
            "loss_scaler": self.loss_scaler.state_dict(),
            "dynamic_loss_scale": self.dynamic_loss_scale,
            "overflow": self.overflow,
            "first_closure_call_this_step": self.first_closure_call_this_step,
            "optimizer_state_dict": self.optimizer.state_dict(),
            "fp32_from_fp16": [[m.detach() for m in g] for g in self.fp32_from_fp16_groups],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict in fp16kit's form or apex's.

        Load fp16kit's form or apex's (an era-2 ``apex.amp.scaler.LossScaler`` or an era-1
        ``LossScaler``/``DynamicLossScaler`` under ``loss_scaler``; read apex files with
        :func:`fp16kit.legacy.load_checkpoint`). Load the model (``model.load_state_dict``)
        before or after this, but before the optimizer is next used: the masters are restored
        by copy. Everything is checked before anything changes; a mismatch raises ValueError
        naming the group and the counts.

        A checkpoint written without ``async_step``/``master_device`` (apex's own included)
        loads into an optimizer built with them: the fp32 params' masters are taken from the
        model when the optimizer is next used. The other way round, the saved fp32 masters (a
        step ahead of the model when the run was asynchronous) go into the fp32 params then."""
        if not isinstance(state_dict, dict):
            raise TypeError(f"FP16_Optimizer.load_state_dict expects a dict, got {type(state_dict).__name__}.")
        missing = [k for k in _STATE_KEYS if k not in state_dict]
        if missing:
            raise ValueError(
                f"FP16_Optimizer state dict is missing {missing}; pass the dict from "
                "FP16_Optimizer.state_dict() (or an apex checkpoint's optimizer entry)."
            )
        new_scaler, dynamic = self._loaded_scaler(state_dict)
        # the masters' own load (it checks everything before it changes anything), which also
        # recovers them from a commit a second Ctrl-C broke off
        self._mpo.load_state_dict(
            {"optimizer": state_dict["optimizer_state_dict"], "masters": state_dict["fp32_from_fp16"]}
        )
        self.loss_scaler = new_scaler
        self.dynamic_loss_scale = dynamic
        if self._step.stage is Stage.CHECKED:  # nothing prepared survives the load
            self._step.reset(cleared=self._step.cleared)
        self.overflow = bool(state_dict["overflow"])
        self.first_closure_call_this_step = bool(state_dict["first_closure_call_this_step"])

    def _loaded_scaler(self, state_dict: dict[str, Any]) -> tuple[Any, bool]:
        """The scaler a checkpoint's ``loss_scaler`` entry describes, and whether it is dynamic
        (changes nothing; ValueError naming the field if it cannot be read or trained with)."""
        try:
            check_saved_scaler(state_dict["loss_scaler"])
        except ValueError as e:
            raise ValueError(f"Cannot load the saved loss scaler: {e}") from None
        scaler = scaler_state(state_dict["loss_scaler"], current=self.loss_scaler.state_dict())
        try:
            return AmpLossScaler.from_state(scaler, self._device), scaler["dynamic"]
        except (TypeError, ValueError) as e:
            raise ValueError(f"The saved loss scaler has invalid settings: {e}") from None

    def __repr__(self) -> str:
        return (
            f"FP16_Optimizer(dynamic_loss_scale={self.dynamic_loss_scale}, "
            f"loss_scale={self.loss_scale}, optimizer={self.optimizer!r})"
        )


# Each of these calls is one commit: a Ctrl-C inside it is held to its end (fp16kit.core.interrupts);
# step() is one through WrappingOptimizer, torch's step hooks included.
commit_methods(
    FP16_Optimizer,
    {
        "zero_grad": "optimizer.zero_grad()",
        "backward": "optimizer.backward(loss)",
        "update_master_grads": "optimizer.update_master_grads()",
        "clip_master_grads": "optimizer.clip_master_grads()",
        "add_param_group": "optimizer.add_param_group()",
        "load_state_dict": "optimizer.load_state_dict()",
    },
    recovers=("load_state_dict",),
)


def _scale_device(opt: FP16_Optimizer) -> torch.device:
    """Where the scale lives: the device of the first model param (CPU with none)."""
    for p in (*opt.all_fp16_params, *opt.all_fp32_from_fp32_params):
        return p.device
    return torch.device("cpu")


def _log_overflow(scale_after: float | torch.Tensor) -> None:
    """apex's message for a skipped step. A tensor is read here: asynchronously, this runs on
    the optimizer thread, which may read the device (the main thread never does)."""
    value = scale_after.item() if isinstance(scale_after, torch.Tensor) else scale_after
    apex_logger.warning(f"Gradient overflow.  Skipping step, reducing loss scale to {value}")
