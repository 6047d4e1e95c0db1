"""fp16kit.optim beyond the formulas: group step counts, grad-less params, empty groups,
checkpoints, errors, torch equivalences, and use inside MixedPrecisionOptimizer."""

from __future__ import annotations

import io

import pytest
import torch

import fp16kit
from fp16kit.optim import LAMB, SGD, Adagrad, Adam, LegacyAdam, NovoGrad

ALL = [
    (Adam, {}),
    (LAMB, {}),
    (NovoGrad, {}),
    (Adagrad, {}),
    (SGD, dict(lr=0.1, momentum=0.9)),
    (LegacyAdam, {}),
]


def _params(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(3, 2, generator=g).to(dtype).requires_grad_(),
        torch.randn(4, generator=g).to(dtype).requires_grad_(),
    ]


def _grads(params, seed):
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


@pytest.mark.parametrize("cls,kw", ALL)
def test_gradless_params_and_empty_groups_are_left_alone(cls, kw):
    a, b = _params()
    frozen = b.detach().clone()
    opt = cls([{"params": [a, b]}, {"params": []}], **kw)
    for k in range(3):
        a.grad = torch.full_like(a, 0.5 + k)
        b.grad = None
        opt.step()
    assert torch.equal(b.detach(), frozen)
    assert len(opt.state[b]) == 0
    assert not torch.equal(a.detach(), _params()[0].detach())


@pytest.mark.parametrize("cls", [Adam, LAMB, NovoGrad])
def test_one_step_count_per_group_advanced_every_step(cls):
    a, b = _params()
    opt = cls([{"params": [a]}, {"params": [b]}, {"params": []}])
    a.grad = torch.ones_like(a)
    opt.step()
    opt.step()
    assert [g["step"] for g in opt.param_groups] == [2, 2, 2]
    assert "step" not in opt.state[a]


def test_adam_param_with_a_late_first_grad_uses_the_group_count():
    # group step 3 when b first steps: bias corrections use t=3 (torch would use t=1)
    a, b = _params()
    b0 = b.detach().clone()
    opt = Adam([a, b], lr=0.1, betas=(0.5, 0.6), eps=0.0)
    for _ in range(2):
        a.grad = torch.ones_like(a)
        opt.step()
    a.grad, b.grad = torch.ones_like(a), torch.full_like(b, 2.0)
    opt.step()
    m, v = 0.5 * 2.0, 0.4 * 4.0
    u = (m / (1 - 0.5**3)) / ((v / (1 - 0.6**3)) ** 0.5)
    torch.testing.assert_close(b.detach(), b0 - 0.1 * u)


@pytest.mark.parametrize("cls,kw", ALL)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_state_dict_round_trip_is_exact_and_plain_data(cls, kw, dtype):
    p1 = _params(dtype)
    p2 = [p.detach().clone().requires_grad_() for p in p1]
    o1 = cls(p1, **kw)
    for k in range(2):
        _grads(p1, k)
        o1.step()
    buf = io.BytesIO()
    torch.save(o1.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    with torch.no_grad():
        for a, b in zip(p1, p2):
            b.copy_(a)
    o2 = cls(p2, **kw)
    o2.load_state_dict(sd)
    for k in range(2, 4):
        _grads(p1, k)
        _grads(p2, k)
        o1.step()
        o2.step()
    for a, b in zip(p1, p2):
        assert torch.equal(a, b)


@pytest.mark.parametrize("cls,kw", [c for c in ALL if c[0] is not SGD])  # torch's SGD takes them
def test_sparse_grads_are_refused(cls, kw):
    p = torch.zeros(4, requires_grad=True)
    opt = cls([p], **kw)
    p.grad = torch.zeros(4).to_sparse()
    with pytest.raises(RuntimeError, match="does not support sparse gradients"):
        opt.step()


@pytest.mark.parametrize("cls", [Adam, LAMB, NovoGrad, Adagrad, LegacyAdam])
def test_zero_grad_follows_set_grad_none(cls):
    p = torch.zeros(3, requires_grad=True)
    opt = cls([p], set_grad_none=False)
    p.grad = torch.ones(3)
    opt.zero_grad()
    assert torch.equal(p.grad, torch.zeros(3))
    opt.zero_grad(set_to_none=True)
    assert p.grad is None
    opt = cls([p])
    p.grad = torch.ones(3)
    opt.zero_grad()
    assert p.grad is None


def test_sgd_zero_grad_default_zeroes_in_place():
    p = torch.zeros(3, requires_grad=True)
    opt = SGD([p], lr=0.1)
    p.grad = torch.ones(3)
    g = p.grad
    opt.zero_grad()
    assert p.grad is g and torch.equal(g, torch.zeros(3))


def test_lamb_nonpositive_max_grad_norm_means_no_clipping():
    runs = []
    for mgn in (0.0, -1.0, 1e9):
        ps = _params(seed=5)
        opt = LAMB(ps, lr=0.01, max_grad_norm=mgn)
        for k in range(3):
            _grads(ps, k)
            for p in ps:
                p.grad.mul_(50.0)
            opt.step()
        runs.append([p.detach().clone() for p in ps])
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            torch.testing.assert_close(a, b)
    assert all(torch.isfinite(p).all() for p in runs[0])


def test_lamb_nan_grad_norm_poisons_every_update_as_apex():
    ps = _params()
    opt = LAMB(ps)
    _grads(ps, 0)
    ps[0].grad[0, 0] = float("nan")
    opt.step()
    assert torch.isnan(ps[1]).all()


def test_novograd_param_with_late_first_grad_raises_before_any_change():
    a, b = _params()
    opt = NovoGrad([a, b])
    a.grad = torch.ones_like(a)
    opt.step()
    before = (a.detach().clone(), opt.param_groups[0]["step"])
    a.grad, b.grad = torch.ones_like(a), torch.ones_like(b)
    with pytest.raises(RuntimeError, match="own param group"):
        opt.step()
    assert torch.equal(a.detach(), before[0]) and opt.param_groups[0]["step"] == before[1]


def test_novograd_group_norms_in_apex_layout():
    a = torch.randn(3, requires_grad=True)
    h = torch.randn(4).half().requires_grad_()
    opt = NovoGrad([a, h])
    a.grad = torch.full((3,), 2.0)
    h.grad = torch.full((4,), 1.0).half()
    opt.step()
    low, full = opt.param_groups[0]["exp_avg_sq"]
    torch.testing.assert_close(low, torch.tensor([2.0]))  # ||h.grad||, first step blend is a no-op
    torch.testing.assert_close(full, torch.tensor([12.0**0.5]))


def test_novograd_refuses_other_norms():
    with pytest.raises(RuntimeError, match="only support l2/inf norm now"):
        NovoGrad([torch.zeros(1, requires_grad=True)], norm_type=1)


def test_sgd_on_fp32_params_is_torch_sgd_bit_for_bit():
    p1 = _params(seed=2)
    p2 = [p.detach().clone().requires_grad_() for p in p1]
    o1 = SGD(p1, lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True)
    o2 = torch.optim.SGD(p2, lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True)
    for k in range(4):
        _grads(p1, k)
        _grads(p2, k)
        o1.step()
        o2.step()
    for a, b in zip(p1, p2):
        assert torch.equal(a, b)
    assert o1.state_dict()["state"].keys() == o2.state_dict()["state"].keys()


def test_sgd_own_path_equals_torch_path_without_wd_after_momentum():
    # the multi-tensor fp32 path for fp16 params is torch's formula: compare on fp16 values
    p1 = _params(torch.float16, seed=4)
    p2 = [p.detach().float().requires_grad_() for p in p1]
    o1 = SGD(p1, lr=0.1, momentum=0.9, dampening=0.2, weight_decay=0.01)
    o2 = torch.optim.SGD(p2, lr=0.1, momentum=0.9, dampening=0.2, weight_decay=0.01)
    for k in range(3):
        _grads(p1, k)
        for a, b in zip(p1, p2):
            b.grad = a.grad.float()
        o1.step()
        o2.step()
        with torch.no_grad():
            for b in p2:
                b.copy_(b.half().float())
    for a, b in zip(p1, p2):
        torch.testing.assert_close(a.float(), b, rtol=1e-3, atol=1e-3)


def test_adam_is_torch_adamw_and_adam_in_exact_arithmetic():
    for adam_w_mode, torch_cls in ((True, torch.optim.AdamW), (False, torch.optim.Adam)):
        p1 = _params(seed=6)
        p2 = [p.detach().clone().requires_grad_() for p in p1]
        o1 = Adam(p1, lr=1e-2, weight_decay=0.1, adam_w_mode=adam_w_mode)
        o2 = torch_cls(p2, lr=1e-2, weight_decay=0.1)
        for k in range(5):
            _grads(p1, k)
            _grads(p2, k)
            o1.step()
            o2.step()
        for a, b in zip(p1, p2):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_adam_keeps_fp32_moments_for_low_precision_params():
    p = torch.randn(5).half().requires_grad_()
    opt = Adam([p])
    p.grad = torch.randn(5).half()
    opt.step()
    assert opt.state[p]["exp_avg"].dtype == torch.float32
    assert opt.state[p]["exp_avg_sq"].dtype == torch.float32
    assert p.dtype == torch.float16


def test_float64_params_step_in_float64():
    p = torch.randn(4, dtype=torch.float64, requires_grad=True)
    opt = Adam([p])
    p.grad = torch.randn(4, dtype=torch.float64)
    opt.step()
    assert opt.state[p]["exp_avg"].dtype == torch.float64


@pytest.mark.parametrize("cls,kw", [(LAMB, {}), (NovoGrad, {}), (Adam, {})])
def test_inside_mixed_precision_optimizer_with_an_fp16_model(cls, kw):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)).half()
    masters_ref = [p.detach().float().requires_grad_() for p in model.parameters()]
    ref = cls(masters_ref, lr=1e-2, **kw)
    opt = fp16kit.MixedPrecisionOptimizer(cls(model.parameters(), lr=1e-2, **kw))
    scaler = fp16kit.GradScaler("cpu", init_scale=256.0)
    for _k in range(3):
        x = torch.randn(5, 4).half()
        opt.zero_grad()
        scaler.scale(model(x).float().pow(2).mean()).backward()
        grads = [p.grad.float() / 256.0 for p in model.parameters()]  # exact: powers of two
        scaler.step(opt)
        scaler.update()
        for m, g in zip(masters_ref, grads):
            m.grad = g
        ref.step()
        for p, m in zip(model.parameters(), masters_ref):
            assert torch.equal(p.detach(), m.detach().half())
        for m_opt, m in zip((p for grp in opt.param_groups for p in grp["params"]), masters_ref):
            assert m_opt.dtype == torch.float32
            assert torch.equal(m_opt.detach(), m.detach())


def test_deepcopy_keeps_the_optimizer_wide_settings():
    import copy

    p = [torch.zeros(2, requires_grad=True)]
    lamb = copy.deepcopy(LAMB(p, use_nvlamb=True, adam_w_mode=False, set_grad_none=False))
    assert (lamb.use_nvlamb, lamb.adam_w_mode, lamb.set_grad_none) == (True, False, False)
    assert copy.deepcopy(SGD(p, wd_after_momentum=True)).wd_after_momentum
    assert copy.deepcopy(NovoGrad(p, reg_inside_moment=True)).moment_mode == 0
    assert copy.deepcopy(Adagrad(p, adagrad_w_mode=True)).adagrad_w_mode


@pytest.mark.parametrize("cls,kw", ALL)
def test_state_of_other_shapes_is_refused_before_loading(cls, kw):
    a = [torch.zeros(6, requires_grad=True)]
    o1 = cls(a, **kw)
    a[0].grad = torch.ones(6)
    o1.step()
    b = [torch.zeros(2, 3, requires_grad=True)]
    o2 = cls(b, **kw)
    with pytest.raises(ValueError, match="group 0, param 0"):
        o2.load_state_dict(o1.state_dict())
    assert not o2.state
