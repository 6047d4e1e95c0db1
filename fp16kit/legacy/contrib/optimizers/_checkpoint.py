"""Checkpoints of the fused-era FP16_Optimizer (docs/apex-others.md §1.5): checks and master layouts.

The checks, and the two master layouts apex wrote:

* per-param (2019-12+): ``fp32_groups`` = one list of fp32 tensors per group; the inner
  optimizer's state has one entry per param.
* flat (2018-12 to 2019-12): ``fp32_groups_flat`` = one 1-D fp32 tensor per group; the inner
  optimizer stepped that one tensor, so its state (``exp_avg``, ...) is flat too. Both are split
  by the sizes of the current params, in group order.

Every check runs before anything is changed; a mismatch names the group and the param.
"""

from __future__ import annotations

from typing import Any

import torch

from ....core import kernels
from ...checkpoints.errors import apex_object_refused
from ...loss_scaler import check_factor, check_scale

__all__ = [
    "check_state_dict",
    "check_unpickled_settings",
    "dynamic_settings",
    "masters_from_state",
    "optimizer_state_from",
]

_REQUIRED = ("dynamic_loss_scale", "cur_scale", "cur_iter", "optimizer_state_dict")


def check_state_dict(sd: Any, fp16_groups: list[list[torch.Tensor]]) -> None:
    """Raise ``TypeError``/``ValueError`` naming what does not match these param groups."""
    if not isinstance(sd, dict):
        raise TypeError(f"FP16_Optimizer.load_state_dict expects the dict from state_dict(), got {type(sd).__name__}.")
    missing = [k for k in _REQUIRED if k not in sd]
    if missing:
        raise ValueError(f"FP16_Optimizer state dict lacks {missing}; pass the dict FP16_Optimizer.state_dict() saved.")
    _check_counters(sd)
    if "fp32_groups" not in sd and "fp32_groups_flat" not in sd:
        raise ValueError(
            "FP16_Optimizer state dict holds no masters ('fp32_groups' or 'fp32_groups_flat'); "
            "a checkpoint saved by apex between 2019-12 and 2020-02 has none (its state_dict() "
            "failed): re-create the optimizer and load the model weights only."
        )
    masters = sd["fp32_groups"] if "fp32_groups" in sd else sd["fp32_groups_flat"]
    if len(masters) != len(fp16_groups):
        raise ValueError(
            f"The checkpoint has masters for {len(masters)} param groups; this optimizer has "
            f"{len(fp16_groups)}. Build the optimizer with the param groups it was saved with."
        )
    saved_groups = sd["optimizer_state_dict"].get("param_groups", [])
    if len(saved_groups) != len(fp16_groups):
        raise ValueError(
            f"The checkpoint's optimizer_state_dict has {len(saved_groups)} param groups; this "
            f"optimizer has {len(fp16_groups)}."
        )
    for i, (saved, params) in enumerate(zip(masters, fp16_groups)):
        if "fp32_groups" in sd:
            if len(saved) != len(params):
                raise ValueError(
                    f"Group {i} of the checkpoint has {len(saved)} masters; this optimizer's group "
                    f"{i} has {len(params)} params."
                )
            for j, (m, p) in enumerate(zip(saved, params)):
                if m.numel() != p.numel():
                    raise ValueError(
                        f"Group {i}, param {j}: the saved master has shape {tuple(m.shape)}, the "
                        f"param {tuple(p.shape)}."
                    )
        else:
            want = sum(p.numel() for p in params)
            if saved.numel() != want:
                raise ValueError(
                    f"Group {i}: the saved flat master has {saved.numel()} elements; this "
                    f"optimizer's group {i} params have {want} in all."
                )


def _number(value: Any) -> Any:
    """A Python number, or a one-element tensor's value (a checkpoint written by other code)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        return value.item()
    return value


def _check_counters(sd: dict[str, Any]) -> None:
    # a scale of 0 or nan trained every param into NaN; a fractional or negative count broke
    # the modulo growth rule
    scale = _number(sd["cur_scale"])
    try:
        check_scale("cur_scale", scale)  # (an int too large for a float, 10**400, raised OverflowError)
    except ValueError:
        raise ValueError(
            f"FP16_Optimizer state dict: cur_scale must be a finite number > 0, got {sd['cur_scale']!r}; "
            "pass the dict FP16_Optimizer.state_dict() saved."
        ) from None
    _whole(sd, "cur_iter", 0)
    if sd["dynamic_loss_scale"]:
        dynamic_settings(sd)


def _whole(sd: dict[str, Any], key: str, low: int) -> int:
    count = _number(sd[key])
    whole = isinstance(count, int) or (isinstance(count, float) and count.is_integer())
    if isinstance(count, bool) or not whole or count < low:
        raise ValueError(
            f"FP16_Optimizer state dict: {key} must be a whole number >= {low}, got {sd[key]!r}; "
            "pass the dict FP16_Optimizer.state_dict() saved."
        )
    return int(count)


def dynamic_settings(sd: dict[str, Any]) -> tuple[float, int, int]:
    """The dynamic-scale settings of a checkpoint as Python numbers, checked.

    ``(scale_factor, scale_window, last_overflow_iter)`` of a dynamic-scale checkpoint as
    Python numbers (apex's defaults 2.0, 1000, -1 where absent); ValueError for values the
    scale rule cannot use (a factor that is not a finite number > 1, a window < 1, ...)."""
    factor = _number(sd.get("scale_factor", 2.0))
    try:
        # apex divides the scale by it at an overflow and multiplies at a growth: <= 1 is no apex run's
        check_factor("scale_factor", factor)
    except ValueError as e:
        raise ValueError(
            f"FP16_Optimizer state dict: {e} No apex run saves another; pass the dict FP16_Optimizer.state_dict() "
            "saved."
        ) from None
    window = _whole({"scale_window": 1000, **sd}, "scale_window", 1)
    last = _whole({"last_overflow_iter": -1, **sd}, "last_overflow_iter", -1)
    return float(factor), window, last


def masters_from_state(
    sd: dict[str, Any], fp32_groups: list[list[torch.Tensor]]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(saved, master)`` pairs to copy, for either layout (a flat master is split by size)."""
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    for i, masters in enumerate(fp32_groups):
        if "fp32_groups" in sd:
            saved = [m.reshape(t.shape) for m, t in zip(sd["fp32_groups"][i], masters)]
        else:
            saved = kernels.flat_views(sd["fp32_groups_flat"][i].reshape(-1), masters)
        pairs.extend(zip(saved, masters))
    return pairs


def optimizer_state_from(sd: dict[str, Any], fp16_groups: list[list[torch.Tensor]]) -> dict[str, Any]:
    """The inner optimizer's state dict in the per-param layout.

    As saved, or (flat layout) each group's one flat state split into one state per
    current param."""
    osd = sd["optimizer_state_dict"]
    # apex's flat version stepped one flat master per group: its state is flat (even for a
    # group of one param, whose state then has the param's numel but not its shape)
    flat = "fp32_groups_flat" in sd and all(len(g["params"]) <= 1 for g in osd["param_groups"])
    if not flat:
        return osd
    state: dict[int, dict[str, Any]] = {}
    groups = []
    next_id = 0
    for g, params in zip(osd["param_groups"], fp16_groups):
        flat_state = osd["state"].get(g["params"][0], {}) if g["params"] else {}
        ids = list(range(next_id, next_id + len(params)))
        next_id += len(params)
        groups.append({**g, "params": ids})
        total = sum(p.numel() for p in params)
        for key, value in flat_state.items():
            if isinstance(value, torch.Tensor) and value.numel() == total and value.dim() == 1:
                parts = [v.clone() for v in kernels.flat_views(value, params)]
            else:
                parts = [value] * len(params)
            for pid, part in zip(ids, parts):
                state.setdefault(pid, {})[key] = part
    return {"state": state, "param_groups": groups}


def check_unpickled_settings(opt: torch.optim.Optimizer, state: dict[str, Any], settings: tuple[str, ...]) -> None:
    """Refuse, in ``__setstate__``, an optimizer apex pickled whole.

    That is what ``torch.load(..., weights_only=False)`` hands fp16kit's class under the apex
    alias: torch's pickling kept its
    param groups and state but not the settings the step reads, which nothing can recover (apex's
    own unpickled optimizer failed at its first step). torch's ``load_state_dict`` also goes
    through ``__setstate__``, on a built optimizer: left alone."""
    if "defaults" in opt.__dict__:
        return
    lost = [k for k in settings if k not in state]
    if lost:
        cls = type(opt)
        raise apex_object_refused(
            f"apex.contrib.optimizers.{cls.__name__}",
            "optimizer",
            f"torch's pickling of optimizers keeps their param groups and state only, so its settings "
            f"{lost} are not in the file",
        )
