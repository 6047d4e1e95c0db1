"""A :class:`~fp16kit.bench.BenchResult` as text: the markdown report, or JSON with the same figures.

The markdown: header lines (the machine, the threads, the load -- with a warning when it
exceeds the cores -- the settings, the bandwidth the bounds come from), then the table of
ratios (row, shape, variant, anchor, median, spread, B/param), then the counted syncs, then the
rows skipped and how each figure was obtained. The JSON (``--json``) holds the same, each
ratio with its per-round values.
"""

from __future__ import annotations

import json
from typing import Any

from . import BenchResult
from .machine import load_warning, oversubscribed_note
from .rows import Count, Figure

__all__ = ["to_json", "to_markdown"]

_METHOD = """\
How to read it: each ratio is the variant's time per iteration over the anchor's, measured in the
same rounds (variants interleaved, the order reversed every other round, warm-up excluded): below
1.0 the variant is faster. Spread: the lowest and highest per-round ratio. A bound anchor is the
time to move that many bytes per param at the rate of a large copy_ measured in the same rounds.
B/param: bytes read + written per param in one iteration, counted from the aten ops it runs (their
schemas; caches and allocation not counted). master-grads and step time zero_grad(set_to_none=True)
and the path/step; the grads are attached by a fake backward that is not timed. syncs: counted over
{steps} iterations, per iteration; host reads on the main thread only."""


def _load(load: Any) -> str:
    return "n/a" if load is None else " ".join(f"{x:.2f}" for x in load)


def header_lines(result: BenchResult) -> list[str]:
    m = result.machine
    s = result.settings
    lines = [
        f"- machine: {m['cpu']}, {m['cores']} cores; torch {m['torch']}, Python {m['python']}",
        f"- torch.set_num_threads({m['torch_threads']}); asynchronous steps split the threads between the main "
        "thread and the optimizer thread",
        f"- load average (1, 5, 15 min; uptime): {_load(m.get('load_before'))} before, "
        f"{_load(m.get('load_after'))} after",
    ]
    if "gpu" in m:
        lines.append(f"- GPU: {m['gpu']}, CUDA {m.get('cuda')}")
    lines.append(
        f"- {s['rounds']} rounds + {s['warmup_rounds']} warm-up{' (--quick sizes)' if s['quick'] else ''}; "
        f"rows: {', '.join(s['rows'])}; devices: {', '.join(s['devices'])}"
    )
    for device, bw in result.bandwidth.items():
        lines.append(f"- {device} copy_ bandwidth (the bounds' rate, median round): {bw / 1e9:.1f} GB/s")
    warning = load_warning(m.get("load_before"), m["cores"])
    if warning:
        lines.append(f"- **{warning}**")
    note = oversubscribed_note(m.get("load_before"), m["cores"], m["torch_threads"])
    if note:
        lines.append(f"- {note}")
    return lines


def _bpp(value: float | None) -> str:
    return "" if value is None else f"{value:.1f}"


def figures_table(figures: list[Figure]) -> list[str]:
    lines = [
        "| row | shape | variant | anchor | median | spread | B/param |",
        "|---|---|---|---|---:|---:|---:|",
    ]
    for f in figures:
        st = f.stats
        row = f.row if f.device == "cpu" else f"{f.row} ({f.device})"
        lines.append(
            f"| {row} | {f.shape} | {f.variant} | {f.anchor} | {st.median:.2f}x | {st.lo:.2f}-{st.hi:.2f} "
            f"| {_bpp(f.bytes_per_param)} |"
        )
    return lines


def counts_table(counts: list[Count]) -> list[str]:
    lines = [
        "| shape | variant | host syncs / step | aten ops / step | Python calls / step |",
        "|---|---|---:|---:|---:|",
    ]
    for c in counts:
        shape = c.shape if c.device == "cpu" else f"{c.shape} ({c.device})"
        lines.append(f"| {shape} | {c.variant} | {c.host_syncs:g} | {c.ops:g} | {c.python_calls:g} |")
    methods = sorted({c.method for c in counts})
    lines.append("")
    lines.append(f"host syncs counted as: {'; '.join(methods)}. Python calls: function calls outside fp16kit.bench.")
    return lines


def to_markdown(result: BenchResult) -> str:
    from .rows import SYNC_STEPS

    out = ["# fp16kit bench", "", *header_lines(result), ""]
    if result.figures:
        out += [*figures_table(result.figures), ""]
    if result.counts:
        out += ["## host syncs, ops and Python calls per step", "", *counts_table(result.counts), ""]
    for s in result.skipped:
        out.append(f"- skipped: {s['row']} on {s['device']} ({s['reason']})")
    if result.skipped:
        out.append("")
    out.append(_METHOD.format(steps=SYNC_STEPS))
    return "\n".join(out) + "\n"


def to_json(result: BenchResult) -> str:
    m = result.machine
    data = {
        "machine": m,
        "settings": result.settings,
        "load_warning": load_warning(m.get("load_before"), m["cores"]),
        "load_note": oversubscribed_note(m.get("load_before"), m["cores"], m["torch_threads"]),
        "bandwidth_bytes_per_s": result.bandwidth,
        "figures": [f.as_dict() for f in result.figures],
        "counts": [c.as_dict() for c in result.counts],
        "skipped": result.skipped,
    }
    return json.dumps(data, indent=1)
