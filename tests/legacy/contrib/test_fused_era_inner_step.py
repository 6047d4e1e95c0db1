"""The fused-era FP16_Optimizer steps its inner optimizer through the inner optimizer's own
``step`` (apex: ``self.optimizer.step(grads=..., output_params=..., scale=..., grad_norms=...)``),
so what torch hangs on that method sees every step that is taken: an LR scheduler attached to
the inner optimizer (the apex-era pattern -- apex's wrapper was no ``torch.optim.Optimizer``)
does not warn "lr_scheduler.step() before optimizer.step()", and step hooks registered on the
inner optimizer run once per step taken, never for a skipped (overflowed) one."""

from __future__ import annotations

import warnings

import pytest
import torch

from fp16kit.legacy.contrib.optimizers import FP16_Optimizer, FusedAdam, FusedSGD
from fp16kit.legacy.optimizers import FusedAdam as CurrentFusedAdam

INNER = {
    "contrib FusedAdam": lambda ps: FusedAdam(ps, lr=1e-2, bias_correction=False, max_grad_norm=1.0),
    "FusedAdam(max_grad_norm=)": lambda ps: CurrentFusedAdam(ps, lr=1e-2, bias_correction=False, max_grad_norm=1.0),
    "current FusedAdam": lambda ps: CurrentFusedAdam(ps, lr=1e-2),
    "contrib FusedSGD": lambda ps: FusedSGD(ps, lr=1e-2, momentum=0.9),
}


def _params():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(4, 3, generator=g).half().requires_grad_(), torch.randn(3, generator=g).half().requires_grad_()]


@pytest.mark.parametrize("name", list(INNER))
def test_a_scheduler_on_the_inner_optimizer_sees_the_steps(name):
    params = _params()
    inner = INNER[name](params)
    opt = FP16_Optimizer(inner, static_loss_scale=8.0, verbose=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt.optimizer, lambda s: 0.5**s)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*lr_scheduler.step.*before.*optimizer.step")
        for _ in range(3):
            opt.backward(sum((p.float() ** 2).sum() for p in params))
            opt.step()
            opt.zero_grad()
            sched.step()
    assert inner.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.5**3)


@pytest.mark.parametrize("name", list(INNER))
def test_inner_step_hooks_run_for_steps_taken_only(name):
    params = _params()
    inner = INNER[name](params)
    opt = FP16_Optimizer(inner, dynamic_loss_scale=True, verbose=False)
    taken = []
    inner.register_step_post_hook(lambda o, args, kwargs: taken.append(kwargs.get("scale")))
    pattern = [True, False, False, True, False]  # overflow?
    for bad in pattern:
        for p in params:
            p.grad = torch.ones_like(p)
        if bad:
            params[1].grad[0] = float("inf")
        opt.step()
    assert len(taken) == pattern.count(False)
    assert opt.cur_iter == len(pattern)


def test_a_subclass_with_apex_fixed_step_signature_works_under_the_wrapper():
    """fairseq's FusedAdamV2 overrides step(closure, grads, output_params, scale, grad_norms)
    without **kwargs: step_with_grads must not pass it private keywords (review item 11 asked
    for one; the wrapper flag stays), and the flag is cleared after a raising step."""

    class FixedSignature(CurrentFusedAdam):
        def step(self, closure=None, grads=None, output_params=None, scale=None, grad_norms=None):
            return super().step(closure, grads=grads, output_params=output_params, scale=scale, grad_norms=grad_norms)

    params = _params()
    inner = FixedSignature(params, lr=1e-2)
    opt = FP16_Optimizer(inner, static_loss_scale=8.0, verbose=False)
    opt.backward(sum((p.float() ** 2).sum() for p in params))
    before = [p.detach().clone() for p in params]
    opt.step()
    assert all(not torch.equal(b, p.detach()) for b, p in zip(before, params))
    assert inner._driven_by_wrapper is False
    with pytest.raises(RuntimeError, match="sparse"):
        inner.step_with_grads(grads=[torch.ones(4, 3).half().to_sparse(), torch.ones(3).half()], scale=1.0)
    assert inner._driven_by_wrapper is False
    with pytest.raises(RuntimeError, match="FusedAdam has been updated"):
        inner.step(grads=[torch.ones(4, 3).half(), torch.ones(3).half()])
