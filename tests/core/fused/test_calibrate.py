"""Finding torch's rounding forms: once per process, quietly, and the kernel matches torch under them."""

from __future__ import annotations

import logging

import pytest

from fp16kit.core.fused import abi, calibrate

pytestmark = pytest.mark.skipif(abi.library() is None, reason="the fused kernels are off on this machine (logged)")


def test_the_forms_are_found_once(caplog):
    with caplog.at_level(logging.DEBUG, logger="fp16kit"):
        assert calibrate.forms() == calibrate.forms()
    assert not caplog.records


def test_the_forms_found_reproduce_every_probe():
    found = calibrate.forms()
    assert found is not None
    cases = [
        calibrate._probe(dtype, decoupled, wd) for dtype in abi.KIND for decoupled, wd in ((True, 0.01), (False, 0.1))
    ]
    assert all(calibrate._matches(case, found) for case in cases)
