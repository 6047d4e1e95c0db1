"""fp16kit.master_weights.checkpoint: a checkpoint of another model is refused before anything
changes, naming the group and the index -- fp32 (direct) params included."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fp16kit import MixedPrecisionOptimizer


def _mixed(width, seed=0):
    # an fp16 layer (mastered) and an fp32 head (stepped directly)
    torch.manual_seed(seed)
    body, head = nn.Linear(4, 4).half(), nn.Linear(4, width)
    return body, head


def _trained(width, optimizer=torch.optim.Adam):
    body, head = _mixed(width)
    opt = MixedPrecisionOptimizer(optimizer([*body.parameters(), *head.parameters()], lr=0.1))
    head(body(torch.ones(2, 4).half()).float()).sum().backward()
    opt.step()
    return opt


@pytest.mark.parametrize(
    "optimizer, key",
    [
        (torch.optim.Adam, "exp_avg"),
        (lambda p, lr: torch.optim.SGD(p, lr=lr, momentum=0.9), "momentum_buffer"),
    ],
)
def test_direct_param_shapes_are_checked_before_anything_changes(optimizer, key):
    saved = _trained(3, optimizer).state_dict()
    opt = _trained(5, optimizer)
    before = opt.state_dict()
    with pytest.raises(ValueError, match=rf"Param group 0, param 2: .*'{key}' has shape \(3, 4\).*\(5, 4\)"):
        opt.load_state_dict(saved)
    after = opt.state_dict()
    assert all(torch.equal(a, b) for a, b in zip(before["masters"][0], after["masters"][0]))
    for k, state in before["optimizer"]["state"].items():
        for name, v in state.items():
            assert torch.equal(v, after["optimizer"]["state"][k][name])


def test_state_of_other_shapes_is_not_compared():
    # Adafactor's factored rows/columns have shapes of their own: same model, loads fine.
    saved = _trained(3, torch.optim.Adafactor).state_dict()
    _trained(3, torch.optim.Adafactor).load_state_dict(saved)


def test_adafactor_factored_state_of_another_model_is_refused():
    saved = _trained(3, torch.optim.Adafactor).state_dict()
    with pytest.raises(ValueError, match=r"Param group 0, param 2: .*'row_var'"):
        _trained(5, torch.optim.Adafactor).load_state_dict(saved)
