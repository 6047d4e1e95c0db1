"""apex.normalization -> fp16kit.legacy.normalization (docs/apex-others.md §4.5)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from fp16kit.core import log as fp16kit_log
from fp16kit.legacy import normalization
from fp16kit.legacy.normalization import FusedLayerNorm, FusedRMSNorm, MixedFusedLayerNorm, MixedFusedRMSNorm
from fp16kit.legacy.normalization import fused_layer_norm as fln

ALL = [torch.float32, torch.float16, torch.bfloat16]


def _rms(x, nshape, w, eps):
    """apex's manual_rms_norm, written out."""
    dims = tuple(range(-1, -len(nshape) - 1, -1))
    y = x * torch.rsqrt(x.to(torch.float32).pow(2).mean(dims, keepdim=True) + eps)
    if w is None:
        return y
    if w.dtype in (torch.float16, torch.bfloat16):
        y = y.to(w.dtype)
    return w * y


def _randomize(module):
    torch.manual_seed(3)
    with torch.no_grad():
        for p in module.parameters():
            p.uniform_(0.5, 1.5)
    return module


def test_import_paths_and_defaults():
    assert normalization.fused_layer_norm is fln
    ln = FusedLayerNorm([4, 6])
    assert isinstance(ln, torch.nn.LayerNorm) and ln.normalized_shape == (4, 6) and ln.eps == 1e-5
    assert torch.equal(ln.weight, torch.ones(4, 6)) and torch.equal(ln.bias, torch.zeros(4, 6))
    assert ln.weight.dtype == torch.float32 and ln.memory_efficient is False
    rms = FusedRMSNorm(6)
    assert isinstance(rms, torch.nn.RMSNorm) and rms.eps == 1e-5 and torch.equal(rms.weight, torch.ones(6))
    assert [n for n, _ in rms.named_parameters()] == ["weight"]
    assert isinstance(MixedFusedLayerNorm(3), FusedLayerNorm) and isinstance(MixedFusedRMSNorm(3), FusedRMSNorm)
    assert list(FusedLayerNorm(3, elementwise_affine=False).parameters()) == []
    assert list(FusedRMSNorm(3, elementwise_affine=False).parameters()) == []


@pytest.mark.parametrize("dtype", ALL)
def test_fused_layer_norm_is_f_layer_norm(dtype):
    ln = _randomize(FusedLayerNorm(8)).to(dtype)
    x = torch.randn(3, 5, 8).to(dtype)
    assert torch.equal(ln(x), F.layer_norm(x, (8,), ln.weight, ln.bias, 1e-5))
    plain = FusedLayerNorm(8, elementwise_affine=False)
    assert torch.equal(plain(x), F.layer_norm(x, (8,), eps=1e-5))


@pytest.mark.parametrize("dtype", ALL)
def test_mixed_layer_norm_output_takes_the_weights_dtype(dtype):
    ln = _randomize(MixedFusedLayerNorm(8))
    x = torch.randn(3, 8).to(dtype)
    out = ln(x)
    assert out.dtype == torch.float32
    assert torch.equal(out, F.layer_norm(x.float(), (8,), ln.weight, ln.bias, 1e-5))
    ln.half()
    assert ln(x).dtype == torch.float16


@pytest.mark.parametrize("dtype", ALL)
@pytest.mark.parametrize("wdtype", ALL)
def test_rms_norms_are_apex_formula(dtype, wdtype):
    x = torch.randn(2, 3, 8).to(dtype)
    for cls in (FusedRMSNorm, MixedFusedRMSNorm):
        m = _randomize(cls([3, 8], eps=1e-6)).to(wdtype)
        assert torch.equal(m(x), _rms(x, (3, 8), m.weight, 1e-6))
    plain = FusedRMSNorm(8, elementwise_affine=False)
    assert torch.equal(plain(x), _rms(x, (8,), None, 1e-5))


def test_state_dicts_load_into_torch_modules_and_back():
    pairs = [
        (FusedLayerNorm(8), torch.nn.LayerNorm(8)),
        (MixedFusedLayerNorm(8), torch.nn.LayerNorm(8)),
        (FusedRMSNorm(8), torch.nn.RMSNorm(8)),
        (MixedFusedRMSNorm(8), torch.nn.RMSNorm(8)),
    ]
    for apex_style, torch_module in pairs:
        _randomize(apex_style)
        torch_module.load_state_dict(apex_style.state_dict())
        fresh = type(apex_style)(8)
        fresh.load_state_dict(torch_module.state_dict())
        assert torch.equal(fresh.weight, apex_style.weight)
    x = torch.randn(4, 8)
    ln, ref = pairs[0]
    assert torch.equal(ln(x), ref(x))


def test_mixed_classes_kwargs_as_apex():
    with pytest.warns(UserWarning, match="MixedFusedLayerNorm does not support `elementwise_affine` argument"):
        MixedFusedLayerNorm(4, elementwise_affine=True)
    with pytest.warns(UserWarning, match="MixedFusedRMSNorm does not support"):
        with pytest.raises(RuntimeError, match="MixedFusedRMSNorm does not support `elementwise_affine = False`"):
            MixedFusedRMSNorm(4, elementwise_affine=False)
    m = MixedFusedLayerNorm(4, 1e-6, sequence_parallel=True, no_persist_layer_norm=True)  # Megatron extras
    assert m.eps == 1e-6 and m.elementwise_affine


def test_memory_efficient_is_accepted_and_logged_once(caplog):
    fp16kit_log._seen.discard(("FusedLayerNorm", "memory_efficient"))
    with caplog.at_level(logging.INFO, logger="fp16kit"):
        FusedLayerNorm(4, memory_efficient=True)
        FusedLayerNorm(4, memory_efficient=True)
        FusedLayerNorm(4)
    assert caplog.text.count("FusedLayerNorm(memory_efficient=True)") == 1


def test_functional_forms_default_eps_1e_6():
    torch.manual_seed(0)
    x, w, b = torch.randn(3, 8), torch.rand(8) + 0.5, torch.randn(8)
    assert torch.equal(fln.fused_layer_norm_affine(x, w, b, (8,)), F.layer_norm(x, (8,), w, b, 1e-6))
    assert torch.equal(fln.fused_layer_norm(x, 8), F.layer_norm(x, (8,), eps=1e-6))
    xh = x.half()
    assert torch.equal(
        fln.mixed_dtype_fused_layer_norm_affine(xh, w, b, 8), F.layer_norm(x.half().float(), (8,), w, b, 1e-6)
    )
    assert torch.equal(fln.fused_rms_norm_affine(x, w, (8,)), _rms(x, (8,), w, 1e-6))
    assert torch.equal(fln.fused_rms_norm(xh, 8), _rms(xh, (8,), None, 1e-6))
    assert torch.equal(fln.mixed_dtype_fused_rms_norm_affine(xh, w, 8), _rms(xh, (8,), w, 1e-6))
    assert torch.equal(fln.manual_rms_norm(xh, (8,), w.half(), 1e-5), _rms(xh, (8,), w.half(), 1e-5))


def test_backward_through_the_modules():
    for cls in (FusedLayerNorm, MixedFusedLayerNorm, FusedRMSNorm, MixedFusedRMSNorm):
        m = cls(8)
        x = torch.randn(2, 8, requires_grad=True)
        m(x).pow(2).sum().backward()
        assert x.grad is not None and m.weight.grad is not None


def test_manual_rms_norm_is_the_plain_formula_even_under_cuda_autocast(monkeypatch):
    # apex's manual_rms_norm never cast for autocast nor to the input's dtype on CUDA; the
    # fused norms do. Pretend the CUDA autocast rule applies: manual_rms_norm must not notice.
    from fp16kit.nn import norm as nn_norm

    monkeypatch.setattr(nn_norm, "_autocast_dtype", lambda input: torch.bfloat16)
    torch.manual_seed(0)
    x, w = torch.randn(3, 8), torch.rand(8) + 0.5
    out = fln.manual_rms_norm(x, (8,), w, 1e-5)
    assert out.dtype == torch.float32 and torch.equal(out, _rms(x, (8,), w, 1e-5))
    assert fln.fused_rms_norm_affine(x, w, (8,)).dtype == torch.bfloat16  # the fused form does cast
    xh = x.half()
    out = fln.manual_rms_norm(xh, 8, None, 1e-6)
    assert out.dtype == torch.float32 and torch.equal(out, _rms(xh, (8,), None, 1e-6))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")
def test_manual_rms_norm_on_cuda_returns_what_the_formula_gives():
    x = torch.randn(3, 8, device="cuda", dtype=torch.float16)
    w = torch.rand(8, device="cuda") + 0.5
    assert fln.manual_rms_norm(x, (8,), None, 1e-5).dtype == torch.float32
    assert fln.manual_rms_norm(x, (8,), w, 1e-5).dtype == torch.float32
    with torch.autocast("cuda", dtype=torch.float16):
        assert torch.equal(fln.manual_rms_norm(x, (8,), w, 1e-5), _rms(x, (8,), w, 1e-5))


@pytest.mark.parametrize("name", ["fused_layer_norm", "fused_rms_norm"])
def test_functional_memory_efficient_is_logged_once(caplog, name):
    fp16kit_log._seen.discard((name, "memory_efficient"))
    fn = getattr(fln, name)
    x = torch.randn(2, 8)
    with caplog.at_level(logging.INFO, logger="fp16kit"):
        fn(x, 8, memory_efficient=True)
        fn(x, 8, memory_efficient=True)
        fn(x, 8)
    assert caplog.text.count(f"{name}(memory_efficient=True)") == 1
