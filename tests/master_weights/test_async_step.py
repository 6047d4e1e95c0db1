"""fp16kit.master_weights.async_step: what a user sees when things go wrong around an asynchronous step --
Ctrl-C while waiting, an error in another optimizer's job on the shared thread, clipping
before a plain step(), zero_grad() on the main thread while a job runs, bad input."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from _helpers import seeded_loss, small_mlp
from fp16kit import GradScaler, MixedPrecisionOptimizer, OptimizerThread


def _net(dtype=torch.bfloat16, seed=0):
    return small_mlp(dtype, seed)


_loss = seeded_loss


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
    opt = MixedPrecisionOptimizer(inner, async_step=True, thread=thread, async_policy="thread")  # (gated there)
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
    opt_a = MixedPrecisionOptimizer(
        _FailingSGD(model_a.parameters(), fail_at=2, lr=0.1), async_step=True, thread=thread, async_policy="thread"
    )
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
    assert opt._async.main.inflight is None
    with pytest.raises(TypeError, match="fp16kit.GradScaler"):
        opt.submit_step(lambda: None, scaler=torch.amp.GradScaler("cpu"))
    assert all(p.grad is not None for p in model.parameters())
    opt.submit_step(lambda: opt.step()).result()


@pytest.mark.parametrize("async_step", [False, True])
def test_clip_before_unscale_clips_the_scaled_grads_as_torch(async_step):
    # torch allows clipping before scaler.unscale_: the *scaled* grads are clipped, then
    # scaler.step divides by the scale. With masters (here: every param, master_device)
    # the numbers must be torch's: the clip was lost (sync) or the unscale was (async).
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    ref = nn.Linear(4, 3)
    ref.load_state_dict(model.state_dict())
    opt = MixedPrecisionOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), master_device="cpu", async_step=async_step
    )
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    scaler, ref_scaler = GradScaler("cpu", init_scale=1024.0), torch.amp.GradScaler("cpu", init_scale=1024.0)
    for m, o, s in ((model, opt, scaler), (ref, ref_opt, ref_scaler)):
        o.zero_grad()
        s.scale(_loss(m, 0)).backward()
        if o is opt:
            o.clip_grad_norm_(1.0)
        else:
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        s.step(o)
        s.update()
    opt.synchronize()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)
    assert scaler.get_scale() == ref_scaler.get_scale()


def test_a_second_submit_step_without_update_is_refused_before_the_hand_off(thread):
    model = _net(torch.float16)
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), master_device="cpu", thread=thread)
    scaler = GradScaler("cpu", init_scale=256.0)

    def fn():
        scaler.step(opt)
        opt.zero_grad()

    scaler.scale(_loss(model, 0)).backward()
    opt.submit_step(fn, scaler=scaler)
    scaler.scale(_loss(model, 1)).backward()
    with pytest.raises(RuntimeError, match="call scaler.update"):
        opt.submit_step(fn, scaler=scaler)  # forgot scaler.update()
    assert all(p.grad is not None for p in model.parameters())  # iteration 1's grads kept
    scaler.update()
    opt.submit_step(fn, scaler=scaler)
    scaler.update()
    opt.synchronize()


def test_ctrl_c_while_update_waits_leaves_the_scaler_usable(thread, monkeypatch):
    # Mode 2: a KeyboardInterrupt while scaler.update() waits for the previous update must
    # leave the iteration records as they were: retrying update() continues exactly as an
    # uninterrupted run (scales and weights).
    def run(interrupt):
        model = _net(torch.float16)
        t = OptimizerThread()
        try:
            opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), master_device="cpu", thread=t)
            scaler = GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
            real_wait = t.wait
            for i in range(5):
                scaler.scale(_loss(model, i)).backward()
                if i == 2:
                    model[0].weight.grad[0, 0] = float("inf")
                opt.submit_step(lambda: (scaler.step(opt), opt.zero_grad()), scaler=scaler)
                if interrupt and i == 3:
                    calls = []

                    def wait_interrupted(fut):
                        if not calls:
                            calls.append(1)
                            raise KeyboardInterrupt
                        return real_wait(fut)

                    monkeypatch.setattr(t, "wait", wait_interrupted)
                    with pytest.raises(KeyboardInterrupt):
                        scaler.update()
                    monkeypatch.setattr(t, "wait", real_wait)
                scaler.update()
            opt.synchronize()
            return [p.detach().clone() for p in model.parameters()], scaler.state_dict()
        finally:
            t.shutdown()

    (a, sa), (b, sb) = run(True), run(False)
    assert all(torch.equal(x, y) for x, y in zip(a, b)) and sa == sb


def test_zero_grad_without_none_steps_params_with_no_grad_as_sync():
    # zero_grad(set_to_none=False): a param that gets no grad this iteration keeps a zero grad
    # and is stepped (SGD momentum moves it on), as torch and synchronous mode do. Grads that
    # do not depend on the weights make the delayed update equal the synchronous one.
    runs = []
    for async_step in (False, True):
        a = nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
        b = nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
        opt = MixedPrecisionOptimizer(torch.optim.SGD([a, b], lr=0.1, momentum=0.9), async_step=async_step)
        for i in range(4):
            opt.zero_grad(set_to_none=False)
            loss = (a * 2.0).float().sum() + ((b * 3.0).float().sum() if i == 0 else 0.0)
            loss.backward()
            opt.step()
        opt.synchronize()
        runs.append((a.detach().clone(), b.detach().clone()))
    (a0, b0), (a1, b1) = runs
    assert torch.equal(a0, a1) and torch.equal(b0, b1)
    assert not torch.equal(b0, torch.full((3,), 0.7, dtype=torch.bfloat16))  # momentum moved it on


def test_a_shut_down_thread_refuses_before_the_hand_off():
    model = _net()
    t = OptimizerThread()
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), async_step=True, thread=t)
    _loss(model, 0).backward()
    opt.step()
    opt.synchronize()
    t.shutdown()
    _loss(model, 1).backward()
    with pytest.raises(RuntimeError, match="was shut down"):
        opt.step()
    assert all(p.grad is not None for p in model.parameters())


def test_the_default_thread_made_anew_after_a_shutdown_is_followed():
    import fp16kit

    model = _net()
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), async_step=True)
    _loss(model, 0).backward()
    opt.step()
    opt.synchronize()
    fp16kit.optimizer_thread().shutdown()
    _loss(model, 1).backward()
    opt.step()  # on the new default thread
    opt.synchronize()
    assert opt.thread is fp16kit.optimizer_thread() and not opt.thread.closed


def test_scaler_step_with_a_positional_closure_matches_torch():
    # torch refuses only closure= as a keyword; a positional closure reaches optimizer.step,
    # which must step the grads the scaler unscaled (not re-read the scaled model grads).
    torch.manual_seed(0)
    model, ref = nn.Linear(4, 3), nn.Linear(4, 3)
    ref.load_state_dict(model.state_dict())
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), master_device="cpu")
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    scaler, ref_scaler = GradScaler("cpu"), torch.amp.GradScaler("cpu")
    for i in range(3):
        rets = []
        for m, o, s in ((model, opt, scaler), (ref, ref_opt, ref_scaler)):
            o.zero_grad()
            s.scale(_loss(m, i)).backward()
            rets.append(s.step(o, lambda: torch.tensor(7.0)))
            s.update()
        assert torch.equal(rets[0], rets[1])
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)


def test_an_optimizer_stepping_its_live_groups_with_frozen_params_is_refused_async():
    # step() replaced on the object: the job would step the live groups, where a frozen param
    # unfrozen meanwhile would be stepped with its scaled grad. Refused, before the hand-off.
    a = nn.Parameter(torch.ones(4, dtype=torch.half))
    b = nn.Parameter(torch.ones(4, dtype=torch.half), requires_grad=False)
    inner = torch.optim.SGD([a, b], lr=0.1)
    plain_step = inner.step
    inner.step = lambda closure=None: plain_step(closure)
    opt = MixedPrecisionOptimizer(inner, async_step=True)
    a.float().sum().backward()
    with pytest.raises(RuntimeError, match="replaced on the object"):
        opt.step()
    assert a.grad is not None and torch.equal(b, torch.ones(4, dtype=torch.half))


def test_mode2_zero_grad_without_none_after_synchronize_steps_params_with_no_grad(thread):
    # The set_to_none choice of every main-thread zero_grad() reaches the next submitted step
    # (also with no job in flight): b, with no grad, is stepped with a zero grad, as torch.
    a, b = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))
    ra, rb = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))
    opt = MixedPrecisionOptimizer(torch.optim.SGD([a, b], lr=0.1, momentum=0.9), master_device="cpu", thread=thread)
    ref = torch.optim.SGD([ra, rb], lr=0.1, momentum=0.9)
    for i, set_to_none in enumerate((True, True, False)):
        opt.zero_grad(set_to_none=set_to_none)
        ref.zero_grad(set_to_none=set_to_none)
        ((a + b).sum() if i < 2 else a.sum()).backward()
        ((ra + rb).sum() if i < 2 else ra.sum()).backward()
        opt.submit_step(opt.step)
        ref.step()
        if i == 1:
            opt.synchronize()
    opt.synchronize()
    assert torch.equal(a, ra) and torch.equal(b, rb)


def test_mode2_zero_grad_in_the_job_leaves_the_main_threads_grads(thread):
    # The job's opt.zero_grad() clears the masters, not a frozen-when-wrapped model param's
    # grad that the main thread's next backward just made.
    gate = threading.Event()
    a = nn.Parameter(torch.ones(4, dtype=torch.half))
    b = nn.Parameter(torch.ones(4, dtype=torch.half), requires_grad=False)
    opt = MixedPrecisionOptimizer(torch.optim.SGD([a, b], lr=0.1), master_device="cpu", thread=thread)
    a.float().sum().backward()
    fut = opt.submit_step(lambda: (opt.step(), gate.wait(10), opt.zero_grad()))
    b.requires_grad_(True)
    (a + b).float().sum().backward()
    gate.set()
    fut.result()
    assert b.grad is not None and a.grad is not None


def test_a_bound_scaler_follows_the_default_thread_made_anew():
    import fp16kit

    model = _net(torch.float16)
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), master_device="cpu")
    scaler = GradScaler("cpu")
    for i in range(4):
        scaler.scale(_loss(model, i)).backward()
        opt.submit_step(lambda: (scaler.step(opt), opt.zero_grad()), scaler=scaler)
        scaler.update()
        if i == 1:
            opt.synchronize()
            fp16kit.optimizer_thread().shutdown()
    opt.synchronize()
    assert not opt.thread.closed


@pytest.mark.parametrize("kw", [{"async_step": True}, {"master_device": "cpu"}])
def test_sparse_grads_into_masters_are_refused_with_the_reason(kw):
    # Every param gets a master with async_step or a master_device: a float32 sparse embedding
    # cannot be stepped there -- a clear error (not a dispatcher dump), nothing handed off.
    emb = nn.Embedding(10, 4, sparse=True)
    opt = MixedPrecisionOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1), **kw)
    scaler = GradScaler("cpu")
    scaler.scale(emb(torch.tensor([1, 2])).sum()).backward()
    with pytest.raises(TypeError, match="async_step/master_device"):
        scaler.step(opt)
    assert emb.weight.grad is not None
