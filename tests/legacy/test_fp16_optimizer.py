"""fp16kit.legacy.FP16_Optimizer, written from docs/apex-fp16-optimizer.md (apex's era-2 FP16_Optimizer).

The core check: FP16_Optimizer produces, bit for bit, what a hand-written pure-torch reference
of apex's algorithm produces -- an fp32 master per fp16/bf16 param, the same torch optimizer on
the masters (and on fp32 params directly), ``(loss.float() * scale).backward()``, master grads
``float(model_grad) * float32(1/scale)``, fp32 grads unscaled in place by the same factor, one
non-finite check, apex amp's dynamic scale rule, skipped steps on overflow and masters copied
back into the model after each step.

The model, data and reference are in tests/_helpers/fp16_optimizer.py; checkpoints are tested in
test_fp16_optimizer_state_dict.py, ``async_step`` and ``master_device`` in
test_fp16_optimizer_async.py.
"""

from __future__ import annotations

import copy
import logging
import pickle
import re
import warnings

import pytest
import torch
from torch import nn

from _helpers.fp16_optimizer import (
    INF,
    LOW,
    LOW_IDS,
    NAN,
    OPTIMIZERS,
    Reference,
    assert_matches,
    batch,
    bitwise,
    build,
    flat_masters,
    inject_inf_fp16,
    inject_nan_fp32,
    loss_fn,
    make_model,
    same_value,
    train_iter,
    two_groups,
)
from fp16kit.legacy import FP16_Optimizer

# ---------------------------------------------------------------- bit for bit: the main loop
SCALINGS = {
    "static": {"static_loss_scale": 128.0},
    "dynamic": {"dynamic": True, "dynamic_args": {"init_scale": 2.0**19, "scale_window": 2}},
    "dynamic_floor": {
        "dynamic": True,
        "dynamic_args": {"init_scale": 2.0**20, "scale_window": 2, "min_loss_scale": 2.0**18},
    },
    "dynamic_cap": {
        "dynamic": True,
        "dynamic_args": {"init_scale": 8.0, "scale_window": 1, "max_loss_scale": 32.0},
    },
    "dynamic_factor3": {
        "dynamic": True,
        "dynamic_args": {"init_scale": 2.0**20, "scale_factor": 3.0, "scale_window": 2},
    },
}


@pytest.mark.parametrize("scaling", list(SCALINGS))
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("dtype", LOW, ids=LOW_IDS)
def test_bitwise_against_reference(dtype, opt_name, scaling):
    cfg = SCALINGS[scaling]
    model, opt, ref = build(dtype, opt_name, **cfg)
    frozen0 = model.frozen.detach().clone()
    dynamic = cfg.get("dynamic", False)
    injections = {5: inject_inf_fp16, 9: inject_nan_fp32} if dynamic else {}
    scales = []
    for i in range(12):
        train_iter(model, opt, ref, i, dtype, injections.get(i))
        assert_matches(model, opt, ref, f"iter {i}")
        scales.append(opt.loss_scale)
    # the scenario exercised what it claims to
    if dynamic:
        assert ref.n_overflows >= 2  # at least the injected ones
        if dtype == torch.float16 and scaling in ("dynamic", "dynamic_floor", "dynamic_factor3"):
            assert ref.n_overflows > 2, "expected real fp16 overflows from the large init scale"
        if scaling in ("dynamic", "dynamic_cap", "dynamic_factor3"):
            assert ref.n_growths >= 1
        if scaling == "dynamic_floor" and dtype == torch.float16:
            assert min(scales) == 2.0**18  # reached the floor and stayed there
        if scaling == "dynamic_cap":
            assert max(scales) == 32.0
    else:
        assert set(scales) == {128.0}
    # the frozen param is never touched
    assert torch.equal(model.frozen, frozen0)
    assert model.frozen.grad is None


def test_params_actually_train():
    """Guard against a vacuous comparison: the weights move away from their initial values."""
    model, opt, ref = build(torch.float16, "sgd_momentum", static_loss_scale=128.0)
    w0 = model.l1.weight.detach().clone()
    g0 = model.gain.detach().clone()
    for i in range(3):
        train_iter(model, opt, ref, i, torch.float16)
    assert not torch.equal(model.l1.weight, w0)
    assert not torch.equal(model.gain, g0)


# ---------------------------------------------------------------- construction
@pytest.mark.parametrize("dtype", LOW, ids=LOW_IDS)
def test_groups_layout(dtype):
    model = make_model(dtype)
    inner = torch.optim.SGD(two_groups(model, 0.1, 0.1), lr=0.1)
    group0_list = inner.param_groups[0]["params"]
    opt = FP16_Optimizer(inner, verbose=False)
    assert opt.optimizer is inner
    assert [[id(p) for p in g] for g in opt.fp16_groups] == [
        [id(model.l1.weight), id(model.l1.bias), id(model.l2.weight)],
        [id(model.l2.bias)],
    ]
    assert [[id(p) for p in g] for g in opt.fp32_from_fp32_groups] == [[], [id(model.gain)]]
    assert all(p is not model.frozen for g in opt.fp16_groups for p in g)
    # masters replace the low-precision params in place in the very same list objects
    assert inner.param_groups[0]["params"] is group0_list
    g0, g1 = inner.param_groups
    for i in range(3):
        assert g0["params"][i] is opt.fp32_from_fp16_groups[0][i]
    assert g1["params"][0] is model.gain
    assert g1["params"][1] is opt.fp32_from_fp16_groups[1][0]
    assert g1["params"][2] is model.frozen  # frozen left untouched in its group
    for p, m in zip([p for g in opt.fp16_groups for p in g], flat_masters(opt)):
        assert m.dtype == torch.float32 and m.requires_grad and m.is_leaf
        assert torch.equal(m, p.detach().float())
        assert m.data_ptr() != p.data_ptr()


def test_existing_state_moves_to_masters_and_is_recast():
    model = make_model(torch.float16)
    params = [model.l1.weight, model.l1.bias]
    inner = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    model.l1.weight.grad = torch.ones_like(model.l1.weight)
    model.l1.bias.grad = torch.ones_like(model.l1.bias)
    inner.step()  # fp16 momentum buffers keyed by the fp16 params
    bufs = [inner.state[p]["momentum_buffer"].clone() for p in params]
    assert bufs[0].dtype == torch.float16
    opt = FP16_Optimizer(inner, verbose=False)
    for p, m, b in zip(params, flat_masters(opt), bufs):
        assert p not in opt.state
        mb = opt.state[m]["momentum_buffer"]
        assert mb.dtype == torch.float32
        assert torch.equal(mb, b.float())


def test_float64_param_raises_apex_text():
    model = nn.Linear(8, 8).double()
    with pytest.raises(TypeError) as e:
        FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), verbose=False)
    # apex's text, naming what fp16kit accepts on the CPU (apex named torch.cuda types only)
    assert str(e.value) == (
        "Wrapped parameters must be either float32, float16 or bfloat16 tensors (CPU or CUDA). "
        "Received torch.DoubleTensor"
    )


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_float64_cuda_param_raises_apex_text_verbatim():
    model = nn.Linear(8, 8).double().cuda()
    with pytest.raises(TypeError) as e:
        FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), verbose=False)
    assert str(e.value) == (
        "Wrapped parameters must be either torch.cuda.FloatTensor or torch.cuda.HalfTensor. "
        "Received torch.cuda.DoubleTensor"
    )


def test_frozen_float64_param_is_accepted():
    model = make_model(torch.float16)
    frozen64 = nn.Parameter(torch.zeros(3, dtype=torch.float64), requires_grad=False)
    FP16_Optimizer(torch.optim.SGD([model.l1.weight, frozen64], lr=0.1), verbose=False)


def test_unknown_dynamic_loss_args_raise_naming_accepted_keys():
    model = make_model(torch.float16)
    with pytest.raises(TypeError) as e:
        FP16_Optimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            dynamic_loss_scale=True,
            dynamic_loss_args={"init_scale": 4.0, "bogus_key": 1},
            verbose=False,
        )
    msg = str(e.value)
    assert "bogus_key" in msg
    for key in ("init_scale", "scale_factor", "scale_window", "min_loss_scale", "max_loss_scale"):
        assert key in msg


def test_dynamic_defaults():
    model = make_model(torch.float16)
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), dynamic_loss_scale=True, verbose=False)
    assert opt.dynamic_loss_scale is True
    assert opt.loss_scale == 2.0**16
    opt2 = FP16_Optimizer(
        torch.optim.SGD(make_model(torch.float16).parameters(), lr=0.1),
        dynamic_loss_scale=True,
        dynamic_loss_args={"init_scale": 2.0**30},
        verbose=False,
    )
    assert opt2.loss_scale == 2.0**24  # min(max_loss_scale, init_scale)
    opt3 = FP16_Optimizer(
        torch.optim.SGD(make_model(torch.float16).parameters(), lr=0.1),
        static_loss_scale=64.0,
        dynamic_loss_scale=True,
        verbose=False,
    )
    assert opt3.loss_scale == 2.0**16  # dynamic overrides static_loss_scale
    opt4 = FP16_Optimizer(torch.optim.SGD(make_model(torch.float16).parameters(), lr=0.1), verbose=False)
    assert opt4.dynamic_loss_scale is False and opt4.loss_scale == 1.0


def test_scale_factor_is_honoured():
    model, opt, ref = build(
        torch.float16,
        "sgd_momentum",
        dynamic=True,
        dynamic_args={"init_scale": 2.0**10, "scale_factor": 3.0, "scale_window": 2},
    )
    train_iter(model, opt, ref, 0, torch.float16, inject_inf_fp16)
    assert opt.overflow is True
    assert opt.loss_scale == 2.0**10 / 3.0
    train_iter(model, opt, ref, 1, torch.float16)
    train_iter(model, opt, ref, 2, torch.float16)
    assert opt.loss_scale == 2.0**10 / 3.0 * 3.0
    assert_matches(model, opt, ref)


def test_add_param_group_gets_masters():
    model = make_model(torch.float16)
    opt = FP16_Optimizer(torch.optim.SGD(model.l1.parameters(), lr=0.1), static_loss_scale=128.0, verbose=False)
    opt.add_param_group({"params": list(model.l2.parameters()), "lr": 0.1})
    assert len(opt.fp16_groups) == 2 and len(opt.fp32_from_fp16_groups[1]) == 2
    assert all(p.dtype == torch.float32 for p in opt.param_groups[1]["params"])
    with pytest.raises(TypeError, match="Received"):
        opt.add_param_group({"params": [torch.zeros(2, dtype=torch.float64, requires_grad=True)]})
    w = model.l2.weight.detach().clone()
    opt.zero_grad()
    x, y = batch(0, torch.float16)
    opt.backward(loss_fn(model, x, y))
    g = opt.fp32_from_fp16_groups[1][0].grad.clone()  # unscaled: / 128
    opt.step()
    assert torch.equal(model.l2.weight, (w.float() - 0.1 * g).half())


# ---------------------------------------------------------------- static scale: no overflow check
def test_static_scale_applies_non_finite_grads():
    model, opt, ref = build(torch.float16, "sgd_momentum", static_loss_scale=64.0)
    for i in range(2):
        train_iter(model, opt, ref, i, torch.float16)
    train_iter(model, opt, ref, 2, torch.float16, inject_inf_fp16)
    assert opt.overflow is False
    assert opt.loss_scale == 64.0
    # the step was taken: the inf reached the master and the fp16 weight
    assert not torch.isfinite(opt.fp32_from_fp16_groups[0][0]).all()
    assert not torch.isfinite(model.l1.weight).all()
    assert_matches(model, opt, ref)


# ---------------------------------------------------------------- overflow handling and messages
@pytest.mark.parametrize("dtype", LOW, ids=LOW_IDS)
@pytest.mark.parametrize("inject", [inject_inf_fp16, inject_nan_fp32], ids=["inf_fp16", "nan_fp32"])
def test_overflow_skips_step_and_logs(dtype, inject, caplog):
    model, opt, ref = build(dtype, "adam", dynamic=True)
    train_iter(model, opt, ref, 0, dtype)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    masters_before = [m.detach().clone() for m in flat_masters(opt)]
    state_before = {i: copy.deepcopy(dict(opt.state[p])) for i, p in enumerate(opt.param_groups[0]["params"])}
    x, y = batch(1, dtype)
    opt.zero_grad()
    opt.backward(loss_fn(model, x, y), update_master_grads=False)
    inject(model)
    opt.update_master_grads()
    assert opt.overflow is True
    assert opt.loss_scale == 2.0**15
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fp16kit"):
        assert opt.step() is None
    msgs = [r for r in caplog.records if r.name.startswith("fp16kit")]
    assert [r.getMessage() for r in msgs] == ["Gradient overflow.  Skipping step, reducing loss scale to 32768.0"]
    assert msgs[0].levelno == logging.WARNING
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
    for m, mb in zip(flat_masters(opt), masters_before):
        assert torch.equal(m, mb)
    for i, p in enumerate(opt.param_groups[0]["params"]):
        same_value(dict(opt.state[p]), state_before[i], f"state {i}")


def test_overflow_flag_clears_on_next_clean_update():
    model, opt, ref = build(torch.float16, "sgd_momentum", dynamic=True)
    assert opt.overflow is False
    train_iter(model, opt, ref, 0, torch.float16, inject_inf_fp16)
    assert opt.overflow is True
    train_iter(model, opt, ref, 1, torch.float16)
    assert opt.overflow is False
    assert_matches(model, opt, ref)


def test_ingestion_messages(caplog):
    model = make_model(torch.float16)
    with caplog.at_level(logging.INFO, logger="fp16kit"):
        FP16_Optimizer(torch.optim.SGD(two_groups(model, 0.1, 0.1), lr=0.1), verbose=True)
    msgs = [r.getMessage() for r in caplog.records if r.name.startswith("fp16kit")]
    assert all(r.levelno == logging.INFO for r in caplog.records if r.name.startswith("fp16kit"))
    expected = ["FP16_Optimizer processing param group 0:"]
    for p in (model.l1.weight, model.l1.bias, model.l2.weight):
        expected.append(f"FP16_Optimizer received {p.type()} with {p.size()}")
    expected.append("FP16_Optimizer processing param group 1:")
    for p in (model.gain, model.l2.bias):  # the frozen param is not reported
        expected.append(f"FP16_Optimizer received {p.type()} with {p.size()}")
    assert msgs == expected

    caplog.clear()
    model2 = make_model(torch.float16)
    with caplog.at_level(logging.DEBUG, logger="fp16kit"):
        FP16_Optimizer(torch.optim.SGD(two_groups(model2, 0.1, 0.1), lr=0.1), verbose=False)
    assert [r for r in caplog.records if r.name.startswith("fp16kit")] == []


# ---------------------------------------------------------------- several losses
@pytest.mark.parametrize("dtype", LOW, ids=LOW_IDS)
def test_deferred_multi_loss_pattern(dtype):
    model, opt, ref = build(
        dtype, "sgd_momentum", dynamic=True, dynamic_args={"init_scale": 2.0**21, "scale_window": 2}
    )
    for i in range(6):
        x1, y1 = batch(2 * i, dtype)
        x2, y2 = batch(2 * i + 1, dtype)
        opt.zero_grad()
        opt.backward(loss_fn(model, x1, y1), update_master_grads=False)
        opt.backward(loss_fn(model, x2, y2), update_master_grads=False)
        if i == 3:
            inject_inf_fp16(model)
        opt.update_master_grads()
        opt.step()

        ref.zero_grad()
        ref.backward(loss_fn(ref.model, x1, y1))
        ref.backward(loss_fn(ref.model, x2, y2))
        if i == 3:
            inject_inf_fp16(ref.model)
        ref.update_master_grads()  # once: one scale update per iteration
        ref.step()
        assert_matches(model, opt, ref, f"iter {i}")
    assert ref.n_overflows >= 1


def test_plain_backward_twice_quirk_for_fp32_params():
    S = 1024.0
    model, opt, ref = build(torch.float16, "sgd_momentum", static_loss_scale=S)
    probe = copy.deepcopy(model)
    x1, y1 = batch(0, torch.float16)
    x2, y2 = batch(1, torch.float16)
    g1 = torch.autograd.grad(loss_fn(probe, x1, y1), probe.gain)[0]
    g2 = torch.autograd.grad(loss_fn(probe, x2, y2), probe.gain)[0]

    opt.zero_grad()
    opt.backward(loss_fn(model, x1, y1))
    opt.backward(loss_fn(model, x2, y2))

    ref.zero_grad()
    ref.backward(loss_fn(ref.model, x1, y1))
    ref.update_master_grads()
    ref.backward(loss_fn(ref.model, x2, y2))
    ref.update_master_grads()

    # apex parity: the fp32 param's grad is g1/S + g2, not g1 + g2 ...
    bitwise(model.gain.grad, ref.model.gain.grad, "gain.grad")
    torch.testing.assert_close(model.gain.grad, g1 / S + g2, rtol=1e-2, atol=1e-4)
    assert not torch.allclose(model.gain.grad, g1 + g2, rtol=1e-2, atol=1e-4)
    # ... while the fp16 params' masters get the correct sum
    for m, rm in zip(flat_masters(opt), ref.masters):
        bitwise(m.grad, rm.grad, "master grad")
    wg1 = torch.autograd.grad(loss_fn(probe, x1, y1), probe.l1.weight)[0].float()
    wg2 = torch.autograd.grad(loss_fn(probe, x2, y2), probe.l1.weight)[0].float()
    torch.testing.assert_close(opt.fp32_from_fp16_groups[0][0].grad, wg1 + wg2, rtol=2e-2, atol=2e-3)

    opt.step()
    ref.step()
    assert_matches(model, opt, ref)


# ---------------------------------------------------------------- LBFGS and closures
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("dtype", LOW, ids=LOW_IDS)
def test_lbfgs_closure_matches_reference(dtype, dynamic):
    model = make_model(dtype)
    ref_model = copy.deepcopy(model)
    kw = {"lr": 0.5, "max_iter": 4, "history_size": 3}
    scale_kw = (
        {"dynamic_loss_scale": True, "dynamic_loss_args": {"init_scale": 2.0**22, "scale_window": 3}}
        if dynamic
        else {"static_loss_scale": 32.0}
    )
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = FP16_Optimizer(torch.optim.LBFGS(trainable, **kw), verbose=False, **scale_kw)
    ref = Reference(
        ref_model,
        [{"params": [p for p in ref_model.parameters() if p.requires_grad]}],
        torch.optim.LBFGS,
        kw,
        static_loss_scale=32.0,
        dynamic=dynamic,
        dynamic_args={"init_scale": 2.0**22, "scale_window": 3},
    )
    pairs = list(zip([p for g in opt.fp16_groups for p in g], flat_masters(opt)))
    calls = [0]

    for step in range(3):
        x, y = batch(step, dtype)

        def closure():
            calls[0] += 1
            # the model sees the masters' values at every (re-)evaluation
            for p, m in pairs:
                assert torch.equal(p.detach(), m.detach().to(dtype))
            opt.zero_grad()
            loss = loss_fn(model, x, y)
            opt.backward(loss)
            return loss

        first = [True]

        def ref_body():
            ref.zero_grad()
            loss = loss_fn(ref.model, x, y)
            ref.backward(loss)
            ref.update_master_grads()
            return loss

        def ref_closure():
            if not first[0]:
                ref.copy_back()
            first[0] = False
            loss = ref_body()
            while ref.overflow:
                loss = ref_body()
            return loss

        ret = opt.step(closure)
        rret = ref.step(ref_closure)
        assert isinstance(ret, torch.Tensor)
        bitwise(ret.detach(), rret.detach(), f"step {step} return")
        assert opt.first_closure_call_this_step is True
        assert_matches(model, opt, ref, f"step {step}")
    assert calls[0] > 3  # LBFGS re-evaluated within steps
    if dynamic and dtype == torch.float16:
        assert ref.n_overflows >= 1  # retries inside the closure happened


def test_closure_nan_loss_raises_after_bounded_retries(caplog):
    model = make_model(torch.float16)
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), dynamic_loss_scale=True, verbose=False)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x, y = batch(0, torch.float16)
    calls = [0]

    def closure():
        calls[0] += 1
        opt.zero_grad()
        loss = loss_fn(model, x, y) * NAN
        opt.backward(loss)
        return loss

    with caplog.at_level(logging.WARNING, logger="fp16kit"):
        with pytest.raises(FloatingPointError, match="not finite"):
            opt.step(closure)
    assert 1 < calls[0] < 1000
    retry_msgs = [
        r.getMessage()
        for r in caplog.records
        if r.getMessage().startswith("OVERFLOW within closure! Skipping step, reducing loss scale to ")
    ]
    assert len(retry_msgs) >= 1
    assert retry_msgs[0] == "OVERFLOW within closure! Skipping step, reducing loss scale to 32768.0"
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n


# ---------------------------------------------------------------- clipping, inspection, zero_grad
@pytest.mark.parametrize("norm_type", [2.0, INF], ids=["l2", "linf"])
@pytest.mark.parametrize("dtype", LOW, ids=LOW_IDS)
def test_clip_master_grads(dtype, norm_type):
    model, opt, ref = build(dtype, "sgd_momentum", dynamic=True, dynamic_args={"init_scale": 2.0**10})
    for i in range(4):
        x, y = batch(i, dtype)
        inject = inject_inf_fp16 if i == 2 else None
        opt.zero_grad()
        opt.backward(loss_fn(model, x, y), update_master_grads=False)
        if inject:
            inject(model)
        opt.update_master_grads()
        norm = opt.clip_master_grads(0.05, norm_type)

        ref.zero_grad()
        ref.backward(loss_fn(ref.model, x, y))
        if inject:
            inject(ref.model)
        ref.update_master_grads()
        if ref.overflow:
            assert norm == -1 and type(norm) is int
        else:
            params = [p for g in ref.opt.param_groups for p in g["params"]]
            rnorm = torch.nn.utils.clip_grad_norm_(params, 0.05, norm_type)
            assert isinstance(norm, torch.Tensor)
            bitwise(norm, rnorm, f"iter {i} norm")
            assert float(norm) > 0.05  # clipping really happened
            for p, rp in zip([p for g in opt.param_groups for p in g["params"]], params):
                if rp.grad is None:
                    assert p.grad is None
                else:
                    bitwise(p.grad, rp.grad, f"iter {i} clipped grad")
        opt.step()
        ref.step()
        assert_matches(model, opt, ref, f"iter {i}")
    assert ref.n_overflows == 1


def test_inspect_master_grad_data(caplog):
    model, opt, ref = build(torch.float16, "adam", dynamic=True)
    x, y = batch(0, torch.float16)
    opt.zero_grad(set_grads_to_None=True)
    opt.backward(loss_fn(model, x, y))
    ref.backward(loss_fn(ref.model, x, y))
    ref.update_master_grads()
    data = opt.inspect_master_grad_data()
    assert isinstance(data, list) and len(data) == 2
    assert [len(g) for g in data] == [3, 3]
    for g, rg in zip(data, ref.opt.param_groups):
        for d, rp in zip(g, rg["params"]):
            if rp.grad is None:
                assert d is None  # the frozen param
            else:
                bitwise(d, rp.grad)
    assert data[1][2] is None
    assert data[1][0] is not None and data[1][0].dtype == torch.float32  # fp32 param

    opt.zero_grad()
    opt.backward(loss_fn(model, x, y), update_master_grads=False)
    inject_inf_fp16(model)
    opt.update_master_grads()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fp16kit"):
        assert opt.inspect_master_grad_data() is None
    assert [r.getMessage() for r in caplog.records if r.name.startswith("fp16kit")] == [
        "Warning:  calling FP16_Optimizer.inspect_master_grad_data while in an overflow state.  "
        "Gradients are currently invalid (may be inf, nan, or stale).  Returning None."
    ]


@pytest.mark.parametrize("to_none", [False, True])
def test_zero_grad(to_none):
    model, opt, _ = build(torch.float16, "sgd_momentum", static_loss_scale=8.0)
    x, y = batch(0, torch.float16)
    opt.backward(loss_fn(model, x, y))
    everything = [*model.parameters(), *flat_masters(opt)]
    assert all(p.grad is not None for p in everything if p.requires_grad)
    opt.zero_grad(set_grads_to_None=to_none)
    for p in everything:
        if not p.requires_grad:
            assert p.grad is None
        elif to_none:
            assert p.grad is None
        else:
            assert p.grad is not None and not p.grad.any()
    assert model.frozen.grad is None


# ---------------------------------------------------------------- proxies and torch.optim integration
def test_proxies():
    model, opt, ref = build(torch.float16, "sgd_momentum", dynamic=True, dynamic_args={"scale_window": 3})
    assert opt.param_groups is opt.optimizer.param_groups
    assert opt.state is opt.optimizer.state
    assert opt.overflow is False
    assert opt.dynamic_loss_scale is True
    train_iter(model, opt, ref, 0, torch.float16)
    m0 = opt.fp32_from_fp16_groups[0][0]
    assert "momentum_buffer" in opt.state[m0]
    assert opt.state[m0]["momentum_buffer"].dtype == torch.float32
    # lr through param_groups reaches the inner optimizer and the step
    opt.param_groups[0]["lr"] = 0.01
    assert opt.optimizer.param_groups[0]["lr"] == 0.01
    ref.opt.param_groups[0]["lr"] = 0.01
    # the loss scale setter writes the current scale, and the dynamic rule continues from it
    opt.loss_scale = 256.0
    ref.scale = 256.0
    assert opt.loss_scale == 256.0
    for i in range(1, 5):
        train_iter(model, opt, ref, i, torch.float16)
        assert_matches(model, opt, ref, f"iter {i}")
    assert opt.loss_scale == 512.0  # one growth after the 3-step window


def test_loss_scale_setter_static():
    model, opt, ref = build(torch.float16, "adam", static_loss_scale=4.0)
    train_iter(model, opt, ref, 0, torch.float16)
    opt.loss_scale = 1024.0
    ref.scale = 1024.0
    for i in range(1, 3):
        train_iter(model, opt, ref, i, torch.float16)
        assert_matches(model, opt, ref, f"iter {i}")
    assert opt.loss_scale == 1024.0


def test_lr_scheduler():
    model, opt, ref = build(
        torch.float16, "adam", dynamic=True, dynamic_args={"init_scale": 2.0**21, "scale_window": 2}
    )
    assert isinstance(opt, torch.optim.Optimizer)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    rsched = torch.optim.lr_scheduler.StepLR(ref.opt, step_size=2, gamma=0.5)
    lrs = []
    for i in range(6):
        train_iter(model, opt, ref, i, torch.float16)
        sched.step()
        with warnings.catch_warnings():
            # the reference skips its inner step on overflow; torch notices and warns
            warnings.simplefilter("ignore")
            rsched.step()
        lrs.append([g["lr"] for g in opt.param_groups])
        assert_matches(model, opt, ref, f"iter {i}")
    assert lrs[-1] == [1e-2 * 0.125, 3e-3 * 0.125]
    assert [g["lr"] for g in opt.optimizer.param_groups] == lrs[-1]


def test_pickle_and_deepcopy_refused():
    model, opt, _ = build(torch.float16, "sgd_momentum")
    with pytest.raises(RuntimeError, match=re.escape("FP16_Optimizer should be serialized using state_dict().")):
        pickle.dumps(opt)
    with pytest.raises(RuntimeError, match=re.escape("FP16_Optimizer should be serialized using state_dict().")):
        copy.deepcopy(opt)
    with pytest.raises(RuntimeError, match=re.escape("FP16_Optimizer should be deserialized using load_state_dict().")):
        opt.__setstate__({})


def test_clip_grad_norm_is_a_method_a_subclass_can_override():
    # apex stored the function on the instance, which hid an override in a subclass
    calls = []

    class Recording(FP16_Optimizer):
        def clip_grad_norm(self, parameters, max_norm, norm_type=2):
            calls.append((max_norm, norm_type))
            return super().clip_grad_norm(parameters, max_norm, norm_type)

    model = nn.Linear(3, 2).half()
    opt = Recording(torch.optim.SGD(model.parameters(), lr=0.1), static_loss_scale=4.0, verbose=False)
    opt.backward(model(torch.ones(2, 3, dtype=torch.float16)).float().sum())
    total = opt.clip_master_grads(0.5)
    grads = [p.grad for p in opt.optimizer.param_groups[0]["params"]]
    assert calls == [(0.5, 2)] and float(total) > 0.5
    assert abs(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))) - 0.5) < 1e-3
    assert "clip_grad_norm" not in vars(opt)


@pytest.mark.parametrize("async_step", [False, True], ids=["sync", "async"])
def test_the_step_lives_in_one_step_state_and_apex_flags_read_it(async_step):
    """apex's overflow / first_closure_call_this_step are properties over the one step state;
    no loose per-step flag is left on the object."""
    from fp16kit.master_weights.step_state import Stage

    model = make_model(torch.float16, 0)
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), dynamic_loss_scale=True, async_step=async_step)
    assert {
        "_overflow",
        "_prepared",
        "_master_grads_reset",
        "_grads_since_step",
        "first_closure_call_this_step",
    }.isdisjoint(vars(opt))
    x, y = batch(0, torch.float16)
    opt.zero_grad()
    opt.backward((model(x) - y).pow(2).mean() * float("inf"))
    assert opt._step.stage is (Stage.CHECKED if async_step else Stage.UNSCALED)
    assert opt.overflow is True
    opt.step()
    assert opt._step.stage is Stage.STEPPED and opt.overflow is True  # apex's overflow outlives the step
    opt.zero_grad()
    assert opt.overflow is True
    opt.overflow = False
    opt.first_closure_call_this_step = False
    sd = opt.state_dict()
    assert sd["overflow"] is False and sd["first_closure_call_this_step"] is False
    opt.first_closure_call_this_step = True
    opt.load_state_dict(sd)
    assert opt.first_closure_call_this_step is False and opt.overflow is False
    opt.synchronize()
