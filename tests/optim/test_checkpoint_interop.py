"""Checkpoints crossing between torch's optimizers and fp16kit.optim / the apex facades: a user
who trained with ``torch.optim.AdamW`` (or whose checkpoint lacks a setting the class keeps in
its param groups) resumes with fp16kit's Adam / FusedAdam / LAMB and gets the numbers a
continued AdamW run gives (docs/apex-others.md §3.1: equal in exact arithmetic), or the
constructor's settings for what the checkpoint does not have -- never a KeyError at the first
step after a successful load, and never a bias correction restarted at step 1."""

from __future__ import annotations

import io

import pytest
import torch

from fp16kit.legacy.optimizers import FusedAdam, FusedLAMB, FusedNovoGrad
from fp16kit.optim import LAMB, Adam, LegacyAdam, NovoGrad


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 3, generator=g).requires_grad_(), torch.randn(5, generator=g).requires_grad_()]


def _grad(p, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(p.shape, generator=g, dtype=p.dtype)


def _weights_only(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _adam_reference(p, m, v, g, t, *, lr, b1, b2, eps, wd):
    """AdamW step t from moments m, v (float64), docs/apex-others.md §3.1 with adam_w_mode."""
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    u = (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps) + wd * p
    return p - lr * u, m, v


@pytest.mark.parametrize("cls", [Adam, FusedAdam])
def test_resume_from_a_torch_adamw_checkpoint_continues_its_step_count(cls):
    lr, wd = 1e-2, 0.01
    src = _params()
    torch_opt = torch.optim.AdamW(src, lr=lr, weight_decay=wd)
    for k in range(6):
        for i, p in enumerate(src):
            p.grad = _grad(p, 10 * k + i)
        torch_opt.step()
    sd = _weights_only(torch_opt.state_dict())
    resumed = [p.detach().clone().requires_grad_() for p in src]
    opt = cls(resumed, lr=lr, weight_decay=wd)
    opt.load_state_dict(sd)
    ref = [
        (p.detach().double(), sd["state"][i]["exp_avg"].double(), sd["state"][i]["exp_avg_sq"].double())
        for i, p in enumerate(src)
    ]
    for k in range(6, 9):
        for i, p in enumerate(resumed):
            p.grad = _grad(p, 10 * k + i)
            ref[i] = _adam_reference(*ref[i], p.grad.double(), k + 1, lr=lr, b1=0.9, b2=0.999, eps=1e-8, wd=wd)
        opt.step()
    for p, (r, _, _) in zip(resumed, ref):
        torch.testing.assert_close(p.detach().double(), r, rtol=1e-5, atol=1e-6)
    assert opt.param_groups[0]["step"] == 9
    # the count lives in the group now: no stale per-param 'step' left to mislead a converter
    assert all("step" not in opt.state[p] for p in resumed)


def test_a_param_that_got_grads_late_in_torch_takes_the_group_count():
    src = _params()
    torch_opt = torch.optim.AdamW(src, lr=1e-2)
    for k in range(5):
        src[0].grad = _grad(src[0], k)
        src[1].grad = _grad(src[1], 50 + k) if k >= 3 else None
        torch_opt.step()
    sd = _weights_only(torch_opt.state_dict())
    assert float(sd["state"][1]["step"]) == 2.0
    resumed = [p.detach().clone().requires_grad_() for p in src]
    opt = Adam(resumed, lr=1e-2)
    opt.load_state_dict(sd)
    for p in resumed:
        p.grad = _grad(p, 99)
    opt.step()
    assert opt.param_groups[0]["step"] == 6  # apex's group count: the most steps any param saw


@pytest.mark.parametrize(
    "cls,kw,key",
    [
        (FusedAdam, dict(bias_correction=False), "bias_correction"),
        (FusedAdam, dict(bias_correction=False, max_grad_norm=1.0), "max_grad_norm"),
        (LegacyAdam, dict(max_grad_norm=1.0), "max_grad_norm"),
        (LAMB, dict(grad_averaging=False), "grad_averaging"),
        (FusedLAMB, dict(max_grad_norm=2.0), "max_grad_norm"),
        (NovoGrad, dict(norm_type=0), "norm_type"),
        (FusedNovoGrad, dict(init_zero=True), "init_zero"),
    ],
)
def test_settings_a_checkpoint_lacks_keep_the_constructors_values(cls, kw, key):
    src = _params()
    torch_opt = torch.optim.Adam(src, lr=1e-3)
    for p in src:
        p.grad = _grad(p, 1)
    torch_opt.step()
    sd = _weights_only(torch_opt.state_dict())
    resumed = [p.detach().clone().requires_grad_() for p in src]
    opt = cls(resumed, lr=1e-3, **kw)
    opt.load_state_dict(sd)
    assert opt.param_groups[0][key] == opt.defaults[key]
    for p in resumed:
        p.grad = _grad(p, 2)
    opt.step()  # no KeyError after a load that succeeded


def test_a_checkpoint_converted_for_torch_still_resumes_fused_adam_exactly():
    # `fp16kit convert-checkpoint --torch-optimizer-state` moves the group step into each
    # param's state; loading that file back into FusedAdam continues the same count
    import copy

    from fp16kit.legacy.checkpoints.convert import convert_checkpoint

    a = _params()
    fa = FusedAdam(a, lr=1e-2, weight_decay=0.01)
    for k in range(3):
        for i, p in enumerate(a):
            p.grad = _grad(p, 10 * k + i)
        fa.step()
    converted, _ = convert_checkpoint({"optimizer": copy.deepcopy(fa.state_dict())}, torch_optimizer_state=True)
    b = [p.detach().clone().requires_grad_() for p in a]
    fb = FusedAdam(b, lr=1e-2, weight_decay=0.01)
    fb.load_state_dict(_weights_only(converted)["optimizer"])
    for k in range(3, 6):
        for i, (p, q) in enumerate(zip(a, b)):
            p.grad = _grad(p, 10 * k + i)
            q.grad = p.grad.clone()
        fa.step()
        fb.step()
    assert all(torch.equal(p, q) for p, q in zip(a, b))
    assert fb.param_groups[0]["step"] == fa.param_groups[0]["step"] == 6


def test_the_legacy_rule_continues_the_group_count_of_a_current_fused_adam_checkpoint():
    # a checkpoint of apex's current FusedAdam (one 'step' per group) resumed by the 2018 rule
    # (per-param 'step', e.g. an old BERT script's FusedAdam(max_grad_norm=...)): each param
    # with state continues from the group's count instead of restarting bias correction at 1
    lr = 1e-2
    src = _params()
    current = FusedAdam(src, lr=lr)
    for k in range(5):
        for i, p in enumerate(src):
            p.grad = _grad(p, 10 * k + i)
        current.step()
    sd = _weights_only(current.state_dict())
    resumed = [p.detach().clone().requires_grad_() for p in src]
    legacy = LegacyAdam(resumed, lr=lr)
    legacy.load_state_dict(sd)
    ref = [
        (p.detach().double(), sd["state"][i]["exp_avg"].double(), sd["state"][i]["exp_avg_sq"].double())
        for i, p in enumerate(src)
    ]
    for k in range(5, 7):
        t = k + 1
        for i, p in enumerate(resumed):
            p.grad = _grad(p, 10 * k + i)
            w, m, v = ref[i]
            g = p.grad.double()
            m = 0.9 * m + 0.1 * g
            v = 0.999 * v + 0.001 * g * g
            step_size = lr * (1 - 0.999**t) ** 0.5 / (1 - 0.9**t)  # docs/apex-others.md §1.4
            ref[i] = (w - step_size * (m / (v.sqrt() + 1e-8)), m, v)
        legacy.step()
    for p, (r, _, _) in zip(resumed, ref):
        torch.testing.assert_close(p.detach().double(), r, rtol=1e-5, atol=1e-6)
    assert [legacy.state[p]["step"] for p in resumed] == [7, 7]
    assert "step" not in legacy.param_groups[0]  # the count lives in each param's state now
