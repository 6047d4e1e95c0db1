"""fp16kit.legacy.amp: apex's ``apex.amp`` on fp16kit's core (docs/apex-amp.md).

Change ``from apex import amp`` to ``from fp16kit.legacy import amp``::

    model, optimizer = amp.initialize(model, optimizer, opt_level="O2")
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), 1.0)
    optimizer.step()
    checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "amp": amp.state_dict()}

O0 (fp32), O2 (fp16 model with fp32 BatchNorm and fp32 master weights in the optimizer),
O3 (pure fp16) run here; O1 casts through ``torch.autocast`` in :mod:`.casts`. No tensor math
lives in this package: it runs in :mod:`fp16kit.core`.
"""

from __future__ import annotations

from typing import Any

from . import lists  # noqa: F401 - apex.amp.lists: scripts edit them before amp.initialize
from ._amp_state import _amp_state, master_params
from .frontend import initialize, load_state_dict, state_dict
from .handle import disable_casts as _disable_casts_fallback
from .handle import init, scale_loss

_FROM_CASTS = (
    "half_function",
    "float_function",
    "promote_function",
    "register_half_function",
    "register_float_function",
    "register_promote_function",
)

__all__ = [
    "initialize",
    "scale_loss",
    "disable_casts",
    "state_dict",
    "load_state_dict",
    "master_params",
    "init",
    *_FROM_CASTS,
    "_amp_state",
]


def disable_casts() -> Any:
    """O1's casts off for the block (exception-safe); a no-op context at other levels."""
    return _disable_casts_fallback()


def __getattr__(name: str) -> Any:
    if name in _FROM_CASTS:
        try:
            from . import casts
        except ImportError as e:
            raise NotImplementedError(
                f"amp.{name} needs fp16kit.legacy.amp.casts (O1 casting), not available in this build ({e})."
            ) from None
        return getattr(casts, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
