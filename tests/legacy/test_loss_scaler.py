"""apex's era-1 LossScaler / DynamicLossScaler: names, attributes and exact scale sequences."""

from __future__ import annotations

import pickle
import random

import pytest
import torch

from fp16kit.legacy import DynamicLossScaler, LossScaler, to_python_float


def spec_update(state, overflow):
    """docs/apex-fp16-optimizer.md's pseudo-code, in Python floats."""
    if overflow:
        state["cur_scale"] = max(state["cur_scale"] / state["scale_factor"], 1)
        state["last_overflow_iter"] = state["cur_iter"]
    elif (state["cur_iter"] - state["last_overflow_iter"]) % state["scale_window"] == 0:
        state["cur_scale"] *= state["scale_factor"]
    state["cur_iter"] += 1


def test_defaults():
    s = DynamicLossScaler()
    assert s.cur_scale == 2**32 and s.loss_scale == 2**32
    assert (s.cur_iter, s.last_overflow_iter, s.scale_factor, s.scale_window) == (0, -1, 2.0, 1000)


def test_sequence_by_hand():
    s = DynamicLossScaler(init_scale=8, scale_factor=2.0, scale_window=3)
    seen = []
    for o in [False, False, False, True, False, False, False, True, True, True, True]:
        s.update_scale(o)
        seen.append((s.cur_scale, s.cur_iter, s.last_overflow_iter))
    assert seen == [
        (8, 1, -1),
        (8, 2, -1),
        (16, 3, -1),
        (8, 4, 3),
        (8, 5, 3),
        (8, 6, 3),
        (16, 7, 3),
        (8, 8, 7),
        (4, 9, 8),
        (2, 10, 9),
        (1, 11, 10),
    ]
    s.update_scale(True)
    assert s.cur_scale == 1  # floor 1


@pytest.mark.parametrize("seed", range(4))
def test_random_sequences_equal_the_spec_in_python_floats(seed):
    rng = random.Random(seed)
    factor = rng.choice([2.0, 3.0, 1.5])
    window = rng.randint(1, 5)
    s = DynamicLossScaler(init_scale=2**32, scale_factor=factor, scale_window=window)
    ref = {"cur_scale": 2**32, "cur_iter": 0, "last_overflow_iter": -1, "scale_factor": factor, "scale_window": window}
    for _ in range(300):
        o = rng.random() < 0.35
        s.update_scale(o)
        spec_update(ref, o)
        assert s.cur_scale == ref["cur_scale"]  # bit for bit: float64 state
        assert (s.cur_iter, s.last_overflow_iter) == (ref["cur_iter"], ref["last_overflow_iter"])


def test_attributes_are_writable():
    s = DynamicLossScaler(init_scale=16, scale_window=4)
    s.cur_scale = 1024
    s.scale_window = 2
    s.update_scale(False)  # (0 - -1) % 2 != 0
    s.update_scale(False)  # (1 - -1) % 2 == 0: grow
    assert s.cur_scale == 2048
    s.last_overflow_iter = 1
    assert s.last_overflow_iter == 1
    s.update_scale(False)  # (2 - 1) % 2 != 0
    s.update_scale(False)  # (3 - 1) % 2 == 0
    assert s.cur_scale == 4096


def test_has_overflow_checks_elements():
    s = DynamicLossScaler()
    p = torch.zeros(3, requires_grad=True)
    q = torch.zeros(2, requires_grad=True)
    assert s.has_overflow([p, q]) is False  # no grads at all
    p.grad = torch.tensor([3e38, 3e38, 1.0])  # finite; apex's per-tensor sum called this overflow
    assert s.has_overflow([p, q]) is False
    q.grad = torch.tensor([1.0, float("nan")])
    assert s.has_overflow([p, q]) is True
    assert torch.equal(p.grad, torch.tensor([3e38, 3e38, 1.0]))  # untouched


def test_has_inf_or_nan_on_class_and_instance():
    t = torch.tensor([1.0, float("inf")], dtype=torch.float16)
    assert DynamicLossScaler._has_inf_or_nan(t) is True
    assert DynamicLossScaler()._has_inf_or_nan(torch.ones(2)) is False
    assert LossScaler._has_inf_or_nan(t) is False


def test_backward_and_scale_gradient():
    for scaler in (LossScaler(4), DynamicLossScaler(init_scale=4)):
        w = torch.ones(2, requires_grad=True)
        scaler.backward((w * 3).sum())
        assert torch.equal(w.grad, torch.full((2,), 12.0))
        assert scaler.scale_gradient(None, (torch.ones(1), None), ()) == (torch.full((1,), 4.0), None)


def test_static_scaler():
    s = LossScaler(128)
    assert s.loss_scale == 128 and s.cur_scale == 128
    assert s.has_overflow([]) is False
    s.update_scale(True)
    assert s.loss_scale == 128


def test_pickle_round_trip():
    s = DynamicLossScaler(init_scale=64, scale_window=3)
    for o in [False, True, False]:
        s.update_scale(o)
    t = pickle.loads(pickle.dumps(s))
    assert (t.cur_scale, t.cur_iter, t.last_overflow_iter, t.scale_factor, t.scale_window) == (
        s.cur_scale,
        s.cur_iter,
        s.last_overflow_iter,
        s.scale_factor,
        s.scale_window,
    )
    for o in [False, False, False, True]:
        s.update_scale(o)
        t.update_scale(o)
        assert s.cur_scale == t.cur_scale


def test_to_python_float():
    assert to_python_float(torch.tensor(2.5)) == 2.5
    assert to_python_float(3) == 3.0 and isinstance(to_python_float(3), float)
    assert to_python_float(1.5) == 1.5


def test_cur_iter_writes_keep_last_overflow_iter_as_apex():
    s = DynamicLossScaler(init_scale=16, scale_window=4)
    s.last_overflow_iter = 5
    s.cur_iter = 10
    assert (s.cur_iter, s.last_overflow_iter) == (10, 5)
    ref = {"cur_scale": 16, "cur_iter": 10, "last_overflow_iter": 5, "scale_factor": 2.0, "scale_window": 4}
    for o in [False, False, True, False, False, False, False]:
        s.update_scale(o)
        spec_update(ref, o)
        assert (s.cur_scale, s.cur_iter, s.last_overflow_iter) == (
            ref["cur_scale"],
            ref["cur_iter"],
            ref["last_overflow_iter"],
        )


def test_cur_scale_keeps_apexs_python_types():
    s = DynamicLossScaler()
    assert type(s.cur_scale) is int and s.cur_scale == 4294967296
    s.update_scale(False)  # (0 - -1) % 1000 != 0: unchanged
    assert type(s.cur_scale) is int
    s.update_scale(True)
    assert type(s.cur_scale) is float and s.cur_scale == 2147483648.0
    small = DynamicLossScaler(init_scale=1.5, scale_window=1000)
    small.update_scale(True)  # max(0.75, 1) -> the int 1
    assert type(small.cur_scale) is int and small.cur_scale == 1
    exact = DynamicLossScaler(init_scale=2.0)
    exact.update_scale(True)  # max(1.0, 1) -> 1.0, the float
    assert type(exact.cur_scale) is float
    ref = {"cur_scale": 2**32, "cur_iter": 0, "last_overflow_iter": -1, "scale_factor": 2.0, "scale_window": 3}
    t = DynamicLossScaler(scale_window=3)
    for o in [False, False, False, True, True] + [False] * 6:
        t.update_scale(o)
        spec_update(ref, o)
        assert type(t.cur_scale) is type(ref["cur_scale"]) and t.cur_scale == ref["cur_scale"]


NAN, INF = float("nan"), float("inf")
# (constructor, keyword, value, message): what apex's classes took and then trained into NaN (a
# scale of 0, NaN or inf), failed later with ZeroDivisionError (scale_window 0, scale_factor 0),
# or skipped every step once the scale overflowed (a factor <= 1 never backs off)
BAD_ARGS = [
    (LossScaler, "scale", 0, "scale must be a finite number > 0 (e.g. 128.0), got 0."),
    (LossScaler, "scale", NAN, "scale must be a finite number > 0 (e.g. 128.0), got nan."),
    (LossScaler, "scale", INF, "scale must be a finite number > 0 (e.g. 128.0), got inf."),
    (LossScaler, "scale", -8, "scale must be a finite number > 0 (e.g. 128.0), got -8."),
    (DynamicLossScaler, "init_scale", 0, "init_scale must be a finite number > 0 (e.g. 128.0), got 0."),
    (DynamicLossScaler, "init_scale", NAN, "init_scale must be a finite number > 0 (e.g. 128.0), got nan."),
    (DynamicLossScaler, "init_scale", INF, "init_scale must be a finite number > 0 (e.g. 128.0), got inf."),
    (DynamicLossScaler, "init_scale", -1.0, "init_scale must be a finite number > 0 (e.g. 128.0), got -1.0."),
    (
        DynamicLossScaler,
        "scale_factor",
        0,
        "scale_factor must be a finite number > 1 (the scale is divided by it at an overflow), got 0.",
    ),
    (
        DynamicLossScaler,
        "scale_factor",
        1,
        "scale_factor must be a finite number > 1 (the scale is divided by it at an overflow), got 1.",
    ),
    (
        DynamicLossScaler,
        "scale_factor",
        NAN,
        "scale_factor must be a finite number > 1 (the scale is divided by it at an overflow), got nan.",
    ),
    (
        DynamicLossScaler,
        "scale_window",
        0,
        "The apex rule grows the scale every `scale_window` clean steps (a "
        "modulo), so scale_window must be an int >= 1, got 0.",
    ),
]


@pytest.mark.parametrize(
    ("cls", "key", "value", "text"), BAD_ARGS, ids=[f"{c.__name__}-{k}={v!r}" for c, k, v, _ in BAD_ARGS]
)
def test_settings_that_cannot_train_are_refused_at_the_call(cls, key, value, text):
    with pytest.raises(ValueError) as info:
        cls(**{key: value})
    assert str(info.value) == text


def test_settings_apex_trained_with_are_accepted():
    assert LossScaler(1).loss_scale == 1 and LossScaler(128.0).loss_scale == 128.0 and LossScaler(2**-4).loss_scale
    s = DynamicLossScaler(init_scale=2**16, scale_factor=1.5, scale_window=1)
    s.update_scale(False)
    assert s.cur_scale == 2**16 * 1.5


@pytest.mark.parametrize(
    ("name", "value", "said"),
    [
        ("cur_scale", 0, "cur_scale must be a finite number > 0"),
        ("cur_scale", NAN, "cur_scale must be a finite"),
        ("scale_factor", 0.5, "scale_factor must be a finite number > 1"),
        ("scale_window", 0, "scale_window must be an int >= 1"),
    ],
)
def test_writing_a_setting_that_cannot_train_is_refused_and_changes_nothing(name, value, said):
    s = DynamicLossScaler(init_scale=16, scale_window=4)
    before = repr(s)
    with pytest.raises(ValueError, match=said):
        setattr(s, name, value)
    assert repr(s) == before
