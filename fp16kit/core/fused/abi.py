"""The C kernels' interface (master_adam.c): the library with its signatures, and the values passed to it.

Everything that calls into the built library goes through here: :func:`library` (None when the kernels are
off), the element kinds, the chunking of the parallel work, the pointer and scalar casts, the hyperparameter
struct, and the bytes the calls move (:class:`Traffic`).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Mapping
from typing import Any

import torch

from . import build

__all__ = ["CHUNK", "F32_GRADS", "KIND", "Traffic", "hyper_of", "is_cpu_scalar", "library", "p64", "pf"]

logger = logging.getLogger("fp16kit")

CHUNK = 1 << 16
"""Elements per parallel work item (a multiple of 16: torch's body/tail split is per tensor)."""

KIND = {torch.float16: 0, torch.bfloat16: 1}
F32_GRADS = 2  # the kernel's grad kind for float32 grads
CPU = torch.device("cpu")


class Group(ctypes.Structure):
    _fields_ = [
        *((n, ctypes.c_double) for n in ("lr", "beta1", "beta2", "eps", "weight_decay")),
        *((n, ctypes.c_int32) for n in ("mode", "body", "tail", "vl", "tail8")),
    ]


_P64 = ctypes.POINTER(ctypes.c_int64)
_PF = ctypes.POINTER(ctypes.c_float)


class Traffic:
    """Bytes the kernels read and wrote in this process (for ``fp16kit bench``: the op observer cannot see into them).

    Counted from what each call touches: a step 28 B per element (the 16-bit grad and param, the fp32 master,
    exp_avg and exp_avg_sq), a skipped step nothing; a check 2 B per element. Plain integers, not thread-safe:
    a figure for one thread's measured iteration."""

    bytes = 0


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built kernel with its signatures, or None (off; the reason was logged)."""
    lib = build.load("master_adam")
    if lib is None:
        return None
    if not lib.fp16kit_cpu_supported():
        logger.warning(
            "fp16kit: the fused master_adam kernel is off (this CPU lacks AVX2/FMA/F16C); using torch's ops."
        )
        return None
    lib.fp16kit_master_adam.argtypes = [
        ctypes.c_int64, _P64, _P64, _P64, ctypes.c_int64, ctypes.POINTER(Group), ctypes.c_int32, ctypes.c_int32,
        ctypes.c_int32, _PF, _PF, ctypes.c_int32,
    ]  # fmt: skip
    lib.fp16kit_master_adam.restype = ctypes.c_int32  # 1: stepped, 0: skipped (found_inf)
    lib.fp16kit_check_finite.argtypes = [
        ctypes.c_int64, _P64, _P64, _P64, ctypes.c_int64, ctypes.c_int32, _PF, ctypes.c_int32,
    ]  # fmt: skip
    lib.fp16kit_check_finite.restype = None
    lib.fp16kit_unscale_to.argtypes = [
        ctypes.c_int64, _P64, _P64, _P64, ctypes.c_int64, ctypes.c_int32, _PF, _PF, ctypes.c_int32,
    ]  # fmt: skip
    lib.fp16kit_unscale_to.restype = None
    return lib


def p64(t: torch.Tensor) -> Any:
    return ctypes.cast(t.data_ptr(), _P64)


def is_cpu_scalar(t: torch.Tensor) -> bool:
    """Can the kernels take ``t`` as a scalar (a flag, a scale): float32, one element, on the CPU?"""
    return t.dtype == torch.float32 and t.device.type == "cpu" and t.numel() == 1


def pf(t: torch.Tensor | None) -> Any:
    if t is None:
        return None
    if not is_cpu_scalar(t):
        raise ValueError(f"expected a float32 CPU scalar tensor, got {t.dtype} {tuple(t.shape)} on {t.device}")
    return ctypes.cast(t.data_ptr(), _PF)


def hyper_of(group: Mapping[str, Any], found: tuple[int, int, int, int], *, decoupled: bool) -> Group:
    beta1, beta2 = group["betas"]
    vl, body, tail, tail8 = found
    return Group(
        float(group["lr"]), float(beta1), float(beta2), float(group["eps"]), float(group["weight_decay"]),
        1 if decoupled else 0, body, tail, vl, tail8,
    )  # fmt: skip
