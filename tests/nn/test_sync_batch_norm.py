"""fp16kit.nn.SyncBatchNorm in one process (docs/apex-others.md §4.3); two ranks with unequal
batches are in tests/legacy/parallel/test_two_ranks.py."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from fp16kit.nn import SyncBatchNorm, convert_sync_batchnorm


def _pair(c=4, **kw):
    torch.manual_seed(0)
    mine = SyncBatchNorm(c, **kw)
    ref = torch.nn.BatchNorm2d(c, **{k: v for k, v in kw.items() if k in ("eps", "momentum", "affine")})
    with torch.no_grad():
        if mine.affine:
            mine.weight.uniform_(0.5, 1.5)
            mine.bias.uniform_(-1, 1)
            ref.weight.copy_(mine.weight)
            ref.bias.copy_(mine.bias)
    return mine, ref


def _batchnorm_ref(x, weight, bias, eps):
    """Batch norm written out: biased batch variance over all dims but 1."""
    dims = [0] + list(range(2, x.dim()))
    mean = x.double().mean(dims, keepdim=True)
    var = ((x.double() - mean) ** 2).mean(dims, keepdim=True)
    shape = [1, -1] + [1] * (x.dim() - 2)
    return (x.double() - mean) / torch.sqrt(var + eps) * weight.double().view(shape) + bias.double().view(shape)


@pytest.mark.parametrize("momentum", [0.1, None])
def test_training_matches_batchnorm(momentum):
    mine, ref = _pair(momentum=momentum)
    for step in range(3):
        x = torch.randn(6, 4, 3, 3) * (step + 1) + step
        xm, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
        w = torch.randn(6, 4, 3, 3)
        out = mine(xm)
        torch.testing.assert_close(
            out.double(), _batchnorm_ref(x, mine.weight, mine.bias, mine.eps), rtol=1e-5, atol=1e-5
        )
        (out * w).sum().backward()
        (ref(xr) * w).sum().backward()
        torch.testing.assert_close(xm.grad, xr.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(mine.weight.grad, ref.weight.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(mine.bias.grad, ref.bias.grad)
    torch.testing.assert_close(mine.running_mean, ref.running_mean)
    torch.testing.assert_close(mine.running_var, ref.running_var)
    assert mine.num_batches_tracked.item() == ref.num_batches_tracked.item() == 3


def test_eval_is_f_batch_norm_exactly():
    mine, ref = _pair()
    for _ in range(2):
        mine(torch.randn(8, 4, 2, 2) + 3)
    mine.eval()
    x = torch.randn(5, 4, 2, 2)
    expected = F.batch_norm(x, mine.running_mean, mine.running_var, mine.weight, mine.bias, False, 0.0, mine.eps)
    assert torch.equal(mine(x), expected)
    before = mine.running_mean.clone()
    mine(x)
    assert torch.equal(before, mine.running_mean)


def test_channel_last_equals_channel_first_and_honours_z_and_relu():
    first, _ = _pair()
    last, _ = _pair(channel_last=True, fuse_relu=True)
    x = torch.randn(6, 4, 3, 3)
    z = torch.randn(6, 3, 3, 4)
    out_first = first(x).permute(0, 2, 3, 1)
    out_last = last(x.permute(0, 2, 3, 1), z)
    torch.testing.assert_close(out_last, torch.relu(out_first + z))
    torch.testing.assert_close(last.running_var, first.running_var)
    first.eval()
    last.eval()
    torch.testing.assert_close(last(x.permute(0, 2, 3, 1), z), torch.relu(first(x).permute(0, 2, 3, 1) + z))


def test_two_dimensional_input_takes_the_channel_last_path():
    bn, _ = _pair(c=3, fuse_relu=True)
    x, z = torch.randn(10, 3), torch.randn(10, 3)
    ref = torch.nn.functional.batch_norm(x, None, None, bn.weight, bn.bias, True, 0.0, bn.eps)
    torch.testing.assert_close(bn(x, z), torch.relu(ref + z))


def test_channel_first_ignores_z_and_fuse_relu_as_apex_and_says_so(caplog):
    bn, ref = _pair(fuse_relu=True)
    x = torch.randn(4, 4, 2, 2)
    with caplog.at_level(logging.INFO, logger="fp16kit"):
        out = bn(x, torch.randn(4, 4, 2, 2))
    torch.testing.assert_close(out, ref(x))
    assert (out < 0).any()
    assert "channel-last path" in caplog.text


def test_low_precision_input_fp32_params():
    mine, ref = _pair()
    x = torch.randn(6, 4, 3, 3)
    out = mine(x.half())
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), ref(x.half().float()), rtol=1e-3, atol=2e-3)
    mine.eval()
    ref.eval()
    out = mine(x.bfloat16())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref(x.bfloat16().float()), rtol=1e-2, atol=1e-2)


def test_large_mean_does_not_cancel_the_variance():
    bn = SyncBatchNorm(2, affine=False)
    x = torch.randn(64, 2, 4).double() + 3e4
    out = bn(x.float())
    torch.testing.assert_close(
        out.double(), _batchnorm_ref(x.float(), torch.ones(2), torch.zeros(2), 1e-5), rtol=1e-3, atol=1e-3
    )
    assert (bn.running_var - 0.1 * x.var((0, 2)).float() - 0.9).abs().max() < 1e-3


def test_without_running_stats_uses_batch_stats_in_eval_too():
    bn = SyncBatchNorm(4, track_running_stats=False, affine=False).eval()
    x = torch.randn(5, 4, 3)
    torch.testing.assert_close(bn(x), F.batch_norm(x, None, None, training=True, eps=1e-5))
    assert bn.running_mean is None


def test_bad_inputs_raise_clearly():
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        SyncBatchNorm(3)(torch.randn(1, 3))
    with pytest.raises(ValueError, match="pass channel_last=True"):
        SyncBatchNorm(3)(torch.randn(2, 4, 5, 3))
    with pytest.raises(ValueError, match="pass channel_last=False"):
        SyncBatchNorm(3, channel_last=True)(torch.randn(2, 3, 5, 5))
    with pytest.raises(TypeError, match="new_group"):
        SyncBatchNorm(3, process_group="world")


def test_convert_follows_torch_reuses_parameters_and_mode():
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 1),
        torch.nn.BatchNorm2d(4),
        torch.nn.InstanceNorm2d(4),
        torch.nn.Sequential(torch.nn.BatchNorm1d(4, momentum=None)),
    )
    model[1].eval()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    weight, buffer = model[1].weight, model[1].running_mean
    converted = convert_sync_batchnorm(model, channel_last=True)
    assert converted is model
    bn = converted[1]
    assert isinstance(bn, SyncBatchNorm) and bn.channel_last
    assert bn.weight is weight and bn.running_mean is buffer and not bn.training
    assert type(converted[2]) is torch.nn.InstanceNorm2d
    assert isinstance(converted[3][0], SyncBatchNorm) and converted[3][0].momentum is None
    assert any(p is weight for p in opt.param_groups[0]["params"])
    top = convert_sync_batchnorm(torch.nn.BatchNorm1d(3))
    assert isinstance(top, SyncBatchNorm)


def test_state_dict_keys_are_batchnorms():
    mine, ref = _pair()
    mine(torch.randn(4, 4, 2, 2))
    ref.load_state_dict(mine.state_dict())
    assert list(mine.state_dict()) == list(ref.state_dict())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_batchnorm():
    mine, ref = _pair()
    mine, ref = mine.cuda(), ref.cuda()
    x = (torch.randn(6, 4, 3, 3) * 2 + 1).cuda()
    xm, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    torch.testing.assert_close(mine(xm), ref(xr), rtol=1e-4, atol=1e-5)
    mine(xm).sum().backward()
    ref(xr).sum().backward()
    torch.testing.assert_close(xm.grad, xr.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(mine.running_var, ref.running_var)
    out = mine(x.half())
    assert out.dtype == torch.float16


def test_gradients_are_exact_in_float64():
    bn = SyncBatchNorm(3, channel_last=True, fuse_relu=True).double()
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
    x = torch.randn(5, 2, 3, dtype=torch.double, requires_grad=True)
    z = torch.randn(5, 2, 3, dtype=torch.double, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: bn(a, b), (x, z))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_cumulative_average_reads_no_count_on_the_host(monkeypatch, dtype):
    # momentum=None took 1 / float(num_batches_tracked): a device-to-host sync every step on CUDA
    def refuse(self, *args):
        raise AssertionError("a tensor was read on the host in forward")

    torch.manual_seed(0)
    mine = SyncBatchNorm(3, momentum=None).to(dtype)
    xs = [(torch.randn(6, 3) * 2 + 1).to(dtype) for _ in range(5)]
    means, vars_ = [], []
    for x in xs:  # apex's cumulative average, written out with Python floats
        xf = x.float()
        means.append(xf.mean(0).double())
        vars_.append(xf.var(0, unbiased=True).double())
    monkeypatch.setattr(torch.Tensor, "__float__", refuse)
    monkeypatch.setattr(torch.Tensor, "item", refuse)
    for x in xs:
        mine(x)
    monkeypatch.undo()
    assert int(mine.num_batches_tracked) == 5
    # the first step's m = 1/1 drops the initial buffers: the running stats are the averages
    tol = {torch.float16: 1e-2, torch.bfloat16: 5e-2}.get(dtype, 1e-5)
    torch.testing.assert_close(mine.running_mean.double(), torch.stack(means).mean(0), atol=tol, rtol=tol)
    torch.testing.assert_close(mine.running_var.double(), torch.stack(vars_).mean(0), atol=tol, rtol=tol)
