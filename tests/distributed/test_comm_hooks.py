"""fp16kit.distributed's arithmetic in one gloo rank, the world size patched so the scaling is
visible (two real ranks: tests/legacy/parallel/test_two_ranks.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from fp16kit.distributed import (
    ApexAllreduceState,
    all_reduce_mean_coalesced,
    apex_allreduce_hook,
    broadcast_coalesced,
    coalesced,
    comm_hooks,
)


class _Bucket:
    def __init__(self, tensor):
        self.tensor = tensor

    def buffer(self):
        return self.tensor


@pytest.mark.parametrize(
    "dtype, fp32", [(torch.float32, False), (torch.float16, True), (torch.float16, False), (torch.bfloat16, True)]
)
@pytest.mark.parametrize("factor, average", [(1.0, True), (3.0, True), (3.0, False), (7.0, True)])
def test_hook_scales_before_and_after_as_apex(gloo_world, monkeypatch, dtype, fp32, factor, average):
    monkeypatch.setattr(comm_hooks.dist, "get_world_size", lambda group=None: 3)
    grads = torch.randn(1000, generator=torch.Generator().manual_seed(0)).to(dtype)
    bucket = _Bucket(grads.clone())
    state = ApexAllreduceState(dist.group.WORLD, average, factor, fp32)
    out = apex_allreduce_hook(state, bucket).wait()
    assert out is bucket.tensor and out.dtype == dtype
    t = grads.float() if fp32 else grads.clone()
    if factor != 1.0:
        t = t * (1.0 / factor)
    if average:  # one rank holds the whole sum here
        t = t * (factor / 3)
    assert torch.equal(out, t.to(dtype))
    if average and factor == 1.0 and dtype == torch.float32:  # torch's default hook divides instead
        assert not torch.equal(out, grads / 3)


def test_state_validates_the_factor():
    for bad in (0, -1.0, "2", True):
        with pytest.raises(ValueError, match="gradient_predivide_factor must be a number > 0"):
            ApexAllreduceState(None, True, bad)


def test_coalesced_collectives_per_dtype(gloo_world, monkeypatch):
    a, b, c = torch.arange(6.0).view(2, 3), torch.ones(4, dtype=torch.float16) * 3, torch.full((2,), 9.0)
    before = [t.clone() for t in (a, b, c)]
    broadcast_coalesced([a, b, c])
    assert all(torch.equal(x, y) for x, y in zip((a, b, c), before))
    monkeypatch.setattr(coalesced.dist, "get_world_size", lambda group=None: 3)
    all_reduce_mean_coalesced([a, b, c])
    assert torch.equal(a, before[0] / 3) and torch.equal(c, before[2] / 3)
    assert b.dtype == torch.float16 and torch.equal(b, before[1] / 3)
