"""FP16_Optimizer: user mistakes that were silent -- a step with no optimizer.backward(loss)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from fp16kit.legacy import FP16_Optimizer


def _setup():
    torch.manual_seed(0)
    model = nn.Linear(4, 2).half()
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), static_loss_scale=8.0, verbose=False)
    return model, opt


def _loss(model):
    return model(torch.ones(3, 4).half()).float().sum()


def test_step_without_optimizer_backward_warns_once_and_keeps_apex_numbers(caplog):
    model, opt = _setup()
    ref_model, ref_opt = _setup()
    with caplog.at_level(logging.WARNING, logger="fp16kit"):
        for _ in range(3):
            for m, o, plain in ((model, opt, True), (ref_model, ref_opt, False)):
                o.zero_grad()
                if plain:
                    _loss(m).backward()  # the mistake: the master grads stay zero
                    o.step()
                else:
                    o.step()  # apex did the same with no backward at all
    warned = [r for r in caplog.records if "optimizer.backward(loss)" in r.getMessage()]
    assert len(warned) == 2  # once per optimizer (both stepped without it), not per step
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)


def test_no_warning_in_apex_loop(caplog):
    model, opt = _setup()
    with caplog.at_level(logging.WARNING, logger="fp16kit"):
        for _ in range(3):
            opt.zero_grad()
            opt.backward(_loss(model))
            opt.step()
    assert not [r for r in caplog.records if "optimizer.backward(loss)" in r.getMessage()]


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_takes_torchs_set_to_none(set_to_none):
    # torch-style loops call zero_grad(set_to_none=...); apex's name is set_grads_to_None
    model = nn.Linear(4, 4).half()
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), verbose=False)
    opt.backward(model(torch.randn(2, 4).half()).float().sum())
    opt.zero_grad(set_to_none=set_to_none)
    for p in [*model.parameters(), *opt.fp32_from_fp16_groups[0]]:
        if set_to_none:
            assert p.grad is None
        else:
            assert p.grad is not None and not p.grad.any()
