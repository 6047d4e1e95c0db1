"""apex.normalization as ``fp16kit.legacy.normalization``: apex's fused layer and RMS norms.

apex.normalization: change ``from apex.normalization import ...`` to
``from fp16kit.legacy.normalization import ...`` (FusedLayerNorm, MixedFusedLayerNorm,
FusedRMSNorm, MixedFusedRMSNorm; see :mod:`.fused_layer_norm`)."""

from . import fused_layer_norm
from .fused_layer_norm import FusedLayerNorm, FusedRMSNorm, MixedFusedLayerNorm, MixedFusedRMSNorm

__all__ = ["FusedLayerNorm", "FusedRMSNorm", "MixedFusedLayerNorm", "MixedFusedRMSNorm", "fused_layer_norm"]
