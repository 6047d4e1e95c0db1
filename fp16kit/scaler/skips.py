"""A GradScaler's skipped steps: ``found_inf`` over the ranks of a process group, and the skip flag.

With ``process_group`` set, every optimizer's flags are max-reduced over the group before the
skip decision and the update (the scaler's ``_reduce_found_inf``), so ranks holding different
shards of the gradients skip together (:func:`check_process_group` checks the group); a pickled
copy, which cannot carry the group, refuses to check grads until one is set again
(:func:`require_process_group`). :func:`recorded_flags` are an iteration's flags, and
:func:`last_step_skipped` is the device flag behind ``last_step_skipped_tensor()``.
"""

from __future__ import annotations

from typing import Any

import torch

from ..core import kernels
from ..core.scale import LossScale

__all__ = ["check_process_group", "last_step_skipped", "recorded_flags", "require_process_group"]


def check_process_group(group: Any) -> Any:
    """``group`` if it is a ``torch.distributed.ProcessGroup`` or None; else TypeError, naming the fix."""
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


def require_process_group(scaler: Any) -> None:
    """Refuse to check grads on an unpickled scaler whose process group was dropped (RuntimeError)."""
    if scaler.__dict__.get("_process_group_lost", False):  # (absent from older pickles)
        raise RuntimeError(
            "This GradScaler was built with a process_group, which cannot be pickled: the "
            "copy has none, and its ranks could skip different steps. Call "
            "scaler.set_process_group(group) after loading it (None: no all-reduce)."
        )


def recorded_flags(states: dict[int, dict[str, Any]]) -> list[torch.Tensor]:
    """The found_inf flags of every optimizer in ``states`` (torch's per-optimizer states), per device."""
    return [found_inf for state in states.values() for found_inf in state["found_inf_per_device"].values()]


def last_step_skipped(states: dict[int, dict[str, Any]], loss_scale: LossScale, scale: torch.Tensor) -> torch.Tensor:
    """This iteration's flags combined, once an optimizer's grads were checked; else the last update's.

    ``False`` before the first update. A 0-dim bool tensor on the scale's device; no sync."""
    found = recorded_flags(states)
    if found:
        return kernels.combine_found_inf(found, scale.device) != 0
    last = loss_scale.last_found_inf()  # a new tensor
    if last is not None:
        return last
    return torch.zeros((), dtype=torch.bool, device=scale.device)
