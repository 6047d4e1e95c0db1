"""Mistakes torch's own tools make with a MixedPrecisionOptimizer, caught where they happen.

**torch's GradScaler** (``torch.amp.GradScaler``, its ``torch.cuda.amp`` / ``torch.cpu.amp``
subclasses, a user's subclass) unscales ``param.grad`` of ``optimizer.param_groups`` in place.
A MixedPrecisionOptimizer's groups hold fp32 masters, whose grads come from the fp16/bf16 model
grads only through :class:`fp16kit.GradScaler` (the ``MasterWeightOptimizer`` protocol): torch's
scaler records no inf check, and its ``step`` fails with "No inf checks were recorded for this
optimizer" -- or, with fp32 params beside the masters, steps the masters with grads still
multiplied by the scale. The optimizer refuses it at the first attribute torch's scaler reads::

    scaler.unscale_(opt)  ->  GradScaler._unscale_grads_ reads opt.param_groups
    scaler.step(opt)      ->  GradScaler.step reads opt._step_supports_amp_scaling (first)

Both properties compare their caller's code object, by identity, with those two functions of
``torch.amp.GradScaler`` (``TORCH_UNSCALE_READER``, ``TORCH_STEP_READER``): one frame lookup and
one ``is`` per read.
Subclasses that do not replace them run the same code objects; ``fp16kit.GradScaler`` replaces
both, and every other reader (LR schedulers, fp16kit itself) runs other code.

**torch.nn.utils.clip_grad_norm_(model.parameters())** after an asynchronous step
(``async_step=True``) handed the model's grads to the optimizer thread finds no grad: it clips
nothing and returns 0, and a grad-norm logger logs zeros. Nothing on the model or the optimizer
sees ``p.grad`` being read, so the first hand-off of a process wraps torch's
``clip_grad_norm_`` (both names torch exports it under) with a check that warns once per
optimizer (:func:`watch_clips`); until then torch is untouched, and with no asynchronous
optimizer alive the wrapper only tests one empty set. Code that imported the function itself
before the first hand-off (``from torch.nn.utils import clip_grad_norm_``) keeps torch's.
"""

from __future__ import annotations

import functools
import logging
import threading
import types
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

__all__ = ["ClipWatched", "TORCH_UNSCALE_READER", "TORCH_STEP_READER", "torch_scaler_error", "watch_clips"]

logger = logging.getLogger("fp16kit")

# The functions of torch's GradScaler that read the optimizer first (see the module docstring).
TORCH_UNSCALE_READER = torch.amp.GradScaler._unscale_grads_.__code__
TORCH_STEP_READER = torch.amp.GradScaler.step.__code__


def torch_scaler_error(frame: types.FrameType, call: str, model_params: Sequence[torch.Tensor]) -> TypeError:
    """The error for torch's GradScaler (``frame``: the frame of its function reading the
    optimizer) driving, in ``scaler.<call>(optimizer)``, a MixedPrecisionOptimizer that keeps
    masters of ``model_params``."""
    scaler = frame.f_locals.get("self")
    cls = type(scaler)
    name = "torch.amp.GradScaler" if cls is torch.amp.GradScaler else f"{cls.__module__}.{cls.__qualname__}"
    device = getattr(scaler, "_device", "cuda")
    bf16 = (
        " (This model's 16-bit params are all bfloat16, which needs no loss scaling: you may also "
        "drop the scaler and call loss.backward(); optimizer.step().)"
        if {p.dtype for p in model_params} & {torch.float16, torch.bfloat16} == {torch.bfloat16} else ""
    )
    return TypeError(
        f"scaler.{call}(optimizer) was called with torch's GradScaler ({name}) on a "
        "MixedPrecisionOptimizer. torch's scaler unscales the grads of optimizer.param_groups in "
        "place, but this optimizer's groups hold fp32 master weights, which receive the model's "
        "fp16/bf16 grads only from fp16kit.GradScaler: torch's would check none of them, and its "
        "step() would fail with 'No inf checks were recorded for this optimizer' (or, with float32 "
        "params beside, step the masters with grads still multiplied by the scale). Use "
        f"fp16kit.GradScaler, which has torch's API: scaler = fp16kit.GradScaler({device!r}) instead "
        f"of torch.amp.GradScaler({device!r}) (a saved torch scaler state loads into it with "
        "load_state_dict), and keep the loop: scaler.scale(loss).backward(); then, to clip, "
        "scaler.unscale_(optimizer) and optimizer.clip_grad_norm_(max_norm); scaler.step(optimizer); "
        f"scaler.update().{bf16}"
    )


# ---------------------------------------------------------------------- clip_grad_norm_ watch
class ClipWatched(Protocol):
    """What :func:`watch_clips` asks of an optimizer whose steps hand its model grads off."""

    def clip_finds_none(self, params: Sequence[torch.Tensor]) -> str | None:
        """The warning for ``torch.nn.utils.clip_grad_norm_(params)`` called now, when
        ``params`` hold this optimizer's handed-off grads (None: no mistake)."""
        ...

    def warned_clip(self) -> bool:
        """Record that the warning was given; True if it was given before."""
        ...


_watched: weakref.WeakSet[Any] = weakref.WeakSet()
_wrappers: set[Callable[..., Any]] = set()  # the checks installed (never installed twice)
_lock = threading.Lock()


def watch_clips(owner: ClipWatched) -> None:
    """Check every later ``torch.nn.utils.clip_grad_norm_`` call against ``owner`` (weakly
    held) -- installing the check into torch on the first call of the process."""
    with _lock:
        if not _watched:
            _install()
        _watched.add(owner)


def _install() -> None:
    modules = (torch.nn.utils, torch.nn.utils.clip_grad)
    made: dict[int, Callable[..., Any]] = {}
    for module in modules:
        fn = module.clip_grad_norm_
        if fn in _wrappers:
            continue
        if id(fn) not in made:  # (both names are one function)
            made[id(fn)] = _watching(fn)
        module.clip_grad_norm_ = made[id(fn)]


def _watching(clip: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    @functools.wraps(clip)
    def clip_grad_norm_(parameters: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        if _watched:
            parameters = _check(parameters)
        return clip(parameters, *args, **kwargs)

    _wrappers.add(clip_grad_norm_)
    return clip_grad_norm_


def _check(parameters: Any) -> Any:
    """Warn for each watched optimizer whose handed-off grads ``parameters`` miss; return
    ``parameters`` as torch will read them (a generator stays one: torch warns when empty)."""
    if isinstance(parameters, torch.Tensor):
        params: list[torch.Tensor] = [parameters]
    else:
        generator = isinstance(parameters, types.GeneratorType)
        params = list(parameters)
        parameters = (p for p in params) if generator else params
    with _lock:
        owners = list(_watched)
    for owner in owners:
        message = owner.clip_finds_none(params)
        if message is not None and not owner.warned_clip():
            logger.warning(message)
    return parameters
