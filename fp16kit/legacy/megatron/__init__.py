"""Megatron-LM v1's ``fp16`` package, as ``fp16kit.legacy.megatron``.

Megatron-LM v1's ``fp16`` package (``fp16/`` 2019-03 to 10, ``megatron/fp16/`` to 2020-12, and
the forks that copied it: THUDM/GLM, sentiment-discovery): ``from fp16 import ...`` and
``from megatron.fp16 import ...`` become ``from fp16kit.legacy.megatron import ...``.

As Megatron's ``__init__``: fp16util's names, and ``*`` of :mod:`.fp16` (``FP16_Module``,
``FP16_Optimizer``, ``fp32_to_fp16``, ``fp16_to_fp32``, ``conversion_helper``) and of
:mod:`.loss_scaler` (``LossScaler``, ``DynamicLossScaler``, ``to_python_float``). The submodules
``fp16``, ``fp16util`` and ``loss_scaler`` keep Megatron's module names. See
docs/apex-others.md §2 and MIGRATION.md for what differs.
"""

from . import fp16, fp16util, loss_scaler  # noqa: E402,F401
from .fp16 import *  # noqa: E402,F401,F403
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
from .loss_scaler import *  # noqa: E402,F401,F403

__all__ = [
    "BN_convert_float",
    "DynamicLossScaler",
    "FP16Model",
    "FP16_Module",
    "FP16_Optimizer",
    "LossScaler",
    "clip_grad_norm",
    "conversion_helper",
    "convert_module",
    "convert_network",
    "fp16_to_fp32",
    "fp32_to_fp16",
    "master_params_to_model_params",
    "model_grads_to_master_grads",
    "network_to_half",
    "prep_param_lists",
    "scaler_from_state",
    "to_python_float",
    "tofp16",
]
