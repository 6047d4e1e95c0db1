"""LossScale(consecutive_hysteresis=True): any clean step re-arms the hysteresis (Megatron-LM's
and DeepSpeed's ``consecutive_hysteresis``), against the rules' pseudo-code written out here by
hand; the default (False, re-armed only by a growth) unchanged."""

from __future__ import annotations

import pickle
import random

import pytest
import torch

from fp16kit.core.scale import LossScale
from fp16kit.core.scale_rules import ApexRule, FixedSettings

INF, OK = True, False


def apex_reference(scale, window, factor, hysteresis, min_scale, consecutive, overflows):
    """ScaleRule's pseudo-code with the apex rule's hooks, in Python floats."""
    tracker, hyst, out = 0, hysteresis, []
    for overflow in overflows:
        if overflow:
            hyst = max(hyst - 1, 0)
            if hyst == 0:
                scale = max(scale / factor, min_scale)
            tracker = 0
            grow = False
        else:
            tracker += 1
            grow = tracker % window == 0
            if grow:
                scale = scale * factor
        if grow or (consecutive and not overflow):
            hyst = hysteresis
        out.append((scale, tracker, hyst))
    return out


def torch_reference(scale, window, hysteresis, consecutive, overflows):
    """The torch rule (backoff 0.5, growth 2, min_scale 1 so the generic path runs)."""
    tracker, hyst, out = 0, hysteresis, []
    for overflow in overflows:
        if overflow:
            hyst = max(hyst - 1, 0)
            if hyst == 0:
                scale = max(scale * 0.5, 1.0)
            tracker = 0
            grow = False
        else:
            tracker += 1
            grow = tracker == window
            if grow:
                tracker = 0
                scale = scale * 2.0
        if grow or (consecutive and not overflow):
            hyst = hysteresis
        out.append((scale, tracker, hyst))
    return out


def run(ls: LossScale, overflows):
    ls.materialize("cpu")
    out = []
    for o in overflows:
        ls.update(torch.tensor(1.0 if o else 0.0))
        out.append((ls.get_scale(), ls.get_growth_tracker(), ls.get_hysteresis_tracker()))
    return out


def storm(rng: random.Random, n: int) -> list[bool]:
    # bursts of overflows between clean runs, so both re-arm paths are exercised
    out: list[bool] = []
    while len(out) < n:
        out += [INF] * rng.randint(1, 4) + [OK] * rng.randint(0, 7)
    return out[:n]


@pytest.mark.parametrize("consecutive", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_apex_rule_with_hysteresis_follows_the_pseudo_code(consecutive, seed):
    rng = random.Random(seed)
    hysteresis, window, min_scale = rng.randint(1, 4), rng.randint(1, 5), rng.choice([1.0, 4.0, 0.5])
    seq = storm(rng, 200)
    ls = LossScale(
        2.0**20,
        rule="apex",
        growth_interval=window,
        hysteresis=hysteresis,
        consecutive_hysteresis=consecutive,
        min_scale=min_scale,
        dtype=torch.float64,
    )
    assert run(ls, seq) == apex_reference(2.0**20, window, 2.0, hysteresis, min_scale, consecutive, seq)


@pytest.mark.parametrize("consecutive", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_torch_rule_with_hysteresis_follows_the_pseudo_code(consecutive, seed):
    rng = random.Random(100 + seed)
    hysteresis, window = rng.randint(1, 4), rng.randint(1, 5)
    seq = storm(rng, 150)
    ls = LossScale(
        2.0**16,
        growth_interval=window,
        hysteresis=hysteresis,
        consecutive_hysteresis=consecutive,
        min_scale=1.0,
    )
    assert run(ls, seq) == torch_reference(2.0**16, window, hysteresis, consecutive, seq)


def test_the_two_modes_differ_where_a_clean_step_separates_overflows():
    # hysteresis 2, no growth in between: only the consecutive mode absorbs the second overflow
    seq = [INF, OK, INF, OK, INF]
    plain = LossScale(64.0, rule="apex", growth_interval=100, hysteresis=2, dtype=torch.float64)
    consecutive = LossScale(
        64.0, rule="apex", growth_interval=100, hysteresis=2, consecutive_hysteresis=True, dtype=torch.float64
    )
    assert [s for s, _, _ in run(plain, seq)] == [64.0, 64.0, 32.0, 32.0, 16.0]
    assert [s for s, _, _ in run(consecutive, seq)] == [64.0, 64.0, 64.0, 64.0, 64.0]


def test_rule_step_reads_the_setting():
    state = LossScale(8.0, rule="apex", hysteresis=3, dtype=torch.float64, device="cpu")
    state.set_hysteresis_tracker(1)
    clean = torch.tensor(False)
    off = ApexRule().step(state, clean, FixedSettings(growth_interval=100, hysteresis=3))
    on = ApexRule().step(state, clean, FixedSettings(growth_interval=100, hysteresis=3, consecutive_hysteresis=True))
    assert int(off.hysteresis_tracker) == 1 and int(on.hysteresis_tracker) == 3


def test_state_dict_round_trip_and_older_dicts_load():
    ls = LossScale(32.0, rule="apex", hysteresis=3, consecutive_hysteresis=True, device="cpu")
    run(ls, [INF, OK, INF])
    sd = ls.state_dict()
    assert sd["consecutive_hysteresis"] is True
    other = LossScale(rule="apex", device="cpu")
    other.load_state_dict(sd)
    assert other.state_dict() == sd
    older = {k: v for k, v in sd.items() if k != "consecutive_hysteresis"}  # saved before the key
    other.load_state_dict(older)
    assert other.consecutive_hysteresis is False


def test_bad_setting_raises_before_anything_changes():
    with pytest.raises(ValueError, match="consecutive_hysteresis must be True"):
        LossScale(consecutive_hysteresis=1)  # type: ignore[arg-type]
    ls = LossScale(8.0, device="cpu")
    before = ls.state_dict()
    with pytest.raises(ValueError, match="consecutive_hysteresis must be True"):
        ls.load_state_dict({**before, "consecutive_hysteresis": "yes"})
    assert ls.state_dict() == before


def test_pickle_keeps_the_setting_and_old_pickles_default_to_false():
    ls = LossScale(8.0, hysteresis=2, consecutive_hysteresis=True, device="cpu")
    assert pickle.loads(pickle.dumps(ls)).consecutive_hysteresis is True
    state = ls.__getstate__()
    del state["consecutive_hysteresis"]  # what a LossScale pickled before the setting holds
    old = LossScale.__new__(LossScale)
    old.__setstate__(state)
    assert old.consecutive_hysteresis is False
    assert "consecutive_hysteresis=True" in repr(ls) and "consecutive" not in repr(old)
