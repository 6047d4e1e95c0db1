"""PyTorch's own GradScaler test scenarios, ported to pytest: test/test_cuda.py's CUDA-only ones,
``test_grad_scaling_scale`` (nested iterables, multi-device placement), ``test_graph_grad_scaling``
and ``test_graph_scaling_fused_optimizers`` (CUDA graphs). All are skipped without CUDA.

Each test runs for torch's class and for fp16kit's: see tests/_helpers/torch_scaling.py.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from _helpers.torch_scaling import (
    _FUSED_OPTIM_INPUTS,
    SCALER_CLASSES,
    _assert_equal,
    _seed,  # noqa: F401 -- the autouse fixture: torch.manual_seed(0) before each test
)

pytestmark = pytest.mark.parametrize("scaler_cls", SCALER_CLASSES)


# ---------------------------------------------------------------------------------------------
# Multi-device placement (CUDA only)
# ---------------------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_grad_scaling_scale_cuda(scaler_cls):
    scaler = scaler_cls("cuda", init_scale=2.0)
    t0 = torch.full((1,), 4.0, dtype=torch.float32, device="cuda:0")
    cpu = torch.full((1,), 4.0, dtype=torch.float32, device="cpu")
    outputs = [t0.clone(), (cpu.clone(), t0.clone())]
    outputs = scaler.scale(outputs)
    assert outputs[0].item() == 8.0 and outputs[1][0].item() == 8.0 and outputs[1][1].item() == 8.0
    assert outputs[1][0].device.type == "cpu"
    assert scaler._scale.device == t0.device


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_grad_scaling_scale_multigpu(scaler_cls):
    scaler = scaler_cls("cuda", init_scale=2.0)
    t0 = torch.full((1,), 4.0, dtype=torch.float32, device="cuda:0")
    t1 = torch.full((1,), 4.0, dtype=torch.float32, device="cuda:1")
    # Create some nested iterables of tensors on different devices.
    outputs = (t1.clone(), (t0.clone(), t1.clone()), [t0.clone(), (t1.clone(), t0.clone())])
    outputs = scaler.scale(outputs)
    assert (
        outputs[0] == 8.0
        and outputs[1][0] == 8.0
        and outputs[1][1] == 8.0
        and outputs[2][0] == 8.0
        and outputs[2][1][0] == 8.0
        and outputs[2][1][1] == 8.0
    )
    assert scaler._scale.device == t1.device


# ---------------------------------------------------------------------------------------------
# CUDA graphs (test_cuda.py; CUDA only)
# ---------------------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "foreach, fused",
    [(False, False), (True, False), (False, True)],
    ids=["forloop", "foreach", "fused"],
)
def test_graph_grad_scaling(scaler_cls, foreach, fused):
    # torch's test_graph_grad_scaling / _test_graph_grad_scaling: scale() and backward() are
    # captured; the scale tensor is read on replay, so the eager step()/update() between
    # replays must change the scale the graph multiplies by.
    torch.cuda.empty_cache()

    scaler = scaler_cls(device="cuda", init_scale=4.0)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()

    weight = torch.ones((100,), device="cuda", requires_grad=True)
    opt = torch.optim.SGD([weight], lr=0.1, foreach=foreach, fused=fused)
    static_input = torch.ones_like(weight)

    # warmup
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        loss = (weight.half() * static_input).sum()
        scaler.scale(loss).backward()
    torch.cuda.current_stream().wait_stream(s)

    opt.zero_grad(set_to_none=True)

    # capture
    with torch.cuda.stream(s):
        g.capture_begin()
        loss = (weight.half() * static_input).sum()
        scaler.scale(loss).backward()
        g.capture_end()

    input_vals = [5, 20000, 5, 40000]
    # If the scale gets updated properly, these are the scale, growth tracker,
    # and grad values we expect.
    expected_scales = [4, 2, 2, 1]
    expected_growth_trackers = [1, 0, 1, 0]
    expected_grad_vals = [5 * 4, float("inf"), 5 * 2, float("inf")]

    for data, scale, growth_tracker, grad_val in zip(
        input_vals, expected_scales, expected_growth_trackers, expected_grad_vals
    ):
        static_input.fill_(data)
        g.replay()
        _assert_equal(weight.grad, torch.full_like(weight.grad, grad_val))
        scaler.step(opt)
        scaler.update()
        _assert_equal(scaler._scale, scale)
        _assert_equal(scaler._growth_tracker, growth_tracker)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("optimizer_ctor, optimizer_kwargs", _FUSED_OPTIM_INPUTS)
def test_graph_scaling_fused_optimizers(scaler_cls, optimizer_ctor, optimizer_kwargs):
    # torch's test_graph_scaling_fused_optimizers (there over optim_db's fused optimizers and
    # their optim_inputs; here over the fused inputs used above): scaler.step() + update()
    # captured in a graph with a fused optimizer (capturable=True where it has the argument)
    # and replayed must match an eager control run with capturable=False.
    device = "cuda"
    steps_warmup = 3
    steps_train = 2

    kwargs = dict(optimizer_kwargs, fused=True)
    has_capturable_arg = "capturable" in inspect.signature(optimizer_ctor.__init__).parameters

    for actually_do_graphs in (True, False) if has_capturable_arg else (True,):
        params = [torch.randn((i + 5, i + 5), device=device) for i in range(2)]
        params_control = [p.clone().requires_grad_() for p in params]
        params_graphed = [p.clone().requires_grad_() for p in params]

        # `GradScaler` in-place updates gradients thus it's necessary to duplicate gradients.
        grads = [[torch.randn_like(p) for p in params] for _ in range(steps_warmup + steps_train)]
        with torch.no_grad():
            grads_control = [[g.clone() for g in gs] for gs in grads]
            grads_graphed = [[g.clone() for g in gs] for gs in grads]

        # Gradient Scaler
        scaler_for_control = scaler_cls(device=device, init_scale=128.0)
        with torch.no_grad():
            scaler_for_control._lazy_init_scale_growth_tracker(device)

        scaler_for_graphed = scaler_cls(device=device)
        scaler_for_graphed.load_state_dict(scaler_for_control.state_dict())
        with torch.no_grad():
            scaler_for_graphed._lazy_init_scale_growth_tracker(device)

        # Control (capturable=False)
        if has_capturable_arg:
            kwargs["capturable"] = False
        opt = optimizer_ctor(params_control, **kwargs)

        for i in range(steps_warmup + steps_train):
            for j, p in enumerate(params_control):
                p.grad = grads_control[i][j]
            scaler_for_control.step(opt)
            scaler_for_control.update()

        # capturable=True
        if has_capturable_arg:
            kwargs["capturable"] = True
        opt = optimizer_ctor(params_graphed, **kwargs)

        for i in range(steps_warmup):
            for j, p in enumerate(params_graphed):
                p.grad = grads_graphed[i][j]
            scaler_for_graphed.step(opt)
            scaler_for_graphed.update()

        if actually_do_graphs:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                scaler_for_graphed.step(opt)
                scaler_for_graphed.update()

        for i in range(steps_train):
            if actually_do_graphs:
                for j, p in enumerate(params_graphed):
                    p.grad.copy_(grads_graphed[i + steps_warmup][j])
                g.replay()
            else:
                # Passing capturable=True to the constructor and running without graphs should
                # still be numerically correct, even if it's not ideal for performance.
                for j, p in enumerate(params_graphed):
                    p.grad = grads_graphed[i + steps_warmup][j]
                scaler_for_graphed.step(opt)
                scaler_for_graphed.update()

        for p_control, p_graphed in zip(params_control, params_graphed):
            torch.testing.assert_close(p_control, p_graphed)
        assert scaler_for_graphed.get_scale() == scaler_for_control.get_scale()
