"""apex's fused optimizers pickled whole and loaded under fp16kit's apex alias.

apex's fused optimizers pickled whole (``torch.save(optimizer)``) and loaded under fp16kit's
apex alias (``torch.load(..., weights_only=False)`` in ``fp16kit run``): what fp16kit's class of
the same name rebuilds, or refuses.

torch's ``Optimizer.__getstate__`` keeps ``defaults``, ``state`` and ``param_groups``. apex's
``apex.optimizers`` classes kept some settings as plain attributes instead, so the file lacks
them (apex's own unpickled optimizer failed at its first step)::

    class          kept on the object by apex           changes the updates when
    FusedAdam      adam_w_mode                          a group has weight_decay != 0
                   master_weights                       capturable=True (lr saved as a tensor)
                   eps_inside_sqrt (eps_mode)           always: the 2018-12..2019-08 class
                                                        (max_grad_norm in its defaults)
    FusedLAMB      adam_w_mode | use_nvlamb             a group has weight_decay != 0 | == 0
    FusedNovoGrad  reg_inside_moment (moment_mode)      always
    FusedAdagrad   adagrad_w_mode                       a group has weight_decay != 0
    FusedSGD       wd_after_momentum                    a group has weight_decay != 0 and momentum != 0
                   materialize_master_grads             never (it only mattered under apex amp O2)
    all            set_grad_none                        never in a step (zero_grad(): None or zeros)

A setting that changes the updates of the saved groups: ``pickle.UnpicklingError`` naming it
and the fix. Otherwise every setting takes apex's default, which gives the same updates as any
other value, and the optimizer continues as one built with those settings and given the saved
state would.
"""

from __future__ import annotations

from typing import Any

import torch

from ...optim.base import public_settings
from ..checkpoints.errors import apex_object_refused

__all__ = ["decays", "settings_or_refusal"]


def decays(state: dict[str, Any], *, with_momentum: bool = False) -> bool:
    """Whether a saved group has ``weight_decay != 0`` (and ``momentum != 0``)."""
    return any(
        g.get("weight_decay", 0) != 0 and (not with_momentum or g.get("momentum", 0) != 0)
        for g in state["param_groups"]
    )


def settings_or_refusal(cls: type[torch.optim.Optimizer], state: dict[str, Any], lost: list[str]) -> dict[str, Any]:
    """The settings of ``cls`` built with apex's defaults, for ``state`` unpickled without them.

    The settings of ``cls`` built with apex's defaults (its constructor's), for ``state``
    unpickled without them; refused when one of ``lost`` (apex's argument names) would have
    changed the updates."""
    if lost:
        raise apex_object_refused(
            f"apex.optimizers.{cls.__name__}",
            "optimizer",
            f"torch's pickling of optimizers keeps their param groups and state only, and apex kept "
            f"{lost} on the object, so the file does not say what the run passed; with these param "
            "groups the value changes the updates",
        )
    probe = cls([torch.zeros(1)], lr=state["defaults"]["lr"])  # type: ignore[call-arg]
    return public_settings(probe)
