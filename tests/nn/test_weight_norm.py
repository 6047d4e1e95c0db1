"""fp16kit.nn.weight_norm: g * v / ||v|| over every dim but the first or last (docs/apex-others.md §4.6)."""

from __future__ import annotations

import pytest
import torch

from fp16kit.nn import WeightNorm, weight_norm


def _formula(v, g, dim):
    """The definition, in float64: the norm over every dim but ``dim``."""
    dims = [d for d in range(v.dim()) if d != dim % v.dim()]
    norm = v.double().pow(2).sum(dims, keepdim=True).sqrt()
    return g.double().reshape(norm.shape) * v.double() / norm


@pytest.mark.parametrize("dim", [0, 2, -1])
def test_forward_matches_definition_and_torch(dim):
    torch.manual_seed(0)
    v = torch.randn(4, 3, 5)
    gshape = (4, 1, 1) if dim == 0 else (1, 1, 5)
    g = torch.randn(gshape)
    out = weight_norm(v, g, dim)
    torch.testing.assert_close(out.double(), _formula(v, g, dim))
    torch.testing.assert_close(out, torch._weight_norm(v, g, dim % 3))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_fp32_math_input_dtype_out(dtype):
    torch.manual_seed(1)
    v, g = torch.randn(6, 8).to(dtype), torch.rand(6, 1).to(dtype) + 0.5
    out = weight_norm(v, g, 0)
    assert out.dtype == dtype
    # computed in fp32 and rounded once
    assert torch.equal(out, _formula(v.float(), g.float(), 0).float().to(dtype))


def test_gradients_match_autograd_of_the_definition():
    torch.manual_seed(2)
    for dim, gshape in [(0, (5,)), (-1, (1, 1, 3)), (0, (1,))]:
        v = torch.randn(5 if gshape != (1,) else 1, 2, 3, dtype=torch.double, requires_grad=True)
        g = torch.randn(gshape, dtype=torch.double, requires_grad=True)
        gw = torch.randn(v.shape, dtype=torch.double)
        (weight_norm(v, g, dim) * gw).sum().backward()
        v2, g2 = v.detach().clone().requires_grad_(), g.detach().clone().requires_grad_()
        (_formula(v2, g2, dim) * gw).sum().backward()
        torch.testing.assert_close(v.grad, v2.grad)
        torch.testing.assert_close(g.grad, g2.grad)
        assert g.grad.shape == g.shape


def test_fp16_grads_come_back_in_input_dtypes():
    v = torch.randn(3, 4).half().requires_grad_()
    g = torch.rand(3, 1).half().requires_grad_()
    weight_norm(v, g).sum().backward()
    assert v.grad.dtype == g.grad.dtype == torch.float16


def test_bad_arguments_name_the_fix():
    v = torch.randn(3, 4, 5)
    with pytest.raises(ValueError, match="first .dim=0. or the last"):
        weight_norm(v, torch.ones(4), 1)
    with pytest.raises(ValueError, match="one value per slice"):
        weight_norm(v, torch.ones(4), 0)
    with pytest.raises(ValueError, match="0-D"):
        WeightNorm.apply(torch.tensor(1.0), torch.tensor(1.0), 0)
