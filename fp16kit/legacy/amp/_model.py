"""What ``amp.initialize`` does to models (spec/amp.md §2.7-8, §4): the incoming checks, the
cast (``convert_network`` keeps affine BatchNorm in fp32), the forward casting of inputs and
outputs, and the state-dict hook that makes ``model.state_dict()`` fp32.

Forward casting is a forward pre-hook and a forward hook made of picklable module-level
objects (apex replaced ``forward`` with a closure, §13.5): ``copy.deepcopy(model)`` casts for
the copy, DataParallel replicas run themselves, the model pickles; namedtuples and Mapping
types come back as their own type.
"""

from __future__ import annotations

import collections.abc
import weakref
from typing import Any

import torch
from torch import nn

from ...core import kernels
from ..fp16util import convert_network

__all__ = ["CastHook", "OutputCastHook", "RefreshMastersHook", "check_models", "check_params", "cast_models", "to_type"]

_HALF = (torch.float16, torch.bfloat16)


def to_type(dtype: torch.dtype, x: Any) -> Any:
    """apex's ``applier(x, to_type(dtype))``: floating tensors -> ``dtype``; strings and
    numpy arrays untouched; objects with ``.to`` -> ``x.to(dtype)``; Mappings and other
    iterables walked, keeping their type (namedtuples too); anything else untouched."""
    if isinstance(x, torch.Tensor):
        return x.to(dtype) if x.is_floating_point() else x
    if isinstance(x, (str, bytes)) or type(x).__module__ == "numpy":
        return x
    if hasattr(x, "to"):
        return x.to(dtype)
    if isinstance(x, collections.abc.Mapping):
        items = [(to_type(dtype, k), to_type(dtype, v)) for k, v in x.items()]
        return _rebuild_mapping(x, items)
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # namedtuple
        return type(x)(*(to_type(dtype, v) for v in x))
    if isinstance(x, collections.abc.Iterable) and not isinstance(x, collections.abc.Iterator):
        return type(x)(to_type(dtype, v) for v in x)
    return x


def _rebuild_mapping(x: Any, items: list[tuple[Any, Any]]) -> Any:
    try:
        return type(x)(items)
    except Exception:  # a Mapping type that cannot be built from pairs (e.g. HF ModelOutput)
        pass
    try:
        new = type(x).__new__(type(x))
        if isinstance(new, dict):
            dict.update(new, items)
            new.__dict__.update(getattr(x, "__dict__", {}))
            for k, v in items:  # dataclass-like outputs mirror keys as attributes
                if k in new.__dict__:
                    new.__dict__[k] = v
            return new
    except Exception:
        pass
    return dict(items)


class CastHook:
    """Forward pre-hook: cast args and kwargs to ``dtype`` (picklable)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return to_type(self.dtype, args), to_type(self.dtype, kwargs)


class OutputCastHook:
    """Forward hook: cast the output to ``dtype`` (picklable)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __call__(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        return to_type(self.dtype, output)


def fp32_state_dict_hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """This module's own fp16/bf16 params and buffers in ``state_dict`` -> fp32 (apex walked
    the whole dict once per module)."""
    for name in (*module._parameters, *module._buffers):
        key = prefix + name
        v = state_dict.get(key)
        if isinstance(v, torch.Tensor) and v.dtype in _HALF:
            state_dict[key] = v.float()


class RefreshMastersHook:
    """``model.load_state_dict`` post hook: masters of the amp optimizers that no longer round
    to the loaded fp16 weights are rebuilt from them (§12 FIX; apex left them stale). Holds
    weak references; a copy or pickle of the model is tied to no optimizer."""

    def __init__(self, optimizers: list[Any]) -> None:
        self._refs = [weakref.ref(o) for o in optimizers]

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._refs = []

    def __call__(self, module: nn.Module, incompatible_keys: Any) -> None:
        for ref in self._refs:
            opt = ref()
            groups = None if opt is None else getattr(getattr(opt, "_amp_stash", None), "master_groups", None)
            if groups is not None and groups.masters.masters:
                kernels.refresh_stale_masters_(groups.masters.model_params, groups.masters.masters)


def check_models(models: list[Any]) -> None:
    for model in models:
        parallel = None
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            parallel = "torch.nn.parallel.DistributedDataParallel"
        elif isinstance(model, torch.nn.parallel.DataParallel):
            parallel = "torch.nn.parallel.DataParallel"
        elif type(model).__name__ == "DistributedDataParallel":
            parallel = "apex.parallel.DistributedDataParallel"
        if parallel is not None:
            raise RuntimeError(
                "Incoming model is an instance of {}. ".format(parallel)
                + "Parallel wrappers should only be applied to the model(s) AFTER \n"
                "the model(s) have been returned from amp.initialize."
            )


def check_params(models: list[nn.Module]) -> None:
    """apex's fp32 check; CPU models are allowed (FIX), fp16 ones are refused with apex's text."""
    for model in models:
        for kind, named in (("param", model.named_parameters()), ("buffer", model.named_buffers())):
            for name, t in named:
                if t.is_floating_point() and t.dtype == torch.float16:
                    raise RuntimeError(
                        "Found {} {} with type {}, expected torch.cuda.FloatTensor.\n"
                        "When using amp.initialize, you do not need to call .half() on your model\n"
                        "before passing it, no matter what optimization level you choose.".format(kind, name, t.type())
                    )


def cast_models(models: list[nn.Module], properties: Any, cast_model_outputs: torch.dtype | None) -> None:
    dtype = properties.cast_model_type
    if dtype:
        for model in models:
            if properties.keep_batchnorm_fp32:
                convert_network(model, dtype)
            else:
                model.to(dtype)
            model.register_forward_pre_hook(CastHook(dtype), with_kwargs=True)
            model.register_forward_hook(OutputCastHook(cast_model_outputs or torch.float32))
            for module in model.modules():
                module.register_state_dict_post_hook(fp32_state_dict_hook)
    elif cast_model_outputs is not None:
        for model in models:
            model.register_forward_hook(OutputCastHook(cast_model_outputs))
