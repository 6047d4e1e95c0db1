"""fp16kit.legacy.FP16_Optimizer with ``async_step=True`` (docs/async.md §3, mode 1) and with
``master_device``: the one-step-delayed apex reference bit for bit, errors, checkpoints across
modes. The model, data and synchronous reference are in tests/_helpers/fp16_optimizer.py.
"""

from __future__ import annotations

import copy
import logging
import threading

import pytest
import torch

from _helpers.fp16_optimizer import (
    INF,
    NAN,
    OPTIMIZERS,
    Reference,
    batch,
    loss_fn,
    make_model,
    two_groups,
)
from fp16kit.legacy import FP16_Optimizer

# ---------------------------------------------------------------- async_step / master_device
# The asynchronous FP16_Optimizer (docs/async.md §3, mode 1) equals, bit for bit, a one-step-delayed
# version of the reference: every trainable param has an fp32 master, the grads of iteration k
# are applied after step k-1's masters have reached the model, and the scale follows apex amp's
# rule with no lag.


class DelayedReference(Reference):
    """apex's algorithm, one step delayed, every trainable param mastered."""

    def __init__(self, model, groups, opt_cls, opt_kw, *, dynamic_args=None, set_to_none=False):
        super().__init__(model, groups, opt_cls, opt_kw, dynamic=True, dynamic_args=dynamic_args)
        self.pairs = []
        ref_groups = []
        for g in groups:
            params = []
            for p in g["params"]:
                if p.requires_grad:
                    m = p.detach().clone().float().requires_grad_(True)
                    self.pairs.append((p, m))
                    params.append(m)
                else:
                    params.append(p)
            ref_groups.append({**g, "params": params})
        self.opt = opt_cls(ref_groups, **opt_kw)
        self.set_to_none = set_to_none
        self.pending = None

    def iteration(self, loss_of, inject=None):
        for p in self.model.parameters():
            p.grad = None
        (loss_of(self.model).float() * self.scale).backward()
        if inject is not None:
            inject(self.model)
        self._apply_pending()
        grads = [p.grad for p, _ in self.pairs]
        overflow = not all(g is None or bool(torch.isfinite(g).all()) for g in grads)
        inv = torch.tensor(1.0 / self.scale, dtype=torch.float64).float()
        self._update_scale(overflow)
        self.pending = (grads, inv, overflow)

    def _apply_pending(self):
        if self.pending is None:
            return
        grads, inv, skip = self.pending
        if not skip:
            for (_, m), g in zip(self.pairs, grads):
                if g is not None:
                    m.grad = g.float() * inv
                elif m.grad is not None:  # zero_grad() ran before this iteration's backward
                    m.grad = None if self.set_to_none else torch.zeros_like(m)
            self.opt.step()
        with torch.no_grad():
            for p, m in self.pairs:
                p.copy_(m)
        self.pending = None

    def finish(self):
        self._apply_pending()


def _build(opt_name, dtype=torch.float16, *, dynamic_args=None, set_to_none=False, **options):
    opt_cls, kw, (lr1, lr2) = OPTIMIZERS[opt_name]
    model = make_model(dtype)
    ref_model = copy.deepcopy(model)
    opt = FP16_Optimizer(
        opt_cls(two_groups(model, lr1, lr2), **kw),
        dynamic_loss_scale=True,
        dynamic_loss_args=dynamic_args,
        verbose=False,
        async_step=True,
        **options,
    )
    ref = DelayedReference(
        ref_model, two_groups(ref_model, lr1, lr2), opt_cls, kw, dynamic_args=dynamic_args, set_to_none=set_to_none
    )
    return model, opt, ref


def _iteration(opt, model, loss_of, inject=None, set_to_none=False):
    opt.zero_grad(set_grads_to_None=set_to_none)
    opt.backward(loss_of(model), update_master_grads=False)
    if inject is not None:
        inject(model)
    opt.update_master_grads()
    assert opt.step() is None


def _assert_same(model, opt, ref):
    for (_, rm), m in zip(ref.pairs, opt.all_fp32_from_fp16_params):
        assert torch.equal(m, rm)
    for p, rp in zip(model.parameters(), ref.model.parameters()):
        assert torch.equal(p, rp)
    assert opt.loss_scale == ref.scale


def _poison(i, value):
    def inject(model):
        model.l1.weight.grad.view(-1)[i] = value

    return inject


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_async_equals_the_one_step_delayed_apex_reference_bit_for_bit(dtype, opt_name, caplog):
    args = {"init_scale": 2.0**10, "scale_window": 3, "min_loss_scale": 4.0}
    model, opt, ref = _build(opt_name, dtype, dynamic_args=args, async_policy="thread")  # (the worker logs)
    poisoned = {2: _poison(0, INF), 5: _poison(3, NAN), 6: _poison(1, INF)}
    with caplog.at_level(logging.WARNING, logger="fp16kit"):
        for i in range(12):
            x, y = batch(i, dtype)
            loss_of = lambda m, x=x, y=y: loss_fn(m, x, y)  # noqa: E731
            _iteration(opt, model, loss_of, poisoned.get(i))
            ref.iteration(loss_of, poisoned.get(i))
            assert opt.loss_scale == ref.scale  # no lag: updated in update_master_grads
        opt.synchronize()
    ref.finish()
    _assert_same(model, opt, ref)
    skips = [r for r in caplog.records if r.getMessage().startswith("Gradient overflow.  Skipping step")]
    assert len(skips) == 3
    assert {r.threadName for r in skips} == {opt._mpo._async.thread.name}  # logged by the worker
    assert skips[0].getMessage().endswith(f"reducing loss scale to {2.0**9}")


@pytest.mark.parametrize("set_to_none", [False, True], ids=["zeroed", "none"])
def test_a_param_without_a_grad_follows_zero_grad_like_apex(set_to_none):
    # SGD with momentum: a zeroed master grad still moves the param (momentum); a missing one
    # leaves it alone. Iteration 3 leaves l2 and gain without grads.
    model, opt, ref = _build("sgd_momentum", set_to_none=set_to_none)
    for i in range(6):
        x, y = batch(i, torch.float16)
        if i == 3:
            loss_of = lambda m, x=x: m.l1(x).float().pow(2).mean()  # noqa: E731
        else:
            loss_of = lambda m, x=x, y=y: loss_fn(m, x, y)  # noqa: E731
        _iteration(opt, model, loss_of, set_to_none=set_to_none)
        ref.iteration(loss_of)
    opt.synchronize()
    ref.finish()
    _assert_same(model, opt, ref)


def test_state_dict_during_pending_work_resumes_bit_for_bit():
    def run(n, model, opt, start=0):
        for i in range(start, start + n):
            x, y = batch(i, torch.float16)
            _iteration(opt, model, lambda m, x=x, y=y: loss_fn(m, x, y))

    model, opt, _ = _build("adam", dynamic_args={"scale_window": 2})
    run(4, model, opt)
    saved_opt = copy.deepcopy(opt.state_dict())  # waits for the step in flight
    saved_model = copy.deepcopy(model.state_dict())
    run(4, model, opt, start=4)
    opt.synchronize()

    model2, opt2, _ = _build("adam", dynamic_args={"scale_window": 2})
    model2.load_state_dict(saved_model)
    opt2.load_state_dict(saved_opt)
    run(4, model2, opt2, start=4)
    opt2.synchronize()
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(opt.all_fp32_from_fp16_params, opt2.all_fp32_from_fp16_params):
        assert torch.equal(a, b)
    assert opt.loss_scale == opt2.loss_scale


def test_wrong_use_raises_clear_errors_and_training_goes_on():
    model, opt, ref = _build("sgd_momentum")
    x, y = batch(0, torch.float16)
    opt.zero_grad()
    opt.backward(loss_fn(model, x, y), update_master_grads=False)
    with pytest.raises(RuntimeError, match=r"call optimizer.backward\(loss\)"):
        opt.step()
    opt.update_master_grads()
    with pytest.raises(RuntimeError, match="Closures are not supported with async_step=True"):
        opt.step(lambda: None)
    with pytest.raises(RuntimeError, match="async_step=False to clip"):
        opt.clip_master_grads(1.0)
    with pytest.raises(RuntimeError, match="async_step=False to clip or inspect"):
        opt.inspect_master_grad_data()
    opt.step()  # the prepared step is still there
    ref.iteration(lambda m: loss_fn(m, x, y))
    opt.synchronize()
    ref.finish()
    _assert_same(model, opt, ref)


def test_an_error_in_the_step_surfaces_on_the_main_thread_and_the_thread_keeps_working():
    class Failing(torch.optim.SGD):
        fail = True

        def step(self, closure=None):
            if Failing.fail:
                Failing.fail = False
                raise ValueError("boom in the step")
            return super().step(closure)

    model = make_model(torch.float16)
    opt = FP16_Optimizer(Failing(model.parameters(), lr=0.1), dynamic_loss_scale=True, verbose=False, async_step=True)
    x, y = batch(0, torch.float16)
    opt.zero_grad()
    opt.backward(loss_fn(model, x, y))
    opt.step()
    opt.zero_grad()
    opt.backward(loss_fn(model, x, y))
    grads = [p.grad for p in model.parameters()]
    with pytest.raises(ValueError, match="boom in the step"):
        opt.step()  # waits for the failed step before anything changes
    assert all(p.grad is g for p, g in zip(model.parameters(), grads))  # still this iteration's
    opt.step()  # the same prepared step, now submitted
    opt.synchronize()
    assert all(p.grad is None for p in model.parameters())
    assert threading.main_thread().is_alive()


def test_fp32_params_get_masters_with_async_step():
    model = make_model(torch.float16)
    opt = FP16_Optimizer(torch.optim.SGD(two_groups(model, 0.1, 0.1), lr=0.1), verbose=False, async_step=True)
    assert opt.all_fp32_from_fp32_params == []
    assert sum(m.numel() for m in opt.all_fp32_from_fp16_params) == sum(
        p.numel() for p in model.parameters() if p.requires_grad
    )


def _trained(async_step, n=3):
    model = make_model(torch.float16)
    opt = FP16_Optimizer(
        torch.optim.Adam(two_groups(model, 1e-2, 3e-3), lr=1e-2),
        dynamic_loss_scale=True,
        verbose=False,
        async_step=async_step,
    )
    for i in range(n):
        x, y = batch(i, torch.float16)
        opt.zero_grad()
        opt.backward(loss_fn(model, x, y))
        opt.step()
    return model, opt


@pytest.mark.parametrize("model_first", [True, False])
def test_a_synchronous_checkpoint_loads_into_an_asynchronous_optimizer(model_first):
    # apex's form (network_to_half keeps fp32 params): the fp32 params' masters come from the
    # loaded model, where the synchronous run stepped them -- whichever is loaded first.
    model, opt = _trained(async_step=False)
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    assert [len(g) for g in saved_opt["fp32_from_fp16"]] == [3, 1]
    model2, opt2 = _trained(async_step=True, n=0)
    if model_first:
        model2.load_state_dict(saved_model)
    opt2.load_state_dict(saved_opt)
    if not model_first:
        model2.load_state_dict(saved_model)
    opt2.state_dict()  # the next point that reads the masters
    low = iter(t for g in saved_opt["fp32_from_fp16"] for t in g)
    for m, p in zip(opt2.all_fp32_from_fp16_params, opt2.all_fp16_params):
        assert torch.equal(m, next(low) if p.dtype == torch.float16 else p)
    x, y = batch(5, torch.float16)
    opt2.zero_grad()
    opt2.backward(loss_fn(model2, x, y))
    opt2.step()
    opt2.synchronize()
    assert all(torch.isfinite(m).all() for m in opt2.all_fp32_from_fp16_params)


@pytest.mark.parametrize("model_first", [True, False])
def test_an_asynchronous_checkpoint_loads_into_a_synchronous_optimizer(model_first):
    model, opt = _trained(async_step=True)
    saved_opt = copy.deepcopy(opt.state_dict())  # masters one step ahead of the model
    saved_model = copy.deepcopy(model.state_dict())
    assert [len(g) for g in saved_opt["fp32_from_fp16"]] == [3, 2]
    model2, opt2 = _trained(async_step=False, n=0)
    if model_first:
        model2.load_state_dict(saved_model)
    opt2.load_state_dict(saved_opt)
    if not model_first:
        model2.load_state_dict(saved_model)  # the older fp32 weights, for now
    opt2.state_dict()  # the next point that reads the masters: the fp32 masters go in
    gain_master = saved_opt["fp32_from_fp16"][1][0]  # group 1: gain, l2.bias
    assert torch.equal(model2.gain, gain_master)  # the fp32 param is its own master here
    assert not torch.equal(model.gain, gain_master)
    assert torch.equal(opt2.all_fp32_from_fp16_params[-1], saved_opt["fp32_from_fp16"][1][1])


def test_a_checkpoint_of_another_model_is_refused_untouched():
    _, opt = _trained(async_step=True)
    opt.synchronize()  # the last step has landed: the masters stay as they are now
    _, other = _trained(async_step=False, n=0)
    saved = copy.deepcopy(other.state_dict())
    saved["fp32_from_fp16"][1] = saved["fp32_from_fp16"][1] * 3
    before = [m.detach().clone() for m in opt.all_fp32_from_fp16_params]
    with pytest.raises(ValueError, match="Param group 1: the checkpoint has 3 master tensors"):
        opt.load_state_dict(saved)
    assert all(torch.equal(a, b) for a, b in zip(before, opt.all_fp32_from_fp16_params))


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_master_device_alone_is_the_synchronous_apex_loop(opt_name):
    # master_device="cpu" on a CPU model: fp32 params step through masters, bit for bit the same.
    opt_cls, kw, (lr1, lr2) = OPTIMIZERS[opt_name]
    runs = []
    for options in ({}, {"master_device": "cpu"}):
        model = make_model(torch.float16)
        opt = FP16_Optimizer(
            opt_cls(two_groups(model, lr1, lr2), **kw), dynamic_loss_scale=True, verbose=False, **options
        )
        for i in range(6):
            x, y = batch(i, torch.float16)
            opt.zero_grad()
            opt.backward(loss_fn(model, x, y), update_master_grads=False)
            if i == 2:
                model.l1.weight.grad.view(-1)[0] = INF
            opt.update_master_grads()
            opt.step()
        runs.append((model, opt))
    (m1, o1), (m2, o2) = runs
    for a, b in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(a, b)
    assert o1.loss_scale == o2.loss_scale


def test_async_several_losses_through_one_graph_as_apex_documents():
    # backward(l1, retain_graph=True) then backward(l2): the weights must not change in between
    # (apex copies masters into the model only in step()).
    model, opt, _ = _build("sgd_momentum")
    for i in range(3):
        x, y = batch(i, torch.float16)
        opt.zero_grad()
        out = model(x)
        weights = [p.detach().clone() for p in model.parameters()]
        opt.backward(out.pow(2).mean(), update_master_grads=False, retain_graph=True)
        opt.backward((out - y).pow(2).mean(), update_master_grads=False)
        opt.update_master_grads()
        assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))
        opt.step()
    opt.synchronize()


def test_async_zero_grad_drops_a_prepared_step():
    # Its grads are gone: stepping now would apply grads nobody checked.
    model, opt, _ = _build("sgd_momentum")
    x, y = batch(0, torch.float16)
    opt.backward(loss_fn(model, x, y))
    opt.zero_grad()
    opt.backward(loss_fn(model, x, y), update_master_grads=False)
    with pytest.raises(RuntimeError, match="found no prepared gradients"):
        opt.step()


def test_async_lr_scheduler_changes_the_next_step_not_the_pending_one():
    model = make_model(torch.float16)
    opt = FP16_Optimizer(
        torch.optim.SGD(model.parameters(), lr=1.0), dynamic_loss_scale=True, verbose=False, async_step=True
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1.0 if epoch == 0 else 0.0)
    before = [m.detach().clone() for m in opt.all_fp32_from_fp16_params]
    thread = opt._mpo._async.thread
    release = threading.Event()
    thread.submit(release.wait, 30)  # the step job runs only after sched.step()
    x, y = batch(0, torch.float16)
    opt.backward(loss_fn(model, x, y))
    opt.step()
    sched.step()
    release.set()
    opt.synchronize()
    assert all(not torch.equal(a, b) for a, b in zip(before, opt.all_fp32_from_fp16_params))


def test_copying_masters_to_the_model_after_a_cross_mode_load_keeps_the_loaded_fp32_weights():
    model, opt = _trained(async_step=False)
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    model2 = make_model(torch.float16, seed=5)
    opt2 = FP16_Optimizer(
        torch.optim.Adam(two_groups(model2, 1e-2, 3e-3), lr=1e-2),
        dynamic_loss_scale=True,
        verbose=False,
        master_device="cpu",
    )
    opt2.load_state_dict(saved_opt)
    model2.load_state_dict(saved_model)
    opt2._master_params_to_model_params()  # apex's own call after a load
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)
