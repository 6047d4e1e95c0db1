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
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from .. import GradScaler, MixedPrecisionOptimizer

__all__ = ["adopt_plain_checkpoint"]

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
            i for i, s in enumerate(states[: len(optimizers)])
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
                "weights; training continues from them.", plain,
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
