"""apex.parallel.sync_batchnorm: ``SyncBatchNorm`` is :class:`fp16kit.nn.SyncBatchNorm`.

apex.parallel.sync_batchnorm (apex's Python fallback module path): ``SyncBatchNorm`` is
fp16kit's one implementation, :class:`fp16kit.nn.SyncBatchNorm`, which also does what the
fallback refused (``channel_last=True``, ``z``, ``fuse_relu``) and weights unequal per-rank
batches by their counts (the fallback averaged the ranks' means with equal weight)."""

from ...nn import SyncBatchNorm

__all__ = ["SyncBatchNorm"]
