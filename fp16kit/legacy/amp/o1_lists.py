"""apex O1's op lists (:mod:`.lists`) on every device: a ``TorchFunctionMode`` above autocast.

O1 runs under ``torch.autocast(device, float16)`` (:mod:`.casts`), but autocast's lists are not
apex's, and they differ per device: CPU autocast runs ``exp``, ``sum``, ``softmax``, ``log`` and
``pow`` in their input's dtype, so on a Linear's fp16 output ``exp(scores / 0.05)`` overflows to
inf where apex ran it in fp32. :class:`ApexLists` is entered beside autocast on the thread that
enables O1. torch hands it every call of a ``torch`` function, ``Tensor`` method or operator
and ``torch.nn.functional`` function made from Python, before autocast sees it, and it applies
the rule apex's lists (``amp.lists``, as read at the last O1 initialize: :func:`install`) give
that function::

    FP16 lists  (matmul, mm, bmm, addmm, conv*, linear, prelu, RNNs and cells, ...)
        float32/bfloat16 args -> the autocast dtype (float16); a float32 leaf that requires grad
        (a parameter) is cast once and reused until clear() (apex's cast cache), unless it
        changed in place since; then the op with autocast off (softmax moved to FP16_FUNCS runs
        in fp16, also where autocast keeps it in fp32)
    FP32 lists  (exp, log, pow, sum, prod, cumsum, norm, softmax, log_softmax, gelu, layer_norm,
                 normalize, the losses, Tensor.cpu, ...)
        float16/bfloat16 args -> float32; then the op with autocast off (its inner ops in fp32)
    in-place forms of the FP32 names  (exp_, log_, pow_, ...)
        torch.exp_(...) with an fp16 arg, h.exp_() on an fp16 h -> NotImplementedError (apex's
        texts); otherwise the op as called
    CASTS, SEQUENCE_CASTS  (add, sub, mul, div, comparisons, addcmul, addcdiv, atan2, dot; cat, stack)
        float16/bfloat16 and float32 args together -> all float32 (torch keeps half for a 0-dim
        float32 tensor; apex did not); in-place ops (add_, h += f) are left to torch
    BANNED_FUNCS  (F.binary_cross_entropy)
        an fp16 arg -> NotImplementedError (the entry's text), unless amp.init(allow_banned=True);
        otherwise as its other list says, else as the FP32 lists (CUDA autocast would raise for
        fp32 inputs too)
    anything else: as autocast decides

A rule applies to the tensors on a device type O1 is on for, while autocast is on there:
``amp.disable_casts()`` and a script's own ``torch.autocast(..., enabled=False)`` turn it off
with autocast. float64 is never touched (as autocast; apex cast it). Which arguments: apex's
rule (:mod:`._cast_args`); an ``out=`` tensor is left as given. A name the user registered with
``amp.register_*_function`` follows the registration, as in apex.

What the mode cannot see: calls that torch makes inside a Python function it handed over whole
and that no list names (the softmax inside ``F.multi_head_attention_forward``, the ops of a
``backward``), and calls from C++ or TorchScript. Those follow the device's autocast.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from .._messages import apex_logger
from . import _list_rules
from ._cast_args import cast_args, float_tensors

__all__ = ["ApexLists", "exempt", "install"]

_LOW = (torch.float16, torch.bfloat16)
_TO_HALF = (torch.float32, torch.bfloat16)


_RULES = _list_rules.Rules()  # replaced by install() at every O1 initialize


def install(rules: _list_rules.Rules) -> None:
    """Apply ``rules`` (:func:`._list_rules.read`) from now on, on every thread with O1 on.

    apex's patches were process-wide."""
    global _RULES
    _RULES = rules


_EXEMPT: set[Callable[..., Any]] = set()


def exempt(fn: Callable[..., Any]) -> None:
    """Leave ``fn`` out of the lists from now on (``amp.register_*_function`` decided its cast)."""
    _EXEMPT.add(fn)


class ApexLists(TorchFunctionMode):
    """apex's O1 lists for the tensors on ``device_types`` (see the module docstring).

    One per thread, entered by ``casts.enable_o1`` and never left (apex never unpatched).
    ``allow_banned`` is ``amp.init``'s; ``verbose`` (``verbosity=2``) logs apex's line per cast
    ("Float->Half (linear)", "Half->Float (exp)") to the ``fp16kit.apex`` logger.
    """

    def __init__(self) -> None:
        super().__init__()
        self.device_types: set[str] = set()
        self.allow_banned = False
        self.verbose = False
        self._cache: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}

    def clear(self) -> None:
        """Forget the cached fp16 copies of parameters."""
        self._cache.clear()

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if kwargs is None:
            kwargs = {}
        rules = _RULES
        rule = rules.by_function.get(func)
        if rule is None or func in _EXEMPT:
            return func(*args, **kwargs)
        kind, name = rule
        if kind == "promote" and not _mixed(args, kwargs):  # most add/mul calls: one dtype
            return func(*args, **kwargs)
        on = [d for d in self.device_types if torch.is_autocast_enabled(d)]
        if not on:
            return func(*args, **kwargs)
        if kind == "banned":
            return self._banned(func, name, on, args, kwargs, rules.banned[name])
        return getattr(self, "_" + kind)(func, name, on, args, kwargs)

    # ------------------------------------------------------------------------------ rules
    def _fp16(self, func: Any, name: str, on: list[str], args: tuple, kwargs: dict) -> Any:
        def convert(t: torch.Tensor) -> torch.Tensor:
            if t.device.type not in on or t.dtype not in _TO_HALF:
                return t
            return self._half(t, torch.get_autocast_dtype(t.device.type), name)

        new_args, new_kwargs = cast_args(args, kwargs, convert, keep=("out",))
        return _without_autocast(func, new_args, new_kwargs)

    def _fp32(self, func: Any, name: str, on: list[str], args: tuple, kwargs: dict) -> Any:
        new_args, new_kwargs = cast_args(args, kwargs, lambda t: self._float(t, on, name), keep=("out",))
        return _without_autocast(func, new_args, new_kwargs)

    def _banned(self, func: Any, name: str, on: list[str], args: tuple, kwargs: dict, ban: tuple[str, str]) -> Any:
        message, besides = ban
        if not self.allow_banned and any(_is_fp16(t, on) for t in float_tensors(args, kwargs)):
            raise NotImplementedError(message)
        return getattr(self, "_" + besides)(func, name, on, args, kwargs)

    def _fp32_inplace_fn(self, func: Any, name: str, on: list[str], args: tuple, kwargs: dict) -> Any:
        if any(_is_fp16(t, on) for t in float_tensors(args, kwargs)):
            raise NotImplementedError(f"Cannot call in-place function {name} with fp16 arguments.")
        return func(*args, **kwargs)

    def _fp32_inplace_method(self, func: Any, name: str, on: list[str], args: tuple, kwargs: dict) -> Any:
        if args and _is_fp16(args[0], on):
            raise NotImplementedError(f"Cannot call in-place method {name} on fp16 Tensors.")
        return func(*args, **kwargs)

    def _promote(self, func: Any, name: str, on: list[str], args: tuple, kwargs: dict) -> Any:
        dtypes = {t.dtype for t in float_tensors(args, kwargs) if t.device.type in on}
        if len(dtypes) < 2 or torch.float32 not in dtypes or not dtypes <= {torch.float32, *_LOW}:
            return func(*args, **kwargs)
        new_args, new_kwargs = cast_args(args, kwargs, lambda t: self._float(t, on, name), keep=("out",))
        return func(*new_args, **new_kwargs)

    # ------------------------------------------------------------------------------ casts
    def _float(self, t: torch.Tensor, on: list[str], name: str) -> torch.Tensor:
        if t.device.type not in on or t.dtype not in _LOW:
            return t
        if self.verbose:
            apex_logger.info(f"Half->Float ({name})")
        return t.float()

    def _half(self, t: torch.Tensor, dtype: torch.dtype, name: str) -> torch.Tensor:
        cacheable = t.dtype == torch.float32 and t.is_leaf and t.requires_grad and not t._is_view()
        if cacheable:
            hit = self._cache.get(id(t))
            if hit is not None:
                source, version, copy = hit
                # a copy made under no_grad has no grad_fn: not reused once grads are recorded
                if (
                    source is t
                    and version == t._version
                    and copy.dtype == dtype
                    and (copy.requires_grad or not torch.is_grad_enabled())
                ):
                    return copy
        if self.verbose:
            apex_logger.info(f"Float->Half ({name})")
        copy = t.to(dtype)
        if cacheable:
            self._cache[id(t)] = (t, t._version, copy)
        return copy


def _without_autocast(func: Any, args: list, kwargs: dict) -> Any:
    """``func`` with autocast off: it runs in the dtype its rule cast to, whatever autocast's own
    list says of it (CUDA autocast's fp32 softmax). torch's C guard, not ``set_autocast_enabled``
    in a try/finally: no Python line runs between the switch-off and the switch-back, so a Ctrl-C
    (or two) in the forward cannot leave autocast off for the rest of the run."""
    with torch._C._DisableAutocast():
        return func(*args, **kwargs)


def _mixed(args: tuple, kwargs: dict) -> bool:
    """Whether the top-level tensors have more than one dtype (or a list may hide one)."""
    seen = None
    for a in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(a, torch.Tensor):
            if seen is None:
                seen = a.dtype
            elif a.dtype is not seen:
                return True
        elif isinstance(a, (list, tuple)):
            return True
    return False


def _is_fp16(t: torch.Tensor, on: list[str]) -> bool:
    return t.dtype == torch.float16 and t.device.type in on
