"""fp16kit.legacy.fused_weight_norm.Fused_Weight_Norm: apex's 2018 autograd Function (spec §4.6)."""

from __future__ import annotations

import pytest
import torch

from fp16kit.legacy.fused_weight_norm import Fused_Weight_Norm


def test_apply_first_and_last_dim():
    torch.manual_seed(0)
    v = torch.randn(4, 3, 2, requires_grad=True)
    g0 = torch.randn(4, 1, 1, requires_grad=True)
    out = Fused_Weight_Norm.apply(v, g0)  # dim defaults to 0
    norms = v.detach().pow(2).sum((1, 2), keepdim=True).sqrt()
    torch.testing.assert_close(out, g0.detach() * v.detach() / norms)
    out.sum().backward()
    assert v.grad is not None and g0.grad.shape == g0.shape
    g2 = torch.randn(1, 1, 2)
    norms = v.detach().pow(2).sum((0, 1), keepdim=True).sqrt()
    torch.testing.assert_close(Fused_Weight_Norm.apply(v, g2, 2), g2 * v.detach() / norms)
    torch.testing.assert_close(Fused_Weight_Norm.apply(v, g2, -1), Fused_Weight_Norm.apply(v, g2, 2))


def test_half_input_half_output():
    v, g = torch.randn(8, 16).half(), torch.rand(8, 1).half()
    out = Fused_Weight_Norm.apply(v, g, 0)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out, torch._weight_norm(v.float(), g.float(), 0).half())


def test_middle_dim_is_apexs_runtime_error():
    with pytest.raises(RuntimeError, match=r"^Currently, Fused_Weight_Norm only supports first or last dimension\.$"):
        Fused_Weight_Norm.apply(torch.randn(3, 4, 5), torch.ones(1, 4, 1), 1)


def test_is_an_autograd_function():
    assert issubclass(Fused_Weight_Norm, torch.autograd.Function)
