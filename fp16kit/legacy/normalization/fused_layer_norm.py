"""apex.normalization.fused_layer_norm on fp16kit.nn's norms (docs/apex-others.md §4.5).

| apex class            | fp16kit base                | output dtype        | math                       |
|-----------------------|-----------------------------|---------------------|----------------------------|
| FusedLayerNorm        | nn.LayerNorm                | input's             | F.layer_norm               |
| MixedFusedLayerNorm   | FusedLayerNorm (affine)     | weight's            | F.layer_norm in fp32       |
| FusedRMSNorm          | nn.RMSNorm                  | apex's formula      | apex's manual_rms_norm     |
| MixedFusedRMSNorm     | FusedRMSNorm (affine)       | weight's            | apex's manual_rms_norm     |

Parameter names and state-dict keys are torch's (``weight``, ``bias``; RMS: ``weight``), so
checkpoints move between these and ``nn.LayerNorm`` / ``nn.RMSNorm`` both ways. Under CUDA
autocast all four cast input and params to the autocast dtype first, as apex's kernels did.
``memory_efficient`` (classes and functional forms) only changed what apex's backward saved:
accepted, logged once. The
functional forms default to ``eps=1e-6`` as apex's did; they work on every device (apex's
needed the CUDA extension).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, Union

import torch
from torch import nn

from ...core.log import log_once
from ...nn import norm as _norm

__all__ = [
    "FusedLayerNorm",
    "FusedRMSNorm",
    "MixedFusedLayerNorm",
    "MixedFusedRMSNorm",
    "fused_layer_norm",
    "fused_layer_norm_affine",
    "fused_rms_norm",
    "fused_rms_norm_affine",
    "manual_rms_norm",
    "mixed_dtype_fused_layer_norm_affine",
    "mixed_dtype_fused_rms_norm_affine",
]

_Shape = Union[int, Sequence[int], torch.Size]


def _memory_efficient(cls: str, flag: bool) -> None:
    if flag:
        log_once(
            (cls, "memory_efficient"),
            "%s(memory_efficient=True): only changed what apex's CUDA backward saved; ignored",
            cls,
        )


def _mixed_kwargs(cls: str, kwargs: dict[str, Any]) -> None:
    """apex's Mixed* rule: ``elementwise_affine`` warns (False raises); other kwargs are dropped
    silently (Megatron passes extras)."""
    if "elementwise_affine" in kwargs:
        warnings.warn(f"{cls} does not support `elementwise_affine` argument", stacklevel=2)
        if not kwargs.pop("elementwise_affine"):
            raise RuntimeError(f"{cls} does not support `elementwise_affine = False`")


class FusedLayerNorm(nn.LayerNorm):
    """apex's ``FusedLayerNorm``: ``nn.LayerNorm`` computing :func:`fp16kit.nn.layer_norm`.

    ``FusedLayerNorm(normalized_shape, eps=1e-5, elementwise_affine=True, memory_efficient=False)``:
    ``nn.LayerNorm`` (weight=1, bias=0) computing :func:`fp16kit.nn.layer_norm`."""

    def __init__(
        self,
        normalized_shape: _Shape,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        memory_efficient: bool = False,
    ) -> None:
        _memory_efficient(type(self).__name__, memory_efficient)
        super().__init__(normalized_shape, eps, elementwise_affine)
        self.memory_efficient = memory_efficient

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return _norm.layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)


class MixedFusedLayerNorm(FusedLayerNorm):
    """apex's ``MixedFusedLayerNorm``: always affine; fp32 math, output in the weight's dtype.

    ``MixedFusedLayerNorm(normalized_shape, eps=1e-5, *, memory_efficient=False, **kwargs)``:
    always affine; fp32 math, output in the weight's dtype (:func:`fp16kit.nn.mixed_layer_norm`)."""

    def __init__(
        self, normalized_shape: _Shape, eps: float = 1e-5, *, memory_efficient: bool = False, **kwargs: Any
    ) -> None:
        _mixed_kwargs("MixedFusedLayerNorm", kwargs)
        super().__init__(normalized_shape, eps, True, memory_efficient)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return _norm.mixed_layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)


class FusedRMSNorm(nn.RMSNorm):
    """apex's ``FusedRMSNorm``: ``nn.RMSNorm`` computing apex's formula.

    ``FusedRMSNorm(normalized_shape, eps=1e-5, elementwise_affine=True, memory_efficient=False)``:
    ``nn.RMSNorm`` (weight=1) computing apex's formula (:func:`fp16kit.nn.rms_norm`)."""

    eps: float  # apex's constructor always sets it (nn.RMSNorm's may be None)

    def __init__(
        self,
        normalized_shape: _Shape,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        memory_efficient: bool = False,
    ) -> None:
        _memory_efficient(type(self).__name__, memory_efficient)
        super().__init__(normalized_shape, eps, elementwise_affine)
        self.memory_efficient = memory_efficient

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return _norm.rms_norm(input, self.normalized_shape, self.weight, self.eps)


class MixedFusedRMSNorm(FusedRMSNorm):
    """apex's ``MixedFusedRMSNorm``: always affine; output in the weight's dtype.

    ``MixedFusedRMSNorm(normalized_shape, eps=1e-5, *, memory_efficient=False, **kwargs)``:
    always affine; output in the weight's dtype (:func:`fp16kit.nn.mixed_rms_norm`)."""

    def __init__(
        self, normalized_shape: _Shape, eps: float = 1e-5, *, memory_efficient: bool = False, **kwargs: Any
    ) -> None:
        _mixed_kwargs("MixedFusedRMSNorm", kwargs)
        super().__init__(normalized_shape, eps, True, memory_efficient)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return _norm.mixed_rms_norm(input, self.normalized_shape, self.weight, self.eps)


# ---------------------------------------------------------------- apex's functional forms


def fused_layer_norm_affine(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    normalized_shape: _Shape,
    eps: float = 1e-6,
    memory_efficient: bool = False,
) -> torch.Tensor:
    _memory_efficient("fused_layer_norm_affine", memory_efficient)
    return _norm.layer_norm(input, normalized_shape, weight, bias, eps)


def fused_layer_norm(
    input: torch.Tensor, normalized_shape: _Shape, eps: float = 1e-6, memory_efficient: bool = False
) -> torch.Tensor:
    _memory_efficient("fused_layer_norm", memory_efficient)
    return _norm.layer_norm(input, normalized_shape, None, None, eps)


def mixed_dtype_fused_layer_norm_affine(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    normalized_shape: _Shape,
    eps: float = 1e-6,
    memory_efficient: bool = False,
) -> torch.Tensor:
    _memory_efficient("mixed_dtype_fused_layer_norm_affine", memory_efficient)
    return _norm.mixed_layer_norm(input, normalized_shape, weight, bias, eps)


def fused_rms_norm_affine(
    input: torch.Tensor,
    weight: torch.Tensor,
    normalized_shape: _Shape,
    eps: float = 1e-6,
    memory_efficient: bool = False,
) -> torch.Tensor:
    _memory_efficient("fused_rms_norm_affine", memory_efficient)
    return _norm.rms_norm(input, normalized_shape, weight, eps)


def fused_rms_norm(
    input: torch.Tensor, normalized_shape: _Shape, eps: float = 1e-6, memory_efficient: bool = False
) -> torch.Tensor:
    _memory_efficient("fused_rms_norm", memory_efficient)
    return _norm.rms_norm(input, normalized_shape, None, eps)


def mixed_dtype_fused_rms_norm_affine(
    input: torch.Tensor,
    weight: torch.Tensor,
    normalized_shape: _Shape,
    eps: float = 1e-6,
    memory_efficient: bool = False,
) -> torch.Tensor:
    _memory_efficient("mixed_dtype_fused_rms_norm_affine", memory_efficient)
    return _norm.mixed_rms_norm(input, normalized_shape, weight, eps)


def manual_rms_norm(
    input: torch.Tensor, normalized_shape: _Shape, weight: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """apex's plain formula on every device (``weight`` may be None; no autocast or output cast)."""
    return _norm.manual_rms_norm(input, normalized_shape, weight, eps)
