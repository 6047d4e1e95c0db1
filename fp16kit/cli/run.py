"""``fp16kit run``: run an unmodified apex-era script with ``import apex`` resolving to fp16kit.legacy.

Beside a real apex >= 25.x, which lacks amp / fp16_utils: only the modules it lacks do."""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from collections.abc import Iterator

# the format fp16kit's command line gives its root handler (fp16kit/cli/__init__.py, main())
_CLI_LOG_FORMAT = "%(name)s: %(levelname)s: %(message)s"

_DESCRIPTION = """\
Run SCRIPT (or -m MODULE, -c COMMAND, - for stdin) exactly as `python SCRIPT ARGS` would -- same
sys.argv, __name__ == "__main__", sys.path[0], exit code and traceback -- with an import hook
that makes `import apex` and every apex module fp16kit covers (apex.amp, apex.fp16_utils,
apex.optimizers, apex.parallel, apex.normalization, apex.contrib.optimizers,
apex.multi_tensor_apply, and the amp_C and apex_C extensions) resolve to fp16kit.legacy.
Availability checks see apex installed: `'apex' in sys.modules` (apex is in sys.modules from
the start), importlib.util.find_spec("apex.amp"), pkgutil.find_loader, and
importlib.metadata.version("apex"), which reports 0.1, as every NVIDIA apex build did.
An apex module fp16kit does not cover raises ImportError naming the closest replacement.
Everything after SCRIPT (or MODULE, COMMAND) goes to the script untouched.

Beside a real apex (importable, or a vendored apex/ package next to SCRIPT):
  NVIDIA apex >= 25.x (NGC containers), which lacks apex.amp and apex.fp16_utils: it is
    complemented -- `import apex` is the installed apex, every module it has stays its own
    (apex.contrib.xentropy, apex.optimizers, apex.normalization, amp_C, ...), and only the covered
    modules it lacks (apex.amp, apex.fp16_utils and their submodules) are fp16kit.legacy's, also
    as attributes (`import apex; apex.amp.initialize(...)` works)
  an apex that still has apex.amp and apex.fp16_utils (before 25.x): refused (exit 2); it does
    not need fp16kit
  --shadow: hide the real apex entirely; all of apex is fp16kit.legacy's

Under torchrun: torchrun --no-python fp16kit run train.py ARGS
In code, the same hook: fp16kit.legacy.install_apex_alias()"""

_EPILOG = """\
exit status: the script's (0, its sys.exit code, 1 after an uncaught exception, 130 after Ctrl-C);
2 when SCRIPT cannot be opened or a real `apex` that has apex.amp is in the way (see --shadow),
1 when MODULE cannot be found."""


def register(sub: argparse._SubParsersAction) -> None:
    run = sub.add_parser(
        "run",
        help="run an unmodified apex script on fp16kit.legacy",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        usage="fp16kit run [-h] [--megatron] [--shadow] (SCRIPT | -m MODULE | -c COMMAND | -) [ARGS ...]",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument(
        "--megatron",
        action="store_true",
        help="also map Megatron-LM v1's `fp16` and `megatron.fp16` packages to fp16kit.legacy.megatron",
    )
    run.add_argument(
        "--shadow",
        action="store_true",
        help="hide a real `apex` (or `fp16`) package entirely: all of apex is fp16kit.legacy's (without it, an apex "
        "lacking apex.amp / apex.fp16_utils is complemented and one that has them is refused)",
    )
    # a flag, not an option with a value: `-m MOD --lr 3` must hand `--lr 3` to MOD, as python does
    run.add_argument("-m", dest="as_module", action="store_true", help="run library module MODULE as a script")
    run.add_argument("-c", dest="as_command", action="store_true", help="run the program passed in as a string")
    run.add_argument(
        "target",
        nargs=argparse.REMAINDER,
        metavar="SCRIPT | MODULE | COMMAND [ARGS ...]",
        help="the script (- reads it from stdin; with -m, the module; with -c, the program) and its arguments",
    )
    run.set_defaults(func=_run, run_parser=run)


def _run(args: argparse.Namespace) -> int:
    from ..migrate.runner import RunError, run_command, run_module, run_script

    target = list(args.target)
    if target[:1] == ["--"]:
        target = target[1:]
    if not target:
        args.run_parser.error("the following arguments are required: SCRIPT (or -m MODULE, -c COMMAND)")
    name, script_args = target[0], target[1:]
    # the process ends with the script: leave what it set up (its __main__, the alias) for its
    # non-daemon threads and atexit handlers, as python does; called in-process, put it all back
    restore = not _is_the_process_entry()
    try:
        with _logging_as_python_leaves_it(restore):
            if args.as_module and args.as_command:
                args.run_parser.error("-m and -c cannot be used together")
            if args.as_module:
                return run_module(name, script_args, megatron=args.megatron, shadow=args.shadow, restore=restore)
            if args.as_command:
                return run_command(name, script_args, megatron=args.megatron, shadow=args.shadow, restore=restore)
            return run_script(name, script_args, megatron=args.megatron, shadow=args.shadow, restore=restore)
    except RunError as e:
        print(f"fp16kit run: {e}", file=sys.stderr)
        return e.exit_code


def _is_the_process_entry() -> bool:
    """Whether this process was started as ``fp16kit ...`` or ``python -m fp16kit ...`` (its
    __main__ is fp16kit's entry point, holding the command line's main())."""
    from . import main

    return getattr(sys.modules.get("__main__"), "main", None) is main


@contextlib.contextmanager
def _logging_as_python_leaves_it(restore: bool) -> Iterator[None]:
    """Take the command line's own root log handler away while the script runs: with it there, the
    script's `logging.basicConfig(level=logging.INFO, format=...)` did nothing (its INFO lines
    vanished, its format was replaced), and fp16kit's warnings were not printed as python prints them."""
    root = logging.getLogger()
    ours = [h for h in root.handlers if getattr(h.formatter, "_fmt", None) == _CLI_LOG_FORMAT]
    level = root.level
    for handler in ours:
        root.removeHandler(handler)
    if ours:
        root.setLevel(logging.WARNING)  # python's default
    try:
        yield
    finally:
        if ours and restore:
            root.setLevel(level)
            for handler in ours:
                root.addHandler(handler)
