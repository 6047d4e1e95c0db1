"""install_apex_alias() and torch's weights-only allow-list: exactly fp16kit's scaler classes go on
it (under the apex -- and with megatron=True, Megatron -- class paths the alias maps to them, and
under their own), a path the user's own entry claims is left to it, and uninstalling takes off
exactly what installing put on, keeping what was added meanwhile. (What this lets torch.load's
default read, and what it still refuses: tests/legacy/checkpoints/test_alias.py.)"""

from __future__ import annotations

import importlib

import pytest
import torch

from fp16kit.legacy.apex_alias import install_apex_alias, uninstall_apex_alias
from fp16kit.legacy.checkpoints.records import FP16KIT_SCALER_CLASSES, SAFE_GLOBALS
from fp16kit.legacy.checkpoints.safe_globals import entry_path, replacing


def _cls(path: str) -> type:
    module, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


def _listed() -> set:
    return set(torch.serialization.get_safe_globals())


@pytest.fixture
def clean_list():
    """torch's list as the test left it is put back afterwards (the tests add their own entries)."""
    before = torch.serialization.get_safe_globals()
    yield
    uninstall_apex_alias()
    torch.serialization.clear_safe_globals()
    torch.serialization.add_safe_globals(before)


def _expected(megatron: bool) -> set:
    """Worked out from the table alone: each fp16kit class under the path it stands for and its
    own; Megatron's dynamic and static scalers also under the repo-root `fp16` path."""
    want = set()
    for own, apex in FP16KIT_SCALER_CLASSES.items():
        if apex.startswith("megatron.") and not megatron:
            continue
        cls = _cls(own)
        want |= {(cls, own), (cls, apex)}
        if apex.startswith("megatron."):
            want.add((cls, apex.removeprefix("megatron.")))
    return want


@pytest.mark.parametrize("megatron", [False, True])
def test_exactly_fp16kit_s_scaler_classes_are_added_and_removed(clean_list, megatron):
    before = _listed()
    install_apex_alias(megatron=megatron)
    added = _listed() - before
    assert added == _expected(megatron)
    assert all(
        isinstance(e, tuple) and f"{e[0].__module__}.{e[0].__qualname__}" in FP16KIT_SCALER_CLASSES for e in added
    )
    uninstall_apex_alias()
    assert _listed() == before


def test_what_the_user_adds_meanwhile_stays_even_fp16kit_s_own_class(clean_list):
    from fp16kit.legacy.amp.scaler import LossScaler

    class Mine:
        pass

    install_apex_alias()
    torch.serialization.add_safe_globals([Mine, LossScaler])  # LossScaler by its own path, as a bare class
    uninstall_apex_alias()
    assert {Mine, LossScaler} <= _listed()
    assert not [e for e in _listed() if isinstance(e, tuple)]


def test_a_path_the_user_already_allowed_is_left_to_the_user_s_entry(clean_list):
    class MyStub:
        pass

    mine = (MyStub, "apex.amp.scaler.LossScaler")
    torch.serialization.add_safe_globals([mine])
    install_apex_alias()
    assert [e for e in _listed() if entry_path(e) == "apex.amp.scaler.LossScaler"] == [mine]
    assert (
        _cls("fp16kit.legacy.loss_scaler.DynamicLossScaler"),
        "apex.fp16_utils.loss_scaler.DynamicLossScaler",
    ) in _listed()  # the other paths are the alias's
    uninstall_apex_alias()
    assert mine in _listed()


def test_the_user_s_safe_globals_block_under_the_alias_leaves_the_alias_s_entries(clean_list):
    class Mine:
        pass

    install_apex_alias()
    with_alias = _listed()
    with torch.serialization.safe_globals([Mine]):
        assert _listed() == with_alias | {Mine}
    assert _listed() == with_alias


def test_replacing_sets_the_alias_s_entries_aside_and_puts_back_only_those_still_installed(clean_list):
    """load_checkpoint's stand-ins answer their paths alone while it reads a file; an alias
    uninstalled during that read is not brought back by it."""
    install_apex_alias()
    with_alias = _listed()
    paths = {entry_path(e) for e in SAFE_GLOBALS}
    with replacing(SAFE_GLOBALS):
        owners = {}
        for e in torch.serialization.get_safe_globals():
            owners.setdefault(entry_path(e), set()).add(e[0] if isinstance(e, tuple) else e)
        assert all(owners[p] == {g for g in SAFE_GLOBALS if entry_path(g) == p} for p in paths)
    assert _listed() == with_alias
    with replacing(SAFE_GLOBALS):
        uninstall_apex_alias()
    assert not [e for e in _listed() if isinstance(e, tuple)]
