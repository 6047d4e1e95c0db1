"""Two apex-era scripts of examples/apex_era/, run as their authors ran them: unmodified under
`fp16kit run`, and after `fp16kit migrate` under plain python with the same output.

gnmt_rank_logging.py: DeepLearningExamples' GNMT logging setup (a RankFilter on the root logger,
``%(rank)s`` formats) with amp O2 and overflowing first steps: apex's banner and skip lines on
stdout, once each, as apex printed them; no "--- Logging error ---".
moco_o1.py: a MoCo-style contrastive loop under amp O1 with ``exp(scores / 0.05)``: the loss stays
finite on CPU (apex ran exp, sum and log in fp32).
"""

from __future__ import annotations

import ast
import math
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

import fp16kit
from fp16kit.cli import main as cli_main

ROOT = pathlib.Path(fp16kit.__file__).resolve().parent.parent
SCRIPTS = ROOT / "examples" / "apex_era"


def _python(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONHASHSEED="0")
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=300)


def _apex_imports(source: str) -> list[int]:
    return [
        node.lineno
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Import)
        and any(a.name.split(".")[0] == "apex" for a in node.names)
        or isinstance(node, ast.ImportFrom)
        and (node.module or "").split(".")[0] == "apex"
    ]


def _unmodified_and_migrated(name: str, args: list[str], tmp_path, capsys) -> tuple[str, str]:
    """(stdout, stderr) under `fp16kit run`; asserts the migrated copy prints the same stdout."""
    unmodified = _python("-m", "fp16kit", "run", str(SCRIPTS / name), *args)
    assert unmodified.returncode == 0, unmodified.stderr
    copy = tmp_path / name
    shutil.copy(SCRIPTS / name, copy)
    assert cli_main(["migrate", str(copy)]) == 0, capsys.readouterr()
    assert not _apex_imports(copy.read_text())
    after = _python(str(copy), *args)
    assert after.returncode == 0, after.stderr
    assert after.stdout == unmodified.stdout
    assert "--- Logging error ---" not in after.stderr
    return unmodified.stdout, unmodified.stderr


def _final_loss(stdout: str) -> float:
    [loss] = re.findall(r"^final loss (\S+)$", stdout, re.M)
    return float(loss)


@pytest.mark.slow
def test_gnmt_rank_logging(tmp_path, capsys):
    out, err = _unmodified_and_migrated("gnmt_rank_logging.py", [], tmp_path, capsys)
    assert "--- Logging error ---" not in err
    lines = out.splitlines()
    # apex's banner, once, verbatim, between the script's own log lines
    start = lines.index("Selected optimization level O2:  FP16 training with FP32 batchnorm and FP32 master weights.")
    assert lines[start - 1].startswith("0: Run arguments: Namespace(")
    assert lines[start + 1 : start + 3] == ["", "Defaults for this optimization level are:"]
    assert lines.count("Processing user overrides (additional kwargs that are not None)...") == 1
    assert lines.count("keep_batchnorm_fp32    : False") == 1  # the override, after processing
    assert lines[start + 19] == "0: Using optimizer: Adam"
    # apex's skip lines, once per skipped step, halving from --init-scale (2**20)
    skips = [line for line in lines if line.startswith("Gradient overflow.")]
    assert skips == [
        f"Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to {2.0 ** (19 - k)}"
        for k in range(len(skips))
    ]
    assert 1 <= len(skips) < 10
    assert lines[-2] == "0: Finished training"
    first = float(re.findall(r"^0: TRAIN \[0\]\[0/\d+\]\tLoss/tok (\S+)\t", out, re.M)[0])
    assert _final_loss(out) < 0.7 * first  # trained


@pytest.mark.slow
def test_gnmt_rank_logging_into_a_log_file(tmp_path):
    # the DEBUG log file of setup_logging holds the script's lines with their rank, and no apex line
    script = tmp_path / "train.py"
    source = (SCRIPTS / "gnmt_rank_logging.py").read_text()
    log_file = tmp_path / "log.log"
    call = "setup_logging(args.log_all_ranks)"
    script.write_text(source.replace(call, f"setup_logging(args.log_all_ranks, {str(log_file)!r})"))
    done = _python("-m", "fp16kit", "run", str(script), "--train-iters", "4")
    assert done.returncode == 0, done.stderr
    logged = [line.split(" - ", 1)[1] for line in log_file.read_text().splitlines()]
    assert logged[0].startswith("INFO - 0 - Run arguments:")
    assert logged[-1] == "INFO - 0 - Finished training"
    assert not [line for line in logged if "Gradient overflow" in line or "optimization level" in line]


@pytest.mark.slow
def test_moco_o1(tmp_path, capsys):
    out, err = _unmodified_and_migrated("moco_o1.py", [], tmp_path, capsys)
    losses = [float(v) for v in re.findall(r"^step \d+ loss (\S+)", out, re.M)]
    assert len(losses) == 5 and all(math.isfinite(v) for v in losses), out  # CPU autocast alone: nan
    assert math.isfinite(_final_loss(out))
    assert losses[-1] < losses[1]  # trained (step 0's queue is still random noise)
    assert "Selected optimization level O1:  Insert automatic casts around Pytorch functions and Tensor methods." in out
