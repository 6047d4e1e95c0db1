"""examples/apex_era/fp16_optimizer_resume.py -- a 2019 fp16_utils script that resumes with
``torch.load(path, map_location=...)`` (torch >= 2.6: weights_only=True; ``--full-unpickler``:
weights_only=False) and ``optimizer.load_state_dict(checkpoint['optimizer'])`` -- resumed from a
checkpoint in apex's own layout: the optimizer entry holds apex's pickled scaler
object (era 2: ``apex.amp.scaler.LossScaler``, 2019 on; era 1: ``apex.fp16_utils.loss_scaler.
DynamicLossScaler``, 2018) and its fp32 masters as Parameters.

apex is not installed: the file is the script's own checkpoint after 5 of 8 epochs, rewritten as
apex would have saved the same state (the ``fake_apex`` stand-ins of conftest.py, removed before
anything reads it). Resumed unmodified under ``fp16kit run``, and after ``fp16kit migrate`` (and a
``fp16kit convert-checkpoint``, as plain python cannot unpickle apex's classes) under python, the
last three epochs print and save exactly what the uninterrupted 8-epoch run does.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch
from torch import nn

import fp16kit
from _helpers.fp16_optimizer import same_value
from fp16kit.cli import main as cli_main

ROOT = pathlib.Path(fp16kit.__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "apex_era" / "fp16_optimizer_resume.py"
ARGS = ["--dynamic-loss-scale"]
EPOCHS, STOP, STEPS_PER_EPOCH = 8, 5, 4

pytestmark = pytest.mark.slow


def _python(*args) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONHASHSEED="0")
    return subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, env=env, timeout=300)


def _script_run(*args, script=SCRIPT, under_fp16kit_run=True) -> list[str]:
    launcher = ["-m", "fp16kit", "run"] if under_fp16kit_run else []
    done = _python(*launcher, script, *ARGS, *args)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run's output and last checkpoint; the checkpoint after STOP epochs."""
    root = tmp_path_factory.mktemp("reference")
    (root / "full").mkdir()
    (root / "part").mkdir()
    lines = _script_run("--epochs", EPOCHS, "--checkpoint-dir", root / "full")
    _script_run("--epochs", STOP, "--checkpoint-dir", root / "part")
    return (
        lines,
        torch.load(root / "full" / "checkpoint.pth.tar", weights_only=True),
        root / "part" / "checkpoint.pth.tar",
    )


def _apex_layout(apex, ckpt_path, era: int, out: pathlib.Path) -> pathlib.Path:
    """The checkpoint as apex's FP16_Optimizer of that era saved the same state."""
    ckpt = torch.load(ckpt_path, weights_only=True)
    sd, s = ckpt["optimizer"], ckpt["optimizer"]["loss_scaler"]
    if era == 2:
        scaler = apex.era2(
            s["loss_scale"],
            window=s["scale_window"],
            unskipped=s["unskipped"],
            min_loss_scale=s["min_loss_scale"],
            max_loss_scale=s["max_loss_scale"],
        )
    else:  # era 1 counts iterations; the same growth phase: unskipped clean ones since the last overflow
        n = ckpt["epoch"] * STEPS_PER_EPOCH
        scaler = apex.era1_dynamic(s["loss_scale"], n, n - 1 - s["unskipped"], 2.0, s["scale_window"])
    masters = [[nn.Parameter(m) for m in group] for group in sd["fp32_from_fp16"]]  # apex saved its Parameters
    torch.save({**ckpt, "optimizer": {**sd, "loss_scaler": scaler, "fp32_from_fp16": masters}}, out)
    apex.remove()
    return out


def _check_resumed(lines: list[str], checkpoint_dir: pathlib.Path, reference, **scaler_settings) -> None:
    ref_lines, ref_final, _ = reference
    ref_final = {**ref_final, "optimizer": {**ref_final["optimizer"]}}
    ref_final["optimizer"]["loss_scaler"] = {**ref_final["optimizer"]["loss_scaler"], **scaler_settings}
    assert lines[0].startswith("=> loading checkpoint")
    # apex's "Gradient overflow" lines are on stdout too (as apex printed them): the uninterrupted
    # run's output after the line of the last epoch the checkpoint holds is what the resumed run prints
    last = next(i for i, line in enumerate(ref_lines) if line.startswith(f"epoch {STOP - 1} "))
    assert lines[1].endswith(f"(epoch {STOP}, loss scale {ref_lines[last].rsplit(' ', 1)[1]})")
    assert lines[2:] == ref_lines[last + 1 :]  # epochs 5-7, their overflow lines and the final loss
    assert any(line.startswith("Gradient overflow.") for line in lines[2:])  # the scale moved while resumed
    same_value(torch.load(checkpoint_dir / "checkpoint.pth.tar", weights_only=True), ref_final, "checkpoint")


@pytest.mark.parametrize("load", [[], ["--full-unpickler"]], ids=["default", "full"])
@pytest.mark.parametrize("era", [2, 1])
def test_resumes_from_apex_s_checkpoint_under_fp16kit_run(fake_apex, tmp_path, reference, era, load):
    old = _apex_layout(fake_apex, reference[2], era, tmp_path / "apex.pth.tar")
    lines = _script_run("--epochs", EPOCHS, "--resume", old, "--checkpoint-dir", tmp_path, *load)
    # era 1's scaler had a floor of 1 and no cap (which these scales never reach): its settings
    _check_resumed(lines, tmp_path, reference, **({} if era == 2 else {"min_loss_scale": 1.0, "max_loss_scale": None}))


def test_resumes_after_migrate_from_the_converted_file(fake_apex, tmp_path, reference, capsys):
    old = _apex_layout(fake_apex, reference[2], 2, tmp_path / "apex.pth.tar")
    migrated = tmp_path / SCRIPT.name
    shutil.copy(SCRIPT, migrated)
    assert cli_main(["migrate", str(migrated)]) == 0
    assert "import apex" not in migrated.read_text() and "from apex" not in migrated.read_text()
    reported = [line for line in capsys.readouterr().out.splitlines() if "fp16kit convert-checkpoint OLD NEW" in line]
    loads = [i for i, line in enumerate(migrated.read_text().splitlines(), 1) if "checkpoint = torch.load(" in line]
    assert [line.split(": ", 1)[0] for line in reported] == [f"{migrated}:{i}" for i in loads]

    # plain python cannot read apex's classes (no alias): the file is converted once
    direct = _python(migrated, *ARGS, "--epochs", EPOCHS, "--resume", old)
    assert direct.returncode != 0 and "GLOBAL apex.amp.scaler.LossScaler was not an allowed global" in direct.stderr
    direct = _python(migrated, *ARGS, "--epochs", EPOCHS, "--resume", old, "--full-unpickler")
    assert direct.returncode != 0 and "No module named 'apex'" in direct.stderr
    new = tmp_path / "converted.pth.tar"
    assert cli_main(["convert-checkpoint", str(old), str(new)]) == 0
    capsys.readouterr()
    lines = _script_run(
        "--epochs", EPOCHS, "--resume", new, "--checkpoint-dir", tmp_path, script=migrated, under_fp16kit_run=False
    )
    _check_resumed(lines, tmp_path, reference)


def test_resumes_from_its_own_checkpoint_and_runs_without_resume(tmp_path, reference):
    lines = _script_run("--epochs", EPOCHS, "--resume", reference[2], "--checkpoint-dir", tmp_path)
    _check_resumed(lines, tmp_path, reference)
    final = float(reference[0][-1].split()[-1])
    assert reference[0][-1].startswith("final loss") and final == final and final < 10  # trained
