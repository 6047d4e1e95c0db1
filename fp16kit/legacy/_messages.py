"""apex's type messages, told per device: apex accepted CUDA tensors only, so its texts name
``torch.cuda.*`` types. fp16kit also runs on the CPU, where those names would send the reader the
wrong way; there the same message names the dtypes fp16kit accepts instead."""

from __future__ import annotations

import torch


def float_or_half(t: torch.Tensor) -> str:
    """What apex's "must be either ..." messages list for ``t``'s device."""
    if t.is_cuda:
        return "torch.cuda.FloatTensor or torch.cuda.HalfTensor"
    return "float32, float16 or bfloat16 tensors (CPU or CUDA)"


def float_type(t: torch.Tensor) -> str:
    """The fp32 tensor type apex expected, named for ``t``'s device."""
    return "torch.cuda.FloatTensor" if t.is_cuda else "torch.FloatTensor"
