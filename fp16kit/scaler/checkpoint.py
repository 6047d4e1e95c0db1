"""A GradScaler's checkpoints and copies: its state dict, loading one, pickling and ``copy``.

The work behind :meth:`fp16kit.GradScaler.state_dict`, ``load_state_dict``, ``__getstate__``,
``__copy__`` and ``__deepcopy__``, which delegate here: each function takes the scaler and does
what the method would, reading the scaler's fields as its methods do. The state dict is plain
data (docs/architecture.md §5): torch's five keys in torch's order, then the extras when one is
not at its default (:func:`extras_state`; torch's ``load_state_dict`` ignores them), then a saved
lag of steps on an optimizer thread (``"next_scale"``, :meth:`ScalerThreads.saved`). A pickled
or copied scaler starts unbound, from the scale a state dict would save, with the lag carried
over (:meth:`ScalerThreads.pickled`); a process group cannot cross processes.
"""

from __future__ import annotations

import copy
from typing import Any

from ..core.scale import LossScale

__all__ = [
    "copy_of",
    "deepcopy_of",
    "extras_state",
    "load_state_dict",
    "loss_scale_state",
    "pickled_state",
    "state_dict",
]


def state_dict(scaler: Any) -> dict[str, Any]:
    """``scaler.state_dict()`` of an enabled scaler (after the queued work of a bound one)."""
    threads = scaler._threads
    threads.synchronize()
    scale, lag = threads.saved(scaler._loss_scale, scaler.get_scale())
    state = {
        "scale": scale,
        "growth_factor": scaler._growth_factor,
        "backoff_factor": scaler._backoff_factor,
        "growth_interval": scaler._growth_interval,
        "_growth_tracker": scaler._get_growth_tracker(),
    }
    state.update(extras_state(scaler._loss_scale))
    state.update(lag)
    return state


def load_state_dict(scaler: Any, state_dict: dict[str, Any]) -> None:
    """``scaler.load_state_dict(state_dict)`` of an enabled scaler.

    Everything is checked before anything changes (:meth:`LossScale.load_state_dict`)."""
    if len(state_dict) == 0:
        raise RuntimeError(
            "The source state dict is empty, possibly because it was saved from a disabled instance of GradScaler."
        )
    ls = scaler._loss_scale
    scaler._threads.load(ls, state_dict, lambda: ls.load_state_dict(loss_scale_state(state_dict, ls)))


def pickled_state(scaler: Any) -> dict[str, Any]:
    """``scaler.__getstate__()``: torch's rule (only between iterations), host values only, no process group."""
    threads = scaler._threads
    threads.synchronize()
    state = scaler.__dict__.copy()
    if scaler._enabled and (len(scaler._per_optimizer_states) != 0 or threads.mid_iteration()):
        # (bound: a step recorded on the thread counts too)
        raise AssertionError(
            "A GradScaler instance may only be pickled at the beginning "
            "of an iteration, or at the end after scaler.update()."
        )
    # A copy of the LossScale holding host values only: it re-creates its tensors lazily,
    # as torch's scaler does with _scale and _growth_tracker, so copies (copy.copy
    # included) never share scale tensors. A process group cannot cross processes: the
    # unpickled scaler has none until one is assigned.
    state["_loss_scale"] = copy.copy(scaler._loss_scale)
    # A copy starts unbound; in the lag of steps on a thread it resumes it as a state dict does.
    scale = threads.pickled(state, scaler._loss_scale, scaler.get_scale() if scaler._enabled else None)
    if scale is not None:
        state["_loss_scale"].init_scale = scale
    if "_disabled_fields" in state:
        state["_disabled_fields"] = dict(state["_disabled_fields"])
    if state.get("_process_group") is not None:
        state["_process_group"] = None
        state["_process_group_lost"] = True
    return state


def copy_of(scaler: Any) -> Any:
    """``copy.copy(scaler)``: a new scaler from its pickled state, keeping the process group."""
    return _copied(scaler, scaler.__getstate__())


def deepcopy_of(scaler: Any, memo: dict[int, Any]) -> Any:
    """``copy.deepcopy(scaler)``: as :func:`copy_of`, from a deep copy of the pickled state."""
    return _copied(scaler, copy.deepcopy(scaler.__getstate__(), memo))


def _copied(scaler: Any, state: dict[str, Any]) -> Any:
    # In the same process a copy keeps the process group (only a pickle cannot carry it).
    cls: Any = type(scaler)
    new = cls.__new__(cls)
    new.__setstate__(state)
    new._process_group = scaler._process_group
    new._process_group_lost = scaler.__dict__.get("_process_group_lost", False)
    return new


def extras_state(ls: LossScale) -> dict[str, Any]:
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


def loss_scale_state(state_dict: dict[str, Any], ls: LossScale) -> dict[str, Any]:
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
