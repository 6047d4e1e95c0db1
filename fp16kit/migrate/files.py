"""Which files ``fp16kit migrate`` rewrites, and rewriting one (the printing is the command line's).

    for PATH given:  a file   -> it, when it is Python (*.py, *.pyw, *.pyi, or a `#!...python` script)
                                 and a regular file (not a FIFO, socket or device); otherwise it is
                                 skipped and, named explicitly as it was, reported as skipped
                     a folder -> every Python file below it, skipping hidden folders, virtual
                                 environments (a pyvenv.cfg inside), site-packages, __pycache__,
                                 node_modules; symlinked folders are not followed
                                 a vendored apex source tree (a folder named apex with __init__.py
                                 and one of apex's subpackages: amp/, optimizers/, ...) is skipped
                                 and reported: rewriting apex's own imports would break that copy
    each file once (by its real path), in sorted order
"""

from __future__ import annotations

import difflib
import os
import re
import stat
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from .codemod import MigrationError, MigrationResult, Unmigratable, migrate_source

__all__ = ["FileOutcome", "iter_python_files", "migrate_file", "is_python_file", "is_vendored_apex"]

_SUFFIXES = (".py", ".pyw", ".pyi")
_SKIP_DIRS = frozenset({"__pycache__", "site-packages", "dist-packages", "node_modules"})
_SHEBANG = re.compile(rb"#![^\n]*python")
# apex's own subpackages: a folder named apex holding one of them is a copy of apex itself
_APEX_SUBPACKAGES = ("amp", "fp16_utils", "optimizers", "parallel", "normalization", "contrib", "transformer")
VENDORED_APEX = "a vendored apex source tree (its own imports must stay apex's); folder skipped"


@dataclass
class FileOutcome:
    """What migrating one file did (``error`` set: nothing was written)."""

    path: str
    changed: bool = False
    written: bool = False
    imports_rewritten: int = 0
    uses_rewritten: int = 0
    checks_rewritten: int = 0
    unmigratable: list[Unmigratable] = field(default_factory=list)
    diff: bytes = b""  # a unified diff in the file's own encoding and line ends
    error: str | None = None
    error_line: int = 0


def is_python_file(path: str) -> bool:
    """A *.py / *.pyw / *.pyi file, or an extensionless script whose first line names python."""
    if path.endswith(_SUFFIXES):
        return True
    if os.path.splitext(path)[1]:
        return False
    try:
        with open(path, "rb") as f:
            return bool(_SHEBANG.match(f.readline(200)))
    except OSError:
        return False


def _is_venv(path: str) -> bool:
    return os.path.exists(os.path.join(path, "pyvenv.cfg"))


def is_vendored_apex(path: str) -> bool:
    """A folder that is a copy of apex's own package: named apex, with __init__.py and a subpackage of apex's."""
    if os.path.basename(os.path.normpath(os.path.abspath(path))) != "apex":
        return False
    return os.path.isfile(os.path.join(path, "__init__.py")) and any(
        os.path.isfile(os.path.join(path, sub, "__init__.py")) for sub in _APEX_SUBPACKAGES
    )


def iter_python_files(paths: Iterable[str], skipped: list[tuple[str, str]] | None = None) -> Iterator[str]:
    """The Python files under ``paths`` (see the module docstring); FileNotFoundError for a missing path.
    ``skipped`` (if given) gets (path, why) for each vendored apex folder and each file named in
    ``paths`` that is not migrated."""
    seen: set[str] = set()
    for path in paths:
        if not os.path.exists(path):
            raise FileNotFoundError(f"no such file or directory: {path}")
        if os.path.isdir(path):
            found = []
            if is_vendored_apex(path):
                if skipped is not None:
                    skipped.append((path, VENDORED_APEX))
                continue
            for root, dirs, files in os.walk(path):
                kept = []
                for d in sorted(dirs):
                    full = os.path.join(root, d)
                    if d.startswith(".") or d in _SKIP_DIRS or _is_venv(full):
                        continue
                    if is_vendored_apex(full):
                        if skipped is not None:
                            skipped.append((full, VENDORED_APEX))
                        continue
                    kept.append(d)
                dirs[:] = kept
                found.extend(os.path.join(root, f) for f in files if not f.startswith("."))
            # regular files only: opening a FIFO (or a device) named *.py would wait forever
            candidates = sorted(f for f in found if os.path.isfile(f) and is_python_file(f))
        elif not os.path.isfile(path):
            candidates = []
            if skipped is not None:
                skipped.append((path, "not a regular file; skipped"))
        elif not is_python_file(path):
            candidates = []
            if skipped is not None:
                skipped.append((path, "not a Python file (*.py, *.pyw, *.pyi or a #!...python script); skipped"))
        else:
            candidates = [path]
        for candidate in candidates:
            real = os.path.realpath(candidate)
            if real not in seen:
                seen.add(real)
                yield candidate


def _unified_diff(path: str, old: bytes, new: bytes) -> bytes:
    """A unified diff of the file's own bytes (its encoding, BOM and line ends), so that `patch` and
    `git apply` take it; lines are split at \\n, \\r\\n and \\r only, as python reads source."""
    name = os.fsencode(os.path.normpath(path))  # `./x.py` (a walk of ".") -> `x.py`: git apply refuses "./"
    lines = difflib.diff_bytes(
        difflib.unified_diff,
        old.splitlines(keepends=True),
        new.splitlines(keepends=True),
        fromfile=name if os.path.isabs(path) else b"a/" + name,
        tofile=name if os.path.isabs(path) else b"b/" + name,
    )
    return b"".join(
        line if line.endswith((b"\n", b"\r")) else line + b"\n\\ No newline at end of file\n" for line in lines
    )


def _write_in_place(path: str, data: bytes) -> None:
    # a temporary file beside the real one, then rename: an interrupted run never leaves half a file
    real = os.path.realpath(path)
    mode = stat.S_IMODE(os.stat(real).st_mode)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(real), prefix=".fp16kit-migrate-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, mode)
        os.replace(tmp, real)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def migrate_file(path: str, *, megatron: bool = False, write: bool = True, diff: bool = False) -> FileOutcome:
    """Rewrite one file's apex imports; writes only if ``write`` and something changed."""
    outcome = FileOutcome(path)
    try:
        with open(path, "rb") as f:
            source = f.read()
    except OSError as e:
        outcome.error = f"cannot read: {e.strerror or e}"
        return outcome
    try:
        result: MigrationResult = migrate_source(source, megatron=megatron)
    except MigrationError as e:
        outcome.error, outcome.error_line = e.message, e.line
        return outcome
    outcome.changed = result.changed
    outcome.imports_rewritten = result.imports_rewritten
    outcome.uses_rewritten = result.uses_rewritten
    outcome.checks_rewritten = result.checks_rewritten
    outcome.unmigratable = result.unmigratable
    if result.changed and diff:
        outcome.diff = _unified_diff(path, source, result.code)  # type: ignore[arg-type]
    if result.changed and write:
        try:
            _write_in_place(path, result.code)  # type: ignore[arg-type]
        except OSError as e:  # a read-only folder or file system: this file is left as it was
            outcome.error = f"cannot write: {e.strerror or e}"
            return outcome
        outcome.written = True
    return outcome
