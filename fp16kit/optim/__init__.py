"""fp16kit.optim: the numerical optimizers torch lacks, or lacks in apex's form.

Each is a plain ``torch.optim.Optimizer`` (it also works inside
:class:`fp16kit.MixedPrecisionOptimizer`) with no host reads on the step path. LAMB, NovoGrad,
Adam, LegacyAdam, Adagrad and SGD's own path use torch's multi-tensor ops, grouped by
(device, dtype), with fp32 math on fp16/bf16 params; SGD on fp32/fp64 params without
``wd_after_momentum`` is ``torch.optim.SGD.step`` itself; LARC is a per-param loop of torch
ops in each param's dtype (apex's numbers), in front of the optimizer it wraps:

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
