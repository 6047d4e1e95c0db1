"""Isolation every test gets."""

from __future__ import annotations

import sys

import pytest


@pytest.fixture(autouse=True)
def _restore_excepthook():
    # torch.distributed.init_process_group wraps sys.excepthook (a "[rank0]: " prefix per line)
    # and never unwraps it: after a few tests that build process groups, every traceback printed
    # in this process would carry one prefix per group ever built.
    hook = sys.excepthook
    yield
    sys.excepthook = hook
