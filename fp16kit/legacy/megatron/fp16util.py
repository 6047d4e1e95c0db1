"""Megatron-LM v1 ``fp16/fp16util.py``: apex's fp16util helpers with Megatron's ``clip_grad_norm``.

Megatron-LM v1 ``fp16/fp16util.py``: apex's fp16util helpers (the same functions as
:mod:`fp16kit.legacy.fp16util`) with Megatron's ``clip_grad_norm`` (``mpu.clip_grad_norm``).

``clip_grad_norm(parameters, max_norm, norm_type=2)``, as Megatron's model-parallel code::

    params = [p for p in parameters if p.grad is not None]
    if norm_type == inf:
        total = max(max |p.grad| for p in params)                 # every param, every rank
        total = all_reduce(float32(total), MAX, model-parallel group)
    else:
        total = sum(norm(p.grad, norm_type).item() ** norm_type    # a Python (double) sum
                    for p in params if p.model_parallel or model_parallel_rank == 0)
        total = all_reduce(float32(total), SUM, model-parallel group) ** (1 / norm_type)
    coef = max_norm / (total + 1e-6)                               # in double
    if coef < 1: p.grad *= coef for p in params
    return total                                                   # a Python float

Not bit-identical to ``torch.nn.utils.clip_grad_norm_`` (the float32 rounding of the sum, the
double root and coefficient); L1 and inf norms agree. Without Megatron's ``mpu`` there is one
model-parallel rank, unless ``model_parallel_group`` (a ``torch.distributed`` group) is given
and ``torch.distributed`` is initialised. A param without a ``model_parallel`` (or
``tensor_model_parallel``) attribute counts as not model-parallel (Megatron raised
AttributeError). With no grads the norm is 0.0 (Megatron's inf norm raised ValueError).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from ...core import kernels
from ..fp16util import (
    BN_convert_float,
    FP16Model,
    convert_module,
    convert_network,
    master_params_to_model_params,
    model_grads_to_master_grads,
    network_to_half,
    prep_param_lists,
    tofp16,
)
from ..loss_scaler import to_python_float

__all__ = [
    "BN_convert_float",
    "FP16Model",
    "clip_grad_norm",
    "convert_module",
    "convert_network",
    "master_params_to_model_params",
    "model_grads_to_master_grads",
    "network_to_half",
    "prep_param_lists",
    "to_python_float",
    "tofp16",
]


def _read(norms: list[torch.Tensor]) -> list[float]:
    """The 0-dim norms as Python floats, in order, with one host read per device (mpu read each
    with ``.item()``: one sync per tensor). The values are the same: every float dtype widens
    to float64 exactly."""
    out: list[float] = [0.0] * len(norms)
    by_device: dict[torch.device, list[int]] = {}
    for i, n in enumerate(norms):
        by_device.setdefault(n.device, []).append(i)
    for idx in by_device.values():
        for i, value in zip(idx, torch.stack([norms[i].double() for i in idx]).tolist()):
            out[i] = value
    return out


def _is_model_parallel(p: torch.Tensor) -> bool:
    return bool(getattr(p, "model_parallel", False) or getattr(p, "tensor_model_parallel", False))


def _reduced(value: float, device: torch.device, op: str, group: Any) -> float:
    """``value`` through a float32 buffer, all-reduced (``op``: "MAX" or "SUM") over ``group``
    when one is active (as Megatron's ``torch.cuda.FloatTensor([float(total)])``)."""
    buf = torch.tensor([value], dtype=torch.float32, device=device)
    if group is not None:
        torch.distributed.all_reduce(buf, op=getattr(torch.distributed.ReduceOp, op), group=group)
    return buf[0].item()


def clip_grad_norm(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2,
    *,
    model_parallel_group: Any = None,
) -> float:
    """Clip the grads of ``parameters`` by their total norm, Megatron's way.

    See the module docstring; returns the total norm as a Python float."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    params = [p for p in parameters if p.grad is not None]
    max_norm, norm_type = float(max_norm), float(norm_type)
    if not params:
        return 0.0
    device = params[0].grad.device  # type: ignore[union-attr]
    dist = torch.distributed
    group = model_parallel_group if dist.is_available() and dist.is_initialized() else None
    grads = [p.grad.detach() for p in params]  # type: ignore[union-attr]
    if norm_type == math.inf:
        largest = max(_read(kernels.norms(grads, math.inf)))
        total = _reduced(largest, device, "MAX", group)
    else:
        first_rank = group is None or dist.get_rank(group) == 0
        counted = [g for p, g in zip(params, grads) if _is_model_parallel(p) or first_rank]
        local = 0.0
        for n in _read(kernels.norms(counted, norm_type)):  # mpu summed each norm**p as a Python float
            local += n**norm_type
        total = _reduced(local, device, "SUM", group) ** (1.0 / norm_type)
    coef = max_norm / (total + 1e-6)
    if coef < 1:
        _multiply_(grads, coef, device)
    return total


_CHUNK = 1 << 25
"""Elements per :func:`kernels.scale_to_` call: it works on a float32 copy of its tensors."""


def _multiply_(grads: list[torch.Tensor], coef: float, device: torch.device) -> None:
    """``g *= coef`` in place, as Megatron multiplied each grad by the Python float: the product
    in float32 (float64 for float64 grads), rounded once. Megatron never checked the clipped
    grads, so the overflow flag the core's multiply raises is not read."""
    flag = kernels.new_overflow_buf(device)
    chunk: list[torch.Tensor] = []
    size = 0
    for g in grads:
        if chunk and size + g.numel() > _CHUNK:
            kernels.scale_to_(chunk, chunk, coef, flag)
            chunk, size = [], 0
        chunk.append(g)
        size += g.numel()
    kernels.scale_to_(chunk, chunk, coef, flag)
