"""fp16kit: mixed-precision training for PyTorch.

Modern face: :class:`fp16kit.GradScaler` (a drop-in for ``torch.amp.GradScaler``).
Core: :mod:`fp16kit.core` (kernels, loss-scale state).
"""

from .core.scale import LossScale
from .grad_scaler import GradScaler, OptState

__version__ = "0.1.0"

__all__ = ["GradScaler", "LossScale", "OptState", "__version__"]
