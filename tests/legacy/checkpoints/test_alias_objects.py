"""Whole apex objects (``torch.save(model)`` / ``torch.save(optimizer)``, as 2018-2020 scripts
saved them) read with the FULL unpickler under fp16kit's apex alias (``fp16kit run``): each
becomes fp16kit's class of the same apex path with the apex object's attributes, and must work
as one fp16kit built with the same settings -- the same numbers, bit for bit -- or be refused
when loaded, naming the fix, never a half-built object that fails later.

apex is not installed: each file is written from a stand-in class registered under apex's
module path (the ``stand_ins`` fixture, conftest.py) holding exactly the attributes apex's
``__init__`` set -- and, where apex's class defined one, apex's own ``__getstate__`` -- and the
stand-ins are removed before the alias is installed, as on a machine without apex.
"""

from __future__ import annotations

import copy
import importlib
import io
import pickle
import sys

import pytest
import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from fp16kit.legacy import fp16_module, optimizers
from fp16kit.legacy.apex_alias import install_apex_alias, uninstall_apex_alias
from fp16kit.legacy.fp16util import FP16Model, network_to_half, tofp16
from fp16kit.legacy.normalization import FusedLayerNorm, FusedRMSNorm, MixedFusedLayerNorm, MixedFusedRMSNorm
from fp16kit.legacy.parallel import DistributedDataParallel
from fp16kit.nn import SyncBatchNorm
from fp16kit.optim import Adam


@pytest.fixture
def alias():
    """The apex alias, installed by :func:`_apex_file`, is removed afterwards."""
    yield
    uninstall_apex_alias()


def _apex_file(stand_ins, obj) -> bytes:
    """``torch.save(obj)`` while the stand-ins are registered; then they are removed (no apex
    here) and fp16kit's apex alias is installed, as ``fp16kit run`` does."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    stand_ins.remove()
    assert not any(name == "apex" or name.startswith("apex.") for name in sys.modules)
    install_apex_alias()
    return buf.getvalue()


def _full_load(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=False)


def _apex_module(stand_ins, path: str, base: type, attrs: dict, init=None) -> nn.Module:
    """An object of a stand-in of apex's ``path`` (an ``nn.Module`` subclass of ``base``),
    initialised as apex's ``__init__`` did: ``init(obj)`` (default ``nn.Module.__init__``),
    then apex's plain attributes ``attrs``."""
    cls = stand_ins.add(path, bases=(base,))
    obj = cls.__new__(cls)
    (init or nn.Module.__init__)(obj)
    obj.__dict__.update(attrs)
    return obj


def _same_tensors(a, b) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


# ------------------------------------------------------------------------- 2018 FP16_Module


def test_a_2018_fp16_module_pickled_whole_runs_in_fp16(stand_ins, alias):
    """apex's first FP16_Module (until 2018-07) lived in apex/fp16_utils/fp16_optimizer.py, so
    ``torch.save(model)`` named apex.fp16_utils.fp16_optimizer.FP16_Module (this failed with
    AttributeError when loaded); its keys carry the ``module.`` prefix."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 3))
    reference = fp16_module.FP16_Module(copy.deepcopy(net))
    apex_model = _apex_module(stand_ins, "apex.fp16_utils.fp16_optimizer.FP16_Module", nn.Module, {})
    apex_model.add_module("module", net.half())
    data = _apex_file(stand_ins, {"model": apex_model, "epoch": 3})
    loaded = _full_load(data)["model"]

    assert type(loaded) is fp16_module.FP16_Module
    x = torch.randn(6, 5, generator=torch.Generator().manual_seed(1))
    out, want = loaded(x), reference(x)
    assert out.dtype == torch.float32 and torch.equal(out, want)
    _same_tensors(loaded.state_dict(), reference.state_dict())
    assert next(iter(loaded.state_dict())) == "module.0.weight"
    out.sum().backward()
    want.sum().backward()
    assert all(
        p.grad.dtype == torch.float16 and torch.equal(p.grad, q.grad)
        for p, q in zip(loaded.parameters(), reference.parameters())
    )
    # the 2018 script's own imports resolve to the same objects
    old = importlib.import_module("apex.fp16_utils.fp16_optimizer")
    assert (old.FP16_Module, old.fp32_to_fp16, old.fp16_to_fp32, old.conversion_helper) == (
        fp16_module.FP16_Module,
        fp16_module.fp32_to_fp16,
        fp16_module.fp16_to_fp32,
        fp16_module.conversion_helper,
    )


# ---------------------------------------------------------------------------------- LARC


def _apex_larc_class(stand_ins) -> type:
    """apex.parallel.LARC.LARC as apex wrote it (2018-05 on): a plain object whose pickling
    forwards to the wrapped optimizer's."""

    class LARC:
        def __init__(self, optimizer, trust_coefficient=0.02, clip=True, eps=1e-8):
            self.optim = optimizer
            self.trust_coefficient = trust_coefficient
            self.eps = eps
            self.clip = clip

        def __getstate__(self):
            return self.optim.__getstate__()

        def __setstate__(self, state):
            self.optim.__setstate__(state)

    return stand_ins.add("apex.parallel.LARC.LARC", LARC)


def test_a_larc_apex_pickled_whole_is_refused_at_load_naming_the_fix(stand_ins, alias):
    """apex's LARC pickled only its inner optimizer's groups and state: neither that optimizer's
    class nor LARC's settings are in the file, and apex itself could not unpickle it."""
    model = nn.Linear(3, 2)
    larc = _apex_larc_class(stand_ins)(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), trust_coefficient=0.01, clip=False
    )
    data = _apex_file(stand_ins, {"model": model.state_dict(), "optimizer": larc})
    with pytest.raises(pickle.UnpicklingError) as info:
        _full_load(data)
    message = str(info.value)
    assert "whole apex.parallel.LARC.LARC object apex pickled (torch.save(optimizer)" in message
    assert "not which optimizer that was nor trust_coefficient, clip and eps" in message
    assert "LARC(torch.optim.SGD(model.parameters(), lr=...), trust_coefficient=..., clip=..., eps=...)" in message


def test_fp16kit_s_own_larc_still_pickles():
    from fp16kit.legacy.parallel.LARC import LARC

    model = nn.Linear(3, 2)
    larc = LARC(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), trust_coefficient=0.01, clip=False)
    twin = pickle.loads(pickle.dumps(larc))
    assert (twin.trust_coefficient, twin.clip, twin.eps) == (0.01, False, 1e-8)
    assert type(twin.optim) is torch.optim.SGD and twin.optim.defaults["momentum"] == 0.9


# ------------------------------------------------------------------------ SyncBatchNorm

SYNC_BN_LAYOUTS = {
    # the Python fallback: no process group before 2018-12; never channel_last (refused) nor fused ReLU
    "fallback 2018-10": ("apex.parallel.sync_batchnorm.SyncBatchNorm", {}),
    "fallback": ("apex.parallel.sync_batchnorm.SyncBatchNorm", {"process_group": None}),
    # the CUDA-extension class: channel_last from 2019-01, fuse_relu from 2019-04
    "optimized 2018-12": ("apex.parallel.optimized_sync_batchnorm.SyncBatchNorm", {"process_group": None}),
    "optimized 2019-01": (
        "apex.parallel.optimized_sync_batchnorm.SyncBatchNorm",
        {"process_group": None, "channel_last": False},
    ),
    "optimized": (
        "apex.parallel.optimized_sync_batchnorm.SyncBatchNorm",
        {"process_group": None, "channel_last": False, "fuse_relu": False},
    ),
    "optimized channel-last + relu": (
        "apex.parallel.optimized_sync_batchnorm.SyncBatchNorm",
        {"process_group": None, "channel_last": True, "fuse_relu": True},
    ),
}


@pytest.mark.parametrize("layout", list(SYNC_BN_LAYOUTS))
def test_an_apex_sync_batchnorm_pickled_whole_trains_and_evaluates(stand_ins, alias, layout):
    """Before: the fallback's pickle (no fuse_relu, no channel_last) failed at its first forward."""
    path, attrs = SYNC_BN_LAYOUTS[layout]
    settings = dict(num_features=4, eps=1e-3, momentum=0.2)
    g = torch.Generator().manual_seed(2)
    bn = _apex_module(
        stand_ins,
        path,
        _BatchNorm,
        attrs,
        init=lambda o: _BatchNorm.__init__(o, **settings, affine=True, track_running_stats=True),
    )
    with torch.no_grad():
        for t in (bn.weight, bn.bias, bn.running_mean):
            t.copy_(torch.randn(4, generator=g))
        bn.running_var.copy_(torch.rand(4, generator=g) + 0.5)
    reference = SyncBatchNorm(
        **settings, channel_last=attrs.get("channel_last", False), fuse_relu=attrs.get("fuse_relu", False)
    )
    reference.load_state_dict(bn.state_dict())
    data = _apex_file(stand_ins, {"model": nn.Sequential(bn)})
    loaded = _full_load(data)["model"][0]

    assert type(loaded) is SyncBatchNorm and loaded.process_group is None
    assert (loaded.channel_last, loaded.fuse_relu) == (reference.channel_last, reference.fuse_relu)
    shape = (6, 3, 3, 4) if reference.channel_last else (6, 4, 3, 3)
    for _ in range(2):
        x = torch.randn(*shape, generator=g, requires_grad=True)
        out, want = loaded(x), reference(x.detach().requires_grad_())
        assert torch.equal(out, want)
        out.square().sum().backward()
    _same_tensors(loaded.state_dict(), reference.state_dict())
    loaded.eval()
    reference.eval()
    x = torch.randn(*shape, generator=g)
    assert torch.equal(loaded(x), reference(x))


# -------------------------------------------------------------- apex.optimizers pickled whole

#: apex's defaults dict (what torch pickles) and the attributes its __init__ set beside it (what
#: torch's pickling of an optimizer drops), per class, with apex's default values
APEX_DEFAULTS = {
    "FusedAdam": (
        dict(lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0),
        dict(adam_w_mode=1, set_grad_none=True),
    ),
    # the same path's class of 2018-12 to 2019-08 (the legacy rule)
    "FusedAdam 2018": (
        dict(lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, max_grad_norm=0.0),
        dict(eps_mode=1),
    ),
    "FusedLAMB": (
        dict(
            lr=1e-3,
            bias_correction=True,
            betas=(0.9, 0.999),
            eps=1e-6,
            weight_decay=0.01,
            grad_averaging=True,
            max_grad_norm=1.0,
        ),
        dict(adam_w_mode=1, set_grad_none=True, use_nvlamb=False),
    ),
    "FusedSGD": (
        dict(lr=0.1, momentum=0, dampening=0, weight_decay=0, nesterov=False),
        dict(
            wd_after_momentum=False,
            materialize_master_grads=True,
            most_recent_scale=1.0,
            scale_set_by_backward=False,
            set_grad_none=False,
        ),
    ),
    "FusedNovoGrad": (
        dict(
            lr=1e-3,
            bias_correction=True,
            betas=(0.9, 0.999),
            eps=1e-8,
            weight_decay=0.0,
            grad_averaging=True,
            norm_type=2,
            init_zero=False,
        ),
        dict(moment_mode=1, set_grad_none=True),
    ),
    "FusedAdagrad": (dict(lr=1e-2, eps=1e-10, weight_decay=0.0), dict(adagrad_w_mode=0, set_grad_none=True)),
}
MODULES = {
    "FusedAdam": "fused_adam",
    "FusedLAMB": "fused_lamb",
    "FusedSGD": "fused_sgd",
    "FusedNovoGrad": "fused_novograd",
    "FusedAdagrad": "fused_adagrad",
}


def _apex_optimizer(stand_ins, version: str, groups: list[dict], **settings) -> torch.optim.Optimizer:
    """A stand-in of ``apex.optimizers.<name>`` built as apex's ``__init__`` did (``settings``
    override apex's defaults; a name apex kept on the object goes there)."""
    defaults, attrs = (dict(d) for d in APEX_DEFAULTS[version])
    for k, v in settings.items():
        (defaults if k in defaults else attrs)[k] = v
    name = version.split()[0]
    cls = stand_ins.add(f"apex.optimizers.{MODULES[name]}.{name}", bases=(torch.optim.Optimizer,))
    opt = cls.__new__(cls)
    torch.optim.Optimizer.__init__(opt, groups, defaults)
    opt.__dict__.update(attrs, _dummy_overflow_buf=torch.zeros(1, dtype=torch.int))
    return opt


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 2))


def _groups(model: nn.Sequential, **second) -> list[dict]:
    return [{"params": list(model[0].parameters())}, {"params": list(model[2].parameters()), **second}]


def _train(model, opt, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(8, 5, generator=g), torch.randn(8, 2, generator=g)
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()


def _reached(apex_opt, reference) -> None:
    """Give ``apex_opt`` the state ``reference`` reached (per-param tensors, apex's group step)."""
    for mine, theirs in zip(apex_opt.param_groups, reference.param_groups):
        if "step" in theirs:
            mine["step"] = theirs["step"]
        for p in theirs["params"]:
            apex_opt.state[p] = {k: v.clone() for k, v in reference.state[p].items()}


# class, settings given to both (apex's argument names), the second group's own settings
REBUILT = {
    "FusedAdam": ("FusedAdam", dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6), dict(lr=3e-3)),
    "FusedAdam, no bias correction": ("FusedAdam", dict(lr=1e-2, bias_correction=False), {}),
    "FusedSGD, momentum": ("FusedSGD", dict(lr=0.05, momentum=0.9, nesterov=True), dict(lr=0.01)),
    "FusedSGD, weight decay without momentum": ("FusedSGD", dict(lr=0.05, weight_decay=1e-2), dict(weight_decay=0.1)),
    "FusedAdagrad": ("FusedAdagrad", dict(lr=0.05, eps=1e-8), dict(lr=0.02)),
}


@pytest.mark.parametrize("case", list(REBUILT))
def test_an_apex_optimizer_pickled_whole_steps_as_fp16kit_s_with_the_same_settings(stand_ins, alias, case):
    """Where the settings apex kept on the object cannot change these groups' updates (no
    weight decay for Adam/Adagrad, no decay with momentum for SGD), the optimizer is rebuilt with
    apex's defaults: it resumes exactly as fp16kit's class built with the run's settings and
    given its state. (Its first step used to fail with AttributeError.)"""
    name, settings, second = REBUILT[case]
    model = _model()
    reference = getattr(optimizers, name)(_groups(model, **second), **settings)
    _train(model, reference, 2, seed=1)
    apex_opt = _apex_optimizer(stand_ins, name, _groups(model, **second), **settings)
    _reached(apex_opt, reference)
    data = _apex_file(stand_ins, {"model": model, "optimizer": apex_opt, "epoch": 2})
    ckpt = _full_load(data)

    loaded = ckpt["optimizer"]
    assert type(loaded) is getattr(optimizers, name)
    assert loaded.param_groups[0]["params"][0] is ckpt["model"][0].weight  # one object graph
    _train(ckpt["model"], loaded, 3, seed=2)
    _train(model, reference, 3, seed=2)
    _same_tensors(ckpt["model"].state_dict(), model.state_dict())
    saved, want = loaded.state_dict(), reference.state_dict()
    kept = (*APEX_DEFAULTS[name][0], "step", "params")  # (torch's bookkeeping keys differ: foreach, ...)
    assert [{k: g.get(k) for k in kept} for g in saved["param_groups"]] == [
        {k: g.get(k) for k in kept} for g in want["param_groups"]
    ]
    for k in want["state"]:
        _same_tensors(saved["state"][k], want["state"][k])
    assert copy.deepcopy(loaded).defaults == loaded.defaults  # pickles again as fp16kit's


# class, apex's settings of the run, the second group's own settings, the settings named
REFUSED = {
    "FusedAdam, weight decay": ("FusedAdam", dict(weight_decay=0.01), {}, ["adam_w_mode"]),
    "FusedAdam, decay in one group": ("FusedAdam", {}, dict(weight_decay=0.01), ["adam_w_mode"]),
    "FusedAdam 2018-12..2019-08": ("FusedAdam 2018", dict(max_grad_norm=1.0), {}, ["eps_inside_sqrt"]),
    "FusedAdam, capturable": ("FusedAdam", dict(lr=torch.tensor(1e-3), capturable=True), {}, ["master_weights"]),
    "FusedLAMB": ("FusedLAMB", {}, {}, ["adam_w_mode"]),
    "FusedLAMB, no decay": ("FusedLAMB", dict(weight_decay=0.0), {}, ["use_nvlamb"]),
    "FusedLAMB, both": ("FusedLAMB", {}, dict(weight_decay=0.0), ["adam_w_mode", "use_nvlamb"]),
    "FusedNovoGrad": ("FusedNovoGrad", {}, {}, ["reg_inside_moment"]),
    "FusedAdagrad, weight decay": ("FusedAdagrad", dict(weight_decay=0.01), {}, ["adagrad_w_mode"]),
    "FusedSGD, decay and momentum": ("FusedSGD", dict(momentum=0.9), dict(weight_decay=1e-4), ["wd_after_momentum"]),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_an_apex_optimizer_pickled_whole_is_refused_where_a_lost_setting_matters(stand_ins, alias, case):
    version, settings, second, lost = REFUSED[case]
    name = version.split()[0]
    model = _model()
    apex_opt = _apex_optimizer(stand_ins, version, _groups(model, **second), **settings)
    data = _apex_file(stand_ins, {"model": model.state_dict(), "optimizer": apex_opt})
    with pytest.raises(pickle.UnpicklingError) as info:
        _full_load(data)
    message = str(info.value)
    assert (
        f"whole apex.optimizers.{name} object apex pickled (torch.save(optimizer), not optimizer.state_dict())"
        in message
    )
    assert f"apex kept {lost} on the object" in message
    assert "torch.save(optimizer.state_dict(), NEW_PATH)" in message


def test_fp16kit_s_own_optimizers_pickle_and_load_state_dicts_as_before():
    model = _model()
    adam = optimizers.FusedAdam(model.parameters(), lr=1e-2, weight_decay=0.1, adam_w_mode=False)
    sgd = optimizers.FusedSGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4, wd_after_momentum=True)
    _train(model, adam, 1, seed=3)
    assert pickle.loads(pickle.dumps(adam)).adam_w_mode is False
    assert copy.deepcopy(sgd).wd_after_momentum is True
    twin = optimizers.FusedAdam(model.parameters(), lr=1e-3)
    twin.load_state_dict(adam.state_dict())
    assert twin.adam_w_mode is True and twin.param_groups[0]["lr"] == 1e-2


def test_a_modern_optimizer_pickle_without_its_settings_is_refused():
    model = _model()
    bare = torch.optim.Optimizer.__getstate__(Adam(model.parameters()))
    opt = Adam.__new__(Adam)
    with pytest.raises(pickle.UnpicklingError, match="holds only torch's defaults, state and param_groups"):
        opt.__setstate__(bare)


# ------------------------------------------------------------------------------ apex DDP


def test_an_apex_ddp_pickled_whole_says_the_file_holds_no_model(stand_ins, alias):
    """apex's DistributedDataParallel.__getstate__ returned None with NCCL (and raised KeyError
    with other backends): ``torch.save(model)`` wrote the class alone -- no module, no weights.
    The object made of it names that and the fix at its first use, not a torch attribute error."""

    def apex_getstate(self):  # apex's, with its return inside the non-NCCL branch
        if self._backend != "nccl":
            del self.__dict__["self.bucket_streams"]
            return self.__dict__

    ddp = _apex_module(
        stand_ins,
        "apex.parallel.distributed.DistributedDataParallel",
        nn.Module,
        {"_backend": "nccl", "message_size": 10000000, "delay_allreduce": False},
    )
    ddp.add_module("module", nn.Linear(3, 2))
    type(ddp).__getstate__ = apex_getstate
    data = _apex_file(stand_ins, {"model": ddp, "epoch": 7})
    ckpt = _full_load(data)

    model = ckpt["model"]
    assert type(model) is DistributedDataParallel and ckpt["epoch"] == 7
    assert not hasattr(model, "module")
    for use in (lambda: model.module, lambda: model(torch.ones(1, 3)), lambda: model.state_dict()):
        with pytest.raises(AttributeError) as info:
            use()
        assert "file holds neither the wrapped model nor its weights" in str(info.value)
        assert "torch.save(model.module.state_dict(), PATH)" in str(info.value)


# ---------------------------------------------------------------- normalization, FP16Model


NORMS = {
    # path, fp16kit's class, apex's attributes beyond the parameters
    "FusedLayerNorm 2019": ("FusedLayerNorm", FusedLayerNorm, dict(eps=1e-5, elementwise_affine=True)),
    "FusedLayerNorm": (
        "FusedLayerNorm",
        FusedLayerNorm,
        dict(eps=1e-4, elementwise_affine=True, memory_efficient=False),
    ),
    "FusedLayerNorm, no affine": ("FusedLayerNorm", FusedLayerNorm, dict(eps=1e-5, elementwise_affine=False)),
    "MixedFusedLayerNorm": (
        "MixedFusedLayerNorm",
        MixedFusedLayerNorm,
        dict(eps=1e-5, elementwise_affine=True, memory_efficient=False),
    ),
    "FusedRMSNorm": ("FusedRMSNorm", FusedRMSNorm, dict(eps=1e-5, elementwise_affine=True, memory_efficient=False)),
    "MixedFusedRMSNorm": (
        "MixedFusedRMSNorm",
        MixedFusedRMSNorm,
        dict(eps=1e-6, elementwise_affine=True, memory_efficient=False),
    ),
}


@pytest.mark.parametrize("case", list(NORMS))
def test_an_apex_norm_pickled_whole_runs_as_fp16kit_s(stand_ins, alias, case):
    name, cls, attrs = NORMS[case]
    g = torch.Generator().manual_seed(4)
    norm = _apex_module(
        stand_ins,
        f"apex.normalization.fused_layer_norm.{name}",
        nn.Module,
        dict(attrs, normalized_shape=torch.Size([6])),
    )
    params = ("weight",) if "RMS" in name else ("weight", "bias")
    for p in params:
        norm.register_parameter(p, nn.Parameter(torch.randn(6, generator=g)) if attrs["elementwise_affine"] else None)
    if name.startswith("Mixed"):
        norm.half()  # Megatron's use: fp16 weights, output in their dtype
    kwargs = {} if name.startswith("Mixed") else dict(elementwise_affine=attrs["elementwise_affine"])
    reference = cls(6, eps=attrs["eps"], **kwargs).to(next(norm.parameters(), torch.empty(0)).dtype)
    reference.load_state_dict(norm.state_dict())
    data = _apex_file(stand_ins, {"model": norm})
    loaded = _full_load(data)["model"]

    assert type(loaded) is cls
    x = torch.randn(3, 6, generator=g)
    out, want = loaded(x), reference(x)
    assert out.dtype == want.dtype and torch.equal(out, want)


def test_fp16model_and_network_to_half_pickled_whole_run(stand_ins, alias):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))
    reference_model, reference_half = FP16Model(copy.deepcopy(net)), network_to_half(copy.deepcopy(net))
    apex_model = _apex_module(stand_ins, "apex.fp16_utils.fp16util.FP16Model", nn.Module, {})
    apex_model.add_module("network", reference_model.network)  # apex's convert_network made the same
    apex_half = nn.Sequential(
        _apex_module(stand_ins, "apex.fp16_utils.fp16util.tofp16", nn.Module, {}), reference_half[1]
    )
    data = _apex_file(stand_ins, {"fp16model": apex_model, "network_to_half": apex_half})
    ckpt = _full_load(data)

    assert type(ckpt["fp16model"]) is FP16Model and type(ckpt["network_to_half"][0]) is tofp16
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(6))
    for key, reference in (("fp16model", reference_model), ("network_to_half", reference_half)):
        out = ckpt[key].eval()(x)
        assert out.dtype == torch.float16 and torch.equal(out, reference.eval()(x)), key
