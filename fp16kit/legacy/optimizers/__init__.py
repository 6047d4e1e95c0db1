"""apex.optimizers -> fp16kit.legacy.optimizers: apex's fused optimizers as facades over :mod:`fp16kit.optim`.

The facades run on CPU and CUDA, with no extension; the fused-era ``FP16_Optimizer`` is here too.

``FusedMixedPrecisionLamb`` (2022) is not provided: importing it raises ImportError naming
``FusedLAMB`` inside ``fp16kit.MixedPrecisionOptimizer``.
"""

from __future__ import annotations

from typing import Any

from .fp16_optimizer import FP16_Optimizer
from .fused_adagrad import FusedAdagrad
from .fused_adam import FusedAdam
from .fused_lamb import FusedLAMB
from .fused_novograd import FusedNovoGrad
from .fused_sgd import FusedSGD

__all__ = ["FP16_Optimizer", "FusedAdagrad", "FusedAdam", "FusedLAMB", "FusedNovoGrad", "FusedSGD"]


def __getattr__(name: str) -> Any:
    if name == "FusedMixedPrecisionLamb":
        raise ImportError(
            "apex's FusedMixedPrecisionLamb is not provided by fp16kit: use "
            "fp16kit.MixedPrecisionOptimizer(fp16kit.legacy.optimizers.FusedLAMB(model.parameters(), ...)) "
            "for LAMB with fp32 master weights of an fp16/bf16 model."
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
