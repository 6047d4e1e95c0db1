"""fp16kit.core.log: one line per key per process."""

from __future__ import annotations

import logging

from fp16kit.core import log


def test_log_once_logs_a_key_once(caplog):
    key = ("test_log_once", object())
    with caplog.at_level(logging.DEBUG, logger="fp16kit"):
        log.log_once(key, "mapped %s", "x")
        log.log_once(key, "mapped %s", "y")
        log.log_once(("test_log_once", "other"), "other", level=logging.WARNING)
    records = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "fp16kit"]
    assert records == [(logging.INFO, "mapped x"), (logging.WARNING, "other")]
