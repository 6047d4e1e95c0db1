"""Weight normalisation ``w = g * v / ||v||`` (Salimans & Kingma 2016) as one autograd Function.

The arithmetic of apex's 2018 ``Fused_Weight_Norm`` (docs/apex-others.md §4.6).

    dim = 0:       ||v|| over every dim but the first,  norms shaped (v.size(0), 1, ..., 1)
    dim = last:    ||v|| over every dim but the last,   norms shaped (1, ..., 1, v.size(-1))
    forward:   w = (g * v / ||v||)                                  fp32 math (fp64 for fp64), v's dtype out
    backward:  grad_g = sum(grad_w * v) / ||v||                     (over the norm dims)
               grad_v = g / ||v|| * (grad_w - v * sum(grad_w * v) / ||v||**2)
               each in fp32, returned in g's / v's dtype; differentiable again (double backward,
               e.g. Hessian-vector products), as torch._weight_norm is

``g`` may have the norms' shape or hold just ``v.size(dim)`` elements (apex's kernel read it
flat); its gradient has ``g``'s own shape. ``torch._weight_norm(v, g, dim)`` computes the same
(its CUDA kernel is the one apex's became).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["WeightNorm", "norm_dims", "weight_norm"]


def norm_dims(input: torch.Tensor, dim: int) -> tuple[tuple[int, ...], list[int]]:
    """Return ``(shape of the per-slice norms, dims reduced)`` for ``dim`` (0, the last dim or -1).

    ValueError for any other dim."""
    if input.dim() == 0:
        raise ValueError("weight_norm needs a tensor with at least one dimension, got a 0-D tensor.")
    last = input.dim() - 1
    if dim == 0:
        return (input.size(0),) + (1,) * last, list(range(1, input.dim()))
    if dim in (last, -1):
        return (1,) * last + (input.size(-1),), list(range(last))
    raise ValueError(
        f"weight_norm normalises over every dim but the first (dim=0) or the last (dim={last} or -1); "
        f"got dim={dim} for a {input.dim()}-D tensor. Move that dim first with movedim()."
    )


class WeightNorm(torch.autograd.Function):
    """``WeightNorm.apply(v, g, dim=0)``: see the module docstring."""

    # ctx: Any -- forward keeps shape and reduce on it, which FunctionCtx's stub does not declare
    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, g: torch.Tensor, dim: int = 0) -> torch.Tensor:
        shape, reduce = norm_dims(input, dim)
        slices = input.size(0) if dim == 0 else input.size(-1)
        if g.numel() != slices:
            raise ValueError(
                f"g must hold one value per slice along dim {dim} ({slices} values, e.g. shape {shape}); "
                f"got shape {tuple(g.shape)}."
            )
        acc = torch.promote_types(input.dtype, torch.float32)  # fp32 math (fp64 stays fp64)
        v = input.to(acc)
        norms = torch.linalg.vector_norm(v, dim=reduce, keepdim=True) if reduce else v.abs()
        g32 = g.to(acc).reshape(shape)
        ctx.save_for_backward(input, g)
        ctx.shape, ctx.reduce = shape, reduce
        return (v * (g32 / norms)).to(input.dtype)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor):
        input, g = ctx.saved_tensors
        shape, reduce = ctx.shape, ctx.reduce
        acc = torch.promote_types(input.dtype, torch.float32)
        v, gw, g32 = input.to(acc), grad_output.to(acc), g.to(acc).reshape(shape)
        # the norms again, from the saved input: computed here they are part of the graph that a
        # double backward (create_graph=True) differentiates (the forward's were not recorded)
        norms = torch.linalg.vector_norm(v, dim=reduce, keepdim=True) if reduce else v.abs()
        dot = (gw * v).sum(dim=reduce, keepdim=True) if reduce else gw * v
        grad_g = (dot / norms).reshape(g.shape).to(g.dtype)
        grad_v = (g32 / norms) * (gw - v * (dot / (norms * norms)))
        return grad_v.to(input.dtype), grad_g, None


def weight_norm(v: torch.Tensor, g: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Return ``g * v / ||v||`` with the norm over every dim of ``v`` but ``dim`` (0 or last).

    Computed in fp32, returned in ``v``'s dtype; differentiable in ``v`` and ``g``."""
    return WeightNorm.apply(v, g, dim)
