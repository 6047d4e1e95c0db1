"""fp16kit.legacy.optimizers: apex.optimizers' signatures, defaults, error texts, group-step
semantics and the two FusedAdam rules (docs/apex-others.md §1.4, §1.7, §3; docs/apex-amp.md §14)."""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from fp16kit.legacy import optimizers as legacy_optimizers
from fp16kit.legacy.contrib import optimizers as contrib
from fp16kit.legacy.optimizers import FusedAdagrad, FusedAdam, FusedLAMB, FusedNovoGrad, FusedSGD

SIGNATURES = {
    FusedAdam: "params lr=0.001 bias_correction=True betas=(0.9, 0.999) eps=1e-08 adam_w_mode=True "
    "weight_decay=0.0 amsgrad=False set_grad_none=True capturable=False master_weights=False",
    FusedLAMB: "params lr=0.001 bias_correction=True betas=(0.9, 0.999) eps=1e-06 weight_decay=0.01 "
    "amsgrad=False adam_w_mode=True grad_averaging=True set_grad_none=True max_grad_norm=1.0 "
    "use_nvlamb=False",
    FusedNovoGrad: "params lr=0.001 bias_correction=True betas=(0.9, 0.999) eps=1e-08 weight_decay=0.0 "
    "amsgrad=False reg_inside_moment=False grad_averaging=True norm_type=2 init_zero=False "
    "set_grad_none=True",
    FusedAdagrad: "params lr=0.01 eps=1e-10 weight_decay=0.0 set_grad_none=True adagrad_w_mode=False",
    FusedSGD: "params lr=<required parameter> momentum=0 dampening=0 weight_decay=0 nesterov=False "
    "wd_after_momentum=False materialize_master_grads=True set_grad_none=False",
    contrib.FusedAdam: "params lr=0.001 bias_correction=True betas=(0.9, 0.999) eps=1e-08 eps_inside_sqrt=False "
    "weight_decay=0.0 max_grad_norm=0.0 amsgrad=False use_mt=False amp_scale_adjustment=1.0",
    contrib.FusedSGD: "params lr=<required parameter> momentum=0.0 dampening=0.0 weight_decay=0.0 "
    "nesterov=False wd_after_momentum=False materialize_master_grads=True",
}


def _positional(cls):
    parts = []
    for p in inspect.signature(cls.__init__).parameters.values():
        if p.name == "self" or p.kind is inspect.Parameter.KEYWORD_ONLY:
            continue
        parts.append(p.name if p.default is inspect.Parameter.empty else f"{p.name}={p.default!r}".replace("'", ""))
    return " ".join(parts)


@pytest.mark.parametrize("cls", list(SIGNATURES))
def test_signatures_and_defaults_are_apex(cls):
    assert _positional(cls) == SIGNATURES[cls]


@pytest.mark.parametrize(
    "cls,name",
    [
        (FusedAdam, "FusedAdam"),
        (FusedLAMB, "FusedLAMB"),
        (FusedNovoGrad, "FusedNovoGrad"),
        (contrib.FusedAdam, "FusedAdam"),
    ],
)
def test_amsgrad_is_refused_with_apex_text(cls, name):
    with pytest.raises(RuntimeError, match=f"^{name} does not support the AMSGrad variant.$"):
        cls([torch.zeros(2, requires_grad=True)], amsgrad=True)


@pytest.mark.parametrize(
    "kw", [dict(grads=[torch.zeros(2)]), dict(output_params=[]), dict(scale=2.0), dict(grad_norms=[1.0])]
)
def test_current_fused_adam_refuses_legacy_step_keywords(kw):
    p = torch.zeros(2, requires_grad=True)
    opt = FusedAdam([p])
    p.grad = torch.ones(2)
    with pytest.raises(RuntimeError) as err:
        opt.step(**kw)
    assert str(err.value) == (
        "FusedAdam has been updated.  Simply initialize it identically to "
        "torch.optim.Adam, and call step() with no arguments."
    )
    assert torch.equal(p.detach(), torch.zeros(2)) and "step" not in opt.param_groups[0]


@pytest.mark.parametrize(
    "cls,name",
    [
        (FusedAdam, "FusedAdam"),
        (FusedLAMB, "FusedLAMB"),
        (FusedNovoGrad, "FusedNovoGrad"),
        (FusedAdagrad, "FusedAdagrad"),
    ],
)
def test_float64_params_are_refused_with_apex_text(cls, name):
    p = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    opt = cls([p])
    p.grad = torch.ones(2, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=f"^{name} only support fp16 and fp32.$"):
        opt.step()


def test_master_weights_texts():
    p = [torch.zeros(2, requires_grad=True)]
    with pytest.raises(RuntimeError, match="^Master weights is currently only supported with the capturable version.$"):
        FusedAdam(p, master_weights=True)
    with pytest.raises(RuntimeError, match="MixedPrecisionOptimizer"):
        FusedAdam(p, master_weights=True, capturable=True)
    FusedAdam(p, capturable=True).step()


def test_fused_sgd_needs_lr_and_checks_as_torch():
    p = [torch.zeros(2, requires_grad=True)]
    with pytest.raises(ValueError, match="required optimization parameter lr"):
        FusedSGD(p)
    with pytest.raises(ValueError, match="Nesterov momentum requires a momentum and zero dampening"):
        FusedSGD(p, lr=0.1, nesterov=True)
    with pytest.raises(ValueError, match="Invalid learning rate: -1"):
        FusedSGD(p, lr=-1)


def test_fused_mixed_precision_lamb_points_to_fused_lamb():
    with pytest.raises(ImportError, match="FusedLAMB"):
        from fp16kit.legacy.optimizers import FusedMixedPrecisionLamb  # noqa: F401
    assert {"FusedAdam", "FusedLAMB", "FusedSGD", "FusedNovoGrad", "FusedAdagrad", "FP16_Optimizer"} <= set(
        legacy_optimizers.__all__
    )
    assert legacy_optimizers.FP16_Optimizer is contrib.FP16_Optimizer


@pytest.mark.parametrize("cls", [FusedAdam, FusedLAMB, FusedNovoGrad])
def test_one_step_per_group_even_for_gradless_groups(cls):
    a, b = torch.zeros(3, requires_grad=True), torch.ones(2, requires_grad=True)
    opt = cls([{"params": [a]}, {"params": [b]}])
    for _ in range(3):
        a.grad = torch.full((3,), 0.1)
        opt.step()
    assert [g["step"] for g in opt.param_groups] == [3, 3]
    assert torch.equal(b.detach(), torch.ones(2)) and not opt.state[b]


def test_zero_grad_takes_no_argument_and_sets_none_by_default():
    p = torch.zeros(2, requires_grad=True)
    for cls, expect_none in ((FusedAdam, True), (FusedLAMB, True), (FusedNovoGrad, True), (FusedAdagrad, True)):
        opt = cls([p])
        p.grad = torch.ones(2)
        opt.zero_grad()
        assert (p.grad is None) == expect_none
    opt = FusedSGD([p], lr=0.1)
    p.grad = torch.ones(2)
    opt.zero_grad()
    assert torch.equal(p.grad, torch.zeros(2))


def test_fused_adam_is_close_to_torch_adamw():
    torch.manual_seed(0)
    p1 = [torch.randn(5, 4, requires_grad=True), torch.randn(3, requires_grad=True)]
    p2 = [p.detach().clone().requires_grad_() for p in p1]
    o1 = FusedAdam(p1, lr=1e-2, weight_decay=0.05)
    o2 = torch.optim.AdamW(p2, lr=1e-2, weight_decay=0.05)
    for _ in range(10):
        for a, b in zip(p1, p2):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        o1.step()
        o2.step()
    for a, b in zip(p1, p2):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _legacy_reference(p0, grads, *, lr, wd, max_grad_norm, eps=1e-8, betas=(0.9, 0.999)):
    """§1.4's pseudo-code, one group, bias_correction=True, eps outside the sqrt, scale 1."""
    b1, b2 = betas
    ps = [p.double() for p in p0]
    ms = [torch.zeros_like(p) for p in ps]
    vs = [torch.zeros_like(p) for p in ps]
    for t, gs in enumerate(grads, start=1):
        norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in gs))
        clip = (norm + 1e-6) / max_grad_norm
        combined = clip if max_grad_norm > 0 and clip > 1 else 1.0
        step_size = lr * math.sqrt(1 - b2**t) / (1 - b1**t)
        for i, g in enumerate(gs):
            g = g.double() / combined
            ms[i] = b1 * ms[i] + (1 - b1) * g
            vs[i] = b2 * vs[i] + (1 - b2) * g * g
            ps[i] = ps[i] - step_size * (ms[i] / (vs[i].sqrt() + eps) + wd * ps[i])
    return ps


def test_fused_adam_built_with_legacy_keywords_follows_the_2018_rule():
    torch.manual_seed(1)
    params = [torch.randn(4, 3, requires_grad=True), torch.randn(6, requires_grad=True)]
    p0 = [p.detach().clone() for p in params]
    grads = [[torch.randn_like(p) * 3 for p in params] for _ in range(4)]
    opt = FusedAdam(params, lr=1e-2, weight_decay=0.01, max_grad_norm=1.0)
    for gs in grads:
        for p, g in zip(params, gs):
            p.grad = g
        opt.step()  # standalone: the group's norm is computed (apex raised TypeError)
    assert opt.state[params[0]]["step"] == 4 and "step" not in opt.param_groups[0]
    for p, e in zip(params, _legacy_reference(p0, grads, lr=1e-2, wd=0.01, max_grad_norm=1.0)):
        torch.testing.assert_close(p.detach().double(), e, rtol=1e-5, atol=1e-6)


def test_contrib_fused_sgd_is_wrapper_only():
    p = torch.zeros(2, requires_grad=True)
    opt = contrib.FusedSGD([p], lr=0.1)
    p.grad = torch.ones(2)
    with pytest.raises(RuntimeError, match="which provides grads.$"):
        opt.step()
    with pytest.raises(RuntimeError, match="which provides output_params.$"):
        opt.step(grads=[p.grad])
    out = torch.zeros(2, dtype=torch.float16)
    opt.step(grads=[torch.full((2,), 8.0, dtype=torch.float16)], output_params=[out], scale=4.0)
    assert torch.equal(p.detach(), torch.full((2,), -0.2))  # 8/4 * 0.1
    assert torch.equal(out, torch.full((2,), -0.2).half())


@pytest.mark.parametrize("cls", [FusedAdam, FusedLAMB, FusedNovoGrad, FusedAdagrad, contrib.FusedAdam])
def test_a_bad_param_in_a_later_group_refuses_the_step_before_any_change(cls):
    good = torch.zeros(3, requires_grad=True)
    bad = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    opt = cls([{"params": [good]}, {"params": [bad]}])
    good.grad, bad.grad = torch.ones(3), torch.ones(2, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="only support fp16 and fp32"):
        opt.step()
    assert torch.equal(good.detach(), torch.zeros(3)) and not opt.state[good]
    assert all("step" not in g for g in opt.param_groups)
