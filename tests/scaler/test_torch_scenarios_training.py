"""PyTorch's own GradScaler test scenarios, ported to pytest (run on CPU and, when present, CUDA):
training loops with a scaler against unscaled control runs, and the optimizer step protocol.

* test/test_torch.py (TestTorchDeviceType): ``_run_scaling_case`` and the scenarios built on it
  (``test_grad_scaling_autocast`` with foreach/fused variants for SGD/Adam/AdamW,
  ``test_grad_scaling_clipping``, ``test_grad_scaling_clipping_separate_unscale``,
  ``test_grad_scaling_penalty``, ``test_grad_scaling_accumulation``),
  ``test_grad_scaling_multiple``, ``test_grad_scaling_autocast_fused_optimizers``,
  ``test_params_invalidated_with_grads_invalidated_between_unscale_and_step``.
* test/test_cuda.py: ``test_grad_scaler_pass_itself``,
  ``test_grad_scaler_with_preset_grad_scale``, and a fused step skipping on inf.

Each test runs for torch's class and for fp16kit's: see tests/_helpers/torch_scaling.py.
"""

from __future__ import annotations

import contextlib
import copy
import pickle
from itertools import chain

import pytest
import torch

from _helpers.torch_scaling import (
    _FUSED_OPTIM_INPUTS,
    AUTOCAST_DTYPE,
    SCALER_CLASSES,
    _assert_equal,
    _create_scaling_case,
    _create_scaling_models_optimizers,
    _seed,  # noqa: F401 -- the autouse fixture: torch.manual_seed(0) before each test
    on_devices,
)

pytestmark = pytest.mark.parametrize("scaler_cls", SCALER_CLASSES)


# ---------------------------------------------------------------------------------------------
# _run_scaling_case and the single-optimizer scenarios built on it
# ---------------------------------------------------------------------------------------------
def _run_scaling_case(
    scaler_cls,
    device,
    run,
    unskipped,
    skipped,
    atol=1e-7,
    optimizer_ctor=torch.optim.SGD,
    optimizer_kwargs=None,
):
    # Ensure scaling can be disabled without changing user control flow.
    for enabled in True, False:
        (
            mod_control,
            mod_scaling,
            opt_control,
            opt_scaling,
            data,
            loss_fn,
            skip_iter,
        ) = _create_scaling_case(device=device, optimizer_ctor=optimizer_ctor, optimizer_kwargs=optimizer_kwargs)

        # For functionality, test with a modest initial scale, and an unrealistically-large growth factor
        # so any potential errors with the growth factor handling will be magnified.
        scaler = scaler_cls(device, init_scale=128.0, growth_factor=2.0, enabled=enabled, growth_interval=1)

        _ = run(device, data, mod_control, opt_control, scaler, loss_fn, skip_iter, False)
        ret = run(device, data, mod_scaling, opt_scaling, scaler, loss_fn, skip_iter, True)

        # Allows run() to optionally return a different scaler instance.
        scaler = ret if ret else scaler
        assert isinstance(scaler, scaler_cls)

        # If scaling was enabled, the scale factor should have been multiplied by the growth factor
        # len(data) - skipped times and the backoff factor "skipped" times.
        if enabled:
            net_growth = scaler.get_growth_factor() ** unskipped if unskipped > 0 else 1.0
            net_backoff = scaler.get_backoff_factor() ** skipped if skipped > 0 else 1.0
            assert scaler.get_scale() == (128.0 * net_growth * net_backoff)
        else:
            assert scaler.get_scale() == 1.0

        for c, s in zip(mod_control.parameters(), mod_scaling.parameters()):
            _assert_equal(c.grad, s.grad, atol=atol, rtol=1e-05)

            c_state, s_state = opt_control.state[c], opt_scaling.state[s]
            for k in c_state:
                _assert_equal(c_state[k], s_state[k], atol=atol, rtol=1e-05, msg=k)

            _assert_equal(c, s, atol=atol, rtol=1e-05)


_AUTOCAST_OPTIMS = [
    pytest.param(torch.optim.SGD, id="SGD"),
    pytest.param(torch.optim.Adam, id="Adam"),
    pytest.param(torch.optim.AdamW, id="AdamW"),
]


# Compares no scaling + no autocasting against scaling + autocasting.
@on_devices
@pytest.mark.parametrize(
    "foreach, fused",
    [(None, None), (True, None), (None, True)],
    ids=["default", "foreach", "fused"],
)
@pytest.mark.parametrize("optimizer_ctor", _AUTOCAST_OPTIMS)
@pytest.mark.parametrize("try_pickle", [False, True], ids=["nopickle", "pickle"])
def test_grad_scaling_autocast(scaler_cls, device, optimizer_ctor, foreach, fused, try_pickle):
    def run(device, data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        for i, (input, target) in enumerate(data):
            optimizer.zero_grad()
            with torch.autocast(device_type=device, dtype=AUTOCAST_DTYPE[device], enabled=try_scaling_api):
                output = model(input)
                loss = loss_fn(output, target)
            if try_scaling_api:
                scaler.scale(loss).backward()
                if i == skip_iter and scaler.is_enabled():
                    with torch.no_grad():
                        model[1].weight.grad.fill_(float("inf"))
                scaler.step(optimizer)
                scaler.update()
                if try_pickle:
                    scaler = pickle.loads(pickle.dumps(scaler))
            else:
                loss.backward()
                if (not scaler.is_enabled()) or (i != skip_iter):
                    optimizer.step()
        return scaler

    # Compare non scaling optimizer step as well as scaling optimizer step. As in torch's test,
    # Adam/AdamW (whose normalised steps amplify fp16 rounding) are expected to miss the
    # tolerance; the match pins that it is the tensor comparison that fails, after the
    # scale-trajectory assertion passed.
    if optimizer_ctor in (torch.optim.Adam, torch.optim.AdamW):
        context = pytest.raises(AssertionError, match="Tensor-likes are not close")
    else:
        context = contextlib.nullcontext()
    with context:
        # sets atol=1e-3 because we're comparing pure fp32 arithmetic vs a mixture of fp16 and fp32
        _run_scaling_case(
            scaler_cls,
            device,
            run,
            unskipped=3,
            skipped=1,
            atol=1e-3,
            optimizer_ctor=optimizer_ctor,
            optimizer_kwargs={"foreach": foreach, "fused": fused},
        )

    # Drop-in check (not in torch's test): the scaled run is bit-identical to torch's scaler's.
    def scaled_run(cls):
        torch.manual_seed(0)
        _, mod_scaling, _, opt_scaling, data, loss_fn, skip_iter = _create_scaling_case(
            device=device,
            optimizer_ctor=optimizer_ctor,
            optimizer_kwargs={"foreach": foreach, "fused": fused},
        )
        scaler = cls(device, init_scale=128.0, growth_factor=2.0, growth_interval=1)
        scaler = run(device, data, mod_scaling, opt_scaling, scaler, loss_fn, skip_iter, True)
        return scaler.get_scale(), [p.detach().clone() for p in mod_scaling.parameters()]

    ref_scale, ref_params = scaled_run(torch.amp.GradScaler)
    got_scale, got_params = scaled_run(scaler_cls)
    assert got_scale == ref_scale
    for got, ref in zip(got_params, ref_params):
        torch.testing.assert_close(got, ref, rtol=0, atol=0)


@on_devices
def test_grad_scaling_clipping(scaler_cls, device):
    def run(device, data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        max_norm = 0.2  # A reasonable value that actually has an effect, based on printouts of grads
        for i, (input, target) in enumerate(data):
            optimizer.zero_grad()
            output = model(input)
            loss = loss_fn(output, target)
            if try_scaling_api:
                scaler.scale(loss).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm * scaler.get_scale())
                if i == skip_iter and scaler.is_enabled():
                    model[1].weight.grad.data.fill_(float("inf"))
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
                if (not scaler.is_enabled()) or (i != skip_iter):
                    optimizer.step()

    _run_scaling_case(scaler_cls, device, run, unskipped=3, skipped=1, atol=1e-5)


@on_devices
def test_grad_scaling_clipping_separate_unscale(scaler_cls, device):
    def run(device, data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        max_norm = 0.2  # A reasonable value that actually has an effect, based on printouts of grads
        for i, (input, target) in enumerate(data):
            optimizer.zero_grad()
            output = model(input)
            loss = loss_fn(output, target)
            if try_scaling_api:
                scaler.scale(loss).backward()
                if i == skip_iter and scaler.is_enabled():
                    model[1].weight.grad.data.fill_(float("inf"))
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, error_if_nonfinite=False)
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
                if (not scaler.is_enabled()) or (i != skip_iter):
                    optimizer.step()

    _run_scaling_case(scaler_cls, device, run, unskipped=3, skipped=1)


@on_devices
def test_grad_scaling_penalty(scaler_cls, device):
    def run(device, data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        for i, (input, target) in enumerate(data):
            optimizer.zero_grad()
            output = model(input)
            loss = loss_fn(output, target)

            if try_scaling_api:
                grad_params = torch.autograd.grad(scaler.scale(loss), model.parameters(), create_graph=True)
                inv_scale = 1.0 / scaler.get_scale()
                grad_params = [p * inv_scale for p in grad_params]
            else:
                grad_params = torch.autograd.grad(loss, model.parameters(), create_graph=True)

            grad_norm = 0
            for grad in grad_params:
                grad_norm += grad.pow(2).sum()
            grad_norm = grad_norm.sqrt()
            loss = loss + grad_norm

            if try_scaling_api:
                scaler.scale(loss).backward()
                if i == skip_iter and scaler.is_enabled():
                    model[1].weight.grad.data.fill_(float("inf"))
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                if (not scaler.is_enabled()) or (i != skip_iter):
                    optimizer.step()

    _run_scaling_case(scaler_cls, device, run, unskipped=3, skipped=1)


@on_devices
def test_grad_scaling_accumulation(scaler_cls, device):
    def run(device, data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        iters_to_accumulate = 2
        for i, (input, target) in enumerate(data):
            output = model(input)
            loss = loss_fn(output, target)
            loss = loss / iters_to_accumulate
            if try_scaling_api:
                scaler.scale(loss).backward()
            else:
                loss.backward()
            if (i + 1) % iters_to_accumulate == 0:
                if try_scaling_api:
                    scaler.step(optimizer)
                    scaler.update()
                    optimizer.zero_grad()
                else:
                    optimizer.step()
                    optimizer.zero_grad()

    _run_scaling_case(scaler_cls, device, run, unskipped=2, skipped=0)


@on_devices
@pytest.mark.parametrize("enabled", [True, False])
def test_grad_scaling_multiple(scaler_cls, device, enabled):
    device = torch.device(device)
    # Tests gradient scaling with 2 models and 2 optimizers that both receive gradients from 2 losses.
    # Some of the logic here cannot reuse the generic helper functions created for the 1-optimizer cases.
    mod_control0, mod_scaling0, opt_control0, opt_scaling0, data, loss_fn, skip_iter = _create_scaling_case(device.type)
    mod_control1, mod_scaling1, opt_control1, opt_scaling1 = _create_scaling_models_optimizers(device.type)

    scaler = scaler_cls(device.type, init_scale=128.0, growth_factor=2.0, enabled=enabled, growth_interval=1)

    def run(model0, model1, optimizer0, optimizer1, try_scaling_api):
        for i, (input, target) in enumerate(data):
            optimizer0.zero_grad()
            optimizer1.zero_grad()
            output0 = model0(input)
            output1 = model1(input)
            loss0 = loss_fn(0.3 * output0 + 0.7 * output1, target)
            loss1 = loss_fn(0.6 * output0 - 0.4 * output1, target)

            if try_scaling_api:
                scaler.scale(loss0).backward(retain_graph=True)
                scaler.scale(loss1).backward()
                if i == skip_iter and scaler.is_enabled():
                    model1[1].weight.grad.data.fill_(float("inf"))

                # As an additional stress test, separately unscale for one of the optimizers.
                scaler.unscale_(optimizer0)

                scaler.step(optimizer0)
                scaler.step(optimizer1)
                scaler.update()
            else:
                loss0.backward(retain_graph=True)
                loss1.backward()
                optimizer0.step()
                if (not scaler.is_enabled()) or (i != skip_iter):
                    optimizer1.step()

    run(mod_control0, mod_control1, opt_control0, opt_control1, False)
    run(mod_scaling0, mod_scaling1, opt_scaling0, opt_scaling1, True)

    # The loss scale should have been multiplied by the growth factor 3 times and the backoff factor once.
    if enabled:
        assert scaler.get_scale() == 128.0 * scaler.get_growth_factor() ** 3 * scaler.get_backoff_factor() ** 1
    else:
        assert scaler.get_scale() == 1.0

    for c, s in zip(
        chain(mod_control0.parameters(), mod_control1.parameters()),
        chain(mod_scaling0.parameters(), mod_scaling1.parameters()),
    ):
        _assert_equal(c, s, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------------------------------------
# Fused optimizers (the _step_supports_amp_scaling protocol)
# ---------------------------------------------------------------------------------------------


@on_devices
@pytest.mark.parametrize("separate_unscale", [True, False], ids=["unscale_", "no_unscale_"])
@pytest.mark.parametrize("optimizer_ctor, optimizer_kwargs", _FUSED_OPTIM_INPUTS)
def test_grad_scaling_autocast_fused_optimizers(scaler_cls, device, optimizer_ctor, optimizer_kwargs, separate_unscale):
    optimizer_kwargs = dict(optimizer_kwargs, fused=True)
    (
        mod_control,
        mod_scaling,
        opt_control,
        opt_scaling,
        data,
        loss_fn,
        _,
    ) = _create_scaling_case(optimizer_ctor=optimizer_ctor, optimizer_kwargs=optimizer_kwargs, device=device)
    kwargs = copy.deepcopy(optimizer_kwargs)
    kwargs["fused"] = False
    if "lr" not in optimizer_kwargs:
        # _create_scaling_case will set lr = 1.0 if optimizer_kwargs do not set lr
        kwargs["lr"] = 1.0
    opt_control = optimizer_ctor(mod_control.parameters(), **kwargs)
    assert getattr(opt_scaling, "_step_supports_amp_scaling", False)

    scaler_scaling = scaler_cls(device, init_scale=128.0)
    scaler_control = scaler_cls(device, init_scale=128.0)
    # TensorTracker: compare, then copy the reference in so that error does not accumulate.
    tracker = []

    def pop_check_set(actual):
        ref = tracker.pop(0)
        torch.testing.assert_close(actual, ref)
        with torch.no_grad():
            actual.copy_(ref)

    for input, target in data:
        opt_control.zero_grad()
        with torch.autocast(device_type=device, dtype=AUTOCAST_DTYPE[device]):
            output_control = mod_control(input)
            loss_control = loss_fn(output_control, target)
        scaler_control.scale(loss_control).backward()
        scaler_control.step(opt_control)
        scaler_control.update()

        opt_scaling.zero_grad()
        with torch.autocast(device_type=device, dtype=AUTOCAST_DTYPE[device]):
            output_scaling = mod_scaling(input)
            loss_scaling = loss_fn(output_scaling, target)
        scaler_scaling.scale(loss_scaling).backward()
        if separate_unscale:
            scaler_scaling.unscale_(opt_scaling)
        scaler_scaling.step(opt_scaling)
        scaler_scaling.update()
        # the scaler registered grad_scale/found_inf on the optimizer only for the step
        assert not hasattr(opt_scaling, "grad_scale") and not hasattr(opt_scaling, "found_inf")

        tracker.append(loss_control.detach().clone())
        pop_check_set(loss_scaling)
        for param_control, param_scaling in zip(mod_control.parameters(), mod_scaling.parameters()):
            tracker.append(param_control.grad.detach().clone())
            pop_check_set(param_scaling.grad)
            tracker.append(param_control.detach().clone())
            pop_check_set(param_scaling)

            state_control, state_scaling = opt_control.state[param_control], opt_scaling.state[param_scaling]

            for k in state_control:
                actual = state_scaling[k]
                if k == "step":
                    actual = actual.squeeze()
                tracker.append(state_control[k].detach().clone())
                pop_check_set(actual)
    assert scaler_scaling.get_scale() == scaler_control.get_scale()


@on_devices
@pytest.mark.parametrize(
    "optimizer_ctor, optimizer_kwargs",
    [
        pytest.param(ctor, dict(kw, **impl), id=f"{ctor.__name__}-{name}-{impl_id}")
        for ctor, variants in (
            (torch.optim.SGD, {"plain": {}, "momentum": {"momentum": 0.9, "weight_decay": 0.1}}),
            (torch.optim.Adam, {"plain": {}, "amsgrad": {"amsgrad": True, "weight_decay": 0.1}}),
            (torch.optim.AdamW, {"plain": {}, "amsgrad": {"amsgrad": True}}),
        )
        for name, kw in variants.items()
        for impl_id, impl in (
            ("forloop", {"foreach": False, "fused": False}),
            ("foreach", {"foreach": True}),
            ("fused", {"fused": True}),
        )
    ],
)
def test_params_invalidated_with_grads_invalidated_between_unscale_and_step(
    scaler_cls, device, optimizer_ctor, optimizer_kwargs
):
    model, _, optimizer, _, data, loss_fn, _ = _create_scaling_case(
        optimizer_ctor=optimizer_ctor, optimizer_kwargs=optimizer_kwargs, device=device
    )
    scaler = scaler_cls(device, init_scale=128.0)

    for input, target in data:
        optimizer.zero_grad()
        with torch.autocast(device_type=device, dtype=AUTOCAST_DTYPE[device]):
            output = model(input)
            loss = loss_fn(output, target)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)

        # deliberately break grads
        for j, param in enumerate(model.parameters()):
            param.grad.copy_(torch.inf if j % 2 else torch.nan)

        scaler.step(optimizer)
        scaler.update()

    assert all((p.isnan().any() or p.isinf().any()) for p in model.parameters())


# ---------------------------------------------------------------------------------------------
# test_cuda.py scenarios of the step protocol, device-generic here
# ---------------------------------------------------------------------------------------------


@on_devices
def test_grad_scaler_pass_itself(scaler_cls, device):
    class _PlaceHolderOptimizer(torch.optim.Optimizer):
        def __init__(self, params, defaults=None):
            if defaults is None:
                defaults = {}
            super().__init__(params, defaults)
            self._step_supports_amp_scaling = True

    seen = {}

    class Optimizer1(_PlaceHolderOptimizer):
        def step(self, closure=None, *, grad_scaler=None):
            assert isinstance(grad_scaler, torch.amp.GradScaler)
            assert grad_scaler is scaler
            assert not hasattr(self, "grad_scale")
            assert not hasattr(self, "found_inf")
            seen["o1"] = True
            return "o1-ret"

    class Optimizer2(_PlaceHolderOptimizer):
        def step(self, closure=None):
            assert isinstance(self.grad_scale, torch.Tensor)
            assert isinstance(self.found_inf, torch.Tensor)
            seen["o2"] = (self.grad_scale.clone(), self.found_inf.clone())
            return "o2-ret"

    x = torch.randn(4, 4, device=device)
    m = torch.nn.Linear(4, 1).to(device)
    o1 = Optimizer1(m.parameters())
    o2 = Optimizer2(m.parameters())
    scaler = scaler_cls(device=device, init_scale=2.0)

    with torch.autocast(device_type=device, dtype=AUTOCAST_DTYPE[device]):
        y = m(x)
        loss = y.mean()
    scaler.scale(loss).backward()
    with pytest.warns(FutureWarning, match="GradScaler is going to stop passing itself") as rec:
        assert scaler.step(o1) == "o1-ret"
    # stacklevel=2: the warning points at the caller of scaler.step
    assert [w.filename for w in rec if issubclass(w.category, FutureWarning)] == [__file__]
    assert scaler.step(o2) == "o2-ret"
    scaler.update()
    assert seen["o1"] is True
    grad_scale, found_inf = seen["o2"]
    _assert_equal(grad_scale, 2.0)
    _assert_equal(found_inf, 0.0)
    assert not hasattr(o2, "grad_scale") and not hasattr(o2, "found_inf")
    # one clean iteration recorded (only o2 recorded inf checks)
    assert scaler._get_growth_tracker() == 1


@on_devices
@pytest.mark.parametrize(
    "foreach, fused", [(None, None), (True, None), (None, True)], ids=["default", "foreach", "fused"]
)
def test_grad_scaler_with_preset_grad_scale(scaler_cls, device, foreach, fused):
    weight = torch.ones((5, 5), device=device, requires_grad=True)
    weight.grad = torch.full_like(weight, fill_value=15)
    opt = torch.optim.SGD([weight], lr=0.1, foreach=foreach, fused=fused)
    scaler = scaler_cls(device=device, init_scale=5)

    # simulate scaling a loss
    scaler.scale(torch.ones(5, device=device))

    if fused:
        # A fused optimizer's preset grad_scale multiplies the scaler's: grads are divided by 5 * 3.
        opt.grad_scale = torch.tensor(3.0, device=device)
        scaler.step(opt)
        # the scaler removes the attribute after the step
        assert not hasattr(opt, "grad_scale")
        _assert_equal(weight, torch.full_like(weight, 1 - 0.1 * 15 / 15))
    else:
        scaler.step(opt)
        # the grads were unscaled in place (15 / 5 = 3) before the step
        _assert_equal(weight.grad, torch.full_like(weight, fill_value=3))
        _assert_equal(weight, torch.full_like(weight, 1 - 0.1 * 3))
    scaler.update()
    assert scaler.get_scale() == 5.0
    assert scaler._get_growth_tracker() == 1


@on_devices
def test_grad_scaler_fused_skips_on_inf(scaler_cls, device):
    # Fused optimizers get found_inf on the device and skip the update themselves.
    weight = torch.ones((3,), device=device, requires_grad=True)
    weight.grad = torch.tensor([4.0, float("inf"), 4.0], device=device)
    opt = torch.optim.Adam([weight], lr=0.1, fused=True)
    scaler = scaler_cls(device, init_scale=4.0)
    scaler.scale(torch.ones((), device=device))
    scaler.step(opt)
    scaler.update()
    _assert_equal(weight, torch.ones(3, device=device))
    assert scaler.get_scale() == 2.0
