"""Megatron's fp16util.clip_grad_norm (mpu.clip_grad_norm, docs/apex-others.md §2.4) against its
code written out by hand; model-parallel params across two gloo ranks."""

from __future__ import annotations

import math
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fp16kit.legacy.megatron import clip_grad_norm


def reference(params, max_norm, norm_type=2, rank=0, reduce=lambda t, op: t):
    """Megatron's mpu.clip_grad_norm, by hand (``reduce`` stands for the all-reduce)."""
    params = [p for p in params if p.grad is not None]
    if norm_type == math.inf:
        total = max(p.grad.data.abs().max() for p in params)
        buf = reduce(torch.FloatTensor([float(total)]), "MAX")
        total = buf[0].item()
    else:
        total = 0.0
        for p in params:
            if getattr(p, "model_parallel", False) or rank == 0:
                total += p.grad.data.norm(norm_type).item() ** norm_type
        buf = reduce(torch.FloatTensor([float(total)]), "SUM")
        total = buf[0].item() ** (1.0 / norm_type)
    coef = max_norm / (total + 1e-6)
    if coef < 1:
        for p in params:
            p.grad.data.mul_(coef)
    return total


def make_params(seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    params = []
    for shape in [(7, 3), (5,), (4, 4), (2,)]:
        p = torch.nn.Parameter(torch.zeros(shape, dtype=dtype))
        p.grad = (torch.randn(shape, generator=g) * 3).to(dtype)
        params.append(p)
    params[1].grad = None  # skipped
    params[2].model_parallel = True
    return params


@pytest.mark.parametrize("norm_type", [2, 1, 3.5, math.inf])
@pytest.mark.parametrize("max_norm", [0.5, 1e6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_matches_megatrons_code(norm_type, max_norm, dtype):
    ours, theirs = make_params(1, dtype), make_params(1, dtype)
    total = clip_grad_norm(ours, max_norm, norm_type)
    expected = reference(theirs, max_norm, norm_type)
    assert type(total) is float and total == expected
    for p, q in zip(ours, theirs):
        assert (p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad)


def test_not_torchs_rounding_but_close():
    ours = make_params(2)
    torchs = make_params(2)
    total = clip_grad_norm(ours, 1e9)
    t = torch.nn.utils.clip_grad_norm_([p for p in torchs if p.grad is not None], 1e9)
    assert math.isclose(total, t.item(), rel_tol=1e-6)


def test_no_grads_and_a_single_tensor():
    p = torch.nn.Parameter(torch.ones(3))
    assert clip_grad_norm([p], 1.0) == 0.0
    assert clip_grad_norm([p], 1.0, math.inf) == 0.0
    q = torch.nn.Parameter(torch.ones(3))
    q.grad = torch.full((3,), 4.0)
    expected = reference([q], 1.0)
    p.grad = torch.full((3,), 4.0)
    assert clip_grad_norm(p, 1.0) == expected and torch.equal(p.grad, q.grad)


def _worker(rank, init_file, results):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        group = dist.new_group([0, 1])
        params = make_params(10 + rank)
        ref_params = make_params(10 + rank)

        def reduce(t, op):
            dist.all_reduce(t, op=getattr(dist.ReduceOp, op), group=group)
            return t

        for norm_type in (2, math.inf):
            total = clip_grad_norm(params, 0.5, norm_type, model_parallel_group=group)
            expected = reference(ref_params, 0.5, norm_type, rank=rank, reduce=reduce)
            results[(rank, norm_type)] = (
                total,
                expected,
                all((p.grad is None) or torch.equal(p.grad, q.grad) for p, q in zip(params, ref_params)),
            )
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_model_parallel_ranks_count_shared_params_once():
    with tempfile.TemporaryDirectory() as d:
        manager = mp.Manager()
        results = manager.dict()
        mp.spawn(_worker, args=(os.path.join(d, "init"), results), nprocs=2, join=True)
        got = dict(results)
    assert len(got) == 4
    for (rank, norm_type), (total, expected, grads_equal) in got.items():
        assert total == expected and grads_equal, (rank, norm_type)
    # both ranks agree on the norm (it was all-reduced)
    assert got[(0, 2)][0] == got[(1, 2)][0] and got[(0, math.inf)][0] == got[(1, math.inf)][0]


def test_large_models_are_clipped_in_chunks_with_the_same_numbers(monkeypatch):
    from fp16kit.legacy.megatron import fp16util

    monkeypatch.setattr(fp16util, "_CHUNK", 16)  # the core's multiply works on a float32 copy
    ours, theirs = make_params(3, torch.float16), make_params(3, torch.float16)
    assert clip_grad_norm(ours, 0.5) == reference(theirs, 0.5)
    for p, q in zip(ours, theirs):
        assert (p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad)
