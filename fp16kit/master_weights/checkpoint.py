"""Checkpoint validation and master matching, shared by both faces.

Everything is checked before anything changes, and a mismatch names the group and the index:

* :func:`validate_optimizer_groups` -- a saved torch optimizer state dict against the live
  optimizer: group count, params per group, and the shapes of the per-param state tensors
  torch's optimizers keep (momentum, Adam's moments...), so a checkpoint of another model fails
  here, not deep in torch at the next step.
* :func:`match_saved_masters` -- saved masters (a list per group) against the masters and
  params they restore, across the modes that give fp32 params masters or not.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ..core.master import LOW_PRECISION
from .groups import MasterGroup

__all__ = ["MatchedMasters", "check_state_dict", "match_saved_masters", "validate_optimizer_groups"]

STATE_KEYS = ("optimizer", "masters")

# State entries torch's optimizers keep with the shape of their param, or (Adafactor's factored
# second moments) a shape made from it; others (Adam's step...) are not compared.
PARAM_SHAPED_STATE = frozenset(
    {
        "momentum_buffer",
        "exp_avg",
        "exp_avg_sq",
        "max_exp_avg_sq",
        "square_avg",
        "grad_avg",
        "acc_delta",
        "sum",
        "ax",
        "prev",
        "step_size",
        "exp_inf",
        "variance",
    }
)


def _state_shape(name: str, shape: torch.Size) -> tuple[int, ...] | None:
    if name in PARAM_SHAPED_STATE:
        return tuple(shape)
    if name in ("row_var", "col_var") and len(shape) >= 2:  # torch.optim.Adafactor
        dim = -1 if name == "row_var" else -2
        factored = list(shape)
        factored[dim] = 1
        return tuple(factored)
    return None


def validate_optimizer_groups(saved: Any, optimizer: torch.optim.Optimizer) -> None:
    """Check a saved torch optimizer state dict against the live optimizer's param groups.

    torch's own check does not say which group differs. Raises ValueError; changes nothing."""
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    if not isinstance(groups, list) or "state" not in saved:
        raise ValueError(
            "The saved optimizer state is not a torch optimizer state dict (no 'state' and "
            "'param_groups'): pass the dict from state_dict()."
        )
    live = optimizer.param_groups
    if len(groups) != len(live):
        raise ValueError(
            f"The checkpoint has {len(groups)} param groups, this optimizer has {len(live)}: it "
            "was written for a different optimizer layout."
        )
    for gi, (s, g) in enumerate(zip(groups, live)):
        n = len(s.get("params", ())) if isinstance(s, dict) else -1
        if n != len(g["params"]):
            raise ValueError(
                f"Param group {gi}: the checkpoint has {n} params, this optimizer has {len(g['params'])} in that group."
            )
    state = saved["state"] if isinstance(saved["state"], dict) else {}
    for gi, (s, g) in enumerate(zip(groups, live)):
        for i, (key, param) in enumerate(zip(s["params"], g["params"])):
            entry = state.get(key)
            if not isinstance(entry, dict):
                continue
            for name, value in entry.items():
                expected = _state_shape(name, param.shape)
                if expected is not None and isinstance(value, torch.Tensor) and value.shape != expected:
                    raise ValueError(
                        f"Param group {gi}, param {i}: the checkpoint's optimizer state "
                        f"{name!r} has shape {tuple(value.shape)}, the param has shape "
                        f"{tuple(param.shape)}: it was written for a different model."
                    )


class MatchedMasters(NamedTuple):
    """Saved masters matched to what they restore.

    ``(source, target)`` copies to make now, and ones to make at the next step (values that come from, or go
    into, the model)."""

    now: list[tuple[torch.Tensor, torch.Tensor]]
    deferred: list[tuple[torch.Tensor, torch.Tensor]]


def match_saved_masters(saved: Any, groups: list[MasterGroup], param_groups: list[dict[str, Any]]) -> MatchedMasters:
    """Match saved masters (a list per group) to what they restore.

    Checks counts and shapes first; raises ValueError naming the group; changes nothing.

    A checkpoint written with and one written without ``async_step``/``master_device`` differ
    in the fp32 params: with them every trainable param has a master (saved in group order),
    without them only the fp16/bf16 params do and the fp32 params are stepped in place. Both
    load either way: saved without, the fp32 params' masters come from the model params;
    saved with, the fp32 masters go into the fp32 params. Those copies wait until the
    optimizer is next used (a step, ``state_dict()``, ``synchronize()``...), so the model may
    be loaded before or after the optimizer -- but before that next use. (Saved masters map
    to the params that are trainable now: change no ``requires_grad`` between saving and
    loading.)"""
    if not isinstance(saved, (list, tuple)) or len(saved) != len(groups):
        n = len(saved) if isinstance(saved, (list, tuple)) else type(saved).__name__
        raise ValueError(
            f"Saved masters have {n} param groups, this optimizer has {len(groups)}: the "
            "checkpoint was written for a different optimizer layout."
        )
    now: list[tuple[torch.Tensor, torch.Tensor]] = []
    deferred: list[tuple[torch.Tensor, torch.Tensor]] = []
    for gi, (s, g, pg) in enumerate(zip(saved, groups, param_groups)):
        if not isinstance(s, (list, tuple)):
            raise ValueError(f"Param group {gi}: expected a list of master tensors, got {type(s).__name__}.")
        low = [m for m, p in zip(g.masters, g.model_params) if p.dtype in LOW_PRECISION]
        trainable = [p for p in pg["params"] if p.requires_grad]
        later: list[tuple[Any, torch.Tensor]] = []
        if len(s) == len(g.masters):
            targets = list(zip(s, g.masters))
        elif len(s) == len(low) < len(g.masters):  # saved without masters for fp32 params
            targets = list(zip(s, low))
            later = [(p, m) for m, p in zip(g.masters, g.model_params) if p.dtype not in LOW_PRECISION]
        elif len(s) == len(trainable) > len(g.masters):  # saved with them; stepped in place here
            mastered = {id(m) for m in g.masters}
            targets = [(t, p) for t, p in zip(s, trainable) if id(p) in mastered]
            later = [(t, p) for t, p in zip(s, trainable) if id(p) not in mastered]
        else:
            raise ValueError(
                f"Param group {gi}: the checkpoint has {len(s)} master tensors, this optimizer has "
                f"{len(g.masters)} masters ({len(low)} fp16/bf16 params, {len(trainable)} trainable "
                "params) in that group: it was written for a different model or param groups -- "
                "or params were frozen or unfrozen since it was saved (freeze the same params "
                "before loading)."
            )
        for i, (t, target) in enumerate(targets + later):
            if not isinstance(t, torch.Tensor) or t.shape != target.shape:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(
                    f"Param group {gi}, master {i}: the checkpoint has shape {got}, the "
                    f"param has shape {tuple(target.shape)}."
                )
        now.extend(targets)
        deferred.extend(later)
    return MatchedMasters(now, deferred)


def check_state_dict(state_dict: Any, optimizer: torch.optim.Optimizer, groups: list[MasterGroup]) -> MatchedMasters:
    """Check a ``MixedPrecisionOptimizer.state_dict()`` against the live optimizer; return the matched masters.

    Checks the keys, the wrapped optimizer's groups and state shapes, the masters. Raises ValueError naming
    what differs; changes nothing."""
    if not isinstance(state_dict, dict) or set(state_dict) != set(STATE_KEYS):
        got = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
        raise ValueError(
            f"MixedPrecisionOptimizer.load_state_dict expects the keys {list(STATE_KEYS)} "
            f"(from MixedPrecisionOptimizer.state_dict()), got {got}."
        )
    validate_optimizer_groups(state_dict["optimizer"], optimizer)
    return match_saved_masters(state_dict["masters"], groups, optimizer.param_groups)
