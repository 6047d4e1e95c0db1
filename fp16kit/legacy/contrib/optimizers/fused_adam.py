"""apex.contrib.optimizers.fused_adam: the legacy ``FusedAdam``, a facade over :class:`fp16kit.optim.LegacyAdam`.

apex.contrib.optimizers.fused_adam: the legacy ``FusedAdam`` (2018 rule, docs/apex-others.md §1.4), a
facade over :class:`fp16kit.optim.LegacyAdam`."""

from __future__ import annotations

from typing import Any

import torch

from ....optim import LegacyAdam
from ....optim.legacy_adam import StepWithGrads
from ._checkpoint import check_unpickled_settings

__all__ = ["FusedAdam"]


class FusedAdam(StepWithGrads, LegacyAdam):
    """apex.contrib.optimizers.FusedAdam, with apex's signature.

    apex.contrib.optimizers.FusedAdam: apex's signature; ``use_mt`` (a kernel choice) is
    accepted; ``amp_scale_adjustment`` is kept (apex applied it only under apex amp)."""

    display_name = "FusedAdam"
    supported_dtypes = (torch.float16, torch.bfloat16, torch.float32)
    dtype_error = "FusedAdam only support fp16 and fp32."

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        amsgrad: bool = False,
        use_mt: bool = False,
        amp_scale_adjustment: float = 1.0,
    ) -> None:
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant.")
        super().__init__(
            params,
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            eps_inside_sqrt=eps_inside_sqrt,
            weight_decay=weight_decay,
            max_grad_norm=max_grad_norm,
        )
        self.use_mt = use_mt
        self.amp_scale_adjustment = amp_scale_adjustment

    def __setstate__(self, state: dict[str, Any]) -> None:
        check_unpickled_settings(self, state, ("eps_inside_sqrt",))
        super().__setstate__(state)
