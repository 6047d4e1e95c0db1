"""What one iteration does, counted rather than timed: bytes moved, torch ops, host reads, Python calls.

Each count comes from running one (warm) iteration of a variant under an observer; none of them
is a timing, so they are exact for the code as it stands::

    op_tally(fn)        # a TorchDispatchMode on the calling thread (top-level aten ops only)
        ops             every aten op dispatched (views and metadata-only ops included)
        read, written   bytes per the op's schema: each tensor argument is read; an argument
                        the schema marks written (``Tensor(a!)``) is written, and not read when
                        the op only overwrites it (copy_, zero_, fill_, an ``out=``); each new tensor an op
                        returns is written; views, ``empty*`` and ``detach`` move nothing.
                        ``_fused_adam(w)_`` writes its grads only when given ``grad_scale`` (it
                        unscales them in place), as torch's kernels do.
                        Logical bytes: caches, write-allocate and allocation are not counted.
        host_reads      ``aten._local_scalar_dense`` calls -- what ``.item()``, ``bool(t)``,
                        ``float(t)`` and ``int(t)`` run -- plus ``Tensor.tolist`` calls (patched
                        for the count), on the calling thread
    cuda_syncs(fn)      on CUDA: ``torch.cuda.set_sync_debug_mode("warn")``; the warnings raised
                        on the calling thread (every synchronizing call, C++ ones included)
    python_calls(fn)    ``sys.setprofile`` on the calling thread: Python function calls outside
                        fp16kit.bench (torch's and fp16kit's own code; the bench's frames left out)

The modes are thread-local: work of the optimizer thread (``async_step=True``) is not seen, which
is the point for host reads: the rule is none on the main thread during a step.
"""

from __future__ import annotations

import os
import sys
import threading
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..core.fused import abi

__all__ = ["OpTally", "cuda_syncs", "op_tally", "python_calls"]

_OVERWRITES = {"copy_", "_foreach_copy_", "zero_", "_foreach_zero_", "fill_", "_foreach_fill_", "_copy_from"}
_NO_TRAFFIC = {
    "empty",
    "empty_like",
    "empty_strided",
    "new_empty",
    "new_empty_strided",
    "detach",
    "alias",
    "lift_fresh",
    "resize_",
    "set_",
}
_FUSED_GRAD_WRITES = {"_fused_adam_", "_fused_adamw_", "_fused_sgd_", "_fused_adagrad_"}
_HOST_READ = "_local_scalar_dense"
_BENCH_DIR = os.path.dirname(os.path.abspath(__file__))


def _tensors(value: Any) -> Iterable[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            if isinstance(v, torch.Tensor):
                yield v


def _nbytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass
class OpTally:
    """The counts of :func:`op_tally` (see the module docstring)."""

    ops: int = 0
    read: int = 0
    written: int = 0
    host_reads: int = 0

    @property
    def moved(self) -> int:
        return self.read + self.written


class _Tally(TorchDispatchMode):
    def __init__(self, tally: OpTally) -> None:
        super().__init__()
        self.tally = tally

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        tally = self.tally
        tally.ops += 1
        name = func.overloadpacket.__name__
        if name == _HOST_READ:
            tally.host_reads += 1
        if func.is_view or name in _NO_TRAFFIC:
            return out
        schema = func._schema
        values = dict(zip((a.name for a in schema.arguments), args))
        values.update(kwargs)
        inputs: list[torch.Tensor] = []
        for arg in schema.arguments:
            tensors = list(_tensors(values.get(arg.name)))
            if not tensors:
                continue
            written = arg.alias_info is not None and arg.alias_info.is_write
            if arg.name == "grads" and name in _FUSED_GRAD_WRITES:
                written = values.get("grad_scale") is not None
            if written:
                tally.written += _nbytes(tensors)
            if not (written and (name in _OVERWRITES or arg.name == "out")):
                tally.read += _nbytes(tensors)
            inputs.extend(tensors)
        if all(r.alias_info is None for r in schema.returns):  # new tensors, not the inputs returned
            known = {id(t) for t in inputs}
            tally.written += _nbytes(t for t in _tensors(out) if id(t) not in known)
        return out


class _CountTolist:
    """``Tensor.tolist`` wrapped to count its calls on one thread (it reads the tensor without a dispatched op)."""

    def __init__(self, tally: OpTally) -> None:
        self.tally = tally
        self.thread = threading.get_ident()
        self.original = torch.Tensor.tolist

    def __enter__(self) -> None:
        original, tally, thread = self.original, self.tally, self.thread

        def tolist(t: torch.Tensor) -> Any:
            if threading.get_ident() == thread:
                tally.host_reads += 1
            return original(t)

        torch.Tensor.tolist = tolist  # type: ignore[method-assign,assignment]

    def __exit__(self, *exc: object) -> None:
        torch.Tensor.tolist = self.original  # type: ignore[method-assign]


def op_tally(fn: Callable[[], Any]) -> OpTally:
    """Run ``fn()`` once under the op observer of the module docstring; return its counts.

    fp16kit's own fused kernels (:mod:`fp16kit.core.fused`), which the observer cannot see into, count their
    traffic themselves (``abi.Traffic``): it is added to ``read`` (their reads and writes, as one figure)."""
    tally = OpTally()
    before = abi.Traffic.bytes
    with _CountTolist(tally), _Tally(tally):
        fn()
    tally.read += abi.Traffic.bytes - before
    return tally


def cuda_syncs(fn: Callable[[], Any]) -> int:
    """Run ``fn()`` once with CUDA's sync debug mode on; return the synchronizing calls made on this thread."""
    thread = threading.get_ident()
    count = 0

    def show(message: Any, category: Any, *args: Any, **kwargs: Any) -> None:
        nonlocal count
        if threading.get_ident() == thread and "synchronizing CUDA operation" in str(message):
            count += 1

    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    return count


def python_calls(fn: Callable[[], Any]) -> int:
    """Run ``fn()`` once; return the Python function calls it made on this thread outside fp16kit.bench."""
    count = 0

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal count
        if event == "call" and not frame.f_code.co_filename.startswith(_BENCH_DIR):
            count += 1

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(previous)
    return count
