"""Collectives over lists of tensors, one flat buffer per (device, dtype) group.

apex's ``flat_dist_call`` (apex.parallel.distributed), which ``apex.parallel.Reducer`` used.

    for each (device, dtype) group of tensors (kernels.group_by_device_and_dtype: devices in
    first-seen order, then dtypes in first-seen order within a device):
        flat = cat(flattened tensors)
        broadcast_coalesced:        broadcast(flat, src)
        all_reduce_mean_coalesced:  all_reduce_sum(flat); flat /= world_size
        copy each slice of flat back into its tensor

Dividing after the sum (not before) is apex's order. Every rank must pass tensors of the
same dtypes and sizes in the same order, as with any collective.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ..core import kernels

__all__ = ["all_reduce_mean_coalesced", "broadcast_coalesced", "call_coalesced"]


def _groups(tensors: Iterable[torch.Tensor]) -> list[list[torch.Tensor]]:
    return [group for per_dtype in kernels.group_by_device_and_dtype(tensors).values() for group in per_dtype.values()]


def _each_flat(tensors, collective, groups=None) -> None:
    for bucket in _groups(tensors) if groups is None else groups:
        flat = _flatten_dense_tensors(bucket)
        collective(flat)
        with torch.no_grad():
            for t, synced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                t.copy_(synced)


@torch.no_grad()
def broadcast_coalesced(tensors: Iterable[torch.Tensor], src: int = 0, group: dist.ProcessGroup | None = None) -> None:
    """Overwrite ``tensors`` on every rank with rank ``src``'s values (in place)."""
    _each_flat(tensors, lambda flat: dist.broadcast(flat, src, group=group))


@torch.no_grad()
def all_reduce_mean_coalesced(tensors: Iterable[torch.Tensor], group: dist.ProcessGroup | None = None) -> None:
    """Replace ``tensors`` on every rank by their mean over the ranks: sum, then ÷ world size."""
    world = dist.get_world_size(group)

    def reduce(flat: torch.Tensor) -> None:
        dist.all_reduce(flat, group=group)
        flat /= world

    _each_flat(tensors, reduce)


@torch.no_grad()
def call_coalesced(tensors: Iterable[torch.Tensor], call, extra_args=None, *, one_bucket: bool = False) -> None:
    """apex's ``flat_dist_call(tensors, call, extra_args)``: one collective per (device, dtype) group.

    ``one_bucket``: its ``apply_flat_dist_call(bucket, ...)``, the tensors already of one type. Per (device,
    dtype) group, ``call(flat, *extra_args)`` on the flattened group; when ``call is dist.all_reduce`` the
    result is divided by the world size (apex's averaging); then copied back into the tensors."""
    tensors = list(tensors)
    extra = () if extra_args is None else tuple(extra_args)

    def collective(flat: torch.Tensor) -> None:
        call(flat, *extra)
        if call is dist.all_reduce:
            flat /= dist.get_world_size()

    _each_flat(tensors, collective, groups=[tensors] if one_bucket and tensors else None)
