"""Ctrl-C at every point of a call: a tracer that delivers SIGINT at the N-th line event.

:func:`sigint_at` runs a call under a ``sys.settrace`` tracer (this thread only: a real
SIGINT reaches only the main thread too) that, at the N-th ``line`` event in any Python frame
under the call -- fp16kit's, torch's, the standard library's -- runs the SIGINT handler that
is installed at that moment. That is what CPython does when a real SIGINT arrives there: it
runs the Python-level handler between two bytecodes on the main thread. With the default
handler it raises KeyboardInterrupt at that line; inside fp16kit's ``hold_interrupts`` the
handler installed there records it and the commit delivers it at its end.

:func:`sweep` does it for N = 1, 2, ... until the call runs to its end with no interrupt
fired, on a training :class:`Script` (a list of named calls per iteration), and checks what
issue 17 asks, for every N:

* the interrupt is never lost: the call raises KeyboardInterrupt;
* it is atomic: a checkpoint taken right after the interrupt (what a user's
  ``except KeyboardInterrupt: save()`` writes) equals bit for bit the uninterrupted run's
  checkpoint just before the call -- or just after it, when the KeyboardInterrupt says the
  call was completed first (``fp16kit.core.interrupts.completed``);
* recovery gives the uninterrupted numbers: the user repeats the call unless it says it was
  completed, trains to the end, and every tensor (model, optimizer and scaler state) equals
  the uninterrupted run's bit for bit;
* resuming in a fresh world (new model, optimizer, scaler; the checkpoint round-tripped
  through ``torch.save``/``torch.load(weights_only=True)``) from that checkpoint, where it sits
  at an iteration boundary, ends with the same numbers too.
"""

from __future__ import annotations

import gc
import io
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fp16kit.core.interrupts import completed

Call = tuple[str, Callable[[Any], Any]]


@dataclass
class Outcome:
    """What one interrupted call did."""

    fired: bool
    error: BaseException | None
    result: Any = None

    @property
    def completed(self) -> bool:
        return self.error is not None and completed(self.error) is not None


def sigint_at(n: int, fn: Callable[[], Any], *, on: str = "line") -> Outcome:
    """Run ``fn()``; at the ``n``-th line event under it (``on="call"``: the ``n``-th entry into
    a Python function), run the installed SIGINT handler.

    Line events are denser than the points where CPython runs a signal handler (function
    entries, the ends of calls, loop jumps): a ``with lock:`` line is traced again on the way
    out, before the lock's C ``__exit__`` runs, where no real signal can land. Inside fp16kit's
    holds that is harmless (the handler only records); for code outside them, ``on="call"``
    fires only where a real SIGINT can (a Python function's entry)."""
    count = 0
    fired = False

    def fire(frame: Any) -> None:
        nonlocal count, fired
        count += 1
        if count == n:
            fired = True
            handler = signal.getsignal(signal.SIGINT)
            if callable(handler):
                handler(signal.SIGINT, frame)

    def local(frame: Any, event: str, arg: Any) -> Any:
        if event == "line" and not fired:
            fire(frame)
        return local

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if fired:
            return None
        if on == "call":
            fire(frame)
            return None
        return local

    # A finalizer or weakref callback of an earlier test's garbage (a WeakSet's _remove) could
    # run inside the call and swallow the interrupt ("Exception ignored in"): CPython's rule
    # for finalizers, not the call's. Collect first and keep the collector off meanwhile.
    gc.collect()
    gc_was_enabled = gc.isenabled()
    gc.disable()
    previous = sys.gettrace()
    sys.settrace(tracer)
    result = error = None
    try:
        result = fn()
    except BaseException as e:  # noqa: BLE001 - what the call raised is the outcome
        error = e
    finally:
        sys.settrace(previous)  # before anything else is called (it would be traced)
        if gc_was_enabled:
            gc.enable()
    return Outcome(fired, error, result)


@dataclass
class Script:
    """A training run: ``build()`` makes a fresh world (model, optimizer, scaler, ...);
    ``iteration(world, i)`` lists the calls of iteration ``i``; ``checkpoint(world)`` is what
    a user saves (a dict of state dicts); ``restore(world, ckpt)`` loads one; ``final(world)``
    every tensor to compare at the end (default: the checkpoint); ``close(world)`` ends it."""

    build: Callable[[], Any]
    iteration: Callable[[Any, int], Sequence[Call]]
    checkpoint: Callable[[Any], dict[str, Any]]
    restore: Callable[[Any, dict[str, Any]], None]
    iterations: int = 3
    final: Callable[[Any], Any] | None = None
    close: Callable[[Any], None] = lambda world: None
    boundary_calls: Sequence[str] = field(default_factory=tuple)  # after these, an iteration ends

    def state(self, world: Any) -> Any:
        return (self.final or self.checkpoint)(world)


def _run_calls(world: Any, calls: Sequence[Call]) -> None:
    for _, fn in calls:
        fn(world)


def run_all(script: Script) -> tuple[Any, dict[tuple[int, str, str], Any]]:
    """The uninterrupted run: its final state and a checkpoint before and after every call."""
    world = script.build()
    points: dict[tuple[int, str, str], Any] = {}
    try:
        for i in range(script.iterations):
            for name, fn in script.iteration(world, i):
                points[(i, name, "before")] = _roundtrip(script.checkpoint(world))
                fn(world)
                points[(i, name, "after")] = _roundtrip(script.checkpoint(world))
        return script.state(world), points
    finally:
        script.close(world)


def sweep(
    script: Script,
    *,
    at_iteration: int,
    call: str,
    limit: int = 20_000,
    dense: int | None = None,
    stride: int = 1,
    resume_every: int = 1,
) -> dict[str, int]:
    """Interrupt ``call`` of iteration ``at_iteration`` at every line -- or, for a fast run,
    at each of the first ``dense`` lines (the call's checks, before any commit) and every
    ``stride``-th after -- and check each outcome (module docstring); resume from every
    ``resume_every``-th checkpoint. Returns counts of what happened."""
    final_ref, points = run_all(script)
    counts = {"points": 0, "completed": 0, "repeated": 0, "resumed": 0}
    n = 1
    while n <= limit:
        resume = counts["points"] % resume_every == 0
        if not _one(script, n, at_iteration, call, final_ref, points, counts, resume):
            return counts
        n += 1 if dense is None or n < dense else stride
    raise AssertionError(f"{call}: still firing at line {limit}")


def _one(
    script: Script,
    n: int,
    at: int,
    target: str,
    final_ref: Any,
    points: dict[tuple[int, str, str], Any],
    counts: dict[str, int],
    resume: bool,
) -> bool:
    world = script.build()
    try:
        for i in range(at):
            _run_calls(world, script.iteration(world, i))
        calls = list(script.iteration(world, at))
        names = [name for name, _ in calls]
        k = names.index(target)
        _run_calls(world, calls[:k])
        outcome = sigint_at(n, lambda: calls[k][1](world))
        if not outcome.fired:
            assert outcome.error is None, f"{target} failed without an interrupt: {outcome.error!r}"
            return False
        where = f"{target} interrupted at line {n}"
        if not isinstance(outcome.error, KeyboardInterrupt):
            raise AssertionError(f"{where}: expected KeyboardInterrupt, got {outcome.error!r}") from outcome.error
        counts["points"] += 1
        done = outcome.completed
        saved = _roundtrip(script.checkpoint(world))
        expected = points[(at, target, "after" if done else "before")]
        assert_equal(saved, expected, f"{where} ({'completed' if done else 'not completed'}): checkpoint")
        counts["completed" if done else "repeated"] += 1
        rest = calls[k + 1 :] if done else calls[k:]
        if resume:
            _resume(script, saved, at, target, done, names, final_ref, where, counts)
        _run_calls(world, rest)
        for i in range(at + 1, script.iterations):
            _run_calls(world, script.iteration(world, i))
        assert_equal(script.state(world), final_ref, f"{where}: after recovery, final state")
        return True
    finally:
        script.close(world)


def _resume(
    script: Script,
    saved: Any,
    at: int,
    target: str,
    done: bool,
    names: list[str],
    final_ref: Any,
    where: str,
    counts: dict[str, int],
) -> None:
    """From the saved checkpoint in a fresh world, where it sits at an iteration boundary."""
    k = names.index(target)
    if done and (target == names[-1] or target in script.boundary_calls):
        start = at + 1
    elif not done and k == 0:
        start = at
    else:
        return
    world = script.build()
    try:
        script.restore(world, saved)
        for i in range(start, script.iterations):
            _run_calls(world, script.iteration(world, i))
        assert_equal(script.state(world), final_ref, f"{where}: resumed from its checkpoint, final state")
        counts["resumed"] += 1
    finally:
        script.close(world)


def _roundtrip(obj: Any) -> Any:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def assert_equal(a: Any, b: Any, where: str, path: str = "") -> None:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), f"{where}{path}: {a!r} vs {b!r}"
        assert a.dtype == b.dtype and a.shape == b.shape, (
            f"{where}{path}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        )
        assert torch.equal(_bits(a), _bits(b)), (
            f"{where}{path}: tensors differ ({a.flatten()[:4].tolist()} vs {b.flatten()[:4].tolist()})"
        )
        return
    if isinstance(a, dict) and isinstance(b, dict):
        assert list(a) == list(b), f"{where}{path}: keys {list(a)} vs {list(b)}"
        for key in a:
            assert_equal(a[key], b[key], where, f"{path}[{key!r}]")
        return
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        assert len(a) == len(b), f"{where}{path}: length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_equal(x, y, where, f"{path}[{i}]")
        return
    assert a == b or (a != a and b != b), f"{where}{path}: {a!r} vs {b!r}"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8)
