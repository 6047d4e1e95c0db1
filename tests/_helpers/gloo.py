"""Run a worker script on two gloo ranks in a fresh interpreter and read back each rank's results.

The worker gets ``argv = [script, INIT_FILE, LOG_PREFIX, *extra]``, starts its ranks itself (e.g.
``torch.multiprocessing.spawn``), and each rank ``torch.save``s its results to ``LOG_PREFIX.<rank>``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

import fp16kit

ROOT = Path(fp16kit.__file__).resolve().parent.parent


def run_two_ranks(worker_source: str, tmp_path: Path, *extra: str) -> list[Any]:
    script = tmp_path / "worker.py"
    script.write_text(worker_source)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "init"), str(tmp_path / "log"), *extra],
        timeout=120,
        env=env,
        cwd=str(tmp_path),
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        # A rank sometimes aborts in teardown, after its results are written ("terminate called
        # without an active exception", about 1 run in 10 on this machine). The same loop with
        # torch.amp.GradScaler and a plain all_reduce does it too (3 of 20 runs), so it is
        # torch/gloo's. The behaviour under test is in the results; any other failure fails.
        assert "terminate called without an active exception" in done.stderr, done.stderr
        assert all((tmp_path / f"log.{r}").exists() for r in range(2)), done.stderr
    return [torch.load(tmp_path / f"log.{r}", weights_only=True) for r in range(2)]
