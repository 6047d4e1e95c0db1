"""apex.amp.lists.torch_overrides: the ``torch`` names O1 casts.

Plain lists, read by the next O1 ``amp.initialize`` / ``amp.init()``. ``CASTS`` are promoted
(fp16 and fp32 arguments together -> all fp32), ``SEQUENCE_CASTS`` likewise across the tensors
of their list argument (``torch.cat``). apex put the batched matmuls on the FP16 list when CUDA
was at least 9.1, which every torch that runs fp16kit has.
"""

import torch

MODULE = torch

FP16_FUNCS = [
    # the functions torch.nn layers call with their weights
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_transpose1d",
    "conv_transpose2d",
    "conv_transpose3d",
    "conv_tbc",
    "prelu",
    # BLAS
    "addmm",
    "addmv",
    "addr",
    "matmul",
    "mm",
    "mv",
    "addbmm",
    "baddbmm",
    "bmm",
]

FP32_FUNCS = [
    # pointwise
    "acos",
    "asin",
    "cosh",
    "erfinv",
    "exp",
    "expm1",
    "log",
    "log10",
    "log2",
    "reciprocal",
    "rsqrt",
    "sinh",
    "tan",
    # other math
    "pow",
    # reductions ('mean' only before torch 1.1)
    "cumprod",
    "cumsum",
    "dist",
    "norm",
    "prod",
    "std",
    "sum",
    "var",
    # misc
    "renorm",
]

CASTS = [
    # multi-tensor math
    "addcdiv",
    "addcmul",
    "atan2",
    "cross",
    "bilinear",
    "dot",
    # element-wise or tensor-wise math
    "add",
    "div",
    "mul",
    # comparisons
    "eq",
    "equal",
    "ge",
    "gt",
    "le",
    "lt",
    "ne",
]

SEQUENCE_CASTS = [
    "cat",
    "stack",
]
