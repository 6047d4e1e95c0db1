"""A growth interval of 2**31 or more (how "never grow" is spelled: sys.maxsize, a huge
``--loss-scale-window``) must never grow the scale within int32 counts. Compared with an int32
tracker it wrapped around (sys.maxsize read as -1, 2**32 + 1 as 1) and the scale grew at every
clean step on the generic path (hysteresis, bounds, float64, apex rules), while torch's own
kernel (the fused path) never grew it."""

from __future__ import annotations

import sys

import pytest
import torch

from fp16kit.core.scale import LossScale
from fp16kit.legacy.megatron import DynamicLossScaler

HUGE = [2**31, 2**32 + 1, 2**40, sys.maxsize]
FLAGS = [False, False, True, False, False, False, True, True, False]


def torch_kernel_scales(interval):
    """torch's own GradScaler update, the reference for the torch rule."""
    scale, tracker = torch.tensor(1024.0), torch.zeros((), dtype=torch.int32)
    out = []
    for f in FLAGS:
        torch._amp_update_scale_(scale, tracker, torch.tensor(float(f)), 2.0, 0.5, interval)
        out.append((scale.item(), int(tracker)))
    return out


@pytest.mark.parametrize("interval", HUGE)
@pytest.mark.parametrize("extra", [{"hysteresis": 1, "dtype": torch.float64}, {"min_scale": 1.0}])
def test_torch_rule_generic_path_matches_torchs_kernel(interval, extra):
    ls = LossScale(1024.0, rule="torch", growth_interval=interval, device="cpu", **extra)
    got = []
    for f in FLAGS:
        ls.update(f)
        got.append((ls.get_scale(), ls.get_growth_tracker()))
    assert got == torch_kernel_scales(interval)


@pytest.mark.parametrize("interval", HUGE)
@pytest.mark.parametrize("rule", ["apex", "apex_amp"])
def test_apex_rules_do_not_grow(interval, rule):
    ls = LossScale(1024.0, rule=rule, growth_interval=interval, hysteresis=2, max_scale=float("inf"), device="cpu")
    scales = []
    for f in FLAGS:
        ls.update(f)
        scales.append(ls.get_scale())
    # hysteresis 2: the overflow at 2 is absorbed, the one at 6 backs off (re-armed only by a
    # growth, which never comes), the one at 7 too
    assert scales == [1024.0] * 6 + [512.0, 256.0, 256.0]


def test_megatrons_scaler_with_a_huge_window():
    """Megatron's pseudo-code: (cur_iter - last_overflow_iter) % scale_window == 0 never holds."""
    s = DynamicLossScaler(init_scale=1024.0, scale_window=sys.maxsize)
    for f in FLAGS:
        s.update_scale(f)
    assert s.cur_scale == 128.0 and s.cur_iter == len(FLAGS) and s.last_overflow_iter == 7
