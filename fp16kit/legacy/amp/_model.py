"""What ``amp.initialize`` does to models (docs/apex-amp.md §2.7-8, §4).

The incoming checks, the cast (``convert_network`` keeps affine BatchNorm in fp32), the
forward casting of inputs and outputs, and the state-dict hook that makes
``model.state_dict()`` fp32.

Forward casting: the model's class becomes a subclass of its own class (same name, qualname
and module; ``isinstance`` holds) whose ``forward`` casts around the user's ``forward``. apex
replaced ``forward`` with a closure (§13.5); here ``model(x)`` and ``model.forward(x)`` both
cast, ``copy.deepcopy(model)`` and DataParallel replicas run themselves, the model pickles
(rebuilt from the user's class by name), ``forward.__func__`` exists, and namedtuples and
Mapping types come back as their own type.
"""

from __future__ import annotations

import collections.abc
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from ...core import kernels
from .._messages import float_type
from ..fp16util import convert_network

__all__ = ["amp_class", "RefreshMastersHook", "check_models", "check_params", "cast_models", "to_type"]

_HALF = (torch.float16, torch.bfloat16)


def to_type(dtype: torch.dtype, x: Any) -> Any:
    """apex's ``applier(x, to_type(dtype))``: cast floating tensors (walking containers) to ``dtype``.

    apex's ``applier(x, to_type(dtype))``: floating tensors -> ``dtype``; strings and
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
        rebuild: Callable[..., Any] = type(x)  # a concrete iterable class, built from its items
        return rebuild(to_type(dtype, v) for v in x)
    return x


def _rebuild_mapping(x: Any, items: list[tuple[Any, Any]]) -> Any:
    """The same Mapping type built from the walked pairs (OrderedDict, defaultdict-free dict
    subclasses, HF ModelOutput); a plain dict when the type cannot be built from pairs."""
    try:
        return type(x)(items)
    except Exception:
        return dict(items)


_AMP_CLASSES: dict[tuple[type, Any, Any], type] = {}


def amp_class(base: type, in_dtype: torch.dtype | None, out_dtype: torch.dtype) -> type:
    """The subclass of ``base`` whose ``forward`` casts its inputs and output around ``base.forward``.

    The subclass of ``base`` (same name and qualname) whose ``forward`` casts floating inputs
    to ``in_dtype`` (None: no input cast) and the output to ``out_dtype`` around ``base.forward``.
    Made once per (base, dtypes)."""
    key = (base, in_dtype, out_dtype)
    cls = _AMP_CLASSES.get(key)
    if cls is None:
        cls = type(
            base.__name__,
            (base,),
            {
                "forward": _amp_forward,
                "__reduce_ex__": _amp_reduce_ex,
                "_amp_cast_types": (in_dtype, out_dtype),
                "__module__": base.__module__,
                "__qualname__": base.__qualname__,
                "__doc__": base.__doc__,
            },
        )
        _AMP_CLASSES[key] = cls
    return cls


if TYPE_CHECKING:

    class _AmpModule(nn.Module):
        """What the classes :func:`amp_class` makes have beyond their base (for the type checker)."""

        _amp_cast_types: tuple[torch.dtype | None, torch.dtype]


def _amp_forward(self: _AmpModule, *args: Any, **kwargs: Any) -> Any:
    in_dtype, out_dtype = type(self)._amp_cast_types
    if in_dtype is not None:
        args, kwargs = to_type(in_dtype, args), to_type(in_dtype, kwargs)
    return to_type(out_dtype, super(type(self), self).forward(*args, **kwargs))


def _amp_reduce_ex(self: _AmpModule, protocol: int) -> Any:
    # pickle and deepcopy rebuild the amp class from the user's class (found by its name)
    # (the state is applied after the object exists: references back to it are kept)
    base = type(self).__bases__[0]
    return (_rebuild, (base, type(self)._amp_cast_types), self.__getstate__())


def _rebuild(base: type, cast_types: tuple[Any, Any]) -> nn.Module:
    cls = cast("type[nn.Module]", amp_class(base, *cast_types))  # a subclass of the user's module class
    return cls.__new__(cls)


def _set_casts(model: nn.Module, in_dtype: torch.dtype | None, out_dtype: torch.dtype) -> None:
    base = type(model)
    if "_amp_cast_types" in base.__dict__:
        base = base.__bases__[0]
    model.__class__ = amp_class(base, in_dtype, out_dtype)


def fp32_state_dict_hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """This module's own fp16/bf16 params and buffers in ``state_dict`` -> fp32.

    apex walked the whole dict once per module."""
    for name in (*module._parameters, *module._buffers):
        key = prefix + name
        v = state_dict.get(key)
        if isinstance(v, torch.Tensor) and v.dtype in _HALF:
            state_dict[key] = v.float()


class RefreshMastersHook:
    """A ``model.load_state_dict`` post hook that rebuilds stale amp masters from the loaded fp16 weights.

    ``model.load_state_dict`` post hook: masters of the amp optimizers that no longer round
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
                f"Incoming model is an instance of {parallel}. "
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
                        f"Found {kind} {name} with type {t.type()}, expected {float_type(t)}.\n"
                        "When using amp.initialize, you do not need to call .half() on your model\n"
                        "before passing it, no matter what optimization level you choose."
                    )


def cast_models(models: list[nn.Module], properties: Any, cast_model_outputs: torch.dtype | None) -> None:
    dtype = properties.cast_model_type
    if dtype:
        for model in models:
            if properties.keep_batchnorm_fp32:
                convert_network(model, dtype)
            else:
                model.to(dtype)
            _set_casts(model, dtype, cast_model_outputs or torch.float32)
            for module in model.modules():
                module.register_state_dict_post_hook(fp32_state_dict_hook)
    elif cast_model_outputs is not None:
        for model in models:
            _set_casts(model, None, cast_model_outputs)
