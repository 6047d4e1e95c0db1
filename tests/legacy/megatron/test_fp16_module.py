"""Megatron's FP16_Module (docs/apex-others.md §2.1): keys without the ``module.`` prefix,
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
    assert list(model.state_dict(prefix="model.")) == [
        "model.0.weight",
        "model.0.bias",
        "model.1.weight",
        "model.1.bias",
    ]
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
    for name in (
        "BN_convert_float",
        "network_to_half",
        "prep_param_lists",
        "model_grads_to_master_grads",
        "master_params_to_model_params",
        "tofp16",
        "to_python_float",
        "clip_grad_norm",
        "convert_module",
        "convert_network",
        "FP16Model",
        "FP16_Module",
        "FP16_Optimizer",
        "fp32_to_fp16",
        "fp16_to_fp32",
        "conversion_helper",
        "LossScaler",
        "DynamicLossScaler",
    ):
        assert hasattr(megatron, name), name
    assert megatron.prep_param_lists is apex_fp16util.prep_param_lists
    assert megatron.clip_grad_norm is megatron.fp16util.clip_grad_norm
    assert megatron.fp16.FP16_Optimizer is megatron.FP16_Optimizer
    assert megatron.loss_scaler.DynamicLossScaler is megatron.DynamicLossScaler


def _net(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))


def _assert_loaded(target, source):
    for (name, a), (_, b) in zip(target.state_dict().items(), source.state_dict().items()):
        assert torch.equal(a, b), name


def test_a_wrapped_fp16_module_loads_what_its_wrapper_saved():
    """torch's loader reaches a nested FP16_Module by recursion and expects ``module.`` keys;
    its state_dict wrote none: the keys the wrapper saved must load back (Megatron's raised
    "Missing key(s)")."""

    class Outer(nn.Module):
        def __init__(self, seed):
            super().__init__()
            self.inner = FP16_Module(_net(seed))
            self.head = nn.Linear(2, 2)

    saved, fresh = Outer(0), Outer(1)
    assert list(saved.state_dict())[:2] == ["inner.0.weight", "inner.0.bias"]
    result = fresh.load_state_dict(saved.state_dict())
    assert not result.missing_keys and not result.unexpected_keys
    _assert_loaded(fresh, saved)

    # nn.DataParallel (on the CPU it just holds the module): keys "module.<key>"
    dp_saved, dp_fresh = nn.DataParallel(FP16_Module(_net(0))), nn.DataParallel(FP16_Module(_net(1)))
    dp_fresh.load_state_dict(dp_saved.state_dict())
    _assert_loaded(dp_fresh, dp_saved)

    # the child itself has a submodule named "module" (Megatron's LocalDDP inside)
    class LocalDDP(nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module

    nested_saved = nn.Sequential(FP16_Module(LocalDDP(_net(0))))
    nested_fresh = nn.Sequential(FP16_Module(LocalDDP(_net(1))))
    assert list(nested_saved.state_dict())[0] == "0.module.0.weight"
    nested_fresh.load_state_dict(nested_saved.state_dict())
    _assert_loaded(nested_fresh, nested_saved)


def test_a_wrapped_fp16_module_still_loads_prefixed_keys_and_reports_wrong_ones():
    saved = nn.Sequential(FP16_Module(_net(0)))
    fresh = nn.Sequential(FP16_Module(_net(1)))
    # torch's own layout (e.g. written by apex's 2018 FP16_Module): "0.module.<key>"
    prefixed = {"0.module." + k: v for k, v in saved[0].module.state_dict().items()}
    fresh.load_state_dict(prefixed)
    _assert_loaded(fresh, saved)
    wrong = {"0.nope." + k: v for k, v in saved[0].module.state_dict().items()}
    result = nn.Sequential(FP16_Module(_net(2))).load_state_dict(wrong, strict=False)
    assert "0.module.0.weight" in result.missing_keys and "0.nope.0.weight" in result.unexpected_keys
