"""Where asynchronous steps run (fp16kit.master_weights.async_policy): the probe, the choice, and the same numbers."""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest
import torch

import fp16kit
from _helpers.interrupt import assert_equal
from fp16kit.core import fused
from fp16kit.core.fused import abi
from fp16kit.core.master import MasterParams
from fp16kit.legacy import FP16_Optimizer
from fp16kit.master_weights import async_policy
from fp16kit.master_weights.async_policy import AsyncPolicy, check_policy
from fp16kit.master_weights.fused_step import FusedSteps


class _Clock:
    """A fake perf_counter: each call returns the time so far; ``cost`` says how long the next interval takes."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _drive(policy: AsyncPolicy, clock: _Clock, steps: int, cost: dict[str, float]) -> list[str]:
    modes = []
    for _ in range(steps):
        mode = "inline" if policy.next_inline() else "thread"
        modes.append(mode)
        clock.now += cost[mode]
    return modes


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


# ---------------------------------------------------------------------- the policy alone
@pytest.mark.parametrize("bad", ["Auto", "threads", "", 1, True])
def test_a_policy_that_is_not_one_is_refused_naming_the_choices(bad):
    with pytest.raises(ValueError, match=r"async_policy must be one of \('auto', 'thread', 'inline'\)"):
        check_policy(bad)


def test_the_default_is_the_environment_s_then_auto(monkeypatch):
    monkeypatch.delenv("FP16KIT_ASYNC_POLICY", raising=False)
    assert check_policy(None) == "auto"
    monkeypatch.setenv("FP16KIT_ASYNC_POLICY", "inline")
    assert check_policy(None) == "inline"
    assert check_policy("thread") == "thread"  # an explicit one wins
    monkeypatch.setenv("FP16KIT_ASYNC_POLICY", "fast")
    with pytest.raises(ValueError, match="environment sets FP16KIT_ASYNC_POLICY='fast'"):
        check_policy(None)
    fp16kit.MixedPrecisionOptimizer(torch.optim.SGD(_model(torch.float16).parameters(), lr=0.1))  # (sync: unread)


def test_auto_warms_up_then_probes_each_mode_in_alternating_order_then_keeps_one():
    clock = _Clock()
    policy = AsyncPolicy("auto", worker_threads=lambda: 0, clock=clock)
    slot, warm = AsyncPolicy.SLOT, AsyncPolicy.WARMUP
    probe = warm + 2 * slot * AsyncPolicy.ROUNDS
    modes = _drive(policy, clock, probe, {"thread": 1.0, "inline": 1.0})
    t, i = ["thread"] * slot, ["inline"] * slot
    assert modes == ["thread"] * warm + t + i + i + t + t + i
    assert policy.mode == "probing"
    _drive(policy, clock, 1, {"thread": 1.0, "inline": 1.0})  # the step after the probe decides
    assert policy.mode in ("thread", "inline")


@pytest.mark.parametrize("faster", ["thread", "inline"])
def test_auto_keeps_the_mode_whose_iterations_took_less_and_logs_both(faster, caplog):
    clock = _Clock()
    policy = AsyncPolicy("auto", worker_threads=lambda: 0, clock=clock)
    cost = {"thread": 3.0, "inline": 5.0} if faster == "thread" else {"thread": 5.0, "inline": 3.0}
    probe = AsyncPolicy.WARMUP + 2 * AsyncPolicy.SLOT * AsyncPolicy.ROUNDS
    with caplog.at_level(logging.INFO, logger="fp16kit"):
        _drive(policy, clock, probe, cost)
        after = _drive(policy, clock, 10, cost)
    assert policy.mode == faster and after == [faster] * 10
    # each interval was charged to the mode of the job queued at its start, warm-up left out
    assert policy.samples == {m: [cost[m]] * (AsyncPolicy.SLOT * AsyncPolicy.ROUNDS) for m in ("thread", "inline")}
    (record,) = [r for r in caplog.records if "async_policy='auto' chose" in r.getMessage()]
    assert f"chose {faster} steps" in record.getMessage()
    assert "5e+03 ms" in record.getMessage() and "3e+03 ms" in record.getMessage()
    assert faster in repr(policy)


@pytest.mark.parametrize(("thread_cost", "kept"), [(0.97, "inline"), (0.94, "thread")])
def test_the_thread_is_kept_only_when_it_wins_by_the_margin(thread_cost, kept):
    # an inline step costs a synchronous one; a thread 3% faster is within a shared machine's noise
    clock = _Clock()
    policy = AsyncPolicy("auto", worker_threads=lambda: 0, clock=clock)
    _drive(policy, clock, AsyncPolicy.WARMUP + 2 * AsyncPolicy.SLOT * AsyncPolicy.ROUNDS + 1,
           {"thread": thread_cost, "inline": 1.0})  # fmt: skip
    assert policy.mode == kept


def test_set_fixes_a_mode_or_probes_again():
    clock = _Clock()
    policy = AsyncPolicy("thread", worker_threads=lambda: 0, clock=clock)
    assert _drive(policy, clock, 40, {"thread": 1.0, "inline": 1.0}) == ["thread"] * 40
    policy.set("inline")
    assert policy.mode == "inline" and _drive(policy, clock, 3, {"thread": 1.0, "inline": 1.0}) == ["inline"] * 3
    policy.set("auto")
    assert policy.mode == "probing"
    assert _drive(policy, clock, AsyncPolicy.WARMUP, {"thread": 1.0, "inline": 1.0}) == ["thread"] * 3
    with pytest.raises(ValueError):
        policy.set("sometimes")
    assert policy.mode == "probing"  # (a refused value changes nothing)


def test_inline_steps_under_auto_borrow_the_idle_optimizer_thread_s_threads(threads, monkeypatch):
    monkeypatch.setattr(async_policy, "_cores", lambda: 4)
    torch.set_num_threads(1)
    asked = []
    clock = _Clock()
    policy = AsyncPolicy("auto", worker_threads=lambda: asked.append(1) or 2, clock=clock)
    seen = []
    for _ in range(AsyncPolicy.WARMUP + 2 * AsyncPolicy.SLOT * AsyncPolicy.ROUNDS):
        inline = policy.next_inline()
        seen.append((inline, torch.get_num_threads()))
        clock.now += 1.0
    assert {n for inline, n in seen if inline} == {3}  # 1 + the worker's 2
    assert {n for inline, n in seen if not inline} == {1}  # given back on the thread's turns
    assert len(asked) == 1  # asked once per probe
    torch.set_num_threads(1)  # the program sets a count of its own meanwhile ...
    policy._decided = "inline"
    policy.next_inline()
    assert torch.get_num_threads() == 3  # ... and an inline step takes the borrowed count again
    policy.set("thread")
    assert torch.get_num_threads() == 1  # back to the main thread's own


def test_borrowing_never_oversubscribes_the_cores(threads, monkeypatch):
    monkeypatch.setattr(async_policy, "_cores", lambda: 2)
    torch.set_num_threads(2)
    policy = AsyncPolicy("auto", worker_threads=lambda: 2, clock=_Clock())
    policy._decided = "inline"
    policy.next_inline()
    assert torch.get_num_threads() == 2


def test_explicit_inline_leaves_the_thread_counts_alone(threads, monkeypatch):
    monkeypatch.setattr(async_policy, "_cores", lambda: 4)
    torch.set_num_threads(1)
    policy = AsyncPolicy("inline", worker_threads=lambda: 2, clock=_Clock())
    assert policy.next_inline()
    assert torch.get_num_threads() == 1


# ---------------------------------------------------------------------- on the optimizer
def _model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(31, 67), torch.nn.ReLU(), torch.nn.Linear(67, 9)).to(dtype)


def _batch(i: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(8, 31, generator=g).to(dtype), torch.randn(8, 9, generator=g)


def _train(policy: str, *, dtype=torch.float16, inner: Any = None, scaler: bool = True, steps: int = 40) -> dict:
    """An asynchronous training with overflows (fp16kit.GradScaler) or a NaN (no scaler); everything it ends with."""
    model = _model(dtype)
    inner = (inner or (lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True)))(model.parameters())
    opt = fp16kit.MixedPrecisionOptimizer(inner, async_step=True, async_policy=policy)
    gs = fp16kit.GradScaler("cpu", init_scale=2.0**10, growth_interval=3) if scaler else None
    modes = []
    for i in range(steps):
        opt.zero_grad()
        x, y = _batch(i, dtype)
        loss = torch.nn.functional.mse_loss(model(x).float(), y) * (1e30 if i in (4, 13, 22) else 1)
        if gs is None:
            loss.backward()
            if i == 13:
                model[0].weight.grad[0, 0] = float("nan")
            opt.step()
        else:
            gs.scale(loss).backward()
            gs.step(opt)
            gs.update()
        modes.append(opt.async_policy)
    opt.synchronize()
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "masters": [m.detach().clone() for m in opt.master_params],
        "optimizer": opt.state_dict(),
        "scale": None if gs is None else gs.get_scale(),
        "modes": modes,
    }


def _same(a: dict, b: dict) -> None:
    for key in ("params", "masters", "optimizer", "scale"):
        assert_equal(a[key], b[key], key)


_INNERS = {
    "adamw-fused": None,  # the one-pass kernel takes the jobs (where it is on)
    "adam-foreach": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=True),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
}


@pytest.mark.parametrize("inner", sorted(_INNERS))
@pytest.mark.parametrize(
    ("dtype", "scaler"),
    [(torch.float16, True), (torch.bfloat16, True), (torch.bfloat16, False)],
    ids=["fp16-grad_scaler", "bf16-grad_scaler", "bf16-no_scaler"],
)
def test_every_policy_trains_to_the_same_bits(inner, dtype, scaler):
    ref = _train("thread", dtype=dtype, inner=_INNERS[inner], scaler=scaler)
    for policy in ("inline", "auto"):
        out = _train(policy, dtype=dtype, inner=_INNERS[inner], scaler=scaler)
        _same(ref, out)
    assert out["modes"][0] == "probing" and out["modes"][-1] in ("thread", "inline")


@pytest.mark.skipif(fused.forms() is None, reason="the fused Adam kernel is off on this machine (logged)")
@pytest.mark.parametrize("policy", ["thread", "inline"])
def test_the_kernel_takes_the_jobs_with_the_torch_op_path_s_numbers(policy, monkeypatch):
    before = abi.Traffic.bytes
    kernel = _train(policy)
    assert abi.Traffic.bytes > before  # the kernel stepped
    monkeypatch.setattr(FusedSteps, "_job_plans", lambda self, groups, grad_of: None)  # torch's ops only
    before = abi.Traffic.bytes
    torch_ops = _train(policy)
    assert abi.Traffic.bytes == before
    _same(kernel, torch_ops)


@pytest.mark.skipif(fused.forms() is None, reason="the fused Adam kernel is off on this machine (logged)")
def test_inline_kernel_jobs_land_the_step_before_in_their_own_pass(monkeypatch):
    # no separate copy of the masters into the model at an inline step (skipped ones included: steps 4, 13, 22),
    # with the numbers of the thread's jobs, which land by that copy (test_every_policy_trains_to_the_same_bits)
    copies = []
    real = MasterParams.masters_to_model

    def counted(self, **kw):
        copies.append(kw)
        return real(self, **kw)

    monkeypatch.setattr(MasterParams, "masters_to_model", counted)
    landing = []
    real_step_job = FusedSteps.step_job
    monkeypatch.setattr(
        FusedSteps, "step_job", lambda self, *a, **kw: landing.append(kw.get("land")) or real_step_job(self, *a, **kw)
    )
    out = _train("inline", steps=30)
    assert landing.count(True) >= 27  # every job after the first two (the first step creates the state)
    assert len(copies) <= 3  # the first landings and synchronize()'s, none per step
    _same(out, _train("thread", steps=30))


@pytest.mark.skipif(fused.forms() is None, reason="the fused Adam kernel is off on this machine (logged)")
def test_after_a_kernel_job_the_masters_hold_no_stale_grad():
    model = _model(torch.float16)
    opt = fp16kit.MixedPrecisionOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True), async_step=True, async_policy="inline"
    )
    gs = fp16kit.GradScaler("cpu", init_scale=2.0**10)
    for i in range(3):
        opt.zero_grad()
        x, y = _batch(i, torch.float16)
        gs.scale(torch.nn.functional.mse_loss(model(x).float(), y)).backward()
        gs.step(opt)
        gs.update()
    opt.synchronize()
    assert all(m.grad is None for m in opt.master_params)


def test_fp16_optimizer_passes_the_policy_through_with_apex_s_numbers():
    def run(policy: str) -> list[torch.Tensor]:
        model = _model(torch.float16)
        opt = FP16_Optimizer(
            torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9),
            dynamic_loss_scale=True,
            verbose=False,
            async_step=True,
            async_policy=policy,
        )
        for i in range(12):
            opt.zero_grad()
            x, y = _batch(i, torch.float16)
            opt.backward(torch.nn.functional.mse_loss(model(x).float(), y) * (1e30 if i == 5 else 1))
            opt.step()
        opt.synchronize()
        assert opt._mpo.async_policy == policy
        return [p.detach().clone() for p in model.parameters()] + [m.detach().clone() for m in opt._mpo.master_params]

    assert_equal(run("thread"), run("inline"), "FP16_Optimizer")


class _FailingSGD(torch.optim.SGD):
    def __init__(self, params, fail_at, **kw):
        super().__init__(params, **kw)
        self.calls, self.fail_at = 0, fail_at

    def step(self, closure=None):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("boom in the step")
        return super().step(closure)


@pytest.mark.parametrize("policy", ["thread", "inline"])
def test_a_job_s_error_is_raised_at_the_next_step_in_either_mode(policy):
    model = _model(torch.float16)
    opt = fp16kit.MixedPrecisionOptimizer(
        _FailingSGD(model.parameters(), fail_at=2, lr=0.1), async_step=True, async_policy=policy
    )
    raised_at = []
    for i in range(4):
        opt.zero_grad()
        x, y = _batch(i, torch.float16)
        torch.nn.functional.mse_loss(model(x).float(), y).backward()
        try:
            opt.step()
        except RuntimeError as e:
            raised_at.append((i, str(e)))
            opt.step()  # nothing was handed off: the same grads go again
    opt.synchronize()
    assert raised_at == [(2, "boom in the step")]


def test_submit_step_runs_on_the_thread_whatever_the_policy(monkeypatch):
    monkeypatch.setenv("FP16KIT_ASYNC_POLICY", "inline")  # (mode 2 is async_step=False: only the default reaches it)
    model = _model(torch.float16)
    opt = fp16kit.MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), master_device="cpu")
    where = []
    for i in range(2):
        x, y = _batch(i, torch.float16)
        torch.nn.functional.mse_loss(model(x).float(), y).backward()
        opt.submit_step(lambda: (where.append(threading.current_thread().name), opt.inner_step()))
    opt.synchronize()
    assert where == [opt.thread.name] * 2


def test_the_policy_is_read_and_set_on_the_optimizer():
    model = _model(torch.float16)
    opt = fp16kit.MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), async_step=True)
    assert opt.async_policy == "probing"
    opt.async_policy = "inline"
    assert opt.async_policy == "inline"
    with pytest.raises(ValueError, match="async_policy must be one of"):
        opt.async_policy = "never"
    assert opt.async_policy == "inline"
    sync = fp16kit.MixedPrecisionOptimizer(torch.optim.SGD(_model(torch.float16).parameters(), lr=0.1))
    assert sync.async_policy is None
    with pytest.raises(ValueError, match="async_step=True"):
        sync.async_policy = "thread"
    with pytest.raises(ValueError, match="assign 'auto', 'thread' or 'inline'"):
        opt.async_policy = None
    assert opt.async_policy == "inline"


@pytest.mark.parametrize("policy", ["thread", "inline", "bogus"])
def test_a_policy_without_async_steps_is_refused_before_anything_changes(policy):
    inner = torch.optim.SGD(_model(torch.float16).parameters(), lr=0.1)
    with pytest.raises(ValueError, match="async_policy"):
        fp16kit.MixedPrecisionOptimizer(inner, async_policy=policy)
    fp16kit.MixedPrecisionOptimizer(inner, async_policy="auto")  # not marked wrapped: wrapping works now


class _SideModel(torch.nn.Module):
    """A param (``side``) that gets a grad only every third iteration."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.side = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4), torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, i: int) -> torch.Tensor:
        out = self.b(torch.relu(self.a(x)))
        return out + self.side(x) if i % 3 == 0 else out


@pytest.mark.parametrize("policy", ["thread", "inline"])
def test_zeroed_grads_and_a_param_with_some_grads_step_alike_with_and_without_the_kernel(policy, monkeypatch):
    # zero_grad(set_to_none=False): a missing grad is a zero grad, which AdamW steps; the kernel (which needs every
    # grad) must leave the master grads the torch-op path reads later (found by an adversarial pass: it stepped 6 of 9)
    def run() -> dict:
        model = _SideModel().half()
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True, weight_decay=0.1)
        opt = fp16kit.MixedPrecisionOptimizer(inner, async_step=True, async_policy=policy)
        gs = fp16kit.GradScaler("cpu", init_scale=2.0**10)
        for i in range(10):
            g = torch.Generator().manual_seed(i)
            x, y = torch.randn(4, 8, generator=g).half(), torch.randn(4, 4, generator=g)
            opt.zero_grad(set_to_none=False)
            gs.scale(((model(x, i).float() - y) ** 2).mean()).backward()
            gs.step(opt)
            gs.update()
        opt.synchronize()
        return {"params": [p.detach().clone() for p in model.parameters()], "optimizer": opt.state_dict()}

    kernel = run()
    monkeypatch.setattr(FusedSteps, "_job_plans", lambda self, groups, grad_of: None)  # torch's ops only
    assert_equal(kernel, run(), "kernel vs torch's ops")


def _failing(policy: str, thread: fp16kit.OptimizerThread) -> tuple[fp16kit.MixedPrecisionOptimizer, torch.nn.Module]:
    model = _model(torch.float16)
    opt = fp16kit.MixedPrecisionOptimizer(
        _FailingSGD(model.parameters(), fail_at=1, lr=0.1), async_step=True, async_policy=policy, thread=thread
    )
    x, y = _batch(0, torch.float16)
    torch.nn.functional.mse_loss(model(x).float(), y).backward()
    opt.step()  # the job fails (on the thread, or here)
    return opt, model


@pytest.mark.parametrize("policy", ["thread", "inline"])
def test_an_inline_job_s_error_is_one_of_the_thread_s_in_either_mode(policy):
    thread = fp16kit.OptimizerThread()
    try:
        opt, _ = _failing(policy, thread)
        thread.wait_idle()
        assert [str(e) for e in thread._undelivered_errors()] == ["boom in the step"]  # (what exit reports)
        with pytest.raises(RuntimeError, match="boom in the step"):
            thread.synchronize()
        thread.synchronize()  # delivered once
        opt.synchronize()  # ... and not again by the optimizer
    finally:
        thread.shutdown()


def test_synchronize_gives_the_borrowed_threads_back(threads, monkeypatch):
    monkeypatch.setattr(async_policy, "_cores", lambda: 4)
    torch.set_num_threads(1)
    model = _model(torch.float16)
    opt = fp16kit.MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), async_step=True)
    opt._async.policy._decided = "inline"  # (as if the probe chose it)
    opt._async.policy._index = 99
    for i in range(2):
        x, y = _batch(i, torch.float16)
        torch.nn.functional.mse_loss(model(x).float(), y).backward()
        opt.step()
        assert torch.get_num_threads() > 1  # borrowed while steps run inline
    opt.synchronize()
    assert torch.get_num_threads() == 1


def test_two_borrowing_optimizers_give_back_the_program_s_count(threads, monkeypatch):
    monkeypatch.setattr(async_policy, "_cores", lambda: 4)
    torch.set_num_threads(1)
    a, b = (AsyncPolicy("auto", worker_threads=lambda: 1, clock=_Clock()) for _ in range(2))
    for p in (a, b):
        p._decided = "inline"
        p.next_inline()
    assert torch.get_num_threads() == 2
    a.set("thread")
    assert torch.get_num_threads() == 2  # b still borrows
    b.set("thread")
    assert torch.get_num_threads() == 1


def _train_with(policy: str, kernel: bool, monkeypatch, step_of, steps: int = 6, scaler_cls=fp16kit.GradScaler):
    """A short asynchronous fp16 run; ``step_of(i, model, opt, scaler)`` runs iteration i. Params, steps, masters."""
    with monkeypatch.context() as m:
        if not kernel:
            m.setattr(FusedSteps, "_job_plans", lambda self, groups, grad_of: None)  # torch's ops only
        model = _model(torch.float16)
        opt = fp16kit.MixedPrecisionOptimizer(
            torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True), async_step=True, async_policy=policy
        )
        gs = scaler_cls("cpu", init_scale=2.0**10)
        for i in range(steps):
            step_of(i, model, opt, gs)
        opt.synchronize()
        return {
            "params": [p.detach().clone() for p in model.parameters()],
            "steps": [opt.optimizer.state[m]["step"].item() for m in opt.master_params],
            "masters": [m.detach().clone() for m in opt.master_params],
        }


@pytest.mark.skipif(fused.forms() is None, reason="the fused Adam kernel is off on this machine (logged)")
@pytest.mark.parametrize("clip", [False, True], ids=["step", "unscale-clip-step"])
@pytest.mark.parametrize("policy", ["thread", "inline"])
def test_zero_grad_keeping_zeros_after_kernel_jobs_steps_an_unused_param(policy, clip, monkeypatch):
    # the kernel's jobs leave the masters with no grad; zero_grad(set_to_none=False) must still leave a zero one on
    # each (torch zeroes the grad every param had), so a param unused at iteration 3 is stepped (adversarial finding)
    def step_of(i, model, opt, gs):
        opt.zero_grad(set_to_none=i != 3)
        x, y = _batch(i, torch.float16)
        h = torch.nn.functional.linear(x, model[0].weight) if i == 3 else model[0](x)  # bias unused at 3
        gs.scale(torch.nn.functional.mse_loss(model[2](model[1](h)).float(), y)).backward()
        if clip and i == 3:  # (the masters' grads made on the main thread, after kernel jobs)
            gs.unscale_(opt)
            opt.clip_grad_norm_(0.5)
        gs.step(opt)
        gs.update()

    kernel = _train_with(policy, True, monkeypatch, step_of)
    assert kernel["steps"] == [6.0] * 4  # every master stepped at every iteration
    off = _train_with(policy, False, monkeypatch, step_of)
    for key in kernel:
        assert_equal(kernel[key], off[key], key)


class _SummingScaler(fp16kit.GradScaler):
    def _reduce_found_inf(self, found_inf_per_device):  # a flag that reads 2 (a sum over ranks that overflowed)
        return {d: f * 2 for d, f in super()._reduce_found_inf(found_inf_per_device).items()}


@pytest.mark.skipif(fused.forms() is None, reason="the fused Adam kernel is off on this machine (logged)")
def test_an_inline_job_that_lands_skips_on_any_nonzero_flag(monkeypatch):
    def step_of(i, model, opt, gs):
        opt.zero_grad()
        x, y = _batch(i, torch.float16)
        gs.scale(torch.nn.functional.mse_loss(model(x).float(), y) * (1e30 if i == 4 else 1)).backward()
        gs.step(opt)
        gs.update()

    inline = _train_with("inline", True, monkeypatch, step_of, scaler_cls=_SummingScaler)
    assert inline["steps"] == [5.0] * 4 and all(torch.isfinite(m).all() for m in inline["masters"])
    thread = _train_with("thread", True, monkeypatch, step_of, scaler_cls=_SummingScaler)
    for key in inline:
        assert_equal(inline[key], thread[key], key)


@pytest.mark.parametrize("policy", ["thread", "inline"])
def test_a_keyboard_interrupt_raised_in_a_job_is_the_job_s_error_in_either_mode(policy):
    # a hook of the wrapped optimizer raises it inside step 4's job: the step returns, the next step raises it
    # before anything changes, its retry and the rest train as the thread does (adversarial finding: inline, it
    # escaped scaler.step with the flags unrecorded, and the scaler refused every later step)
    def run(policy: str, interrupt: bool) -> dict:
        model = _model(torch.float16)
        opt = fp16kit.MixedPrecisionOptimizer(
            torch.optim.AdamW(model.parameters(), lr=1e-2), async_step=True, async_policy=policy
        )
        gs = fp16kit.GradScaler("cpu", init_scale=2.0**10)
        calls, raised_at = [], []

        def hook(o, a, k):  # (counted: on the thread it runs beside the main thread's next iteration)
            calls.append(1)
            if interrupt and len(calls) == 5:  # job 4
                raise KeyboardInterrupt

        opt.optimizer.register_step_pre_hook(hook)
        for i in range(8):
            opt.zero_grad()
            x, y = _batch(i, torch.float16)
            gs.scale(torch.nn.functional.mse_loss(model(x).float(), y)).backward()
            try:
                gs.step(opt)
            except KeyboardInterrupt:
                raised_at.append(i)
                gs.step(opt)  # the retry: nothing was handed off yet
            gs.update()
        opt.synchronize()
        return {"params": [p.detach().clone() for p in model.parameters()], "raised_at": raised_at}

    out = run(policy, True)
    assert out["raised_at"] == [5]
    reference = run("thread", True)
    assert_equal(out["params"], reference["params"], "params")
