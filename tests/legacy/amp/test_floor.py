"""The opt-in floor policy (docs/apex-amp.md §7 FIX): ``amp.initialize(..., on_min_scale=...)``."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from fp16kit.legacy import amp
from fp16kit.legacy.amp._amp_state import _amp_state


def _setup(**kw):
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return amp.initialize(model, opt, opt_level="O0", loss_scale="dynamic", verbosity=0, **kw)


def _nan_steps(model, opt, n):
    """``n`` steps whose loss is NaN; the scale after each."""
    scales = []
    for _ in range(n):
        opt.zero_grad()
        loss = model(torch.ones(2, 4)).sum() * float("nan")
        with amp.scale_loss(loss, opt) as s:
            s.backward()
        w = model.weight.detach().clone()
        opt.step()
        assert torch.equal(model.weight, w)  # skipped
        scales.append(amp._amp_state.loss_scalers[0].loss_scale())
    return scales


FLOOR = 2.0**14
EXPECTED = [2.0**15, 2.0**14, 2.0**14, 2.0**14]


def test_default_is_apex_halving_to_the_floor_silently(caplog):
    with caplog.at_level(logging.WARNING, logger="fp16kit"):
        model, opt = _setup(min_loss_scale=FLOOR)
        assert _nan_steps(model, opt, 4) == EXPECTED
    assert "floor" not in caplog.text


def test_warn_logs_each_overflow_at_the_floor_same_numbers(caplog):
    model, opt = _setup(min_loss_scale=FLOOR, on_min_scale="warn")
    with caplog.at_level(logging.WARNING, logger="fp16kit"):
        assert _nan_steps(model, opt, 4) == EXPECTED
    # the 3rd and 4th back-offs started at the floor
    assert sum("already at its floor" in r.getMessage() for r in caplog.records) == 2


def test_raise_raises_at_the_scale_loss_exit_and_the_step_is_still_skipped():
    model, opt = _setup(min_loss_scale=FLOOR, on_min_scale="raise")
    assert _nan_steps(model, opt, 2) == EXPECTED[:2]
    opt.zero_grad()
    with pytest.raises(FloatingPointError, match="floor"):
        with amp.scale_loss(model(torch.ones(2, 4)).sum() * float("nan"), opt) as s:
            s.backward()
    w = model.weight.detach().clone()
    opt.step()
    assert torch.equal(model.weight, w)
    assert amp._amp_state.loss_scalers[0].loss_scale() == FLOOR


@pytest.mark.parametrize("min_loss_scale", [None, 0])
def test_policy_without_floor_is_a_clear_error_and_changes_nothing(min_loss_scale):
    _setup()
    scalers = _amp_state.loss_scalers
    with pytest.raises(ValueError, match="min_loss_scale"):
        _setup(min_loss_scale=min_loss_scale, on_min_scale="raise")
    with pytest.raises(ValueError, match="on_min_scale must be one of"):
        _setup(min_loss_scale=1.0, on_min_scale="panic")
    assert _amp_state.loss_scalers is scalers


def test_keyword_only():
    with pytest.raises(TypeError):
        amp.initialize(
            nn.Linear(1, 1), None, True, "O0", None, None, None, None, None, None, 1, 0, None, 2.0**24, "warn"
        )
