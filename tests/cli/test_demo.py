"""`fp16kit demo` and the command line."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import fp16kit
from fp16kit.cli import main
from fp16kit.demo import DemoConfig, run_demo


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_demo_trains_and_tracks_fp32(dtype):
    result = run_demo(DemoConfig(epochs=3, steps_per_epoch=15, dtype=dtype))
    assert [r.epoch for r in result.rows] == [1, 2, 3]
    first, last = result.rows[0], result.rows[-1]
    assert last.fp32_loss < first.fp32_loss and last.amp_loss < first.amp_loss  # it learns
    for r in result.rows:  # mixed precision follows the fp32 run closely
        assert abs(r.amp_loss - r.fp32_loss) < 0.05 * r.fp32_loss
        assert r.scale > 0 and r.skipped >= 0
    assert abs(result.amp_accuracy - result.fp32_accuracy) < 0.05


def test_demo_reports_skipped_steps_when_the_scale_is_too_high():
    # 2**40 overflows fp16 gradients at once: the scaler must skip and back off.
    result = run_demo(DemoConfig(epochs=1, steps_per_epoch=20, init_scale=2.0**40))
    assert result.rows[0].skipped >= 1
    assert result.rows[0].scale < 2.0**40


def test_demo_rejects_fp32():
    with pytest.raises(ValueError, match="torch.float16 or torch.bfloat16"):
        run_demo(DemoConfig(dtype=torch.float32))


def test_cli_demo_prints_a_table(capsys):
    assert main(["demo", "--epochs", "2", "--steps", "5", "--dtype", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "bfloat16 autocast + fp16kit.GradScaler" in out
    table = [line for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert len(table) == 2
    assert "skipped steps:" in out and "test accuracy:" in out


def test_cli_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit) as e:
        main(["demo", "--epochs", "0"])
    assert e.value.code == 2
    assert "must be >= 1" in capsys.readouterr().err


def test_cli_without_command_prints_help(capsys):
    assert main([]) == 2
    assert "demo" in capsys.readouterr().out


def test_python_dash_m_version():
    root = os.path.dirname(os.path.dirname(os.path.abspath(fp16kit.__file__)))
    out = subprocess.run(
        [sys.executable, "-m", "fp16kit", "--version"],
        capture_output=True, text=True, check=True, env=dict(os.environ, PYTHONPATH=root),
    ).stdout
    assert out.strip() == f"fp16kit {fp16kit.__version__}"
