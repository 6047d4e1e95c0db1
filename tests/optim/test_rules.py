"""Each fp16kit.optim optimizer against a hand-written per-tensor reference of the
pseudo-code (docs/apex-others.md §1.4, §3.1-3.5), several steps, fp32 and fp16/bf16 params.

The references below are written from docs/apex-others.md, tensor by tensor in plain arithmetic, not with
the code under test: fp32 params are compared with a float64 reference, low-precision params
with an fp32 reference that rounds the param to its dtype after every step (one rounding, as
apex's kernels)."""

from __future__ import annotations

import math

import pytest
import torch

from fp16kit.optim import LAMB, SGD, Adagrad, Adam, LegacyAdam, NovoGrad

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(4, 3), (7,), (2, 2, 2)]


def _tol(dtype):
    return {
        torch.float32: dict(rtol=1e-5, atol=1e-6),
        torch.float16: dict(rtol=2e-3, atol=2e-3),
        torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
    }[dtype]


def _ref_dtype(dtype):
    return torch.float64 if dtype == torch.float32 else torch.float32


def _setup(dtype, seed=0, steps=4):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=gen).to(dtype).requires_grad_() for s in SHAPES]
    grads = [[torch.randn(s, generator=gen).to(dtype) for s in SHAPES] for _ in range(steps)]
    return params, grads


def _run(opt_cls, kwargs, dtype, steps=4, seed=0):
    params, grads = _setup(dtype, seed, steps)
    ref = [p.detach().clone() for p in params]
    opt = opt_cls(params, **kwargs)
    for k in range(steps):
        for p, g in zip(params, grads[k]):
            p.grad = g.clone()
        opt.step()
    return params, ref, grads


# ------------------------------------------------------------------ references
def ref_adam(p0, grads, dtype, *, lr, betas, eps, wd, adam_w_mode, bias_correction):
    rd = _ref_dtype(dtype)
    ps = [p.to(rd) for p in p0]
    ms = [torch.zeros_like(p) for p in ps]
    vs = [torch.zeros_like(p) for p in ps]
    b1, b2 = betas
    for t, gs in enumerate(grads, start=1):
        bc1, bc2 = (1 - b1**t, 1 - b2**t) if bias_correction else (1.0, 1.0)
        for i, g in enumerate(gs):
            g = g.to(rd)
            if not adam_w_mode:
                g = g + wd * ps[i]
            ms[i] = b1 * ms[i] + (1 - b1) * g
            vs[i] = b2 * vs[i] + (1 - b2) * g * g
            u = (ms[i] / bc1) / ((vs[i] / bc2).sqrt() + eps)
            if adam_w_mode:
                u = u + wd * ps[i]
            ps[i] = (ps[i] - lr * u).to(dtype).to(rd)
    return ps


def ref_legacy_adam(
    p0, grads, dtype, *, lr, betas, eps, wd, eps_inside_sqrt, bias_correction, max_grad_norm=0.0, scale=1.0
):
    rd = _ref_dtype(dtype)
    ps = [p.to(rd) for p in p0]
    ms = [torch.zeros_like(p) for p in ps]
    vs = [torch.zeros_like(p) for p in ps]
    b1, b2 = betas
    for t, gs in enumerate(grads, start=1):
        combined = scale
        if max_grad_norm > 0:
            norm = math.sqrt(sum(float((g.to(torch.float64) ** 2).sum()) for g in gs))
            clip = (norm / scale + 1e-6) / max_grad_norm
            if clip > 1:
                combined = clip * scale
        step_size = lr * math.sqrt(1 - b2**t) / (1 - b1**t) if bias_correction else lr
        for i, g in enumerate(gs):
            g = g.to(rd) / combined
            ms[i] = b1 * ms[i] + (1 - b1) * g
            vs[i] = b2 * vs[i] + (1 - b2) * g * g
            denom = (vs[i] + eps).sqrt() if eps_inside_sqrt else vs[i].sqrt() + eps
            ps[i] = (ps[i] - step_size * (ms[i] / denom + wd * ps[i])).to(dtype).to(rd)
    return ps


def ref_lamb(
    p0,
    grads,
    dtype,
    *,
    lr,
    betas,
    eps,
    wd,
    adam_w_mode,
    grad_averaging,
    max_grad_norm,
    use_nvlamb,
    bias_correction=True,
):
    rd = _ref_dtype(dtype)
    ps = [p.to(rd) for p in p0]
    ms = [torch.zeros_like(p) for p in ps]
    vs = [torch.zeros_like(p) for p in ps]
    b1, b2 = betas
    b3 = 1 - b1 if grad_averaging else 1.0
    for t, gs in enumerate(grads, start=1):
        gnorm = math.sqrt(sum(float((g.to(torch.float64) ** 2).sum()) for g in gs))
        c = gnorm / max_grad_norm if max_grad_norm > 0 and gnorm > max_grad_norm else 1.0
        bc1, bc2 = (1 - b1**t, 1 - b2**t) if bias_correction else (1.0, 1.0)
        for i, g in enumerate(gs):
            pn = float(ps[i].norm())
            g = g.to(rd) / c
            if not adam_w_mode:
                g = g + wd * ps[i]
            ms[i] = b1 * ms[i] + b3 * g
            vs[i] = b2 * vs[i] + (1 - b2) * g * g
            u = (ms[i] / bc1) / ((vs[i] / bc2).sqrt() + eps)
            if adam_w_mode:
                u = u + wd * ps[i]
            un = float(u.norm())
            r = lr * pn / un if (use_nvlamb or wd != 0) and pn != 0 and un != 0 else lr
            ps[i] = (ps[i] - r * u).to(dtype).to(rd)
    return ps


def ref_novograd(
    p0,
    grads,
    dtype,
    *,
    lr,
    betas,
    eps,
    wd,
    reg_inside_moment,
    grad_averaging,
    norm_type,
    init_zero,
    bias_correction=True,
):
    rd = _ref_dtype(dtype)
    ps = [p.to(rd) for p in p0]
    ms = [torch.zeros_like(p) for p in ps]
    vs = [None] * len(ps)
    b1, b2 = betas
    b3 = 1 - b1 if grad_averaging else 1.0
    for t, gs in enumerate(grads, start=1):
        bc1, bc2 = (1 - b1**t, math.sqrt(1 - b2**t)) if bias_correction else (1.0, 1.0)
        for i, g in enumerate(gs):
            g = g.to(rd)
            n = float(g.norm()) if norm_type == 2 else float(g.abs().max())
            if vs[i] is None:
                vs[i] = 0.0 if init_zero else n
            if norm_type == 2:
                vs[i] = math.sqrt(b2 * vs[i] ** 2 + (1 - b2) * n**2)
            else:
                vs[i] = b2 * vs[i] + (1 - b2) * n
            d = vs[i] / bc2 + eps
            if reg_inside_moment:
                ms[i] = b1 * ms[i] + b3 * (g / d + wd * ps[i])
                new = ps[i] - lr * (ms[i] / bc1)
            else:
                ms[i] = b1 * ms[i] + b3 * g
                new = ps[i] - lr * ((ms[i] / bc1) / d + wd * ps[i])
            ps[i] = new.to(dtype).to(rd)
    return ps


def ref_adagrad(p0, grads, dtype, *, lr, eps, wd, w_mode):
    rd = _ref_dtype(dtype)
    ps = [p.to(rd) for p in p0]
    ss = [torch.zeros_like(p) for p in ps]
    for gs in grads:
        for i, g in enumerate(gs):
            g = g.to(rd)
            if not w_mode:
                g = g + wd * ps[i]
            ss[i] = ss[i] + g * g
            u = g / (ss[i].sqrt() + eps)
            if w_mode:
                u = u + wd * ps[i]
            ps[i] = (ps[i] - lr * u).to(dtype).to(rd)
    return ps


def ref_sgd(p0, grads, dtype, *, lr, momentum, dampening, wd, nesterov, wd_after_momentum):
    rd = _ref_dtype(dtype)
    ps = [p.to(rd) for p in p0]
    bufs = [None] * len(ps)
    for gs in grads:
        for i, g in enumerate(gs):
            g = g.to(rd)
            if wd and not wd_after_momentum:
                g = g + wd * ps[i]
            if momentum:
                bufs[i] = g.clone() if bufs[i] is None else momentum * bufs[i] + (1 - dampening) * g
                g = g + momentum * bufs[i] if nesterov else bufs[i]
            if wd and wd_after_momentum:
                g = g + wd * ps[i]
            ps[i] = (ps[i] - lr * g).to(dtype).to(rd)
    return ps


def _check(params, expected, dtype):
    for p, e in zip(params, expected):
        torch.testing.assert_close(p.detach().to(e.dtype), e, **_tol(dtype))


# ------------------------------------------------------------------ the tests
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("adam_w_mode", [True, False])
@pytest.mark.parametrize("bias_correction", [True, False])
def test_adam_matches_reference(dtype, adam_w_mode, bias_correction):
    kw = dict(
        lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1, adam_w_mode=adam_w_mode, bias_correction=bias_correction
    )
    params, ref, grads = _run(Adam, kw, dtype)
    expected = ref_adam(
        ref,
        grads,
        dtype,
        lr=1e-2,
        betas=(0.8, 0.95),
        eps=1e-6,
        wd=0.1,
        adam_w_mode=adam_w_mode,
        bias_correction=bias_correction,
    )
    _check(params, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("eps_inside_sqrt", [True, False])
@pytest.mark.parametrize("bias_correction", [True, False])
def test_legacy_adam_matches_reference(dtype, eps_inside_sqrt, bias_correction):
    kw = dict(
        lr=1e-2,
        betas=(0.8, 0.95),
        eps=1e-6,
        weight_decay=0.1,
        eps_inside_sqrt=eps_inside_sqrt,
        bias_correction=bias_correction,
    )
    params, ref, grads = _run(LegacyAdam, kw, dtype)
    expected = ref_legacy_adam(
        ref,
        grads,
        dtype,
        lr=1e-2,
        betas=(0.8, 0.95),
        eps=1e-6,
        wd=0.1,
        eps_inside_sqrt=eps_inside_sqrt,
        bias_correction=bias_correction,
    )
    _check(params, expected, dtype)


@pytest.mark.parametrize("max_grad_norm", [0.0, 0.5, 100.0])
def test_legacy_adam_scale_and_clip_with_supplied_grads(max_grad_norm):
    """fp32 masters stepped from scaled fp16 grads, written into fp16 outputs (the wrapper's
    call), clipping per group from the supplied norm of the scaled grads."""
    scale = 1024.0
    params, grads = _setup(torch.float32, seed=3, steps=3)
    ref = [p.detach().clone() for p in params]
    outs = [p.detach().half() for p in params]
    opt = LegacyAdam(params, lr=1e-2, max_grad_norm=max_grad_norm, bias_correction=False)
    for gs in grads:
        scaled = [(g * scale).half() for g in gs]
        norm = torch.sqrt(sum((s.double() ** 2).sum() for s in scaled))
        opt.step(grads=scaled, output_params=outs, scale=scale, grad_norms=[norm])
    exp_grads = [[(g * scale).half().double() for g in gs] for gs in grads]
    expected = ref_legacy_adam(
        ref,
        exp_grads,
        torch.float32,
        lr=1e-2,
        betas=(0.9, 0.999),
        eps=1e-8,
        wd=0.0,
        eps_inside_sqrt=False,
        bias_correction=False,
        max_grad_norm=max_grad_norm,
        scale=scale,
    )
    _check(params, expected, torch.float32)
    for o, e in zip(outs, expected):
        assert o.dtype == torch.float16
        torch.testing.assert_close(o.double(), e.half().double(), rtol=0, atol=1e-3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "case",
    [
        dict(wd=0.01, adam_w_mode=True, grad_averaging=True, max_grad_norm=1.0, use_nvlamb=False),
        dict(wd=0.0, adam_w_mode=True, grad_averaging=False, max_grad_norm=1.0, use_nvlamb=False),
        dict(wd=0.0, adam_w_mode=True, grad_averaging=True, max_grad_norm=100.0, use_nvlamb=True),
        dict(wd=0.05, adam_w_mode=False, grad_averaging=True, max_grad_norm=0.0, use_nvlamb=False),
        dict(wd=0.05, adam_w_mode=True, grad_averaging=True, max_grad_norm=-1.0, use_nvlamb=False),
    ],
)
def test_lamb_matches_reference(dtype, case):
    kw = dict(
        lr=1e-2,
        betas=(0.9, 0.99),
        eps=1e-6,
        weight_decay=case["wd"],
        adam_w_mode=case["adam_w_mode"],
        grad_averaging=case["grad_averaging"],
        max_grad_norm=case["max_grad_norm"],
        use_nvlamb=case["use_nvlamb"],
    )
    params, ref, grads = _run(LAMB, kw, dtype)
    expected = ref_lamb(ref, grads, dtype, lr=1e-2, betas=(0.9, 0.99), eps=1e-6, **case)
    _check(params, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "case",
    [
        dict(reg_inside_moment=False, grad_averaging=True, norm_type=2, init_zero=False),
        dict(reg_inside_moment=True, grad_averaging=False, norm_type=2, init_zero=False),
        dict(reg_inside_moment=False, grad_averaging=True, norm_type=0, init_zero=True),
        dict(reg_inside_moment=True, grad_averaging=True, norm_type=0, init_zero=False),
        dict(reg_inside_moment=False, grad_averaging=False, norm_type=2, init_zero=True),
    ],
)
def test_novograd_matches_reference(dtype, case):
    kw = dict(lr=1e-2, betas=(0.95, 0.98), eps=1e-8, weight_decay=0.01, **case)
    params, ref, grads = _run(NovoGrad, kw, dtype)
    expected = ref_novograd(ref, grads, dtype, lr=1e-2, betas=(0.95, 0.98), eps=1e-8, wd=0.01, **case)
    _check(params, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("w_mode", [True, False])
def test_adagrad_matches_reference(dtype, w_mode):
    params, ref, grads = _run(Adagrad, dict(lr=0.1, eps=1e-10, weight_decay=0.05, adagrad_w_mode=w_mode), dtype)
    _check(params, ref_adagrad(ref, grads, dtype, lr=0.1, eps=1e-10, wd=0.05, w_mode=w_mode), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "case",
    [
        dict(momentum=0.0, dampening=0.0, wd=0.0, nesterov=False, wd_after_momentum=False),
        dict(momentum=0.9, dampening=0.1, wd=0.01, nesterov=False, wd_after_momentum=False),
        dict(momentum=0.9, dampening=0.0, wd=0.01, nesterov=True, wd_after_momentum=False),
        dict(momentum=0.9, dampening=0.0, wd=0.01, nesterov=False, wd_after_momentum=True),
        dict(momentum=0.9, dampening=0.0, wd=0.01, nesterov=True, wd_after_momentum=True),
    ],
)
def test_sgd_matches_reference(dtype, case):
    kw = dict(
        lr=0.05,
        momentum=case["momentum"],
        dampening=case["dampening"],
        weight_decay=case["wd"],
        nesterov=case["nesterov"],
        wd_after_momentum=case["wd_after_momentum"],
    )
    params, ref, grads = _run(SGD, kw, dtype)
    _check(params, ref_sgd(ref, grads, dtype, lr=0.05, **case), dtype)
