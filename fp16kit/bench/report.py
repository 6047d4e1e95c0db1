"""A :class:`~fp16kit.bench.BenchResult` as text: the markdown report, or JSON with the same figures.

The markdown: header lines (the machine, the threads, the load -- with a warning when it
exceeds the cores -- the settings, the bandwidth the bounds come from), then the table of
ratios (row, shape, variant, anchor, median, spread, B/param), then the counted syncs, then the
memory table (bytes per param held and at the step's peak, with the stated anchors after the
measured rows and their sources as footnotes), then the rows skipped and how each figure was
obtained. The JSON (``--json``) holds the same, each ratio with its per-round values, each
memory figure in bytes and in B/param (``memory``; the anchors in ``memory_stated``).
"""

from __future__ import annotations

import json
from typing import Any

from . import BenchResult
from .machine import load_warning, oversubscribed_note
from .memory import PARTS, STATED, MemoryFigure
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


_MEMORY_COLUMNS = ("params", "grads", "opt state", "masters", "master grads", "other")

_MEMORY_METHOD = """\
memory: bytes per param (B/param), counted on the last of {steps} AdamW steps, not timed (the machine's
load does not change them). held after step:
every byte the run allocated and still holds when step() returns, the grads still attached; its parts are
distinct storages (params, their grads, the torch optimizer's state -- exp_avg, exp_avg_sq, step --,
masters, master grads) and other = held - those parts: what a library keeps beyond them (spare master
grads kept between steps, a flat grad buffer no master points to, a scaler's small tensors). after
zero_grad: held after zero_grad(set_to_none=True) (FP16_Optimizer: set_grads_to_None=True), what stays
into the next forward. peak in step: the most held from the end of the backward to the end of the step
(unscale or check, master grads, the optimizer step, the copy into the model, scaler.update()).
temporaries: peak - max(held at the step's start, held at its end) (issue 20's target: <= 1 B/param).
Activations are not counted. Measured with: {methods}. The fused kernel's rows: fp16kit's one-pass C
kernel (no allocation of its own); "torch ops": MixedPrecisionOptimizer's torch-op path, in the same
process, by a subclass of AdamW the kernel declines. master_device='cpu' on a CPU run is the model's
own device (the bytes of the row without it); on CUDA, host = the bytes kept on the CPU, not in the GPU's
figures. stated rows are other systems' figures from the sources below, not measured."""


def _b(nbytes: int, numel: int) -> str:
    return f"{nbytes / numel:.2f}"


def memory_tables(figures: list[MemoryFigure]) -> list[str]:
    from .memory import STEPS

    lines: list[str] = []
    head = " | ".join(_MEMORY_COLUMNS)
    groups: dict[tuple[str, str], list[MemoryFigure]] = {}
    for f in figures:
        groups.setdefault((f.device, f.shape), []).append(f)
    for (device, shape), group in groups.items():
        cuda = device == "cuda"
        lines += [
            f"## memory ({device}): training-state bytes per param, AdamW, {shape}",
            "",
            f"| variant | {head} | held after step | after zero_grad | peak in step | temporaries |"
            + (" host |" if cuda else ""),
            "|---|" + "---:|" * (len(_MEMORY_COLUMNS) + 4 + cuda),
        ]
        for f in group:
            n = f.numel
            cells = " | ".join(_b(f.parts[p], n) for p in PARTS)
            note = f" ({f.note})" if f.note else ""
            lines.append(
                f"| {f.variant}{note} | {cells} | {_b(f.held_after_step, n)} | {_b(f.after_zero_grad, n)} "
                f"| {_b(f.peak, n)} | {_b(f.temporaries, n)} |" + (f" {_b(f.host_bytes, n)} |" if cuda else "")
            )
        sources: dict[str, int] = {}
        for s in STATED:
            mark = sources.setdefault(s.source, len(sources) + 1)
            cells = " | ".join(s.parts.get(p, "-") for p in PARTS)
            lines.append(
                f"| stated [{mark}]: {s.variant} | {cells} | {s.held} | - | - | - |" + (" - |" if cuda else "")
            )
        lines.append("")
        lines += [f"[{i}] {source}." for source, i in sources.items()]
        lines.append("")
    methods = "; ".join(sorted({f.method for f in figures}))
    lines.append(_MEMORY_METHOD.format(steps=STEPS, methods=methods))
    return lines


def to_markdown(result: BenchResult) -> str:
    from .rows import SYNC_STEPS

    out = ["# fp16kit bench", "", *header_lines(result), ""]
    if result.figures:
        out += [*figures_table(result.figures), ""]
    if result.counts:
        out += ["## host syncs, ops and Python calls per step", "", *counts_table(result.counts), ""]
    if result.memory:
        out += [*memory_tables(result.memory), ""]
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
        "memory": [m.as_dict() for m in result.memory],
        "memory_stated": [s.as_dict() for s in STATED] if result.memory else [],
        "skipped": result.skipped,
    }
    return json.dumps(data, indent=1)
