"""Megatron FP16_Optimizer checkpoints: plain data through torch.save/torch.load(weights_only=True),
an exact resume, the saved scaler beating the constructor's settings, and the dicts
fp16kit.legacy.load_checkpoint makes of scalers pickled by Megatron-era code."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from fp16kit.legacy.megatron import DynamicLossScaler, FP16_Module, FP16_Optimizer, LossScaler

MEGATRON_ARGS = {"scale_window": 3.0, "min_scale": 1.0, "delayed_shift": 2, "init_scale": 2**18}


def build(**kwargs):
    torch.manual_seed(0)
    model = FP16_Module(nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2)))
    inner = torch.optim.Adam(model.parameters(), lr=1e-2)
    opt = FP16_Optimizer(inner, **kwargs)
    return model, opt


def train(model, opt, iters, start=0):
    for i in range(start, start + iters):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(4, 5, generator=g), torch.randn(4, 2, generator=g)
        if i % 5 == 4:
            x[1, 2] = float("inf")
        opt.zero_grad()
        opt.backward(((model(x) - y) ** 2).mean(), update_master_grads=False)
        opt.update_master_grads()
        opt.clip_master_grads(1.0)
        opt.step()


def roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_resume_is_exact_and_the_saved_scaler_wins():
    model, opt = build(static_loss_scale=None, dynamic_loss_scale=True, dynamic_loss_args=MEGATRON_ARGS)
    train(model, opt, 9)
    saved = roundtrip({"model": model.state_dict(), "optimizer": opt.state_dict()})
    assert set(saved["optimizer"]) == {
        "loss_scaler",
        "dynamic_loss_scale",
        "overflow",
        "first_closure_call_this_step",
        "optimizer_state_dict",
        "fp32_from_fp16",
    }
    assert saved["optimizer"]["loss_scaler"] == opt.loss_scaler.state_dict()

    model2, opt2 = build(static_loss_scale=4.0)  # other settings: the checkpoint's win
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["optimizer"])
    assert isinstance(opt2.loss_scaler, DynamicLossScaler) and opt2.dynamic_loss_scale is True
    assert opt2.loss_scaler.state_dict() == opt.loss_scaler.state_dict()
    train(model, opt, 8, start=9)
    train(model2, opt2, 8, start=9)
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)
    for m, n in zip(opt.fp32_from_fp16_groups[0], opt2.fp32_from_fp16_groups[0]):
        assert torch.equal(m, n)
    assert opt2.loss_scaler.state_dict() == opt.loss_scaler.state_dict()


@pytest.mark.parametrize("path", ["megatron.fp16.loss_scaler.DynamicLossScaler", "fp16.loss_scaler.DynamicLossScaler"])
def test_loads_a_pickled_megatron_scaler_as_load_checkpoint_gives_it(path):
    model, opt = build(static_loss_scale=None, dynamic_loss_scale=True, dynamic_loss_args=MEGATRON_ARGS)
    train(model, opt, 3)
    sd = opt.state_dict()
    # a 2019 object: no min_scale / delayed_shift / cur_hysteresis / consecutive_hysteresis
    sd["loss_scaler"] = {
        "__apex_class__": path,
        "cur_scale": 2048.0,
        "cur_iter": 40,
        "last_overflow_iter": 38,
        "scale_factor": 2.0,
        "scale_window": 1000,
    }
    _, fresh = build(static_loss_scale=None, dynamic_loss_scale=True, dynamic_loss_args=MEGATRON_ARGS)
    fresh.load_state_dict(sd)
    s = fresh.loss_scaler
    assert (s.cur_scale, s.cur_iter, s.last_overflow_iter, s.scale_window) == (2048.0, 40, 38, 1000)
    assert (s.min_scale, s.delayed_shift, s.cur_hysteresis, s.consecutive_hysteresis) == (1, 1, 1, True)
    assert fresh.loss_scale == 2048.0


def test_loads_a_static_megatron_scaler():
    _, opt = build(static_loss_scale=None, dynamic_loss_scale=True, dynamic_loss_args=MEGATRON_ARGS)
    sd = opt.state_dict()
    sd["loss_scaler"] = {"__apex_class__": "megatron.fp16.loss_scaler.LossScaler", "cur_scale": 512}
    sd["dynamic_loss_scale"] = False
    opt.load_state_dict(sd)
    assert type(opt.loss_scaler) is LossScaler and opt.loss_scale == 512 and not opt.dynamic_loss_scale
    assert roundtrip(opt.state_dict())["loss_scaler"] == {"cur_scale": 512}


def test_bad_checkpoints_change_nothing():
    model, opt = build(static_loss_scale=None, dynamic_loss_scale=True, dynamic_loss_args=MEGATRON_ARGS)
    train(model, opt, 4)
    good = opt.state_dict()
    before = (opt.loss_scaler.state_dict(), [m.clone() for m in opt.fp32_from_fp16_groups[0]])
    amp_form = {**good, "loss_scaler": {"__apex_class__": "apex.amp.scaler.LossScaler", "_loss_scale": 2.0}}
    with pytest.raises(ValueError, match="Cannot read the saved loss scaler"):
        opt.load_state_dict(amp_form)
    bad_attr = {**good, "loss_scaler": {**good["loss_scaler"], "delayed_shift": 0}}
    with pytest.raises(ValueError, match="delayed_shift must be an int >= 1"):
        opt.load_state_dict(bad_attr)
    short = {**good, "fp32_from_fp16": [good["fp32_from_fp16"][0][:-1]]}
    with pytest.raises(ValueError):
        opt.load_state_dict(short)
    with pytest.raises(ValueError, match="missing"):
        opt.load_state_dict({k: v for k, v in good.items() if k != "overflow"})
    assert opt.loss_scaler.state_dict() == before[0]
    assert all(torch.equal(m, b) for m, b in zip(opt.fp32_from_fp16_groups[0], before[1]))


def test_an_apex_scaler_converted_by_convert_checkpoint_continues_as_the_original():
    # convert-checkpoint writes an apex.fp16_utils scaler in fp16kit's plain form; a Megatron
    # optimizer reading that form must continue with the same scales as from the raw record.
    import random

    from fp16kit.legacy.checkpoints.load import scaler_state
    from fp16kit.legacy.fp16_optimizer import AmpLossScaler
    from fp16kit.legacy.megatron.loss_scaler import scaler_from_state

    record = {
        "__apex_class__": "apex.fp16_utils.loss_scaler.DynamicLossScaler",
        "cur_scale": 1024.0,
        "cur_iter": 57,
        "last_overflow_iter": 50,
        "scale_factor": 2.0,
        "scale_window": 10,
    }
    original = scaler_from_state(dict(record))
    converted = scaler_from_state(scaler_state(dict(record), current=AmpLossScaler(1.0).state_dict()))
    rng = random.Random(0)
    for _ in range(60):
        overflow = rng.random() < 0.15
        original.update_scale(overflow)
        converted.update_scale(overflow)
        assert converted.cur_scale == original.cur_scale


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    ("dynamic", "field", "value", "said"),
    [
        (True, "cur_scale", NAN, "cur_scale must be a finite number > 0, got nan"),  # was named init_scale
        (True, "cur_scale", 0, "cur_scale must be a finite number > 0, got 0"),
        (True, "cur_scale", -2.0, "cur_scale must be a finite number > 0, got -2.0"),
        (True, "scale_factor", 0.5, "scale_factor must be a finite number > 1"),  # grew at every overflow
        (True, "scale_window", 0, "scale_window must be a whole number >= 1"),
        (False, "cur_scale", INF, "cur_scale must be a finite number > 0, got inf"),
        (False, "cur_scale", NAN, "cur_scale must be a finite number > 0, got nan"),
    ],
)
def test_a_saved_scale_that_cannot_train_is_refused_naming_the_field_and_changes_nothing(dynamic, field, value, said):
    kwargs = (
        dict(static_loss_scale=None, dynamic_loss_scale=True, dynamic_loss_args=MEGATRON_ARGS)
        if dynamic
        else dict(static_loss_scale=128.0)
    )
    model, opt = build(**kwargs)
    train(model, opt, 3)
    saved = opt.state_dict()
    saved = {**saved, "loss_scaler": {**saved["loss_scaler"], field: value}}
    before = (
        opt.loss_scaler.state_dict(),
        [m.clone() for m in opt.fp32_from_fp16_groups[0]],
        opt.optimizer.state_dict(),
    )
    with pytest.raises(ValueError, match=rf"Cannot read the saved loss scaler \({said}"):
        opt.load_state_dict(saved)
    assert opt.loss_scaler.state_dict() == before[0]
    assert all(torch.equal(m, b) for m, b in zip(opt.fp32_from_fp16_groups[0], before[1]))
    assert str(opt.optimizer.state_dict()) == str(before[2])


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("value", [0, -1.0, NAN, INF], ids=repr)
def test_setting_a_loss_scale_that_cannot_train_is_refused(dynamic, value):
    # Megatron's static scaler took any cur_scale: 0 divided by zero at the next update_master_grads
    model, opt = build(static_loss_scale=8.0, dynamic_loss_scale=dynamic)
    before = opt.loss_scale
    with pytest.raises(ValueError, match="must be a finite number > 0"):
        opt.loss_scale = value
    assert opt.loss_scale == before
    opt.loss_scale = 2**10
    assert opt.loss_scale == 1024


@pytest.mark.parametrize(
    "field", ["cur_scale", "cur_iter", "last_overflow_iter", "scale_factor", "min_scale", "delayed_shift"]
)
@pytest.mark.parametrize("bad", [10**400, -(10**400), 2**62], ids=["10**400", "-10**400", "2**62"])
def test_a_saved_number_too_large_for_its_field_is_a_valueerror_naming_it(field, bad):
    """10**400 raised OverflowError (math.isfinite) or, in a counter, RuntimeError/OverflowError from
    the core's int32 trackers; a saved value no Megatron run wrote is a ValueError naming its field."""
    from fp16kit.legacy.megatron.loss_scaler import scaler_from_state

    saved = {
        "cur_scale": 2.0**16,
        "cur_iter": 5,
        "last_overflow_iter": -1,
        "scale_factor": 2.0,
        "scale_window": 1000,
        "min_scale": 1,
        "delayed_shift": 2,
        "cur_hysteresis": 2,
        "consecutive_hysteresis": False,
        field: bad,
    }
    if field in ("scale_factor", "min_scale", "cur_scale") and bad == 2**62:
        scaler_from_state(saved)  # a large number, but a float: Megatron's arithmetic runs on
        return
    with pytest.raises(ValueError, match=field):
        scaler_from_state(saved)


def test_a_huge_whole_scale_window_never_grows_the_scale_as_inf_does():
    from fp16kit.legacy.megatron.loss_scaler import scaler_from_state

    saved = {"cur_scale": 4.0, "cur_iter": 5, "last_overflow_iter": -1, "scale_factor": 2.0, "scale_window": 10**400}
    scaler = scaler_from_state(saved)
    for _ in range(3):
        scaler.update_scale(False)
    assert scaler.cur_scale == 4.0
