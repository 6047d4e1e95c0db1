"""apex.optimizers.fused_sgd: ``FusedSGD``, a facade over :class:`fp16kit.optim.SGD`.

``torch.optim.SGD`` plus ``wd_after_momentum``; momentum buffers start per param, torch's rule."""

from __future__ import annotations

from typing import Any

from torch.optim.optimizer import required

from ...optim import SGD
from ._unpickled import decays, settings_or_refusal

__all__ = ["FusedSGD"]


class FusedSGD(SGD):
    """apex.optimizers.FusedSGD, with apex's signature (``lr`` required) and defaults.

    apex.optimizers.FusedSGD: apex's signature (``lr`` required) and defaults;
    ``materialize_master_grads`` is accepted (it only mattered under apex amp O2)."""

    display_name = "FusedSGD"

    def __init__(
        self,
        params: Any,
        lr: Any = required,
        momentum: float = 0,
        dampening: float = 0,
        weight_decay: float = 0,
        nesterov: bool = False,
        wd_after_momentum: bool = False,
        materialize_master_grads: bool = True,
        set_grad_none: bool = False,
    ) -> None:
        if lr is required:
            raise ValueError("parameter group didn't specify a value of required optimization parameter lr")
        super().__init__(
            params,
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
            wd_after_momentum=wd_after_momentum,
            set_grad_none=set_grad_none,
        )
        self.materialize_master_grads = materialize_master_grads

    def _settings_for_bare_pickle(self, state: dict[str, Any]) -> dict[str, Any]:
        lost = ["wd_after_momentum"] if decays(state, with_momentum=True) else []
        return settings_or_refusal(FusedSGD, state, lost)
