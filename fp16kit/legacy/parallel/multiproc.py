"""apex.parallel.multiproc, apex's launcher, is not provided: torch's ``torchrun`` replaces it.

apex.parallel.multiproc, apex's launcher (``python -m apex.parallel.multiproc train.py ARGS``),
is not provided: torch's ``torchrun`` replaces it. Running this module says how, naming the
script and arguments it was given."""

from __future__ import annotations

import shlex
import sys

__all__ = ["main"]

MESSAGE = (
    "apex.parallel.multiproc is not provided by fp16kit: launch with torch's launcher instead,\n"
    "    torchrun --nproc_per_node=NUM_GPUS {command}\n"
    "torchrun sets RANK, LOCAL_RANK and WORLD_SIZE in the environment (multiproc passed --rank and "
    "--world-size arguments): read them from os.environ and call "
    "torch.distributed.init_process_group(backend, init_method='env://')."
)


def _message(argv: list[str] | None) -> str:
    argv = sys.argv[1:] if argv is None else list(argv)
    return MESSAGE.format(command=shlex.join(argv) if argv else "train.py ARGS")


def main(argv: list[str] | None = None) -> None:
    """Refuse to launch (RuntimeError), naming the torchrun command for ``argv``.

    apex's ``sys.argv[1:]`` by default: the script and its arguments."""
    raise RuntimeError(_message(argv))


if __name__ == "__main__":
    sys.exit(_message(None))
