"""apex.optimizers.fused_novograd: ``FusedNovoGrad``, a facade over :class:`fp16kit.optim.NovoGrad`."""

from __future__ import annotations

from typing import Any

import torch

from ...optim import NovoGrad
from ._unpickled import settings_or_refusal

__all__ = ["FusedNovoGrad"]


class FusedNovoGrad(NovoGrad):
    """apex.optimizers.FusedNovoGrad, with apex's signature, defaults and layout.

    apex.optimizers.FusedNovoGrad: apex's signature, defaults and layout
    (``group['exp_avg_sq']`` = [fp16 norms, fp32 norms])."""

    display_name = "FusedNovoGrad"
    supported_dtypes = (torch.float16, torch.bfloat16, torch.float32)
    dtype_error = "FusedNovoGrad only support fp16 and fp32."

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        reg_inside_moment: bool = False,
        grad_averaging: bool = True,
        norm_type: int = 2,
        init_zero: bool = False,
        set_grad_none: bool = True,
    ) -> None:
        if amsgrad:
            raise RuntimeError("FusedNovoGrad does not support the AMSGrad variant.")
        super().__init__(
            params,
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            reg_inside_moment=reg_inside_moment,
            grad_averaging=grad_averaging,
            norm_type=norm_type,
            init_zero=init_zero,
            set_grad_none=set_grad_none,
        )

    def _settings_for_bare_pickle(self, state: dict[str, Any]) -> dict[str, Any]:
        return settings_or_refusal(FusedNovoGrad, state, ["reg_inside_moment"])  # apex's moment_mode
