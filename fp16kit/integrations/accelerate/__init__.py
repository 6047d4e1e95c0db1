"""HF Accelerate: ``MasterWeightsAccelerator`` (fp32 masters for an fp16/bf16 model). See :mod:`.plugin`."""

from .plugin import MasterWeightsAcceleratedOptimizer, MasterWeightsAccelerator

__all__ = ["MasterWeightsAccelerator", "MasterWeightsAcceleratedOptimizer"]
