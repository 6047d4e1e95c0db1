"""The interleaved runner and its statistics: every figure is a ratio of two variants timed in the same rounds.

::

    schedule(names, rounds, warmup)   # warm-up rounds first, excluded; then the measured ones
        round r runs every variant once, in the order  names        when r is even
                                                       names[::-1]  when r is odd
        (A B C, C B A, A B C, ...: drift on a shared machine and a variant's effect on the
        caches of the one after it hit every variant alike)
    run_interleaved(variants, ...)    # -> {name: [seconds per iteration, one per measured round]}
        before the rounds: each variant runs once (warm) and its iterations per round are chosen so
        that a round of it lasts about ``target_s`` (at least ``min_iters``)
    ratio_stats(times, anchor)        # -> Stats: the per-round ratios times[r] / anchor[r],
                                      #    their median and their spread (min, max)

A variant is anything with ``run(n) -> seconds`` (n iterations; it keeps its own clock, so a
variant can leave setup -- the fake backward of :mod:`fp16kit.bench.loops` -- out of the time).
:class:`Clock` is that clock: host time on the CPU, CUDA events on a CUDA device (their elapsed
time is the stream's: launch-bound work counts as long as the host takes to launch it), and with
``wall=True`` host time between two device-wide synchronizes (for work on several streams or
threads).

Nothing here asserts a timing; tests feed fake timings to the pure functions.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

__all__ = [
    "Clock",
    "Stats",
    "Timed",
    "iterations_for",
    "ratio_stats",
    "ratios",
    "run_interleaved",
    "schedule",
]


class Timed(Protocol):
    """A variant: runs ``n`` iterations and returns the seconds they took (its own clock)."""

    def run(self, n: int) -> float: ...


def schedule(names: Sequence[str], rounds: int, warmup: int = 1) -> list[tuple[bool, list[str]]]:
    """The order of every round: ``(measured, names in the order they run)``; warm-up rounds come first.

    Round ``r`` (warm-up rounds counted) runs ``names`` in order when ``r`` is even and reversed when it is odd."""
    if rounds < 1 or warmup < 0:
        raise ValueError(f"need rounds >= 1 and warmup >= 0, got rounds={rounds}, warmup={warmup}")
    out = []
    for r in range(warmup + rounds):
        order = list(names) if r % 2 == 0 else list(reversed(names))
        out.append((r >= warmup, order))
    return out


def iterations_for(seconds_per_iteration: float, target_s: float, min_iters: int = 1, max_iters: int = 10_000) -> int:
    """How many iterations make a round of about ``target_s`` seconds (clamped to ``[min_iters, max_iters]``)."""
    if not seconds_per_iteration > 0 or not math.isfinite(seconds_per_iteration):
        return max_iters
    return max(min_iters, min(max_iters, round(target_s / seconds_per_iteration)))


def run_interleaved(
    variants: Mapping[str, Timed],
    *,
    rounds: int,
    warmup: int = 1,
    target_s: float = 0.2,
    min_iters: int = 1,
    iters: Mapping[str, int] | None = None,
) -> dict[str, list[float]]:
    """Time every variant in interleaved rounds (see :func:`schedule`); seconds per iteration per measured round.

    ``iters`` fixes a variant's iterations per round; the others are calibrated from one warm run."""
    counts = dict(iters or {})
    for name, variant in variants.items():
        if name not in counts:
            variant.run(1)  # warm: first-touch allocations, lazy initialization
            counts[name] = iterations_for(variant.run(1), target_s, min_iters)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for measured, order in schedule(list(variants), rounds, warmup):
        for name in order:
            seconds = variants[name].run(counts[name]) / counts[name]
            if measured:
                times[name].append(seconds)
    return times


@dataclass(frozen=True)
class Stats:
    """The per-round ratios of a variant to its anchor, their median and spread."""

    ratios: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.ratios)

    @property
    def lo(self) -> float:
        return min(self.ratios)

    @property
    def hi(self) -> float:
        return max(self.ratios)

    def as_dict(self) -> dict[str, Any]:
        return {"median": self.median, "min": self.lo, "max": self.hi, "ratios": list(self.ratios)}


def ratios(times: Sequence[float], anchor: Sequence[float]) -> list[float]:
    """``times[r] / anchor[r]`` for every round ``r`` (both measured in the same rounds)."""
    if len(times) != len(anchor) or not times:
        raise ValueError(f"need the same number of rounds (>= 1) for both, got {len(times)} and {len(anchor)}")
    if any(not a > 0 for a in anchor):
        raise ValueError(f"an anchor time is not positive: {list(anchor)}")
    return [t / a for t, a in zip(times, anchor)]


def ratio_stats(times: Sequence[float], anchor: Sequence[float]) -> Stats:
    """The :class:`Stats` of ``times`` over ``anchor``, round by round."""
    return Stats(tuple(ratios(times, anchor)))


class Clock:
    """Accumulates the time spent inside ``with clock:`` blocks, except inside ``with clock.paused():``.

    CPU: ``time.perf_counter``. CUDA: events on the current stream, read once in :meth:`seconds`
    (no synchronize per iteration). ``wall=True``: host time, the device synchronized at the
    start and end of each block (work on other streams and threads counted)."""

    def __init__(self, device: torch.device | str = "cpu", *, wall: bool = False) -> None:
        self.device = torch.device(device)
        self.events = self.device.type == "cuda" and not wall
        self.sync = self.device.type == "cuda" and wall
        self._host = 0.0
        self._start = 0.0
        self._pairs: list[tuple[Any, Any]] = []

    def _begin(self) -> None:
        if self.events:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            self._pairs.append((start, None))
        else:
            if self.sync:
                torch.cuda.synchronize(self.device)
            self._start = time.perf_counter()

    def _end(self) -> None:
        if self.events:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._pairs[-1] = (self._pairs[-1][0], end)
        else:
            if self.sync:
                torch.cuda.synchronize(self.device)
            self._host += time.perf_counter() - self._start

    def __enter__(self) -> Clock:
        self._begin()
        return self

    def __exit__(self, *exc: object) -> None:
        self._end()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Leave the block's work out of the time (setup inside a timed iteration)."""
        self._end()
        try:
            yield
        finally:
            self._begin()

    def seconds(self) -> float:
        """The time accumulated so far (on CUDA: synchronizes once to read the events)."""
        if not self._pairs:
            return self._host
        torch.cuda.synchronize(self.device)
        return self._host + sum(s.elapsed_time(e) for s, e in self._pairs) / 1000.0
