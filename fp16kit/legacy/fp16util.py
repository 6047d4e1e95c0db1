"""apex.fp16_utils.fp16util: model conversion and master-param helpers, apex's names.

Fixes over apex: ``FP16Model`` casts only floating-point inputs (apex also cast integer index
tensors, which broke embeddings); ``prep_param_lists(flat_master=True)`` allocates the flat
master grad as zeros (apex left it uninitialised) and refuses mixed dtypes with a clear error;
``to_python_float`` accepts Python numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ..core import kernels
from ..core.master import MasterParams
from .fp16_module import FP16_Module, conversion_helper, fp16_to_fp32, fp32_to_fp16  # 2018's fp16util held them
from .loss_scaler import to_python_float

__all__ = [
    "BN_convert_float",
    "FP16Model",
    "FP16_Module",
    "conversion_helper",
    "fp16_to_fp32",
    "fp32_to_fp16",
    "clip_grad_norm",
    "convert_module",
    "convert_network",
    "master_params_to_model_params",
    "model_grads_to_master_grads",
    "network_to_half",
    "prep_param_lists",
    "to_python_float",
    "tofp16",
]

clip_grad_norm = torch.nn.utils.clip_grad_norm_


class tofp16(nn.Module):
    """A module whose forward returns ``input.half()``."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return input.half()


def BN_convert_float(module: nn.Module) -> nn.Module:
    """Recursively turn every affine BatchNorm back to float32 (cuDNN wants fp32 BN params)."""
    if isinstance(module, _BatchNorm) and module.affine is True:
        module.float()
    for child in module.children():
        BN_convert_float(child)
    return module


def network_to_half(network: nn.Module) -> nn.Sequential:
    """Return ``nn.Sequential(tofp16(), BN_convert_float(network.half()))``.

    ``nn.Sequential(tofp16(), BN_convert_float(network.half()))``: state-dict keys of the
    network gain a ``1.`` prefix, as with apex."""
    return nn.Sequential(tofp16(), BN_convert_float(network.half()))


def convert_module(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Convert the module's own floating-point params, grads and buffers to ``dtype``.

    Convert the module's own floating-point params, their grads and its floating-point
    buffers to ``dtype`` (not its children's)."""
    for param in module.parameters(recurse=False):
        if param is not None:
            if param.data.dtype.is_floating_point:
                param.data = param.data.to(dtype=dtype)
            if param._grad is not None and param._grad.data.dtype.is_floating_point:
                param._grad.data = param._grad.data.to(dtype=dtype)
    for buf in module.buffers(recurse=False):
        if buf is not None and buf.data.dtype.is_floating_point:
            buf.data = buf.data.to(dtype=dtype)
    return module


def convert_network(network: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Convert every module but affine BatchNorms to ``dtype``; re-flatten RNN weights."""
    for module in network.modules():
        if isinstance(module, _BatchNorm) and module.affine is True:
            continue
        convert_module(module, dtype)
        if isinstance(module, nn.RNNBase):
            module.flatten_parameters()
    return network


class FP16Model(nn.Module):
    """Run a network in fp16.

    ``self.network = convert_network(network, torch.half)``; floating positional inputs
    are cast to half, other inputs (e.g. token ids) pass unchanged."""

    def __init__(self, network: nn.Module) -> None:
        super().__init__()
        self.network = convert_network(network, dtype=torch.half)

    def forward(self, *inputs: Any) -> Any:
        inputs = tuple(t.half() if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in inputs)
        return self.network(*inputs)


def prep_param_lists(model: nn.Module, flat_master: bool = False) -> tuple[list[nn.Parameter], list[torch.Tensor]]:
    """Return ``(model_params, master_params)`` for the model's trainable params.

    fp32 copies with ``requires_grad=True``, or with ``flat_master=True`` one flat fp32
    ``nn.Parameter`` holding them all (its grad allocated as zeros)."""
    model_params = [param for param in model.parameters() if param.requires_grad]
    if flat_master:
        dtypes = sorted({str(p.dtype) for p in model_params})
        if len(dtypes) > 1:
            raise TypeError(
                "prep_param_lists(flat_master=True) needs all trainable params of one dtype, got "
                f"{', '.join(dtypes)}. Use flat_master=False, or fp16kit.legacy.FP16_Optimizer."
            )
        master = nn.Parameter(kernels.flatten([p.detach() for p in model_params], dtype=torch.float32))
        master.grad = torch.zeros_like(master)
        return model_params, [master]
    masters = MasterParams(model_params).masters
    return model_params, masters


def model_grads_to_master_grads(
    model_params: Sequence[torch.Tensor],
    master_params: Sequence[torch.Tensor],
    flat_master: bool = False,
) -> None:
    """Copy model grads into master grads (no unscaling).

    Non-flat: a missing model grad sets the master grad to None. Flat: a missing model
    grad counts as zeros."""
    if flat_master:
        flat = master_params[0]
        if flat.grad is None:
            flat.grad = torch.zeros_like(flat)
        views = kernels.flat_views(flat.grad, model_params)
        srcs = [p.grad if p.grad is not None else torch.zeros_like(p) for p in model_params]
        kernels.copy_to_(srcs, views)
        return
    srcs, dsts = [], []
    for model, master in zip(model_params, master_params):
        if model.grad is not None:
            if master.grad is None:
                master.grad = torch.empty_like(master)
            srcs.append(model.grad)
            dsts.append(master.grad)
        else:
            master.grad = None
    kernels.copy_to_(srcs, dsts)


def master_params_to_model_params(
    model_params: Sequence[torch.Tensor],
    master_params: Sequence[torch.Tensor],
    flat_master: bool = False,
) -> None:
    """Copy master values into the model params (rounding to their dtype)."""
    if flat_master:
        masters = kernels.flat_views(master_params[0].detach(), model_params)
    else:
        masters = [m.detach() for m in master_params]
    pairs = list(zip(masters, model_params))  # apex zipped: extra entries are ignored
    kernels.copy_to_([m for m, _ in pairs], [p.detach() for _, p in pairs])
