"""fp16kit.legacy.fused_weight_norm.Fused_Weight_Norm: apex's 2018 autograd Function (docs/apex-others.md §4.6)."""

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


@pytest.mark.parametrize("dim", [0, -1])
def test_gradients_and_second_derivatives_match_torch_weight_norm(dim):
    """apex's 2018 Function, first and second order (a Hessian-vector product in the weights:
    the forward's norms must be in the backward's graph), against autograd through the
    definition g * v / ||v||, and its first-order grads against torch._weight_norm (whose CPU
    double backward in v is itself wrong in torch 2.13: not symmetric)."""
    torch.manual_seed(0)
    v = torch.randn(4, 3, 5, dtype=torch.float64, requires_grad=True)
    g = torch.rand((4, 1, 1) if dim == 0 else (1, 1, 5), dtype=torch.float64, requires_grad=True)
    w_out = torch.randn(4, 3, 5, dtype=torch.float64)
    probe = torch.randn(4, 3, 5, dtype=torch.float64)

    def hvp(fn):
        vv, gg = v.detach().clone().requires_grad_(), g.detach().clone().requires_grad_()
        loss = (fn(vv, gg) * w_out).pow(2).sum()
        gv, gg_grad = torch.autograd.grad(loss, (vv, gg), create_graph=True)
        (gv * probe).sum().backward()
        return gv.detach(), gg_grad.detach(), vv.grad, gg.grad

    ours = hvp(lambda a, b: Fused_Weight_Norm.apply(a, b, dim))
    reduce = (1, 2) if dim == 0 else (0, 1)
    definition = hvp(lambda a, b: b * a / a.pow(2).sum(reduce, keepdim=True).sqrt())
    for a, b in zip(ours, definition):
        torch.testing.assert_close(a, b)
    first_order = hvp(lambda a, b: torch._weight_norm(a, b, dim % 3))[:2]
    for a, b in zip(ours[:2], first_order):
        torch.testing.assert_close(a, b)
    assert torch.autograd.gradgradcheck(
        lambda a, b: Fused_Weight_Norm.apply(a, b, dim),
        (
            v[:2, :2, :3].detach().clone().requires_grad_(),
            g[:2].detach().clone().requires_grad_() if dim == 0 else g[..., :3].detach().clone().requires_grad_(),
        ),
    )
