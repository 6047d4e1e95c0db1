"""Ctrl-C at every line of a step, for the legacy faces: FP16_Optimizer (sync and async) and amp O2 (issue 17 §1).

Each test sweeps one call of one iteration (tests/_helpers/interrupt.py): the interrupt is
never lost, a checkpoint right after it is the uninterrupted run's before or after the call,
and repeating the call (unless it says it was completed) or resuming from that checkpoint in a
fresh world ends with the uninterrupted numbers bit for bit.

The calls of an iteration are the ones apex documented::

    FP16_Optimizer:  optimizer.zero_grad(); optimizer.backward(loss);
                     [optimizer.clip_master_grads(1.0)]; optimizer.step()
    amp O2:          optimizer.zero_grad()
                     with amp.scale_loss(loss, optimizer) as scaled:   # one call: the whole with
                         scaled.backward()
                     optimizer.step()
"""

from __future__ import annotations

import gc
import os
import signal
import sys
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from _helpers.interrupt import Script, assert_equal, run_all, sweep
from _helpers.interrupt import _roundtrip as roundtrip
from fp16kit.core.interrupts import completed
from fp16kit.legacy import FP16_Optimizer, amp
from fp16kit.legacy.amp._amp_state import _amp_state

OPTS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
}


def _model(*, batchnorm: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3)]
    if batchnorm:  # amp O2 keeps it fp32: params without masters, whose grads amp stashes
        layers.insert(1, torch.nn.BatchNorm1d(5))
    # eval(): a forward in training mode updates the running stats, so a repeated forward (of
    # an interrupted iteration) would count twice -- the user's forward, not fp16kit's calls
    return torch.nn.Sequential(*layers).eval() if batchnorm else torch.nn.Sequential(*layers)


def _loss(model: torch.nn.Module, i: int, dtype: torch.dtype, overflow_at: int | None) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + i)
    loss = model(torch.randn(4, 6, generator=g).to(dtype)).float().pow(2).mean()
    return loss * 1e30 if i == overflow_at else loss


def _clone(sd: dict[str, Any]) -> dict[str, Any]:
    return {k: v.detach().clone() for k, v in sd.items()}


# ---------------------------------------------------------------------- FP16_Optimizer
def fp16_optimizer_script(
    *,
    opt: str = "sgd",
    dynamic: bool = True,
    clip: bool = False,
    async_step: bool = False,
    overflow_at: int | None = None,
    iterations: int = 3,
) -> Script:
    """apex's FP16_Optimizer loop on an fp16 model (``dynamic``: apex amp's rule from 2**8
    with a window of 2, so the scale grows within the run; else a static scale of 128)."""

    def build() -> Any:
        model = _model().half()
        inner = OPTS[opt](model.parameters())
        if dynamic:
            o = FP16_Optimizer(
                inner,
                dynamic_loss_scale=True,
                dynamic_loss_args={"init_scale": 2.0**8, "scale_window": 2},
                verbose=False,
                async_step=async_step,
            )
        else:
            o = FP16_Optimizer(inner, static_loss_scale=128.0, verbose=False, async_step=async_step)
        return SimpleNamespace(model=model, opt=o)

    def iteration(w: Any, i: int) -> list:
        calls: list = [
            ("zero_grad", lambda w: w.opt.zero_grad()),
            # the forward too: a backward that was not completed is repeated from the forward
            ("backward", lambda w: w.opt.backward(_loss(w.model, i, torch.float16, overflow_at))),
        ]
        if clip:
            calls.append(("clip", lambda w: w.opt.clip_master_grads(1.0)))
        calls.append(("step", lambda w: w.opt.step()))
        return calls

    def checkpoint(w: Any) -> dict[str, Any]:
        return {"model": _clone(w.model.state_dict()), "opt": w.opt.state_dict()}

    def restore(w: Any, ckpt: dict[str, Any]) -> None:
        w.model.load_state_dict(ckpt["model"])
        w.opt.load_state_dict(ckpt["opt"])

    def final(w: Any) -> Any:
        w.opt.synchronize()
        return {**checkpoint(w), "masters": [m.detach().clone() for m in w.opt.all_fp32_from_fp16_params]}

    def close(w: Any) -> None:
        w.opt.synchronize()

    return Script(build, iteration, checkpoint, restore, iterations, final, close, boundary_calls=("step",))


# ---------------------------------------------------------------------- amp O2
def _activate(w: Any) -> Any:
    """amp's state is process-wide; the sweep keeps two worlds alive at once (the interrupted
    one and the one resumed from its checkpoint): each call puts its own world's state in."""
    _amp_state.__dict__.update(getattr(w, "amp_state", {}))  # (the handle API's worlds have none)
    return w


def amp_o2_script(
    *,
    opt: str = "sgd",
    loss_scale: float | str = "dynamic",
    batchnorm: bool = False,
    overflow_at: int | None = None,
    iterations: int = 3,
) -> Script:
    """``amp.initialize(model, optimizer, opt_level="O2")`` (dynamic: window 2, so the scale
    grows within the run; or a static ``loss_scale``)."""

    def build() -> Any:
        model = _model(batchnorm=batchnorm)
        inner = OPTS[opt](model.parameters())
        model, o = amp.initialize(model, inner, opt_level="O2", loss_scale=loss_scale, verbosity=0)
        for scaler in _amp_state.loss_scalers:
            scaler._scale_seq_len = 2
        return SimpleNamespace(model=model, opt=o, amp_state=dict(_amp_state.__dict__))

    def backward(w: Any, i: int) -> None:
        _activate(w)
        loss = _loss(w.model, i, torch.float16, overflow_at)
        with amp.scale_loss(loss, w.opt) as scaled:
            scaled.backward()

    def iteration(w: Any, i: int) -> list:
        return [
            ("zero_grad", lambda w: _activate(w).opt.zero_grad()),
            ("scale_loss", lambda w: backward(w, i)),
            ("step", lambda w: _activate(w).opt.step()),
        ]

    def checkpoint(w: Any) -> dict[str, Any]:
        _activate(w)
        return {"model": _clone(w.model.state_dict()), "opt": w.opt.state_dict(), "amp": amp.state_dict()}

    def restore(w: Any, ckpt: dict[str, Any]) -> None:
        _activate(w)
        w.model.load_state_dict(ckpt["model"])
        w.opt.load_state_dict(ckpt["opt"])
        amp.load_state_dict(ckpt["amp"])

    def final(w: Any) -> Any:
        return {**checkpoint(w), "masters": [m.detach().clone() for m in amp.master_params(w.opt)]}

    return Script(build, iteration, checkpoint, restore, iterations, final, boundary_calls=("step",))


# ---------------------------------------------------------------------- the 2018 handle API
@pytest.fixture
def handle(monkeypatch: Any) -> Any:
    """The handle ``amp.init()`` returns, with O1's casting switched off again: the sweeps are of
    the wrapper's commits, and a Ctrl-C inside torch's own dispatch of a torch function under
    O1's lists (``torch.overrides._pop_mode_temporarily``, Python code, reached by every
    ``backward()``) takes the lists off torch's mode stack -- torch's code, found by this sweep."""
    from fp16kit.legacy.amp import casts

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(_amp_state, "handle", getattr(_amp_state, "handle", None), raising=False)
    h = amp.init()
    casts._disable_o1_for_tests()
    assert h.is_active()
    return h


def amp_handle_script(
    handle: Any,
    *,
    opt: str = "sgd",
    num_loss: int = 2,
    overflow_at: int | None = None,
    iterations: int = 3,
    forward_apart: bool = False,
) -> Script:
    """``optimizer = handle.wrap_optimizer(optimizer, num_loss)`` after ``amp.init()``: per
    iteration ``zero_grad()``, one ``with optimizer.scale_loss(loss_k)`` per loss (its own
    forward), ``step()``; loss 1 overflows at ``overflow_at`` (a skipped step, its scaler
    halved). Window 2, so the scales grow within the run. ``forward_apart``: each forward is a
    call of its own (``forward_k``), before its ``scale_loss_k``."""

    def build() -> Any:
        model = _model()
        o = handle.wrap_optimizer(OPTS[opt](model.parameters()), num_loss=num_loss)
        for scaler in o._loss_scaler:
            scaler._scale_seq_len = 2
        return SimpleNamespace(model=model, opt=o)

    def forward(w: Any, i: int, k: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(100 + 10 * i + k)
        out = w.model(torch.randn(4, 6, generator=g)).float()
        # 1e35 * S overflows fp32 (and fp16) in the backward
        w.loss = out.pow(2).mean() * 1e-2 if k == 0 else out.sum() * (1e35 if i == overflow_at else 1e-3)
        return w.loss

    def backward(w: Any, loss: torch.Tensor) -> None:
        with w.opt.scale_loss(loss) as scaled:
            scaled.backward(retain_graph=forward_apart)  # (apart: a repeated call has no forward)

    def iteration(w: Any, i: int) -> list:
        losses: list = []
        for k in range(num_loss):
            if forward_apart:
                losses += [
                    (f"forward_{k}", lambda w, k=k: forward(w, i, k)),
                    (f"scale_loss_{k}", lambda w: backward(w, w.loss)),
                ]
            else:
                losses.append((f"scale_loss_{k}", lambda w, k=k: backward(w, forward(w, i, k))))
        return [("zero_grad", lambda w: w.opt.zero_grad()), *losses, ("step", lambda w: w.opt.step())]

    def checkpoint(w: Any) -> dict[str, Any]:
        return {"model": _clone(w.model.state_dict()), "opt": w.opt.state_dict()}

    def restore(w: Any, ckpt: dict[str, Any]) -> None:
        w.model.load_state_dict(ckpt["model"])
        w.opt.load_state_dict(ckpt["opt"])

    return Script(build, iteration, checkpoint, restore, iterations, boundary_calls=("step",))


# ---------------------------------------------------------------------- the sweeps (CI: small)
# Every line of the checks before a commit, then every 29th line; the slow tests sweep more
# configurations (static scales, AdamW, fp32 params, async backward) and lines.
FAST = dict(dense=30, stride=29, resume_every=5)
CI = dict(iterations=2)  # the swept iteration is the last


@pytest.mark.parametrize("call", ["backward", "clip", "step"])
def test_ctrl_c_anywhere_in_an_fp16_optimizer_iteration(call: str) -> None:
    counts = sweep(fp16_optimizer_script(clip=True, overflow_at=1, **CI), at_iteration=1, call=call, **FAST)
    assert counts["points"] > 0 and counts["completed"] > 0


def test_ctrl_c_anywhere_in_an_async_fp16_optimizer_step() -> None:
    sweep(fp16_optimizer_script(async_step=True, overflow_at=1, **CI), at_iteration=1, call="step", **FAST)


@pytest.mark.parametrize("call", ["scale_loss", "step"])
def test_ctrl_c_anywhere_in_an_amp_o2_iteration(call: str) -> None:
    counts = sweep(amp_o2_script(overflow_at=1, **CI), at_iteration=1, call=call, **FAST)
    assert counts["points"] > 0 and counts["completed"] > 0 and counts["repeated"] > 0


@pytest.mark.parametrize("call", ["scale_loss_1", "step"])  # (slow: scale_loss_0 too, more configurations)
def test_ctrl_c_anywhere_in_an_amp_handle_iteration(handle: Any, call: str) -> None:
    # the forward apart (CI time); the slow sweeps have it inside
    counts = sweep(
        amp_handle_script(handle, overflow_at=1, forward_apart=True, **CI), at_iteration=1, call=call, **FAST
    )
    assert counts["points"] > 0 and counts["completed"] > 0 and counts["repeated"] > 0


# ---------------------------------------------------------------------- slow: more configurations
# A covering set, every 17th line of every call but zero_grad, at iterations 0 and 1;
# FP16KIT_SWEEP_EVERY_LINE=1 sweeps every line of every configuration.
EVERY_LINE = os.environ.get("FP16KIT_SWEEP_EVERY_LINE") == "1"
FP16_OPTIMIZER_CONFIGS = [
    dict(opt=o, dynamic=d, clip=c, async_step=a, overflow_at=ov)
    for o in sorted(OPTS)
    for d in (True, False)
    for a in (False, True)
    for c in ((False,) if a else (False, True))  # async: clip_master_grads is refused
    for ov in ((None, 1) if d else (None,))  # a static scale never skips: an overflow is NaN weights
]
FP16_OPTIMIZER_COVERING = [
    dict(opt="sgd", dynamic=True, clip=True, async_step=False, overflow_at=None),
    dict(opt="adamw", dynamic=True, clip=True, async_step=False, overflow_at=1),
    dict(opt="sgd", dynamic=False, clip=False, async_step=True, overflow_at=None),
    dict(opt="adamw", dynamic=True, clip=False, async_step=True, overflow_at=1),
    dict(opt="adamw", dynamic=False, clip=True, async_step=False, overflow_at=None),
]
AMP_O2_CONFIGS = [
    dict(opt=o, loss_scale=s, batchnorm=b, overflow_at=ov)
    for o in sorted(OPTS)
    for s in ("dynamic", 128.0)
    for b in (False, True)
    for ov in ((None, 1) if s == "dynamic" else (None,))
]
AMP_O2_COVERING = [
    dict(opt="sgd", loss_scale="dynamic", batchnorm=True, overflow_at=1),
    dict(opt="adamw", loss_scale="dynamic", batchnorm=False, overflow_at=None),
    dict(opt="adamw", loss_scale=128.0, batchnorm=True, overflow_at=None),
    dict(opt="sgd", loss_scale=128.0, batchnorm=False, overflow_at=None),
]


def _ids(config: dict[str, Any]) -> str:
    return "-".join(f"{k}={v}" for k, v in config.items())


def _sweep_all(script: Script) -> None:
    pace = {} if EVERY_LINE else dict(dense=60, stride=17, resume_every=3)
    for at in (0, 1):
        for call in [name for name, _ in script.iteration(None, at)]:
            if call != "zero_grad":
                sweep(script, at_iteration=at, call=call, **pace)


@pytest.mark.slow
@pytest.mark.parametrize("config", FP16_OPTIMIZER_CONFIGS if EVERY_LINE else FP16_OPTIMIZER_COVERING, ids=_ids)
def test_ctrl_c_anywhere_fp16_optimizer_more_configurations(config: dict[str, Any]) -> None:
    _sweep_all(fp16_optimizer_script(**config))


@pytest.mark.slow
@pytest.mark.parametrize("config", AMP_O2_CONFIGS if EVERY_LINE else AMP_O2_COVERING, ids=_ids)
def test_ctrl_c_anywhere_amp_o2_more_configurations(config: dict[str, Any]) -> None:
    _sweep_all(amp_o2_script(**config))


AMP_HANDLE_CONFIGS = [dict(opt=o, num_loss=n, overflow_at=ov) for o in sorted(OPTS) for n in (1, 2) for ov in (None, 1)]
AMP_HANDLE_COVERING = [
    dict(opt="sgd", num_loss=2, overflow_at=None),
    dict(opt="adamw", num_loss=2, overflow_at=1),
    dict(opt="adamw", num_loss=1, overflow_at=1),
]


@pytest.mark.slow
@pytest.mark.parametrize("config", AMP_HANDLE_CONFIGS if EVERY_LINE else AMP_HANDLE_COVERING, ids=_ids)
def test_ctrl_c_anywhere_amp_handle_more_configurations(handle: Any, config: dict[str, Any]) -> None:
    _sweep_all(amp_handle_script(handle, **config))


# ---------------------------------------------------------------------- a second Ctrl-C
def _twice(*args: Any) -> None:  # the user pressing Ctrl-C twice while the step runs
    handler = signal.getsignal(signal.SIGINT)
    handler(signal.SIGINT, None)
    handler(signal.SIGINT, None)


def test_a_second_ctrl_c_breaks_the_fp16_optimizer_step_and_it_refuses_until_restored() -> None:
    script = fp16_optimizer_script(opt="adamw")
    w = script.build()
    saved = script.checkpoint(w)
    hook = w.opt.register_step_pre_hook(_twice)
    for _, fn in script.iteration(w, 0)[:-1]:
        fn(w)
    with pytest.raises(KeyboardInterrupt) as info:
        w.opt.step()
    assert any("second Ctrl-C" in note for note in info.value.__notes__)
    hook.remove()
    for call in (w.opt.step, w.opt.zero_grad, lambda: w.opt.backward(_loss(w.model, 0, torch.float16, None))):
        with pytest.raises(RuntimeError, match="second Ctrl-C broke off"):
            call()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    script.restore(w, saved)  # recovers the optimizer and its masters
    ref = script.build()
    for world in (w, ref):
        for i in range(2):
            for _, fn in script.iteration(world, i):
                fn(world)
    assert_equal(script.state(w), script.state(ref), "after load_state_dict")


def _run(script: Script, w: Any, iterations: range) -> None:
    for i in iterations:
        for _, fn in script.iteration(w, i):
            fn(w)


def _refused(call: Any) -> str:
    with pytest.raises(RuntimeError, match="second Ctrl-C broke off") as info:
        call()
    return str(info.value)


@pytest.mark.parametrize("where", ["scale_loss exit, in the unscale", "scale_loss exit, in the scale update", "step"])
def test_a_second_ctrl_c_breaks_amp_and_it_refuses_until_restored(where: str, monkeypatch: Any) -> None:
    script = amp_o2_script(opt="adamw", overflow_at=2 if where == "step" else 1)  # (a skipped step: no hooks)
    w = script.build()
    _run(script, w, range(1))
    saved = roundtrip(script.checkpoint(w))  # what the user restores: the last checkpoint
    calls = script.iteration(w, 1)
    scaler = _amp_state.loss_scalers[0]
    if where == "step":
        hook = w.opt.register_step_pre_hook(_twice)
        broken = calls[-1]
        calls[0][1](w)
        calls[1][1](w)
    else:
        target = w.opt if "unscale" in where else scaler
        name = "_post_amp_backward" if "unscale" in where else "update"
        inner = getattr(target, name)
        monkeypatch.setattr(target, name, lambda *a: (_twice(), inner(*a)))
        broken = calls[1]
        calls[0][1](w)
    with pytest.raises(KeyboardInterrupt) as info:
        broken[1](w)
    assert any("second Ctrl-C" in note for note in info.value.__notes__)
    monkeypatch.undo()
    if where == "step":
        hook.remove()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    # every call that would train on, or save, half a change refuses, naming the fix
    texts = [_refused(lambda: _activate(w).opt.step())]
    for fn in (calls[1][1], lambda w: amp.state_dict()) if where != "step" else ():
        texts.append(_refused(lambda: fn(w)))
    if where == "step" or "unscale" in where:
        texts += [_refused(w.opt.zero_grad), _refused(w.opt.state_dict)]
    assert all("load_state_dict" in t and "checkpoint" in t for t in texts), texts
    if where != "step":
        assert "amp.load_state_dict(checkpoint['amp'])" in texts[1]
    # restored from the checkpoint (what a resumed run loads), training goes on as in that run
    script.restore(w, saved)
    ref = script.build()
    script.restore(ref, roundtrip(saved))
    for world in (w, ref):
        _run(script, world, range(1, 3))
    assert_equal(script.state(w), script.state(ref), "after load_state_dict")
    assert_equal(script.state(w), script.state(_run_all(script)), "against the uninterrupted run")


def _run_all(script: Script) -> Any:
    w = script.build()
    _run(script, w, range(3))
    return w


# ---------------------------------------------------------------------- two Ctrl-Cs anywhere
def _sigint_twice_at(n: int, gap: int, fn: Any) -> tuple[int, BaseException | None]:
    """Run ``fn()``, running the installed SIGINT handler at its ``n``-th and ``n + gap``-th line
    events (the user pressing Ctrl-C twice); returns how many fired and what ``fn`` raised."""
    count = fired = 0

    def local(frame: Any, event: str, arg: Any) -> Any:
        nonlocal count, fired
        if event == "line" and fired < 2:
            count += 1
            if count in (n, n + gap):
                fired += 1
                handler = signal.getsignal(signal.SIGINT)
                if callable(handler):
                    handler(signal.SIGINT, frame)
        return local

    previous = sys.gettrace()
    gc.collect()
    gc.disable()
    sys.settrace(lambda frame, event, arg: local if fired < 2 else None)
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - what the call raised is the outcome
        return fired, e
    finally:
        sys.settrace(previous)
        gc.enable()
    return fired, None


DOUBLE = dict(dense=20, stride=23)  # CI; the slow ones every 11th line, the two 3 lines apart
DOUBLE_SLOW = dict(dense=60, stride=11)


def _raised_by_delivery_without_note(error: BaseException) -> bool:
    tb = error.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_name == "_deliver" and code.co_filename.endswith(os.path.join("core", "interrupts.py")):
            return completed(error) is None
        tb = tb.tb_next
    return False


def double_tap_sweep(
    script: Script, *, call: str, at: int = 1, gap: int = 1, dense: int = 30, stride: int = 13
) -> dict[str, int]:
    """Two Ctrl-Cs ``gap`` lines apart at every point of ``call`` (each of the first ``dense``
    lines, every ``stride``-th after). The call raises KeyboardInterrupt, and then either

    * it refuses: saving (``checkpoint``) and training on (``optimizer.step()``) raise
      RuntimeError naming the fix, and restoring the checkpoint of the iteration's start and
      training on ends bit for bit as the uninterrupted run; or
    * nothing is half done: the checkpoint is the uninterrupted run's before the call, or after
      it if the KeyboardInterrupt says it was completed, and going on from there as after one
      Ctrl-C (repeating the call unless completed) ends bit for bit as the uninterrupted run."""
    final_ref, points = run_all(script)
    counts = {"points": 0, "refused": 0, "whole": 0, "stale handler": 0, "undelivered note": 0}
    n = 1
    while True:
        w = script.build()
        _run(script, w, range(at))
        saved = roundtrip(script.checkpoint(w))
        calls = list(script.iteration(w, at))
        k = [name for name, _ in calls].index(call)
        for _, fn in calls[:k]:
            fn(w)
        fired, error = _sigint_twice_at(n, gap, lambda: calls[k][1](w))
        if fired == 0:
            assert error is None, error
            return counts
        where = f"{call}: two Ctrl-Cs at lines {n} and {n + gap}"
        assert isinstance(error, KeyboardInterrupt), f"{where}: {error!r}"
        if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            # fp16kit.core.interrupts: the second one at a hold's exit line, before its restore,
            # leaves the hold's handler installed (test_two_ctrl_cs_at_a_holds_exit_...)
            counts["stale handler"] += 1
            signal.signal(signal.SIGINT, signal.default_int_handler)
        counts["points"] += 1
        try:
            ckpt = roundtrip(script.checkpoint(w))
        except RuntimeError as e:
            assert "second Ctrl-C broke off" in str(e) and "load_state_dict" in str(e), f"{where}: {e}"
            assert any("second Ctrl-C" in note for note in getattr(error, "__notes__", ())), where
            _refused(lambda: _activate(w).opt.step())
            counts["refused"] += 1
            script.restore(w, saved)
            _run(script, w, range(at, script.iterations))
        else:
            if _raised_by_delivery_without_note(error):
                # issue 17 open item (b), fp16kit.core.interrupts: the second one at _deliver's
                # first line drops the note that the call was completed (nothing says whether to
                # repeat it); restoring the checkpoint still gives the numbers
                counts["undelivered note"] += 1
                script.restore(w, saved)
                _run(script, w, range(at, script.iterations))
            else:
                done = completed(error) is not None
                assert_equal(
                    ckpt, points[(at, call, "after" if done else "before")], f"{where}: not refused, checkpoint"
                )
                counts["whole"] += 1
                for _, fn in calls[k + 1 :] if done else calls[k:]:
                    fn(w)
                _run(script, w, range(at + 1, script.iterations))
        assert_equal(script.state(w), final_ref, f"{where}: trained on")
        n += 1 if n < dense else stride


@pytest.mark.parametrize("call", ["scale_loss", "step"])
def test_two_ctrl_cs_anywhere_in_amp_o2_then_restore(call: str) -> None:
    counts = double_tap_sweep(amp_o2_script(opt="adamw", batchnorm=True, overflow_at=1, **CI), call=call, **DOUBLE)
    assert counts["refused"] > 0 and counts["whole"] > 0


def _handle_double_tap(handle: Any, call: str, **pace: Any) -> dict[str, int]:
    # the forwards apart: two Ctrl-Cs in one can break state of torch's own (in a context manager
    # of its Python code) -- torch's code, not the commits here
    script = amp_handle_script(handle, overflow_at=1, forward_apart=True, **CI)
    return double_tap_sweep(script, call=call, **pace)


@pytest.mark.parametrize("call", ["scale_loss_1", "step"])
def test_two_ctrl_cs_anywhere_in_an_amp_handle_iteration_then_restore(handle: Any, call: str) -> None:
    counts = _handle_double_tap(handle, call, **DOUBLE)
    assert counts["refused"] > 0 and counts["whole"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("config", AMP_O2_COVERING[1:3], ids=_ids)
@pytest.mark.parametrize("call", ["scale_loss", "step"])
def test_two_ctrl_cs_anywhere_in_amp_more_lines(call: str, config: dict[str, Any]) -> None:
    double_tap_sweep(amp_o2_script(**config, iterations=2), call=call, gap=3, **DOUBLE_SLOW)


@pytest.mark.slow
@pytest.mark.parametrize("call", ["scale_loss_0", "step"])
def test_two_ctrl_cs_anywhere_in_an_amp_handle_iteration_more_lines(handle: Any, call: str) -> None:
    _handle_double_tap(handle, call, gap=3, **DOUBLE_SLOW)
