"""apex.parallel.optimized_sync_batchnorm: ``SyncBatchNorm`` is :class:`fp16kit.nn.SyncBatchNorm`.

apex.parallel.optimized_sync_batchnorm (apex's CUDA-extension module path): ``SyncBatchNorm``
is :class:`fp16kit.nn.SyncBatchNorm` (count-weighted statistics over all ranks, unbiased running
variance, ``channel_last``, ``forward(input, z=None)`` with ``fuse_relu``), on any device."""

from ...nn import SyncBatchNorm

__all__ = ["SyncBatchNorm"]
