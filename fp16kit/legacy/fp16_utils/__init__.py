"""apex.fp16_utils's names exactly: what ``from apex.fp16_utils import *`` bound, in every era.

``fp16kit migrate`` rewrites ``apex.fp16_utils`` to this package and ``fp16kit run`` makes it
``apex.fp16_utils``, so a star import brings in apex's names (the 2018 and 2019+ ones) and
nothing else: fp16kit.legacy's own names (``amp``, ``optimizers``, ``parallel``,
``load_checkpoint``, ...) would shadow a script's variables of those names. The objects are
fp16kit.legacy's; this package only chooses which of them apex.fp16_utils exported.

apex.fp16_utils had no ``__all__``, so its star import bound every public name of its
``__init__``: the functions and classes it imported and the submodules those imports loaded
(``fp16util``, ``fp16_optimizer``, ``loss_scaler``; ``fused_weight_norm`` in 2018).
"""

from .. import fp16_optimizer, fp16util, fused_weight_norm, loss_scaler
from ..fp16_module import FP16_Module, fp16_to_fp32, fp32_to_fp16
from ..fp16_optimizer import FP16_Optimizer
from ..fp16util import (
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
from ..fused_weight_norm import Fused_Weight_Norm
from ..loss_scaler import DynamicLossScaler, LossScaler

__all__ = [
    # 2019+ (apex/fp16_utils/__init__.py until apex deleted it)
    "BN_convert_float",
    "DynamicLossScaler",
    "FP16Model",
    "FP16_Optimizer",
    "LossScaler",
    "clip_grad_norm",
    "convert_module",
    "convert_network",
    "master_params_to_model_params",
    "model_grads_to_master_grads",
    "network_to_half",
    "prep_param_lists",
    "to_python_float",
    "tofp16",
    # 2018: the fp16_optimizer module's helpers and the fused weight norm
    "FP16_Module",
    "Fused_Weight_Norm",
    "fp16_to_fp32",
    "fp32_to_fp16",
    # the submodules its imports loaded, which its star import bound too
    "fp16_optimizer",
    "fp16util",
    "fused_weight_norm",
    "loss_scaler",
]
