"""OwedUpdate (the adapters' one scale update per iteration): an update interrupted while it runs
(Ctrl-C inside ``scaler.update()``) stays owed, so the next settle runs it -- once."""

from __future__ import annotations

import pytest
import torch

import fp16kit
from fp16kit.integrations._scale_updates import OwedUpdate


class _InterruptedOnce(fp16kit.GradScaler):
    interrupted = False

    def update(self, new_scale=None):
        if not self.interrupted:
            self.interrupted = True
            raise KeyboardInterrupt
        super().update(new_scale)


def _stepped_scaler(scaler):
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    scaler.step(opt)
    return opt


def test_an_interrupted_update_is_still_owed_and_runs_once_on_retry():
    scaler = _InterruptedOnce("cpu", init_scale=1024.0, growth_interval=1)
    owed = OwedUpdate()
    opt = _stepped_scaler(scaler)
    owed.stepped(scaler, opt, None)
    with pytest.raises(KeyboardInterrupt):
        owed.settle(scaler)
    assert scaler.get_scale() == 1024.0
    assert owed.settle(scaler) is True  # the retry runs the owed update
    assert scaler.get_scale() == 2048.0  # one clean step, growth interval 1: grown once
    assert owed.settle(scaler) is False  # and only once


def test_nothing_owed_runs_nothing():
    scaler = fp16kit.GradScaler("cpu", init_scale=1024.0)
    assert OwedUpdate().settle(scaler) is False
    assert scaler.get_scale() == 1024.0
