"""``fp16kit.GradScaler``: a drop-in for ``torch.amp.GradScaler`` on fp16kit's core.

Used from one thread it is indistinguishable from torch's scaler: same constructor, methods,
return values, error types and texts, per-optimizer state machine, ``state_dict`` keys and
order, pickling rules and fused-optimizer protocol. It subclasses ``torch.amp.GradScaler`` so
``isinstance`` checks in other libraries keep passing, but overrides every method: all work
goes through :mod:`fp16kit.core.kernels` and :class:`fp16kit.core.scale.LossScale`.

The class reads like torch's: its methods keep torch's per-optimizer state machine and error
texts, and hand the rest to the modules beside it, one call each:

- :mod:`.binding` -- everything about optimizer threads (``self._threads``): routing ``step()``
  and ``unscale_()`` there, ``update()`` with its lag, the settings, the per-thread views of
  ``_scale`` and ``_per_optimizer_states``;
- :mod:`.stepping` -- what ``unscale_()``/``step()`` do with each kind of optimizer (torch's,
  master-weight, fused);
- :mod:`.checkpoint` -- state dicts, pickling and copies;
- :mod:`.skips` -- the process group the flags are reduced over, and the skip flag;
- :mod:`.fields` -- torch's private attributes as views of the LossScale.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from collections.abc import Iterable
from typing import Any, cast, overload

import torch
import torch.amp.grad_scaler as _torch_grad_scaler

from ..core import kernels
from ..core.interrupts import commit_methods
from ..core.protocol import Flags, scaled_iterations, speaks_master_protocol
from ..core.scale import FloorPolicy, LossScale
from ..core.thread import OptimizerThread
from . import checkpoint, skips, stepping
from .binding import ScaleField, StatesField, ThreadSide
from .fields import LossScaleField

__all__ = ["GradScaler", "OptState"]

# torch's own enum and per-optimizer factory: states compare equal to torch's, and code that
# inspects `scaler._per_optimizer_states` (torch's tests, FSDP's ShardedGradScaler) works.
OptState = _torch_grad_scaler.OptState
_refresh_per_optimizer_state = _torch_grad_scaler._refresh_per_optimizer_state


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
        # Built even when disabled (the extras are validated either way); no tensors until scale(), as torch's.
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
        self._process_group = skips.check_process_group(process_group)
        self._process_group_lost = False
        if self._enabled:
            self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)

    # -------------------------------------------------------------- torch's private fields (fp16kit.scaler.fields)
    _scale = ScaleField("scale")
    _growth_tracker = LossScaleField("growth_tracker")
    _init_scale = LossScaleField("init_scale")
    _init_growth_tracker = LossScaleField("init_growth_tracker")
    _growth_factor = LossScaleField("growth_factor")
    _backoff_factor = LossScaleField("backoff_factor")
    _growth_interval = LossScaleField("growth_interval")
    _per_optimizer_states = StatesField()  # bound: a step on the optimizer thread records into its iteration's
    _threads = ThreadSide()  # everything about optimizer threads: fp16kit.scaler.binding

    # -------------------------------------------------------------- the optimizer thread
    def bind(self, thread: OptimizerThread, *, step_of: Any = None) -> None:
        """Run this scaler's steps on ``thread`` (docs/async.md §4, mode 2).

        ``scale()`` and ``update()`` stay on the main thread, ``step()`` runs in the jobs there, each side seeing its own scale (see
        :mod:`fp16kit.scaler.binding`). ``opt.submit_step(fn, scaler=scaler)`` calls this with ``step_of=opt``
        before it hands anything off: a second submitted step of ``opt`` with no ``update()`` since its last
        one raises RuntimeError. Before the first ``scale()`` the binding is made there. Binding to the same
        thread again does nothing; to another raises RuntimeError -- unless the bound thread was shut down:
        then the scaler moves to the new one."""
        self._threads.bind_explicitly(thread, self._loss_scale, step_of=step_of)

    # -------------------------------------------------------------- scale
    def _check_scale_growth_tracker(self, funcname: str) -> tuple[torch.Tensor, torch.Tensor]:
        fix = "This may indicate your script did not use scaler.scale(loss or outputs) earlier in the iteration."
        scale, growth_tracker = self._scale, self._growth_tracker  # (each read is a descriptor chain: once)
        if scale is None:
            raise AssertionError(f"Attempted {funcname} but _scale is None.  " + fix)
        if growth_tracker is None:
            raise AssertionError(f"Attempted {funcname} but _growth_tracker is None.  " + fix)
        return (scale, growth_tracker)

    def _lazy_init_scale_growth_tracker(self, dev: torch.device) -> None:
        if self._growth_tracker is not None:
            raise AssertionError("_growth_tracker initialized before _scale")
        self._loss_scale.materialize(dev)

    def _scale_on(self, device: torch.device) -> torch.Tensor:
        scale = self._scale
        if scale is None:
            self._lazy_init_scale_growth_tracker(device)
            scale = self._scale
        assert scale is not None
        return scale

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
        self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool
    ) -> Flags:
        return stepping.unscale_grads(optimizer, inv_scale, found_inf, allow_fp16)

    def _reduce_found_inf(self, found_inf_per_device: Flags) -> Flags:
        """With a process group: one flag, max-reduced over the ranks, on the scale's device.
        (Also when this rank holds no grads for the optimizer: it must join the collective.)"""
        if self._process_group is None:
            return found_inf_per_device
        scale, _ = self._check_scale_growth_tracker("_reduce_found_inf")
        return kernels.all_reduce_found_inf(found_inf_per_device, scale.device, self._process_group)

    def set_process_group(self, process_group: Any) -> None:
        """Set (or, with None, remove) the group over which ``found_inf`` is all-reduced.

        E.g. after unpickling a scaler that had one."""
        self._process_group = skips.check_process_group(process_group)
        self._process_group_lost = False

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide ("unscale") the optimizer's gradients by the scale factor, in place.

        Records whether any is inf/NaN. Optional: :meth:`step` unscales if you have not. Call it at most once
        per optimizer per iteration, after all grads are accumulated. No host sync."""
        if not self._enabled:
            return
        if self._threads.route(self._loss_scale, self.unscale_, optimizer):
            return

        scale, _ = self._check_scale_growth_tracker("unscale_")
        skips.require_process_group(self)

        optimizer_state = self._per_optimizer_states[id(optimizer)]

        if optimizer_state["stage"] is OptState.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        elif optimizer_state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")

        inv_scale = kernels.inv_scale(scale)
        found_inf = kernels.new_found_inf(scale.device)

        # Recorded before the all-reduce: a failing collective must not leave the grads to be unscaled twice.
        optimizer_state["found_inf_per_device"] = self._unscale_grads_(optimizer, inv_scale, found_inf, False)
        optimizer_state["stage"] = OptState.UNSCALED
        optimizer_state["found_inf_per_device"] = self._reduce_found_inf(optimizer_state["found_inf_per_device"])

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        _scale, _ = self._check_scale_growth_tracker("_check_inf_per_device")
        skips.require_process_group(self)
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
        self, optimizer: torch.optim.Optimizer, optimizer_state: dict[str, Any], *args: Any, **kwargs: Any
    ) -> float | None:
        return stepping.step_unless_found_inf(optimizer, optimizer_state, args, kwargs)

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

        if speaks_master_protocol(optimizer) and optimizer.submits_steps():
            # MixedPrecisionOptimizer(async_step=True): the step goes to the optimizer thread. No sync.
            stepping.submit_master_step(self, optimizer, optimizer_state)
            return None

        if getattr(optimizer, "_step_supports_amp_scaling", False):
            # The optimizer handles scaling itself (torch's fused optimizers' protocol).
            return stepping.fused_step(self, optimizer, optimizer_state, args, kwargs)

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
        if self._threads.update(
            self._loss_scale,
            new_scale,
            is_async=is_async,
            has_checks=lambda: bool(skips.recorded_flags(self._per_optimizer_states)),
            check_new_scale=lambda new: _check_new_scale(new, self._device),
        ):
            scaled_iterations.closed(self)  # bound: the binding updated
            return

        _scale, _growth_tracker = self._check_scale_growth_tracker("update")

        if new_scale is not None:
            # Accept a new user-defined scale (copied, not aliased).
            _check_new_scale(new_scale, self._device)
            self._loss_scale.set_scale(new_scale)
        else:
            # Consume the inf/nan flags the optimizers recorded this iteration.
            found_infs = skips.recorded_flags(self._per_optimizer_states)

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

    # Bound to an optimizer thread, get_*(up_to_date=True) waits for the queued work; set_* is queued.
    def get_growth_factor(self, *, up_to_date: bool = False) -> float:
        r"""Return a Python float containing the scale growth factor."""
        return self._threads.read(getattr, self, "_growth_factor", up_to_date=up_to_date)

    def set_growth_factor(self, new_factor: float) -> None:
        r"""Set a new scale growth factor."""
        self._threads.apply(setattr, self, "_growth_factor", new_factor)

    def get_backoff_factor(self, *, up_to_date: bool = False) -> float:
        r"""Return a Python float containing the scale backoff factor."""
        return self._threads.read(getattr, self, "_backoff_factor", up_to_date=up_to_date)

    def set_backoff_factor(self, new_factor: float) -> None:
        r"""Set a new scale backoff factor."""
        self._threads.apply(setattr, self, "_backoff_factor", new_factor)

    def get_growth_interval(self, *, up_to_date: bool = False) -> int:
        r"""Return a Python int containing the growth interval."""
        return self._threads.read(getattr, self, "_growth_interval", up_to_date=up_to_date)

    def set_growth_interval(self, new_interval: int) -> None:
        r"""Set a new growth interval."""
        self._threads.apply(setattr, self, "_growth_interval", new_interval)

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
            return skips.last_step_skipped(self._per_optimizer_states, self._loss_scale, self._scale)
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
        return checkpoint.state_dict(self) if self._enabled else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        r"""Load the scaler state (from this class or from ``torch.amp.GradScaler``).

        A no-op when disabled. Extras missing from the dict keep their current settings, with the hysteresis
        tracker full."""
        if self._enabled:
            checkpoint.load_state_dict(self, state_dict)

    def _recovered_from_interrupt(self) -> None:
        # A second Ctrl-C broke a call off (fp16kit.core.interrupts): start the next iteration afresh.
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
        scaled_iterations.closed(self)

    # pickling and copies: torch's rule, and a copy starts unbound (fp16kit.scaler.checkpoint)
    __getstate__ = checkpoint.pickled_state
    __copy__ = checkpoint.copy_of
    __deepcopy__ = checkpoint.deepcopy_of

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
