"""apex.parallel.multiproc, apex's launcher (``python -m apex.parallel.multiproc train.py ARGS``),
is not provided: torch's ``torchrun`` replaces it. Running this module says how."""

from __future__ import annotations

import sys

__all__ = ["main"]

MESSAGE = (
    "apex.parallel.multiproc is not provided by fp16kit: launch with torch's launcher instead,\n"
    "    torchrun --nproc_per_node=NUM_GPUS train.py ARGS\n"
    "torchrun sets RANK, LOCAL_RANK and WORLD_SIZE in the environment (multiproc passed --rank and "
    "--world-size arguments): read them from os.environ and call "
    "torch.distributed.init_process_group(backend, init_method='env://')."
)


def main(argv: list[str] | None = None) -> None:
    """Refuse to launch, naming torchrun (RuntimeError)."""
    raise RuntimeError(MESSAGE)


if __name__ == "__main__":
    sys.exit(MESSAGE)
