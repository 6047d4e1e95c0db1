"""fp16kit.demo.measure: the updates lost to rounding, and the bytes of training state."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fp16kit
from fp16kit.demo.measure import STATE_PARTS, LostUpdates, state_bytes


def _sgd_step(param: torch.Tensor, grad: torch.Tensor) -> LostUpdates:
    opt = torch.optim.SGD([param], lr=1.0)
    counter = LostUpdates(opt)
    param.grad = grad.to(param.dtype)
    opt.step()
    return counter


@pytest.mark.parametrize("dtype, kept", [(torch.bfloat16, 1), (torch.float16, 2), (torch.float32, 4)])
def test_an_update_under_half_a_step_of_the_weight_is_lost(dtype, kept):
    # w = 1 stepped down: the grid step below 1 is 2**-8 (bf16), 2**-11 (fp16), 2**-24 (fp32);
    # an update under half a step rounds back to 1
    w = torch.ones(4, dtype=dtype)
    counter = _sgd_step(w, torch.tensor([2.0**-5, 3 * 2.0**-11, 2.0**-14, 2.0**-20]))
    assert counter.counts() == (4 - kept, 4)
    assert int((w == 1).sum()) == 4 - kept


def test_a_step_not_taken_is_not_counted():
    w = torch.ones(3, dtype=torch.bfloat16)
    opt = torch.optim.SGD([w], lr=1.0)
    counter = LostUpdates(opt)
    assert counter.counts() == (0, 0)
    w.grad = torch.full((3,), 2.0**-12, dtype=torch.bfloat16)
    opt.step()
    opt.step()
    assert counter.counts() == (6, 6)
    counter.remove()
    opt.step()
    assert counter.counts() == (6, 6)


def test_with_masters_the_counter_on_the_inner_optimizer_sees_the_masters():
    # the same tiny update: lost on a bf16 weight, kept by its fp32 master
    model = nn.Linear(4, 1, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        model.weight.fill_(1.0)
    inner = torch.optim.SGD(model.parameters(), lr=1.0)
    opt = fp16kit.MixedPrecisionOptimizer(inner)
    counter = LostUpdates(inner)
    model.weight.grad = torch.full((1, 4), 2.0**-12, dtype=torch.bfloat16)
    opt.step()
    assert counter.counts() == (0, 4)
    assert torch.equal(model.weight, torch.ones(1, 4, dtype=torch.bfloat16))  # the model's copy rounds


def test_asynchronous_steps_are_counted_on_the_optimizer_thread():
    def run(async_step: bool) -> tuple[int, int]:
        torch.manual_seed(0)
        model = nn.Linear(16, 8).to(torch.bfloat16)
        inner = torch.optim.AdamW(model.parameters(), lr=1e-4)
        opt = fp16kit.MixedPrecisionOptimizer(inner, async_step=async_step)
        counter = LostUpdates(inner)
        x = torch.randn(32, 16, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
        for _ in range(3):
            opt.zero_grad()
            model(x).float().pow(2).mean().backward()
            opt.step()
        opt.synchronize()
        return counter.counts()

    sync = run(False)
    assert sync[1] == 3 * (16 * 8 + 8)
    assert run(True) == sync


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_state_bytes_of_fp32_adamw_are_its_tensors():
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    state = [v for s in opt.state.values() for v in s.values()]
    got = state_bytes(model, opt)
    assert list(got) == list(STATE_PARTS)
    assert got == {"weights": 4 * n, "grads": 4 * n, "optimizer state": _nbytes(state), "masters": 0}
    assert _nbytes(state) == 8 * n + 4 * len(params)  # two fp32 moments + a step count per tensor


def test_state_bytes_count_masters_and_their_grads():
    model = nn.Linear(8, 4).to(torch.float16)
    inner = torch.optim.AdamW(model.parameters())
    opt = fp16kit.MixedPrecisionOptimizer(inner)
    scaler = fp16kit.GradScaler("cpu")
    scaler.scale(model(torch.randn(2, 8).half()).float().sum()).backward()
    scaler.step(opt)
    n = sum(p.numel() for p in model.parameters())
    masters = opt.master_params
    got = state_bytes(model, inner)
    assert got["weights"] == got["grads"] == 2 * n
    assert got["masters"] == _nbytes(masters) + _nbytes(m.grad for m in masters if m.grad is not None) == 8 * n


def test_views_of_one_buffer_count_once():
    flat = torch.zeros(10, requires_grad=True)
    model = nn.Module()
    model.a = nn.Parameter(flat.detach()[:4])
    model.b = nn.Parameter(flat.detach()[4:])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert state_bytes(model, opt)["weights"] == 40
