"""fp16kit.integrations imports no framework; an adapter's missing framework names the extra."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from fp16kit.core import log as fp16kit_log
from fp16kit.integrations._requires import require

FRAMEWORKS = ("lightning", "pytorch_lightning", "accelerate", "transformers")


def test_importing_fp16kit_and_the_package_imports_no_framework():
    code = (
        "import sys, fp16kit, fp16kit.integrations, fp16kit.legacy\n"
        f"print(sorted(m for m in {FRAMEWORKS!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_missing_framework_names_the_extra():
    with pytest.raises(ImportError, match=r'pip install "fp16kit\[lightning\]"') as info:
        require("no_such_framework_xyz.pytorch", extra="lightning", tested=("2.6", "2.7"))
    assert isinstance(info.value.__cause__, ImportError)


def test_untested_version_warns_once(caplog, monkeypatch):
    monkeypatch.setattr(fp16kit_log, "_seen", set())
    with caplog.at_level(logging.WARNING, logger="fp16kit"):
        mod = require("pytest", extra="test", tested=("0.1", "0.2"))
        require("pytest", extra="test", tested=("0.1", "0.2"))
    assert mod is pytest
    warnings = [r for r in caplog.records if "is tested with pytest >= 0.1, < 0.2" in r.getMessage()]
    assert len(warnings) == 1


def test_tested_version_is_quiet(caplog, monkeypatch):
    monkeypatch.setattr(fp16kit_log, "_seen", set())
    with caplog.at_level(logging.WARNING, logger="fp16kit"):
        require("pytest", extra="test", tested=("0.1", "1000"))
    assert not caplog.records
