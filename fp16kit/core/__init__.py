"""fp16kit's core: the machinery both faces (modern and legacy) stand on.

* :mod:`fp16kit.core.kernels` -- the one unscale path (multi-tensor, no host sync).
* :mod:`fp16kit.core.scale` -- the loss-scale state machine, kept on the device; its rules
  (:mod:`~fp16kit.core.scale_rules`: torch's, apex's two), skip counting
  (:mod:`~fp16kit.core.skip_counter`) and the floor policy (:mod:`~fp16kit.core.floor`).
* :mod:`fp16kit.core.master` -- fp32 masters of low-precision params (per tensor or flat).
* :mod:`fp16kit.core.thread` -- the optimizer thread (FIFO, futures, errors delivered once).
* :mod:`fp16kit.core.protocol` -- the scaler <-> master-weight optimizer contract.

The core imports neither face.
"""

from .scale import LossScale

__all__ = ["LossScale"]
