"""What the framework adapters share."""

from __future__ import annotations

from typing import Any

from ..master_weights.optimizer import MixedPrecisionOptimizer

__all__ = ["find_master_optimizer"]


def find_master_optimizer(optimizer: Any) -> MixedPrecisionOptimizer | None:
    """The :class:`fp16kit.MixedPrecisionOptimizer` under a framework's optimizer wrappers, or None.

    The :class:`fp16kit.MixedPrecisionOptimizer` under a framework's optimizer wrappers
    (Accelerate's ``AcceleratedOptimizer``, Lightning's ``LightningOptimizer``: each keeps the
    wrapped one as ``.optimizer``), or None when there is none."""
    seen: set[int] = set()
    while optimizer is not None and not isinstance(optimizer, MixedPrecisionOptimizer) and id(optimizer) not in seen:
        seen.add(id(optimizer))
        optimizer = getattr(optimizer, "optimizer", None)
    return optimizer if isinstance(optimizer, MixedPrecisionOptimizer) else None
