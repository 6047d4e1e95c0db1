"""The rule objects on their own: each rule's sequence worked out by hand from its docstring's
pseudo-code, its defaults, and the fused path."""

from __future__ import annotations

import pytest
import torch

from fp16kit.core.scale import ScaleState
from fp16kit.core.scale_rules import (
    RULES,
    ApexAmpRule,
    ApexRule,
    FixedSettings,
    ScaleRule,
    TorchRule,
    rule_named,
)

INF, OK = True, False


def walk(
    rule: ScaleRule, settings: FixedSettings, scale: float, overflows: list[bool]
) -> tuple[list[float], list[int]]:
    """Drive ``rule.step`` as LossScale does (results rounded to the settings' dtype)."""
    state = ScaleState(
        scale=torch.tensor(scale, dtype=settings.dtype),
        growth_tracker=torch.zeros((), dtype=torch.int32),
        hysteresis_tracker=torch.full((), settings.hysteresis, dtype=torch.int32),
    )
    scales, trackers = [], []
    for o in overflows:
        step = rule.step(state, torch.tensor(o), settings)
        assert step.growth_tracker.dtype == torch.int32 and step.hysteresis_tracker.dtype == torch.int32
        state = ScaleState(step.scale.to(settings.dtype), step.growth_tracker, step.hysteresis_tracker)
        scales.append(float(state.scale))
        trackers.append(int(state.growth_tracker))
    return scales, trackers


# ---------------------------------------------------------------- the sequences
def test_torch_rule_by_hand():
    k = FixedSettings(growth_factor=2.0, backoff_factor=0.5, growth_interval=2)
    scales, trackers = walk(TorchRule(), k, 8.0, [OK, OK, INF, OK, INF, OK, OK])
    assert scales == [8, 16, 8, 8, 4, 4, 8]
    assert trackers == [1, 0, 0, 1, 0, 1, 0]


def test_torch_rule_refuses_growth_to_inf_in_float32_only():
    k = FixedSettings(growth_interval=1)
    assert walk(TorchRule(), k, 2.0**127, [OK]) == ([2.0**127], [0])
    k64 = FixedSettings(growth_interval=1, dtype=torch.float64)
    assert walk(TorchRule(), k64, 2.0**127, [OK]) == ([2.0**128], [0])


def test_apex_rule_by_hand():
    # modulo growth; tracker == cur_iter - last_overflow_iter - 1, never reset by growth
    k = FixedSettings(growth_factor=2.0, growth_interval=3, min_scale=1.0)
    scales, trackers = walk(ApexRule(), k, 8.0, [OK, OK, OK, INF, OK, OK, OK, OK, OK, OK])
    assert scales == [8, 8, 16, 8, 8, 8, 16, 16, 16, 32]
    assert trackers == [1, 2, 3, 0, 1, 2, 3, 4, 5, 6]


def test_apex_rules_back_off_by_dividing_by_the_growth_factor():
    k = FixedSettings(growth_factor=4.0, backoff_factor=0.5, growth_interval=100)
    assert walk(ApexRule(), k, 64.0, [INF])[0] == [16]
    assert walk(ApexAmpRule(), k, 64.0, [INF])[0] == [16]
    assert walk(TorchRule(), k, 64.0, [INF])[0] == [32]


def test_apex_amp_rule_by_hand():
    k = FixedSettings(growth_interval=2, max_scale=2.0**24)
    scales, trackers = walk(ApexAmpRule(), k, 2.0**16, [OK, OK, INF, OK, OK])
    assert scales == [65536, 131072, 65536, 65536, 131072]
    assert trackers == [1, 0, 0, 1, 0]


def test_apex_amp_rule_checks_growth_after_an_overflow_too():
    k = FixedSettings(growth_interval=0, max_scale=2.0**24)
    assert walk(ApexAmpRule(), k, 64.0, [INF]) == ([64], [0])  # halved, then doubled back


def test_hysteresis_and_bounds_are_shared_by_every_rule():
    for rule in (TorchRule(), ApexRule(), ApexAmpRule()):
        k = FixedSettings(growth_interval=100, hysteresis=2, min_scale=2.0)
        # the first overflow is tolerated, the next ones back off down to the floor
        assert walk(rule, k, 8.0, [INF, INF, INF, INF])[0] == [8, 4, 2, 2], rule
        k = FixedSettings(growth_interval=1, max_scale=20.0)
        assert walk(rule, k, 8.0, [OK, OK])[0] == [16, 20], rule


def test_step_reports_the_back_off_and_the_scale_it_started_from():
    k = FixedSettings(growth_interval=100, hysteresis=2)
    state = ScaleState(torch.tensor(8.0), torch.zeros((), dtype=torch.int32), torch.tensor(2, dtype=torch.int32))
    step = TorchRule().step(state, torch.tensor(True), k)
    assert not bool(step.backed_off) and int(step.hysteresis_tracker) == 1  # tolerated
    state = ScaleState(state.scale, step.growth_tracker, step.hysteresis_tracker)
    step = TorchRule().step(state, torch.tensor(True), k)
    assert bool(step.backed_off) and float(step.scale) == 4.0
    assert step.scale_before.dtype == torch.float64 and float(step.scale_before) == 8.0
    assert float(state.scale) == 8.0  # step() writes nothing back


def test_used_scale_never_backs_one_scale_off_twice():
    k = FixedSettings(growth_interval=100)
    state = ScaleState(torch.tensor(8.0), torch.zeros((), dtype=torch.int32), torch.ones((), dtype=torch.int32))
    found = torch.tensor(True)
    # the overflowing loss used 32, already backed off to 8 since: 8 stays
    lagged = TorchRule().step(state, found, k, used_scale=torch.tensor(32.0, dtype=torch.float64))
    assert float(lagged.scale) == 8.0
    # it used 8, the current scale: the plain rule
    current = TorchRule().step(state, found, k, used_scale=torch.tensor(8.0, dtype=torch.float64))
    assert float(current.scale) == float(TorchRule().step(state, found, k).scale) == 4.0


# ---------------------------------------------------------------- defaults, checks, lookup
def test_each_rule_decides_its_default_bounds():
    assert TorchRule().bounds(None, None) == (None, None)
    assert ApexRule().bounds(None, None) == (1.0, None)  # apex's floor of 1
    assert ApexRule().bounds(0.5, 8.0) == (0.5, 8.0)
    assert ApexAmpRule().bounds(None, None) == (None, 2.0**24)
    assert ApexAmpRule().bounds(0, float("inf")) == (None, float("inf"))  # 0: no floor


def test_each_rule_decides_whether_the_initial_scale_is_clamped():
    assert TorchRule().initial_scale(2.0**30, 1.0, 2.0**24) == 2.0**24
    assert TorchRule().initial_scale(0.5, 1.0, None) == 1.0
    assert ApexAmpRule().initial_scale(2.0**30, None, 2.0**24) == 2.0**24
    assert ApexRule().initial_scale(0.25, 1.0, None) == 0.25  # apex's era-1 scaler: as told


def test_only_the_apex_rule_needs_a_window():
    with pytest.raises(ValueError, match="scale_window must be an int >= 1"):
        ApexRule().check(0)
    ApexRule().check(1)
    TorchRule().check(0)
    ApexAmpRule().check(0)


def test_rule_named():
    assert RULES == ("torch", "apex", "apex_amp")
    assert [type(rule_named(n)) for n in RULES] == [TorchRule, ApexRule, ApexAmpRule]
    for bad in ("jmp", ["torch"], None):
        with pytest.raises(ValueError, match="rule must be one of"):
            rule_named(bad)  # type: ignore[arg-type]


# ---------------------------------------------------------------- the fused path
def test_torch_rule_fuses_only_without_extras():
    assert TorchRule().fuses(FixedSettings())
    for extra in ({"hysteresis": 2}, {"min_scale": 1.0}, {"max_scale": 1e30}, {"dtype": torch.float64}):
        assert not TorchRule().fuses(FixedSettings(**extra)), extra


def test_update_fused_is_the_step_in_place():
    k = FixedSettings(growth_factor=3.0, backoff_factor=0.3, growth_interval=2)
    fused = ScaleState(torch.tensor(1000.0), torch.zeros((), dtype=torch.int32), torch.ones((), dtype=torch.int32))
    for o in [OK, INF, OK, OK, INF, INF, OK, OK, OK]:
        step = TorchRule().step(fused, torch.tensor(o), k)
        assert TorchRule().update_fused(fused, torch.tensor(float(o)), k)
        assert torch.equal(fused.scale, step.scale.float()) and torch.equal(fused.growth_tracker, step.growth_tracker)


def test_other_rules_have_no_fused_path():
    state = ScaleState(torch.tensor(8.0), torch.zeros((), dtype=torch.int32), torch.ones((), dtype=torch.int32))
    for rule in (ApexRule(), ApexAmpRule()):
        assert rule.update_fused(state, torch.tensor(1.0), FixedSettings(growth_interval=1)) is False
    assert TorchRule().update_fused(state, torch.tensor(1.0), FixedSettings(hysteresis=2)) is False
    assert float(state.scale) == 8.0
