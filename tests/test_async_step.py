"""fp16kit.async_step: what a user sees when things go wrong around an asynchronous step --
Ctrl-C while waiting, an error in another optimizer's job on the shared thread, clipping
before a plain step(), zero_grad() on the main thread while a job runs, bad input."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from fp16kit import GradScaler, MixedPrecisionOptimizer, OptimizerThread


def _net(dtype=torch.bfloat16, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)).to(dtype)


def _loss(model, i):
    g = torch.Generator().manual_seed(100 + i)
    x = torch.randn(8, 4, generator=g)
    return model(x.to(next(model.parameters()).dtype)).float().pow(2).mean()


@pytest.fixture
def thread():
    t = OptimizerThread()
    yield t
    t.shutdown(wait=True, timeout=10)


class _GatedSGD(torch.optim.SGD):
    """SGD whose step waits for ``gate`` and counts the steps that finished."""

    def __init__(self, params, gate, **kw):
        super().__init__(params, **kw)
        self.gate = gate
        self.finished = 0

    def step(self, closure=None):
        assert self.gate.wait(10)
        out = super().step(closure)
        self.finished += 1
        return out


def test_ctrl_c_while_waiting_leaves_the_step_tracked(thread, monkeypatch):
    # "Save a checkpoint on Ctrl-C": a KeyboardInterrupt while synchronize() waits must not
    # forget the step in flight, so state_dict() waits for it and synchronize() lands it.
    gate = threading.Event()
    model = _net()
    inner = _GatedSGD(model.parameters(), gate, lr=0.1)
    opt = MixedPrecisionOptimizer(inner, async_step=True, thread=thread)
    _loss(model, 0).backward()
    opt.step()
    real_wait, interrupted = thread.wait, []

    def wait_once_interrupted(fut):
        if not interrupted:
            interrupted.append(True)
            raise KeyboardInterrupt
        return real_wait(fut)

    monkeypatch.setattr(thread, "wait", wait_once_interrupted)
    with pytest.raises(KeyboardInterrupt):
        opt.synchronize()
    assert inner.finished == 0
    gate.set()
    state = opt.state_dict()  # waits for the step: not a mid-step snapshot
    assert inner.finished == 1
    assert all(torch.equal(s, m) for s, m in zip(state["masters"][0], opt.master_params))
    opt.synchronize()
    for p, m in zip(opt.model_params, opt.master_params):
        assert torch.equal(p, m.to(p.dtype))  # landed


class _FailingSGD(torch.optim.SGD):
    def __init__(self, params, fail_at, **kw):
        super().__init__(params, **kw)
        self.calls = 0
        self.fail_at = fail_at

    def step(self, closure=None):
        self.calls += 1
        if self.calls == self.fail_at:
            raise ValueError("boom in A's step")
        return super().step(closure)


def _train_b(opt_b, model_b, thread, other=None, iters=4):
    """Train B, with A (``other``) stepping on the same thread; returns the errors caught."""
    caught = []
    for i in range(iters):
        if other is not None:
            model_a, opt_a = other
            opt_a.zero_grad()
            _loss(model_a, i).backward()
            try:
                opt_a.step()
            except ValueError as e:
                caught.append(("A", str(e)))
            thread.wait_idle()  # A's job has run (and failed, on its second step)
        opt_b.zero_grad()
        _loss(model_b, i).backward()
        try:
            opt_b.step()
        except ValueError as e:
            caught.append(("B", str(e)))
            assert all(p.grad is not None for p in model_b.parameters())  # nothing handed off
            opt_b.step()  # "call step() again": the same grads go
    opt_b.synchronize()
    return caught


def test_another_jobs_error_is_raised_before_the_hand_off_and_only_once(thread):
    model_b, ref_b = _net(seed=1), _net(seed=1)
    model_a = _net(seed=2)
    opt_a = MixedPrecisionOptimizer(_FailingSGD(model_a.parameters(), fail_at=2, lr=0.1), async_step=True, thread=thread)
    opt_b = MixedPrecisionOptimizer(torch.optim.SGD(model_b.parameters(), lr=0.1), async_step=True, thread=thread)
    caught = _train_b(opt_b, model_b, thread, other=(model_a, opt_a))
    assert caught == [("B", "boom in A's step")]  # once, at the first call that could report it
    alone = OptimizerThread()
    try:
        ref = MixedPrecisionOptimizer(torch.optim.SGD(ref_b.parameters(), lr=0.1), async_step=True, thread=alone)
        assert _train_b(ref, ref_b, alone) == []
    finally:
        alone.shutdown()
    for p, q in zip(model_b.parameters(), ref_b.parameters()):
        assert torch.equal(p, q)  # B lost no gradient


def test_an_error_delivered_through_the_future_is_not_raised_again(thread):
    model = _net()
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), master_device="cpu", thread=thread)
    _loss(model, 0).backward()
    fut = opt.submit_step(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        fut.result()
    for i in range(2):  # a loop that skips the failing batch goes on
        _loss(model, i).backward()
        opt.submit_step(lambda: opt.step()).result()
    opt.synchronize()
    thread.synchronize()


@pytest.mark.parametrize("plain_step", [True, False])
def test_async_unscale_clip_then_step_equals_the_same_with_scaler_step(plain_step):
    # scaler.unscale_(opt); opt.clip_grad_norm_(); opt.step() -- the plain step must use the
    # clipped, unscaled master grads (it handed the scaled model grads to the thread at scale 1).
    runs = []
    for plain in (plain_step, False):
        model = _net(torch.float16)
        opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), async_step=True)
        scaler = GradScaler("cpu", init_scale=2.0**10)
        norms = []
        for i in range(4):
            opt.zero_grad()
            scaler.scale(_loss(model, i)).backward()
            scaler.unscale_(opt)
            norms.append(opt.clip_grad_norm_(0.05))
            opt.step() if plain else scaler.step(opt)
            scaler.update()
        opt.synchronize()
        runs.append(([p.detach().clone() for p in model.parameters()], norms, scaler.get_scale()))
    (a, na, sa), (b, nb, sb) = runs
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert all(torch.equal(x, y) for x, y in zip(na, nb)) and sa == sb
    assert all(n < 100 for n in na)  # unscaled norms, not scaled by 2**10


def test_async_clip_without_scaler_equals_the_synchronous_clip():
    # clip_grad_norm_ with no scaler reads the grads into the masters after the step in flight
    # landed: the clipped update is the same as synchronous, one step later.
    model = _net()
    sync = _net()
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), async_step=True)
    ref = MixedPrecisionOptimizer(torch.optim.SGD(sync.parameters(), lr=0.1))
    for o, m in ((opt, model), (ref, sync)):
        o.zero_grad()
        _loss(m, 0).backward()
        o.clip_grad_norm_(0.01)
        o.step()
    opt.synchronize()
    for p, q in zip(model.parameters(), sync.parameters()):
        assert torch.equal(p, q)


def test_main_thread_zero_grad_cannot_clear_a_running_jobs_check(thread):
    # Mode 2: zero_grad() on the main thread while the job runs (allowed) must not reset the
    # non-finite check the job made: the inf step is skipped.
    model = _net(torch.float16)
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), master_device="cpu", thread=thread)
    before = [p.detach().clone() for p in model.parameters()]
    checked, go_on = threading.Event(), threading.Event()
    ensure = opt._grads.ensure

    def ensure_then_pause(state):
        ensure(state)
        checked.set()
        assert go_on.wait(10)

    opt._grads.ensure = ensure_then_pause
    _loss(model, 0).backward()
    model[0].weight.grad[0, 0] = float("inf")
    fut = opt.submit_step(lambda: opt.step())  # no scaler: the grads at scale 1
    assert checked.wait(10)
    opt.zero_grad()  # main thread, job in flight
    go_on.set()
    assert fut.result() is None  # skipped
    opt.synchronize()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_submit_step_checks_its_callable_before_handing_off(thread):
    model = _net(torch.float16)
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), master_device="cpu", thread=thread)
    _loss(model, 0).backward()
    with pytest.raises(TypeError, match="expects a callable"):
        opt.submit_step(None)
    assert all(p.grad is not None for p in model.parameters())  # still there
    assert opt._async.inflight is None
    with pytest.raises(TypeError, match="fp16kit.GradScaler"):
        opt.submit_step(lambda: None, scaler=torch.amp.GradScaler("cpu"))
    assert all(p.grad is not None for p in model.parameters())
    opt.submit_step(lambda: opt.step()).result()
