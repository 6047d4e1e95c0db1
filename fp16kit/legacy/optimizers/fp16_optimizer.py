"""apex.optimizers.fp16_optimizer (2018-12 to 2019-10): the fused-era ``FP16_Optimizer``.

One implementation serves both apex paths: see
:mod:`fp16kit.legacy.contrib.optimizers.fp16_optimizer`.
"""

from ..contrib.optimizers.fp16_optimizer import FP16_Optimizer

__all__ = ["FP16_Optimizer"]
