"""apex's legacy ``step(grads=, output_params=)`` zipped the group's params with the supplied
lists: the shortest one decides, and a param past the end of a supplied list is not stepped,
even when it has a ``.grad`` (apex/optimizers/fused_adam.py @2019, contrib fused_sgd.py:
``for p, grad, output_param in zip(group['params'], grads_this_group, output_params_this_group)``).
References hand-written from docs/apex-others.md §1.4 (first Adam step) and §3.3 (plain SGD)."""

from __future__ import annotations

import math

import pytest
import torch

from fp16kit.legacy.contrib.optimizers import FusedAdam as ContribFusedAdam
from fp16kit.legacy.contrib.optimizers import FusedSGD as ContribFusedSGD
from fp16kit.legacy.optimizers import FusedAdam
from fp16kit.optim import SGD, LegacyAdam
from fp16kit.optim.sgd import sgd_step

LR, B1, B2, EPS = 1e-2, 0.9, 0.999, 1e-8


def _adam_first_step(p, g, scale=1.0):
    # docs/apex-others.md §1.4, t = 1, no weight decay, float64 reference
    g = g.double() / scale
    m, v = (1 - B1) * g, (1 - B2) * g * g
    step_size = LR * math.sqrt(1 - B2) / (1 - B1)
    return (p.double() - step_size * (m / (v.sqrt() + EPS))).float()


def _two_params():
    a = torch.tensor([1.0, -2.0, 3.0], requires_grad=True)
    b = torch.tensor([0.5, 0.25], requires_grad=True)
    b.grad = torch.tensor([1.0, 1.0])  # b has a grad of its own: apex still did not step it
    return a, b


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: LegacyAdam(ps, lr=LR),
        lambda ps: ContribFusedAdam(ps, lr=LR),
        lambda ps: FusedAdam(ps, lr=LR, max_grad_norm=0.0),
    ],
)
def test_legacy_adam_does_not_step_params_past_the_supplied_grads(make):
    a, b = _two_params()
    ga = torch.tensor([0.5, -1.0, 2.0])
    want_a, b0 = _adam_first_step(a.detach(), ga), b.detach().clone()
    opt = make([a, b])
    opt.step(grads=[ga])
    torch.testing.assert_close(a.detach(), want_a, rtol=1e-6, atol=1e-7)
    assert torch.equal(b.detach(), b0)
    assert b not in opt.state or not opt.state[b]


def test_legacy_adam_does_not_step_params_past_the_supplied_output_params():
    a, b = _two_params()
    ga, gb = torch.tensor([0.5, -1.0, 2.0]), torch.tensor([4.0, 4.0])
    out_a = torch.zeros(3, dtype=torch.float16)
    want_a, b0 = _adam_first_step(a.detach(), ga, scale=2.0), b.detach().clone()
    opt = LegacyAdam([a, b], lr=LR)
    opt.step(grads=[ga, gb], output_params=[out_a], scale=2.0)
    torch.testing.assert_close(a.detach(), want_a, rtol=1e-6, atol=1e-7)
    assert torch.equal(out_a, want_a.half())
    assert torch.equal(b.detach(), b0)


def test_sgd_step_does_not_step_params_past_the_supplied_lists():
    a, b = _two_params()
    ga = torch.tensor([0.5, -1.0, 2.0])
    want_a, b0 = a.detach() - 0.1 * ga / 4.0, b.detach().clone()
    opt = SGD([a, b], lr=0.1)
    sgd_step(opt, wd_after_momentum=False, grads=[[ga]], outputs=[[None, None]], scale=4.0)
    assert torch.equal(a.detach(), want_a)
    assert torch.equal(b.detach(), b0)


def test_contrib_fused_sgd_does_not_step_params_past_the_supplied_grads():
    a = torch.tensor([1.0, -2.0, 3.0], requires_grad=True)
    b = torch.tensor([0.5, 0.25], requires_grad=True)
    b.grad = torch.tensor([1.0, 1.0])
    out_a, out_b = torch.zeros(3, dtype=torch.float16), torch.zeros(2, dtype=torch.float16)
    ga = torch.tensor([0.5, -1.0, 2.0]).half()
    opt = ContribFusedSGD([a, b], lr=0.1)
    opt.step(grads=[ga], output_params=[out_a, out_b], scale=4.0)
    want_a = torch.tensor([1.0, -2.0, 3.0]) - 0.1 * ga.float() / 4.0
    assert torch.equal(a.detach(), want_a)
    assert torch.equal(out_a, want_a.half())
    assert torch.equal(b.detach(), torch.tensor([0.5, 0.25]))
    assert torch.equal(out_b, torch.zeros(2, dtype=torch.float16))
