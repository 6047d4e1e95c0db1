"""A DDP communication hook with apex.parallel.DistributedDataParallel's gradient arithmetic (docs/apex-others.md §4.1).

Per bucket (apex's ``allreduce_bucket``):

    t = bucket.float() if always_fp32 (and the bucket is fp16/bf16) else bucket
    if predivide_factor != 1:  t *= 1 / predivide_factor
    t = all_reduce_sum(t)
    if average:                t *= predivide_factor / world_size
    bucket = t (cast back to the bucket's dtype)

torch's default hook divides by the world size *before* the sum; apex multiplied by
``f / world`` *after* it. For world sizes that are not powers of two the two differ in the
last bit, which is why this hook replaces torch's even with the default arguments.

    ddp.register_comm_hook(ApexAllreduceState(group), apex_allreduce_hook)
"""

# No ``from __future__ import annotations`` here: torch's ``register_comm_hook`` compares the
# hook's annotations with ``dist.GradBucket`` and ``torch.futures.Future[torch.Tensor]`` objects,
# and refuses the strings that import would make of them (hence ``Optional``: Python 3.9).

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["ApexAllreduceState", "apex_allreduce_hook"]


@dataclass
class ApexAllreduceState:
    """What :func:`apex_allreduce_hook` needs: the group and apex's three arguments."""

    process_group: Optional[dist.ProcessGroup] = None
    gradient_average: bool = True
    gradient_predivide_factor: float = 1.0
    allreduce_always_fp32: bool = False

    def __post_init__(self) -> None:
        factor = self.gradient_predivide_factor
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
            raise ValueError(f"gradient_predivide_factor must be a number > 0, got {factor!r}.")


def apex_allreduce_hook(state: ApexAllreduceState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Sum ``bucket`` over ``state.process_group`` with apex's scaling (module docstring)."""
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    factor = state.gradient_predivide_factor
    buffer = bucket.buffer()
    tensor = buffer
    if state.allreduce_always_fp32 and buffer.dtype in (torch.float16, torch.bfloat16):
        tensor = buffer.float()
    if factor != 1.0:
        tensor.mul_(1.0 / factor)
    work = dist.all_reduce(tensor, group=group, async_op=True)

    def finish(fut: torch.futures.Future) -> torch.Tensor:
        fut.value()  # re-raises a failed collective
        reduced = tensor  # all_reduce works in place
        if state.gradient_average:
            reduced.mul_(factor / world)
        if reduced is not buffer:
            buffer.copy_(reduced)
        return buffer

    return work.get_future().then(finish)
