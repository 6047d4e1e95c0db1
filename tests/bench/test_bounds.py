"""fp16kit.bench.bounds: the bound's time per round from the copy's (fake timings)."""

from __future__ import annotations

import pytest

from fp16kit.bench.bounds import MASTER_GRAD_BYTES, MASTER_STEP_BYTES, Memcpy, bound_times


def test_the_bounds_are_design_rule_9s():
    assert (MASTER_GRAD_BYTES, MASTER_STEP_BYTES) == (6, 28)


def test_bound_times_scale_the_copy_rate_to_the_bytes_of_the_row():
    # a copy moving 1000 bytes in 1 s (then 2 s): 6 B/param x 500 params = 3000 bytes -> 3 s (6 s)
    assert bound_times([1.0, 2.0], moved=1000, bytes_per_param=6, params=500) == [3.0, 6.0]


def test_memcpy_moves_twice_its_buffer_and_copies():
    probe = Memcpy(4096)
    assert probe.nbytes == 4096 and probe.moved == 8192
    assert probe.run(2) >= 0.0
    assert bool((probe.dst == 1).all())
    assert probe.bandwidth(2.0) == pytest.approx(4096.0)
