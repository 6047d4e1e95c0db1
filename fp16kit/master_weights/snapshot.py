"""The hyperparameters of a submitted step: the param groups as they were at submit time.

An asynchronous step runs on the optimizer thread after ``step()`` returned, when the main
thread may already have moved on: an LR scheduler's ``scheduler.step()`` right after
``opt.step()`` sets the *next* step's lr. So a job steps the wrapped optimizer over a
:func:`snapshot` of its param groups taken at submit (tensor values such as a scheduler's lr
tensor copied), through a :class:`StepView` -- a shallow copy of the optimizer object (same
state, same hooks) whose ``param_groups`` are the snapshot. Afterwards :func:`write_back`
copies what the step itself changed (D-Adaptation-style estimates, counters it sets on itself)
into the live groups and the live optimizer::

    submit:  groups = snapshot(optimizer.param_groups)        (main thread)
    job:     before = snapshot(groups)                        (optimizer thread)
             StepView(optimizer, groups).optimizer.step()
             write_back(before, groups, optimizer.param_groups)

An optimizer that cannot step a snapshot (``StepView.applies_to``: its groups are a property,
or its ``step`` was replaced on the object) steps its live groups, read when the job runs.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch

__all__ = ["StepView", "snapshot", "write_back"]


def snapshot(groups: list[dict[str, Any]], *, leave_out: Collection[int] = ()) -> list[dict[str, Any]]:
    """Return the param groups' values now, tensor values copied.

    Tensor values (an lr tensor, which LR schedulers update in place) are copied; the params lists stay shared
    -- or, when ``leave_out`` names params (by id), are copied without them (params frozen at submit time:
    unfrozen while the job runs, they belong to the next step)."""
    return [{k: _params(v, leave_out) if k == "params" else _frozen(v) for k, v in g.items()} for g in groups]


def _params(params: list[torch.Tensor], leave_out: Collection[int]) -> list[torch.Tensor]:
    if not leave_out:
        return params
    return [p for p in params if id(p) not in leave_out]


def _frozen(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, tuple) and any(isinstance(v, torch.Tensor) for v in value):
        return tuple(_frozen(v) for v in value)
    return value


class StepView:
    """The wrapped optimizer stepping a snapshot of its param groups (taken when the step was submitted).

    So the live groups stay the main thread's: an LR scheduler there already sets the next step's values. A
    shallow copy of the optimizer object (same state dict, same hooks); attributes the step sets on itself
    (counters) are written back afterwards."""

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
        """Can ``optimizer`` step a snapshot?

        Not when its groups are a property (they live elsewhere) or its ``step`` was replaced on the object
        (bound to it): those step with their live groups, read when the step runs."""
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


def write_back(before: list[dict[str, Any]], stepped: list[dict[str, Any]], live: list[dict[str, Any]]) -> None:
    """Write what a job changed in its snapshot of the param groups into the live groups.

    A new value, or new contents of a tensor value (copied into the live tensor)."""
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
