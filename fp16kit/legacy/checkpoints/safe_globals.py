"""torch's weights-only allow-list while fp16kit's apex alias is installed.

``torch.load(f)`` (torch >= 2.6's default, ``weights_only=True``) reads the loss scalers apex-era
optimizer checkpoints pickle, as fp16kit's own scaler classes -- the only non-plain objects in an apex
``FP16_Optimizer`` (or Megatron-LM v1 optimizer) state dict.

Contract::

    allow(fp16kit_module)   at install_apex_alias(); fp16kit_module(apex path) is the fp16kit module the
                            alias gives that module path, or None (not the alias's: beside a real apex)
        for each scaler class path P apex and Megatron pickled (checkpoint_records.SCALER_CLASSES)
        whose module the alias gives a fp16kit module holding a class C of that name,
        C one of checkpoint_records.FP16KIT_SCALER_CLASSES (nothing else is ever added):
            the entries (C, P) and (C, C's own path) -- the second is what a script under the alias
            saves again (torch pickles C by its own path)
        skipped: an entry already on torch's list (it is not removed later either), and a path
            that an entry already on the list gives another object (the user's own
            add_safe_globals stands; a DEBUG line names it)
        -> the entries added (torch.serialization.add_safe_globals)
    disallow(entries)       at uninstall_apex_alias(): exactly those entries leave the list; what
                            was added meanwhile stays
    replacing(entries)      (fp16kit.legacy.load_checkpoint's stand-ins, while it reads a file): for
                            its duration `entries` are on the list and every other entry of one of
                            their paths is set aside (the alias's classes, a user's own), so those
                            paths read as the stand-ins there, never as a live class

Why this is safe: torch's weights-only unpickler hands these classes plain data only (numbers,
strings, tensors, containers); NEWOBJ makes one with ``object.__new__`` (no constructor runs), and
BUILD calls its ``__setstate__``, which builds the scaler from the numbers and bools it reads and
refuses (ValueError naming the field) any field that is not one apex pickled. A crafted REDUCE can
only call the class itself, on plain data. No module, optimizer, apex DDP or other class is added.

torch keeps one object per path: an entry someone adds *while* the alias is on under one of these
paths competes with the alias's (which one torch uses is not defined): uninstall the alias first,
or use :func:`fp16kit.legacy.load_checkpoint`, which reads them as inert records whatever the list holds.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

__all__ = ["allow", "disallow", "replacing", "entry_path"]

logger = logging.getLogger("fp16kit")

_LOCK = threading.RLock()
_ASIDE: list[list[Any]] = []  # the entries each replacing() in progress will put back


def entry_path(entry: Any) -> str:
    """The path an allow-list entry answers to.

    torch's rule: a tuple's string, else the object's ``__module__.__qualname__``."""
    if isinstance(entry, tuple):
        return entry[1] if len(entry) == 2 and isinstance(entry[1], str) else ""  # torch refuses it at load
    return f"{getattr(entry, '__module__', '')}.{getattr(entry, '__qualname__', '')}"


def _target(entry: Any) -> Any:
    return entry[0] if isinstance(entry, tuple) else entry


def _remove(entries: Iterable[Any]) -> None:
    # torch.serialization has no public "remove": keep everything else, in one reassignment
    gone = set(entries)
    kept = [e for e in torch.serialization.get_safe_globals() if e not in gone]
    torch.serialization.clear_safe_globals()
    torch.serialization.add_safe_globals(kept)


def _scaler_entries(fp16kit_module: Callable[[str], str | None]) -> list[tuple[type, str]]:
    from .records import FP16KIT_SCALER_CLASSES, SCALER_CLASSES

    entries: list[tuple[type, str]] = []
    for path in SCALER_CLASSES:
        module, name = path.rsplit(".", 1)
        target = fp16kit_module(module)
        if target is None:
            continue
        cls = getattr(importlib.import_module(target), name, None)
        if not isinstance(cls, type):
            continue
        own = f"{cls.__module__}.{cls.__qualname__}"
        if own not in FP16KIT_SCALER_CLASSES:
            continue  # only fp16kit's scaler classes, whatever a table says
        entries += [(cls, path), (cls, own)]
    return list(dict.fromkeys(entries))  # Megatron's two module paths share a class: its own path once


def allow(fp16kit_module: Callable[[str], str | None]) -> list[Any]:
    """Put fp16kit's scaler classes on torch's allow-list under the apex paths and their own.

    Put fp16kit's scaler classes on torch's allow-list under the apex (and Megatron) paths the
    alias maps to them, and under their own (see the module docstring). Returns what was added."""
    wanted = _scaler_entries(fp16kit_module)
    with _LOCK:
        present = torch.serialization.get_safe_globals()
        claimed = {entry_path(e): _target(e) for e in present}
        added = []
        for entry in wanted:
            path = entry_path(entry)
            if entry in present:
                continue
            if path in claimed and claimed[path] is not entry[0]:
                logger.debug(
                    "apex alias: %s is already on torch's weights-only list (%r): left to that entry",
                    path,
                    claimed[path],
                )
                continue
            added.append(entry)
        torch.serialization.add_safe_globals(list(added))  # a copy typed as torch's parameter
    return added


def disallow(entries: Iterable[Any]) -> None:
    """Take exactly ``entries`` (what :func:`allow` returned) off torch's allow-list."""
    entries = list(entries)
    with _LOCK:
        _remove(entries)
        for aside in _ASIDE:  # set aside by a load in progress: not put back either
            aside[:] = [e for e in aside if e not in entries]


@contextlib.contextmanager
def replacing(entries: Iterable[Any]) -> Iterator[None]:
    """Put ``entries`` on torch's allow-list for the duration, in place of others of their paths.

    ``entries`` on torch's allow-list for the duration, in place of every other entry of one of
    their paths (restored afterwards, unless :func:`disallow` took it off meanwhile)."""
    entries = list(entries)
    paths = {entry_path(e) for e in entries}
    with _LOCK:
        present = torch.serialization.get_safe_globals()
        aside = [e for e in present if entry_path(e) in paths and e not in entries]
        new = [e for e in entries if e not in present]
        _remove(aside)
        torch.serialization.add_safe_globals(new)
        _ASIDE.append(aside)
    try:
        yield
    finally:
        with _LOCK:
            _ASIDE[:] = [a for a in _ASIDE if a is not aside]
            _remove(new)
            torch.serialization.add_safe_globals(aside)
