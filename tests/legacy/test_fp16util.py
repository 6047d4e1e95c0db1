"""apex's fp16util helpers under fp16kit.legacy."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fp16kit.legacy as legacy
from fp16kit.legacy import (
    BN_convert_float,
    FP16Model,
    clip_grad_norm,
    convert_module,
    convert_network,
    master_params_to_model_params,
    model_grads_to_master_grads,
    network_to_half,
    prep_param_lists,
    tofp16,
)


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 3))


def test_exports_and_submodules():
    names = [
        "FP16_Optimizer",
        "LossScaler",
        "DynamicLossScaler",
        "prep_param_lists",
        "model_grads_to_master_grads",
        "master_params_to_model_params",
        "FP16Model",
        "network_to_half",
        "BN_convert_float",
        "tofp16",
        "convert_module",
        "convert_network",
        "clip_grad_norm",
        "to_python_float",
    ]
    for n in names:
        assert hasattr(legacy, n), n
    ns = {}
    exec("from fp16kit.legacy import *", ns)
    assert all(n in ns for n in names + ["fp16util", "fp16_optimizer", "loss_scaler"])
    assert clip_grad_norm is torch.nn.utils.clip_grad_norm_


def test_tofp16_and_network_to_half():
    assert tofp16()(torch.ones(2)).dtype == torch.float16
    net = network_to_half(_net())
    assert isinstance(net, nn.Sequential) and isinstance(net[0], tofp16)
    assert net[1][0].weight.dtype == torch.float16
    assert net[1][1].weight.dtype == torch.float32  # affine BN back to fp32
    assert list(net.state_dict())[0].startswith("1.")


def test_bn_convert_float_skips_non_affine():
    net = nn.Sequential(nn.BatchNorm1d(3, affine=False), nn.BatchNorm2d(3)).half()
    BN_convert_float(net)
    assert net[0].running_mean.dtype == torch.float16
    assert net[1].weight.dtype == torch.float32


def test_convert_module_and_network():
    lin = nn.Linear(2, 2)
    lin.weight.grad = torch.ones(2, 2)
    convert_module(lin, torch.bfloat16)
    assert lin.weight.dtype == lin.weight.grad.dtype == lin.bias.dtype == torch.bfloat16
    net = convert_network(_net(), torch.float16)
    assert net[0].weight.dtype == torch.float16 and net[1].weight.dtype == torch.float32
    rnn = convert_network(nn.LSTM(3, 4), torch.float16)
    assert rnn.weight_ih_l0.dtype == torch.float16


def test_fp16model_casts_only_floating_inputs():
    class Embed(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 4)

        def forward(self, ids, scale):
            return self.emb(ids) * scale

    m = FP16Model(Embed())
    out = m(torch.tensor([1, 2, 3]), torch.tensor(2.0))
    assert out.dtype == torch.float16  # ids stayed int64 (apex cast them and broke)


@pytest.mark.parametrize("flat", [False, True])
def test_prep_param_lists_and_grad_round_trip(flat):
    net = _net().half()
    net[1].weight.requires_grad_(False)
    model_params, master_params = prep_param_lists(net, flat_master=flat)
    assert len(model_params) == 5
    if flat:
        (m,) = master_params
        assert (
            isinstance(m, nn.Parameter)
            and m.dtype == torch.float32
            and m.numel() == sum(p.numel() for p in model_params)
        )
        assert torch.equal(m.grad, torch.zeros_like(m))
    else:
        assert all(m.dtype == torch.float32 and m.requires_grad for m in master_params)
    for p in model_params:
        p.grad = torch.randn_like(p)
    model_grads_to_master_grads(model_params, master_params, flat_master=flat)
    got = master_params[0].grad if flat else torch.cat([m.grad.reshape(-1) for m in master_params])
    want = torch.cat([p.grad.float().reshape(-1) for p in model_params])
    assert torch.equal(got, want)
    with torch.no_grad():
        for m in master_params:
            m.add_(0.01)
    master_params_to_model_params(model_params, master_params, flat_master=flat)
    vals = torch.cat([p.detach().float().reshape(-1) for p in model_params])
    src = master_params[0].detach() if flat else torch.cat([m.detach().reshape(-1) for m in master_params])
    assert torch.equal(vals, src.half().float())


def test_missing_model_grad_clears_master_grad():
    net = nn.Linear(2, 2).half()
    model_params, master_params = prep_param_lists(net)
    model_params[0].grad = torch.ones(2, 2, dtype=torch.half)
    master_params[1].grad = torch.ones(2)
    model_grads_to_master_grads(model_params, master_params)
    assert master_params[1].grad is None and master_params[0].grad is not None


def test_flat_master_needs_one_dtype():
    net = _net()
    net[0].half()
    with pytest.raises(TypeError, match="one dtype"):
        prep_param_lists(net, flat_master=True)
