"""``fp16kit bench``: every master-weight path measured against what a user would write instead.

The method, the same for every timed figure::

    variants of one row run in the same process, interleaved: A B C, C B A, A B C, ...
    >= 7 measured rounds after a warm-up round (excluded); a round of a variant lasts ~0.25 s
    (--quick: ~0.03 s), its iterations chosen from one warm run
    figure = the variant's time / the anchor's time, round by round; reported: the median of
    the per-round ratios and their spread (min-max)
    anchors: the loop a user writes with torch alone (:mod:`fp16kit.bench.loops`), torch's own
    GradScaler or fused AdamW, the synchronous step, and the memory-bandwidth bound measured in
    the run by a large copy (:mod:`fp16kit.bench.bounds`)
    torch.set_num_threads(threads) for the whole run, stated; the load average before and after

The modules, one job each: ``timing`` (the interleaved runner, its statistics, the clock),
``bounds`` (the memcpy probe, bytes per param), ``shapes`` (param lists, MLPs), ``loops`` (the
anchors and fp16kit's variants on a param list), ``training`` (the loops with a model),
``trace`` (bytes, ops, host reads, Python calls, counted), ``memory`` (bytes per param held and at
the step's peak, counted), ``machine`` (the header), ``rows``
(which variants against which anchors), ``report`` (markdown and JSON). Benchmarks, not tests:
no figure here is asserted anywhere.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from . import machine
from .memory import MemoryFigure
from .rows import ROWS, Context, Count, Skipped

__all__ = ["ROWS", "BenchResult", "run_bench"]

MIN_ROUNDS = 7


@dataclass
class BenchResult:
    """What a run measured: the machine, the settings, the figures, the counts, the rows skipped."""

    machine: dict[str, Any]
    settings: dict[str, Any]
    figures: list[Any] = field(default_factory=list)
    counts: list[Any] = field(default_factory=list)
    skipped: list[dict[str, str]] = field(default_factory=list)
    memory: list[MemoryFigure] = field(default_factory=list)
    bandwidth: dict[str, float] = field(default_factory=dict)  # device -> bytes/s, the median copy


def run_bench(
    *,
    rows: Sequence[str] | None = None,
    devices: Sequence[str] = ("cpu",),
    rounds: int = MIN_ROUNDS,
    warmup: int = 1,
    quick: bool = False,
    threads: int | None = None,
    progress: Callable[[str], None] = lambda _msg: None,
) -> BenchResult:
    """Run the rows (default: all of :data:`ROWS`) on each device; CUDA rows are skipped without CUDA.

    ``threads``: ``torch.set_num_threads`` for the run (default: torch's current setting), restored after."""
    names = list(rows or ROWS)
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        raise ValueError(f"unknown rows {unknown}: choose from {list(ROWS)}")
    if rounds < MIN_ROUNDS:
        raise ValueError(f"rounds must be >= {MIN_ROUNDS} (the house rule), got {rounds}")
    before = torch.get_num_threads()
    threads = threads or before
    settings = {"rows": names, "devices": list(devices), "rounds": rounds, "warmup_rounds": warmup, "quick": quick}
    result = BenchResult(machine.describe(threads, list(devices)), settings)
    torch.set_num_threads(threads)
    try:
        for device in devices:
            if device == "cuda" and not torch.cuda.is_available():
                result.skipped += [{"row": n, "device": "cuda", "reason": "no CUDA device"} for n in names]
                continue
            ctx = Context(torch.device(device), rounds, warmup, quick, threads, progress)
            for name in names:
                for entry in ROWS[name](ctx):
                    if isinstance(entry, Skipped):
                        result.skipped.append(entry.as_dict())
                    elif isinstance(entry, MemoryFigure):
                        result.memory.append(entry)
                    else:
                        (result.counts if isinstance(entry, Count) else result.figures).append(entry)
            if ctx.copy_seconds:
                copy = sorted(ctx.copy_seconds)[len(ctx.copy_seconds) // 2]
                result.bandwidth[device] = ctx.memcpy().bandwidth(copy)
    finally:
        torch.set_num_threads(before)
    result.machine["load_after"] = machine.load_average()
    return result
