"""benchmarks/gpu_check.sh, the prepared run for a lent GPU: what it runs, what it writes, what it exits with.

No GPU here, so a stand-in ``python3`` (``$PYTHON``) says CUDA is available and records each command it is
given; the script's own logic (the order, the time limits, the files, the exit status) is what is tested."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None, reason="needs bash")

FAKE = """#!{python}
import os, sys
with open(os.environ["FAKE_LOG"], "a") as log:
    log.write(" ".join(sys.argv[1:]) + "\\n")
if sys.argv[1] == "-m" and sys.argv[2] == "pytest":
    print("3 passed")
    sys.exit(int(os.environ.get("FAKE_PYTEST_RC", "0")))
if sys.argv[1] == "-m" and sys.argv[2] == "fp16kit":
    print("| row | figure |")
    print("fp16kit bench: progress", file=sys.stderr)
    sys.exit(int(os.environ.get("FAKE_BENCH_RC", "0")))
print("torch 2.x, CUDA 13, NVIDIA H200")  # the -c probes
sys.exit(int(os.environ.get("FAKE_CUDA_RC", "0")))
"""


def _run(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess[str], list[str], Path]:
    fake = tmp_path / "python3"
    fake.write_text(FAKE.format(python=sys.executable))
    fake.chmod(0o755)
    log = tmp_path / "calls.log"
    out = tmp_path / "out"
    full = {**os.environ, "PYTHON": str(fake), "OUT": str(out), "FAKE_LOG": str(log), **env}
    proc = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=full, capture_output=True, text=True, timeout=60)
    calls = log.read_text().splitlines() if log.exists() else []
    return proc, calls, out


def test_runs_the_cuda_tests_then_the_gpu_bench_and_keeps_their_output(tmp_path):
    proc, calls, out = _run(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    pytest_call = next(c for c in calls if c.startswith("-m pytest"))
    bench_call = next(c for c in calls if c.startswith("-m fp16kit bench"))
    assert calls.index(pytest_call) < calls.index(bench_call)
    assert "-m cuda" in pytest_call and "-rs" in pytest_call
    assert "--device cuda" in bench_call
    assert (out / "cuda-tests.log").read_text().strip() == "3 passed"
    assert "| row | figure |" in (out / "bench.md").read_text()
    assert "progress" in (out / "bench.log").read_text()
    assert "H200" in (out / "env.txt").read_text()


def test_a_failing_cuda_test_run_is_the_exit_status_and_the_bench_still_runs(tmp_path):
    proc, calls, _ = _run(tmp_path, FAKE_PYTEST_RC="1")
    assert proc.returncode == 1
    assert any(c.startswith("-m fp16kit bench") for c in calls)


def test_a_failing_bench_is_the_exit_status_when_the_tests_pass(tmp_path):
    proc, _, _ = _run(tmp_path, FAKE_BENCH_RC="3")
    assert proc.returncode == 3


def test_without_a_cuda_device_it_says_so_and_runs_nothing(tmp_path):
    proc, calls, out = _run(tmp_path, FAKE_CUDA_RC="1")
    assert proc.returncode == 0
    assert "no CUDA device" in proc.stdout
    assert not any(c.startswith("-m ") for c in calls)
    assert "no CUDA device" in (out / "env.txt").read_text()
