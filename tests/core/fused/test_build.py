"""Building and loading the C kernels: the cache, the switches, the fallbacks (each one log line)."""

from __future__ import annotations

import logging
import os

import pytest

from fp16kit.core.fused import build


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    monkeypatch.setattr(build, "_loaded", {})
    monkeypatch.setenv("FP16KIT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_fp16kit_fused_0_turns_the_kernels_off_with_one_info_line(fresh, monkeypatch, caplog):
    monkeypatch.setenv("FP16KIT_FUSED", "0")
    with caplog.at_level(logging.INFO, logger="fp16kit"):
        assert build.load("master_adam") is None
        assert build.load("master_adam") is None
    assert [r.levelno for r in caplog.records] == [logging.INFO]
    assert "FP16KIT_FUSED=0" in caplog.records[0].getMessage()
    assert not fresh.exists()


def test_a_missing_compiler_is_one_warning(fresh, monkeypatch, caplog):
    if build.disabled_by_env():
        pytest.skip("FP16KIT_FUSED=0")
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with caplog.at_level(logging.INFO, logger="fp16kit"):
        assert build.load("master_adam") is None
        build.load("master_adam")
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "failed" in caplog.records[0].getMessage() and "FP16KIT_FUSED=0" in caplog.records[0].getMessage()


def test_built_once_then_loaded_from_the_cache(fresh, monkeypatch, caplog):
    if build.disabled_by_env() or build._load("master_adam")[0] is None:
        pytest.skip("no kernel build on this machine")
    monkeypatch.setattr(build, "_loaded", {})
    built = sorted(fresh.glob("master_adam-*.so"))
    assert len(built) == 1
    stamp = os.stat(built[0]).st_mtime_ns
    with caplog.at_level(logging.INFO, logger="fp16kit"):
        assert build.load("master_adam") is not None
    assert not caplog.records  # no build, nothing to say
    assert os.stat(built[0]).st_mtime_ns == stamp
    assert not list(fresh.glob("*.tmp"))


def test_an_unwritable_cache_is_reported(monkeypatch, tmp_path, caplog):
    if build.disabled_by_env():
        pytest.skip("FP16KIT_FUSED=0")
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setattr(build, "_loaded", {})
    monkeypatch.setenv("FP16KIT_CACHE", str(blocker / "cache"))  # a directory under a file
    with caplog.at_level(logging.INFO, logger="fp16kit"):
        assert build.load("master_adam") is None
    assert "FP16KIT_CACHE" in caplog.records[-1].getMessage()
