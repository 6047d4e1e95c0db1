"""The fused-era FP16_Optimizer refuses what its optimizers cannot take with a message that says
what to do, before anything changes (house rule 7)."""

from __future__ import annotations

import pytest
import torch

from fp16kit.legacy.contrib.optimizers import FP16_Optimizer, FusedSGD
from fp16kit.legacy.optimizers import FusedAdam


@pytest.mark.parametrize("make", [
    lambda ps: FusedAdam(ps, lr=1e-3, bias_correction=False, max_grad_norm=1.0),
    lambda ps: FusedSGD(ps, lr=1e-3, momentum=0.9),
])
def test_a_sparse_embedding_grad_is_refused_by_name_before_any_change(make):
    emb = torch.nn.Embedding(5, 2, sparse=True).half()
    lin = torch.nn.Linear(2, 2).half()
    opt = FP16_Optimizer(make(list(lin.parameters()) + list(emb.parameters())), dynamic_loss_scale=True,
                         verbose=False)
    opt.backward(lin(emb(torch.tensor([1, 2]))).float().sum())
    before = [p.detach().clone() for p in [*lin.parameters(), *emb.parameters()]]
    masters = [m.detach().clone() for g in opt.fp32_groups for m in g]
    with pytest.raises(RuntimeError, match=r"param 2 of group 0.*sparse.*sparse=False"):
        opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, [*lin.parameters(), *emb.parameters()]))
    assert all(torch.equal(a, m) for a, m in zip(masters, (m for g in opt.fp32_groups for m in g)))
    assert opt.cur_iter == 0 and opt.cur_scale == 2.0**16 and not opt.state
