"""``grad_norm`` for Lightning modules trained with fp32 master weights.

Lightning's ``lightning.pytorch.utilities.grad_norm(module, norm_type)`` reads ``p.grad`` of the
module's params. With an fp16 model those grads are still multiplied by the loss scale in
``on_before_optimizer_step``; the unscaled grads live on the masters. This drop-in maps each
param to its master (through the trainer's MixedPrecisionOptimizers) and computes the same
per-param norms and total (``torch.tensor(norms).norm(norm_type)``, Lightning 2.6's arithmetic),
under the same keys, so a user swaps the import and logs the true norm::

    from fp16kit.integrations.lightning import grad_norm
    def on_before_optimizer_step(self, optimizer):
        self.log_dict(grad_norm(self, norm_type=2))
"""

from __future__ import annotations

from .._requires import require

pl = require("lightning.pytorch", extra="lightning", tested=("2.6", "2.7"))

from typing import Any  # noqa: E402

import torch  # noqa: E402

from ... import MixedPrecisionOptimizer  # noqa: E402

__all__ = ["grad_norm", "trainer_of"]


def trainer_of(model: Any) -> Any:
    """The Trainer of a LightningModule, possibly inside a strategy's wrappers; None if none is attached.

    The Trainer of a LightningModule, possibly inside a strategy's wrappers (DDP's
    ``.module``, Lightning's ``_forward_module``); None if none is attached."""
    for _ in range(4):
        if isinstance(model, pl.LightningModule):
            try:
                return model.trainer
            except RuntimeError:  # not attached to a Trainer
                return None
        model = getattr(model, "module", None) or getattr(model, "_forward_module", None)
    return None


def grad_norm(
    module: torch.nn.Module, norm_type: float | int | str, group_separator: str = "/"
) -> dict[str, torch.Tensor]:
    """Drop-in for ``lightning.pytorch.utilities.grad_norm`` that reads the unscaled master grads.

    Call it in ``on_before_optimizer_step`` (the fp16 model grads are still multiplied by the
    loss scale there). Same keys and arithmetic as Lightning's; a param without a master (not
    stepped by a MixedPrecisionOptimizer) contributes its own grad. With several optimizers
    (manual optimization), the params of the one being stepped count; those of the others are
    left out (their grads are still scaled: not this step's)."""
    norm_type = float(norm_type)
    if norm_type <= 0:
        raise ValueError(f"`norm_type` must be a positive number or 'inf' (infinity norm). Got {norm_type}")
    trainer = trainer_of(module)
    plugin = trainer.precision_plugin if trainer is not None else None
    unscaled = getattr(plugin, "unscaled", None)  # MasterWeightsPrecision's
    master_of: dict[int, torch.Tensor] = {}
    skip: set[int] = set()  # params of optimizers not being stepped now: their grads are still scaled
    ours = [o for o in (trainer.optimizers if trainer is not None else []) if isinstance(o, MixedPrecisionOptimizer)]
    stepping = [o for o in ours if unscaled is None or unscaled(o)]
    for opt in ours:
        if opt in stepping:
            master_of.update({id(p): m for p, m in zip(opt.model_params, opt.master_params)})
        else:
            skip.update(id(p) for p in opt.model_params)
    if ours and not stepping:
        raise RuntimeError(
            "fp16kit grad_norm reads the unscaled master grads, which exist from "
            "MasterWeightsPrecision's unscale to the optimizer step: call it in "
            "on_before_optimizer_step (or after trainer.precision_plugin.unscale_gradients(opt))."
        )
    norms = {}
    for name, p in module.named_parameters():
        if id(p) in skip and id(p) not in master_of:
            continue
        grad = master_of[id(p)].grad if id(p) in master_of else p.grad
        if grad is not None:
            norms[f"grad_{norm_type}_norm{group_separator}{name}"] = grad.data.norm(norm_type)
    if norms:
        norms[f"grad_{norm_type}_norm_total"] = torch.tensor(list(norms.values())).norm(norm_type)
    return norms
