"""fp16kit: mixed-precision training for PyTorch.

Modern face: :class:`fp16kit.GradScaler` (a drop-in for ``torch.amp.GradScaler``) and
:class:`fp16kit.MixedPrecisionOptimizer` (fp32 masters for fp16/bf16 models, steps optionally
on the :class:`fp16kit.OptimizerThread`).
Core: :mod:`fp16kit.core` (kernels, loss-scale state).
"""

from .core.scale import LossScale
from .core.thread import OptimizerThread, optimizer_thread
from .grad_scaler import GradScaler, OptState
from .optimizer import MixedPrecisionOptimizer

__version__ = "0.1.0"

__all__ = [
    "GradScaler",
    "LossScale",
    "MixedPrecisionOptimizer",
    "OptState",
    "OptimizerThread",
    "optimizer_thread",
    "__version__",
]
