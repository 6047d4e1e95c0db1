"""(contract) GradScaler checks that are not ports of a specific torch test: they pin torch's
documented state machine, error types/texts and warning locations. Each runs against
``torch.amp.GradScaler`` (they must pass for torch's class) and ``fp16kit.GradScaler``; what they
share with the ports of torch's tests is in tests/_helpers/torch_scaling.py.
"""

from __future__ import annotations

import pytest
import torch

from _helpers.torch_scaling import (
    SCALER_CLASSES,
    _assert_equal,
    _seed,  # noqa: F401 -- the autouse fixture: torch.manual_seed(0) before each test
    on_devices,
)

pytestmark = pytest.mark.parametrize("scaler_cls", SCALER_CLASSES)


# ---------------------------------------------------------------------------------------------
# (contract) torch's state machine, error types and texts
# ---------------------------------------------------------------------------------------------
def _one_param_case(scaler_cls, device, **kw):
    p = torch.ones(4, device=device, requires_grad=True)
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = scaler_cls(device, init_scale=8.0, **kw)
    scaler.scale((p * 2).sum()).backward()
    return p, opt, scaler


@on_devices
def test_state_machine_errors(scaler_cls, device):
    p, opt, scaler = _one_param_case(scaler_cls, device)
    scaler.unscale_(opt)
    with pytest.raises(
        RuntimeError, match=r"^unscale_\(\) has already been called on this optimizer since the last update\(\)\.$"
    ):
        scaler.unscale_(opt)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match=r"^unscale_\(\) is being called after step\(\)\.$"):
        scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match=r"^step\(\) has already been called since the last update\(\)\.$"):
        scaler.step(opt)
    scaler.update()
    # after update() the optimizer is READY again
    assert scaler._per_optimizer_states[id(opt)]["stage"] is torch.amp.grad_scaler.OptState.READY
    with pytest.raises(RuntimeError, match="^Closure use is not currently supported if GradScaler is enabled.$"):
        scaler.step(opt, closure=lambda: None)


@on_devices
def test_calls_before_scale_raise(scaler_cls, device):
    scaler = scaler_cls(device)
    opt = torch.optim.SGD([torch.ones(1, device=device, requires_grad=True)], lr=0.1)
    fix = "This may indicate your script did not use scaler.scale(loss or outputs) earlier in the iteration."
    for name, call in (
        ("unscale_", lambda: scaler.unscale_(opt)),
        ("step", lambda: scaler.step(opt)),
        ("update", lambda: scaler.update()),
    ):
        with pytest.raises(AssertionError) as exc:
            call()
        assert str(exc.value) == f"Attempted {name} but _scale is None.  " + fix
    assert scaler.get_scale() == 2.0**16  # the init scale, before the lazy init
    assert scaler._get_growth_tracker() == 0


@on_devices
def test_update_without_inf_checks_and_no_grad_step(scaler_cls, device):
    scaler = scaler_cls(device)
    scaler.scale(torch.ones((), device=device))
    with pytest.raises(AssertionError, match="^No inf checks were recorded prior to update.$"):
        scaler.update()
    opt = torch.optim.SGD([torch.ones(1, device=device, requires_grad=True)], lr=0.1)  # no grads
    with pytest.raises(AssertionError, match="^No inf checks were recorded for this optimizer.$"):
        scaler.step(opt)


@on_devices
def test_fp16_grads_rejected(scaler_cls, device):
    p = torch.ones(4, dtype=torch.float16, device=device, requires_grad=True)
    p.grad = torch.ones(4, dtype=torch.float16, device=device)
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = scaler_cls(device)
    scaler.scale(torch.ones((), device=device))
    # torch's text first; fp16kit's scaler adds the fix (MixedPrecisionOptimizer)
    fp16kit_hint = "" if scaler_cls is torch.amp.GradScaler else ".*MixedPrecisionOptimizer.*"
    with pytest.raises(ValueError, match=f"^Attempting to unscale FP16 gradients.{fp16kit_hint}$"):
        scaler.unscale_(opt)
    with pytest.raises(ValueError, match=f"^Attempting to unscale FP16 gradients.{fp16kit_hint}$"):
        scaler.step(opt)
    _assert_equal(p.grad, torch.ones(4))


@on_devices
def test_factor_validation(scaler_cls, device):
    with pytest.raises(AssertionError, match=r"^The growth factor must be > 1\.0\.$"):
        scaler_cls(device, growth_factor=1.0)
    with pytest.raises(AssertionError, match=r"^The backoff factor must be < 1\.0\.$"):
        scaler_cls(device, backoff_factor=1.0)
    # a disabled scaler does not validate them
    assert not scaler_cls(device, growth_factor=0.5, backoff_factor=2.0, enabled=False).is_enabled()


@on_devices
def test_update_new_scale(scaler_cls, device):
    p, opt, scaler = _one_param_case(scaler_cls, device)
    scaler.step(opt)
    scaler.update(3.0)
    assert scaler.get_scale() == 3.0
    new = torch.tensor(5.0, device=device)
    scaler.scale((p * 2).sum())
    scaler.update(new)
    new.fill_(11.0)  # copied, not aliased
    assert scaler.get_scale() == 5.0
    reason = (
        "new_scale should be a float or a 1-element torch.cuda.FloatTensor or "
        "torch.FloatTensor with requires_grad=False."
    )
    bads = [torch.ones(2, device=device), torch.tensor(2.0, device=device, requires_grad=True)]
    if device != "cpu":
        bads.append(torch.tensor(2.0))  # on another device type than the scaler's
    for bad in bads:
        with pytest.raises(AssertionError) as exc:
            scaler.update(bad)
        assert str(exc.value) == reason


@on_devices
def test_setters_getters(scaler_cls, device):
    scaler = scaler_cls(device, init_scale=4.0, growth_factor=3.0, backoff_factor=0.25, growth_interval=7)
    assert (scaler.get_growth_factor(), scaler.get_backoff_factor(), scaler.get_growth_interval()) == (3.0, 0.25, 7)
    scaler.set_growth_factor(5.0)
    scaler.set_backoff_factor(0.125)
    scaler.set_growth_interval(1)
    assert (scaler.get_growth_factor(), scaler.get_backoff_factor(), scaler.get_growth_interval()) == (5.0, 0.125, 1)
    assert (scaler._growth_factor, scaler._backoff_factor, scaler._growth_interval) == (5.0, 0.125, 1)
    assert scaler._init_scale == 4.0 and scaler._init_growth_tracker == 0
    assert scaler._scale is None and scaler._growth_tracker is None
    p = torch.ones(2, device=device, requires_grad=True)
    opt = torch.optim.SGD([p], lr=0.1)
    scaler.scale(p.sum()).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 20.0
    p.grad.fill_(float("nan"))
    scaler.scale(p.sum())
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.5


@on_devices
def test_fused_optimizer_without_grads_in_iteration(scaler_cls, device):
    # Two fused optimizers; one of them (an unused head) has no grads this iteration. torch
    # then hands that optimizer found_inf = sum([]) and its fused step is a no-op.
    trunk = torch.nn.Linear(4, 4).to(device)
    head = torch.nn.Linear(4, 4).to(device)
    opt_trunk = torch.optim.Adam(trunk.parameters(), lr=0.1, fused=True)
    opt_head = torch.optim.Adam(head.parameters(), lr=0.1, fused=True)
    scaler = scaler_cls(device, init_scale=8.0)
    head_before = [q.detach().clone() for q in head.parameters()]
    scaler.scale(trunk(torch.randn(2, 4, device=device)).sum()).backward()
    scaler.step(opt_trunk)
    scaler.step(opt_head)
    scaler.update()
    for q, q0 in zip(head.parameters(), head_before):
        _assert_equal(q, q0)
    assert scaler.get_scale() == 8.0 and scaler._get_growth_tracker() == 1
