"""No host-to-device tensor per step (review item 6): NovoGrad makes the index tensors of its
two-tensor norm layout once per group layout; LegacyAdam fills a Python ``scale`` / grad norm
in on the device instead of making a host tensor and copying it at every step."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from fp16kit.optim import LegacyAdam, NovoGrad


@pytest.fixture
def no_host_tensors(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a host tensor was made on the step path")

    def as_tensor(value, *a, **k):
        if not isinstance(value, torch.Tensor):
            refuse()
        return original_as_tensor(value, *a, **k)

    original_as_tensor = torch.as_tensor

    def arm():
        monkeypatch.setattr(torch, "tensor", refuse)
        monkeypatch.setattr(torch, "as_tensor", as_tensor)

    return arm


def _mixed_params(gen):
    return [
        torch.randn(3, generator=gen).half().requires_grad_(),
        torch.randn(4, generator=gen).requires_grad_(),
        torch.randn(2, generator=gen).bfloat16().requires_grad_(),
    ]


@pytest.mark.parametrize("norm_type", [0, 2])
def test_novograd_makes_its_index_tensors_once(no_host_tensors, norm_type):
    gen = torch.Generator().manual_seed(0)
    params = _mixed_params(gen)
    opt = NovoGrad(params, lr=1e-2, norm_type=norm_type)

    def step(o, ps):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        o.step()

    step(opt, params)
    step(opt, params)  # the layout's index tensors now exist
    no_host_tensors()
    for _ in range(3):
        step(opt, params)
    assert [t.numel() for t in opt.param_groups[0]["exp_avg_sq"]] == [2, 1]
    # the cache is private: a copy or a pickle starts its own
    clone = copy.deepcopy(opt)
    assert "_index_cache" not in pickle.loads(pickle.dumps(opt)).__dict__
    assert "_index_cache" not in clone.__dict__


def test_novograd_indexes_each_layout_by_its_own_params():
    """Two groups of different layouts, one optimizer: each group's norms stay its own."""
    gen = torch.Generator().manual_seed(1)
    a, b = _mixed_params(gen), [torch.randn(5, generator=gen).requires_grad_()]
    opt = NovoGrad([{"params": a}, {"params": b}], lr=1e-2)
    for _ in range(3):
        for p in a + b:
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        opt.step()
    assert [t.numel() for t in opt.param_groups[0]["exp_avg_sq"]] == [2, 1]
    assert [t.numel() for t in opt.param_groups[1]["exp_avg_sq"]] == [0, 1]


@pytest.mark.parametrize("max_grad_norm", [0.0, 1.0])
def test_legacy_adam_python_scale_and_norms_make_no_host_tensor(no_host_tensors, max_grad_norm):
    gen = torch.Generator().manual_seed(2)
    params = [torch.randn(3, generator=gen).requires_grad_(), torch.randn(2, generator=gen).requires_grad_()]
    opt = LegacyAdam([{"params": params[:1]}, {"params": params[1:]}], lr=1e-2, max_grad_norm=max_grad_norm)
    grads = [[torch.randn(3, generator=gen)], [torch.randn(2, generator=gen)]]
    no_host_tensors()
    opt.step(grads=grads, scale=8.0, grad_norms=[30.0, 0.5])
    opt.step(grads=grads)  # scale=1.0, norms computed on the device
    assert all(opt.state[p]["step"] == 2 for p in params)
