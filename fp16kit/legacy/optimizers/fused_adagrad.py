"""apex.optimizers.fused_adagrad: ``FusedAdagrad``, a facade over :class:`fp16kit.optim.Adagrad`.

L2 mode = ``torch.optim.Adagrad(lr, eps=1e-10, weight_decay=wd)``; W mode has no torch twin."""

from __future__ import annotations

from typing import Any

import torch

from ...optim import Adagrad
from ._unpickled import decays, settings_or_refusal

__all__ = ["FusedAdagrad"]


class FusedAdagrad(Adagrad):
    """apex.optimizers.FusedAdagrad: apex's signature and defaults; state ``sum`` only."""

    display_name = "FusedAdagrad"
    supported_dtypes = (torch.float16, torch.bfloat16, torch.float32)
    dtype_error = "FusedAdagrad only support fp16 and fp32."

    def __init__(
        self,
        params: Any,
        lr: float = 1e-2,
        eps: float = 1e-10,
        weight_decay: float = 0.0,
        set_grad_none: bool = True,
        adagrad_w_mode: bool = False,
    ) -> None:
        super().__init__(
            params,
            lr=lr,
            eps=eps,
            weight_decay=weight_decay,
            adagrad_w_mode=adagrad_w_mode,
            set_grad_none=set_grad_none,
        )

    def _settings_for_bare_pickle(self, state: dict[str, Any]) -> dict[str, Any]:
        return settings_or_refusal(FusedAdagrad, state, ["adagrad_w_mode"] if decays(state) else [])
