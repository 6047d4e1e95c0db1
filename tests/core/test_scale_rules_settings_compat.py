"""A rule driven by a settings object written before ``consecutive_hysteresis`` existed (any
object with the other ScaleSettings attributes) behaves as before: hysteresis re-armed only by
a growth. Checked against the rules' pseudo-code, transcribed here."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from fp16kit.core.scale import ScaleState
from fp16kit.core.scale_rules import rule_named


def reference(rule, k, scale, growth, hyst, overflow):
    """scale_rules.ScaleRule's pseudo-code (no used_scale), per rule, with consecutive=False."""
    if overflow:
        hyst = max(hyst - 1, 0)
    backing_off = overflow and hyst == 0
    if backing_off:
        backed = scale * k.backoff_factor if rule == "torch" else scale / k.growth_factor
        if k.min_scale is not None:
            backed = max(backed, k.min_scale)
        scale = backed
    counted = 0 if overflow else growth + 1
    if rule == "torch":
        grow = not overflow and counted == k.growth_interval
    elif rule == "apex":
        grow = not overflow and counted % k.growth_interval == 0
    else:
        grow = counted == k.growth_interval
    if grow:
        scale = scale * k.growth_factor
        hyst = k.hysteresis
    growth = counted if rule == "apex" or not grow else 0
    return scale, growth, hyst


@pytest.mark.parametrize("rule", ["torch", "apex", "apex_amp"])
@pytest.mark.parametrize("seed", [0, 1])
def test_settings_without_the_attribute_follow_the_old_rule(rule, seed):
    k = SimpleNamespace(
        growth_factor=2.0,
        backoff_factor=0.5,
        growth_interval=3,
        hysteresis=3,
        min_scale=1.0,
        max_scale=None,
        dtype=torch.float64,
    )
    assert not hasattr(k, "consecutive_hysteresis")
    state = ScaleState(
        scale=torch.tensor(2.0**10, dtype=torch.float64),
        growth_tracker=torch.tensor(0, dtype=torch.int32),
        hysteresis_tracker=torch.tensor(3, dtype=torch.int32),
    )
    expected = (2.0**10, 0, 3)
    rnd = random.Random(seed)
    # overflows separated by single clean steps: where consecutive_hysteresis=True would differ
    flags = [rnd.random() < 0.5 for _ in range(60)]
    for overflow in flags:
        step = rule_named(rule).step(state, torch.tensor(overflow), k)
        state.scale, state.growth_tracker, state.hysteresis_tracker = (
            step.scale,
            step.growth_tracker,
            step.hysteresis_tracker,
        )
        expected = reference(rule, k, *expected, overflow)
        assert (step.scale.item(), step.growth_tracker.item(), step.hysteresis_tracker.item()) == expected


def test_fixed_settings_positional_arguments_keep_their_meaning():
    """FixedSettings(growth_factor, backoff_factor, growth_interval, hysteresis, min_scale,
    max_scale, dtype), as written before consecutive_hysteresis existed: inserted in the middle,
    the new field took min_scale's value (1.0: truthy, so the hysteresis re-armed at every
    clean step) and dtype landed in max_scale."""
    from fp16kit.core.scale_rules import FixedSettings

    k = FixedSettings(2.0, 0.5, 3, 3, 1.0, 2.0**20, torch.float64)
    assert (k.min_scale, k.max_scale, k.dtype, k.consecutive_hysteresis) == (1.0, 2.0**20, torch.float64, False)
    state = ScaleState(
        scale=torch.tensor(2.0**10, dtype=torch.float64),
        growth_tracker=torch.tensor(0, dtype=torch.int32),
        hysteresis_tracker=torch.tensor(3, dtype=torch.int32),
    )
    expected = (2.0**10, 0, 3)
    for overflow in [True, False, True, False, True, True, False]:
        step = rule_named("apex").step(state, torch.tensor(overflow), k)
        state.scale, state.growth_tracker, state.hysteresis_tracker = (
            step.scale,
            step.growth_tracker,
            step.hysteresis_tracker,
        )
        expected = reference("apex", k, *expected, overflow)
        assert (step.scale.item(), step.growth_tracker.item(), step.hysteresis_tracker.item()) == expected
