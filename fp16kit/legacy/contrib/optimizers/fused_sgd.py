"""apex.contrib.optimizers.fused_sgd: the wrapper-only ``FusedSGD``, a facade over :func:`fp16kit.optim.sgd.sgd_step`.

apex.contrib.optimizers.fused_sgd: the wrapper-only ``FusedSGD`` (it must be driven by the
fused-era ``FP16_Optimizer``, which supplies the fp16 grads, the fp16 output params and the
scale), a facade over :func:`fp16kit.optim.sgd.sgd_step`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.optim.optimizer import required

from ....optim import SGD
from ....optim.legacy_adam import StepWithGrads, per_group
from ....optim.sgd import sgd_step
from ._checkpoint import check_unpickled_settings

__all__ = ["FusedSGD"]


class FusedSGD(StepWithGrads, SGD):
    """apex.contrib.optimizers.FusedSGD, driven by the fused-era ``FP16_Optimizer``.

    apex.contrib.optimizers.FusedSGD: ``step(closure=None, grads=None, output_params=None,
    scale=1., grad_norms=None)``; grads are multiplied by ``1/scale``, ``grad_norms`` ignored."""

    display_name = "FusedSGD"

    def __init__(
        self,
        params: Any,
        lr: Any = required,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        wd_after_momentum: bool = False,
        materialize_master_grads: bool = True,
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
        )
        self.materialize_master_grads = materialize_master_grads

    def __setstate__(self, state: dict[str, Any]) -> None:
        check_unpickled_settings(self, state, ("wd_after_momentum", "materialize_master_grads"))
        super().__setstate__(state)

    @torch.no_grad()
    def step(
        self,
        closure: Callable[[], Any] | None = None,
        grads: Any = None,
        output_params: Any = None,
        scale: float | torch.Tensor = 1.0,
        grad_norms: Sequence[Any] | None = None,
    ) -> Any:
        if hasattr(self, "_amp_stash"):
            raise RuntimeError("apex.contrib.optimizers.FusedSGD should not be used with AMP.")
        if grads is None:
            raise RuntimeError(
                "apex.contrib.optimizers.FusedSGD must be wrapped with "
                "apex.contrib.optimizers.FP16_Optimizer which provides grads."
            )
        if output_params is None:
            raise RuntimeError(
                "apex.contrib.optimizers.FusedSGD must be wrapped with "
                "apex.contrib.optimizers.FP16_Optimizer which provides output_params."
            )
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        sgd_step(
            self,
            wd_after_momentum=self.wd_after_momentum,
            grads=per_group(grads, len(self.param_groups)),
            outputs=per_group(output_params, len(self.param_groups)),
            scale=scale,
        )
        return loss
