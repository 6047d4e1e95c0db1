"""fp16kit.legacy.FP16_Optimizer's state_dict() / load_state_dict(): a round trip continues bit
for bit, the fp32 masters come back exactly, and a state dict of another group layout or with
bad scaler settings is refused without changing anything. The model, data and reference are in
tests/_helpers/fp16_optimizer.py.
"""

from __future__ import annotations

import copy
import io
import re

import pytest
import torch

from _helpers.fp16_optimizer import (
    LOW,
    LOW_IDS,
    OPTIMIZERS,
    batch,
    bitwise,
    build,
    flat_masters,
    inject_inf_fp16,
    inject_nan_fp32,
    loss_fn,
    make_model,
    same_value,
)
from fp16kit.legacy import FP16_Optimizer


# ---------------------------------------------------------------- checkpoints
def _step(model, opt, i, dtype, inject=None):
    x, y = batch(i, dtype)
    opt.zero_grad()
    if inject is None:
        opt.backward(loss_fn(model, x, y))
    else:
        opt.backward(loss_fn(model, x, y), update_master_grads=False)
        inject(model)
        opt.update_master_grads()
    opt.step()


def _snapshot(model, opt):
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "masters": [m.detach().clone() for m in flat_masters(opt)],
        "scale": opt.loss_scale,
        "overflow": opt.overflow,
        "state": [
            [copy.deepcopy(dict(opt.state[p])) if p in opt.state else {} for p in g["params"]] for g in opt.param_groups
        ],
        "lrs": [g["lr"] for g in opt.param_groups],
    }


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("dtype", LOW, ids=LOW_IDS)
def test_state_dict_round_trip_continues_bitwise(dtype, opt_name):
    dyn = {"init_scale": 2.0**21, "scale_window": 2}
    injections = {2: inject_inf_fp16, 6: inject_nan_fp32}
    model, opt, _ = build(dtype, opt_name, dynamic=True, dynamic_args=dyn)
    for i in range(4):
        _step(model, opt, i, dtype, injections.get(i))

    sd = opt.state_dict()
    assert set(sd) == {
        "loss_scaler",
        "dynamic_loss_scale",
        "overflow",
        "first_closure_call_this_step",
        "optimizer_state_dict",
        "fp32_from_fp16",
    }
    assert isinstance(sd["loss_scaler"], dict)
    assert [len(g) for g in sd["fp32_from_fp16"]] == [3, 1]
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": sd}, buf)
    buf.seek(0)
    ck = torch.load(buf, weights_only=True)

    # a fresh model (different init) and optimizer; the model is loaded first
    model2, opt2, _ = build(dtype, opt_name, dynamic=True, dynamic_args={"init_scale": 8.0}, seed=7)
    model2.load_state_dict(ck["model"])
    opt2.load_state_dict(ck["optimizer"])
    same_value(_snapshot(model2, opt2), _snapshot(model, opt), "after load")

    for i in range(4, 9):
        _step(model, opt, i, dtype, injections.get(i))
        _step(model2, opt2, i, dtype, injections.get(i))
        same_value(_snapshot(model2, opt2), _snapshot(model, opt), f"iter {i}")


def test_state_dict_restores_masters_exactly():
    """The fp32 masters come back exactly, not through an fp16 round trip."""
    model, opt, _ = build(torch.float16, "adam", static_loss_scale=16.0)
    for i in range(3):
        _step(model, opt, i, torch.float16)
    masters = [m.detach().clone() for m in flat_masters(opt)]
    assert any(not torch.equal(m, m.half().float()) for m in masters)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buf)
    buf.seek(0)
    ck = torch.load(buf, weights_only=True)
    model2, opt2, _ = build(torch.float16, "adam", static_loss_scale=16.0, seed=3)
    model2.load_state_dict(ck["model"])
    opt2.load_state_dict(ck["optimizer"])
    for m, m2 in zip(masters, flat_masters(opt2)):
        bitwise(m2.detach(), m)
    assert opt2.loss_scale == 16.0 and opt2.dynamic_loss_scale is False


def _trained_other_layout(layout: str):
    """An optimizer over the same model with another group structure, trained a few steps."""
    model = make_model(torch.float16, seed=5)
    if layout == "fp16_count":  # group 0 has 2 fp16 params instead of 3
        groups = [
            {"params": [model.l1.weight, model.l1.bias]},
            {"params": [model.gain, model.l2.weight, model.l2.bias, model.frozen]},
        ]
    elif layout == "group_count":  # one group instead of two
        groups = [{"params": list(model.parameters())}]
    else:  # "fp32_count": same masters per group, the fp32 param moved to group 0
        groups = [
            {"params": [model.l1.weight, model.l1.bias, model.l2.weight, model.gain]},
            {"params": [model.l2.bias, model.frozen]},
        ]
    opt = FP16_Optimizer(
        torch.optim.SGD(groups, lr=0.05, momentum=0.9),
        dynamic_loss_scale=True,
        dynamic_loss_args={"init_scale": 2.0**12, "scale_window": 2},
        verbose=False,
    )
    for i in range(3):
        _step(model, opt, i, torch.float16)
    return model, opt


@pytest.mark.parametrize("layout", ["fp16_count", "group_count", "fp32_count"])
def test_mismatched_groups_raise_and_change_nothing(layout):
    model, opt, _ = build(torch.float16, "sgd_momentum", dynamic=True, dynamic_args={"init_scale": 2.0**10})
    for i in range(2):
        _step(model, opt, i, torch.float16)
    sd = copy.deepcopy(opt.state_dict())

    model2, opt2 = _trained_other_layout(layout)
    before = _snapshot(model2, opt2)
    inner_sd_before = copy.deepcopy(opt2.optimizer.state_dict())
    with pytest.raises(ValueError) as e:
        opt2.load_state_dict(sd)
    msg = str(e.value)
    # nothing changed ...
    same_value(_snapshot(model2, opt2), before, "after failed load")
    same_value(opt2.optimizer.state_dict(), inner_sd_before, "inner state dict after failed load")
    # ... and the message names the group and the counts
    if layout == "fp16_count":
        assert re.search(r"group 0", msg, re.I), msg
        assert "3" in msg and "2" in msg, msg
    elif layout == "group_count":
        assert "2" in msg and "1" in msg and "group" in msg.lower(), msg
    else:
        # group 0: the checkpoint has 3 params, this optimizer 4
        assert re.search(r"group 0", msg, re.I), msg
        assert "3" in msg and "4" in msg, msg


def test_static_scaler_counts_clean_updates_like_apex():
    model = make_model(torch.float16)
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), static_loss_scale=8.0, verbose=False)
    for i in range(3):
        opt.zero_grad()
        x, y = batch(i, torch.float16)
        opt.backward(loss_fn(model, x, y))
        opt.step()
    assert opt.loss_scaler._unskipped == 3 and opt.state_dict()["loss_scaler"]["unskipped"] == 3


def test_load_with_bad_scaler_settings_changes_nothing():
    model = make_model(torch.float16)
    opt = FP16_Optimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), dynamic_loss_scale=True, verbose=False
    )
    x, y = batch(0, torch.float16)
    opt.backward(loss_fn(model, x, y))
    opt.step()
    sd = opt.state_dict()
    before = (
        copy.deepcopy(opt.optimizer.state_dict()),
        [m.detach().clone() for m in flat_masters(opt)],
        opt.loss_scale,
    )
    bad = dict(sd, loss_scaler=dict(sd["loss_scaler"], min_loss_scale=-1.0))
    with pytest.raises(ValueError, match="invalid settings"):
        opt.load_state_dict(bad)
    after = (opt.optimizer.state_dict(), flat_masters(opt), opt.loss_scale)
    same_value(before[0], after[0], "optimizer state")
    assert all(torch.equal(a, b) for a, b in zip(before[1], after[1])) and before[2] == after[2]


NAN, INF = float("nan"), float("inf")
ERA1 = "apex.fp16_utils.loss_scaler.DynamicLossScaler"
ERA2 = "apex.amp.scaler.LossScaler"


def _era1_record(**changes):
    """An era-1 DynamicLossScaler as load_checkpoint returns it from an apex file."""
    return {
        "__apex_class__": ERA1,
        "cur_scale": 1024.0,
        "cur_iter": 5,
        "last_overflow_iter": 2,
        "scale_factor": 2.0,
        "scale_window": 1000,
        **changes,
    }


def _era2_record(**changes):
    return {
        "__apex_class__": ERA2,
        "dynamic": True,
        "_loss_scale": 1024.0,
        "_max_loss_scale": 2.0**24,
        "_min_loss_scale": None,
        "_scale_seq_len": 2000,
        "_unskipped": 3,
        "_has_overflow": False,
        "_overflow_buf": torch.IntTensor([0]),
        **changes,
    }


# (what the saved loss_scaler is, the message naming the field)
BAD_SAVED_SCALERS = {
    "loss_scale nan": (dict(loss_scale=NAN), "loss_scale must be a finite number > 0.*, got nan"),
    "loss_scale 0": (dict(loss_scale=0.0), "loss_scale must be a finite number > 0.*, got 0.0"),
    "loss_scale -1": (dict(loss_scale=-1.0), "loss_scale must be a finite number > 0.*, got -1.0"),
    "loss_scale inf": (dict(loss_scale=INF), "loss_scale must be a finite number > 0.*, got inf"),
    "static loss_scale 0": (dict(dynamic=False, loss_scale=0.0), "loss_scale must be a finite number > 0"),
    "scale_window 0": (dict(scale_window=0), "scale_window must be a whole number >= 1.*, got 0"),
    "scale_factor 1": (dict(scale_factor=1.0), "scale_factor must be a finite number > 1.*, got 1.0"),
    "unskipped -1": (dict(unskipped=-1), "unskipped .* must be an int >= 0, got -1"),
    "min above max": (dict(min_loss_scale=2.0**30), r"min_loss_scale \(1073741824.0\) is above max_loss_scale"),
    "era-1 scale_window 0": (
        _era1_record(scale_window=0),
        f"{ERA1} in this file is not one apex pickled: its scale_window is 0, not a whole number >= 1",
    ),
    "era-1 scale_window inf": (_era1_record(scale_window=INF), "its scale_window is inf, not a whole number >= 1"),
    "era-1 cur_scale nan": (_era1_record(cur_scale=NAN), "its cur_scale is nan, not a finite number > 0"),
    "era-1 cur_scale 0": (_era1_record(cur_scale=0), "its cur_scale is 0, not a finite number > 0"),
    "era-1 scale_factor 0": (_era1_record(scale_factor=0.0), "its scale_factor is 0.0, not a finite number > 1"),
    "era-1 static cur_scale -1": (
        {"__apex_class__": "apex.fp16_utils.loss_scaler.LossScaler", "cur_scale": -1.0},
        "its cur_scale is -1.0, not a finite number > 0",
    ),
    "era-2 _loss_scale nan": (
        _era2_record(_loss_scale=NAN),
        f"{ERA2} in this file is not one apex pickled: its _loss_scale is nan, not a finite number > 0",
    ),
    "era-2 _loss_scale 0": (_era2_record(_loss_scale=0.0), "its _loss_scale is 0.0, not a finite number > 0"),
    "era-2 _loss_scale -1": (_era2_record(_loss_scale=-1.0), "its _loss_scale is -1.0"),
    "era-2 _scale_seq_len inf": (_era2_record(_scale_seq_len=INF), "its _scale_seq_len is inf"),
}


@pytest.mark.parametrize("case", list(BAD_SAVED_SCALERS))
def test_a_saved_loss_scaler_that_cannot_train_is_refused_naming_the_field_and_changes_nothing(case):
    # apex (and fp16kit before) trained with a NaN or 0 scale (NaN weights, or every step
    # skipped) and failed on an era-1 window of 0 or inf with ZeroDivisionError / OverflowError
    saved, said = BAD_SAVED_SCALERS[case]
    model, opt, _ = build(torch.float16, "sgd_momentum", dynamic=True, dynamic_args={"init_scale": 2.0**10})
    for i in range(2):
        _step(model, opt, i, torch.float16)
    sd = copy.deepcopy(opt.state_dict())
    if "__apex_class__" in saved:
        sd["loss_scaler"] = saved
    else:
        sd["loss_scaler"] = dict(sd["loss_scaler"], **saved)
    before = _snapshot(model, opt)
    scaler_before = opt.loss_scaler.state_dict()
    inner_before = copy.deepcopy(opt.optimizer.state_dict())
    with pytest.raises(ValueError, match=said):
        opt.load_state_dict(sd)
    same_value(_snapshot(model, opt), before, "after the refused load")
    same_value(opt.optimizer.state_dict(), inner_before, "inner state dict after the refused load")
    assert opt.loss_scaler.state_dict() == scaler_before
    _step(model, opt, 2, torch.float16)  # and it trains on as it was
    assert all(torch.isfinite(p).all() for p in model.parameters())
