"""The ``fp16kit`` command line (also ``python -m fp16kit``).

One module per command; each exposes ``register(subparsers)``, which adds its parser and sets
``func`` to the function that runs it (``func(args) -> exit code``). The commands print to
stdout; the library underneath only logs.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from .. import __version__

# the command modules, in the order `fp16kit --help` lists them
_COMMANDS = ("demo", "bench", "migrate", "run", "convert_checkpoint")


class _Formatter(argparse.HelpFormatter):
    """argparse measures the commands without their indent, so a long one (convert-checkpoint)
    pushed its summary onto the next line: count the indent, one line per command."""

    def add_argument(self, action: argparse.Action) -> None:
        super().add_argument(action)
        if action.help is not argparse.SUPPRESS:
            for sub in self._iter_indented_subactions(action):
                width = len(self._format_action_invocation(sub)) + self._current_indent
                self._action_max_length = max(self._action_max_length, width)


def build_parser() -> argparse.ArgumentParser:
    import importlib

    parser = argparse.ArgumentParser(
        prog="fp16kit",
        formatter_class=_Formatter,
        description="Mixed-precision training for PyTorch: apex's API (fp16kit.legacy) and a "
        "torch.amp-style face (fp16kit.GradScaler, MixedPrecisionOptimizer) on one core.",
    )
    parser.add_argument("--version", action="version", version=f"fp16kit {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMANDS:
        importlib.import_module(f"{__name__}.{name}").register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(levelname)s: %(message)s")
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    return func(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
