"""Every script in examples/ runs (briefly) and does what it says."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

import fp16kit

ROOT = pathlib.Path(fp16kit.__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def _run(name, *args):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args], capture_output=True, text=True, env=env, timeout=300
    )


def test_every_example_is_tested():
    tested = {"apex_fp16_optimizer.py", "fp16_model_grad_scaler.py"}
    assert {p.name for p in EXAMPLES.glob("*.py")} == tested


def test_every_integration_example_is_run_by_an_integration_test():
    # the name in code (not a comment) of a test file that starts a subprocess
    runners = [
        "\n".join(line.split("#")[0] for line in p.read_text().splitlines())
        for p in (pathlib.Path(__file__).parents[1] / "integrations").glob("test_*.py")
    ]
    runners = [src for src in runners if "subprocess" in src or "sys.executable" in src]
    untested = [
        p.name for p in (EXAMPLES / "integrations").glob("*.py") if not any(f'"{p.name}"' in r for r in runners)
    ]
    assert not untested, f"examples/integrations without a test that runs them: {untested}"


def test_apex_script_with_changed_imports_trains_and_resumes():
    r = _run("apex_fp16_optimizer.py", "--steps", "60")
    assert r.returncode == 0, r.stderr
    losses = [float(v) for v in re.findall(r"loss (\d+\.\d+)", r.stdout)]
    assert losses[-1] < 0.5 * losses[0]
    assert "Gradient overflow.  Skipping step" in r.stdout  # the scale calibrates from 2**20 (apex printed it)


@pytest.mark.parametrize("flag", [[], ["--bf16"]])
def test_fp16_model_with_grad_scaler_trains(flag):
    r = _run("fp16_model_grad_scaler.py", "--steps", "40", *flag)
    assert r.returncode == 0, r.stderr
    losses = [float(v) for v in re.findall(r"loss (\d+\.\d+)", r.stdout)]
    assert losses[-1] < losses[0]
    assert "fp32 master weights" in r.stdout
