"""``fp16kit.GradScaler``: a drop-in for ``torch.amp.GradScaler`` on fp16kit's core.

Used from one thread it is indistinguishable from torch's scaler: same constructor, methods,
return values, error types and texts, per-optimizer state machine, ``state_dict`` keys and
order, pickling rules and fused-optimizer protocol. It subclasses ``torch.amp.GradScaler`` so
``isinstance`` checks in other libraries keep passing, but overrides every method: all work
goes through :mod:`fp16kit.core.kernels` and :class:`fp16kit.core.scale.LossScale`.
"""

from __future__ import annotations

import copy
import inspect
import warnings
from collections import defaultdict
from collections.abc import Iterable
from typing import Any, cast, overload

import torch
import torch.amp.grad_scaler as _torch_grad_scaler

from ..core import kernels
from ..core.interrupts import commit_methods
from ..core.protocol import scaled_iterations, speaks_master_protocol
from ..core.scale import FloorPolicy, LossScale
from ..core.thread import OptimizerThread, current_optimizer_thread
from .binding import ScalerThreads

__all__ = ["GradScaler", "OptState"]

# torch's text (kept, so code matching it still works), then the fix fp16kit offers
FP16_GRADS = "Attempting to unscale FP16 gradients."
FP16_GRADS_HINT = (
    " fp16kit: an fp16 model trains through fp32 master weights with "
    "fp16kit.MixedPrecisionOptimizer(optimizer) -- wrap the optimizer in it and pass that to "
    "scaler.step(); or keep the model in float32 and use torch.autocast."
)

# torch's own enum and per-optimizer factory: states compare equal to torch's, and code that
# inspects `scaler._per_optimizer_states` (torch's tests, FSDP's ShardedGradScaler) works.
OptState = _torch_grad_scaler.OptState
_refresh_per_optimizer_state = _torch_grad_scaler._refresh_per_optimizer_state


class _LossScaleField:
    """One of torch's private GradScaler attributes, backed by a LossScale attribute.

    torch sets these attributes only when a scaler is *constructed* enabled, so on one built
    disabled reading one raises ``AttributeError`` until it is assigned (e.g.
    ``get_growth_factor()`` fails in torch); such a scaler keeps assigned values aside, as
    plain attributes. Flipping ``_enabled`` later changes nothing here, as in torch."""

    def __init__(self, attr: str) -> None:
        self.attr = attr
        self.name = attr

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        if not obj.__dict__.get("_built_enabled", True):
            try:
                return obj.__dict__["_disabled_fields"][self.name]
            except KeyError:
                raise AttributeError(f"'{type(obj).__name__}' object has no attribute '{self.name}'") from None
        return getattr(obj._loss_scale, self.attr)

    def __set__(self, obj: Any, value: Any) -> None:
        if not obj.__dict__.get("_built_enabled", True):
            obj.__dict__.setdefault("_disabled_fields", {})[self.name] = value
        else:
            setattr(obj._loss_scale, self.attr, value)


class _ScaleField(_LossScaleField):
    """``_scale``: bound to an optimizer thread, each side sees its own scale -- the step being
    run on the optimizer thread, the next forward's on the main thread (docs/async.md)."""

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        threads = obj.__dict__.get("_thread_side")
        if threads is not None and threads.binding is not None:
            return threads.binding.scale_for_caller()
        return super().__get__(obj, objtype)


class GradScaler(torch.amp.GradScaler):
    """Scale losses and unscale gradients for mixed-precision training, like ``torch.amp.GradScaler``.

    See torch's documentation: the behaviour is the same.

    ::

        scaler = fp16kit.GradScaler("cuda")
        for input, target in data:
            optimizer.zero_grad()
            with torch.autocast("cuda", dtype=torch.float16):
                loss = loss_fn(model(input), target)
            scaler.scale(loss).backward()   # loss * scale
            scaler.step(optimizer)          # unscale grads; skip the step if any is inf/NaN
            scaler.update()                 # back off on overflow, grow after clean steps

    Positional arguments and defaults are torch's. Keyword-only extras, all off by default
    (with the defaults, the state dict has exactly torch's five keys):

    * ``hysteresis`` (int, 1): back off only after this many overflows since the last growth.
    * ``min_scale`` / ``max_scale`` (float or None): bounds for back-off / growth.
    * ``on_min_scale`` (``"ignore" | "warn" | "raise"``): what to do when a step overflows
      with the scale already at ``min_scale`` (``"raise"``: ``FloatingPointError``).
    * ``process_group``: a ``torch.distributed`` group over which ``found_inf`` is
      all-reduced (max) before the skip decision and the update, so ranks holding different
      shards of the gradients skip together. ``None`` (default): no communication; pass
      ``torch.distributed.group.WORLD`` for the default group.

    Skipped steps can be read without a host sync through :meth:`last_step_skipped_tensor`,
    or as Python values through :meth:`last_step_skipped`, :meth:`skipped_steps` and
    :meth:`consecutive_skipped_steps`.
    """

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        hysteresis: int = 1,
        min_scale: float | None = None,
        max_scale: float | None = None,
        on_min_scale: FloorPolicy = "ignore",
        process_group: Any = None,
    ) -> None:
        self._device = device
        self._enabled = enabled
        if self._device == "cuda":
            if enabled and torch.cuda.amp.common.amp_definitely_not_available():
                warnings.warn(
                    "torch.cuda.amp.GradScaler is enabled, but CUDA is not available.  Disabling.",
                    stacklevel=2,
                )
                self._enabled = False

        if self._enabled:
            if growth_factor <= 1.0:
                raise AssertionError("The growth factor must be > 1.0.")
            if backoff_factor >= 1.0:
                raise AssertionError("The backoff factor must be < 1.0.")
        # Built even when disabled, so the extras are validated either way; it holds no
        # tensors until the first scale() (torch creates its scale lazily too).
        self._loss_scale = LossScale(
            init_scale,
            rule="torch",
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            hysteresis=hysteresis,
            min_scale=min_scale,
            max_scale=max_scale,
            on_min_scale=on_min_scale,
        )
        self._built_enabled = self._enabled
        self._process_group = _check_process_group(process_group)
        self._process_group_lost = False
        if self._enabled:
            self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)

    # -------------------------------------------------------------- torch's private fields
    # torch keeps the scale state in these attributes, and code in the wild (torch's own
    # tests, FSDP's ShardedGradScaler, checkpoint helpers) reads and writes them. They are
    # views of the LossScale, so both spellings stay in step.
    _scale = _ScaleField("scale")
    _growth_tracker = _LossScaleField("growth_tracker")
    _init_scale = _LossScaleField("init_scale")
    _init_growth_tracker = _LossScaleField("init_growth_tracker")
    _growth_factor = _LossScaleField("growth_factor")
    _backoff_factor = _LossScaleField("backoff_factor")
    _growth_interval = _LossScaleField("growth_interval")

    @property
    def _per_optimizer_states(self) -> dict[int, dict[str, Any]]:
        # Bound to an optimizer thread, a step run there records into its iteration's states.
        threads = self.__dict__.get("_thread_side")
        if (
            threads is not None
            and threads.binding is not None
            and (states := threads.binding.states_for_caller()) is not None
        ):
            return states
        try:
            return self.__dict__["_opt_states"]
        except KeyError:
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '_per_optimizer_states'") from None

    @_per_optimizer_states.setter
    def _per_optimizer_states(self, value: dict[int, dict[str, Any]]) -> None:
        self.__dict__["_opt_states"] = value

    # -------------------------------------------------------------- the optimizer thread
    def bind(self, thread: OptimizerThread, *, step_of: Any = None) -> None:
        """Run this scaler's steps on ``thread`` (docs/async.md §4, mode 2).

        ``scale()`` and ``update()`` stay on the main thread, ``step()`` runs in the jobs there, each side seeing its own scale (see
        :mod:`fp16kit.scaler.binding`). ``opt.submit_step(fn, scaler=scaler)`` calls this with ``step_of=opt``
        before it hands anything off: a second submitted step of ``opt`` with no ``update()`` since its last
        one raises RuntimeError. Before the first ``scale()`` the binding is made there. Binding to the same
        thread again does nothing; to another raises RuntimeError -- unless the bound thread was shut down:
        then the scaler moves to the new one."""
        if not isinstance(thread, OptimizerThread):
            raise TypeError(f"bind() takes an fp16kit.OptimizerThread, got {type(thread).__name__}.")
        binding = self._threads.bind(thread, self._loss_scale, mark=thread.steps)
        if binding is not None and step_of is not None:
            binding.submitting(step_of)

    @property
    def _threads(self) -> ScalerThreads:
        threads = self.__dict__.get("_thread_side")
        if threads is None:  # built lazily: also for scalers unpickled from older versions
            threads = self.__dict__["_thread_side"] = ScalerThreads()
            threads.loaded(self._loss_scale, self.__dict__.pop("_lagged_next_scale", None))
        return threads

    # -------------------------------------------------------------- scale
    def _check_scale_growth_tracker(self, funcname: str) -> tuple[torch.Tensor, torch.Tensor]:
        fix = "This may indicate your script did not use scaler.scale(loss or outputs) earlier in the iteration."
        if self._scale is None:
            raise AssertionError(f"Attempted {funcname} but _scale is None.  " + fix)
        if self._growth_tracker is None:
            raise AssertionError(f"Attempted {funcname} but _growth_tracker is None.  " + fix)
        return (self._scale, self._growth_tracker)

    def _lazy_init_scale_growth_tracker(self, dev: torch.device) -> None:
        if self._growth_tracker is not None:
            raise AssertionError("_growth_tracker initialized before _scale")
        self._loss_scale.materialize(dev)

    def _scale_on(self, device: torch.device) -> torch.Tensor:
        if self._scale is None:
            self._lazy_init_scale_growth_tracker(device)
        assert self._scale is not None
        return self._scale

    @overload
    def scale(self, outputs: torch.Tensor) -> torch.Tensor: ...

    @overload
    def scale(self, outputs: list[torch.Tensor]) -> list[torch.Tensor]: ...

    @overload
    def scale(self, outputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]: ...

    @overload
    def scale(self, outputs: Iterable[torch.Tensor]) -> Iterable[torch.Tensor]: ...

    def scale(self, outputs: torch.Tensor | Iterable[torch.Tensor]) -> torch.Tensor | Iterable[torch.Tensor]:
        """Multiply a tensor or (nested) iterable of tensors by the scale factor; returned unmodified when disabled.

        The scale is created on the device of the first tensor."""
        if not self._enabled:
            return outputs
        scaled_iterations.opened(self)
        out = kernels.scale_outputs(outputs, self._scale_on)
        self._threads.scaled(self._loss_scale)
        return out

    # -------------------------------------------------------------- unscale
    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:
        # An optimizer that keeps master weights (MixedPrecisionOptimizer: fp16 model grads ->
        # fp32 master grads) unscales into them (fp16kit.core.protocol).
        if speaks_master_protocol(optimizer):
            return optimizer.unscale_grads_(inv_scale, found_inf)
        try:
            return kernels.unscale_grads_(_optimizer_params(optimizer), inv_scale, found_inf, allow_fp16=allow_fp16)
        except ValueError as e:  # raised before any grad changed: name the fix
            if str(e) != FP16_GRADS:
                raise
            raise ValueError(f"{FP16_GRADS}{FP16_GRADS_HINT}") from None

    def _reduce_found_inf(
        self, found_inf_per_device: dict[torch.device, torch.Tensor]
    ) -> dict[torch.device, torch.Tensor]:
        """With a process group: one flag, max-reduced over the ranks, on the scale's device.
        (Also when this rank holds no grads for the optimizer: it must join the collective.)"""
        if self._process_group is None:
            return found_inf_per_device
        scale, _ = self._check_scale_growth_tracker("_reduce_found_inf")
        return kernels.all_reduce_found_inf(found_inf_per_device, scale.device, self._process_group)

    def _check_process_group_present(self) -> None:
        if self.__dict__.get("_process_group_lost", False):
            raise RuntimeError(
                "This GradScaler was built with a process_group, which cannot be pickled: the "
                "copy has none, and its ranks could skip different steps. Call "
                "scaler.set_process_group(group) after loading it (None: no all-reduce)."
            )

    def set_process_group(self, process_group: Any) -> None:
        """Set (or, with None, remove) the group over which ``found_inf`` is all-reduced.

        E.g. after unpickling a scaler that had one."""
        self._process_group = _check_process_group(process_group)
        self._process_group_lost = False

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide ("unscale") the optimizer's gradients by the scale factor, in place.

        Records whether any is inf/NaN. Optional: :meth:`step` unscales if you have not. Call it at most once
        per optimizer per iteration, after all grads are accumulated. No host sync."""
        if not self._enabled:
            return
        if self._threads.route(self._loss_scale, self.unscale_, optimizer):
            return

        self._check_scale_growth_tracker("unscale_")
        self._check_process_group_present()

        optimizer_state = self._per_optimizer_states[id(optimizer)]

        if optimizer_state["stage"] is OptState.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        elif optimizer_state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")

        assert self._scale is not None
        inv_scale = kernels.inv_scale(self._scale)
        found_inf = kernels.new_found_inf(self._scale.device)

        # The grads are unscaled from here on: record it before the all-reduce, so that a
        # failing collective cannot leave them to be unscaled a second time.
        optimizer_state["found_inf_per_device"] = self._unscale_grads_(optimizer, inv_scale, found_inf, False)
        optimizer_state["stage"] = OptState.UNSCALED
        optimizer_state["found_inf_per_device"] = self._reduce_found_inf(optimizer_state["found_inf_per_device"])

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        _scale, _ = self._check_scale_growth_tracker("_check_inf_per_device")
        self._check_process_group_present()
        # Unscaling by exactly 1.0 checks the grads without changing them (torch does the same).
        dummy_inv_scale = torch.full((), 1.0, dtype=torch.float32, device=_scale.device)
        found_inf = kernels.new_found_inf(_scale.device)
        self._per_optimizer_states[id(optimizer)]["found_inf_per_device"] = self._reduce_found_inf(
            self._unscale_grads_(optimizer, dummy_inv_scale, found_inf, True)
        )
        return self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]

    def _found_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]

    # -------------------------------------------------------------- step
    def _maybe_opt_step(
        self,
        optimizer: torch.optim.Optimizer,
        optimizer_state: dict[str, Any],
        *args: Any,
        **kwargs: Any,
    ) -> float | None:
        retval: float | None = None
        # The skip decision needs the flag on the host: the one sync of a non-fused step
        # (fused optimizers take found_inf on the device instead; see step()).
        if not sum(v.item() for v in optimizer_state["found_inf_per_device"].values()):
            if speaks_master_protocol(optimizer):
                optimizer.skip_decided()  # it need not read the flags again
            retval = optimizer.step(*args, **kwargs)
        return retval

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> float | None:
        """Unscale the optimizer's grads and run ``optimizer.step(*args, **kwargs)`` if none is inf/NaN.

        Grads already unscaled by :meth:`unscale_` are not unscaled again. Returns the step's value (None when
        skipped). Optimizers with ``_step_supports_amp_scaling`` (fused Adam/AdamW/SGD) receive
        ``grad_scale``/``found_inf`` and skip on the device. Closures are not supported while enabled."""
        if not self._enabled:
            return optimizer.step(*args, **kwargs)

        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")

        if self._threads.route(self._loss_scale, self.step, optimizer, *args, step=True, **kwargs):
            return None  # ran on the optimizer thread (docs/async.md): the value stays there

        self._check_scale_growth_tracker("step")

        optimizer_state = self._per_optimizer_states[id(optimizer)]

        if optimizer_state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")

        retval: float | None = None

        if speaks_master_protocol(optimizer) and optimizer.submits_steps():
            # MixedPrecisionOptimizer(async_step=True): it checks the grads on their device,
            # hands them to the optimizer thread and returns this step's flags; update() uses
            # them on the device, so the next scale() sees this step's overflow. No sync.
            self._check_process_group_present()
            unscaled = optimizer_state["stage"] is OptState.UNSCALED
            optimizer_state["found_inf_per_device"] = optimizer.submit_scaled_step(
                self._scale,
                unscaled_flags=optimizer_state["found_inf_per_device"] if unscaled else None,
                reduce=self._reduce_found_inf,
            )
            optimizer_state["stage"] = OptState.STEPPED
            return None

        if getattr(optimizer, "_step_supports_amp_scaling", False):
            # The optimizer handles scaling itself. Old protocol: it takes a `grad_scaler`
            # keyword (deprecated by torch, with this FutureWarning). New protocol: it reads
            # `grad_scale` and `found_inf` attributes and skips/unscales inside its kernel.
            kwargs_ = kwargs
            has_grad_scaler_kwarg = "grad_scaler" in inspect.signature(optimizer.step).parameters
            if has_grad_scaler_kwarg:
                warnings.warn(
                    "GradScaler is going to stop passing itself as a keyword argument to the passed "
                    "optimizer. In the near future GradScaler registers `grad_scale: Tensor` and "
                    "`found_inf: Tensor` to the passed optimizer and let the optimizer use them directly.",
                    FutureWarning,
                    stacklevel=3,  # the caller of scaler.step, past the commit wrapper
                )
                kwargs_.update({"grad_scaler": self})
            else:
                if optimizer_state["stage"] is OptState.READY:
                    self._check_inf_per_device(optimizer)
                scaler = self._get_scale_async()
                if scaler is None:
                    raise AssertionError("_get_scale_async returned None")
                flags = list(optimizer_state["found_inf_per_device"].values())
                # No flags (no grads were checked): torch passes sum([]), the int 0. A fused
                # step with no grads ignores it; one with grads the check never saw fails.
                found_inf = kernels.combine_found_inf(flags, scaler.device) if flags else 0
                # Product of the scales, if the user preset `optimizer.grad_scale`.
                optimizer.grad_scale = (  # type: ignore[attr-defined]
                    getattr(optimizer, "grad_scale", None)
                    if optimizer_state["stage"] == OptState.UNSCALED
                    else scaler * getattr(optimizer, "grad_scale", 1)
                )
                optimizer.found_inf = found_inf  # type: ignore[attr-defined]
            retval = optimizer.step(*args, **kwargs_)
            optimizer_state["stage"] = OptState.STEPPED
            if not has_grad_scaler_kwarg:
                del optimizer.grad_scale  # type: ignore[attr-defined]
                del optimizer.found_inf  # type: ignore[attr-defined]
            return retval

        if optimizer_state["stage"] is OptState.READY:
            self.unscale_(optimizer)

        if len(optimizer_state["found_inf_per_device"]) == 0:
            raise AssertionError("No inf checks were recorded for this optimizer.")

        retval = self._maybe_opt_step(optimizer, optimizer_state, *args, **kwargs)

        optimizer_state["stage"] = OptState.STEPPED

        return retval

    # -------------------------------------------------------------- update
    def update(self, new_scale: float | torch.Tensor | None = None, *, is_async: bool = True) -> None:
        """Update the scale: back off after a skipped step, grow after clean ones, or set ``new_scale``.

        Backs off if any optimizer step this iteration was skipped, grows after ``growth_interval`` clean
        iterations (see :class:`LossScale` for the rule), or sets ``new_scale`` (a float, or a 1-element
        tensor on this scaler's device that does not require grad; it is copied). Call once per iteration,
        after every ``step()``. No host sync.

        When the steps run on an optimizer thread (``opt.submit_step``), call it from the main
        thread: it publishes the scale the previous iteration's update computed (the next
        loss is scaled with it: one iteration of lag) and queues this iteration's update
        behind this iteration's step. ``is_async=False`` waits for it instead: torch's exact
        trajectory. See :mod:`fp16kit.scaler.binding`."""
        if not self._enabled:
            return
        if current_optimizer_thread() is not None:
            raise RuntimeError(
                "scaler.update() must be called from the main thread, once per iteration after "
                "the step: loss = scaler.scale(loss); loss.backward(); "
                "opt.submit_step(lambda: scaler.step(opt), scaler=scaler); scaler.update()."
            )
        binding = self._threads.for_update(
            self._loss_scale,
            has_checks=any(st["found_inf_per_device"] for st in self._per_optimizer_states.values()),
        )
        if binding is not None:
            if new_scale is not None:
                _check_new_scale(new_scale, self._device)
                binding.set_scale(new_scale)
            else:
                binding.update(is_async)
            scaled_iterations.closed(self)
            return

        _scale, _growth_tracker = self._check_scale_growth_tracker("update")

        if new_scale is not None:
            if self._scale is None:
                raise AssertionError("_scale is None in update")
            # Accept a new user-defined scale (copied, not aliased).
            _check_new_scale(new_scale, self._device)
            self._loss_scale.set_scale(new_scale)
        else:
            # Consume the inf/nan flags the optimizers recorded this iteration.
            found_infs = [
                found_inf
                for state in self._per_optimizer_states.values()
                for found_inf in state["found_inf_per_device"].values()
            ]

            if len(found_infs) == 0:
                raise AssertionError("No inf checks were recorded prior to update.")

            # Summed into the first flag in place, as torch does.
            found_inf_combined = kernels.combine_found_inf(found_infs, _scale.device, into_first=True)

        # To prepare for next iteration, clear the data collected from optimizers this iteration.
        # (Before the scale update: with on_min_scale="raise" that update may raise.)
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
        scaled_iterations.closed(self)
        if new_scale is None:
            self._loss_scale.update(found_inf_combined)

    # -------------------------------------------------------------- reads and settings
    def _get_scale_async(self) -> torch.Tensor | None:
        return self._scale

    def get_scale(self) -> float:
        """The current scale as a Python float, or 1.0 when disabled (a host sync)."""
        if self._enabled:
            return self._init_scale if (scale := self._get_scale_async()) is None else cast(float, scale.item())
        return 1.0

    # With steps on the optimizer thread, from the main thread: ``get_*(up_to_date=True)``
    # first waits for the queued work (a queued ``set_*`` included); ``set_*`` is queued
    # behind the pending jobs.
    def get_growth_factor(self, *, up_to_date: bool = False) -> float:
        r"""Return a Python float containing the scale growth factor."""
        return self._setting("_growth_factor", up_to_date)

    def set_growth_factor(self, new_factor: float) -> None:
        r"""Set a new scale growth factor."""
        self._set("_growth_factor", new_factor)

    def get_backoff_factor(self, *, up_to_date: bool = False) -> float:
        r"""Return a Python float containing the scale backoff factor."""
        return self._setting("_backoff_factor", up_to_date)

    def set_backoff_factor(self, new_factor: float) -> None:
        r"""Set a new scale backoff factor."""
        self._set("_backoff_factor", new_factor)

    def get_growth_interval(self, *, up_to_date: bool = False) -> int:
        r"""Return a Python int containing the growth interval."""
        return self._setting("_growth_interval", up_to_date)

    def set_growth_interval(self, new_interval: int) -> None:
        r"""Set a new growth interval."""
        self._set("_growth_interval", new_interval)

    def _setting(self, name: str, up_to_date: bool) -> Any:
        if up_to_date:
            self._threads.synchronize()
        return getattr(self, name)

    def _set(self, name: str, value: Any) -> None:
        if (binding := self._threads.main()) is not None:
            binding.queue(setattr, self, name, value)
        else:
            setattr(self, name, value)

    def _get_growth_tracker(self) -> int:
        if self._enabled:
            return self._init_growth_tracker if self._growth_tracker is None else cast(int, self._growth_tracker.item())
        return 0

    def is_enabled(self) -> bool:
        r"""Return a bool indicating whether this instance is enabled."""
        return self._enabled

    # -------------------------------------------------------------- skipped steps (extras)
    def last_step_skipped_tensor(self) -> torch.Tensor:
        """0-dim bool tensor on the scale's device: was (or will be) a step skipped? No sync.

        Once this iteration's grads have been checked (by ``unscale_()`` or ``step()``), it
        answers for this iteration: True if any optimizer's grads hold inf/NaN. After
        ``update()``, it answers for the iteration update() consumed. ``False`` before the
        first check, and always when disabled."""
        if self._enabled and self._scale is not None:
            found = [f for state in self._per_optimizer_states.values() for f in state["found_inf_per_device"].values()]
            if found:
                return kernels.combine_found_inf(found, self._scale.device) != 0
            last = self._loss_scale.last_found_inf()  # a new tensor
            if last is not None:
                return last
            return torch.zeros((), dtype=torch.bool, device=self._scale.device)
        return torch.zeros((), dtype=torch.bool)

    def last_step_skipped(self) -> bool:
        """As :meth:`last_step_skipped_tensor`, as a Python bool (a host sync)."""
        return bool(self.last_step_skipped_tensor().item())

    def skipped_steps(self) -> int:
        """Return the iterations whose update() saw an overflow, since construction.

        A host sync; with steps on the optimizer thread it also waits for the queued jobs: read it to log, not
        every iteration. Not part of the state dict (torch's keys only); carried through pickling."""
        return self._threads.after(self._loss_scale.skipped_steps) if self._enabled else 0

    def consecutive_skipped_steps(self) -> int:
        """Overflowing iterations in a row, up to the last update() (a host sync)."""
        return self._threads.after(self._loss_scale.consecutive_skipped_steps) if self._enabled else 0

    # -------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        r"""Return the state of the scaler as a :class:`dict` of plain data.

        Five entries, as torch's: ``"scale"``, ``"growth_factor"``, ``"backoff_factor"``,
        ``"growth_interval"``, ``"_growth_tracker"``. When an extra is not at its default,
        ``"hysteresis"``, ``"_hysteresis_tracker"``, ``"min_scale"``, ``"max_scale"`` and
        ``"on_min_scale"`` follow (torch's ``load_state_dict`` ignores them); with steps on an
        optimizer thread, ``"next_scale"`` may (see :meth:`ScalerThreads.saved`). Empty when
        disabled. Call it after :meth:`update` to checkpoint the end of an iteration.
        """
        if self._enabled:
            self._threads.synchronize()
            scale, lag = self._threads.saved(self._loss_scale, self.get_scale())
            state = {
                "scale": scale,
                "growth_factor": self._growth_factor,
                "backoff_factor": self._backoff_factor,
                "growth_interval": self._growth_interval,
                "_growth_tracker": self._get_growth_tracker(),
            }
            state.update(_extras_state(self._loss_scale))
            state.update(lag)
            return state
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        r"""Load the scaler state (from this class or from ``torch.amp.GradScaler``).

        A no-op when disabled. Extras missing from the dict keep their current settings, with the hysteresis
        tracker full."""
        if not self._enabled:
            return

        if len(state_dict) == 0:
            raise RuntimeError(
                "The source state dict is empty, possibly because it was saved from a disabled instance of GradScaler."
            )

        self._threads.synchronize()
        ls = self._loss_scale
        next_scale = self._threads.check_loaded(state_dict)
        ls.load_state_dict(_loss_scale_state(state_dict, ls))  # validates before changing
        self._threads.loaded(ls, next_scale)

    def _recovered_from_interrupt(self) -> None:
        # A second Ctrl-C broke a call off (fp16kit.core.interrupts): this iteration's records
        # are half made; the restored scaler starts the next iteration afresh.
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
        scaled_iterations.closed(self)

    def __getstate__(self) -> dict[str, Any]:
        self._threads.synchronize()
        state = self.__dict__.copy()
        # A copy starts unbound, from the optimizer thread's scale (a binding holds a thread).
        state.pop("_thread_side", None)
        if self._enabled:
            binding = self._threads.binding  # bound: a step recorded on the thread counts too
            if len(self._per_optimizer_states) != 0 or (binding is not None and binding.mid_iteration()):
                raise AssertionError(
                    "A GradScaler instance may only be pickled at the beginning "
                    "of an iteration, or at the end after scaler.update()."
                )
        # A copy of the LossScale holding host values only: it re-creates its tensors lazily,
        # as torch's scaler does with _scale and _growth_tracker, so copies (copy.copy
        # included) never share scale tensors. A process group cannot cross processes: the
        # unpickled scaler has none until one is assigned.
        state["_loss_scale"] = copy.copy(self._loss_scale)
        if self._enabled:  # in the lag of steps on a thread: the copy resumes it as a state dict does
            scale, lag = self._threads.saved(self._loss_scale, self.get_scale())
            state["_loss_scale"].init_scale = scale
            state["_lagged_next_scale"] = lag.get("next_scale")
        if "_disabled_fields" in state:
            state["_disabled_fields"] = dict(state["_disabled_fields"])
        if state.get("_process_group") is not None:
            state["_process_group"] = None
            state["_process_group_lost"] = True
        return state

    def _copy(self, state: dict[str, Any]) -> GradScaler:
        new = type(self).__new__(type(self))
        new.__setstate__(state)
        # In the same process a copy keeps the group (only a pickle cannot carry it).
        new._process_group = self._process_group
        new._process_group_lost = self.__dict__.get("_process_group_lost", False)
        return new

    def __copy__(self) -> GradScaler:
        return self._copy(self.__getstate__())

    def __deepcopy__(self, memo: dict[int, Any]) -> GradScaler:
        return self._copy(copy.deepcopy(self.__getstate__(), memo))

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        if not self._enabled:
            return f"{type(self).__name__}(device={self._device!r}, enabled=False)"
        ls = self._loss_scale
        return (
            f"{type(self).__name__}(device={self._device!r}, scale="
            f"{'lazy ' + repr(ls.init_scale) if ls.scale is None else 'on ' + str(ls.scale.device)}, "
            f"growth_factor={ls.growth_factor}, backoff_factor={ls.backoff_factor}, "
            f"growth_interval={ls.growth_interval})"
        )


# Each of these calls is one commit: a Ctrl-C inside it is held to its end (fp16kit.core.interrupts).
commit_methods(
    GradScaler,
    {
        "scale": "scaler.scale()",
        "unscale_": "scaler.unscale_(optimizer)",
        "step": "scaler.step(optimizer)",
        "update": "scaler.update()",
        "load_state_dict": "scaler.load_state_dict()",
    },
    recovers=("load_state_dict",),
)


def _check_new_scale(new_scale: float | torch.Tensor, device: str) -> None:
    """torch's checks of update(new_scale), with its text (AssertionError)."""
    if isinstance(new_scale, float):
        return
    reason = (
        "new_scale should be a float or a 1-element torch.cuda.FloatTensor or "
        "torch.FloatTensor with requires_grad=False."
    )
    if new_scale.device.type != device:
        raise AssertionError(reason)
    if new_scale.numel() != 1:
        raise AssertionError(reason)
    if new_scale.requires_grad is True:
        raise AssertionError(reason)


def _extras_state(ls: LossScale) -> dict[str, Any]:
    """The extras' entries of a scaler's state dict: none when all are at their defaults."""
    if ls.hysteresis == 1 and ls.min_scale is None and ls.max_scale is None and ls.on_min_scale == "ignore":
        return {}
    return {
        "hysteresis": ls.hysteresis,
        "_hysteresis_tracker": ls.get_hysteresis_tracker(),
        "min_scale": ls.min_scale,
        "max_scale": ls.max_scale,
        "on_min_scale": ls.on_min_scale,
    }


def _loss_scale_state(state_dict: dict[str, Any], ls: LossScale) -> dict[str, Any]:
    """A GradScaler state dict (torch's or with extras) as a LossScale state dict. Keys are
    read in torch's order (the same KeyError for the same bad dict); extras missing from it
    keep ``ls``'s settings, with the hysteresis tracker full."""
    extras = {
        "hysteresis": state_dict.get("hysteresis", ls.hysteresis),
        "min_scale": state_dict.get("min_scale", ls.min_scale),
        "max_scale": state_dict.get("max_scale", ls.max_scale),
        "on_min_scale": state_dict.get("on_min_scale", ls.on_min_scale),
    }
    return {
        "scale": state_dict["scale"],
        "growth_factor": state_dict["growth_factor"],
        "backoff_factor": state_dict["backoff_factor"],
        "growth_interval": state_dict["growth_interval"],
        "growth_tracker": state_dict["_growth_tracker"],
        "hysteresis_tracker": state_dict.get("_hysteresis_tracker", extras["hysteresis"]),
        "rule": "torch",
        **extras,
    }


def _check_process_group(group: Any) -> Any:
    if group is None:
        return None
    dist = torch.distributed
    if not (dist.is_available() and isinstance(group, dist.ProcessGroup)):
        raise TypeError(
            "process_group must be a torch.distributed.ProcessGroup or None, got "
            f"{type(group).__name__}. Create the scaler after init_process_group() and pass e.g. "
            "torch.distributed.group.WORLD or a group from torch.distributed.new_group()."
        )
    return group


def _optimizer_params(optimizer: torch.optim.Optimizer) -> Iterable[torch.Tensor]:
    for group in optimizer.param_groups:
        for param in group["params"]:
            if not isinstance(param, torch.Tensor):
                raise AssertionError(f"expected param to be torch.Tensor, got {type(param).__name__}")
            yield param
