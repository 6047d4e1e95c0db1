"""examples/apex_era/transformer_xl_amp.py, whose apex guards are Transformer-XL's and other
codebases' ('apex' in sys.modules, find_spec, a try-import flag): without apex it stops at
"APEX AMP unavailable"; under `fp16kit run`, and migrated under plain python, every guard sees apex
and the two runs print the same."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

import fp16kit
from fp16kit.cli import main as cli_main

pytest.importorskip("libcst")

ROOT = pathlib.Path(fp16kit.__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "apex_era" / "transformer_xl_amp.py"
ARGS = ["--fp16", "--max_step", "20"]
EVERY_GUARD_SEES_APEX = "apex available: True, APEX_AVAILABLE: True, apex.amp: True\namp: apex O1\n"


def _python(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONHASHSEED="0")
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.slow
def test_guards_see_apex_under_run_and_after_migrate(tmp_path, capsys):
    without = _python(str(SCRIPT), *ARGS)  # the guard is real: no apex, no fp16kit
    assert without.returncode == 1 and "RuntimeError: APEX AMP unavailable" in without.stderr

    unmodified = _python("-m", "fp16kit", "run", str(SCRIPT), *ARGS)
    assert unmodified.returncode == 0, unmodified.stderr
    assert unmodified.stdout.startswith(EVERY_GUARD_SEES_APEX) and "final loss " in unmodified.stdout

    copy = tmp_path / SCRIPT.name
    shutil.copy(SCRIPT, copy)
    assert cli_main(["migrate", str(copy)]) == 0
    out = capsys.readouterr().out
    assert "1 of 1 Python file rewritten (2 imports, 0 dotted uses, 6 availability checks)" in out
    assert "left for you" not in out  # every guard of this script can be rewritten
    migrated = _python(str(copy), *ARGS)
    assert migrated.returncode == 0, migrated.stderr
    assert migrated.stdout == unmodified.stdout
