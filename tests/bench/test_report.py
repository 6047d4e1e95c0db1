"""fp16kit.bench.report: the markdown and the JSON of a result (a made-up one: nothing is timed here)."""

from __future__ import annotations

import json

from fp16kit.bench import BenchResult
from fp16kit.bench.report import to_json, to_markdown
from fp16kit.bench.rows import Count, Figure


def _result(load=(0.5, 0.4, 0.3)):
    machine = {"cpu": "Some CPU", "cores": 2, "torch": "2.x", "python": "3.x", "torch_threads": 2, "load_before": load}
    machine["load_after"] = (1.0, 0.5, 0.3)
    settings = {"rows": ["step", "syncs"], "devices": ["cpu", "cuda"], "rounds": 7, "warmup_rounds": 1, "quick": True}
    result = BenchResult(machine, settings, bandwidth={"cpu": 12.5e9})
    result.figures.append(Figure("step", "cpu", "4 x 1M", "amp O2", "hand loop (torch only)", (1.0, 1.2, 0.9), 48.0))
    result.counts.append(Count("syncs", "cpu", "MLP", "FP16_Optimizer", 1.0, 63.0, 267.0, "counted so"))
    result.skipped.append({"row": "step", "device": "cuda", "reason": "no CUDA device"})
    return result


def test_markdown_has_the_machine_the_table_and_the_skips():
    text = to_markdown(_result())
    assert "Some CPU, 2 cores; torch 2.x" in text
    assert "torch.set_num_threads(2)" in text
    assert "0.50 0.40 0.30 before" in text
    assert "12.5 GB/s" in text
    assert "| step | 4 x 1M | amp O2 | hand loop (torch only) | 1.00x | 0.90-1.20 | 48.0 |" in text
    assert "| MLP | FP16_Optimizer | 1 | 63 | 267 |" in text
    assert "skipped: step on cuda (no CUDA device)" in text
    assert "WARNING" not in text and "NOTE" not in text


def test_markdown_warns_when_the_load_exceeds_the_cores():
    assert "WARNING: the 1-minute load average (2.50) exceeds the 2 cores" in to_markdown(_result((2.5, 1, 1)))
    assert "NOTE: the load (1.00) plus this run's 2 threads exceed the 2 cores" in to_markdown(_result((1.0, 1, 1)))


def test_json_holds_the_same_figures():
    data = json.loads(to_json(_result((3.0, 1, 1))))
    (fig,) = data["figures"]
    assert fig["kind"] == "ratio" and fig["median"] == 1.0 and (fig["min"], fig["max"]) == (0.9, 1.2)
    assert fig["ratios"] == [1.0, 1.2, 0.9] and fig["bytes_per_param"] == 48.0
    (count,) = data["counts"]
    assert count["kind"] == "count" and count["host_syncs_per_step"] == 1.0
    assert data["skipped"] == [{"row": "step", "device": "cuda", "reason": "no CUDA device"}]
    assert data["machine"]["cpu"] == "Some CPU" and data["load_warning"].startswith("WARNING")
