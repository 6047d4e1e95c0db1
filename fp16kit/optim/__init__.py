"""fp16kit.optim: the numerical optimizers torch lacks, or lacks in apex's form.

Each is a plain ``torch.optim.Optimizer`` (it also works inside
:class:`fp16kit.MixedPrecisionOptimizer`), written with torch's multi-tensor ops, grouped by
(device, dtype), with fp32 math on fp16/bf16 params and no host reads on the step path:

* :class:`LAMB` -- apex FusedLAMB's rule (global grad-norm clipping, per-tensor trust ratio).
* :class:`NovoGrad` -- apex FusedNovoGrad's rule (per-layer second moment).
* :class:`Adam` -- Adam/AdamW with apex FusedAdam's ``bias_correction`` flag, fp32 moments for
  low-precision params and one step count per param group (torch ``AdamW`` otherwise).
* :class:`LegacyAdam` -- the 2018-2019 FusedAdam rule (``eps_inside_sqrt``, per-group
  ``max_grad_norm``, ``step(grads=, output_params=, scale=, grad_norms=)``).
* :class:`Adagrad` -- with apex's decoupled ``adagrad_w_mode``.
* :class:`SGD` -- ``torch.optim.SGD`` plus apex's ``wd_after_momentum``.
* :class:`LARC` -- apex's layer-wise adaptive rate clipping, a wrapper around any optimizer.
"""

from .adagrad import Adagrad
from .adam import Adam
from .lamb import LAMB
from .larc import LARC
from .legacy_adam import LegacyAdam
from .novograd import NovoGrad
from .sgd import SGD

__all__ = ["Adagrad", "Adam", "LAMB", "LARC", "LegacyAdam", "NovoGrad", "SGD"]
