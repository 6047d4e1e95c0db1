"""Lightning's fine-tuning callbacks (``BaseFinetuning``, ``BackboneFinetuning``) with fp32 masters.

``BaseFinetuning`` (lightning 2.6.6) remembers the param groups it added by param *name*:

* ``on_train_epoch_start`` -> ``_store``: ``_apply_mapping_to_param_groups(optimizer.param_groups,
  {param: name for pl_module.named_parameters()})``. A ``MixedPrecisionOptimizer``'s groups hold
  the fp32 masters, which are no module params: Lightning raised ``KeyError(<tensor>)``.
* ``on_fit_start`` when resuming: ``optimizer.param_groups = <the stored groups, names mapped
  back to the module's params>``. Assigned to a ``MixedPrecisionOptimizer``, the fp16/bf16
  params of the groups added before the checkpoint would be stepped directly (no masters, the
  loss scale never divided out).

:func:`adapt_finetuning` (called by ``MasterWeightsPrecision.connect`` for each such callback in
``trainer.callbacks``) gives the callback instance two replacements:

* ``_apply_mapping_to_param_groups``: masters are named as their model params;
* ``on_fit_start``: resuming, the groups present (from ``configure_optimizers``) take the stored
  hyperparameters and keep their masters; each stored group beyond them is added with
  ``opt.add_param_group`` with its params trainable again, as ``unfreeze_and_add_param_group``
  left them (Lightning's own restore leaves them frozen after ``freeze_before_training``: an
  fp32 run silently stops training the backbone after a resume; the masters, saved for
  trainable params, cannot be loaded into frozen ones); then the callback's own
  ``on_fit_start`` runs with nothing left to restore (its checks still run). The optimizer
  state restored afterwards (masters, momentum) then matches group for group, and the resumed
  run continues as the uninterrupted one.
"""

from __future__ import annotations

from .._requires import require

require("lightning.pytorch", extra="lightning", tested=("2.6", "2.7"))

import weakref  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

from lightning.pytorch.callbacks import BaseFinetuning  # noqa: E402

from ... import MixedPrecisionOptimizer  # noqa: E402

__all__ = ["adapt_finetuning"]


def adapt_finetuning(callbacks: Any, optimizers: Callable[[], list[MixedPrecisionOptimizer]]) -> None:
    """Adapt every ``BaseFinetuning`` in ``callbacks`` to the plugin's MixedPrecisionOptimizers.

    Adapt every ``BaseFinetuning`` in ``callbacks`` to ``optimizers()`` (the plugin's current
    MixedPrecisionOptimizers; read at each call, so a callback reused by another fit follows)."""
    for cb in callbacks if isinstance(callbacks, list) else []:
        if not isinstance(cb, BaseFinetuning):
            continue
        named = vars(cb).get("_apply_mapping_to_param_groups")
        if isinstance(named, _NameMasters):  # a second fit (maybe another plugin): follow it
            named.optimizers = optimizers
            continue
        cb._apply_mapping_to_param_groups = _NameMasters(optimizers)  # type: ignore[method-assign]
        cb.on_fit_start = _RestoreGroups(cb)  # type: ignore[method-assign]


class _NameMasters:
    """``BaseFinetuning._apply_mapping_to_param_groups`` that maps each master to its model param
    first (the other direction -- names to params -- passes through unchanged)."""

    def __init__(self, optimizers: Callable[[], list[MixedPrecisionOptimizer]]) -> None:
        self.optimizers = optimizers

    def __call__(self, param_groups: list[dict[str, Any]], mapping: dict) -> list[dict[str, Any]]:
        model_of = {id(m): p for o in self.optimizers() for p, m in zip(o.model_params, o.master_params)}
        groups = [{**g, "params": [model_of.get(id(p), p) for p in g["params"]]} for g in param_groups]
        return BaseFinetuning._apply_mapping_to_param_groups(groups, mapping)


class _RestoreGroups:
    """``BaseFinetuning.on_fit_start`` for MixedPrecisionOptimizers (see the module docstring)."""

    def __init__(self, cb: BaseFinetuning) -> None:
        self.callback = weakref.ref(cb)  # (stored on cb: no cycle)
        self.original = type(cb).on_fit_start

    def __call__(self, trainer: Any, pl_module: Any) -> None:
        cb = self.callback()
        assert cb is not None
        stored = cb._internal_optimizer_metadata
        ours: dict[int, list[dict[str, Any]]] = {}
        if cb._restarting and stored:
            named = dict(pl_module.named_parameters())
            for idx, opt in enumerate(trainer.optimizers):
                if isinstance(opt, MixedPrecisionOptimizer) and idx in stored:
                    ours[idx] = stored.pop(idx)
                    _restore_groups(opt, ours[idx], named)
        try:  # its checks, and the groups of plain optimizers (Lightning's own way)
            self.original(cb, trainer, pl_module)
        finally:
            stored.update(ours)


def _restore_groups(opt: MixedPrecisionOptimizer, saved: list[dict[str, Any]], named: dict[str, Any]) -> None:
    for group, entry in zip(opt.param_groups, saved):
        group.update({k: v for k, v in entry.items() if k != "params"})
    for entry in saved[len(opt.param_groups) :]:
        params = [named[n] for n in entry["params"]]
        for p in params:  # as unfreeze_and_add_param_group left them (see the module docstring)
            p.requires_grad_(True)
        opt.add_param_group({**entry, "params": params})
