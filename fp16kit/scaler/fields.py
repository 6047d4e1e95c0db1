"""torch's private ``GradScaler`` attributes (``_scale``, ``_growth_tracker``, ...) as views of a LossScale.

torch keeps the scale state in these attributes, and code in the wild (torch's own tests, FSDP's
``ShardedGradScaler``, checkpoint helpers) reads and writes them. :class:`fp16kit.GradScaler` keeps
the state in a :class:`~fp16kit.core.scale.LossScale` (``_loss_scale``) and declares each of torch's
names as a :class:`LossScaleField`, so both spellings stay in step. The one that answers per thread,
``_scale`` of a scaler bound to an optimizer thread, is :class:`fp16kit.scaler.binding.ScaleField`.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LossScaleField"]


class LossScaleField:
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
