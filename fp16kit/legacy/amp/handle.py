"""apex.amp.handle: ``scale_loss`` (spec/amp.md §6) and ``disable_casts``.

The overflow check and the scale update run on the device at every non-delayed exit; the
skip is applied (and apex's line logged) when ``optimizer.step()`` runs, which reads the
flags once. ``delay_overflow_check=True`` still checks (FIX: apex applied overflowed grads).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from ...core import kernels
from ._amp_state import _amp_state

__all__ = ["scale_loss", "disable_casts"]

_NOT_INITIALIZED = (
    "Invoked 'with amp.scale_loss`, but internal Amp state has not been initialized.  "
    "model, optimizer = amp.initialize(model, optimizer, opt_level=...) must be called "
    "before `with amp.scale_loss`."
)


def _clear_cache(properties: Any) -> None:
    if properties.patch_torch_functions:
        from . import casts

        casts.clear_cache()


@contextlib.contextmanager
def scale_loss(
    loss: torch.Tensor,
    optimizers: Any,
    loss_id: int = 0,
    model: Any = None,
    delay_unscale: bool = False,
    delay_overflow_check: bool = False,
) -> Iterator[torch.Tensor]:
    """Yield ``loss.float() * S``; on exit unscale this backward's grads into what the
    optimizers step (the masters at O2) and update the scale (see the module docstring)."""
    properties = getattr(_amp_state, "opt_properties", None)
    if properties is None:
        raise RuntimeError(_NOT_INITIALIZED)
    if not properties.enabled:
        yield loss
        return
    if isinstance(optimizers, torch.optim.Optimizer) or type(optimizers).__name__ == "LARC":
        optimizers = [optimizers]
    optimizers = list(optimizers)  # FIX: a tuple is prepared too
    scaler = _amp_state.loss_scalers[loss_id]
    if not properties.master_weights and scaler.is_static_one():
        try:
            yield loss.float()
        finally:
            _clear_cache(properties)
        return
    if not delay_unscale:
        for opt in optimizers:
            if not opt._amp_stash.params_have_scaled_gradients:
                opt._prepare_amp_backward()
    try:
        yield kernels.scale_outputs(loss.float(), scaler.scale_on)
        if delay_unscale:
            for opt in optimizers:
                opt._amp_stash.params_have_scaled_gradients = True
            return
        scaler.clear_overflow_state()
        for opt in optimizers:
            opt._post_amp_backward(scaler)
            opt._amp_stash.params_have_scaled_gradients = False
        found = scaler.update_async()
        if found is not None:
            for opt in optimizers:
                opt._amp_stash.pending.append((loss_id, scaler, found))
    finally:
        _clear_cache(properties)


def disable_casts() -> Any:
    """O1's casts off for the block (exception-safe); a no-op context at other levels (FIX:
    apex raised AttributeError without O1)."""
    properties = getattr(_amp_state, "opt_properties", None)
    if properties is not None and properties.patch_torch_functions:
        from . import casts

        return casts.disable_casts()
    return contextlib.nullcontext()
