"""apex.contrib.optimizers -> fp16kit.legacy.contrib.optimizers: the fused-era ``FP16_Optimizer``.

And the optimizers it drives (the legacy ``FusedAdam``, ``FusedSGD``)."""

from .fp16_optimizer import FP16_Optimizer
from .fused_adam import FusedAdam
from .fused_sgd import FusedSGD

__all__ = ["FP16_Optimizer", "FusedAdam", "FusedSGD"]
