"""apex.optimizers.fused_lamb: ``FusedLAMB``, a facade over :class:`fp16kit.optim.LAMB`.

apex's 2020-04 rule; FIX: ``max_grad_norm <= 0`` disables clipping instead of zeroing grads."""

from __future__ import annotations

from typing import Any

import torch

from ...optim import LAMB
from ._unpickled import settings_or_refusal

__all__ = ["FusedLAMB"]


class FusedLAMB(LAMB):
    """apex.optimizers.FusedLAMB, with apex's signature and defaults.

    apex.optimizers.FusedLAMB: apex's signature and defaults (eps 1e-6, weight_decay 0.01,
    clipping at a global grad norm of 1.0)."""

    display_name = "FusedLAMB"
    supported_dtypes = (torch.float16, torch.bfloat16, torch.float32)
    dtype_error = "FusedLAMB only support fp16 and fp32."

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        amsgrad: bool = False,
        adam_w_mode: bool = True,
        grad_averaging: bool = True,
        set_grad_none: bool = True,
        max_grad_norm: float = 1.0,
        use_nvlamb: bool = False,
    ) -> None:
        if amsgrad:
            raise RuntimeError("FusedLAMB does not support the AMSGrad variant.")
        super().__init__(
            params,
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            adam_w_mode=adam_w_mode,
            grad_averaging=grad_averaging,
            max_grad_norm=max_grad_norm,
            use_nvlamb=use_nvlamb,
            set_grad_none=set_grad_none,
        )

    def _settings_for_bare_pickle(self, state: dict[str, Any]) -> dict[str, Any]:
        # a decaying group's update depends on adam_w_mode, another's on use_nvlamb (trust ratio)
        lost = {"adam_w_mode" if g.get("weight_decay", 0) != 0 else "use_nvlamb" for g in state["param_groups"]}
        return settings_or_refusal(FusedLAMB, state, sorted(lost))
