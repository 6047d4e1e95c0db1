"""apex.parallel on torch.distributed (docs/apex-others.md §4.1-4.4).

Change ``from apex.parallel import ...`` / ``import apex.parallel`` to ``fp16kit.legacy.parallel``:

- ``DistributedDataParallel``: torch's DDP with apex's arguments and gradient arithmetic;
- ``Reducer``: apex's manual broadcast + gradient averaging;
- ``SyncBatchNorm``, ``convert_syncbn_model``, ``create_syncbn_process_group``;
- ``ReduceOp`` (``torch.distributed.ReduceOp``); ``LARC`` (the module, as in apex:
  ``from fp16kit.legacy.parallel.LARC import LARC``).

``convert_syncbn_model`` follows torch's ``convert_sync_batchnorm`` (FIX): the new modules reuse
the old Parameters, so an optimizer built before conversion still trains them, and eval mode
is kept. ``apex.parallel.multiproc`` is replaced by ``torchrun`` (running
``python -m fp16kit.legacy.parallel.multiproc`` says how).
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from ...nn import convert_sync_batchnorm
from . import LARC
from .distributed import DistributedDataParallel, Reducer
from .optimized_sync_batchnorm import SyncBatchNorm

__all__ = [
    "DistributedDataParallel",
    "LARC",
    "ReduceOp",
    "Reducer",
    "SyncBatchNorm",
    "convert_syncbn_model",
    "create_syncbn_process_group",
]

ReduceOp = dist.ReduceOp


def convert_syncbn_model(
    module: nn.Module, process_group: dist.ProcessGroup | None = None, channel_last: bool = False
) -> nn.Module:
    """Convert every ``_BatchNorm`` in ``module`` into a :class:`SyncBatchNorm` sharing its state.

    Every ``_BatchNorm`` in ``module`` (never InstanceNorm) becomes a :class:`SyncBatchNorm`
    sharing its Parameters, running statistics, ``num_batches_tracked`` and train/eval mode.
    Returns the converted module; use the return value (a top-level BatchNorm is replaced)."""
    return convert_sync_batchnorm(module, process_group, channel_last)


def create_syncbn_process_group(group_size: int) -> dist.ProcessGroup | None:
    """Create the process groups of ``group_size`` consecutive ranks; return this rank's (None: the world).

    ``group_size`` 0: None (the whole world). Else every rank creates all groups of
    ``group_size`` consecutive ranks (a collective: call it on every rank) and gets its own."""
    if group_size == 0:
        return None
    world_size = dist.get_world_size()
    if not 0 < group_size <= world_size or world_size % group_size != 0:
        raise ValueError(
            f"create_syncbn_process_group({group_size}): the world size {world_size} must be a multiple of "
            f"group_size (1 <= group_size <= {world_size}); pass a divisor of {world_size}, or 0 for one group."
        )
    rank = dist.get_rank()
    group = None
    for start in range(0, world_size, group_size):
        ranks = list(range(start, start + group_size))
        new = dist.new_group(ranks=ranks)
        if rank // group_size == start // group_size:
            group = new
    return group
