"""Megatron's FP16_Module (spec/apex-others.md §2.1): keys without the ``module.`` prefix,
state_dict_for_save_checkpoint, pipeline stages; and the package's names (Megatron's __init__)."""

from __future__ import annotations

import torch
from torch import nn

import fp16kit.legacy.megatron as megatron
from fp16kit.legacy import fp16util as apex_fp16util
from fp16kit.legacy.megatron import FP16_Module


def test_keys_have_no_module_prefix_and_load_from_a_plain_model():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    model = FP16_Module(nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)))
    assert list(model.state_dict()) == ["0.weight", "0.bias", "1.weight", "1.bias"]
    result = model.load_state_dict(plain.state_dict())
    assert not result.missing_keys and not result.unexpected_keys
    assert model.module[0].weight.dtype == torch.float16
    assert torch.equal(model.module[0].weight, plain[0].weight.half())
    assert list(model.state_dict(prefix="model.")) == ["model.0.weight", "model.0.bias", "model.1.weight", "model.1.bias"]
    assert list(model.state_dict_for_save_checkpoint()) == list(model.state_dict())


def test_state_dict_for_save_checkpoint_asks_a_megatron_module():
    class MegatronModule(nn.Linear):
        def state_dict_for_save_checkpoint(self, destination=None, prefix="", keep_vars=False):
            return {"language_model": self.state_dict(prefix=prefix, keep_vars=keep_vars)}

    model = FP16_Module(MegatronModule(2, 2))
    assert list(model.state_dict_for_save_checkpoint()) == ["language_model"]


def test_casting_and_pipeline_stages():
    lin = nn.Linear(3, 3)
    x = torch.randn(2, 3)
    first = FP16_Module(lin, pipeline_last_stage=False)
    mid = first(x)
    assert mid.dtype == torch.float16  # not the last stage: outputs stay fp16
    last = FP16_Module(nn.Linear(3, 3), pipeline_first_stage=False)
    out = last(mid)
    assert out.dtype == torch.float32
    ids = torch.tensor([1, 2])
    emb = FP16_Module(nn.Embedding(4, 2))
    assert emb(ids).dtype == torch.float32  # integer inputs pass uncast


def test_package_names_as_megatrons_init():
    for name in ("BN_convert_float", "network_to_half", "prep_param_lists", "model_grads_to_master_grads",
                 "master_params_to_model_params", "tofp16", "to_python_float", "clip_grad_norm",
                 "convert_module", "convert_network", "FP16Model", "FP16_Module", "FP16_Optimizer",
                 "fp32_to_fp16", "fp16_to_fp32", "conversion_helper", "LossScaler", "DynamicLossScaler"):
        assert hasattr(megatron, name), name
    assert megatron.prep_param_lists is apex_fp16util.prep_param_lists
    assert megatron.clip_grad_norm is megatron.fp16util.clip_grad_norm
    assert megatron.fp16.FP16_Optimizer is megatron.FP16_Optimizer
    assert megatron.loss_scaler.DynamicLossScaler is megatron.DynamicLossScaler
