"""Apex-era usage of the legacy FP16_Optimizer (and Megatron's) around its step state: the
flags apex kept loose (``overflow``, ``first_closure_call_this_step``, what ``update_master_grads``
prepared, whether a backward ran since the last step) live on one StepState now.

Every test states the behaviour from before that move -- apex's where apex had one: its
``first_closure_call_this_step`` is a plain attribute that only ``step(closure)`` resets, and
``overflow`` is whatever the last ``update_master_grads`` (or an assignment) left.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from _helpers.fp16_optimizer import (
    INF,
    assert_matches,
    batch,
    bitwise,
    build,
    flat_masters,
    loss_fn,
    make_model,
)
from fp16kit import GradScaler
from fp16kit.legacy import FP16_Optimizer
from fp16kit.legacy.megatron import FP16_Optimizer as MegatronFP16_Optimizer

NO_BACKWARD = "with no optimizer.backward(loss) since the last step"

KINDS = {
    "apex": dict(dynamic_loss_scale=True, dynamic_loss_args={"init_scale": 2.0**10}, verbose=False),
    "apex-static": dict(static_loss_scale=128.0, verbose=False),
    "apex-cpu-masters": dict(dynamic_loss_scale=True, verbose=False, master_device="cpu"),
    "apex-async": dict(dynamic_loss_scale=True, verbose=False, async_step=True),
    "megatron": dict(dynamic_loss_scale=True, dynamic_loss_args={"init_scale": 2.0**10}),
    "megatron-static": dict(static_loss_scale=128.0),
}


def _make(kind, model, opt_cls=torch.optim.SGD, **kw):
    cls = MegatronFP16_Optimizer if kind.startswith("megatron") else FP16_Optimizer
    inner = opt_cls([p for p in model.parameters() if p.requires_grad], **(kw or {"lr": 0.05, "momentum": 0.9}))
    return cls(inner, **KINDS[kind])


def _finish(opt):
    if getattr(opt, "async_step", False):
        opt.synchronize()


def _iteration(model, opt, i):
    x, y = batch(i, torch.float16)
    opt.zero_grad()
    opt.backward(loss_fn(model, x, y))
    opt.step()


# ------------------------------------------------------------------ apex's attributes and resumes
@pytest.mark.parametrize("kind", list(KINDS))
def test_first_closure_call_this_step_is_apexs_plain_attribute(kind):
    """Assigned False, it stays False through zero_grad, backward and a plain step() (only
    step(closure) resets it, as in apex); state_dict() saves what it is."""
    model = make_model(torch.float16)
    opt = _make(kind, model)
    opt.first_closure_call_this_step = False
    _iteration(model, opt, 0)
    assert opt.first_closure_call_this_step is False
    assert opt.state_dict()["first_closure_call_this_step"] is False
    opt.zero_grad()
    assert opt.first_closure_call_this_step is False
    _finish(opt)


@pytest.mark.parametrize("kind", ["apex", "apex-static", "apex-cpu-masters", "megatron-static"])
def test_resuming_a_checkpoint_saved_inside_a_closure_copies_the_masters_first(kind):
    """A checkpoint saved from inside ``step(closure)`` has ``first_closure_call_this_step``
    False. Loaded into a fresh optimizer, the next closure step's first evaluation copies the
    (restored) masters into the model first, as apex's wrapped closure does -- the model then
    runs on the checkpoint's weights even if only the optimizer was loaded."""
    trained = make_model(torch.float16, seed=0)
    opt0 = _make(kind, trained)
    _iteration(trained, opt0, 0)
    saved = copy.deepcopy(opt0.state_dict())
    saved["first_closure_call_this_step"] = False  # as written from inside a closure
    model = make_model(torch.float16, seed=3)  # the model is not loaded: its weights differ
    opt = _make(kind, model)
    opt.load_state_dict(saved)
    assert opt.first_closure_call_this_step is False
    low = [p for g in opt.fp16_groups for p in g]
    seen = []
    x, y = batch(1, torch.float16)

    def closure():
        seen.append(all(torch.equal(p.detach(), m.detach().to(p.dtype)) for p, m in zip(low, flat_masters(opt))))
        opt.zero_grad()
        loss = loss_fn(model, x, y)
        opt.backward(loss)
        return loss

    opt.step(closure)
    assert seen == [True]
    assert opt.first_closure_call_this_step is True


@pytest.mark.parametrize("kind", ["apex", "apex-static", "apex-cpu-masters", "megatron", "megatron-static"])
def test_load_state_dict_between_backward_and_step_keeps_this_iterations_grads(kind, caplog):
    """backward(loss); load_state_dict(state_dict()); step(): the master grads are this
    iteration's, the step applies them (as with no load), and no "step() with no
    optimizer.backward(loss)" warning is logged."""

    def run(reload):
        model = make_model(torch.float16)
        opt = _make(kind, model)
        for i in range(2):
            x, y = batch(i, torch.float16)
            opt.zero_grad()
            opt.backward(loss_fn(model, x, y))
            if reload and i == 1:
                opt.load_state_dict(copy.deepcopy(opt.state_dict()))
            opt.step()
        return [m.detach().clone() for m in flat_masters(opt)]

    with caplog.at_level(logging.WARNING, logger="fp16kit"):
        reloaded = run(True)
    assert NO_BACKWARD not in caplog.text
    for a, b in zip(reloaded, run(False)):
        bitwise(a, b)


# ------------------------------------------------------------------ behaved identically
def test_apex_patterns_match_the_reference_bit_for_bit():
    """backward(loss) twice then step; backward(update_master_grads=False) x2 +
    update_master_grads(); an injected inf (skip); zero_grad between backward and step (zero
    master grads are stepped: momentum); overflow read at every point."""
    model, opt, ref = build(torch.float16, "sgd_momentum", dynamic=True, dynamic_args={"init_scale": 2.0**12})
    for i in range(5):
        x, y = batch(i, torch.float16)
        opt.zero_grad()
        ref.zero_grad()
        if i == 0:  # two losses, each backward updating the master grads
            for j in range(2):
                opt.backward(loss_fn(model, x, y) * (j + 1))
                ref.backward(loss_fn(ref.model, x, y) * (j + 1))
                ref.update_master_grads()
        elif i in (1, 2):  # deferred; an inf at i == 2
            for j in range(2):
                opt.backward(loss_fn(model, x, y) * (j + 1), update_master_grads=False)
                ref.backward(loss_fn(ref.model, x, y) * (j + 1))
            if i == 2:
                for m in (model, ref.model):
                    m.l1.weight.grad.view(-1)[0] = INF
            opt.update_master_grads()
            ref.update_master_grads()
        else:
            opt.backward(loss_fn(model, x, y))
            ref.backward(loss_fn(ref.model, x, y))
            ref.update_master_grads()
            if i == 4:  # zero_grad between backward and step
                opt.zero_grad()
                ref.zero_grad()
        assert opt.overflow == ref.overflow
        opt.step()
        ref.step()
        assert opt.overflow == ref.overflow
        assert_matches(model, opt, ref, f"iteration {i}")


def test_async_step_refuses_a_step_without_prepared_grads():
    model = make_model(torch.float16)
    opt = _make("apex-async", model)
    x, y = batch(0, torch.float16)
    opt.zero_grad()
    opt.backward(loss_fn(model, x, y))
    opt.step()
    with pytest.raises(RuntimeError, match="found no prepared gradients"):
        opt.step()  # twice
    opt.backward(loss_fn(model, x, y))
    opt.zero_grad()
    with pytest.raises(RuntimeError, match="found no prepared gradients"):
        opt.step()  # zero_grad between backward and step
    opt.backward(loss_fn(model, x, y))
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    with pytest.raises(RuntimeError, match="found no prepared gradients"):
        opt.step()  # a load between backward and step
    opt.zero_grad(set_grads_to_None=True)
    opt.backward(loss_fn(model, x, y))
    opt.step()
    opt.synchronize()


@pytest.mark.parametrize("kind", ["apex", "apex-cpu-masters", "apex-async"])
def test_driven_by_fp16kit_grad_scaler(kind):
    """scaler.scale/unscale_/step/update around an FP16_Optimizer, with a direct step() between
    unscale_ and scaler.step and a skipped (inf) iteration: no internal error; overflow untouched."""
    model = make_model(torch.float16)
    opt = _make(kind, model)
    scaler = GradScaler("cpu", init_scale=1024.0)
    for i in range(4):
        x, y = batch(i, torch.float16)
        opt.zero_grad()
        scaler.scale(loss_fn(model, x, y)).backward()
        if i == 1:
            model.l1.weight.grad.view(-1)[0] = INF
        if i == 2:
            scaler.unscale_(opt)
            if kind != "apex-async":
                opt.clip_master_grads(0.5)
                opt.step()
        scaler.step(opt)
        scaler.update()
        assert opt.overflow is False
    _finish(opt)
    assert scaler.get_scale() == 512.0


@pytest.mark.parametrize("kind", ["megatron", "megatron-static", "apex"])
def test_lbfgs_closure_flags(kind):
    """LBFGS step(closure): first_closure_call_this_step is False inside every evaluation and
    True after; a plain step() after a closure step warns nothing."""
    model = make_model(torch.float16)
    opt = _make(kind, model, torch.optim.LBFGS, lr=0.2, max_iter=3)
    seen = []
    for i in range(2):
        x, y = batch(i, torch.float16)

        def closure():
            seen.append(opt.first_closure_call_this_step)
            opt.zero_grad()
            loss = loss_fn(model, x, y)
            opt.backward(loss)
            return loss

        opt.step(closure)
        assert opt.first_closure_call_this_step is True
    assert seen and not any(seen)
