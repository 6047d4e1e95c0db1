"""Asynchronous steps (docs/async.md): mode 1 (async_step=True), mode 2 (submit_step) and the
thread-aware GradScaler."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fp16kit
from _helpers import amp_iteration, batches, mlp, mse
from fp16kit import GradScaler, MixedPrecisionOptimizer
from fp16kit.core import kernels


class DelayedReference:
    """The hand-written one-step-delayed loop: the grads of iteration k (taken at the weights
    the model has then) are applied after step k-1's masters have reached the model; the
    scale follows torch's rule with no lag."""

    def __init__(self, model, opt_cls, scale, growth_interval, **kw):
        self.model = model
        self.masters = [p.detach().clone().float().requires_grad_() for p in model.parameters()]
        self.opt = opt_cls(self.masters, **kw)
        self.scale, self.tracker, self.interval = scale, 0, growth_interval
        self.pending = None

    def iteration(self, x, y, inject=False):
        for p in self.model.parameters():
            p.grad = None
        loss = mse(self.model, x, y)
        (loss * torch.tensor(self.scale)).backward()
        if inject:
            next(self.model.parameters()).grad.view(-1)[0] = float("inf")
        if self.pending is not None:  # step k-1 finishes; its masters reach the model
            grads, inv, skip = self.pending
            if not skip:
                for m, g in zip(self.masters, grads):
                    m.grad = g.float() * inv
                self.opt.step()
            with torch.no_grad():
                for p, m in zip(self.model.parameters(), self.masters):
                    p.copy_(m)
        grads = [p.grad for p in self.model.parameters()]
        skip = not all(torch.isfinite(g).all() for g in grads)
        self.pending = (grads, torch.tensor(1.0 / self.scale, dtype=torch.float64).float(), skip)
        if skip:
            self.scale, self.tracker = self.scale * 0.5, 0
        else:
            self.tracker += 1
            if self.tracker == self.interval:
                self.scale, self.tracker = self.scale * 2.0, 0
        return loss


# ------------------------------------------------------------------------------ mode 1
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "opt_cls, kw",
    [
        (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
        (torch.optim.Adam, {"lr": 1e-2}),
        (torch.optim.Adam, {"lr": 1e-2, "fused": True}),  # the kernel unscales (scales: powers of 2)
    ],
    ids=["sgd", "adam", "adam-fused"],
)
@pytest.mark.parametrize("flat", [False, True])
def test_mode1_equals_a_one_step_delayed_reference_bit_for_bit(dtype, opt_cls, kw, flat):
    model = mlp(dtype)
    ref = DelayedReference(copy.deepcopy(model), opt_cls, 1024.0, 3, **kw)
    opt = MixedPrecisionOptimizer(opt_cls(model.parameters(), **kw), async_step=True, flat=flat)
    scaler = GradScaler("cpu", init_scale=1024.0, growth_interval=3)
    for i, (x, y) in enumerate(batches(9, dtype)):
        inject = i in (3, 4)
        a = amp_iteration(model, opt, scaler, x, y, inject, deferred=True)
        b = ref.iteration(x, y, inject)
        assert torch.equal(a, b), f"loss at iteration {i}"
        assert scaler.get_scale() == ref.scale, f"scale at iteration {i}: no lag"
        for p, q in zip(model.parameters(), ref.model.parameters()):
            assert torch.equal(p, q), f"weights at iteration {i}"
    opt.synchronize()
    grads, inv, skip = ref.pending
    for m, g in zip(ref.masters, grads):
        m.grad = g.float() * inv
    ref.opt.step()
    for m, r in zip(opt.master_params, ref.masters):
        assert torch.equal(m, r)
    for p, m in zip(model.parameters(), opt.master_params):
        assert torch.equal(p, m.detach().to(dtype))  # synchronize() landed the last step
    assert scaler.skipped_steps() == 2


def test_mode1_without_a_scaler_skips_non_finite_on_the_thread():
    model = mlp(torch.bfloat16)
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), async_step=True)
    x, y = batches(1, torch.bfloat16)[0]
    mse(model, x, y).backward()
    model[0].weight.grad[0, 0] = float("nan")
    masters = [m.detach().clone() for m in opt.master_params]
    assert opt.step() is None
    opt.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(masters, opt.master_params))
    assert all(p.grad is None for p in model.parameters())  # handed to the thread


def _landing_threads(opt):
    """Record which thread copies the masters into the model (None: the main thread)."""
    seen = []
    copy_masters = opt._masters.masters_to_model

    def recording(*args, **kwargs):
        seen.append(fp16kit.core.thread.current_optimizer_thread())
        return copy_masters(*args, **kwargs)

    opt._masters.masters_to_model = recording
    return seen


def test_mode1_host_landing_runs_on_the_idle_optimizer_thread():
    model = mlp(torch.bfloat16)
    with fp16kit.OptimizerThread() as thread:
        opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), async_step=True, thread=thread)
        seen = _landing_threads(opt)
        for x, y in batches(3, torch.bfloat16):
            opt.zero_grad()
            mse(model, x, y).backward()
            opt.step()
        opt.synchronize()
        assert seen[:2] == [thread, thread]  # the steps' landings overlapped the checks
        assert seen[2] is None  # synchronize() lands on the caller
        for p, m in zip(model.parameters(), opt.master_params):
            assert torch.equal(p, m.detach().to(p.dtype))


def test_mode1_a_busy_shared_thread_lands_inline_without_waiting_for_other_work():
    import threading

    model = mlp(torch.bfloat16)
    with fp16kit.OptimizerThread() as thread:
        opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), async_step=True, thread=thread)
        seen = _landing_threads(opt)
        (x, y), (x2, y2) = batches(2, torch.bfloat16)
        mse(model, x, y).backward()
        opt.step()
        thread.wait(opt._async.main.inflight)  # the step is done; now the thread gets busy elsewhere
        release = threading.Event()
        other = thread.submit(release.wait, 30)
        opt.zero_grad()
        mse(model, x2, y2).backward()
        opt.step()  # must not wait behind the unrelated job
        assert not other.done() and seen == [None]
        release.set()
        opt.synchronize()
        assert other.result() is True


def test_mode1_fp32_params_get_masters_too():
    model = mlp(torch.bfloat16)
    model[2].float()
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), async_step=True)
    assert opt._groups.direct_params() == [] and len(opt.master_params) == 4
    with pytest.raises(TypeError, match="float64 param"):
        MixedPrecisionOptimizer(torch.optim.SGD(nn.Linear(2, 2).double().parameters(), lr=0.1), async_step=True)


def test_mode1_closures_are_refused():
    model = mlp(torch.bfloat16)
    opt = MixedPrecisionOptimizer(torch.optim.LBFGS(model.parameters()), async_step=True)
    with pytest.raises(RuntimeError, match="Closures are not supported with async_step=True"):
        opt.step(lambda: mse(model, *batches(1, torch.bfloat16)[0]))


class FailingSGD(torch.optim.SGD):
    fail_at = 3

    def step(self, closure=None):
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls == self.fail_at:
            raise RuntimeError("inner step failed")
        return super().step(closure)


def test_mode1_an_error_in_a_step_surfaces_at_the_next_call_and_training_goes_on():
    model = mlp(torch.bfloat16)
    opt = MixedPrecisionOptimizer(FailingSGD(model.parameters(), lr=0.1), async_step=True)
    scaler = GradScaler("cpu", init_scale=256.0)
    data = batches(6, torch.bfloat16)
    for x, y in data[:3]:
        amp_iteration(model, opt, scaler, x, y, deferred=True)
    with pytest.raises(RuntimeError, match="inner step failed"):
        amp_iteration(model, opt, scaler, *data[3], deferred=True)  # reports job 3's failure; this step did not run
    for x, y in data[4:]:
        amp_iteration(model, opt, scaler, x, y, deferred=True)
    opt.synchronize()
    assert opt.optimizer.calls == 5  # jobs 1, 2, 3 (failed), then the steps of data[4:]


def test_mode1_state_dict_during_pending_work_resumes_bit_for_bit(tmp_path):
    data = batches(10, torch.bfloat16)

    def build():
        model = mlp(torch.bfloat16)
        opt = MixedPrecisionOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2), async_step=True)
        return model, opt, GradScaler("cpu", init_scale=512.0, growth_interval=2)

    model, opt, scaler = build()
    for x, y in data[:5]:
        amp_iteration(model, opt, scaler, x, y, deferred=True)
    assert opt._async.main.inflight is not None  # a step is pending while we save
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "scaler": scaler.state_dict()}, tmp_path / "c.pt")
    for i, (x, y) in enumerate(data[5:]):
        amp_iteration(model, opt, scaler, x, y, inject=(i == 2), deferred=True)
    opt.synchronize()

    ck = torch.load(tmp_path / "c.pt", weights_only=True)
    model2, opt2, scaler2 = build()
    model2.load_state_dict(ck["model"])
    opt2.load_state_dict(ck["opt"])
    scaler2.load_state_dict(ck["scaler"])
    for i, (x, y) in enumerate(data[5:]):
        amp_iteration(model2, opt2, scaler2, x, y, inject=(i == 2), deferred=True)
    opt2.synchronize()
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)
    assert scaler.state_dict() == scaler2.state_dict()


def test_mode1_unscale_then_clip_then_step():
    model = mlp(torch.bfloat16)
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), async_step=True)
    scaler = GradScaler("cpu", init_scale=256.0)
    for x, y in batches(3, torch.bfloat16):
        opt.zero_grad()
        scaler.scale(mse(model, x, y)).backward()
        scaler.unscale_(opt)  # lands the previous step, unscales into the masters
        opt.clip_grad_norm_(1e-3)
        scaler.step(opt)
        scaler.update()
    opt.synchronize()
    assert scaler.skipped_steps() == 0


# ------------------------------------------------------------------------------ mode 2
def _overflowing_setup():
    """One fp16 weight whose gradient is 2 * scale: it overflows fp16 whenever scale > 2**14."""
    w = nn.Parameter(torch.ones(4, dtype=torch.float16))
    opt = MixedPrecisionOptimizer(torch.optim.SGD([w], lr=1e-6), master_device="cpu")
    scaler = GradScaler("cpu")  # init 2**16, growth interval 2000
    return w, opt, scaler


@pytest.mark.parametrize("is_async", [True, False])
def test_mode2_scenario_settles_where_torch_does(is_async):
    w, opt, scaler = _overflowing_setup()
    forward, stepped = [], []

    def step():
        stepped.append(scaler.get_scale())  # the scale of the step being run
        scaler.step(opt)
        opt.zero_grad()

    for _ in range(12):
        forward.append(scaler.get_scale())
        loss = scaler.scale((w.float() * 2).sum())
        loss.backward()
        opt.submit_step(step)
        scaler.update(is_async=is_async)
    opt.synchronize()
    assert stepped == forward  # the scale that multiplied a loss is the one it is unscaled with
    if is_async:  # one iteration of lag, and one overflowing scale is never backed off twice
        assert forward == [65536.0, 65536.0, 32768.0, 32768.0] + [16384.0] * 8
    else:  # torch's trajectory
        assert forward == [65536.0, 32768.0] + [16384.0] * 10
    assert scaler.state_dict()["scale"] == 16384.0


class Mode2Reference(DelayedReference):
    """Mode 2 with ``update(is_async=True)`` by hand: the step of iteration k unscales with the
    scale its loss was multiplied by, s_k; the update of iteration k runs after that step (the
    torch rule, a back-off starting from s_k and never above the current scale), and its
    result U_k first scales the loss of iteration k + 2."""

    def __init__(self, model, opt_cls, scale, growth_interval, **kw):
        super().__init__(model, opt_cls, scale, growth_interval, **kw)
        self.forward = [scale, scale]  # s_0, s_1; then s_k = U_{k-2}

    def iteration(self, x, y, inject=False):
        k = len(self.forward) - 2
        self.scale = self.forward[k]  # what DelayedReference multiplies the loss by
        tracker = self.tracker
        loss = super().iteration(x, y, inject)  # (its own, unlagged scale update is dropped)
        self.tracker = tracker
        grads, inv, overflow = self.pending
        state = self.forward[-1]
        if overflow:
            state, self.tracker = min(state, self.forward[k] * 0.5), 0
        else:
            self.tracker += 1
            if self.tracker == self.interval:
                state, self.tracker = state * 2.0, 0
        self.forward.append(state)
        return loss


@pytest.mark.parametrize(
    "opt_cls, kw",
    [(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}), (torch.optim.Adam, {"lr": 1e-2})],
    ids=["sgd", "adam"],
)
def test_mode2_async_updates_equal_a_hand_written_reference_bit_for_bit(opt_cls, kw):
    model = mlp(torch.float16)
    ref = Mode2Reference(copy.deepcopy(model), opt_cls, 1024.0, 3, **kw)
    opt = MixedPrecisionOptimizer(opt_cls(model.parameters(), **kw))
    scaler = GradScaler("cpu", init_scale=1024.0, growth_interval=3)
    for i, (x, y) in enumerate(batches(12, torch.float16)):
        inject = i in (4, 5, 9)
        assert scaler.get_scale() == ref.forward[i], f"forward scale at iteration {i}"
        opt.zero_grad()
        loss = mse(model, x, y)
        scaler.scale(loss).backward()
        if inject:
            next(model.parameters()).grad.view(-1)[0] = float("inf")
        opt.submit_step(lambda: (scaler.step(opt), opt.zero_grad()))
        scaler.update()
        assert torch.equal(loss, ref.iteration(x, y, inject)), f"loss at iteration {i}"
        for p, q in zip(model.parameters(), ref.model.parameters()):
            assert torch.equal(p, q), f"weights at iteration {i}"
    opt.synchronize()
    grads, inv, skip = ref.pending
    if not skip:
        for m, g in zip(ref.masters, grads):
            m.grad = g.float() * inv
        ref.opt.step()
    for m, r in zip(opt.master_params, ref.masters):
        assert torch.equal(m, r)
    assert scaler.skipped_steps() == 3


def test_mode2_update_before_the_step_raises_on_the_main_thread():
    w, opt, scaler = _overflowing_setup()
    scaler.scale((w.float() * 1e-3).sum()).backward()
    opt.submit_step(lambda: scaler.step(opt))
    scaler.update()
    scaler.scale((w.float() * 1e-3).sum()).backward()
    with pytest.raises(RuntimeError, match="called before this iteration's step"):
        scaler.update()
    opt.submit_step(lambda: scaler.step(opt))  # the right order works after the error
    scaler.update()
    opt.synchronize()


def test_mode2_a_second_step_without_update_raises_on_the_main_thread():
    w, opt, scaler = _overflowing_setup()
    scaler.scale((w.float() * 1e-3).sum()).backward()
    opt.submit_step(lambda: scaler.step(opt))
    opt.submit_step(lambda: scaler.step(opt))
    with pytest.raises(RuntimeError, match=r"step\(\) has already been called since the last update\(\)"):
        opt.synchronize()
    scaler.update()
    opt.synchronize()


def test_mode2_an_error_in_fn_surfaces_and_the_thread_keeps_working():
    w, opt, scaler = _overflowing_setup()

    def bad():
        raise ZeroDivisionError("in fn")

    scaler.scale((w.float() * 1e-3).sum()).backward()
    opt.submit_step(bad)
    with pytest.raises(ZeroDivisionError, match="in fn"):
        opt.synchronize()
    scaler.scale((w.float() * 1e-3).sum()).backward()
    opt.submit_step(lambda: (scaler.step(opt), opt.zero_grad()))
    scaler.update()
    opt.synchronize()


def test_mode2_grad_scaler_per_thread_behaviour():
    w, opt, scaler = _overflowing_setup()
    seen = {}

    def step():
        seen["scale"] = scaler.get_scale()
        seen["ret"] = scaler.step(opt)
        try:
            scaler.update()
        except RuntimeError as e:
            seen["update"] = str(e)
        scaler.set_growth_interval(7)  # inline on the thread
        opt.zero_grad()

    scaler.scale((w.float() * 1e-3).sum()).backward()
    opt.submit_step(step)
    scaler.update()
    opt.synchronize()
    assert seen["scale"] == 65536.0 and "must be called from the main thread" in seen["update"]
    assert scaler.get_growth_interval(up_to_date=True) == 7
    scaler.set_growth_factor(4.0)  # from the main thread: queued behind pending jobs
    assert scaler.get_growth_factor(up_to_date=True) == 4.0
    # from the main thread, a bound scaler's step runs on the optimizer thread and returns None
    before = opt.master_params[0].detach().clone()
    opt.param_groups[0]["lr"] = 10.0
    scaler.scale((w.float() * 1e-3).sum()).backward()
    assert scaler.step(opt) is None
    scaler.update()
    opt.synchronize()
    assert not torch.equal(before, opt.master_params[0])  # it stepped
    sd = scaler.state_dict()  # waits for pending work
    other = GradScaler("cpu")
    other.load_state_dict(sd)
    assert other.state_dict() == sd


def test_mode2_needs_a_master_for_every_param():
    model = mlp(torch.bfloat16)
    model[2].float()
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match="master_device"):
        opt.submit_step(lambda: None)
    async_opt = MixedPrecisionOptimizer(torch.optim.SGD(mlp(torch.bfloat16).parameters(), lr=0.1), async_step=True)
    with pytest.raises(RuntimeError, match="already steps asynchronously"):
        async_opt.submit_step(lambda: None)


def test_mode2_without_a_scaler():
    model = mlp(torch.bfloat16)
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), master_device="cpu")
    ref = copy.deepcopy(model)
    ref_opt = MixedPrecisionOptimizer(torch.optim.SGD(ref.parameters(), lr=0.1), master_device="cpu")
    x, y = batches(1, torch.bfloat16)[0]
    mse(model, x, y).backward()
    mse(ref, x, y).backward()
    opt.submit_step(lambda: (opt.step(), opt.zero_grad()))
    opt.synchronize()
    ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)


def test_public_names():
    assert fp16kit.OptimizerThread is fp16kit.core.thread.OptimizerThread


def test_an_unrelated_scaler_is_not_bound_by_earlier_submitted_steps():
    w, opt, scaler = _overflowing_setup()
    scaler.scale((w.float() * 1e-3).sum()).backward()
    opt.submit_step(lambda: scaler.step(opt))
    scaler.update()
    opt.synchronize()
    plain = GradScaler("cpu")
    plain.scale(torch.ones(()))
    with pytest.raises(AssertionError, match="No inf checks were recorded prior to update."):
        plain.update()  # torch's error: its step never went to the thread
    assert plain.__dict__.get("_binding") is None


# ------------------------------------------------------------------------------ hyperparameters
def _blocked(thread):
    """Hold the thread with a job until the returned event is set (the next step then runs
    after whatever the main thread does meanwhile)."""
    import threading

    release = threading.Event()
    thread.submit(release.wait, 30)
    return release


@pytest.mark.parametrize("mode", ["mode1", "mode2"])
def test_a_step_uses_the_lr_it_was_submitted_with(mode):
    # The scheduler sets lr=0 for the next step right after this one is submitted; the job,
    # run only afterwards, must still use lr=1 (as a synchronous step would have).
    model = mlp(torch.bfloat16)
    with fp16kit.OptimizerThread() as thread:
        opt = MixedPrecisionOptimizer(
            torch.optim.SGD(model.parameters(), lr=1.0),
            async_step=mode == "mode1",
            master_device="cpu",
            thread=thread,
        )
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1.0 if epoch == 0 else 0.0)
        before = [m.detach().clone() for m in opt.master_params]
        x, y = batches(1, torch.bfloat16)[0]
        mse(model, x, y).backward()
        release = _blocked(thread)
        if mode == "mode1":
            opt.step()
        else:
            opt.submit_step(lambda: (opt.step(), opt.zero_grad()))
        sched.step()
        assert opt.param_groups[0]["lr"] == 0.0
        release.set()
        opt.synchronize()
        assert all(not torch.equal(a, b) for a, b in zip(before, opt.master_params))


def test_what_a_step_writes_into_its_groups_or_itself_reaches_the_optimizer():
    # e.g. D-Adaptation keeps its estimate in the group; counters on the optimizer object.
    class Counting(torch.optim.SGD):
        def step(self, closure=None):
            self.calls = getattr(self, "calls", 0) + 1
            for g in self.param_groups:
                g["estimate"] = g.get("estimate", 0) + 1
            return super().step(closure)

    model = mlp(torch.bfloat16)
    opt = MixedPrecisionOptimizer(Counting(model.parameters(), lr=0.1), async_step=True)
    for x, y in batches(3, torch.bfloat16):
        opt.zero_grad()
        mse(model, x, y).backward()
        opt.step()
        opt.param_groups[0]["lr"] = 0.05  # the main thread's own write stays
    opt.synchronize()
    assert opt.optimizer.calls == 3
    assert opt.param_groups[0]["estimate"] == 3 and opt.param_groups[0]["lr"] == 0.05


def test_add_param_group_waits_for_the_step_in_flight():
    model = mlp(torch.bfloat16)
    extra = nn.Linear(3, 3).bfloat16()
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), async_step=True)
    x, y = batches(1, torch.bfloat16)[0]
    mse(model, x, y).backward()
    opt.step()
    opt.add_param_group({"params": extra.parameters(), "lr": 0.2})
    assert opt._async.main.inflight is None and len(opt.master_params) == 6
    mse(model, x, y).backward()
    extra(torch.ones(1, 3, dtype=torch.bfloat16)).float().sum().backward()
    opt.step()
    opt.synchronize()


def test_async_submit_lands_the_previous_step_itself():
    # The building blocks, as the legacy face uses them: a check without landing, then submit.
    model = mlp(torch.bfloat16)
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), async_step=True)
    inv = torch.ones(())
    for x, y in batches(3, torch.bfloat16):
        opt.zero_grad()
        mse(model, x, y).backward()
        flags = opt.async_check_grads(land=False)
        opt.async_submit(inv, kernels.combine_found_inf(flags.values(), torch.device("cpu")))
    opt.synchronize()
    for p, m in zip(model.parameters(), opt.master_params):
        assert torch.equal(p, m.detach().to(p.dtype))
    with pytest.raises(ValueError, match="missing_grads must be one of"):
        opt.async_submit(inv, torch.zeros(()), missing_grads="drop")
    sync = MixedPrecisionOptimizer(torch.optim.SGD(mlp(torch.bfloat16).parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match="build the optimizer with async_step=True"):
        sync.async_check_grads()


def test_a_submitted_function_may_set_the_lr_of_its_own_step():
    # e.g. a warm-up inside the job: it applies to this step, and stays afterwards.
    model = mlp(torch.bfloat16)
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), master_device="cpu")
    before = [m.detach().clone() for m in opt.master_params]
    x, y = batches(1, torch.bfloat16)[0]
    mse(model, x, y).backward()

    def warm_then_step():
        opt.param_groups[0]["lr"] = 0.0
        opt.step()

    opt.submit_step(warm_then_step)
    opt.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(before, opt.master_params))
    assert opt.param_groups[0]["lr"] == 0.0


def test_a_tensor_lr_updated_in_place_by_a_scheduler_reaches_only_the_next_step():
    model = mlp(torch.bfloat16)
    with fp16kit.OptimizerThread() as thread:
        opt = MixedPrecisionOptimizer(
            torch.optim.Adam(model.parameters(), lr=torch.tensor(1e-2)), async_step=True, thread=thread
        )
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1.0 if epoch == 0 else 0.0)
        before = [m.detach().clone() for m in opt.master_params]
        x, y = batches(1, torch.bfloat16)[0]
        mse(model, x, y).backward()
        release = _blocked(thread)
        opt.step()
        sched.step()  # lr.fill_(0.0) in place
        assert float(opt.param_groups[0]["lr"]) == 0.0
        release.set()
        opt.synchronize()
        assert all(not torch.equal(a, b) for a, b in zip(before, opt.master_params))


def test_a_step_replaced_on_the_optimizer_object_still_runs():
    model = mlp(torch.bfloat16)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = []
    original = inner.step

    def counting_step(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    inner.step = counting_step
    opt = MixedPrecisionOptimizer(inner, async_step=True)
    for x, y in batches(3, torch.bfloat16):
        opt.zero_grad()
        mse(model, x, y).backward()
        opt.step()
    opt.synchronize()
    assert len(calls) == 3


def test_a_scheduler_on_the_wrapped_optimizer_sees_the_step_taken(recwarn):
    model = mlp(torch.bfloat16)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(inner, step_size=10)  # tracks the inner optimizer
    opt = MixedPrecisionOptimizer(inner, async_step=True)
    for x, y in batches(3, torch.bfloat16):
        opt.zero_grad()
        mse(model, x, y).backward()
        opt.step()
        sched.step()  # before the job ran, maybe: no call-order warning
    opt.synchronize()
    assert not [w for w in recwarn if "lr_scheduler.step()" in str(w.message)]


def test_skip_counters_of_a_bound_scaler_are_read_where_its_updates_run():
    w, opt, scaler = _overflowing_setup()

    def step():
        scaler.step(opt)
        opt.zero_grad()

    for _ in range(5):
        scaler.scale((w.float() * 2).sum()).backward()
        opt.submit_step(step)
        scaler.update()
        scaler.skipped_steps()  # queued behind this iteration's update, never racing it
    assert scaler.skipped_steps() == 4  # 65536, 65536, 32768, 32768 overflow; 16384 does not
    assert scaler.consecutive_skipped_steps() == 0


def test_a_scheduler_stepped_inside_the_job_updates_a_tensor_lr():
    # LR schedulers fill_ a tensor lr in place: inside a job that lands in the snapshot and
    # must reach the live groups.
    model = mlp(torch.bfloat16)
    opt = MixedPrecisionOptimizer(torch.optim.Adam(model.parameters(), lr=torch.tensor(0.01)), master_device="cpu")
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for x, y in batches(3, torch.bfloat16):
        mse(model, x, y).backward()
        opt.submit_step(lambda: (opt.step(), sched.step(), opt.zero_grad()))
    opt.synchronize()
    assert float(opt.param_groups[0]["lr"]) == pytest.approx(0.01 * 0.5**3)


def test_a_replaced_step_wrapped_by_a_scheduler_runs_with_the_lr_the_job_sets():
    model = mlp(torch.bfloat16)
    inner = torch.optim.SGD(model.parameters(), lr=1.0)
    calls = []
    original = inner.step

    def counting_step(self, closure=None):
        calls.append(1)
        return original(closure)

    inner.step = counting_step.__get__(inner)  # a bound method, as wrappers install them
    torch.optim.lr_scheduler.StepLR(inner, step_size=10)  # wraps the replacement
    opt = MixedPrecisionOptimizer(inner, master_device="cpu")
    before = [m.detach().clone() for m in opt.master_params]
    x, y = batches(1, torch.bfloat16)[0]
    mse(model, x, y).backward()

    def frozen_step():
        opt.param_groups[0]["lr"] = 0.0  # live groups here: the replaced step reads them
        opt.step()

    opt.submit_step(frozen_step)
    opt.synchronize()
    assert len(calls) == 1
    assert all(torch.equal(a, b) for a, b in zip(before, opt.master_params))


def test_mode2_resume_from_a_checkpoint_is_bit_for_bit():
    def build():
        model = mlp(torch.float16)
        return model, MixedPrecisionOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2)), GradScaler("cpu")

    def run(model, opt, scaler, data):
        for x, y in data:
            opt.zero_grad()
            scaler.scale(mse(model, x, y)).backward()
            opt.submit_step(lambda: (scaler.step(opt), opt.zero_grad()))
            scaler.update()

    data = batches(6, torch.float16)
    model, opt, scaler = build()
    run(model, opt, scaler, data[:3])
    saved = copy.deepcopy((model.state_dict(), opt.state_dict(), scaler.state_dict()))
    run(model, opt, scaler, data[3:])
    opt.synchronize()

    model2, opt2, scaler2 = build()
    opt2.load_state_dict(saved[1])
    model2.load_state_dict(saved[0])
    scaler2.load_state_dict(saved[2])
    run(model2, opt2, scaler2, data[3:])
    opt2.synchronize()
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)


def test_skip_counters_after_a_failed_step_and_after_the_thread_is_gone():
    w, opt, scaler = _overflowing_setup()
    with fp16kit.OptimizerThread() as thread:
        opt._async._thread = thread

        def step():
            scaler.step(opt)
            opt.zero_grad()

        for _ in range(3):
            scaler.scale((w.float() * 2).sum()).backward()
            opt.submit_step(step)
            scaler.update()
        assert scaler.skipped_steps() == 3  # 65536, 65536 (one iteration of lag), 32768
        thread.submit(lambda: 1 / 0)
        assert scaler.skipped_steps() == 3  # waits, and leaves the error to be reported
        with pytest.raises(ZeroDivisionError):
            thread.synchronize()
    assert scaler.skipped_steps() == 3  # the thread is shut down: nothing to wait for
