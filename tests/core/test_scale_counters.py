"""The two small pieces LossScale delegates to: the skip counter and the floor watch."""

from __future__ import annotations

import logging
import random

import pytest
import torch

from fp16kit.core.floor import FloorWatch, LaggedReader
from fp16kit.core.skip_counter import SkipCounter


# ---------------------------------------------------------------- SkipCounter
def test_skip_counter_counts_in_total_and_in_a_row():
    c = SkipCounter("cpu")
    assert c.last_found_inf() is None and (c.skipped(), c.consecutive()) == (0, 0)
    for flag in [1.0, 0.0, 2.0, float("inf"), 1.0]:  # any nonzero value is an overflow
        c.record(torch.tensor(flag))
    assert (c.skipped(), c.consecutive()) == (4, 3)
    assert c.last_found_inf().dtype == torch.bool and bool(c.last_found_inf())
    c.record(torch.tensor(0.0))
    assert (c.skipped(), c.consecutive()) == (4, 0) and not bool(c.last_found_inf())


def test_skip_counter_starts_from_the_given_counts():
    c = SkipCounter("cpu", skipped=10, consecutive=2)
    c.record(torch.tensor(1.0))
    assert (c.skipped(), c.consecutive()) == (11, 3)


@pytest.mark.parametrize("read_every", [0, 1, 5, SkipCounter.HISTORY])
def test_skip_counter_folds_at_any_rhythm(read_every):
    rng = random.Random(read_every)
    flags = [rng.random() < 0.4 for _ in range(3 * SkipCounter.HISTORY + 7)] + [True] * (SkipCounter.HISTORY + 3)
    c = SkipCounter("cpu")
    skipped = consecutive = 0
    for i, flag in enumerate(flags):
        c.record(torch.tensor(float(flag)))
        skipped += flag
        consecutive = consecutive + 1 if flag else 0
        if read_every and i % read_every == 0:
            assert (c.skipped(), c.consecutive()) == (skipped, consecutive)
    assert (c.skipped(), c.consecutive()) == (skipped, consecutive)


def test_last_found_inf_is_a_new_tensor():
    c = SkipCounter("cpu")
    c.record(torch.tensor(1.0))
    last = c.last_found_inf()
    c.record(torch.tensor(0.0))
    assert bool(last) and not bool(c.last_found_inf())


# ---------------------------------------------------------------- FloorWatch
def at_floor(watch: FloorWatch, backed_off: bool, scale: float, min_scale: float = 1.0) -> None:
    watch.count(torch.tensor(backed_off), torch.tensor(scale, dtype=torch.float64), min_scale)


def test_floor_watch_counts_back_offs_that_start_at_the_floor():
    watch = FloorWatch("cpu")
    at_floor(watch, True, 2.0)  # backs off onto the floor: not a hit
    at_floor(watch, False, 1.0)  # at the floor, no back-off: not a hit
    watch.report("raise", 1.0)
    at_floor(watch, True, 1.0)
    with pytest.raises(FloatingPointError, match=r"overflowed 1 more time\(s\).*min_scale=1\)"):
        watch.report("raise", 1.0)
    watch.report("raise", 1.0)  # each hit is reported once


def test_floor_watch_policies(caplog):
    watch = FloorWatch("cpu")
    at_floor(watch, True, 0.5, min_scale=0.5)
    watch.report("ignore", 0.5)  # ignoring does not consume the report
    with caplog.at_level(logging.WARNING, logger="fp16kit"):
        at_floor(watch, True, 0.5, min_scale=0.5)
        watch.report("warn", 0.5)
    msgs = [r.getMessage() for r in caplog.records if r.name == "fp16kit"]
    assert len(msgs) == 1 and "2 more time(s)" in msgs[0] and "min_scale=0.5" in msgs[0]


def test_lagged_reader_returns_the_newest_landed_copy():
    reader = LaggedReader()
    assert reader.poll() is None
    t = torch.tensor(3)
    reader.push(t)
    t.add_(4)  # the copy was taken at push time
    reader.push(t)
    assert reader.poll() == 7 and reader.poll() is None
    for i in range(LaggedReader._MAX_PENDING + 5):  # bounded: old copies are dropped
        reader.push(torch.tensor(i))
    assert len(reader._pending) == LaggedReader._MAX_PENDING
    assert reader.poll() == LaggedReader._MAX_PENDING + 4


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_floor_watch_on_cuda_never_syncs():
    watch = FloorWatch("cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            watch.count(
                torch.ones((), dtype=torch.bool, device="cuda"), torch.ones((), dtype=torch.float64, device="cuda"), 1.0
            )
            watch.report("ignore", 1.0)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    with pytest.raises(FloatingPointError, match="3 more time"):
        watch.report("raise", 1.0)
