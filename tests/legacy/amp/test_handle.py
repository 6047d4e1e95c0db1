"""The 2018 handle API (docs/apex-amp.md §11): ``amp.init`` on CPU autocast, the handle's "old API"
error, and ``handle.wrap_optimizer`` against a hand-written reference (two losses per step,
one overflowing)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from fp16kit.legacy import amp
from fp16kit.legacy.amp import casts
from fp16kit.legacy.amp._amp_state import _amp_state

OLD_API = (
    "The old Amp API is no longer supported.  Please move to the new API, documented here:  "
    "https://nvidia.github.io/apex/amp.html.  Transition guide:  "
    "https://nvidia.github.io/apex/amp.html#transition-guide-for-old-api-users"
)


def _autocast_state():
    return torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), torch.is_autocast_enabled("cuda")


@pytest.fixture
def handle(monkeypatch):
    """``amp.init()`` on a CPU-only view of torch; autocast and ``_amp_state`` restored after."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name in ("handle", "opt_properties"):
        if hasattr(_amp_state, name):
            monkeypatch.setattr(_amp_state, name, getattr(_amp_state, name))
    monkeypatch.delattr(_amp_state, "opt_properties", raising=False)
    monkeypatch.setattr(_amp_state, "verbosity", 1)  # apex's default (earlier tests set 0)
    before = _autocast_state()
    h = amp.init()
    yield h
    casts._disable_o1_for_tests()
    assert _autocast_state() == before


def test_init_switches_o1_on_and_sets_the_handle(handle):
    assert _amp_state.handle is handle and handle.is_active()
    lin = nn.Linear(4, 4)
    assert lin(torch.randn(2, 4)).dtype == torch.float16  # CPU autocast, float16
    with amp.disable_casts():
        assert lin(torch.randn(2, 4)).dtype == torch.float32
        assert not handle.is_active()
    assert handle.is_active()
    # no opt_properties: amp.scale_loss still asks for amp.initialize (§6)
    with pytest.raises(RuntimeError, match="internal Amp state has not been initialized"):
        with amp.scale_loss(torch.ones(()), torch.optim.SGD(lin.parameters(), lr=0.1)):
            pass


def test_handle_scale_loss_raises_apex_text(handle):
    opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(RuntimeError) as e:
        with handle.scale_loss(torch.ones(()), opt):
            pass
    assert str(e.value) == OLD_API


def test_deactivate_leaves_o1(handle):
    handle._deactivate()
    assert not handle.is_active() and not torch.is_autocast_enabled("cpu")
    assert nn.Linear(2, 2)(torch.randn(1, 2)).dtype == torch.float32


def test_disabled_init_is_a_no_op_handle():
    before = _autocast_state()
    h = amp.init(enabled=False)
    assert not h.is_active() and _autocast_state() == before
    lin = nn.Linear(3, 1)
    opt = h.wrap_optimizer(torch.optim.SGD(lin.parameters(), lr=0.5))
    loss = lin(torch.ones(1, 3)).sum()
    with h.scale_loss(loss, opt) as s:
        assert s is loss
    with opt.scale_loss(loss) as s:
        assert s is loss
        s.backward()
    w = lin.weight.detach().clone()
    opt.step()
    assert torch.equal(lin.weight, w - 0.5 * torch.ones(1, 3))


def _losses(lin, x, blow_up):
    out = lin(x)  # fp16 under O1
    a = (out.float() ** 2).mean() * 1e-2  # fp16 grads well inside range at a scale of 2**16
    b = out.float().sum() * (1e6 if blow_up else 1e-3)  # 1e6 * 2**16 overflows fp16 in backward
    return a, b


def _ref_grads(lin, x, blow_up, scales):
    """Each loss's grads unscaled by its own scale, summed (apex's wrapper)."""
    params = list(lin.parameters())
    total = None
    found = []
    for loss, s in zip(_losses(lin, x, blow_up), scales):
        g = torch.autograd.grad(loss * s, params, retain_graph=True)
        g = [t * torch.tensor(1.0 / s, dtype=torch.float32) for t in g]
        found.append(not all(torch.isfinite(t).all() for t in g))
        total = g if total is None else [a + b for a, b in zip(total, g)]
    return total, found


def test_wrap_optimizer_two_losses_against_reference(handle, caplog):
    torch.manual_seed(0)
    lin = nn.Linear(8, 4)
    ref = nn.Linear(8, 4)
    ref.load_state_dict(lin.state_dict())
    opt = handle.wrap_optimizer(torch.optim.SGD(lin.parameters(), lr=0.1), num_loss=2)
    lr = 0.1
    scales = [2.0**16, 2.0**16]
    for it, blow_up in enumerate([False, True, False]):
        x = torch.randn(5, 8)
        grads, found = _ref_grads(ref, x, blow_up, scales)
        opt.zero_grad()
        before = [p.detach().clone() for p in lin.parameters()]
        for k, loss in enumerate(_losses(lin, x, blow_up)):
            with opt.scale_loss(loss) as scaled:
                assert scaled.dtype == loss.dtype and torch.equal(scaled, loss * scales[k])
                scaled.backward(retain_graph=True)  # both losses share one forward
        if not blow_up:  # the grads the optimizer sees: unscaled and summed
            for p, g in zip(lin.parameters(), grads):
                assert torch.equal(p.grad, g)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="fp16kit"):
            opt.step()
        skipped = any(found)
        assert skipped == blow_up, it
        assert ("Gradient overflow, skipping update" in caplog.text) == blow_up, (it, caplog.text)
        if skipped:
            for p, b in zip(lin.parameters(), before):
                assert torch.equal(p, b)
            scales = [s / 2 if f else s for s, f in zip(scales, found)]
        else:
            with torch.no_grad():
                for p, g in zip(ref.parameters(), grads):
                    p -= lr * g
            for p, r in zip(lin.parameters(), ref.parameters()):
                assert torch.equal(p, r)
        assert [s.loss_scale() for s in opt._loss_scaler] == scales
    assert scales == [2.0**16, 2.0**15]  # only the overflowing loss's scaler halved


def test_second_loss_without_grads_keeps_the_first(handle):
    a, b = nn.Linear(3, 1), nn.Linear(3, 1)
    opt = handle.wrap_optimizer(torch.optim.SGD([*a.parameters(), *b.parameters()], lr=1.0), num_loss=2)
    x = torch.ones(1, 3)
    with opt.scale_loss(a(x).float().sum() * 0.25) as s:  # 1.0 * 2**16 would overflow fp16
        s.backward()
    first = [p.grad.clone() for p in a.parameters()]
    with opt.scale_loss(b(x).float().sum() * 0.25) as s:
        s.backward()
    for p, g in zip(a.parameters(), first):
        assert torch.equal(p.grad, g)
    assert torch.equal(b.weight.grad, torch.full((1, 3), 0.25))


def test_wrapper_errors(handle):
    lin = nn.Linear(2, 1)
    opt = handle.wrap_optimizer(torch.optim.SGD(lin.parameters(), lr=0.1))
    with pytest.raises(NotImplementedError) as e:
        opt.step(lambda: 0.0)
    assert str(e.value) == "The `closure` argument is unsupported by the amp optimizer wrapper."
    with opt.scale_loss(lin(torch.ones(1, 2)).float().sum()) as s:
        s.backward()
    with pytest.raises(RuntimeError, match="num_loss=2"):
        with opt.scale_loss(lin(torch.ones(1, 2)).float().sum()):
            pass
    assert opt.param_groups[0]["lr"] == 0.1  # the optimizer's surface
