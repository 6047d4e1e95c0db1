"""Layer norm and RMS norm with apex's dtype contract (apex.normalization, docs/apex-others.md §4.5).

Arithmetic contract (every function below):

    under CUDA autocast (input on CUDA):          # apex's _cast_if_autocast_enabled
        input, weight, bias = cast to torch.get_autocast_dtype("cuda"); autocast off inside
    layer_norm(x, shape, w, b, eps)       = F.layer_norm(x, shape, w, b, eps)
                                            (fp32 statistics; output in x's dtype)
    mixed_layer_norm(x, shape, w, b, eps) = F.layer_norm(x.float(), shape, w.float(), b.float(), eps)
                                            .to(w.dtype)          # fp32 math, weight's dtype out
    rms_norm(x, shape, w, eps):                   # apex's manual_rms_norm, bit for bit
        ms = mean(x.float() ** 2 over the normalized dims)
        y  = x * rsqrt(ms + eps)                  # fp32 (type promotion)
        if w is None: return y (x's dtype on CUDA, as apex's kernel)
        if w is fp16/bf16: y = y.to(w.dtype)
        return w * y
    mixed_rms_norm = rms_norm with a weight: the output is in the weight's dtype

``nn.LayerNorm`` under autocast returns fp32; apex's fused kernels returned fp16/bf16, which is
what the autocast cast reproduces. On CPU apex itself called ``F.layer_norm`` and the RMS
formula above, so those are exact there; on CUDA the formulas match apex's kernels up to
reduction order. The modules keep torch's parameter names (``weight``, ``bias``), so their
state dicts load into ``nn.LayerNorm`` / ``nn.RMSNorm`` and back.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Union

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "MixedLayerNorm",
    "MixedRMSNorm",
    "RMSNorm",
    "layer_norm",
    "manual_rms_norm",
    "mixed_layer_norm",
    "mixed_rms_norm",
    "rms_norm",
]

_Shape = Union[int, Sequence[int], torch.Size]
_LOW = (torch.float16, torch.bfloat16)


def _shape(normalized_shape: _Shape) -> tuple[int, ...]:
    if isinstance(normalized_shape, (int, numbers.Integral)):
        return (int(normalized_shape),)
    return tuple(int(s) for s in normalized_shape)


def _autocast_dtype(input: torch.Tensor) -> torch.dtype | None:
    """The CUDA autocast dtype when apex's kernels would have cast to it, else None."""
    if input.is_cuda and torch.is_autocast_enabled("cuda"):
        return torch.get_autocast_dtype("cuda")
    return None


def _cast(dtype: torch.dtype, *tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    return [t if t is None or not t.is_floating_point() else t.to(dtype) for t in tensors]


def _layer_norm(input, shape, weight, bias, eps, mixed):
    if mixed:
        out = F.layer_norm(
            input.float(),
            shape,
            None if weight is None else weight.float(),
            None if bias is None else bias.float(),
            eps,
        )
        return out if weight is None else out.to(weight.dtype)
    return F.layer_norm(input, shape, weight, bias, eps)


def _rms_formula(input, shape, weight, eps):
    dims = tuple(range(-1, -len(shape) - 1, -1))
    ms = input.to(torch.float32).pow(2).mean(dims, keepdim=True)
    y = input * torch.rsqrt(ms + eps)
    if weight is None:
        return y
    if weight.dtype in _LOW:
        y = y.to(weight.dtype)
    return weight * y


def _rms_norm(input, shape, weight, eps, mixed):
    out = _rms_formula(input, shape, weight, eps)
    # apex's CUDA kernels wrote the input's dtype (without a weight, or not mixed); its CPU
    # formula returns what type promotion gives
    if input.is_cuda and (weight is None or not mixed):
        return out.to(input.dtype)
    return out


def _dispatch(fn, input, shape, params, eps, mixed):
    shape = _shape(shape)
    dtype = _autocast_dtype(input)
    if dtype is None:
        return fn(input, shape, *params, eps, mixed)
    input, *params = _cast(dtype, input, *params)
    with torch.autocast("cuda", enabled=False):
        return fn(input, shape, *params, eps, mixed)


def layer_norm(
    input: torch.Tensor,
    normalized_shape: _Shape,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """``F.layer_norm`` (fp32 statistics, output in the input's dtype), with apex's CUDA autocast rule.

    The rule: input and params cast to the autocast dtype first."""
    return _dispatch(_layer_norm, input, normalized_shape, (weight, bias), eps, False)


def mixed_layer_norm(
    input: torch.Tensor, normalized_shape: _Shape, weight: torch.Tensor, bias: torch.Tensor | None, eps: float = 1e-5
) -> torch.Tensor:
    """Layer norm computed in fp32 whatever the dtypes; the output takes the weight's dtype.

    As apex's MixedFusedLayerNorm: fp16/bf16 activations with fp32 params give fp32."""
    return _dispatch(_layer_norm, input, normalized_shape, (weight, bias), eps, True)


def rms_norm(
    input: torch.Tensor, normalized_shape: _Shape, weight: torch.Tensor | None = None, eps: float = 1e-5
) -> torch.Tensor:
    """apex's RMS norm formula (module docstring); on CUDA the output takes the input's dtype as apex's kernel did."""
    return _dispatch(_rms_norm, input, normalized_shape, (weight,), eps, False)


def mixed_rms_norm(
    input: torch.Tensor, normalized_shape: _Shape, weight: torch.Tensor, eps: float = 1e-5
) -> torch.Tensor:
    """apex's RMS norm formula; the output takes the weight's dtype."""
    return _dispatch(_rms_norm, input, normalized_shape, (weight,), eps, True)


def manual_rms_norm(
    input: torch.Tensor, normalized_shape: _Shape, weight: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """apex's ``manual_rms_norm``: the plain formula of the module docstring on every device.

    No autocast cast and no CUDA output cast (without a weight the result is fp32)."""
    return _rms_formula(input, _shape(normalized_shape), weight, eps)


class MixedLayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` whose forward is :func:`mixed_layer_norm`: fp32 math, output in the parameters' dtype.

    Same parameters and state-dict keys, always affine. Keep the params in fp32 and feed fp16/bf16 activations
    to get fp32 out."""

    def __init__(
        self, normalized_shape: _Shape, eps: float = 1e-5, *, bias: bool = True, device=None, dtype=None
    ) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine=True, bias=bias, device=device, dtype=dtype)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return mixed_layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)


class RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` (same parameters and state-dict keys) computing apex's formula (:func:`rms_norm`).

    ``eps=1e-5`` by default as apex (torch's default None means the dtype's machine epsilon)."""

    eps: float  # nn.RMSNorm allows None; __init__ here takes a float

    def __init__(
        self, normalized_shape: _Shape, eps: float = 1e-5, elementwise_affine: bool = True, *, device=None, dtype=None
    ) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, device=device, dtype=dtype)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return rms_norm(input, self.normalized_shape, self.weight, self.eps)


class MixedRMSNorm(RMSNorm):
    """:class:`RMSNorm`, always affine, output in the weight's dtype (:func:`mixed_rms_norm`)."""

    def __init__(self, normalized_shape: _Shape, eps: float = 1e-5, *, device=None, dtype=None) -> None:
        super().__init__(normalized_shape, eps, True, device=device, dtype=dtype)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return mixed_rms_norm(input, self.normalized_shape, self.weight, self.eps)
