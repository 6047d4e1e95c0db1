"""Isolation every test gets."""

from __future__ import annotations

import gc
import sys

import pytest


def pytest_collection_finish(session: pytest.Session) -> None:
    # Every test module is imported now (torch, lightning, transformers: some 400k objects), and a
    # full collection would walk them all -- 0.2 s on a 2-core machine. The Ctrl-C sweeps collect
    # before each of their thousands of points (tests/_helpers/interrupt.py) and the gloo tests
    # after each group: frozen, what collection left is skipped by every later collection, which
    # then walks only the tests' own objects. (A test's garbage is still collected.)
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def _restore_excepthook():
    # torch.distributed.init_process_group wraps sys.excepthook (a "[rank0]: " prefix per line)
    # and never unwraps it: after a few tests that build process groups, every traceback printed
    # in this process would carry one prefix per group ever built.
    hook = sys.excepthook
    yield
    sys.excepthook = hook


@pytest.fixture
def amp_state_restored():
    """amp.initialize sets process-wide state, as apex's did: put it back after the test."""
    from fp16kit.legacy.amp._amp_state import _amp_state

    saved = dict(vars(_amp_state))
    yield
    vars(_amp_state).clear()
    vars(_amp_state).update(saved)


@pytest.fixture
def gloo_world(tmp_path):
    """A one-rank gloo default process group for the test (torch.distributed.group.WORLD)."""
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        # DDP objects sit in reference cycles: freed by a later gc, after their group was
        # destroyed (and a new one built), torch's reducer hangs or aborts the whole pytest
        # process ("terminate called after throwing an instance of 'std::system_error'")
        gc.collect()
        dist.destroy_process_group()


@pytest.fixture
def threads():
    """``threads()`` makes an OptimizerThread that is shut down (drained) after the test."""
    from fp16kit import OptimizerThread

    made = []

    def make():
        made.append(OptimizerThread())
        return made[-1]

    yield make
    for t in made:
        t.shutdown(wait=True, timeout=10)
