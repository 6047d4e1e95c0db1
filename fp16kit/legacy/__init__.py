"""fp16kit.legacy: apex.fp16_utils' API on fp16kit's core.

Change ``from apex.fp16_utils import ...`` to ``from fp16kit.legacy import ...``: the names,
signatures and numbers are apex's (its final, 2019-2025 behaviour for FP16_Optimizer), minus
the bugs listed in MIGRATION.md. Checkpoints written by apex-era code load through
:func:`load_checkpoint`. This package holds no tensor math of its own: all of it runs in
:mod:`fp16kit.core`.
"""

from . import amp, fp16_optimizer, fp16util, loss_scaler
from .checkpoint import load_checkpoint
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
from .loss_scaler import DynamicLossScaler, LossScaler

__all__ = [
    "BN_convert_float",
    "DynamicLossScaler",
    "FP16Model",
    "FP16_Optimizer",
    "LossScaler",
    "amp",
    "clip_grad_norm",
    "convert_module",
    "convert_network",
    "fp16_optimizer",
    "fp16util",
    "load_checkpoint",
    "loss_scaler",
    "master_params_to_model_params",
    "model_grads_to_master_grads",
    "network_to_half",
    "prep_param_lists",
    "to_python_float",
    "tofp16",
]
