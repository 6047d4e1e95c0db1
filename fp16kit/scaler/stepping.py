"""What GradScaler's ``unscale_()`` and ``step()`` do with each kind of optimizer.

:meth:`fp16kit.GradScaler.step` keeps torch's per-optimizer state machine (READY / UNSCALED /
STEPPED) and hands the optimizer-specific parts to these functions:

- a torch optimizer: its ``param.grad`` are unscaled in place by :mod:`fp16kit.core.kernels`
  (:func:`unscale_grads`), then ``optimizer.step()`` runs unless a flag is set
  (:func:`step_unless_found_inf`);
- a master-weight optimizer (:mod:`fp16kit.core.protocol`): the grads are unscaled into its fp32
  masters (:func:`unscale_grads`), and with ``async_step=True`` the whole step is submitted to
  the optimizer thread with its flags kept on the device (:func:`submit_master_step`);
- an optimizer with ``_step_supports_amp_scaling`` (torch's fused Adam/AdamW/SGD): torch's
  protocol, the optimizer unscales and skips inside its own kernel (:func:`fused_step`).

Each function takes the scaler and does what its method would, through the scaler's own hooks
(``_check_inf_per_device``, ``_get_scale_async``, ``_reduce_found_inf``), so a subclass that
overrides one of those sees it called as from torch's ``step()``.
"""

from __future__ import annotations

import inspect
import warnings
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.amp.grad_scaler import OptState

from ..core import kernels
from ..core.protocol import Flags, speaks_master_protocol
from . import skips

__all__ = [
    "FP16_GRADS",
    "FP16_GRADS_HINT",
    "fused_step",
    "step_unless_found_inf",
    "submit_master_step",
    "unscale_grads",
]

# torch's text (kept, so code matching it still works), then the fix fp16kit offers
FP16_GRADS = "Attempting to unscale FP16 gradients."
FP16_GRADS_HINT = (
    " fp16kit: an fp16 model trains through fp32 master weights with "
    "fp16kit.MixedPrecisionOptimizer(optimizer) -- wrap the optimizer in it and pass that to "
    "scaler.step(); or keep the model in float32 and use torch.autocast."
)


def unscale_grads(
    optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool
) -> Flags:
    """``GradScaler._unscale_grads_``: unscale the optimizer's grads, recording inf/NaN in ``found_inf``.

    A master-weight optimizer (MixedPrecisionOptimizer: fp16 model grads -> fp32 master grads)
    unscales into its masters (fp16kit.core.protocol)."""
    if speaks_master_protocol(optimizer):
        check = getattr(optimizer, "check_grads_", None)
        if allow_fp16 and check is not None:  # torch's check before a fused step (_check_inf_per_device)
            return check(inv_scale, found_inf)
        return optimizer.unscale_grads_(inv_scale, found_inf)
    try:
        return kernels.unscale_grads_(_optimizer_params(optimizer), inv_scale, found_inf, allow_fp16=allow_fp16)
    except ValueError as e:  # raised before any grad changed: name the fix
        if str(e) != FP16_GRADS:
            raise
        raise ValueError(f"{FP16_GRADS}{FP16_GRADS_HINT}") from None


def step_unless_found_inf(
    optimizer: torch.optim.Optimizer, optimizer_state: dict[str, Any], args: Any, kwargs: dict[str, Any]
) -> float | None:
    """``GradScaler._maybe_opt_step``: ``optimizer.step(*args, **kwargs)`` unless a recorded flag is set.

    The skip decision needs the flag on the host: the one sync of a non-fused step (fused
    optimizers take found_inf on the device instead; see :func:`fused_step`)."""
    retval: float | None = None
    if not sum(v.item() for v in optimizer_state["found_inf_per_device"].values()):
        if speaks_master_protocol(optimizer):
            optimizer.skip_decided()  # it need not read the flags again
        retval = optimizer.step(*args, **kwargs)
    return retval


def submit_master_step(scaler: Any, optimizer: Any, optimizer_state: dict[str, Any]) -> None:
    """``scaler.step(opt)`` of a MixedPrecisionOptimizer(async_step=True).

    It checks the grads on their device, hands them to the optimizer thread and returns this
    step's flags; update() uses them on the device, so the next scale() sees this step's
    overflow. No sync."""
    skips.require_process_group(scaler)
    unscaled = optimizer_state["stage"] is OptState.UNSCALED
    optimizer_state["found_inf_per_device"] = optimizer.submit_scaled_step(
        scaler._scale,
        unscaled_flags=optimizer_state["found_inf_per_device"] if unscaled else None,
        reduce=scaler._reduce_found_inf,
    )
    optimizer_state["stage"] = OptState.STEPPED


def fused_step(
    scaler: Any, optimizer: torch.optim.Optimizer, optimizer_state: dict[str, Any], args: Any, kwargs: dict[str, Any]
) -> float | None:
    """``scaler.step(optimizer, *args, **kwargs)`` of an optimizer with ``_step_supports_amp_scaling``.

    The optimizer handles scaling itself. Old protocol: it takes a `grad_scaler` keyword
    (deprecated by torch, with this FutureWarning). New protocol: it reads `grad_scale` and
    `found_inf` attributes and skips/unscales inside its kernel."""
    kwargs_ = kwargs
    has_grad_scaler_kwarg = _takes_grad_scaler(optimizer.step)
    if has_grad_scaler_kwarg:
        warnings.warn(
            "GradScaler is going to stop passing itself as a keyword argument to the passed "
            "optimizer. In the near future GradScaler registers `grad_scale: Tensor` and "
            "`found_inf: Tensor` to the passed optimizer and let the optimizer use them directly.",
            FutureWarning,
            stacklevel=4,  # the caller of scaler.step, past step() and the commit wrapper
        )
        kwargs_.update({"grad_scaler": scaler})
    else:
        if optimizer_state["stage"] is OptState.READY:
            scaler._check_inf_per_device(optimizer)
        scale = scaler._get_scale_async()
        if scale is None:
            raise AssertionError("_get_scale_async returned None")
        flags = list(optimizer_state["found_inf_per_device"].values())
        # No flags (no grads were checked): torch passes sum([]), the int 0. A fused
        # step with no grads ignores it; one with grads the check never saw fails.
        found_inf = kernels.combine_found_inf(flags, scale.device) if flags else 0
        # Product of the scales, if the user preset `optimizer.grad_scale`.
        optimizer.grad_scale = (  # type: ignore[attr-defined]
            getattr(optimizer, "grad_scale", None)
            if optimizer_state["stage"] == OptState.UNSCALED
            else scale * getattr(optimizer, "grad_scale", 1)
        )
        optimizer.found_inf = found_inf  # type: ignore[attr-defined]
    retval = optimizer.step(*args, **kwargs_)
    optimizer_state["stage"] = OptState.STEPPED
    if not has_grad_scaler_kwarg:
        del optimizer.grad_scale  # type: ignore[attr-defined]
        del optimizer.found_inf  # type: ignore[attr-defined]
    return retval


_GRAD_SCALER_KWARG: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def _takes_grad_scaler(step: Any) -> bool:
    """Does ``step`` take torch's old ``grad_scaler`` keyword? (``inspect.signature`` once per function.)

    torch's ``step()`` inspects the signature at every step (some 20 us); the answer is the function's, so it is
    kept per function (a bound method's ``__func__``; weakly, so a function can be freed)."""
    fn = getattr(step, "__func__", step)
    try:
        return _GRAD_SCALER_KWARG[fn]
    except (KeyError, TypeError):
        pass
    found = "grad_scaler" in inspect.signature(step).parameters
    try:
        _GRAD_SCALER_KWARG[fn] = found
    except TypeError:  # not weakly referenceable (a C function, a callable object): ask again next time
        pass
    return found


def _optimizer_params(optimizer: torch.optim.Optimizer) -> Iterable[torch.Tensor]:
    for group in optimizer.param_groups:
        for param in group["params"]:
            if not isinstance(param, torch.Tensor):
                raise AssertionError(f"expected param to be torch.Tensor, got {type(param).__name__}")
            yield param
