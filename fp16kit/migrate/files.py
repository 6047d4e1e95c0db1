"""Which files ``fp16kit migrate`` rewrites, and rewriting one (the printing is the command line's).

    for PATH given:  a file   -> it, when it is Python (*.py, *.pyw, *.pyi, or a `#!...python` script)
                                 and a regular file (not a FIFO, socket or device); otherwise it is
                                 skipped and, named explicitly as it was, reported as skipped
                     a folder -> every Python file below it, skipping hidden folders, virtual
                                 environments (a pyvenv.cfg inside), site-packages, __pycache__,
                                 node_modules; a symlinked folder is followed once when its target
                                 is inside a PATH given (each real folder is walked once; a link to a
                                 folder holding it is a loop: reported, not followed), and reported,
                                 not followed, when its target is outside them
                                 a vendored apex source tree (a folder named apex with __init__.py
                                 and one of apex's subpackages: amp/, optimizers/, ...) is skipped
                                 and reported: rewriting apex's own imports would break that copy
    each file once (by its real path; a name that is not a symlink wins), in sorted order

Rewriting one file (``migrate_file``) never harms it: the new bytes go to a temporary file beside it,
which gets the file's owner, group, mode and extended attributes, and replaces it atomically -- and
only if the file is still what was read (inode, size, mtime and content: an edit saved meanwhile is
kept and the file reported as changed while migrating). Refused, each with its reason and nothing
written: a file whose real path is outside ``roots`` (a symlink out of the tree), a hard-linked file
and a read-only one (unless ``write_hard_links`` / ``write_read_only``), one whose owner or extended
attributes cannot be kept, and a file over ``max_size`` bytes (not even read). A file the parser
cannot handle (nested too deeply, a NUL byte, anything else) is reported, never raised.
"""

from __future__ import annotations

import difflib
import errno
import hashlib
import os
import re
import stat
import sys
import tempfile
import threading
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from .codemod import MigrationError, MigrationResult, Unmigratable, migrate_source

__all__ = [
    "DEFAULT_MAX_SIZE",
    "FileOutcome",
    "given_roots",
    "iter_python_files",
    "migrate_file",
    "is_python_file",
    "is_vendored_apex",
]

_SUFFIXES = (".py", ".pyw", ".pyi")
_SKIP_DIRS = frozenset({"__pycache__", "site-packages", "dist-packages", "node_modules"})
_SHEBANG = re.compile(rb"#![^\n]*python")
# apex's own subpackages: a folder named apex holding one of them is a copy of apex itself
_APEX_SUBPACKAGES = ("amp", "fp16_utils", "optimizers", "parallel", "normalization", "contrib", "transformer")
VENDORED_APEX = "a vendored apex source tree (its own imports must stay apex's); folder skipped"
DEFAULT_MAX_SIZE = 1 << 20  # bytes; a 2 MB generated file took minutes and gigabytes to parse
# a valid expression of a few hundred terms overflows the parser's recursion at python's default limit:
# files are parsed in a thread with this much stack and this recursion limit (~2,000 terms; libcst's
# parse time grows with the square of an expression's length, so one parse, not a retry)
_DEEP_STACK = 256 << 20
_DEEP_RECURSION = 10_000


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


def given_roots(paths: Iterable[str]) -> list[str]:
    """The real folders a migration of ``paths`` may write in.

    Each folder given, and the folder holding each file given (so a named symlink to a file
    elsewhere is not followed out of it)."""
    roots = []
    for path in paths:
        folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
        roots.append(os.path.realpath(folder))
    return roots


def _inside(real: str, roots: Sequence[str]) -> bool:
    return any(real == root or real.startswith(root.rstrip(os.sep) + os.sep) for root in roots)


def iter_python_files(paths: Iterable[str], skipped: list[tuple[str, str]] | None = None) -> Iterator[str]:
    """The Python files under ``paths`` (see the module docstring); FileNotFoundError for a missing path.

    ``skipped`` (if given) gets (path, why) for each vendored apex folder, each symlinked folder
    not followed (a loop, or a target outside ``paths``), and each file named in ``paths`` that is
    not migrated."""
    paths = list(paths)
    for path in paths:
        if not os.path.lexists(path):
            raise FileNotFoundError(f"no such file or directory: {path}")
    roots = given_roots(p for p in paths if os.path.isdir(p))

    def skip(path: str, why: str) -> None:
        if skipped is not None:
            skipped.append((path, why))

    seen: set[str] = set()
    walked: set[str] = set()  # real folders already walked: each once, however many links lead there
    for path in paths:
        if os.path.islink(path) and not os.path.exists(path):
            candidates = []
            skip(path, _broken_link(path))
        elif os.path.isdir(path):
            if is_vendored_apex(path):
                skip(path, VENDORED_APEX)
                continue
            found = _walk(path, roots, walked, skip)
            # regular files only: opening a FIFO (or a device) named *.py would wait forever
            candidates = [f for f in found if os.path.isfile(f) and is_python_file(f)]
            # a file reached by a symlink and by its own name is yielded under its own name
            candidates.sort(key=lambda f: (os.path.islink(f), f))
        elif not os.path.isfile(path):
            candidates = []
            skip(path, "not a regular file; skipped")
        elif not is_python_file(path):
            candidates = []
            skip(path, "not a Python file (*.py, *.pyw, *.pyi or a #!...python script); skipped")
        else:
            candidates = [path]
        kept = []
        for candidate in candidates:
            real = os.path.realpath(candidate)
            if real not in seen:
                seen.add(real)
                kept.append(candidate)
        yield from sorted(kept)


def _broken_link(path: str) -> str:
    try:
        os.stat(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "a symlink loop; skipped"
    return f"a symlink to {os.readlink(path)}, which does not exist; skipped"


def _walk(top: str, roots: Sequence[str], walked: set[str], skip) -> list[str]:
    """The files below ``top``, its own folders first and then the symlinked folders found in them
    (so a file keeps its own name when a link also leads to it); a link out of ``roots`` or back to
    a folder holding it is reported and not followed."""
    found: list[str] = []
    pending = [top]
    while pending:
        start = pending.pop(0)
        start_real = os.path.realpath(start)
        if start_real in walked:
            continue
        walked.add(start_real)
        links: list[str] = []
        for root, dirs, files in os.walk(start):
            kept = []
            for d in sorted(dirs):
                full = os.path.join(root, d)
                if d.startswith(".") or d in _SKIP_DIRS or _is_venv(full):
                    continue
                if is_vendored_apex(full):
                    skip(full, VENDORED_APEX)
                    continue
                if os.path.islink(full):
                    links.append(full)
                    continue
                walked.add(os.path.realpath(full))
                kept.append(d)
            dirs[:] = kept
            for f in files:
                full = os.path.join(root, f)
                if f.startswith("."):
                    continue
                if os.path.islink(full) and not os.path.exists(full) and is_python_file(full):
                    skip(full, _broken_link(full))
                    continue
                found.append(full)
        for link in sorted(links):
            real = os.path.realpath(link)
            holder = os.path.realpath(os.path.dirname(os.path.abspath(link)))
            if (holder + os.sep).startswith(real.rstrip(os.sep) + os.sep):
                skip(link, f"a symlink loop (to {real}, a folder holding it); not followed")
            elif not _inside(real, roots):
                skip(link, f"a symlink to {real}, outside the folders given; not followed (name it to migrate it)")
            elif real not in walked:
                pending.append(link)
    return found


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


CHANGED_WHILE_MIGRATING = "changed while migrating (saved after migrate read it; kept as saved): run migrate again"


class _Refused(Exception):
    """The file cannot be rewritten without harm (nothing is written); the message says why."""


def _same_file(real: str, before: os.stat_result, digest: bytes, path: str) -> bool:
    """Whether ``path`` still leads to ``real`` and that is still the file that was read."""
    if os.path.realpath(path) != real:
        return False
    try:
        now = os.stat(real)
        if (now.st_dev, now.st_ino, now.st_size, now.st_mtime_ns) != (
            before.st_dev,
            before.st_ino,
            before.st_size,
            before.st_mtime_ns,
        ):
            return False
        with open(real, "rb") as f:
            return hashlib.sha256(f.read(before.st_size + 1)).digest() == digest
    except OSError:
        return False


def _copy_xattrs(real: str, fd: int) -> None:
    """The file's extended attributes (ACLs, SELinux labels, user.*) onto ``fd``; _Refused if one cannot be."""
    if not hasattr(os, "listxattr"):
        return
    try:
        names = os.listxattr(real)
    except OSError:  # a file system without them
        return
    lost = []
    for name in names:
        try:
            value = os.getxattr(real, name)
        except OSError:
            lost.append(name)
            continue
        try:
            os.setxattr(fd, name, value)
        except OSError:
            try:
                if os.getxattr(fd, name) == value:  # the new file got it anyway (a folder's default label)
                    continue
            except OSError:
                pass
            lost.append(name)
    if lost:
        raise _Refused(
            f"its extended attribute{'s' * (len(lost) != 1)} {', '.join(lost)} cannot be given to the rewritten file"
        )


def _write_in_place(path: str, real: str, data: bytes, before: os.stat_result, digest: bytes) -> None:
    """``data`` into ``real`` (``path`` resolved when it was read), atomically: a temporary file
    beside it, with its owner, group, mode and extended attributes, then a rename -- an interrupted
    run never leaves half a file. _Refused (nothing written) if the file changed since it was read."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(real), prefix=".fp16kit-migrate-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            mine = os.fstat(f.fileno())
            if (mine.st_uid, mine.st_gid) != (before.st_uid, before.st_gid):
                try:
                    os.fchown(f.fileno(), before.st_uid, before.st_gid)
                except PermissionError:
                    raise _Refused(
                        f"owned by uid {before.st_uid} gid {before.st_gid}, which this user cannot give "
                        "the rewritten file: run migrate as its owner, or as root"
                    ) from None
            os.fchmod(f.fileno(), stat.S_IMODE(before.st_mode))  # after chown, which clears set-id bits
            _copy_xattrs(real, f.fileno())
        if not _same_file(real, before, digest, path):  # last look: an editor's save is never overwritten
            raise _Refused(CHANGED_WHILE_MIGRATING)
        os.replace(tmp, real)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise


def _write_through(path: str, real: str, data: bytes, before: os.stat_result, digest: bytes) -> None:
    """``data`` into the file itself (the same inode: every hard link sees it; not atomic)."""
    with open(real, "r+b") as f:
        if not _same_file(real, before, digest, path):
            raise _Refused(CHANGED_WHILE_MIGRATING)
        f.write(data)
        f.truncate()


def _refusal(
    real: str, before: os.stat_result, roots: Sequence[str] | None, write_hard_links: bool, write_read_only: bool
) -> str | None:
    if roots is not None and not _inside(real, roots):
        return f"a symlink to {real}, outside the folders given: name {real} itself to migrate it"
    if before.st_nlink > 1 and not write_hard_links:
        return (
            f"a hard-linked file ({before.st_nlink} names; a rewrite would split it from the others): "
            "--write-hard-links rewrites it in place, for all of them"
        )
    if not before.st_mode & stat.S_IWUSR and not write_read_only:
        return f"read-only (mode {stat.S_IMODE(before.st_mode):04o}): --write-read-only rewrites it, keeping the mode"
    return None


def _parse_deep(source: bytes, megatron: bool) -> MigrationResult:
    """_migrate_source in a thread with a deep stack and a high recursion limit: a valid expression
    of a few hundred terms overflows the parser's recursion at python's default limit (the limit is
    the interpreter's, raised while the thread runs; the stack is the thread's own)."""
    box: dict = {}

    def run() -> None:
        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(max(limit, _DEEP_RECURSION))
        try:
            box["result"] = _migrate_source(source, megatron)
        except BaseException as e:  # noqa: BLE001 -- raised again in the caller's thread
            box["error"] = e
        finally:
            sys.setrecursionlimit(limit)

    try:
        size = threading.stack_size(_DEEP_STACK)
    except (ValueError, RuntimeError):  # a platform that cannot size a thread's stack: the default limit
        return _migrate_source(source, megatron)
    try:
        thread = threading.Thread(target=run, name="fp16kit-migrate-deep")
        thread.start()
    finally:
        threading.stack_size(size)
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["result"]


def _migrate_source(source: bytes, megatron: bool) -> MigrationResult:
    # the file's own warnings (an invalid escape such as "\d": a DeprecationWarning or SyntaxWarning
    # when libcst evaluates a literal) are not migrate's, and under `python -W error` they raised
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SyntaxWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        return migrate_source(source, megatron=megatron)


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def migrate_file(
    path: str,
    *,
    megatron: bool = False,
    write: bool = True,
    diff: bool = False,
    roots: Sequence[str] | None = None,
    max_size: int | None = DEFAULT_MAX_SIZE,
    write_hard_links: bool = False,
    write_read_only: bool = False,
) -> FileOutcome:
    """Rewrite one file's apex imports, writing only if ``write``, something changed, and no harm can come.

    Rewrite one file's apex imports; writes only if ``write`` and something changed, and only
    without harm (see the module docstring): otherwise ``error`` says why and nothing is written.
    ``roots`` (real folders, given_roots()): where it may write (None: anywhere); ``max_size``: the
    largest file read, in bytes (None: no limit)."""
    outcome = FileOutcome(path)
    real = os.path.realpath(path)
    try:
        with open(real, "rb") as f:
            before = os.fstat(f.fileno())
            if not stat.S_ISREG(before.st_mode):
                outcome.error = "not a regular file"
                return outcome
            if max_size is not None and before.st_size > max_size:
                outcome.error = (
                    f"{before.st_size} bytes, over the {max_size}-byte limit (a generated file?), "
                    "not read: --max-size BYTES raises the limit"
                )
                return outcome
            source = f.read() if max_size is None else f.read(max_size + 1)
    except OSError as e:
        outcome.error = f"cannot read: {e.strerror or e}"
        return outcome
    if max_size is not None and len(source) > max_size:  # it grew after the look at its size
        outcome.error = f"over the {max_size}-byte limit, not read: --max-size BYTES raises the limit"
        return outcome
    try:
        result: MigrationResult = _parse_deep(source, megatron)
    except MigrationError as e:
        outcome.error, outcome.error_line = e.message, e.line
        return outcome
    except RecursionError:  # deeper than _DEEP_RECURSION allows
        outcome.error = (
            "cannot parse: nested too deeply for the parser (an expression of thousands of terms or "
            "brackets?): split it, or rewrite this file's apex imports by hand"
        )
        return outcome
    except Exception as e:  # noqa: BLE001 -- one file the parser cannot handle must not stop a run
        if b"\0" in source:
            outcome.error_line = source[: source.index(b"\0")].count(b"\n") + 1
            outcome.error = (
                "cannot parse: a NUL byte (python would refuse the file too): remove it, or write it as \\x00"
            )
        else:
            outcome.error = f"cannot migrate: {type(e).__name__}: {_one_line(e)} (rewrite its apex imports by hand)"
        return outcome
    outcome.changed = result.changed
    outcome.imports_rewritten = result.imports_rewritten
    outcome.uses_rewritten = result.uses_rewritten
    outcome.checks_rewritten = result.checks_rewritten
    outcome.unmigratable = result.unmigratable
    if result.changed and diff:
        outcome.diff = _unified_diff(path, source, result.code)  # type: ignore[arg-type]
    if result.changed and write:
        refusal = _refusal(real, before, roots, write_hard_links, write_read_only)
        if refusal is not None:
            outcome.error = refusal
            return outcome
        digest = hashlib.sha256(source).digest()
        try:
            if before.st_nlink > 1:  # only with write_hard_links: keep the inode all its names share
                _write_through(path, real, result.code, before, digest)  # type: ignore[arg-type]
            else:
                _write_in_place(path, real, result.code, before, digest)  # type: ignore[arg-type]
        except _Refused as e:
            outcome.error = str(e)
            return outcome
        except OSError as e:  # a read-only folder or file system: this file is left as it was
            outcome.error = f"cannot write: {e.strerror or e}"
            return outcome
        outcome.written = True
    return outcome
