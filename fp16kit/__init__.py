"""fp16kit: mixed-precision training for PyTorch.

Modern face: :class:`fp16kit.GradScaler` (a drop-in for ``torch.amp.GradScaler``) and
:class:`fp16kit.MixedPrecisionOptimizer` (fp32 masters for fp16/bf16 models, steps optionally
on the :class:`fp16kit.OptimizerThread`).
Core: :mod:`fp16kit.core` (kernels, loss-scale state).
"""

import warnings

with warnings.catch_warnings():
    # torch installed without numpy warns "Failed to initialize NumPy" when first imported;
    # fp16kit never uses numpy, so its users (and `fp16kit demo`'s first line) need not see it
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
    import torch  # noqa: F401

from .core.scale import LossScale
from .core.thread import OptimizerThread, optimizer_thread
from .scaler.grad_scaler import GradScaler, OptState
from .master_weights.optimizer import MixedPrecisionOptimizer

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
