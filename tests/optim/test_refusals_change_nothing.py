"""A step that is refused (a sparse grad, an unsupported dtype) raises before any param, grad
or optimizer state changes -- also when the bad param sits in a later param group than params
that could have been stepped already (house rule 7)."""

from __future__ import annotations

import pytest
import torch

from fp16kit.legacy.contrib.optimizers import FusedSGD as ContribFusedSGD
from fp16kit.legacy.optimizers import FusedAdagrad, FusedAdam, FusedLAMB, FusedNovoGrad, FusedSGD
from fp16kit.optim import LAMB, SGD, Adagrad, Adam, LegacyAdam, NovoGrad

CASES = [
    (Adam, {}),
    (LAMB, {}),
    (NovoGrad, {}),
    (Adagrad, {}),
    (LegacyAdam, {}),
    (SGD, dict(lr=0.1, momentum=0.9)),
    (SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.1, wd_after_momentum=True)),
    (FusedAdam, {}),
    (FusedLAMB, {}),
    (FusedNovoGrad, {}),
    (FusedAdagrad, {}),
    (FusedSGD, dict(lr=0.1, momentum=0.9)),
]


def _snapshot(opt, params):
    state = {
        id(p): {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in opt.state[p].items()}
        for p in params
        if p in opt.state
    }
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return [p.detach().clone() for p in params], state, groups


def _same(before, opt, params):
    values, state, groups = before
    assert all(torch.equal(a, p.detach()) for a, p in zip(values, params))
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == groups
    for p in params:
        now = opt.state[p] if p in opt.state else {}
        was = state.get(id(p), {})
        assert now.keys() == was.keys()
        assert all(torch.equal(now[k], was[k]) if isinstance(was[k], torch.Tensor) else now[k] == was[k] for k in was)


@pytest.mark.parametrize("cls,kw", CASES)
def test_a_sparse_grad_in_a_later_group_is_refused_before_any_change(cls, kw):
    half = torch.randn(3, 2, dtype=torch.float16, requires_grad=True)  # SGD: the own (fp32-math) path
    dense = torch.randn(4, requires_grad=True)
    emb = torch.nn.Embedding(6, 2, sparse=True)
    params = [half, dense, emb.weight]
    opt = cls([{"params": [half, dense]}, {"params": [emb.weight]}], **kw)
    for _k in range(2):  # some state first
        half.grad = torch.randn(3, 2).half()
        dense.grad = torch.randn(4)
        emb.weight.grad = torch.randn(6, 2)
        opt.step()
    half.grad = torch.randn(3, 2).half()
    dense.grad = torch.randn(4)
    emb.weight.grad = None
    emb(torch.tensor([1, 3])).sum().backward()
    assert emb.weight.grad.is_sparse
    before = _snapshot(opt, params)
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    _same(before, opt, params)


def test_contrib_fused_sgd_refuses_a_sparse_grad_of_a_later_group_before_any_change():
    half = torch.randn(3, dtype=torch.float16, requires_grad=True)
    other = torch.randn(5, dtype=torch.float16, requires_grad=True)
    opt = ContribFusedSGD([{"params": [half]}, {"params": [other]}], lr=0.1, momentum=0.9)
    out = [[half], [other]]
    opt.step(grads=[[torch.ones(3).half()], [torch.ones(5).half()]], output_params=out, scale=4.0)
    before = _snapshot(opt, [half, other])
    sparse = torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.ones(2), (5,), check_invariants=True).half()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step(grads=[[torch.ones(3).half()], [sparse]], output_params=out, scale=4.0)
    _same(before, opt, [half, other])


STATE_CASES = CASES + [
    (SGD, dict(lr=0.1, momentum=0.9)),  # fp32 params below: torch's own SGD.step
    (ContribFusedSGD, dict(lr=0.1, momentum=0.9)),
    (LegacyAdam, dict(max_grad_norm=1.0)),
]


@pytest.mark.parametrize("fp32", [False, True])
@pytest.mark.parametrize("cls,kw", STATE_CASES)
def test_a_bad_state_shape_in_a_later_group_is_refused_before_any_change(cls, kw, fp32):
    """A loaded state of the wrong shape in group 1 raises before group 0's params, its step
    count or any state changes (review item 5: group 0 used to step first)."""
    dtype = torch.float32 if fp32 else torch.float16
    gen = torch.Generator().manual_seed(0)
    first = torch.randn(3, 2, generator=gen).to(dtype).requires_grad_()
    second = torch.randn(4, generator=gen).to(dtype).requires_grad_()
    params = [first, second]
    opt = cls([{"params": [first]}, {"params": [second]}], **kw)

    def step():
        grads = [torch.randn(3, 2, generator=gen).to(dtype), torch.randn(4, generator=gen).to(dtype)]
        if cls is ContribFusedSGD:
            opt.step(grads=[[grads[0]], [grads[1]]], output_params=[[first], [second]], scale=2.0)
        else:
            first.grad, second.grad = grads
            opt.step()

    step()
    step()
    state = opt.state[second]
    bad = [k for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() > 0]
    assert bad, state.keys()
    for k in bad:
        state[k] = torch.zeros(5, dtype=state[k].dtype)
    before = _snapshot(opt, params)
    with pytest.raises(RuntimeError, match="shape"):
        step()
    _same(before, opt, params)


def test_sgd_steps_complex_params_as_torch_does():
    """A complex param went down the fp32-math path (complex64 is not its own work dtype) and
    lost its imaginary part: torch's SGD.step handles it, exactly as torch.optim.SGD."""
    p = torch.tensor([1 + 2j, -0.5 + 0.25j], requires_grad=True)
    ref = p.detach().clone().requires_grad_()
    opt, ref_opt = (
        SGD([p], lr=0.1, momentum=0.9, weight_decay=0.01),
        torch.optim.SGD([ref], lr=0.1, momentum=0.9, weight_decay=0.01),
    )
    for k in range(3):
        p.grad = torch.tensor([1 + 1j, 2 - 3j]) * (k + 1)
        ref.grad = p.grad.clone()
        opt.step()
        ref_opt.step()
    assert torch.equal(p.detach(), ref.detach())
    assert torch.equal(opt.state[p]["momentum_buffer"], ref_opt.state[ref]["momentum_buffer"])


@pytest.mark.parametrize("kw,with_half", [(dict(weight_decay=0.1, wd_after_momentum=True), False), ({}, True)])
def test_sgd_refuses_complex_params_on_its_own_path_before_any_change(kw, with_half):
    c = torch.tensor([1 + 2j], requires_grad=True)
    half = torch.randn(3, dtype=torch.float16, requires_grad=True)
    params = [half, c] if with_half else [c]
    opt = SGD(params, lr=0.1, momentum=0.9, **kw)
    for p in params:
        p.grad = torch.ones_like(p)
    before = _snapshot(opt, params)
    with pytest.raises(RuntimeError, match="complex64"):
        opt.step()
    _same(before, opt, params)
