"""fp16kit.bench.timing: the interleaved order and the statistics, fed fake timings (no real timing asserted)."""

from __future__ import annotations

import pytest

from fp16kit.bench.timing import Clock, Stats, iterations_for, ratio_stats, ratios, run_interleaved, schedule


def test_schedule_alternates_the_order_and_puts_the_warmup_first():
    plan = schedule(["A", "B", "C"], rounds=4, warmup=1)
    assert plan == [
        (False, ["A", "B", "C"]),
        (True, ["C", "B", "A"]),
        (True, ["A", "B", "C"]),
        (True, ["C", "B", "A"]),
        (True, ["A", "B", "C"]),
    ]


def test_schedule_without_warmup_starts_in_order():
    assert schedule(["A", "B"], rounds=2, warmup=0) == [(True, ["A", "B"]), (True, ["B", "A"])]


@pytest.mark.parametrize("rounds, warmup", [(0, 1), (3, -1)])
def test_schedule_refuses_bad_counts(rounds, warmup):
    with pytest.raises(ValueError):
        schedule(["A"], rounds, warmup)


def test_ratios_are_taken_round_by_round():
    assert ratios([2.0, 3.0, 8.0], [1.0, 3.0, 4.0]) == [2.0, 1.0, 2.0]
    with pytest.raises(ValueError):
        ratios([1.0], [1.0, 2.0])
    with pytest.raises(ValueError):
        ratios([1.0], [0.0])


def test_stats_median_and_spread():
    st = ratio_stats([1.0, 2.0, 3.0, 10.0, 5.0, 4.0, 6.0], [1.0] * 7)
    assert st.median == 4.0
    assert (st.lo, st.hi) == (1.0, 10.0)
    assert st.as_dict() == {"median": 4.0, "min": 1.0, "max": 10.0, "ratios": [1.0, 2.0, 3.0, 10.0, 5.0, 4.0, 6.0]}
    assert Stats((1.0, 3.0)).median == 2.0  # even count: the mean of the middle two


def test_iterations_for_clamps():
    assert iterations_for(0.01, 0.2) == 20
    assert iterations_for(1.0, 0.2) == 1
    assert iterations_for(1.0, 0.2, min_iters=8) == 8
    assert iterations_for(1e-9, 0.2, max_iters=50) == 50
    assert iterations_for(0.0, 0.2, max_iters=50) == 50


class Fake:
    """A variant whose iterations take ``seconds`` each (as reported, nothing sleeps); logs its calls."""

    def __init__(self, name, seconds, log):
        self.name, self.seconds, self.log = name, list(seconds), log

    def run(self, n):
        self.log.append((self.name, n))
        return n * (self.seconds.pop(0) if len(self.seconds) > 1 else self.seconds[0])


def test_run_interleaved_order_calibration_and_warmup():
    log = []
    # calibration: a warm run, then a measured one (0.05 s -> 4 iterations of a 0.2 s round)
    a = Fake("A", [9.0, 0.05, 100.0, 1.0, 2.0, 3.0], log)
    b = Fake("B", [9.0, 0.1, 100.0, 2.0, 2.0, 2.0], log)
    times = run_interleaved({"A": a, "B": b}, rounds=3, warmup=1, target_s=0.2)
    assert log == [
        ("A", 1), ("A", 1), ("B", 1), ("B", 1),  # calibration
        ("A", 4), ("B", 2),  # warm-up round: excluded
        ("B", 2), ("A", 4),
        ("A", 4), ("B", 2),
        ("B", 2), ("A", 4),
    ]  # fmt: skip
    # seconds per iteration of the measured rounds, in round order
    assert times == {"A": [1.0, 2.0, 3.0], "B": [2.0, 2.0, 2.0]}
    assert ratio_stats(times["A"], times["B"]).ratios == (0.5, 1.0, 1.5)


def test_run_interleaved_fixed_iterations_skip_calibration():
    log = []
    a = Fake("A", [1.0], log)
    run_interleaved({"A": a}, rounds=1, warmup=0, iters={"A": 3})
    assert log == [("A", 3)]


def test_clock_leaves_paused_work_out(monkeypatch):
    from fp16kit.bench import timing

    now = iter([0.0, 1.0, 11.0, 12.5, 20.0, 21.0])  # host clock readings, one per start/stop
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(now))
    clock = Clock("cpu")
    with clock:  # 0.0
        with clock.paused():  # stop 1.0, start 11.0
            pass
    # stop 12.5
    with clock:  # 20.0 .. 21.0
        pass
    assert clock.seconds() == 1.0 + 1.5 + 1.0
    assert Clock("cpu").seconds() == 0.0
