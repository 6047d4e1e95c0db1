"""fp16kit.scaler.binding: binding a GradScaler to the optimizer thread -- explicitly
(submit_step(fn, scaler=), scaler.bind), lazily only where unambiguous -- and the
scaler <-> optimizer protocol (fp16kit.core.protocol) as users meet it."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

import fp16kit.master_weights.optimizer
import fp16kit.scaler.grad_scaler
from _helpers import seeded_loss, small_mlp
from fp16kit import GradScaler, MixedPrecisionOptimizer
from fp16kit.core import protocol
from fp16kit.core.protocol import MasterWeightOptimizer
from fp16kit.legacy import FP16_Optimizer


def _net(dtype=torch.float16, seed=0):
    return small_mlp(dtype, seed)


_loss = seeded_loss


@pytest.fixture(autouse=True)
def _own_scaled_iterations(monkeypatch):
    # The registry is process-wide: a scaler another test left mid-iteration must not count.
    fresh = protocol.ScaledIterations()
    monkeypatch.setattr(fp16kit.scaler.grad_scaler, "scaled_iterations", fresh)
    monkeypatch.setattr(fp16kit.master_weights.misuse, "scaled_iterations", fresh)


def _mode2(model, opt, scaler, iters, *, explicit=True, inject=()):
    for i in range(iters):
        loss = scaler.scale(_loss(model, i))
        loss.backward()
        if i in inject:
            model[0].weight.grad[0, 0] = float("inf")
        fn = lambda: (scaler.step(opt), opt.zero_grad())  # noqa: E731
        opt.submit_step(fn, scaler=scaler) if explicit else opt.submit_step(fn)
        scaler.update()
    opt.synchronize()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("explicit", [True, False])
def test_mode2_with_and_without_scaler_keyword_train_the_same(threads, explicit):
    runs = []
    for how in (explicit, True):
        model = _net()
        opt = MixedPrecisionOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), master_device="cpu", thread=threads()
        )
        scaler = GradScaler("cpu", init_scale=2.0**10)
        runs.append((_mode2(model, opt, scaler, 6, explicit=how, inject=(2,)), scaler.get_scale()))
    (a, sa), (b, sb) = runs
    assert all(torch.equal(x, y) for x, y in zip(a, b)) and sa == sb


def test_bind_before_the_first_scale_binds_at_it(threads):
    thread = threads()
    model = _net()
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), master_device="cpu", thread=thread)
    scaler = GradScaler("cpu", init_scale=2.0**10)
    scaler.bind(thread)
    scaler.bind(thread)  # again: nothing changes
    _mode2(model, opt, scaler, 3, explicit=False)
    with pytest.raises(RuntimeError, match="cannot also be used"):
        scaler.bind(threads())
    with pytest.raises(TypeError, match="OptimizerThread"):
        scaler.bind("fp16kit-optimizer")


def test_lazy_binding_refuses_to_guess_between_two_threads(threads):
    # One scaler, steps submitted to two threads in one iteration and no scaler=: update()
    # cannot tell where this scaler's step runs; it says how to bind, rather than guess.
    models = [_net(seed=s) for s in (0, 1)]
    opts = [
        MixedPrecisionOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), master_device="cpu", thread=threads())
        for m in models
    ]
    scaler = GradScaler("cpu")
    loss = scaler.scale(_loss(models[0], 0) + _loss(models[1], 0))
    loss.backward()
    for opt in opts:
        opt.submit_step(lambda: None)  # (a job that ran scaler.step would bind it there)
    with pytest.raises(RuntimeError, match="scaler=scaler"):
        scaler.update()
    for opt in opts:
        opt.synchronize()


def test_master_weight_optimizers_speak_the_protocol():
    model = _net()
    assert isinstance(MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1)), MasterWeightOptimizer)
    legacy = FP16_Optimizer(torch.optim.SGD(_net().parameters(), lr=0.1), verbose=False)
    assert isinstance(legacy, MasterWeightOptimizer)
    assert not isinstance(torch.optim.SGD(_net(torch.float32).parameters(), lr=0.1), MasterWeightOptimizer)


def test_fp16_optimizer_driven_by_grad_scaler_equals_mixed_precision_optimizer():
    runs = []
    for make in (
        lambda p: MixedPrecisionOptimizer(torch.optim.SGD(p, lr=0.1, momentum=0.9)),
        lambda p: FP16_Optimizer(torch.optim.SGD(p, lr=0.1, momentum=0.9), verbose=False),
    ):
        model = _net()
        opt = make(model.parameters())
        scaler = GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
        for i in range(6):
            opt.zero_grad()
            scaler.scale(_loss(model, i)).backward()
            if i == 3:
                model[2].weight.grad[0, 0] = float("nan")
            scaler.step(opt)
            scaler.update()
        runs.append(([p.detach().clone() for p in model.parameters()], scaler.get_scale()))
    (a, sa), (b, sb) = runs
    assert all(torch.equal(x, y) for x, y in zip(a, b)) and sa == sb


@pytest.mark.parametrize("async_step", [False, True])
def test_step_called_directly_after_a_scaled_backward_warns_once(caplog, async_step):
    model = _net()
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), async_step=async_step)
    scaler = GradScaler("cpu")
    with caplog.at_level(logging.WARNING, logger="fp16kit"):
        for i in range(3):
            opt.zero_grad()
            scaler.scale(_loss(model, i)).backward()
            opt.step()  # should have been scaler.step(opt)
    warned = [r for r in caplog.records if "scaler.step(optimizer)" in r.getMessage()]
    assert len(warned) == 1
    opt.synchronize()


def test_no_warning_through_the_scaler_or_without_one(caplog):
    model = _net()
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    scaler = GradScaler("cpu")
    with caplog.at_level(logging.WARNING, logger="fp16kit"):
        for i in range(2):
            opt.zero_grad()
            scaler.scale(_loss(model, i)).backward()
            scaler.unscale_(opt)
            opt.clip_grad_norm_(1.0)
            scaler.step(opt)
            scaler.update()
        opt.zero_grad()
        _loss(model, 5).backward()
        opt.step()  # no scaler iteration open: fine
    assert not [r for r in caplog.records if "scaler.step(optimizer)" in r.getMessage()]


def test_a_bound_scaler_steps_another_optimizer_on_the_thread_and_lands_it(threads):
    # scaler.step(opt) from the main thread of a bound scaler runs on the thread; an optimizer
    # with masters must still update its model (it moved only the masters).
    thread = threads()
    runs = []
    for bound in (True, False):
        torch.manual_seed(0)
        model = nn.Linear(3, 1)
        opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), master_device="cpu", thread=thread)
        scaler = GradScaler("cpu")
        if bound:
            scaler.bind(opt.thread)
        for _ in range(3):
            opt.zero_grad()
            scaler.scale(model(torch.ones(2, 3)).sum()).backward()
            scaler.step(opt)
            scaler.update(is_async=False)
        opt.synchronize()
        runs.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(x, y) for x, y in zip(*runs))
    assert not torch.equal(runs[0][0], nn.Linear(3, 1).weight)  # it trained


def test_a_routed_step_then_a_submitted_step_is_one_iteration(threads):
    # One scaler for two optimizers: B stepped through the bound scaler, A submitted. Not "a
    # step was already submitted" -- that refers to submit_step alone.
    thread = threads()
    model_a, model_b = _net(seed=0), _net(seed=1)
    opt_a = MixedPrecisionOptimizer(torch.optim.SGD(model_a.parameters(), lr=0.1), master_device="cpu", thread=thread)
    opt_b = MixedPrecisionOptimizer(torch.optim.SGD(model_b.parameters(), lr=0.1), master_device="cpu", thread=thread)
    scaler = GradScaler("cpu", init_scale=2.0**8)
    scaler.bind(thread)
    for i in range(3):
        opt_b.zero_grad()
        scaler.scale(_loss(model_a, i) + _loss(model_b, i)).backward()
        scaler.step(opt_b)
        opt_a.submit_step(lambda: (scaler.step(opt_a), opt_a.zero_grad()), scaler=scaler)
        scaler.update()
    opt_a.synchronize()


def test_a_bound_scaler_cannot_be_pickled_mid_iteration(threads):
    import pickle

    thread = threads()
    model = _net()
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), master_device="cpu", thread=thread)
    scaler = GradScaler("cpu")
    scaler.scale(_loss(model, 0)).backward()
    opt.submit_step(lambda: (scaler.step(opt), opt.zero_grad()), scaler=scaler)
    with pytest.raises(AssertionError, match="may only be pickled"):
        pickle.dumps(scaler)
    scaler.update()
    assert pickle.loads(pickle.dumps(scaler)).get_scale() == scaler.get_scale()


def test_one_scaler_two_submitted_optimizers_per_iteration(threads):
    # Each optimizer submits its step with scaler=; one update() per iteration. Equals the
    # same loop where only the first names the scaler (refused before: "a step was already
    # submitted").
    runs = []
    for both in (True, False):
        thread = threads()
        models = [_net(seed=0), _net(seed=1)]
        opts = [
            MixedPrecisionOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), master_device="cpu", thread=thread)
            for m in models
        ]
        scaler = GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
        for i in range(4):
            for o in opts:
                o.zero_grad()
            scaler.scale(_loss(models[0], i) + _loss(models[1], i)).backward()
            if i == 2:
                models[1][0].weight.grad[0, 0] = float("inf")
            for k, o in enumerate(opts):
                fn = lambda o=o: (scaler.step(o), o.zero_grad())  # noqa: E731
                o.submit_step(fn, scaler=scaler) if both or k == 0 else o.submit_step(fn)
            scaler.update(is_async=False)
        for o in opts:
            o.synchronize()
        runs.append(([p.detach().clone() for m in models for p in m.parameters()], scaler.get_scale()))
    (a, sa), (b, sb) = runs
    assert all(torch.equal(x, y) for x, y in zip(a, b)) and sa == sb


# ---------------------------------------------------------------------- checkpoints in the lag
OVERFLOW = 2


def _iterate(model, opt, scaler, steps, *, explicit):
    for i in steps:
        opt.zero_grad()
        loss = scaler.scale(_loss(model, i) * (1e30 if i == OVERFLOW else 1.0))  # one overflow
        loss.backward()
        fn = lambda: (scaler.step(opt), opt.zero_grad())  # noqa: E731
        opt.submit_step(fn, scaler=scaler) if explicit else opt.submit_step(fn)
        scaler.update()


def _world(threads):
    model = _net()
    opt = MixedPrecisionOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2), thread=threads())
    return model, opt, GradScaler("cpu", init_scale=2.0**8, growth_interval=1)


def _finish(model, opt, scaler):
    opt.synchronize()
    return [p.detach().clone() for p in model.parameters()], scaler.state_dict(), opt.state_dict()


def _same(a, b):
    (pa, sa, oa), (pb, sb, ob) = a, b
    assert all(torch.equal(x, y) for x, y in zip(pa, pb))
    assert sa == sb
    ta, tb = torch.utils._pytree.tree_leaves(oa), torch.utils._pytree.tree_leaves(ob)
    assert len(ta) == len(tb)
    assert all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(ta, tb))


@pytest.mark.parametrize("how", ["scaler=", "lazy", "bind() first"])
@pytest.mark.parametrize("cut", [1, 2, 3, 4])
def test_a_checkpoint_saved_right_after_update_resumes_bit_for_bit(threads, how, cut):
    # After update() the next loss is scaled with the previous iteration's result while the
    # queued update computes a newer one (growth every step here, and a back-off at 2): the
    # state dict keeps both, so a fresh world resumed from it goes on exactly.
    explicit = how != "lazy"
    model, opt, scaler = _world(threads)
    _iterate(model, opt, scaler, range(cut), explicit=explicit)
    saved = copy.deepcopy((opt.state_dict(), model.state_dict(), scaler.state_dict()))  # opt first: it waits
    assert saved[2]["next_scale"] != saved[2]["scale"]  # the lag this test is about
    assert saved[2]["scale"] == scaler.get_scale()  # "scale": what the next loss is scaled with
    _iterate(model, opt, scaler, range(cut, 6), explicit=explicit)
    reference = _finish(model, opt, scaler)

    model2, opt2, scaler2 = _world(threads)
    if how == "bind() first":  # bound before the load: this iteration's loss is scaled by
        scaler2.bind(opt2.thread)  # the loaded scale itself (autograd keeps it for backward)
    opt2.load_state_dict(saved[0])
    model2.load_state_dict(saved[1])
    scaler2.load_state_dict(saved[2])
    assert scaler2.state_dict() == saved[2]  # saved again at once, nothing is lost
    _iterate(model2, opt2, scaler2, range(cut, 6), explicit=explicit)
    _same(_finish(model2, opt2, scaler2), reference)


def test_loading_into_the_bound_scaler_itself_restores_the_lag(threads):
    model, opt, scaler = _world(threads)
    _iterate(model, opt, scaler, range(2), explicit=True)
    saved = copy.deepcopy((opt.state_dict(), model.state_dict(), scaler.state_dict()))  # opt first: it waits
    _iterate(model, opt, scaler, range(2, 6), explicit=True)
    reference = _finish(model, opt, scaler)
    opt.load_state_dict(saved[0])  # back in time, in the same objects (e.g. after a failure)
    model.load_state_dict(saved[1])
    scaler.load_state_dict(saved[2])
    _iterate(model, opt, scaler, range(2, 6), explicit=True)
    _same(_finish(model, opt, scaler), reference)


def test_a_lagged_checkpoint_loads_into_torch_and_into_a_run_without_a_thread(threads):
    model, opt, scaler = _world(threads)
    _iterate(model, opt, scaler, range(2), explicit=True)
    saved = scaler.state_dict()
    ours, theirs = GradScaler("cpu"), torch.amp.GradScaler("cpu")
    ours.load_state_dict(saved)
    theirs.load_state_dict(saved)  # torch ignores the extra key
    assert ours.get_scale() == theirs.get_scale() == saved["scale"]
    # Without a thread, training goes on from "scale" as torch's would; the lag is dropped at
    # the first update, so a later binding starts from the scale of then.
    plain = _net()
    sync_opt = MixedPrecisionOptimizer(torch.optim.SGD(plain.parameters(), lr=0.1), thread=threads())
    ours.scale(_loss(plain, 0)).backward()
    ours.step(sync_opt)
    ours.update()
    assert ours.get_scale() == saved["scale"] * 2  # a clean step, growth_interval=1
    assert "next_scale" not in ours.state_dict()
    sync_opt.zero_grad()
    ours.scale(_loss(plain, 1)).backward()
    sync_opt.submit_step(lambda: (ours.step(sync_opt), sync_opt.zero_grad()), scaler=ours)
    ours.update(is_async=False)
    assert ours.get_scale() == saved["scale"] * 4


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), "2", True])
def test_a_bad_next_scale_is_refused_and_nothing_changes(threads, bad):
    model, opt, scaler = _world(threads)
    _iterate(model, opt, scaler, range(2), explicit=True)
    opt.synchronize()
    before = scaler.state_dict()
    with pytest.raises(ValueError, match="next_scale must be a finite number > 0"):
        scaler.load_state_dict({**before, "scale": 1.0, "next_scale": bad})
    assert scaler.state_dict() == before
