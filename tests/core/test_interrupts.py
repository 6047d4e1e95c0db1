"""Ctrl-C at every line of a step, for MixedPrecisionOptimizer with fp16kit.GradScaler (issue 17 §1).

Each test sweeps one call of one iteration (tests/_helpers/interrupt.py): the interrupt is
never lost, a checkpoint right after it is the uninterrupted run's before or after the call,
and repeating the call (unless it says it was completed) or resuming from that checkpoint
ends with the uninterrupted numbers bit for bit.
"""

from __future__ import annotations

import os
import signal
import threading
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import fp16kit
from fp16kit.core.interrupts import ABANDONED, COMPLETED, RAISED, abandoned, completed, hold_interrupts
from tests._helpers.interrupt import Script, sigint_at, sweep


# ---------------------------------------------------------------------- the mechanism
def test_a_sigint_inside_a_hold_is_raised_at_its_end_with_the_completed_note() -> None:
    done = []
    with pytest.raises(KeyboardInterrupt) as info:
        with hold_interrupts("the test step"):
            signal.getsignal(signal.SIGINT)(signal.SIGINT, None)
            done.append(True)  # the block runs on to its end
    assert done == [True]
    assert completed(info.value) == "the test step"
    assert COMPLETED.format(what="the test step") in info.value.__notes__
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_second_sigint_breaks_the_hold_and_says_so() -> None:
    broken = []
    with pytest.raises(KeyboardInterrupt) as info:
        with hold_interrupts("the test step", on_abandon=lambda: broken.append(True)):
            handler = signal.getsignal(signal.SIGINT)
            handler(signal.SIGINT, None)
            handler(signal.SIGINT, None)
            raise AssertionError("not reached")
    assert broken == [True]
    assert ABANDONED.format(what="the test step") in info.value.__notes__
    assert completed(info.value) is None and abandoned(info.value)  # (run_inline lets only such a one go up)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert not abandoned(KeyboardInterrupt()) and not abandoned(ValueError(ABANDONED))


def test_holds_nest_and_only_the_outermost_delivers() -> None:
    with pytest.raises(KeyboardInterrupt) as info:
        with hold_interrupts("outer"):
            with hold_interrupts("inner"):
                signal.getsignal(signal.SIGINT)(signal.SIGINT, None)
            assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    assert completed(info.value) == "outer"


def test_no_hold_off_the_main_thread_or_without_a_python_handler() -> None:
    seen = []

    def worker() -> None:
        with hold_interrupts("off main"):
            seen.append(signal.getsignal(signal.SIGINT))

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen == [signal.default_int_handler]
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with hold_interrupts("ignored"):
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_users_handler_gets_the_held_signal_and_nothing_is_raised() -> None:
    got = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: got.append(signum))
    try:
        with hold_interrupts("the test step"):
            signal.getsignal(signal.SIGINT)(signal.SIGINT, None)
            assert got == []
        assert got == [signal.SIGINT]
    finally:
        signal.signal(signal.SIGINT, previous)


def test_another_error_inside_a_hold_still_delivers_the_interrupt() -> None:
    with pytest.raises(KeyboardInterrupt) as info:
        with hold_interrupts("the test step"):
            signal.getsignal(signal.SIGINT)(signal.SIGINT, None)
            raise ValueError("boom")
    assert isinstance(info.value.__context__, ValueError)
    # The call is over (it may have changed state before it raised): do not repeat it.
    assert completed(info.value) == "the test step"
    assert RAISED.format(what="the test step") in info.value.__notes__


def test_a_sigint_right_after_the_restore_still_says_completed() -> None:
    # The body's Ctrl-C is held; a second one fires at every line (the tracer). Each time the
    # body ran to its end and was not abandoned -- the second one came during the exit, after
    # the restore, from the default handler -- the interrupt must carry the COMPLETED note.
    reached: list[bool] = []

    def block() -> None:
        with hold_interrupts("the test step"):
            signal.getsignal(signal.SIGINT)(signal.SIGINT, None)
            reached.append(True)

    n, after_the_body = 1, 0
    while True:
        reached.clear()
        outcome = sigint_at(n, block)
        if not outcome.fired:
            break
        error = outcome.error
        assert isinstance(error, KeyboardInterrupt)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler, f"line {n}: left installed"
        abandoned = any(note.startswith("fp16kit: a second") for note in getattr(error, "__notes__", ()))
        if reached and not abandoned:
            after_the_body += 1
            assert completed(error) == "the test step", f"line {n}"
        n += 1
    assert after_the_body >= 3
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_the_tracer_delivers_through_the_installed_handler() -> None:
    def body() -> int:
        x = 1
        x += 1
        return x

    out = sigint_at(2, body)
    assert out.fired and isinstance(out.error, KeyboardInterrupt)
    assert sigint_at(10, body).fired is False


# ---------------------------------------------------------------------- scripts
def _model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3)).to(dtype)


def _batch(i: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(4, 6, generator=g).to(dtype)


def mpo_script(
    *,
    dtype: torch.dtype = torch.float16,
    async_step: bool = False,
    fused: bool = False,
    scaler: bool = True,
    clip: bool = False,
    overflow_at: int | None = None,
    extra: tuple[str, ...] = (),
    iterations: int = 3,
    submit: bool = False,
    routed: bool = False,
    async_policy: str | None = None,
) -> Script:
    """MixedPrecisionOptimizer(AdamW) on a small model, torch.amp style. ``extra``: calls added
    at the end of each iteration ("synchronize", "state_dict"). ``submit``: mode 2, the step
    and zero_grad run on the optimizer thread (``opt.submit_step``). ``routed``: the scaler is
    bound to the thread and ``scaler.step(opt)``, called on the main thread, runs there."""

    def build() -> Any:
        model = _model(dtype)
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=fused or None)
        thread = fp16kit.OptimizerThread() if async_step or submit or routed else None
        opt = fp16kit.MixedPrecisionOptimizer(inner, async_step=async_step, thread=thread, async_policy=async_policy)
        sc = fp16kit.GradScaler("cpu", init_scale=2.0**8, growth_interval=1) if scaler else None
        if routed:
            sc.bind(thread)
        return SimpleNamespace(model=model, opt=opt, scaler=sc, thread=thread, saved=None)

    def backward(w: Any, i: int) -> None:
        loss = w.model(_batch(i, dtype)).float().pow(2).mean()
        if i == overflow_at:
            loss = loss * 1e30
        (w.scaler.scale(loss) if w.scaler is not None else loss).backward()

    def iteration(w: Any, i: int) -> list:
        calls: list = [("zero_grad", lambda w: w.opt.zero_grad()), ("backward", lambda w: backward(w, i))]
        if submit:

            def step_job(w: Any) -> None:
                w.scaler.step(w.opt)
                w.opt.zero_grad()

            calls.append(("submit_step", lambda w: w.opt.submit_step(lambda: step_job(w), scaler=w.scaler)))
            calls.append(("update", lambda w: w.scaler.update()))
        elif scaler:
            if clip:
                calls.append(("unscale_", lambda w: w.scaler.unscale_(w.opt)))
                calls.append(("clip", lambda w: w.opt.clip_grad_norm_(0.5)))
            calls.append(("step", lambda w: w.scaler.step(w.opt)))
            calls.append(("update", lambda w: w.scaler.update()))
        else:
            if clip:
                calls.append(("clip", lambda w: w.opt.clip_grad_norm_(0.5)))
            calls.append(("step", lambda w: w.opt.step()))
        if "synchronize" in extra:
            calls.append(("synchronize", lambda w: w.opt.synchronize()))
        if "state_dict" in extra:
            calls.append(("state_dict", lambda w: setattr(w, "saved", w.opt.state_dict())))
        return calls

    def checkpoint(w: Any) -> dict[str, Any]:
        opt_state = w.opt.state_dict()  # first: it waits for a step still running (async)
        ckpt = {"model": {k: v.clone() for k, v in w.model.state_dict().items()}, "opt": opt_state}
        if w.scaler is not None:
            ckpt["scaler"] = w.scaler.state_dict()
        return ckpt

    def restore(w: Any, ckpt: dict[str, Any]) -> None:
        w.model.load_state_dict(ckpt["model"])
        w.opt.load_state_dict(ckpt["opt"])
        if w.scaler is not None:
            w.scaler.load_state_dict(ckpt["scaler"])

    def final(w: Any) -> Any:
        w.opt.synchronize()
        return {**checkpoint(w), "masters": [m.detach().clone() for m in w.opt.master_params]}

    def close(w: Any) -> None:
        if w.thread is not None:
            w.thread.shutdown()

    # The iteration ends after its last call; without extra calls, after update (or step) --
    # in mode 2 too: the scaler's state dict holds the lag ("next_scale").
    boundary = () if extra else ("update",) if scaler else ("step",)
    return Script(build, iteration, checkpoint, restore, iterations, final, close, boundary_calls=boundary)


# ---------------------------------------------------------------------- the sweeps (CI: small)
# Every line of the checks before a commit, then every 11th line; the slow test sweeps every line.
FAST = dict(dense=60, stride=11, resume_every=5)


@pytest.mark.parametrize("async_step", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("call", ["step", "update"])
def test_ctrl_c_anywhere_in_a_scaled_step_fp16(async_step: bool, call: str) -> None:
    counts = sweep(mpo_script(async_step=async_step), at_iteration=1, call=call, **FAST)
    assert counts["points"] > 0


@pytest.mark.parametrize("fused", [False, True], ids=["torch_ops", "kernel"])
def test_ctrl_c_anywhere_in_an_asynchronous_step_run_inline(fused: bool) -> None:
    # async_policy="inline": the job runs inside step() on the main thread, where a Ctrl-C can land in it
    for overflow_at in (None, 1):
        script = mpo_script(async_step=True, async_policy="inline", fused=fused, overflow_at=overflow_at)
        assert sweep(script, at_iteration=1, call="step", **FAST)["points"] > 0
    script = mpo_script(dtype=torch.bfloat16, async_step=True, async_policy="inline", fused=fused, scaler=False)
    sweep(script, at_iteration=1, call="step", **FAST)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_ctrl_c_anywhere_in_a_step_the_fused_kernel_takes(dtype: torch.dtype) -> None:
    # AdamW(fused=True): from the second step on, the scaler's check and the step are the kernel's
    # (fp16kit.master_weights.fused_step); the overflow at iteration 1 is a skipped kernel step.
    for overflow_at in (None, 1):
        counts = sweep(
            mpo_script(dtype=dtype, fused=True, overflow_at=overflow_at), at_iteration=1, call="step", **FAST
        )
        assert counts["points"] > 0
    # no scaler: opt.step() checks the grads itself and steps in the kernel
    sweep(mpo_script(dtype=dtype, fused=True, scaler=False), at_iteration=1, call="step", **FAST)


@pytest.mark.parametrize("async_step", [False, True], ids=["sync", "async"])
def test_ctrl_c_anywhere_in_step_without_a_scaler_bf16(async_step: bool) -> None:
    sweep(mpo_script(dtype=torch.bfloat16, async_step=async_step, scaler=False), at_iteration=1, call="step", **FAST)


@pytest.mark.parametrize("call", ["unscale_", "clip", "step"])
def test_ctrl_c_anywhere_with_unscale_and_clip(call: str) -> None:
    sweep(mpo_script(clip=True), at_iteration=1, call=call, **FAST)


@pytest.mark.parametrize("call", ["submit_step", "update"])
def test_ctrl_c_anywhere_in_a_submitted_step(call: str) -> None:
    # Saved and resumed right after update(), in the lag (the scale of iteration 0 changes).
    sweep(mpo_script(submit=True, overflow_at=0), at_iteration=1, call=call, **FAST)


@pytest.mark.parametrize("call", ["step", "update"])
def test_ctrl_c_anywhere_in_a_step_routed_to_the_thread(call: str) -> None:
    # A bound scaler's step called on the main thread runs on the optimizer thread (and waits).
    sweep(mpo_script(routed=True, overflow_at=0), at_iteration=1, call=call, **FAST)


@pytest.mark.parametrize("call", ["synchronize", "state_dict"])
def test_ctrl_c_anywhere_in_synchronize_and_state_dict(call: str) -> None:
    sweep(mpo_script(async_step=True, extra=("synchronize", "state_dict")), at_iteration=1, call=call, **FAST)


# ---------------------------------------------------------------------- slow: more configurations
# A covering set (each dtype, mode, fused, clip and overflow value appears), every 17th line of
# every call; FP16KIT_SWEEP_EVERY_LINE=1 sweeps every line of all 36 configurations (about an
# hour on two cores).
EVERY_LINE = os.environ.get("FP16KIT_SWEEP_EVERY_LINE") == "1"
ALL_CONFIGS = [
    dict(dtype=d, async_step=a, fused=f, clip=c, overflow_at=o)
    for d in (torch.float16, torch.bfloat16)
    for a in (False, True)
    for f in (False, True)
    for c in (False, True)
    for o in (None, 1)
] + [dict(dtype=d, submit=True, overflow_at=o) for d in (torch.float16, torch.bfloat16) for o in (None, 1)]
COVERING = [
    dict(dtype=torch.float16, async_step=False, fused=False, clip=False, overflow_at=None),
    dict(dtype=torch.float16, async_step=False, fused=True, clip=True, overflow_at=1),
    dict(dtype=torch.bfloat16, async_step=False, fused=False, clip=True, overflow_at=1),
    dict(dtype=torch.bfloat16, async_step=True, fused=True, clip=False, overflow_at=None),
    dict(dtype=torch.float16, async_step=True, fused=False, clip=True, overflow_at=1),
    dict(dtype=torch.float16, async_step=True, fused=True, clip=True, overflow_at=None),
    dict(dtype=torch.float16, submit=True, overflow_at=1),
    dict(dtype=torch.bfloat16, submit=True, overflow_at=None),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "config", ALL_CONFIGS if EVERY_LINE else COVERING, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items())
)
def test_ctrl_c_anywhere_more_configurations(config: dict[str, Any]) -> None:
    asynchronous = config.get("async_step") or config.get("submit")
    script = mpo_script(**config, extra=("synchronize", "state_dict") if asynchronous else ())
    pace = {} if EVERY_LINE else dict(dense=60, stride=17, resume_every=3)
    for call in [name for name, _ in script.iteration(None, 0)]:
        if call not in ("zero_grad", "backward"):
            sweep(script, at_iteration=1, call=call, **pace)


# ---------------------------------------------------------------------- a second Ctrl-C
def test_a_second_ctrl_c_breaks_the_step_and_the_optimizer_refuses_until_restored() -> None:
    model = _model(torch.float16)
    opt = fp16kit.MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    scaler = fp16kit.GradScaler("cpu", init_scale=2.0**8)
    saved = opt.state_dict()

    def twice(*args: Any) -> None:  # the user pressing Ctrl-C twice while the step runs
        handler = signal.getsignal(signal.SIGINT)
        handler(signal.SIGINT, None)
        handler(signal.SIGINT, None)

    hook = opt.register_step_pre_hook(twice)
    scaler.scale(model(_batch(0, torch.float16)).float().pow(2).mean()).backward()
    with pytest.raises(KeyboardInterrupt) as info:
        scaler.step(opt)
    assert any("second Ctrl-C" in note for note in info.value.__notes__)
    hook.remove()
    for call in (opt.step, opt.zero_grad, opt.state_dict, lambda: scaler.step(opt)):
        with pytest.raises(RuntimeError, match="second Ctrl-C broke off"):
            call()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    opt.load_state_dict(saved)
    scaler.load_state_dict(fp16kit.GradScaler("cpu", init_scale=2.0**8).state_dict())
    opt.zero_grad()
    scaler.scale(model(_batch(0, torch.float16)).float().pow(2).mean()).backward()
    scaler.step(opt)
    scaler.update()
