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
one ``is`` per read. Subclasses that do not replace them run the same code objects;
``fp16kit.GradScaler`` replaces both, and every other reader (LR schedulers, fp16kit) runs other code.

**torch.nn.utils.clip_grad_norm_(model.parameters())** after an asynchronous step
(``async_step=True``, ``submit_step``) handed the model's grads to the optimizer thread finds no
grad: it clips nothing and returns 0, and a grad-norm logger logs zeros. Nothing on the model or
the optimizer sees ``p.grad`` being read, so the first hand-off of a process (:func:`watch_clips`)
replaces the private helper torch's ``clip_grad_norm_`` calls for the total norm,
``torch.nn.utils.clip_grad._get_total_norm``, by one that, given no grad at all by
``clip_grad_norm_``, asks each watched optimizer whether the clipped params are its handed-off
ones (warning once per optimizer), then computes torch's norm. Inside a step job every call is
checked, found grads or not: there the model's grads may be the main thread's next backward's,
which the clip would rescale under it. The public functions stay torch's
own objects (aliases made before keep working, and are watched too); the normal path costs one
emptiness test; until the first hand-off torch is untouched.
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
import threading
import types
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from ..core.protocol import scaled_iterations
from ..core.thread import current_optimizer_thread

__all__ = ["ClipWatched", "TORCH_UNSCALE_READER", "TORCH_STEP_READER", "torch_scaler_error", "watch_clips"]

logger = logging.getLogger("fp16kit")

# The functions of torch's GradScaler that read the optimizer first (see the module docstring).
TORCH_UNSCALE_READER = torch.amp.GradScaler._unscale_grads_.__code__
TORCH_STEP_READER = torch.amp.GradScaler.step.__code__


def torch_scaler_error(frame: types.FrameType, call: str, model_params: Sequence[torch.Tensor]) -> TypeError:
    """Build the error for torch's GradScaler driving a MixedPrecisionOptimizer.

    The call is ``scaler.<call>(optimizer)``; ``frame``: the frame of torch's function reading the optimizer;
    the optimizer keeps masters of ``model_params``."""
    scaler = frame.f_locals.get("self")
    cls = type(scaler)
    name = "torch.amp.GradScaler" if cls is torch.amp.GradScaler else f"{cls.__module__}.{cls.__qualname__}"
    device = getattr(scaler, "_device", "cuda")
    bf16 = (
        " (This model's 16-bit params are all bfloat16, which needs no loss scaling: you may also "
        "drop the scaler and call loss.backward(); optimizer.step().)"
        if {p.dtype for p in model_params} & {torch.float16, torch.bfloat16} == {torch.bfloat16}
        else ""
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
        """Return the warning for ``torch.nn.utils.clip_grad_norm_(params)`` called now.

        A warning when ``params`` hold this optimizer's handed-off grads; None: no mistake."""
        ...

    def warned_clip(self) -> bool:
        """Record that the warning was given; True if it was given before."""
        ...


_watched: weakref.WeakSet[Any] = weakref.WeakSet()
_wrappers: set[Callable[..., Any]] = set()  # the checks installed (never installed twice)
_lock = threading.Lock()


def watch_clips(owner: ClipWatched) -> None:
    """Check every later ``torch.nn.utils.clip_grad_norm_`` call against ``owner`` (weakly held).

    The check is installed into torch on the first call of the process."""
    with _lock:
        if not _watched:
            _install()
        _watched.add(owner)


def _install() -> None:
    # torch's clip_grad_norm_ looks its helper up in its module at each call: replacing the
    # helper there leaves every public name (and every alias of it made earlier) as it is.
    module = torch.nn.utils.clip_grad
    norm = getattr(module, "_get_total_norm", None)
    clip = getattr(module, "clip_grad_norm_", None)
    if norm is None or clip is None or _wraps_ours(norm):
        return  # ours already (maybe re-wrapped by a third party), or another torch: nothing watched
    clip_code = inspect.unwrap(clip).__code__

    @functools.wraps(norm)
    def _get_total_norm(tensors: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        # On the main thread the mistake shows as no grad found; inside a step job the model's
        # grads may already be the next backward's, so every clip of them there is checked.
        if _watched and isinstance(tensors, list) and (not tensors or current_optimizer_thread() is not None):
            caller = _calling_frame(clip_code)
            if caller is not None:
                _check(caller.f_locals.get("parameters", ()))
        return norm(tensors, *args, **kwargs)

    _wrappers.add(_get_total_norm)
    module._get_total_norm = _get_total_norm


_WRAPPER_DEPTH = 4  # third-party wrappers (tracers, profilers) allowed between clip and the check


def _calling_frame(code: types.CodeType) -> types.FrameType | None:
    """The frame running ``code`` among the check's few nearest callers, if any."""
    frame: types.FrameType | None = sys._getframe(2)  # (1 is the check itself)
    for _ in range(_WRAPPER_DEPTH):
        if frame is None or frame.f_code is code:
            return frame
        frame = frame.f_back
    return None


def _wraps_ours(function: Callable[..., Any]) -> bool:
    """Whether ``function`` is one of our checks, or reaches one through ``__wrapped__`` links.

    A third party's ``functools.wraps`` of our check links to it; ours links on to torch's
    helper, so the walk stops at the first of ours rather than unwrapping to the end.
    """
    return inspect.unwrap(function, stop=lambda f: f in _wrappers) in _wrappers


def _check(params: Sequence[torch.Tensor]) -> None:
    """Warn for each watched optimizer whose handed-off grads ``params`` miss."""
    with _lock:
        owners = list(_watched)
    for owner in owners:
        message = owner.clip_finds_none(params)
        if message is not None and not owner.warned_clip():
            logger.warning(message)


def warn_if_scaled(latch: threading.Event) -> None:
    """Warn once (``latch``) when ``step()`` is called directly while a GradScaler has an iteration open.

    The grads are then probably still multiplied by the loss scale; the warning names ``scaler.step(optimizer)``."""
    if latch.is_set() or not scaled_iterations.any_open():
        return
    latch.set()
    logger.warning(_SCALED_STEP)


_SCALED_STEP = (
    "MixedPrecisionOptimizer.step() was called directly while a GradScaler has scaled a loss it "
    "has not updated yet: these gradients are probably still multiplied by the loss scale and the "
    "update is that many times too large. Call scaler.step(optimizer) (then scaler.update()) "
    "instead of optimizer.step(). (Warned once per optimizer.)"
)
