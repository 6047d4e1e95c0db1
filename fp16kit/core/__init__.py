"""fp16kit's core: the machinery both faces (modern and legacy) stand on.

* :mod:`fp16kit.core.kernels` -- the one unscale path (multi-tensor, no host sync).
* :mod:`fp16kit.core.scale` -- the loss-scale state machine, kept on the device.

The core imports neither face.
"""

from .scale import LossScale

__all__ = ["LossScale"]
