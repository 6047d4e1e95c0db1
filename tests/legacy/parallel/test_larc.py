"""apex.parallel.LARC -> fp16kit.legacy.parallel.LARC (fp16kit.optim.larc), against apex's step
written out here with apex's host-side branches (docs/apex-others.md §4.4)."""

from __future__ import annotations

import copy

import pytest
import torch

from fp16kit.legacy.parallel.LARC import LARC
from fp16kit.optim.larc import LARC as ModernLARC


def _apex_step(optim, trust_coefficient=0.02, clip=True, eps=1e-8):
    """apex/parallel/LARC.py's step(), verbatim arithmetic."""
    with torch.no_grad():
        weight_decays = []
        for group in optim.param_groups:
            weight_decay = group["weight_decay"] if "weight_decay" in group else 0
            weight_decays.append(weight_decay)
            group["weight_decay"] = 0
            for p in group["params"]:
                if p.grad is None:
                    continue
                param_norm = torch.norm(p.data)
                grad_norm = torch.norm(p.grad.data)
                if param_norm != 0 and grad_norm != 0:
                    adaptive_lr = trust_coefficient * param_norm / (grad_norm + param_norm * weight_decay + eps)
                    if clip:
                        adaptive_lr = min(adaptive_lr / group["lr"], 1)
                    p.grad.data += weight_decay * p.data
                    p.grad.data *= adaptive_lr
    optim.step()
    for i, group in enumerate(optim.param_groups):
        group["weight_decay"] = weight_decays[i]


def _setup(dtype=torch.float32, lr=0.1, wd=1e-4):
    torch.manual_seed(0)
    params = [torch.randn(5, 4), torch.randn(4), torch.zeros(3), torch.randn(2, 2), torch.randn(6) * 1e-3]
    params = [p.to(dtype).requires_grad_() for p in params]
    grads = [torch.randn(5, 4) * 10, torch.randn(4) * 1e-4, torch.randn(3), torch.zeros(2, 2), torch.randn(6)]
    for p, g in zip(params, grads):
        p.grad = g.to(dtype)
    params[3].grad = None if dtype != torch.float32 else params[3].grad
    groups = [{"params": params[:3], "weight_decay": wd}, {"params": params[3:], "lr": lr * 3}]
    return params, groups


@pytest.mark.parametrize("clip", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_step_is_apexs_bit_for_bit(clip, dtype):
    params, groups = _setup(dtype)
    ref_params = [p.detach().clone().requires_grad_() for p in params]
    for r, p in zip(ref_params, params):
        r.grad = None if p.grad is None else p.grad.clone()
    ref_groups = [{**g, "params": ref_params[:3] if i == 0 else ref_params[3:]} for i, g in enumerate(groups)]
    opt = LARC(torch.optim.SGD(groups, lr=0.1, momentum=0.9), trust_coefficient=0.5, clip=clip)
    ref = torch.optim.SGD(ref_groups, lr=0.1, momentum=0.9)
    for _ in range(2):
        opt.step()
        _apex_step(ref, trust_coefficient=0.5, clip=clip)
        for p, r in zip(params, ref_params):
            assert torch.equal(p, r)
            assert (p.grad is None and r.grad is None) or torch.equal(p.grad, r.grad)
    assert [g["weight_decay"] for g in opt.param_groups] == [1e-4, 0]


def test_zero_norms_leave_the_grad_alone():
    p_zero = torch.zeros(3, requires_grad=True)
    p = torch.ones(3, requires_grad=True)
    p_zero.grad = torch.ones(3)
    p.grad = torch.zeros(3)
    opt = LARC(torch.optim.SGD([p_zero, p], lr=1.0, weight_decay=0.5))
    opt.step()
    assert torch.equal(p_zero, -torch.ones(3))  # grad unscaled, no decay added
    assert torch.equal(p, torch.ones(3))


def test_weight_decay_restored_when_the_inner_step_raises():
    class Failing(torch.optim.SGD):
        def step(self, closure=None):
            raise RuntimeError("boom")

    p = torch.ones(2, requires_grad=True)
    p.grad = torch.ones(2)
    opt = LARC(Failing([p], lr=0.1, weight_decay=0.3))
    with pytest.raises(RuntimeError, match="boom"):
        opt.step()
    assert opt.param_groups[0]["weight_decay"] == 0.3


def test_proxies_the_wrapped_optimizer():
    params, groups = _setup()
    inner = torch.optim.SGD(groups, lr=0.1, momentum=0.9)
    opt = LARC(inner)
    assert ModernLARC is LARC and type(opt).__name__ == "LARC"  # amp recognises it by name
    assert opt.optim is inner and opt.param_groups is inner.param_groups and opt.state is inner.state
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    assert saved["state"] and saved["param_groups"] == inner.state_dict()["param_groups"]
    extra = torch.ones(2, requires_grad=True)
    opt.add_param_group({"params": [extra]})
    assert inner.param_groups[-1]["params"] == [extra]
    opt.zero_grad()
    assert all(p.grad is None for p in params)
    other = LARC(torch.optim.SGD(_setup()[1], lr=0.1, momentum=0.9))
    other.load_state_dict(saved)
    assert other.state_dict()["state"].keys() == saved["state"].keys()
    assert repr(opt) == repr(inner)


def test_closure_runs_first_and_its_loss_is_returned():
    p = torch.ones(2, requires_grad=True)
    opt = LARC(torch.optim.SGD([p], lr=0.1))

    def closure():
        opt.zero_grad()
        loss = (p * 3).sum()
        loss.backward()
        return loss

    assert opt.step(closure).item() == 6.0
    assert not torch.equal(p, torch.ones(2))


def test_refuses_a_non_optimizer():
    with pytest.raises(TypeError, match="torch.optim.SGD"):
        LARC([torch.ones(1)])
