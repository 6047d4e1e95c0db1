"""apex.amp.lists.tensor_overrides: the ``torch.Tensor`` methods and operators O1 casts.

Plain lists, read by the next O1 ``amp.initialize`` / ``amp.init()``. As in apex, each list is
built at import from the names below that ``torch.Tensor`` has, followed by the names of the
same list of :mod:`.torch_overrides` that are ``Tensor`` methods too (``exp``, ``sum``, ``add``,
...): removing a name from ``torch_overrides`` changes ``torch.<name>`` only, ``x.<name>()``
keeps this module's entry.
"""

import torch

from . import torch_overrides

MODULE = torch.Tensor

FP16_FUNCS = [name for name in ("__matmul__",) if hasattr(MODULE, name)]

FP32_FUNCS = [
    name
    for name in (
        "__ipow__",
        "__pow__",
        "__rpow__",
        # cast to fp32 before the transfer to the CPU
        "cpu",
    )
    if hasattr(MODULE, name)
]

CASTS = [
    name
    for name in (
        "__add__",
        "__div__",
        "__eq__",
        "__ge__",
        "__gt__",
        "__iadd__",
        "__idiv__",
        "__imul__",
        "__isub__",
        "__itruediv__",
        "__le__",
        "__lt__",
        "__mul__",
        "__ne__",
        "__radd__",
        "__rdiv__",
        "__rmul__",
        "__rsub__",
        "__rtruediv__",
        "__sub__",
        "__truediv__",
    )
    if hasattr(MODULE, name)
]

SEQUENCE_CASTS: list[str] = []

for _own, _torchs in (
    (FP16_FUNCS, torch_overrides.FP16_FUNCS),
    (FP32_FUNCS, torch_overrides.FP32_FUNCS),
    (CASTS, torch_overrides.CASTS),
):
    _own.extend(name for name in _torchs if hasattr(MODULE, name))
del _own, _torchs
