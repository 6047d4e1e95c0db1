"""The master-grad path in one pass: 16-bit model grads -> unscaled fp32 master grads, and the non-finite flag.

For every pair, in one pass over the source (on the CPU, OpenMP over 64K-element chunks of all tensors)::

    dst = float(src) * inv_scale          (no multiply when inv_scale == 1, as torch)
    found_inf = 1 if src holds inf/NaN    (only ever set)

Bit for bit what ``torch._foreach_copy_(dsts, srcs)`` then ``torch._amp_foreach_non_finite_check_and_unscale_(dsts,
found_inf, inv_scale)`` leave, and the same flag (tested on every 16-bit pattern), with one exception: a NaN source
gives a NaN whose payload may differ. torch's fp16 -> fp32 copy keeps a NaN's sign and payload in its vector body
(the hardware conversion) but writes 0x7fffffff in its scalar tails, whose places depend on the tensor's size and on
how torch splits the copy between threads; the kernel always converts as the hardware does. A NaN master grad only
exists in a step that is skipped. 2 B read and 4 written per element where the two ops read and write 10, and one
call for all the tensors.

:func:`unscale_to_` takes the pairs when all hold -- the kernel is on (:mod:`~fp16kit.core.fused.build`), every
tensor is on the CPU and contiguous, the sources share one 16-bit dtype, the destinations are float32 of the same
sizes, ``inv_scale`` and ``found_inf`` are float32 0-dim CPU tensors -- and otherwise returns False with nothing
changed (the caller runs torch's ops).
"""

from __future__ import annotations

import functools
import itertools
import operator
from collections.abc import Sequence

import torch

from .abi import CHUNK, CPU, KIND, Traffic, library, p64, pf

__all__ = ["unscale_to_"]

UNSCALE_BYTES = 6
"""Bytes the master-grad pass reads and writes per element (2 + 4)."""

MIN_MEAN_NUMEL = 4096
"""Below this mean tensor size torch's two multi-tensor ops are as fast or faster: they walk the tensors in C++,
the kernel's caller reads their addresses in Python. Measured here (2 threads, one call): 8000 x 1k 13.9 ms
through the kernel vs 10 ms through torch's ops, 4000 x 2k even, 2000 x 4k 4.1 vs 4.9 ms, 1000 x 8k 2.3 vs 3.9,
40 x 1M 7.9 vs 13.6."""


def unscale_to_(
    srcs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor], inv_scale: torch.Tensor, found_inf: torch.Tensor
) -> bool:
    """``dst = float(src) * inv_scale`` for every pair and the non-finite flag, in one pass; False: not taken.

    See the module docstring for when it takes the pairs; False changes nothing. Also False for tensors of fewer
    than :data:`MIN_MEAN_NUMEL` elements on average: there the Python that reads their addresses costs more than
    the pass saves (torch's multi-tensor ops walk them in C++)."""
    lib = library()
    n = len(srcs)
    if lib is None or not n or len(dsts) != n:
        return False
    for t in (inv_scale, found_inf):
        if t.dtype is not torch.float32 or t.device != CPU or t.dim() != 0:
            return False
    dtype = srcs[0].dtype
    kind = KIND.get(dtype)
    numels = list(map(_numel, srcs))
    total = sum(numels)
    if kind is None or total < MIN_MEAN_NUMEL * n:
        return False
    same = functools.partial(map, operator.is_)
    if not (
        all(same(map(_dtype, srcs), itertools.repeat(dtype)))
        and all(same(map(_dtype, dsts), itertools.repeat(torch.float32)))
        and numels == list(map(_numel, dsts))
        and all(map(operator.eq, map(_device, srcs), itertools.repeat(CPU)))
        and all(map(operator.eq, map(_device, dsts), itertools.repeat(CPU)))
        and all(map(_contiguous, srcs))
        and all(map(_contiguous, dsts))
    ):
        return False
    pairs = torch.tensor([list(map(_data_ptr, srcs)), list(map(_data_ptr, dsts))], dtype=torch.int64).t().contiguous()
    numel = torch.tensor(numels, dtype=torch.int64)
    chunk_start = torch.tensor([0, *itertools.accumulate(-(-k // CHUNK) for k in numels)], dtype=torch.int64)
    lib.fp16kit_unscale_to(
        n, p64(pairs), p64(numel), p64(chunk_start), CHUNK, kind, pf(inv_scale), pf(found_inf),
        torch.get_num_threads(),
    )  # fmt: skip
    Traffic.bytes += UNSCALE_BYTES * total
    return True


_numel = torch.Tensor.numel
_data_ptr = torch.Tensor.data_ptr
_contiguous = torch.Tensor.is_contiguous
_dtype = operator.attrgetter("dtype")
_device = operator.attrgetter("device")
