"""Unusual but legal call orders around a MixedPrecisionOptimizer step, through the step-state
machine (master_weights/step_state) and both sides of asynchronous steps (master_weights/sides).

Each states the behaviour from before the step state became one table: the same numbers as torch
would give, or the documented error -- never an ``internal:`` RuntimeError (a bug of ours).
"""

from __future__ import annotations

import copy

import pytest
import torch

from _helpers import mlp, mse
from fp16kit import GradScaler, MixedPrecisionOptimizer, OptimizerThread

SCALE = 1024.0  # a power of two: 1/scale is exact, the reference's unscale is bit for bit


def _data(i):
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(6, 8, generator=g).half(), torch.randn(6, 4, generator=g)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _no_internal_error(fn):
    try:
        return fn()
    except RuntimeError as e:
        assert not str(e).startswith("internal:"), f"an internal error reached the user: {e}"
        raise


class _Masters:
    """fp32 masters by hand: grads ``float(model grad) * 1/SCALE``, the same torch optimizer."""

    def __init__(self, model):
        self.model = copy.deepcopy(model)
        self.masters = [p.detach().clone().float().requires_grad_() for p in self.model.parameters()]
        self.opt = _sgd(self.masters)

    def backward(self, i):
        for p in self.model.parameters():
            p.grad = None
        (mse(self.model, *_data(i)) * SCALE).backward()
        for p, m in zip(self.model.parameters(), self.masters):
            m.grad = p.grad.float() * (1.0 / SCALE)

    def step(self):
        self.opt.step()
        with torch.no_grad():
            for p, m in zip(self.model.parameters(), self.masters):
                p.copy_(m)


def _assert_equal(model, opt, ref):
    for m, r in zip(opt.master_params, ref.masters):
        assert torch.equal(m, r)
    for p, q in zip(model.parameters(), ref.model.parameters()):
        assert torch.equal(p, q)


# ------------------------------------------------------------------ stepping around the scaler
def test_scaler_step_after_a_direct_step_following_unscale_steps_again():
    """``scaler.unscale_(opt); opt.step(); scaler.step(opt)``: torch would step twice with the
    unscaled grads (the masters keep their grads). No ``internal:`` error."""
    model = mlp()
    ref = _Masters(model)
    opt = MixedPrecisionOptimizer(_sgd(model.parameters()))
    scaler = GradScaler("cpu", init_scale=SCALE)
    for i in range(2):
        opt.zero_grad()
        scaler.scale(mse(model, *_data(i))).backward()
        scaler.unscale_(opt)
        opt.step()
        _no_internal_error(lambda: scaler.step(opt))
        scaler.update()
        ref.backward(i)
        ref.step()
        ref.step()
        _assert_equal(model, opt, ref)
    assert scaler.get_scale() == SCALE


def test_submitted_step_that_steps_directly_then_through_the_scaler():
    """The same inside a ``submit_step`` function (mode 2): the job must not fail with an
    ``internal:`` error; it equals a job that steps twice."""

    def run(twice_directly):
        thread = OptimizerThread()
        try:
            model = mlp()
            opt = MixedPrecisionOptimizer(_sgd(model.parameters()), thread=thread)
            scaler = GradScaler("cpu", init_scale=SCALE)
            scaler.bind(thread)

            def fn():
                scaler.unscale_(opt)
                opt.step()
                if twice_directly:
                    return opt.step()
                return _no_internal_error(lambda: scaler.step(opt))

            for i in range(2):
                scaler.scale(mse(model, *_data(i))).backward()
                fut = opt.submit_step(fn, scaler=scaler)
                scaler.update()
                assert fut.exception() is None, fut.exception()
            opt.synchronize()
            return [m.detach().clone() for m in opt.master_params]
        finally:
            thread.shutdown()

    for a, b in zip(run(False), run(True)):
        assert torch.equal(a, b)


# ------------------------------------------------------------------ grads reset after unscale_
@pytest.mark.parametrize("async_step", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("between", ["zero_grad", "load_state_dict", "step_with_closure"])
def test_scaler_step_after_the_unscaled_grads_were_reset(between, async_step):
    """``scaler.unscale_(opt)``, then something that resets the optimizer's step (zero_grad,
    a checkpoint load, a closure step), then ``scaler.step(opt)``: the documented "were reset
    since" RuntimeError in both modes (before, the synchronous one raised an ``internal:`` error)."""
    if async_step and between == "step_with_closure":
        pytest.skip("closures are refused with async_step=True")
    model = mlp()
    opt = MixedPrecisionOptimizer(_sgd(model.parameters()), async_step=async_step)
    scaler = GradScaler("cpu", init_scale=SCALE)
    opt.zero_grad()
    scaler.scale(mse(model, *_data(0))).backward()
    saved = copy.deepcopy(opt.state_dict())
    scaler.unscale_(opt)
    if between == "zero_grad":
        opt.zero_grad()
    elif between == "load_state_dict":
        opt.load_state_dict(saved)
    else:
        opt.step(lambda: mse(model, *_data(0)))
    before = [m.detach().clone() for m in opt.master_params]
    with pytest.raises(
        RuntimeError,
        match=r"^scaler\.unscale_\(optimizer\) ran this iteration, but the optimizer's gradients were reset since",
    ):
        _no_internal_error(lambda: scaler.step(opt))
    opt.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(before, opt.master_params))  # nothing stepped


# ------------------------------------------------------------------ behaved identically
@pytest.mark.parametrize("async_step", [False, True], ids=["sync", "async"])
def test_a_new_backward_after_unscale_raises_the_documented_error(async_step):
    model = mlp()
    opt = MixedPrecisionOptimizer(_sgd(model.parameters()), async_step=async_step)
    scaler = GradScaler("cpu", init_scale=SCALE)
    opt.zero_grad()
    scaler.scale(mse(model, *_data(0))).backward()
    scaler.unscale_(opt)
    scaler.scale(mse(model, *_data(1))).backward()
    with pytest.raises(RuntimeError, match=r"The model's gradients changed after scaler\.unscale_"):
        scaler.step(opt)
    with pytest.raises(RuntimeError, match=r"The model's gradients changed after scaler\.unscale_"):
        opt.clip_grad_norm_(1.0)
    opt.synchronize()


def test_unscale_step_update_twice_without_backward_applies_the_grads_twice():
    """A second ``unscale_``/``step`` with no new backward: the masters' grads (unscaled once
    more, as for grads read at scale 1 before) step again; no internal error."""
    model = mlp()
    opt = MixedPrecisionOptimizer(_sgd(model.parameters()))
    scaler = GradScaler("cpu", init_scale=SCALE)
    opt.zero_grad()
    scaler.scale(mse(model, *_data(0))).backward()
    for _ in range(2):
        scaler.unscale_(opt)
        _no_internal_error(lambda: scaler.step(opt))
        scaler.update()


@pytest.mark.parametrize("async_step", [False, True], ids=["sync", "async"])
def test_skipped_step_then_the_next_iteration_without_zero_grad(async_step):
    """An inf grad skips the step; the next backward runs with no zero_grad. Synchronously it
    accumulates onto the inf grads (skipped again); asynchronously the skipped step's grads were
    handed off, so the next one is clean. Equal, bit for bit, to the hand-written masters."""
    model = mlp()
    ref = _Masters(model)
    opt = MixedPrecisionOptimizer(_sgd(model.parameters()), async_step=async_step)
    scaler = GradScaler("cpu", init_scale=SCALE)
    opt.zero_grad()
    scaler.scale(mse(model, *_data(0))).backward()
    next(model.parameters()).grad.view(-1)[0] = float("inf")
    scaler.step(opt)
    scaler.update()
    assert [p.grad is None for p in model.parameters()] == [async_step] * 4
    scaler.scale(mse(model, *_data(1))).backward()
    scaler.step(opt)
    scaler.update()
    opt.synchronize()
    if async_step:
        assert scaler.get_scale() == SCALE / 2
        ref.backward(1)
        ref.step()
    else:
        assert scaler.get_scale() == SCALE / 4
    _assert_equal(model, opt, ref)


def test_two_optimizers_on_one_thread_and_calls_across_jobs():
    """Two submit_step optimizers share one OptimizerThread; o1's job calls o2 (param_groups,
    clip, zero_grad) and a synchronous optimizer's step. The calls answer on o2's standing side."""
    thread = OptimizerThread()
    try:
        m1, m2, m3 = mlp(seed=0), mlp(seed=5), mlp(seed=7)
        o1 = MixedPrecisionOptimizer(_sgd(m1.parameters()), thread=thread)
        o2 = MixedPrecisionOptimizer(_sgd(m2.parameters()), thread=thread)
        o3 = MixedPrecisionOptimizer(_sgd(m3.parameters()))
        s1, s2 = GradScaler("cpu", init_scale=SCALE), GradScaler("cpu", init_scale=SCALE / 2)
        s1.bind(thread)
        s2.bind(thread)
        seen = []
        for i in range(2):
            s1.scale(mse(m1, *_data(i))).backward()
            s2.scale(mse(m2, *_data(i + 3))).backward()
            mse(m3, *_data(i + 6)).backward()

            def f1():
                seen.append(o2.param_groups[0]["lr"])
                o3.step()
                o3.zero_grad()
                s1.unscale_(o1)
                o1.clip_grad_norm_(0.5)
                return s1.step(o1)

            def f2():
                return s2.step(o2)

            a = o1.submit_step(f1, scaler=s1)
            s1.update()
            b = o2.submit_step(f2, scaler=s2)
            s2.update()
            assert a.exception() is None and b.exception() is None
        o1.synchronize()
        o2.synchronize()
        assert seen == [0.1, 0.1]
    finally:
        thread.shutdown()


def test_submitted_function_that_raises_leaves_the_next_step_working():
    thread = OptimizerThread()
    try:
        model = mlp()
        opt = MixedPrecisionOptimizer(_sgd(model.parameters()), thread=thread)
        scaler = GradScaler("cpu", init_scale=SCALE)
        scaler.bind(thread)
        results = []
        for i in range(3):
            scaler.scale(mse(model, *_data(i))).backward()

            def fn(i=i):
                scaler.unscale_(opt)
                if i == 1:
                    raise ValueError("boom")
                return scaler.step(opt)

            fut = opt.submit_step(fn, scaler=scaler)
            scaler.update()
            results.append(type(fut.exception()).__name__ if fut.exception() else None)
        opt.synchronize()
        assert results == [None, "ValueError", None]
    finally:
        thread.shutdown()
