"""fp16kit: mixed-precision training for PyTorch.

Modern face: :class:`fp16kit.GradScaler` (a drop-in for ``torch.amp.GradScaler``) and
:class:`fp16kit.MixedPrecisionOptimizer` (fp32 masters for fp16/bf16 models, steps optionally
on the :class:`fp16kit.OptimizerThread`).
Core: :mod:`fp16kit.core` (kernels, loss-scale state).
"""

import importlib as _importlib
import warnings as _warnings
from typing import Any as _Any

with _warnings.catch_warnings():
    # torch installed without numpy warns "Failed to initialize NumPy" when first imported;
    # fp16kit never uses numpy, so its users (and `fp16kit demo`'s first line) need not see it
    _warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
    import torch as _torch  # noqa: F401

from .core.scale import LossScale
from .core.thread import OptimizerThread, optimizer_thread
from .master_weights import MixedPrecisionOptimizer
from .scaler import GradScaler, OptState

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

# Reachable as attributes after ``import fp16kit``, imported on first use (none of them imports
# a framework: fp16kit.integrations' own submodules do, each when it is imported).
_SUBPACKAGES = ("core", "distributed", "integrations", "legacy", "master_weights", "nn", "optim", "scaler")


def __getattr__(name: str) -> _Any:
    if name in _SUBPACKAGES:
        return _importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'fp16kit' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*__all__, *_SUBPACKAGES])
