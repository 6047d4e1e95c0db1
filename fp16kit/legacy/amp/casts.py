"""apex amp's O1 casts (docs/apex-amp.md §10) on ``torch.autocast`` (§12) and apex's op lists.

apex O1 patched ``torch``, ``torch.Tensor`` and ``torch.nn.functional`` process-wide so that
matmul-like ops ran in fp16 and precision-sensitive ones in fp32. The port enters torch's
autocast, which casts in the dispatcher (aliases, internal calls, fused kernels), and above it
apex's own lists (:mod:`.o1_lists`), which decide for every name apex listed, on every device --
autocast's lists differ from apex's and between CPU and CUDA (CPU autocast runs exp, sum,
softmax in fp16)::

    enable_o1(device_type)     autocast(device_type, float16) and apex's lists (ApexLists)
                               entered on the calling thread and never left (the faithful
                               default of §12: loss functions computed in the training loop on
                               the model's outputs are cast as in apex)
    clear_cache()              torch.clear_autocast_cache() and the lists' fp16 parameter
                               copies: at every scale_loss exit and, through
                               clear_cache_after_forward(model), at the end of every model
                               forward (apex's cache lived until the next scale_loss exit, so
                               eval loops saw stale fp16 weights: apex#796, the §10 FIX)
    disable_casts()            autocast off for the block, for every device type it is on for
                               (apex's lists follow autocast: off too); the previous state comes
                               back on exit, also after an exception, and it works without O1
                               (§13.6/§13.10 FIXes)
    half/float/promote_function(fn)
                               while autocast is on for a tensor's device type, floating
                               arguments are cast (``.to(dtype)``) before ``fn`` runs under the
                               current autocast state; autocast off -> ``fn`` unchanged
    register_*_function(module, name) + apply_registrations()
                               queued, then applied by the next O1 initialize; the function
                               registered then follows its registration, not apex's lists

On CUDA both layers run too: CUDA autocast already runs most of apex's FP32 names in fp32, and the
lists add the ones it does not (gelu, std, var, local_response_norm, ctc_loss, Tensor.cpu;
grid_sample, which it promotes), apex's promote and in-place rules and its BCE error; ops no list
names follow CUDA autocast (einsum, scaled_dot_product_attention: fp16). Differences from apex a
user can notice are listed in MIGRATION.md (§12): autocast is per thread (apex's patches hit every
thread), ops apex did not list follow the device's autocast, and fp64 tensors are never cast.

The decorators follow apex's argument rule (:mod:`._cast_args`). ``half_function`` casts to
autocast's low-precision dtype for the device (float16 under O1); ``promote_function`` casts
every floating tensor to the widest floating dtype among them (``torch.promote_types``; apex
raised NotImplementedError for float+double and bf16+float mixes, autocast never raises).
Unlike autocast's own lists, the decorators cast float64 too, as apex did.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from . import _list_rules, o1_lists
from ._cast_args import cast_args, float_tensors

__all__ = [
    "apply_registrations",
    "clear_cache",
    "clear_cache_after_forward",
    "disable_casts",
    "enable_o1",
    "float_function",
    "half_function",
    "promote_function",
    "read_lists",
    "register_float_function",
    "register_half_function",
    "register_promote_function",
]

logger = logging.getLogger("fp16kit")

# Device types autocast may be on for; probed by disable_casts(). Unknown ones are skipped.
_AUTOCAST_DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps", "hpu", "xla", "ipu", "mtia", "maia")

# Per-thread O1 state: ``contexts`` ({device_type: entered torch.autocast}) and ``lists`` (the
# entered ApexLists, or None). Autocast state and torch's mode stack are per thread in torch, so
# is this; the module-level object keeps them referenced for the life of their thread.
_o1 = threading.local()


def _o1_contexts() -> dict[str, torch.autocast]:
    contexts = getattr(_o1, "contexts", None)
    if contexts is None:
        contexts = _o1.contexts = {}
    return contexts


def _o1_lists() -> o1_lists.ApexLists | None:
    return getattr(_o1, "lists", None)


def _autocast_on(device_type: str) -> bool:
    try:
        return torch.is_autocast_enabled(device_type)
    except RuntimeError:  # a device type autocast does not know (e.g. "meta")
        return False


def _device_types() -> tuple[str, ...]:
    extra = torch._C._get_privateuse1_backend_name()
    return _AUTOCAST_DEVICE_TYPES + (() if extra in _AUTOCAST_DEVICE_TYPES else (extra,))


# ------------------------------------------------------------------------------------- O1


def read_lists() -> _list_rules.Rules:
    """Return apex's op lists (``amp.lists``) as they stand now, ready for :func:`enable_o1`.

    apex's op lists (``amp.lists``) as they stand now, ready for :func:`enable_o1`; TypeError,
    naming the list and the fix, for an entry that is not a function name."""
    return _list_rules.read()


def enable_o1(
    device_type: str = "cuda",
    *,
    allow_banned: bool = False,
    verbose: bool = False,
    rules: _list_rules.Rules | None = None,
) -> None:
    """Switch O1 on for ``device_type`` on the calling thread, for good.

    Autocast (float16) and apex's op lists (:class:`.o1_lists.ApexLists`) for that device
    type.

    Every call reads ``amp.lists`` anew (or takes ``rules``, from :func:`read_lists`): the lists
    as edited up to now apply from here on, on every thread with O1 on; later edits wait for the
    next call, as apex read them when ``amp.init`` patched. Idempotent per thread and device
    type: a second call enters no second context (it updates ``allow_banned``, amp.init's, and
    ``verbose``, apex's per-cast lines at ``verbosity=2``). Called by ``amp.initialize`` at O1
    and by ``amp.init()``; other threads keep running without O1 (apex's patches reached every
    thread: MIGRATION.md).
    """
    if rules is None:
        rules = read_lists()
    contexts = _o1_contexts()
    if device_type not in contexts:
        if device_type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(
                "opt_level O1 casts through CUDA autocast, but CUDA is not available in this process. "
                "Move the model to a CUDA device, or run O1 on CPU autocast (the model's parameters "
                "on the CPU select device_type='cpu')."
            )
        ctx = torch.autocast(device_type, dtype=torch.float16)
        ctx.__enter__()
        contexts[device_type] = ctx
    o1_lists.install(rules)
    mode = _o1_lists()
    if mode is None:
        mode = o1_lists.ApexLists()
        mode.__enter__()
        _o1.lists = mode
    mode.device_types.add(device_type)
    mode.allow_banned = allow_banned
    mode.verbose = verbose


def _disable_o1_for_tests() -> None:
    """Leave the O1 contexts entered on this thread (the lists first, then autocast, newest
    first): casting returns to the state it had before enable_o1. For tests; amp itself never
    leaves O1, as apex never unpatched."""
    mode = _o1_lists()
    if mode is not None:
        _o1.lists = None
        mode.__exit__(None, None, None)
    contexts = _o1_contexts()
    for device_type in reversed(list(contexts)):
        contexts.pop(device_type).__exit__(None, None, None)


def clear_cache() -> None:
    """Drop autocast's cache of low-precision parameter copies (``torch.clear_autocast_cache``).

    Called at every ``scale_loss`` exit; a parameter changed in place after its copy was cached
    (optimizer step, EMA, ``load_state_dict``) is then seen by the next cast. The lists' own
    copies of parameters go too (they also notice in-place changes by themselves).
    """
    torch.clear_autocast_cache()
    mode = _o1_lists()
    if mode is not None:
        mode.clear()


def _clear_cache_hook(module: torch.nn.Module, args: Any, output: Any) -> None:
    # A module-level function (not a closure) so that a model carrying it still pickles and
    # deep-copies (apex's patched forward did neither: §13.5).
    clear_cache()


def clear_cache_after_forward(module: torch.nn.Module) -> torch.utils.hooks.RemovableHandle:
    """Clear autocast's cache at the end of every ``module`` forward, also one that raised.

    ``amp.initialize`` registers it on each model at O1, so an eval loop (which never reaches
    ``scale_loss``) does not run on fp16 copies of weights that have changed since (apex#796).
    Returns the hook's handle (``handle.remove()`` undoes it).
    """
    return module.register_forward_hook(_clear_cache_hook, always_call=True)


@contextlib.contextmanager
def disable_casts() -> Iterator[None]:
    """Run the block with autocast off for every device type it is on for on this thread.

    The previous autocast state comes back on exit, also when the block raises (apex left casts
    off for good), and the block runs unchanged when no autocast is on (apex raised
    AttributeError before amp.initialize). Usable as a decorator, as apex's.
    """
    with contextlib.ExitStack() as stack:
        for device_type in _device_types():
            if _autocast_on(device_type):
                stack.enter_context(torch.autocast(device_type, enabled=False))
        yield


# ------------------------------------------------------------------------------- decorators


def _cast_call(fn: Callable, args: tuple, kwargs: dict, dtype_for: Callable[[torch.Tensor], torch.dtype | None]) -> Any:
    def convert(t: torch.Tensor) -> torch.Tensor:
        dtype = dtype_for(t)
        return t if dtype is None or t.dtype == dtype else t.to(dtype)

    new_args, new_kwargs = cast_args(args, kwargs, convert)
    return fn(*new_args, **new_kwargs)


def half_function(fn: Callable) -> Callable:
    """Decorate ``fn`` to run in autocast's low-precision dtype while autocast is on.

    ``fn``'s floating tensor arguments go to autocast's low-precision dtype (float16 under
    O1) while autocast is on for their device type; otherwise ``fn`` runs unchanged."""

    def dtype_for(t: torch.Tensor) -> torch.dtype | None:
        device_type = t.device.type
        return torch.get_autocast_dtype(device_type) if _autocast_on(device_type) else None

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return _cast_call(fn, args, kwargs, dtype_for)

    return wrapper


def float_function(fn: Callable) -> Callable:
    """Decorate ``fn`` to run in float32 while autocast is on for its arguments' device type.

    ``fn``'s floating tensor arguments go to float32 while autocast is on for their device
    type; otherwise ``fn`` runs unchanged."""

    def dtype_for(t: torch.Tensor) -> torch.dtype | None:
        return torch.float32 if _autocast_on(t.device.type) else None

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return _cast_call(fn, args, kwargs, dtype_for)

    return wrapper


def promote_function(fn: Callable) -> Callable:
    """Decorate ``fn`` to run in the widest floating dtype of its arguments while autocast is on.

    While autocast is on for their device type, ``fn``'s floating tensor arguments go to the
    widest floating dtype among them (half + float -> float); otherwise ``fn`` runs unchanged."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        tensors = [t for t in float_tensors(args, kwargs) if _autocast_on(t.device.type)]
        if not tensors:
            return fn(*args, **kwargs)
        widest = functools.reduce(torch.promote_types, (t.dtype for t in tensors))

        def dtype_for(t: torch.Tensor) -> torch.dtype | None:
            return widest if _autocast_on(t.device.type) else None

        return _cast_call(fn, args, kwargs, dtype_for)

    return wrapper


# ---------------------------------------------------------------------------- registrations

_registry_lock = threading.Lock()
_pending: list[tuple[Any, str, Callable[[Callable], Callable]]] = []
_applied_once = False


def _register(module: Any, name: str, decorator: Callable[[Callable], Callable]) -> None:
    if not hasattr(module, name):
        raise ValueError(f"No function named {name} in module {module}.")
    with _registry_lock:
        _pending.append((module, name, decorator))
        late = _applied_once
    if late:
        logger.warning(
            "amp.%s(%s, %r) was called after amp.initialize: it takes effect only at the next "
            "amp.initialize with opt_level O1 (apex ignored it silently). Register functions "
            "before calling amp.initialize.",
            f"register_{decorator.__name__}",
            getattr(module, "__name__", module),
            name,
        )


def register_half_function(module: Any, name: str) -> None:
    """Have ``module.<name>`` run as :func:`half_function` from the next O1 initialize on."""
    _register(module, name, half_function)


def register_float_function(module: Any, name: str) -> None:
    """Have ``module.<name>`` run as :func:`float_function` from the next O1 initialize on."""
    _register(module, name, float_function)


def register_promote_function(module: Any, name: str) -> None:
    """Have ``module.<name>`` run as :func:`promote_function` from the next O1 initialize on."""
    _register(module, name, promote_function)


def apply_registrations() -> None:
    """Replace every queued ``module.<name>`` with its wrapped function, then empty the queue.

    Called by ``amp.initialize`` at O1. Registrations made after it wait for the next call.
    """
    global _applied_once
    with _registry_lock:
        queued = list(_pending)
        _pending.clear()
        _applied_once = True
    for module, name, decorator in queued:
        fn = getattr(module, name)
        o1_lists.exempt(fn)  # the registration decides its cast, as in apex
        setattr(module, name, decorator(fn))
