"""fp16kit.nn: modules and functions with the numerics apex's fused layers had, on any device.

- norms with apex's dtype contract (fp32 statistics; ``Mixed*``: output in the weight's dtype):
  :class:`MixedLayerNorm`, :class:`RMSNorm`, :class:`MixedRMSNorm` and their functional forms;
- :class:`SyncBatchNorm`: batch norm over every rank's batch (any backend, unequal batches,
  channel-last, residual ``z`` and fused ReLU), :func:`convert_sync_batchnorm`;
- :func:`weight_norm`: ``g * v / ||v||`` in fp32 as one autograd Function.
"""

from .norm import (
    MixedLayerNorm,
    MixedRMSNorm,
    RMSNorm,
    layer_norm,
    mixed_layer_norm,
    mixed_rms_norm,
    rms_norm,
)
from .sync_batch_norm import SyncBatchNorm, convert_sync_batchnorm
from .weight_norm import WeightNorm, weight_norm

__all__ = [
    "MixedLayerNorm",
    "MixedRMSNorm",
    "RMSNorm",
    "SyncBatchNorm",
    "WeightNorm",
    "convert_sync_batchnorm",
    "layer_norm",
    "mixed_layer_norm",
    "mixed_rms_norm",
    "rms_norm",
    "weight_norm",
]
