"""Megatron-LM v1's scalers: every scale, counter and Python type against a hand-written copy of
docs/apex-others.md §2.3's pseudo-code, through random overflow storms; the saved forms."""

from __future__ import annotations

import copy
import pickle
import random

import pytest
import torch

from _helpers.megatron_reference import MegatronScaler
from fp16kit.legacy.megatron import DynamicLossScaler, LossScaler, scaler_from_state

INF, OK = True, False


class Reference(MegatronScaler):
    """Megatron's DynamicLossScaler.update_scale, transcribed (tests/_helpers), and what it shows."""

    def observed(self):
        return (self.cur_scale, type(self.cur_scale), self.cur_iter, self.last_overflow_iter, self.cur_hysteresis)


def observed(s: DynamicLossScaler):
    return (s.cur_scale, type(s.cur_scale), s.cur_iter, s.last_overflow_iter, s.cur_hysteresis)


def storm(rng: random.Random, n: int) -> list[bool]:
    out: list[bool] = []
    while len(out) < n:
        out += [INF] * rng.randint(1, 5) + [OK] * rng.choice([0, 1, 2, 3, 8, 20])
    return out[:n]


@pytest.mark.parametrize("consecutive", [False, True])
@pytest.mark.parametrize("min_scale", [1, 1.0, 4, 0.25])
@pytest.mark.parametrize("seed", range(4))
def test_random_storms_match_the_pseudo_code(consecutive, min_scale, seed):
    rng = random.Random(seed)
    kwargs = dict(
        init_scale=rng.choice([2**32, 2**10, 1024.0, 48]),
        scale_window=rng.choice([1, 2, 5, 7.0]),
        min_scale=min_scale,
        delayed_shift=rng.randint(1, 4),
        consecutive_hysteresis=consecutive,
        scale_factor=rng.choice([2.0, 2, 3.0]),
    )
    ours, ref = DynamicLossScaler(**kwargs), Reference(**kwargs)
    for overflow in storm(rng, 300):
        ours.update_scale(overflow)
        ref.update_scale(overflow)
        assert observed(ours) == ref.observed(), (kwargs, overflow)
        assert ours.loss_scale == ref.cur_scale


def test_megatron_defaults_absorb_the_first_overflow():
    # Megatron passes scale_window=1000., min_scale=1., delayed_shift=2: overflows at 0, 1, 2
    s = DynamicLossScaler(scale_window=1000.0, min_scale=1.0, delayed_shift=2)
    scales = []
    for _ in range(3):
        scales.append(s.cur_scale)
        s.update_scale(INF)
    assert scales == [2**32, 2**32, 2**31]
    assert s.cur_scale == 2**30 and s.cur_hysteresis == 1
    for _ in range(999):
        s.update_scale(OK)
    assert s.cur_scale == 2**30 and s.cur_hysteresis == 1  # re-armed only by the growth
    s.update_scale(OK)  # the 1000th clean iteration since the last overflow
    assert s.cur_scale == 2**31 and s.cur_hysteresis == 2


def test_types_at_an_int_floor_as_the_spec_example():
    s = DynamicLossScaler(init_scale=8, min_scale=2)
    seen = []
    for _ in range(4):
        s.update_scale(INF)
        seen.append(s.cur_scale)
    assert seen == [4.0, 2.0, 2, 2] and [type(v) for v in seen] == [float, float, int, int]
    f = DynamicLossScaler(init_scale=8, min_scale=2.0)
    for _ in range(3):
        f.update_scale(INF)
    assert f.cur_scale == 2.0 and type(f.cur_scale) is float


def test_an_absorbed_overflow_keeps_the_int_scale():
    s = DynamicLossScaler(delayed_shift=3)
    s.update_scale(INF)
    s.update_scale(INF)
    assert s.cur_scale == 2**32 and type(s.cur_scale) is int and s.cur_hysteresis == 1


def test_defaults_and_attributes():
    s = DynamicLossScaler()
    assert (s.cur_scale, s.cur_iter, s.last_overflow_iter, s.scale_factor, s.scale_window) == (2**32, 0, -1, 2.0, 1000)
    assert (s.min_scale, s.delayed_shift, s.cur_hysteresis, s.consecutive_hysteresis) == (1, 1, 1, False)


def test_settings_assigned_later_take_effect():
    s, ref = DynamicLossScaler(init_scale=64.0), Reference(init_scale=64.0)
    for obj in (s, ref):
        obj.delayed_shift = 2
        obj.cur_hysteresis = 2
        obj.min_scale = 16
        obj.consecutive_hysteresis = True
        obj.scale_window = 3
    for overflow in [INF, OK, INF, INF, INF, INF, OK, OK, OK, OK, INF]:
        s.update_scale(overflow)
        ref.update_scale(overflow)
        assert observed(s) == ref.observed()


def test_bad_settings_name_the_fix():
    with pytest.raises(ValueError, match="scale_window must be a whole number"):
        DynamicLossScaler(scale_window=0.5)
    with pytest.raises(ValueError, match="delayed_shift must be an int >= 1"):
        DynamicLossScaler(delayed_shift=0)
    with pytest.raises(ValueError, match="min_scale must be a finite number >= 0"):
        DynamicLossScaler(min_scale=-1)
    s = DynamicLossScaler()
    with pytest.raises(ValueError, match="cur_hysteresis must be an int >= 1"):
        s.cur_hysteresis = 0
    assert s.cur_hysteresis == 1


@pytest.mark.parametrize("factor", [1, 0.5, 0.0, float("nan")], ids=repr)
def test_a_scale_factor_that_never_backs_off_is_refused(factor):
    # Megatron divided by it at an overflow: 1 keeps an overflowing scale, 0.5 doubles it, so
    # every later step is skipped (0: ZeroDivisionError); torch's GradScaler also wants > 1
    with pytest.raises(ValueError, match=rf"scale_factor must be a finite number > 1 .*got {factor!r}\."):
        DynamicLossScaler(scale_factor=factor)
    s = DynamicLossScaler(scale_factor=4.0)
    with pytest.raises(ValueError, match="scale_factor must be a finite number > 1"):
        s.scale_factor = factor
    assert s.scale_factor == 4.0


def test_has_overflow_checks_elements():
    p = torch.nn.Parameter(torch.zeros(2))
    q = torch.nn.Parameter(torch.zeros(3))
    s = DynamicLossScaler()
    assert s.has_overflow([p, q]) is False  # no grads
    p.grad = torch.tensor([3e38, 3e38])  # Megatron's sum called this an overflow (FIX)
    q.grad = torch.ones(3)
    assert s.has_overflow([p, q]) is False
    q.grad[1] = float("nan")
    assert s.has_overflow([p, q]) is True
    assert DynamicLossScaler._has_inf_or_nan(torch.tensor([float("inf")])) is True
    assert s._has_inf_or_nan(torch.ones(2)) is False
    assert LossScaler(4).has_overflow([q]) is False


@pytest.mark.parametrize("cls", [LossScaler, DynamicLossScaler])
def test_backward_scales_or_passes_pipeline_grads(cls):
    scaler = cls(8) if cls is LossScaler else cls(init_scale=8)
    w = torch.ones(3, requires_grad=True)
    scaler.backward((w * 2).sum())
    assert torch.equal(w.grad, torch.full((3,), 16.0))
    w.grad = None
    out = w * 2
    scaler.backward(out, output_tensor_grad=torch.tensor([1.0, 2.0, 3.0]))  # not scaled again
    assert torch.equal(w.grad, torch.tensor([2.0, 4.0, 6.0]))
    assert scaler.scale_gradient(None, (torch.ones(2), None), ())[0].tolist() == [8.0, 8.0]


def test_state_dict_is_plain_and_round_trips(tmp_path):
    s = DynamicLossScaler(init_scale=2**20, scale_window=4.0, min_scale=2, delayed_shift=3, consecutive_hysteresis=True)
    for o in [INF, OK, INF, INF, INF, OK, OK, OK, OK, INF]:
        s.update_scale(o)
    torch.save({"s": s.state_dict()}, tmp_path / "s.pt")
    loaded = torch.load(tmp_path / "s.pt", weights_only=True)["s"]
    again = scaler_from_state(loaded)
    assert again.state_dict() == s.state_dict() and type(again.cur_scale) is type(s.cur_scale)
    clone = pickle.loads(pickle.dumps(s))
    assert clone.state_dict() == s.state_dict()
    deep = copy.deepcopy(s)
    for o in [INF, OK, OK, OK, OK, OK]:
        s.update_scale(o)
        deep.update_scale(o)
        clone.update_scale(o)
    assert deep.state_dict() == s.state_dict() == clone.state_dict()


@pytest.mark.parametrize("path", ["megatron.fp16.loss_scaler.DynamicLossScaler", "fp16.loss_scaler.DynamicLossScaler"])
def test_old_pickles_default_the_missing_attributes(path):
    # a 2019 scaler pickled only apex era 1's attributes: the rest are 1, 1, 1, True
    old = {
        "__apex_class__": path,
        "cur_scale": 1024.0,
        "cur_iter": 10,
        "last_overflow_iter": 7,
        "scale_factor": 2.0,
        "scale_window": 4,
    }
    s = scaler_from_state(old)
    assert isinstance(s, DynamicLossScaler)
    assert (s.min_scale, s.delayed_shift, s.cur_hysteresis, s.consecutive_hysteresis) == (1, 1, 1, True)
    ref = Reference(init_scale=1024.0, scale_window=4, consecutive_hysteresis=True)
    ref.cur_iter, ref.last_overflow_iter = 10, 7
    for o in [OK, INF, OK, OK, OK, OK]:
        s.update_scale(o)
        ref.update_scale(o)
        assert observed(s) == ref.observed()


def test_full_megatron_record_and_static_forms():
    full = {
        "__apex_class__": "megatron.fp16.loss_scaler.DynamicLossScaler",
        "cur_scale": 2**31,
        "cur_iter": 5,
        "last_overflow_iter": 2,
        "scale_factor": 2.0,
        "scale_window": 1000.0,
        "min_scale": 1.0,
        "delayed_shift": 2,
        "cur_hysteresis": 1,
        "consecutive_hysteresis": False,
    }
    s = scaler_from_state(full)
    assert s.state_dict() == {k: v for k, v in full.items() if k != "__apex_class__"}
    static = scaler_from_state({"__apex_class__": "fp16.loss_scaler.LossScaler", "cur_scale": 128})
    assert type(static) is LossScaler and static.loss_scale == 128
    assert type(scaler_from_state({"cur_scale": 4.0})) is LossScaler
    for bad in ({"__apex_class__": "apex.amp.scaler.LossScaler", "_loss_scale": 1.0}, {"cur_iter": 1}, [1.0], 3.0):
        with pytest.raises(ValueError):
            scaler_from_state(bad)


def test_an_infinite_window_never_grows_and_a_nan_one_is_refused(tmp_path):
    """Megatron's (cur_iter - last_overflow_iter) % inf is never 0: the scale never grows
    (fp16kit raised OverflowError 'cannot convert float infinity to integer')."""
    s = DynamicLossScaler(init_scale=2**10, scale_window=float("inf"), delayed_shift=2)
    for overflow in [False] * 5 + [True, True] + [False] * 5:
        s.update_scale(overflow)
    assert s.cur_scale == 512.0 and s.scale_window == float("inf")
    path = tmp_path / "s.pt"
    torch.save(s.state_dict(), path)
    again = scaler_from_state(torch.load(path, weights_only=True))
    again.update_scale(False)
    assert again.cur_scale == 512.0 and again.scale_window == float("inf")
    with pytest.raises(ValueError, match="scale_window must be a whole number"):
        DynamicLossScaler(scale_window=float("nan"))
