"""fp16kit.master_weights.groups: which params get masters, params unfrozen after wrapping, and the
checks made before anything changes (add_param_group, master_dtype)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fp16kit
from _helpers import seeded_loss, small_mlp
from fp16kit import GradScaler, MixedPrecisionOptimizer
from fp16kit.legacy import FP16_Optimizer


def _net(dtype=torch.float32, seed=0):
    return small_mlp(dtype, seed)


_loss = seeded_loss


def test_fp32_layer_unfrozen_after_wrapping_matches_torch_amp():
    # Staged fine-tuning with an fp32 model: the layer unfrozen later is unscaled and checked
    # as torch.amp.GradScaler does (it was stepped 65536x too large).
    model, ref = _net(), _net()
    for m in (model, ref):
        m[0].requires_grad_(False)
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    scaler, ref_scaler = GradScaler("cpu"), torch.amp.GradScaler("cpu")
    for i in range(6):
        if i == 2:
            model[0].requires_grad_(True)
            ref[0].requires_grad_(True)
        for m, o, s in ((model, opt, scaler), (ref, ref_opt, ref_scaler)):
            o.zero_grad()
            s.scale(_loss(m, i)).backward()
            if i == 4:  # an overflow in the unfrozen layer skips the step, as in torch
                m[0].weight.grad[0, 0] = float("inf")
            s.step(o)
            s.update()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)
    assert scaler.get_scale() == ref_scaler.get_scale() == 2.0**15


@pytest.mark.parametrize("flat", [False, True])
def test_fp16_layer_unfrozen_after_wrapping_gets_a_master(flat):
    # The fp16 layer unfrozen later is stepped through an fp32 master, unscaled and checked:
    # it trains exactly as when it was trainable (but had no grads) from the start.
    late, early = _net(torch.float16), _net(torch.float16)
    late[0].requires_grad_(False)
    opt_late = MixedPrecisionOptimizer(torch.optim.SGD(late.parameters(), lr=0.1), flat=flat)
    opt_early = MixedPrecisionOptimizer(torch.optim.SGD(early.parameters(), lr=0.1), flat=flat)
    early[0].requires_grad_(False)
    scalers = (GradScaler("cpu", init_scale=2.0**8), GradScaler("cpu", init_scale=2.0**8))
    for i in range(6):
        if i == 2:
            late[0].requires_grad_(True)
            early[0].requires_grad_(True)
        for m, o, s in ((late, opt_late, scalers[0]), (early, opt_early, scalers[1])):
            o.zero_grad()
            s.scale(_loss(m, i)).backward()
            if i == 4:
                m[0].weight.grad[0, 0] = float("inf")
            s.step(o)
            s.update()
    for p, q in zip(late.parameters(), early.parameters()):
        assert p.dtype == torch.float16 and torch.equal(p, q)
    assert len(opt_late.master_params) == 4
    assert all(m.dtype == torch.float32 for m in opt_late.master_params)
    assert late[0].weight in [p for g in opt_late.groups for p in g.model_params]
    assert scalers[0].get_scale() == scalers[1].get_scale() == 2.0**7


def test_async_layer_unfrozen_after_wrapping_is_handed_off_and_mastered():
    # Asynchronously, the unfrozen layer gets a master (the worker never writes a param the
    # forward reads), its grads are handed off each step (they do not accumulate), and the
    # run equals one whose layer was trainable from the start.
    runs = []
    for unfreeze_late in (True, False):
        model = _net(torch.bfloat16)
        if unfreeze_late:
            model[0].requires_grad_(False)
        opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), async_step=True)
        if not unfreeze_late:
            model[0].requires_grad_(False)
        for i in range(5):
            if i == 2:
                model[0].requires_grad_(True)
            opt.zero_grad()
            _loss(model, i).backward()
            opt.step()
            assert all(p.grad is None for p in model.parameters())  # handed off
        opt.synchronize()
        assert len(opt.master_params) == 4
        runs.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_legacy_fp16_optimizer_refuses_a_param_unfrozen_after_construction():
    # apex's construction-time rule: FP16_Optimizer decides then which params it trains; apex
    # stepped a later-unfrozen fp16 param with its scaled grad. fp16kit refuses instead.
    model = _net(torch.float16)
    model[0].requires_grad_(False)
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), static_loss_scale=128.0, verbose=False)
    model[0].requires_grad_(True)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="frozen when FP16_Optimizer was built"):
        opt.backward(_loss(model, 0))
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    model[0].requires_grad_(False)  # frozen again: trains as before
    opt.zero_grad()
    opt.backward(_loss(model, 1))
    opt.step()


def test_add_param_group_checks_like_the_constructor_before_changing_anything():
    model = _net(torch.float16)
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), async_step=True)
    extra = nn.Parameter(torch.zeros(3, dtype=torch.float64))
    groups, masters = len(opt.param_groups), len(opt.master_params)
    with pytest.raises(TypeError, match="float64"):
        opt.add_param_group({"params": [extra]})
    assert len(opt.param_groups) == groups and len(opt.master_params) == masters
    opt.add_param_group({"params": (p for p in [nn.Parameter(torch.zeros(3, dtype=torch.float16))])})
    assert len(opt.master_params) == masters + 1  # a generator of params is read once


def test_a_float64_param_unfrozen_later_with_async_steps_is_refused_with_its_name():
    model = _net(torch.float16)
    extra = nn.Parameter(torch.zeros(2, dtype=torch.float64), requires_grad=False)
    opt = MixedPrecisionOptimizer(torch.optim.SGD([*model.parameters(), extra], lr=0.1), async_step=True)
    extra.requires_grad_(True)
    _loss(model, 0).backward()
    with pytest.raises(TypeError, match="unfrozen after wrapping"):
        opt.step()
    extra.requires_grad_(False)
    opt.step()  # nothing was handed off: the step goes on
    opt.synchronize()


@pytest.mark.parametrize("name, dtype", [("float32", torch.float32), ("torch.float64", torch.float64)])
def test_master_dtype_accepts_dtype_names(name, dtype):
    opt = MixedPrecisionOptimizer(torch.optim.SGD(_net(torch.float16).parameters(), lr=0.1), master_dtype=name)
    assert {m.dtype for m in opt.master_params} == {dtype}


@pytest.mark.parametrize("bad", ["int8", "float33", 42, None])
def test_master_dtype_refuses_what_is_not_a_floating_dtype(bad):
    with pytest.raises(TypeError, match="torch.float32"):
        MixedPrecisionOptimizer(torch.optim.SGD(_net(torch.float16).parameters(), lr=0.1), master_dtype=bad)


def test_frozen_params_stay_watched_not_mastered():
    model = _net(torch.float16)
    model[2].requires_grad_(False)
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    assert len(opt.master_params) == 2
    assert [len(g.watched) for g in opt.groups] == [2]
    _loss(model, 0).backward()
    opt.step()
    assert len(opt.master_params) == 2  # nothing unfrozen: nothing adopted
    assert copy.copy(opt.groups[0].watched)[0] is model[2].weight
    assert fp16kit.MixedPrecisionOptimizer is MixedPrecisionOptimizer


def test_a_param_unfrozen_while_a_step_runs_is_left_to_the_next_step():
    # Asynchronously, the job in flight steps what was trainable when it was submitted: a
    # param unfrozen meanwhile (its grad is the next step's, still scaled) is not touched by
    # the worker -- the next step adopts it, unscaled through its master.
    import threading

    gate = threading.Event()

    class GatedSGD(torch.optim.SGD):
        def step(self, closure=None):
            assert gate.wait(10)
            return super().step(closure)

    a = nn.Parameter(torch.ones(4, dtype=torch.half))
    b = nn.Parameter(torch.ones(4, dtype=torch.half), requires_grad=False)
    opt = MixedPrecisionOptimizer(GatedSGD([a, b], lr=0.1), async_step=True, async_policy="thread")
    scaler = GradScaler("cpu", init_scale=1024.0)
    x = torch.ones(4, dtype=torch.half)
    scaler.scale((a * x).float().sum()).backward()
    scaler.step(opt)
    scaler.update()
    b.requires_grad_(True)
    opt.zero_grad()
    scaler.scale(((a + b) * x).float().sum()).backward()  # b's grad: 1024, scaled
    gate.set()
    opt.wait_for_step()
    assert torch.equal(b, torch.ones(4, dtype=torch.half))  # the job left it alone
    scaler.step(opt)
    scaler.update()
    opt.synchronize()
    assert torch.equal(b, torch.full((4,), 0.9, dtype=torch.half))  # one unscaled step


def test_add_param_group_refuses_a_param_already_optimized():
    model = _net(torch.float16)
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="more than one parameter group"):
        opt.add_param_group({"params": [model[0].weight]})
    assert len(opt.param_groups) == 1 and len(opt.master_params) == 4


def test_params_unfrozen_together_are_adopted_together_in_group_order():
    # One pass for all of them: with flat=True their masters share one new buffer, and each
    # role's list follows the group's order, as in an optimizer built after unfreezing (so
    # checkpoints pair saved masters by position either way).
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(i + 1).half(), requires_grad=i % 2 == 0) for i in range(6)]
    opt = MixedPrecisionOptimizer(torch.optim.SGD(params, lr=0.1), flat=True)
    for p in params:
        p.requires_grad_(True)
        p.grad = torch.ones_like(p)
    opt.step()
    fresh = MixedPrecisionOptimizer(torch.optim.SGD([nn.Parameter(p.detach().clone()) for p in params], lr=0.1))
    assert [tuple(m.shape) for m in opt.groups[0].masters] == [tuple(m.shape) for m in fresh.groups[0].masters]
    assert len(opt.groups[0].model_params) == len(params)
    assert all(a is b for a, b in zip(opt.groups[0].model_params, params))
    late = [opt.groups[0].masters[i] for i in (1, 3, 5)]
    assert len({m.untyped_storage().data_ptr() for m in late}) == 1  # one flat block
    assert opt.groups[0].watched == []


NOT_FLOATING = [
    (
        torch.int64,
        r"Integer and bool tensors \(buffers, indices\) have no gradients: build the optimizer on "
        r"model.parameters\(\)",
    ),
    (torch.int32, r"Integer and bool tensors \(buffers, indices\) have no gradients"),
    (torch.bool, r"Integer and bool tensors \(buffers, indices\) have no gradients"),
    (torch.complex64, r"Complex params cannot be loss-scaled \(torch.amp.GradScaler cannot unscale them either\)"),
]


@pytest.mark.parametrize(("dtype", "advice"), NOT_FLOATING, ids=[str(d) for d, _ in NOT_FLOATING])
@pytest.mark.parametrize("async_step", [False, True], ids=["sync", "async"])
def test_a_param_that_is_not_floating_point_is_refused_in_torchs_words_and_nothing_is_wrapped(
    dtype, advice, async_step
):
    # e.g. the optimizer built on model.state_dict().values(): BatchNorm's int64 num_batches_tracked
    # was accepted (and a complex param failed at the first unscale with NotImplementedError)
    model = _net(torch.float16)
    odd = torch.zeros(3, dtype=dtype)
    inner = torch.optim.SGD([*model.parameters(), odd], lr=0.1)  # torch itself takes it
    groups_before = [[id(p) for p in g["params"]] for g in inner.param_groups]
    with pytest.raises(
        TypeError,
        match=rf"^MixedPrecisionOptimizer can only optimize Tensors of floating point dtype, "
        rf"but one of the params in param group 0 \(index 4, shape \(3,\)\) is "
        rf"{dtype}\. {advice}",
    ):
        MixedPrecisionOptimizer(inner, async_step=async_step)
    assert [[id(p) for p in g["params"]] for g in inner.param_groups] == groups_before  # no masters swapped in
    inner.param_groups[0]["params"].pop()
    opt = MixedPrecisionOptimizer(inner, async_step=async_step)  # nor was the optimizer marked wrapped
    assert len(opt.master_params) == 4


@pytest.mark.parametrize(("dtype", "advice"), NOT_FLOATING, ids=[str(d) for d, _ in NOT_FLOATING])
def test_add_param_group_refuses_a_param_that_is_not_floating_point(dtype, advice):
    model = _net(torch.float16)
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    extra = nn.Parameter(torch.ones(2, dtype=torch.float16))
    with pytest.raises(
        TypeError,
        match=rf"can only optimize Tensors of floating point dtype, but one of the params "
        rf"\(index 1, shape \(5,\)\) is {dtype}\. {advice}",
    ):
        opt.add_param_group({"params": [extra, torch.zeros(5, dtype=dtype)]})
    assert len(opt.param_groups) == 1 and len(opt.master_params) == 4
    legacy = FP16_Optimizer(torch.optim.SGD(_net(torch.float16).parameters(), lr=0.1), verbose=False)
    with pytest.raises(TypeError, match=rf"can only optimize Tensors of floating point dtype.* is {dtype}\."):
        legacy.add_param_group({"params": [torch.zeros(5, dtype=dtype)]})
    assert len(legacy.param_groups) == 1


class _Executor:
    """What was passed as thread= by mistake: a concurrent.futures executor (or look-alike)."""

    def submit(self, fn, *args, **kwargs):
        raise AssertionError("never used")


@pytest.mark.parametrize("thread", ["executor", "look-alike", "name"])
def test_thread_must_be_an_optimizer_thread_and_is_checked_at_construction(thread):
    # a ThreadPoolExecutor was taken and failed at the first step with AttributeError ('enqueue')
    import concurrent.futures

    bad = {"executor": concurrent.futures.ThreadPoolExecutor(1), "look-alike": _Executor(), "name": "worker"}[thread]
    model = _net(torch.float16)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        with pytest.raises(
            TypeError,
            match=r"^thread must be an fp16kit.OptimizerThread \(or None for the process-wide "
            r"fp16kit.optimizer_thread\(\)\), got .*\. .*pass thread=fp16kit."
            r"OptimizerThread\(\) for a thread of this optimizer's own\.$",
        ):
            MixedPrecisionOptimizer(inner, async_step=True, thread=bad)
    finally:
        if isinstance(bad, concurrent.futures.ThreadPoolExecutor):
            bad.shutdown()
    assert all(p.dtype == torch.float16 for p in inner.param_groups[0]["params"])  # nothing wrapped
    with fp16kit.OptimizerThread() as own:
        opt = MixedPrecisionOptimizer(inner, async_step=True, thread=own)
        _loss(model, 0).backward()
        opt.step()
        opt.synchronize()
