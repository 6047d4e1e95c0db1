"""``fp16kit run``: run an unmodified apex-era script (or ``-m`` module) as ``python SCRIPT ARGS``
would, with :func:`~fp16kit.migrate.alias.install_apex_alias` in effect.

Contract (what the script sees, and what the caller gets back)::

    sys.argv      = [SCRIPT, *ARGS]           (-m: [the module's file, *ARGS], as runpy sets it)
    sys.path[0]   = the script's directory    (-m: the current directory); unchanged under python -P
                    (a folder or zip file with __main__.py: itself, absolute, even under -P)
    __name__      = "__main__"; __file__ = SCRIPT's absolute path (python >= 3.9); the code runs as
                    sys.modules["__main__"]
    children started by multiprocessing / torch.multiprocessing with "spawn" (tested) or
        "forkserver" install the alias before they re-import the main script, so `import apex`
        works there too ("fork" children inherit it); other processes the script starts
        (subprocess, os.exec*) do not have it: start them with `fp16kit run` too
    returns the exit code:
        normal end 0; SystemExit(None) 0, SystemExit(int n) n, SystemExit(other) str(other) on
        stderr and 1; an uncaught exception: sys.excepthook with the script's own frames only
        (no fp16kit / runpy frames) and 1; KeyboardInterrupt: its traceback and 130
    afterwards sys.argv, sys.path[0], the __main__ module and the alias are as they were

A script that cannot be started (missing file, no such module, a real ``apex`` in the way) raises
:class:`RunError` before anything runs; the command line prints it.
"""

from __future__ import annotations

import builtins
import contextlib
import importlib.machinery
import io
import os
import pkgutil
import runpy
import sys
import types
import zipfile
from collections.abc import Iterator, Sequence
from types import TracebackType
from typing import Any

from . import alias

__all__ = ["RunError", "run_script", "run_module"]

# the frames a traceback drops: this module's and runpy's ("<frozen runpy>" when it is frozen)
_LAUNCHER_FILES = frozenset({__file__, runpy.__file__, runpy.run_path.__code__.co_filename})
# where runpy raises the errors `python -m` reports in one line (private, but the same since 3.4)
_GET_MODULE_DETAILS = getattr(runpy, "_get_module_details", None)
_GET_MODULE_DETAILS = getattr(_GET_MODULE_DETAILS, "__code__", None)


class RunError(Exception):
    """The script could not be started; ``exit_code`` is what python itself would exit with."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def run_script(path: str, args: Sequence[str] = (), *, megatron: bool = False, shadow: bool = False) -> int:
    """``python PATH ARGS`` with the apex alias installed; returns the exit code."""
    if not os.path.exists(path):
        raise RunError(f"can't open file {os.path.abspath(path)!r}: [Errno 2] No such file or directory", 2)
    if os.path.isdir(path) or zipfile.is_zipfile(path):
        # a directory or zip file with __main__.py: python puts it (absolute) first on sys.path
        entry = os.path.abspath(path)
        with _script_environment([path, *args], entry, megatron=megatron, shadow=shadow, archive=True):
            return _call(lambda: _exec_archive_main(entry))
    entry = os.path.dirname(os.path.realpath(path))
    with _script_environment([path, *args], entry, megatron=megatron, shadow=shadow):
        return _call(lambda: _exec_as_main(os.path.abspath(path)))


def _exec_as_main(path: str) -> None:
    """What python does with a script file: compile it under its absolute name (as tracebacks show
    it since 3.9), run it as the module ``__main__`` (so its classes pickle), keep sys.argv[0]."""
    with io.open_code(path) as f:
        source = f.read()  # bytes: compile() honours a BOM or a coding declaration
    code = compile(source, path, "exec", dont_inherit=True)
    main = types.ModuleType("__main__")
    main.__dict__.update(
        __file__=path, __cached__=None, __builtins__=builtins, __package__=None, __spec__=None,
        __loader__=importlib.machinery.SourceFileLoader("__main__", path),
    )
    saved = sys.modules["__main__"]
    sys.modules["__main__"] = main
    try:
        exec(code, main.__dict__)
    finally:
        sys.modules["__main__"] = saved


def _exec_archive_main(entry: str) -> None:
    """What python does with a folder or zip file: run the ``__main__`` module found in it (now
    sys.path[0]) as ``__main__``, with an absolute ``__file__``. (runpy.run_path would put a second,
    relative, entry first on sys.path, which an os.chdir() in the script then broke.)"""
    importer = pkgutil.get_importer(entry)
    spec = importer.find_spec("__main__") if importer is not None else None
    if spec is None or spec.loader is None:
        raise RunError(f"can't find '__main__' module in {entry!r}", 1)
    code = spec.loader.get_code("__main__")  # type: ignore[attr-defined]
    main = types.ModuleType("__main__")
    main.__dict__.update(
        __file__=spec.origin, __cached__=spec.cached, __builtins__=builtins, __package__="", __spec__=spec,
        __loader__=spec.loader,
    )
    saved = sys.modules["__main__"]
    sys.modules["__main__"] = main
    try:
        exec(code, main.__dict__)
    finally:
        sys.modules["__main__"] = saved


def run_module(name: str, args: Sequence[str] = (), *, megatron: bool = False, shadow: bool = False) -> int:
    """``python -m NAME ARGS`` with the apex alias installed; returns the exit code."""
    if not name or name.startswith("."):
        raise RunError(f"Relative module names not supported: {name!r}", 1)
    with _script_environment([name, *args], os.getcwd(), megatron=megatron, shadow=shadow):
        return _call(lambda: _run_module_as_main(name))


def _run_module_as_main(name: str) -> None:
    """runpy.run_module, with what ``python -m`` prints as one line (runpy's own "No module named X",
    "Error while finding module specification ...", "X is a package and cannot be directly executed")
    turned into RunError; an error raised while importing the module's packages keeps its traceback,
    as python's does."""
    try:
        runpy.run_module(name, run_name="__main__", alter_sys=True)
    except ImportError as e:
        codes = []  # the frames from here to where it was raised
        tb = e.__traceback__
        while tb is not None:
            codes.append(tb.tb_frame.f_code)
            tb = tb.tb_next
        # raised by runpy itself for this call (not by a runpy call inside the module's own code)
        if len(codes) > 2 and codes[1] is runpy.run_module.__code__ and all(c is _GET_MODULE_DETAILS for c in codes[2:]):
            raise RunError(str(e), 1) from None
        raise


@contextlib.contextmanager
def _script_environment(
    argv: list[str], entry: str, *, megatron: bool, shadow: bool, archive: bool = False
) -> Iterator[None]:
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = argv
    if not getattr(sys.flags, "safe_path", False):  # python -P (3.11+) adds no script directory
        if sys.path:
            sys.path[0] = entry
        else:
            sys.path.insert(0, entry)
    elif archive:  # ... but always the folder or zip file it runs __main__ from
        sys.path.insert(0, entry)
    try:
        # after sys.path[0] is the script's: a vendored apex/ beside the script counts as a real apex
        alias.install_apex_alias(megatron=megatron, shadow=shadow)
    except RuntimeError as e:
        sys.argv, sys.path[:] = saved_argv, saved_path
        raise RunError(str(e), 2) from None
    try:
        with _alias_in_spawned_children(megatron, shadow):
            yield
    finally:
        alias.uninstall_apex_alias()
        sys.argv = saved_argv
        sys.path[:] = saved_path


def _install_in_child(megatron: bool, shadow: bool) -> None:
    """Unpickled by a spawned child before it re-imports the parent's __main__ (see below)."""
    alias.install_apex_alias(megatron=megatron, shadow=shadow)


class _AliasForChild:
    def __init__(self, megatron: bool, shadow: bool) -> None:
        self.args = (megatron, shadow)

    def __reduce__(self) -> tuple[Any, tuple[bool, bool]]:
        return (_install_in_child, self.args)


@contextlib.contextmanager
def _alias_in_spawned_children(megatron: bool, shadow: bool) -> Iterator[None]:
    # A "spawn"/"forkserver" child unpickles multiprocessing's preparation data, then runs the
    # parent's main script again (as __mp_main__), whose `import apex` needs the alias: an extra
    # entry in that data installs it while it is unpickled (prepare() ignores keys it does not know).
    from multiprocessing import spawn

    original = spawn.get_preparation_data

    def get_preparation_data(name: str) -> dict:
        data = original(name)
        data["fp16kit_apex_alias"] = _AliasForChild(megatron, shadow)
        return data

    spawn.get_preparation_data = get_preparation_data
    try:
        yield
    finally:
        spawn.get_preparation_data = original


def _strip_launcher_frames(tb: TracebackType | None) -> TracebackType | None:
    """Drop the leading runner/runpy frames, so the traceback starts in the script as python's does."""
    while tb is not None and tb.tb_frame.f_code.co_filename in _LAUNCHER_FILES:
        tb = tb.tb_next
    return tb


def _call(run: Any) -> int:
    try:
        run()
    except RunError:
        raise  # the script could not start: the command line prints it
    except SystemExit as e:
        return _system_exit_code(e.code)
    except KeyboardInterrupt as e:
        _report(e)
        return 130
    except BaseException as e:  # noqa: B036 -- the interpreter's top level: report anything, as python does
        _report(e)
        return 1
    return 0


def _system_exit_code(code: Any) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    # python writes a non-integer exit code to stderr and exits with 1
    sys.stderr.write(f"{code}\n")
    sys.stderr.flush()
    return 1


def _report(e: BaseException) -> None:
    tb = _strip_launcher_frames(e.__traceback__)
    e.__traceback__ = tb
    sys.excepthook(type(e), e, tb)
