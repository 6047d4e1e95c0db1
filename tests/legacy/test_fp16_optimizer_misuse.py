"""FP16_Optimizer: user mistakes that were silent -- a step with no optimizer.backward(loss)."""

from __future__ import annotations

import logging
import re

import pytest
import torch
from torch import nn

from fp16kit.legacy import FP16_Optimizer


def _setup():
    torch.manual_seed(0)
    model = nn.Linear(4, 2).half()
    opt = FP16_Optimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), static_loss_scale=8.0, verbose=False
    )
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


# ---------------------------------------------------------------- scale settings that cannot train
NAN, INF = float("nan"), float("inf")


def _wrapped_state(model, inner):
    """What a refused construction must leave as it was: the inner optimizer's groups (still the
    model's fp16 params, not masters), its state and the model."""
    return (
        [[id(p) for p in g["params"]] for g in inner.param_groups],
        inner.state_dict(),
        {n: p.detach().clone() for n, p in model.named_parameters()},
    )


def _same_state(a, b):
    assert a[0] == b[0] and a[1] == b[1]
    assert all(torch.equal(a[2][n], b[2][n]) for n in a[2])


@pytest.mark.parametrize("value", [0, 0.0, -1, -128.0, NAN, INF, None, 10**400], ids=lambda v: repr(v)[:12])
def test_a_static_loss_scale_that_cannot_train_is_refused_and_nothing_is_wrapped(value):
    # apex took it: 0 made every master grad inf/NaN (1/0), NaN and inf wrote NaN into the weights
    torch.manual_seed(0)
    model = nn.Linear(4, 2).half()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    before = _wrapped_state(model, inner)
    with pytest.raises(
        ValueError,
        match=r"static_loss_scale must be a finite number > 0, got "
        rf"{re.escape(repr(value)[:20])}.*\(e\.g\. 128\.0\), or dynamic_loss_scale=True",
    ):
        FP16_Optimizer(inner, static_loss_scale=value, verbose=False)
    _same_state(before, _wrapped_state(model, inner))


@pytest.mark.parametrize("value", [1, 128, 128.0, 2.0**-3, "128"], ids=repr)
def test_static_loss_scales_apex_trained_with_are_accepted(value):
    model, _ = _setup()
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), static_loss_scale=value, verbose=False)
    opt.backward(_loss(model))
    opt.step()
    assert opt.loss_scale == float(value) and all(torch.isfinite(p).all() for p in model.parameters())


BAD_DYNAMIC_ARGS = [
    ("init_scale", 0, "init_scale must be a finite number > 0"),
    ("init_scale", NAN, "init_scale must be a finite number > 0"),
    ("init_scale", -1.0, "init_scale must be a finite number > 0"),
    ("scale_factor", 1, "scale_factor must be a finite number > 1"),  # never backs off
    ("scale_factor", 0.5, "scale_factor must be a finite number > 1"),  # grows at an overflow
    ("scale_factor", 0, "scale_factor must be a finite number > 1"),
    ("scale_factor", NAN, "scale_factor must be a finite number > 1"),
    ("scale_window", 0, "scale_window must be a whole number >= 1"),
    ("scale_window", -5, "scale_window must be a whole number >= 1"),
    ("scale_window", 2.5, "scale_window must be a whole number >= 1"),
    ("scale_window", INF, "scale_window must be a whole number >= 1"),
    ("min_loss_scale", NAN, "min_loss_scale must be None or a finite number >= 0"),
    ("min_loss_scale", -1.0, "min_loss_scale must be None or a finite number >= 0"),
    ("min_loss_scale", 2.0**30, r"min_loss_scale \(1073741824.0\) is above max_loss_scale \(16777216.0\)"),
    ("max_loss_scale", 0, "max_loss_scale must be a number > 0"),
    ("max_loss_scale", NAN, "max_loss_scale must be a number > 0"),
]


@pytest.mark.parametrize(("key", "value", "said"), BAD_DYNAMIC_ARGS, ids=[f"{k}={v!r}" for k, v, _ in BAD_DYNAMIC_ARGS])
def test_dynamic_loss_args_that_cannot_train_are_refused_and_nothing_is_wrapped(key, value, said):
    torch.manual_seed(0)
    model = nn.Linear(4, 2).half()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    before = _wrapped_state(model, inner)
    with pytest.raises(ValueError, match=said):
        FP16_Optimizer(inner, dynamic_loss_scale=True, dynamic_loss_args={key: value}, verbose=False)
    _same_state(before, _wrapped_state(model, inner))


def test_dynamic_settings_apex_ran_with_are_accepted():
    # an uncapped init_scale starts at max_loss_scale (apex: min(max, init)); 0 is apex's "no floor";
    # an integral float window counts as apex's == did
    model, _ = _setup()
    opt = FP16_Optimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        dynamic_loss_scale=True,
        verbose=False,
        dynamic_loss_args={"init_scale": INF, "min_loss_scale": 0, "scale_window": 2.0},
    )
    assert opt.loss_scale == 2.0**24
    for _ in range(3):
        opt.zero_grad()
        opt.backward(_loss(model))
        opt.step()
    assert 1 <= opt.loss_scale <= 2.0**24 and all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("value", [0, -2.0, NAN, INF], ids=repr)
def test_setting_a_loss_scale_that_cannot_train_is_refused(value):
    model, opt = _setup()
    with pytest.raises(ValueError, match=r"loss_scale must be a finite number > 0"):
        opt.loss_scale = value
    assert opt.loss_scale == 8.0
    opt.loss_scale = 2**10  # scripts set it by hand
    assert opt.loss_scale == 1024.0
