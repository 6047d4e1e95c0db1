"""`fp16kit bench` (fp16kit.cli.bench over fp16kit.bench): options, rows, --json; figures never asserted."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from fp16kit.bench import ROWS
from fp16kit.cli import main

pytestmark = pytest.mark.usefixtures("amp_state_restored")  # (tests/conftest.py)


def _check_figures(data):
    for f in data["figures"]:
        assert all(math.isfinite(r) and r > 0 for r in f["ratios"]), f
        assert len(f["ratios"]) >= 7 and f["min"] <= f["median"] <= f["max"], f
    for c in data["counts"]:
        assert c["host_syncs_per_step"] >= 0 and c["aten_ops_per_step"] > 0, c


def test_only_runs_the_rows_named(capsys):
    assert main(["bench", "--quick", "--only", "scaler", "--json", "--threads", "1"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {f["row"] for f in data["figures"]} == {"scaler"}
    assert [f["variant"] for f in data["figures"]] == ["fp16kit.GradScaler"] * 2
    assert {f["anchor"] for f in data["figures"]} == {"torch.amp.GradScaler"}
    assert data["counts"] == [] and data["skipped"] == []
    assert data["settings"]["rows"] == ["scaler"] and data["machine"]["torch_threads"] == 1
    _check_figures(data)


def test_markdown_names_the_machine_and_the_threads(capsys):
    assert main(["bench", "--quick", "--only", "scaler", "--threads", "1"]) == 0
    captured = capsys.readouterr()
    assert "torch.set_num_threads(1)" in captured.out
    assert "load average" in captured.out
    assert "| scaler |" in captured.out
    assert "fp16kit bench: scaler [cpu]" in captured.err  # progress on stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the skip without CUDA")
def test_cuda_rows_are_skipped_without_cuda(capsys):
    assert main(["bench", "--quick", "--device", "cuda", "--only", "step,scaler", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["figures"] == [] and data["counts"] == []
    assert data["skipped"] == [
        {"row": "step", "device": "cuda", "reason": "no CUDA device"},
        {"row": "scaler", "device": "cuda", "reason": "no CUDA device"},
    ]
    assert main(["bench", "--quick", "--device", "cuda", "--only", "syncs"]) == 0
    assert "skipped: syncs on cuda (no CUDA device)" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--rounds", "3"], "must be >= 7"),
        (["--only", "nope"], "unknown row nope"),
        (["--device", "tpu"], "devices are cpu and cuda"),
        (["--threads", "0"], "must be >= 1"),
    ],
)
def test_bad_options_exit_2(args, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", *args])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_quick_json_emits_every_row():
    # the whole --quick run in a fresh process, as a user runs it
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "fp16kit", "bench", "--quick", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    rows = {f["row"] for f in data["figures"]} | {c["row"] for c in data["counts"]} | {m["row"] for m in data["memory"]}
    assert rows == set(ROWS)
    _check_figures(data)
    variants = {(f["row"], f["variant"]) for f in data["figures"]}
    for variant in ("MixedPrecisionOptimizer", "MixedPrecisionOptimizer (flat)", "FP16_Optimizer.update_master_grads"):
        assert ("master-grads", variant) in variants
    for variant in ("MixedPrecisionOptimizer + GradScaler", "FP16_Optimizer", "amp O2", "hand loop (torch only)"):
        assert ("step", variant) in variants
    assert all(f["bytes_per_param"] > 0 for f in data["figures"] if f["row"] in ("master-grads", "step"))
    assert len([f for f in data["figures"] if f["row"] == "async"]) == 3
    assert data["memory"] and all(m["held_after_step_bytes"] > 0 for m in data["memory"])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_rows_run_on_a_gpu(capsys):
    assert main(["bench", "--quick", "--device", "cuda", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["skipped"] == [] and "gpu" in data["machine"]
    rows = {f["row"] for f in data["figures"]} | {c["row"] for c in data["counts"]} | {m["row"] for m in data["memory"]}
    assert rows == set(ROWS)
    assert {f["device"] for f in data["figures"]} == {m["device"] for m in data["memory"]} == {"cuda"}
    assert data["bandwidth_bytes_per_s"]["cuda"] > 0
    _check_figures(data)
