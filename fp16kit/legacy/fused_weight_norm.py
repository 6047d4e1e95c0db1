"""apex.fp16_utils.Fused_Weight_Norm (apex's first release, 2018; docs/apex-others.md §4.6).

``Fused_Weight_Norm.apply(input, g, dim=0)`` = ``g * input / ||input||`` with the norm over every
dim but the first (``dim=0``) or the last, fp32 math, output in ``input``'s dtype: the arithmetic
of :class:`fp16kit.nn.WeightNorm`, on any device (apex's kernel wanted contiguous CUDA tensors,
and from 2018-07 apex replaced the class by a stub pointing to torch's weight norm). ``dim=-1``
means the last dim here; apex accepted only ``input.dim() - 1``. The modern spelling is
``fp16kit.nn.weight_norm(v, g, dim)`` or ``torch.nn.utils.parametrizations.weight_norm``.
"""

from __future__ import annotations

import torch
from torch.autograd.function import FunctionCtx

from ..nn.weight_norm import WeightNorm

__all__ = ["Fused_Weight_Norm"]


class Fused_Weight_Norm(WeightNorm):
    """Weight norm as an autograd Function, apex's name and error text."""

    @staticmethod
    def forward(ctx: FunctionCtx, input: torch.Tensor, g: torch.Tensor, dim: int = 0) -> torch.Tensor:
        if dim not in (0, input.dim() - 1, -1):
            raise RuntimeError("Currently, Fused_Weight_Norm only supports first or last dimension.")
        return WeightNorm.forward(ctx, input, g, dim)
