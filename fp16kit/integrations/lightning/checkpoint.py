"""Lightning checkpoints that ``MasterWeightsPrecision`` did not write, made loadable.

Called from the plugin's ``on_load_checkpoint``, which Lightning (2.6) runs after the model
weights were loaded and before the optimizer states are::

    for each optimizer state without "masters" (a plain "16-true"/"16-mixed"/fp32 run):
        masters = the checkpoint's model weights ("state_dict", by param name) in the
                  masters' dtype and device -- exact for a "16-mixed" run's fp32 weights;
                  a param missing there takes the model's current value
        state   = {"optimizer": state, "masters": masters}   (warning logged once per load)
    no entry of MasterWeightsPrecision but a "MixedPrecision" scaler state: load it (info)

The inner optimizer's saved state (momentum, Adam moments) is cast to the masters' dtype by
torch's ``load_state_dict``; structure and shapes are then checked by
``MixedPrecisionOptimizer.load_state_dict`` as for any checkpoint.

Asynchronous steps (:func:`landed_weights`, :func:`restore_next_forward`): a save while a step
has not landed in the model (its masters are newer than the params the next forward uses)
must neither write the live params (an autograd graph may hold them: a save inside
``training_step`` then broke the backward; and landing early changed the training numbers
of a run that saves) nor hold weights one step behind its masters::

    save:   state_dict[name] = master rounded to the param's dtype   (consistent with the masters)
            plugin entry["next_forward"][name] = the live param       (only where they differ)
    load:   after Lightning loaded state_dict: param = next_forward[name]; the masters then load
            (MixedPrecisionOptimizer lands them at its next step, as the run that saved did)

so the resumed run continues bit for bit as the one that saved.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ... import GradScaler, MixedPrecisionOptimizer

__all__ = ["adopt_plain_checkpoint", "landed_weights", "restore_next_forward"]

logger = logging.getLogger("fp16kit")


def adopt_plain_checkpoint(
    checkpoint: dict[str, Any],
    optimizers: list[MixedPrecisionOptimizer],
    module: torch.nn.Module | None,
    scaler: GradScaler | None,
    *,
    own_key: str,
) -> None:
    """Rewrite ``checkpoint`` in place (see the module docstring)."""
    states = checkpoint.get("optimizer_states")
    if isinstance(states, list):
        plain = [
            i
            for i, s in enumerate(states[: len(optimizers)])
            if isinstance(s, dict) and "state" in s and "masters" not in s
        ]
        if plain:
            weights = checkpoint.get("state_dict") or {}
            name_of = {id(p): n for n, p in module.named_parameters()} if module is not None else {}
            for i in plain:
                states[i] = {"optimizer": states[i], "masters": _masters_from(weights, name_of, optimizers[i])}
            logger.warning(
                "The checkpoint has no fp32 master weights (it was not saved with "
                "MasterWeightsPrecision): the masters of optimizer(s) %s are rebuilt from its model "
                "weights; training continues from them.",
                plain,
            )
    if own_key not in checkpoint and scaler is not None:
        saved = checkpoint.get("MixedPrecision")
        if isinstance(saved, dict) and "scale" in saved:
            scaler.load_state_dict(saved)
            logger.info("Loaded the loss-scaler state of Lightning's MixedPrecision plugin from the checkpoint.")


def _masters_from(
    weights: dict[str, Any], name_of: dict[int, str], opt: MixedPrecisionOptimizer
) -> list[list[torch.Tensor]]:
    out = []
    for group in opt.groups:
        row = []
        for p, m in zip(group.model_params, group.masters):
            src = weights.get(name_of.get(id(p), ""))
            if not isinstance(src, torch.Tensor) or src.shape != p.shape:
                src = p
            row.append(src.detach().to(device=m.device, dtype=m.dtype, copy=True))
        out.append(row)
    return out


def landed_weights(
    weights: dict[str, Any], module: torch.nn.Module, optimizers: list[MixedPrecisionOptimizer]
) -> dict[str, torch.Tensor]:
    """Put each master, rounded to its param's dtype, into ``weights``; return the replaced live values.

    Put each master, rounded to its param's dtype, into ``weights`` (a checkpoint's
    ``state_dict``, by name) where it differs from the param; return the replaced live values
    (the params the next forward uses). The live params are not written."""
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    replaced: dict[str, torch.Tensor] = {}
    for opt in optimizers:
        opt.wait_for_step()  # (the optimizer states taken before this waited already)
        for param, m in zip(opt.model_params, opt.master_params):
            landed = None
            for name in names.get(id(param), []):
                live = weights.get(name)
                if not isinstance(live, torch.Tensor):
                    continue
                landed = landed if landed is not None else m.detach().to(device=live.device, dtype=live.dtype)
                if not torch.equal(live, landed):
                    replaced[name], weights[name] = live, landed
    return replaced


def restore_next_forward(module: torch.nn.Module, next_forward: dict[str, torch.Tensor]) -> None:
    """Write the saved live params back.

    After Lightning loaded the checkpoint's landed weights; see the module docstring."""
    params = dict(module.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for name, value in next_forward.items():
            if name in params:
                params[name].copy_(value)
