"""``fp16kit run``: run an unmodified apex-era script (or ``-m`` module) with the apex alias installed.

``fp16kit run``: run an unmodified apex-era script (or ``-m`` module) as ``python SCRIPT ARGS``
would, with :func:`~fp16kit.legacy.apex_alias.finder.install_apex_alias` in effect.

Contract (what the script sees, and what the caller gets back)::

    sys.argv      = [SCRIPT, *ARGS]           (-m: [the module's file, *ARGS], as runpy sets it; -c: ["-c",
                                              *ARGS]; stdin: ["-", *ARGS])
    sys.path[0]   = the script's directory    (-m: the current directory; -c and stdin: ""); unchanged
                                              under python -P
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
    afterwards sys.argv, sys.path[0], the __main__ module and the alias are as they were (restore=False,
        for a process that ends with the script: left in place for its threads and atexit handlers)

Beside a real apex lacking apex.amp / apex.fp16_utils (NVIDIA apex >= 25.x) the alias complements it
(the script's ``import apex`` is the real one; only the covered modules it lacks are fp16kit's); a
real apex that has them is in the way unless ``shadow=True`` (see :mod:`fp16kit.legacy.apex_alias.finder`).

A script that cannot be started (missing file, no such module, a real apex with apex.amp in the way) raises
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

from ..legacy.apex_alias import finder as alias

__all__ = ["RunError", "run_script", "run_module", "run_command"]

# the frames a traceback drops: this module's and runpy's ("<frozen runpy>" when it is frozen)
_LAUNCHER_FILES = frozenset({__file__, runpy.__file__, runpy.run_path.__code__.co_filename})
# runpy's lookup for `python -m` (private, but the same since 3.4), where it raises the errors
# python reports in one line
_GET_MODULE_DETAILS_FUNC: Any = runpy._get_module_details  # type: ignore[attr-defined]
_GET_MODULE_DETAILS = _GET_MODULE_DETAILS_FUNC.__code__


class RunError(Exception):
    """The script could not be started; ``exit_code`` is what python itself would exit with."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def run_script(
    path: str, args: Sequence[str] = (), *, megatron: bool = False, shadow: bool = False, restore: bool = True
) -> int:
    """``python PATH ARGS`` with the apex alias installed; returns the exit code.

    ``restore=False`` (the command line, whose process ends next) leaves the script's __main__,
    sys.argv, sys.path and the alias in place, as python does until exit: its non-daemon threads and
    atexit handlers still pickle its classes and import apex."""
    if path == "-":  # python - : the script is read from stdin
        return _run_source(sys.stdin.read(), "<stdin>", ["-", *args], megatron, shadow, restore)
    if not os.path.exists(path):
        raise RunError(f"can't open file {os.path.abspath(path)!r}: [Errno 2] No such file or directory", 2)
    if os.path.isdir(path) or zipfile.is_zipfile(path):
        # a directory or zip file with __main__.py: python puts it (absolute) first on sys.path
        entry = os.path.abspath(path)
        with _script_environment([path, *args], entry, megatron=megatron, shadow=shadow, restore=restore, archive=True):
            return _call(lambda: _exec_as_main(*_archive_main(entry), restore=restore))
    entry = os.path.dirname(os.path.realpath(path))
    with _script_environment([path, *args], entry, megatron=megatron, shadow=shadow, restore=restore):
        return _call(lambda: _exec_as_main(*_script_main(os.path.abspath(path)), restore=restore))


def run_command(
    command: str, args: Sequence[str] = (), *, megatron: bool = False, shadow: bool = False, restore: bool = True
) -> int:
    """``python -c COMMAND ARGS`` with the apex alias installed; returns the exit code.

    ``restore``: as for :func:`run_script`."""
    return _run_source(command, "<string>", ["-c", *args], megatron, shadow, restore)


def _run_source(source: str, filename: str, argv: list[str], megatron: bool, shadow: bool, restore: bool) -> int:
    """python -c / python - : sys.path[0] is "" (the current directory, unless python -P), no __file__."""
    attrs: dict[str, Any] = dict(__package__=None, __spec__=None, __loader__=importlib.machinery.BuiltinImporter)
    if filename == "<stdin>":
        attrs.update(__file__=filename, __cached__=None)
    with _script_environment(argv, "", megatron=megatron, shadow=shadow, restore=restore):
        # compiled inside _call: a SyntaxError is reported as python reports it
        return _call(
            lambda: _exec_as_main(compile(source, filename, "exec", dont_inherit=True), attrs, restore=restore)
        )


def _script_main(path: str) -> tuple[types.CodeType, dict[str, Any]]:
    """What python does with a script file: compile it under its absolute name (as tracebacks show
    it since 3.9); sys.argv[0] stays as typed."""
    with io.open_code(path) as f:
        source = f.read()  # bytes: compile() honours a BOM or a coding declaration
    code = compile(source, path, "exec", dont_inherit=True)
    return code, dict(
        __file__=path,
        __cached__=None,
        __package__=None,
        __spec__=None,
        __loader__=importlib.machinery.SourceFileLoader("__main__", path),
    )


def _archive_main(entry: str) -> tuple[types.CodeType, dict[str, Any]]:
    """What python does with a folder or zip file: the ``__main__`` module found in it (now
    sys.path[0]), with an absolute ``__file__``. (runpy.run_path would put a second, relative,
    entry first on sys.path, which an os.chdir() in the script then broke.)"""
    importer = pkgutil.get_importer(entry)
    spec = importer.find_spec("__main__") if importer is not None else None
    if spec is None or spec.loader is None:
        raise RunError(f"can't find '__main__' module in {entry!r}", 1)
    code = spec.loader.get_code("__main__")  # type: ignore[attr-defined]
    return code, dict(
        __file__=spec.origin, __cached__=spec.cached, __package__="", __spec__=spec, __loader__=spec.loader
    )


def _exec_as_main(code: types.CodeType, attrs: dict[str, Any], *, restore: bool) -> None:
    """Run ``code`` as a fresh module ``__main__`` (so the classes it defines pickle)."""
    main = types.ModuleType("__main__")
    main.__dict__.update(attrs, __builtins__=builtins)
    saved = sys.modules["__main__"]
    sys.modules["__main__"] = main
    try:
        exec(code, main.__dict__)
    finally:
        if restore:
            sys.modules["__main__"] = saved


def run_module(
    name: str, args: Sequence[str] = (), *, megatron: bool = False, shadow: bool = False, restore: bool = True
) -> int:
    """``python -m NAME ARGS`` with the apex alias installed; returns the exit code.

    ``restore``: as for :func:`run_script`."""
    if not name or name.startswith("."):
        raise RunError(f"Relative module names not supported: {name!r}", 1)
    with _script_environment([name, *args], os.getcwd(), megatron=megatron, shadow=shadow, restore=restore):
        return _call(lambda: _exec_as_main(*_module_main(name), restore=restore))


def _module_main(name: str) -> tuple[types.CodeType, dict[str, Any]]:
    """What ``python -m`` finds (runpy's lookup: a package runs its __main__), with what it prints as
    one line ("No module named X", "Error while finding module specification ...", "X is a package
    and cannot be directly executed") turned into RunError; an error raised while importing the
    module's packages keeps its traceback, as python's does. sys.argv[0] becomes the module's file."""
    try:
        _, spec, code = _GET_MODULE_DETAILS_FUNC(name)
    except ImportError as e:
        codes = []  # the frames from here to where it was raised
        tb = e.__traceback__
        while tb is not None:
            codes.append(tb.tb_frame.f_code)
            tb = tb.tb_next
        if len(codes) > 1 and all(c is _GET_MODULE_DETAILS for c in codes[1:]):  # runpy's own message
            raise RunError(str(e), 1) from None
        raise
    sys.argv[0] = spec.origin
    return code, dict(
        __file__=spec.origin, __cached__=spec.cached, __package__=spec.parent, __spec__=spec, __loader__=spec.loader
    )


@contextlib.contextmanager
def _script_environment(
    argv: list[str], entry: str, *, megatron: bool, shadow: bool, restore: bool, archive: bool = False
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
    spawn_hook = _alias_in_spawned_children(megatron, shadow)
    spawn_hook.__enter__()
    try:
        yield
    finally:
        if restore:
            spawn_hook.__exit__(None, None, None)
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
