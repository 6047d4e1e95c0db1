"""apex.fp16_utils names of 2018 (until apex ``5c6144e6``).

``FP16_Module``, ``fp32_to_fp16``, ``fp16_to_fp32``, ``conversion_helper``. Megatron-LM v1 copied
them (:mod:`fp16kit.legacy.megatron`).

::

    conversion_helper(val, fn):            # through tuples and lists only
        if val is not a tuple or list: return fn(val)
        out = [conversion_helper(v, fn) for v in val]
        return tuple(out) if val is a tuple else out     # (a namedtuple comes back a tuple)

    fp32_to_fp16(val): float32 tensors (and Parameters) -> .half(); anything else as it is
    fp16_to_fp32(val): float16 tensors (and Parameters) -> .float(); anything else as it is

``FP16_Module(module)`` holds ``module.half()`` as its child ``module``; ``forward(*inputs,
**kwargs)`` casts the positional inputs with ``fp32_to_fp16`` (integer tensors, bf16 and float64
pass unchanged; kwargs are never cast), runs the child and casts its outputs with
``fp16_to_fp32``. Its state-dict keys carry the ``module.`` prefix (apex's 2018 class did not
override ``state_dict``; Megatron's does, see :class:`fp16kit.legacy.megatron.FP16_Module`).
Dicts are returned untouched, as in apex.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["FP16_Module", "conversion_helper", "fp16_to_fp32", "fp32_to_fp16"]


def conversion_helper(val: Any, conversion: Callable[[Any], Any]) -> Any:
    """Apply ``conversion`` to ``val``, recursing through tuples and lists (not dicts)."""
    if not isinstance(val, (tuple, list)):
        return conversion(val)
    out = [conversion_helper(v, conversion) for v in val]
    return tuple(out) if isinstance(val, tuple) else out


def _half(val: Any) -> Any:
    return val.half() if isinstance(val, torch.Tensor) and val.dtype == torch.float32 else val


def _float(val: Any) -> Any:
    return val.float() if isinstance(val, torch.Tensor) and val.dtype == torch.float16 else val


def fp32_to_fp16(val: Any) -> Any:
    """float32 tensors in ``val`` (a tensor or nested tuples/lists) cast to float16."""
    return conversion_helper(val, _half)


def fp16_to_fp32(val: Any) -> Any:
    """float16 tensors in ``val`` (a tensor or nested tuples/lists) cast to float32."""
    return conversion_helper(val, _float)


class FP16_Module(nn.Module):
    """Run ``module`` in fp16 behind fp32 inputs and outputs (see the module docstring)."""

    module: nn.Module  # registered by add_module: a submodule, not what nn.Module.__getattr__ may return

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.add_module("module", module.half())

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        return fp16_to_fp32(self.module(*fp32_to_fp16(inputs), **kwargs))
