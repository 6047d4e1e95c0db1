"""Ctrl-C the way users press it, against fp16kit's holds (issue 17 §1, adversarial pass).

tests/core/test_interrupts.py sweeps one SIGINT at every line of a call. These press it the other
ways users do: twice in quick succession (the second one at a chosen line, by the same kind of
tracer as tests/_helpers/interrupt.py) -- inside the wrapped optimizer's step and just after a
``torch.no_grad()`` entry -- and with a graceful-stop handler of the program's own installed.
"""

from __future__ import annotations

import io
import linecache
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import fp16kit


# ---------------------------------------------------------------------- tools
def sigint_when(predicates: Sequence[Callable[[Any], bool]], fn: Callable[[], Any]) -> tuple[int, BaseException | None]:
    """Run ``fn()``; at the first line event (under it, this thread) for which the next of
    ``predicates`` holds, run the installed SIGINT handler -- what CPython does when a real
    SIGINT arrives there. Returns how many fired and what ``fn`` raised."""
    fired = 0

    def local(frame: Any, event: str, arg: Any) -> Any:
        nonlocal fired
        if event == "line" and fired < len(predicates) and predicates[fired](frame):
            fired += 1
            handler = signal.getsignal(signal.SIGINT)
            if callable(handler):
                handler(signal.SIGINT, frame)
        return local

    previous = sys.gettrace()
    sys.settrace(lambda frame, event, arg: local if fired < len(predicates) else None)
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - what the call raised is the outcome
        return fired, e
    finally:
        sys.settrace(previous)
    return fired, None


def in_function(name: str, filename_end: str, after: int = 1) -> Callable[[Any], bool]:
    """A predicate: the ``after``-th line event in a function ``name`` of a file ending so."""
    seen = 0

    def predicate(frame: Any) -> bool:
        nonlocal seen
        if frame.f_code.co_name == name and frame.f_code.co_filename.endswith(filename_end):
            seen += 1
            return seen >= after
        return False

    return predicate


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3)).half()


def _batch(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(4, 6, generator=g).half()


def _world(*, async_step: bool = False, inner: type = torch.optim.AdamW) -> SimpleNamespace:
    model = _model()
    thread = fp16kit.OptimizerThread() if async_step else None
    opt = fp16kit.MixedPrecisionOptimizer(inner(model.parameters(), lr=1e-2), async_step=async_step, thread=thread)
    scaler = fp16kit.GradScaler("cpu", init_scale=2.0**8, growth_interval=1)
    return SimpleNamespace(model=model, opt=opt, scaler=scaler, thread=thread)


def _backward(w: SimpleNamespace, i: int, factor: float = 1.0) -> None:
    w.scaler.scale(w.model(_batch(i)).float().pow(2).mean() * factor).backward()


def _masters(w: SimpleNamespace) -> list[torch.Tensor]:
    return [m.detach().clone() for m in w.opt.master_params]


@pytest.fixture(autouse=True)
def _grad_mode_and_handler_restored() -> Any:
    handler = signal.getsignal(signal.SIGINT)
    yield
    torch.set_grad_enabled(True)  # a failing test must not break the tests after it
    signal.signal(signal.SIGINT, handler)


# ---------------------------------------------------------------------- waits are not held
class _BlockingAdamW(torch.optim.AdamW):
    """An AdamW whose armed step sends the process a real SIGINT once the main thread says it
    is waiting, then blocks until released (at most 10 s: a held interrupt shows as the
    step having finished before the KeyboardInterrupt came)."""

    armed = False
    main_waiting = threading.Event()
    release = threading.Event()
    finished = threading.Event()

    def step(self, closure: Any = None) -> Any:
        cls = type(self)
        if cls.armed:
            cls.armed = False
            cls.main_waiting.wait(10)
            threading.Event().wait(0.2)  # let the main thread get into the wait
            os.kill(os.getpid(), signal.SIGINT)
            cls.release.wait(10)
            cls.finished.set()
        return super().step(closure)


# ---------------------------------------------------------------------- a second Ctrl-C
def test_a_second_ctrl_c_inside_the_inner_step_makes_the_optimizer_refuse() -> None:
    """A double Ctrl-C inside ``scaler.step(opt)`` breaks off the wrapped AdamW half way
    through its params, but only the scaler (the outermost hold) is marked: the optimizer,
    whose masters and state are part old, part new, goes on -- ``opt.state_dict()`` in the
    user's ``except KeyboardInterrupt: save()`` writes the half-stepped state silently."""
    w = _world()
    w.opt.zero_grad(), _backward(w, 0)
    before = _masters(w)
    fired, error = sigint_when(
        [
            in_function("step", "fp16kit/scaler/grad_scaler.py"),
            in_function("_single_tensor_adam", "torch/optim/adam.py", 40),
        ],
        lambda: w.scaler.step(w.opt),
    )
    assert fired == 2 and isinstance(error, KeyboardInterrupt)
    after = _masters(w)
    changed = [not torch.equal(a, b) for a, b in zip(before, after)]
    assert any(changed) and not all(changed), f"not a half step: {changed}"  # the premise
    with pytest.raises(RuntimeError, match="load_state_dict"):
        w.opt.state_dict()
    with pytest.raises(RuntimeError, match="load_state_dict"):
        w.opt.zero_grad()


def _just_after_no_grad_entered(frame: Any) -> bool:
    """The line event of a ``with torch.no_grad():`` line in fp16kit once its ``__enter__``
    has switched grad mode off (the block not yet entered)."""
    line = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
    return "/fp16kit/" in frame.f_code.co_filename and line == "with torch.no_grad():" and not torch.is_grad_enabled()


def test_a_second_ctrl_c_never_leaves_grad_mode_disabled() -> None:
    """A second Ctrl-C that lands just after torch.no_grad() switched grad mode off, before
    its block is entered (fp16kit's step and kernels run under no_grad), breaks the call with
    grad mode still off: the user reloads the checkpoint as the note says, and the next
    backward fails with "element 0 of tensors does not require grad". The broken call must
    leave grad mode as it found it."""
    w = _world()
    w.opt.zero_grad(), _backward(w, 0)
    fired, error = sigint_when(
        [in_function("step", "fp16kit/scaler/grad_scaler.py"), _just_after_no_grad_entered],
        lambda: w.scaler.step(w.opt),
    )
    assert fired == 2 and isinstance(error, KeyboardInterrupt)
    assert torch.is_grad_enabled(), "grad mode left disabled by a Ctrl-C-broken scaler.step()"


# ---------------------------------------------------------------------- the program's own handler
def test_a_graceful_stop_handler_never_becomes_a_keyboard_interrupt() -> None:
    """A program that installs a SIGINT handler that only sets a flag (stop after this
    iteration) never sees KeyboardInterrupt without fp16kit. Pressing Ctrl-C twice during
    ``scaler.step(opt)`` -- what users of such programs do -- makes fp16kit raise
    KeyboardInterrupt from the middle of the step and mark the scaler broken: the second
    SIGINT must go to the program's handler too, and the call complete."""
    stops: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: stops.append(signum))
    w = _world()
    w.opt.zero_grad(), _backward(w, 0)
    ref = _world()
    ref.opt.zero_grad(), _backward(ref, 0), ref.scaler.step(ref.opt)
    fired, error = sigint_when(
        [in_function("step", "fp16kit/scaler/grad_scaler.py"), in_function("step", "fp16kit/scaler/grad_scaler.py", 5)],
        lambda: w.scaler.step(w.opt),
    )
    assert fired == 2
    assert error is None, f"the program's handler never raises, but the step raised {error!r}"
    assert stops == [signal.SIGINT, signal.SIGINT]
    w.scaler.update()  # not refused
    ref.scaler.update()
    for a, b in zip(_masters(w), _masters(ref)):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------- resuming a submit_step run
def _submit_run(w: SimpleNamespace, start: int, stop: int, factor_at: dict[int, float]) -> None:
    for i in range(start, stop):
        w.opt.zero_grad()
        _backward(w, i, factor_at.get(i, 1.0))
        w.opt.submit_step(lambda: (w.scaler.step(w.opt), w.opt.zero_grad()), scaler=w.scaler)
        w.scaler.update()


def _checkpoint(w: SimpleNamespace) -> dict[str, Any]:
    ckpt = {"model": w.model.state_dict(), "opt": w.opt.state_dict(), "scaler": w.scaler.state_dict()}
    buf = io.BytesIO()
    torch.save(ckpt, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _final(w: SimpleNamespace) -> dict[str, Any]:
    w.opt.synchronize()
    return {**_checkpoint(w), "masters": _masters(w)}


# ---------------------------------------------------------------------- recovering from a broken call
@pytest.mark.parametrize("async_step", [False, True], ids=["sync", "async"])
def test_load_state_dict_recovers_an_optimizer_broken_by_a_second_ctrl_c(async_step: bool) -> None:
    """After a double Ctrl-C breaks ``opt.step()``, every call refuses and names the way out:
    "Restore it from the last checkpoint (load_state_dict)" -- which must work, although it
    calls ``wait_for_step()`` and ``restore_masters()``, commits of the broken optimizer."""
    w = _world(async_step=async_step)
    try:
        w.opt.zero_grad(), _backward(w, 0), w.scaler.step(w.opt), w.scaler.update()
        w.opt.synchronize()
        saved = {"model": {k: v.clone() for k, v in w.model.state_dict().items()}, "opt": w.opt.state_dict()}
        w.opt.zero_grad(), _backward(w, 1)
        w.scaler.unscale_(w.opt)
        fired, error = sigint_when(
            [
                in_function("step", "fp16kit/master_weights/optimizer.py"),
                in_function("step", "fp16kit/master_weights/optimizer.py", 4),
            ],
            lambda: w.opt.step(),
        )
        assert fired == 2 and isinstance(error, KeyboardInterrupt)
        with pytest.raises(RuntimeError, match="load_state_dict"):
            w.opt.zero_grad()  # broken: refuses, naming the way out
        w.model.load_state_dict(saved["model"])
        w.opt.load_state_dict(saved["opt"])  # the way out
        w.opt.zero_grad()
        w.opt.synchronize()
    finally:
        if w.thread is not None:
            w.thread.shutdown()


def test_scaler_load_state_dict_recovers_a_scaler_broken_by_a_second_ctrl_c() -> None:
    """The scaler's way out (a control: its load_state_dict calls no commit of its own)."""
    w = _world()
    w.opt.zero_grad(), _backward(w, 0), w.scaler.step(w.opt), w.scaler.update()
    saved = w.scaler.state_dict()
    w.opt.zero_grad(), _backward(w, 1)
    fired, error = sigint_when(
        [in_function("step", "fp16kit/scaler/grad_scaler.py"), in_function("step", "fp16kit/scaler/grad_scaler.py", 3)],
        lambda: w.scaler.step(w.opt),
    )
    assert fired == 2 and isinstance(error, KeyboardInterrupt)
    with pytest.raises(RuntimeError, match="load_state_dict"):
        w.scaler.update()
    w.scaler.load_state_dict(saved)
    assert w.scaler.state_dict() == saved
