"""fp16kit.nn's norms against the formulas of docs/apex-others.md §4.5, written out here."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fp16kit import nn as fnn

LOW = [torch.float16, torch.bfloat16]
ALL = [torch.float32, *LOW]


def _data(dtype, wdtype, shape=(3, 5, 8), nshape=(8,)):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=g) * 3 + 1).to(dtype)
    w = (torch.rand(nshape, generator=g) + 0.5).to(wdtype)
    b = torch.randn(nshape, generator=g).to(wdtype)
    return x, w, b


def _ref_layer_norm_fp32(x, w, b, eps, dims):
    x = x.double()
    mean = x.mean(dims, keepdim=True)
    var = ((x - mean) ** 2).mean(dims, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * w.double() + b.double()


def _ref_rms(x, nshape, w, eps):
    """apex's manual_rms_norm, as docs/apex-others.md §4.5 writes it."""
    dims = tuple(range(-1, -len(nshape) - 1, -1))
    ms = torch.mean(x.to(torch.float32) ** 2, dim=dims, keepdim=True)
    y = x * torch.rsqrt(ms + eps)
    if w is None:
        return y
    if w.dtype in (torch.float16, torch.bfloat16):
        y = y.to(w.dtype)
    return w * y


@pytest.mark.parametrize("dtype", ALL)
def test_layer_norm_is_f_layer_norm(dtype):
    x, w, b = _data(dtype, dtype)
    out = fnn.layer_norm(x, (8,), w, b, 1e-5)
    assert out.dtype == dtype
    assert torch.equal(out, F.layer_norm(x, (8,), w, b, 1e-5))


@pytest.mark.parametrize("dtype", ALL)
@pytest.mark.parametrize("wdtype", ALL)
def test_mixed_layer_norm_fp32_math_weight_dtype_out(dtype, wdtype):
    x, w, b = _data(dtype, wdtype, shape=(4, 2, 6), nshape=(2, 6))
    out = fnn.mixed_layer_norm(x, (2, 6), w, b, 1e-5)
    assert out.dtype == wdtype
    ref = _ref_layer_norm_fp32(x, w, b, 1e-5, (-2, -1))
    # fp32 math rounded once to the weight's dtype: within one rounding of the exact value
    tol = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}[wdtype]
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)


def test_mixed_layer_norm_keeps_fp32_for_low_precision_activations():
    x, w, b = _data(torch.float16, torch.float32)
    out = fnn.mixed_layer_norm(x, 8, w, b)
    assert out.dtype == torch.float32
    assert torch.equal(out, F.layer_norm(x.float(), (8,), w, b, 1e-5))


@pytest.mark.parametrize("dtype", ALL)
@pytest.mark.parametrize("wdtype", ALL)
def test_rms_norm_is_apex_formula_bit_for_bit(dtype, wdtype):
    x, w, _ = _data(dtype, wdtype, shape=(3, 4, 8), nshape=(4, 8))
    out = fnn.rms_norm(x, (4, 8), w, 1e-5)
    ref = _ref_rms(x, (4, 8), w, 1e-5)
    assert out.dtype == ref.dtype and torch.equal(out, ref)
    assert torch.equal(fnn.mixed_rms_norm(x, (4, 8), w, 1e-5), ref)


@pytest.mark.parametrize("dtype", LOW)
def test_rms_norm_without_weight_returns_fp32_on_cpu_as_apex(dtype):
    x, _, _ = _data(dtype, dtype)
    out = fnn.rms_norm(x, 8, None, 1e-6)
    assert out.dtype == torch.float32 and torch.equal(out, _ref_rms(x, (8,), None, 1e-6))


def test_rms_norm_value_against_definition():
    x, w, _ = _data(torch.float32, torch.float32)
    x64 = x.double()
    ref = x64 / torch.sqrt((x64**2).mean(-1, keepdim=True) + 1e-5) * w.double()
    torch.testing.assert_close(fnn.rms_norm(x, 8, w).double(), ref)


def test_modules_use_torch_state_dict_keys_both_ways():
    for mine, theirs in [
        (fnn.MixedLayerNorm(8), torch.nn.LayerNorm(8)),
        (fnn.RMSNorm(8), torch.nn.RMSNorm(8)),
        (fnn.MixedRMSNorm(8), torch.nn.RMSNorm(8)),
    ]:
        with torch.no_grad():
            for p in mine.parameters():
                p.uniform_()
        theirs.load_state_dict(mine.state_dict())
        mine.load_state_dict(theirs.state_dict())
        assert list(mine.state_dict()) == list(theirs.state_dict())


def test_modules_forward():
    x, w, b = _data(torch.bfloat16, torch.float32)
    ln = fnn.MixedLayerNorm(8)
    with torch.no_grad():
        ln.weight.copy_(w)
        ln.bias.copy_(b)
    assert torch.equal(ln(x), F.layer_norm(x.float(), (8,), w, b, 1e-5))
    rms = fnn.RMSNorm(8, eps=1e-6)
    assert rms.eps == 1e-6 and fnn.RMSNorm(8).eps == 1e-5
    assert torch.equal(rms(x), _ref_rms(x, (8,), rms.weight, 1e-6))
    mixed = fnn.MixedRMSNorm(8).half()
    assert mixed(x.float()).dtype == torch.float16


def test_gradients_flow_through_mixed_forms():
    x, w, b = _data(torch.float32, torch.float32)
    x.requires_grad_()
    w.requires_grad_()
    fnn.mixed_rms_norm(x, 8, w).sum().backward()
    ref_x = x.detach().clone().requires_grad_()
    ref_w = w.detach().clone().requires_grad_()
    _ref_rms(ref_x, (8,), ref_w, 1e-5).sum().backward()
    torch.testing.assert_close(x.grad, ref_x.grad)
    torch.testing.assert_close(w.grad, ref_w.grad)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fn", ["layer_norm", "mixed_layer_norm", "rms_norm", "mixed_rms_norm"])
def test_cuda_autocast_casts_input_and_params_first(fn):
    x, w, b = (t.cuda() for t in _data(torch.float32, torch.float32))
    args = (w, b) if "layer" in fn else (w,)
    with torch.autocast("cuda", dtype=torch.float16):
        out = getattr(fnn, fn)(x, 8, *args)
    assert out.dtype == torch.float16  # nn.LayerNorm under autocast would give fp32
    expected = getattr(fnn, fn)(x.half(), 8, *(a.half() for a in args))
    assert torch.equal(out, expected)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_dtypes_follow_apex_kernels():
    x, w, b = (t.cuda() for t in _data(torch.float16, torch.float32))
    assert fnn.mixed_layer_norm(x, 8, w, b).dtype == torch.float32
    assert fnn.mixed_rms_norm(x, 8, w).dtype == torch.float32
    assert fnn.rms_norm(x, 8, None).dtype == torch.float16
    assert fnn.rms_norm(x, 8, w.half()).dtype == torch.float16
    torch.testing.assert_close(fnn.rms_norm(x, 8, w.half()).cpu(), _ref_rms(x.cpu(), (8,), w.half().cpu(), 1e-5))
