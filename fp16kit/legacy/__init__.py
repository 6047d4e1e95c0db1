"""fp16kit.legacy: apex's API on fp16kit's core, for code written before apex deleted it.

Change ``from apex.fp16_utils import ...`` to ``from fp16kit.legacy import ...`` (and
``from apex import amp`` to ``from fp16kit.legacy import amp``, ``apex.optimizers`` to
``fp16kit.legacy.optimizers``, and so on -- ``fp16kit migrate`` does it for you, and
``fp16kit run`` runs a script unmodified): the names, signatures and numbers are apex's, minus
the bugs listed in MIGRATION.md. This package is ``apex.fp16_utils`` (both eras, plus the 2018
names); its subpackages are the other apex modules: :mod:`.amp`, :mod:`.optimizers`,
:mod:`.contrib.optimizers`, :mod:`.parallel`, :mod:`.normalization`, :mod:`.multi_tensor_apply`,
and Megatron-LM v1's copied ``fp16`` package, :mod:`.megatron`. Checkpoints written by
apex-era code load through :func:`load_checkpoint`. It holds no tensor math of its own: that
runs in :mod:`fp16kit.core` and the modern face (:mod:`fp16kit.optim`, :mod:`fp16kit.nn`,
:mod:`fp16kit.distributed`).
"""

from . import (
    amp,
    contrib,
    fp16_optimizer,
    fp16util,
    loss_scaler,
    megatron,
    multi_tensor_apply,
    normalization,
    optimizers,
    parallel,
)
from .alias import install_apex_alias, uninstall_apex_alias
from .checkpoint import load_checkpoint
from .fp16_module import FP16_Module, fp16_to_fp32, fp32_to_fp16
from .fp16_optimizer import FP16_Optimizer
from .fp16util import (
    BN_convert_float,
    FP16Model,
    clip_grad_norm,
    convert_module,
    convert_network,
    master_params_to_model_params,
    model_grads_to_master_grads,
    network_to_half,
    prep_param_lists,
    to_python_float,
    tofp16,
)
from .fused_weight_norm import Fused_Weight_Norm
from .loss_scaler import DynamicLossScaler, LossScaler

__all__ = [
    "BN_convert_float",
    "DynamicLossScaler",
    "FP16Model",
    "FP16_Module",
    "FP16_Optimizer",
    "Fused_Weight_Norm",
    "LossScaler",
    "amp",
    "clip_grad_norm",
    "contrib",
    "convert_module",
    "convert_network",
    "fp16_optimizer",
    "fp16_to_fp32",
    "fp16util",
    "fp32_to_fp16",
    "install_apex_alias",
    "load_checkpoint",
    "loss_scaler",
    "master_params_to_model_params",
    "megatron",
    "model_grads_to_master_grads",
    "multi_tensor_apply",
    "network_to_half",
    "normalization",
    "optimizers",
    "parallel",
    "prep_param_lists",
    "to_python_float",
    "tofp16",
    "uninstall_apex_alias",
]
