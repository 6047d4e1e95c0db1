"""Megatron-LM v1's FP16_Optimizer driven by Megatron's training sequence (docs/apex-others.md
§2.2), bit for bit against a hand-written fp32-master reference of Megatron's code: zero_grad;
backward(loss, update_master_grads=False); update_master_grads(); clip_master_grads(c); step();
the LR scheduler skipped when optimizer.overflow."""

from __future__ import annotations

import copy
import logging
import math

import pytest
import torch
from torch import nn

from _helpers.megatron_reference import MegatronScaler
from fp16kit.legacy.megatron import FP16_Module, FP16_Optimizer, LossScaler

INF = float("inf")
LR = 0.05


class StaticScaler:
    def __init__(self, scale):
        self.cur_scale = scale

    def update_scale(self, overflow):
        pass


def ref_clip(params, max_norm):
    """mpu.clip_grad_norm (L2) in one model-parallel rank, as Megatron wrote it."""
    params = [p for p in params if p.grad is not None]
    total = 0.0
    for p in params:
        total += p.grad.data.norm(2).item() ** 2
    total = torch.FloatTensor([float(total)])[0].item() ** 0.5
    coef = max_norm / (total + 1e-6)
    if coef < 1:
        for p in params:
            p.grad.data.mul_(coef)
    return total


class Reference:
    """Megatron's FP16_Optimizer by hand: fp32 masters of the low-precision params, fp32 params
    stepped in place, the same torch optimizer and scheduler."""

    def __init__(self, model, extra, scaler, dynamic):
        self.model, self.extra, self.scaler, self.dynamic = model, extra, scaler, dynamic
        self.low = [p for p in model.parameters()]
        self.masters = [p.detach().clone().float().requires_grad_() for p in self.low]
        self.opt = torch.optim.SGD([{"params": self.masters + [extra]}], lr=LR, momentum=0.9)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, 1, gamma=0.9)
        self.overflow = False

    def iteration(self, loss_fn, clip):
        for p in self.low + self.masters + [self.extra]:
            p.grad = None if p.grad is None else torch.zeros_like(p.grad)
        loss = loss_fn(self.model, self.extra)
        (loss.float() * self.scaler.cur_scale).backward()
        grads = [p.grad for p in self.low + [self.extra] if p.grad is not None]
        self.overflow = self.dynamic and any(not torch.isfinite(g).all() for g in grads)
        clipped = -1
        if not self.overflow:
            for p, m in zip(self.low, self.masters):
                m.grad = None if p.grad is None else p.grad.detach().float()
            for p in self.masters + [self.extra]:
                if p.grad is not None:
                    p.grad.mul_(1.0 / self.scaler.cur_scale)
            if clip > 0:
                clipped = ref_clip(self.masters + [self.extra], clip)
        self.scaler.update_scale(self.overflow)
        if not self.overflow:
            self.opt.step()
            with torch.no_grad():
                for p, m in zip(self.low, self.masters):
                    p.copy_(m)
            self.sched.step()
        return clipped


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 3)
        self.unused = nn.Linear(2, 2)  # never in the forward: its grads stay None

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def build(dtype, dynamic_args, static=None, device="cpu"):
    torch.manual_seed(0)
    net = Net().to(device)
    model = FP16_Module(net) if dtype == torch.float16 else net.to(dtype)
    extra = nn.Parameter(torch.linspace(0.5, 1.5, 3, device=device))  # an fp32 param beside the fp16 model
    ref_model, ref_extra = copy.deepcopy(model), nn.Parameter(extra.detach().clone())
    inner = torch.optim.SGD([{"params": list(model.parameters()) + [extra]}], lr=LR, momentum=0.9)
    if static is None:
        opt = FP16_Optimizer(inner, static_loss_scale=None, dynamic_loss_scale=True, dynamic_loss_args=dynamic_args)
        ref = Reference(ref_model, ref_extra, MegatronScaler(**dynamic_args), True)
    else:
        opt = FP16_Optimizer(inner, static_loss_scale=static)
        ref = Reference(ref_model, ref_extra, StaticScaler(static), False)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.9)
    return model, extra, opt, sched, ref


def loss_fn_for(i, dtype, device="cpu"):
    g = torch.Generator().manual_seed(1000 + i)
    x = torch.randn(5, 6, generator=g).to(device)
    y = torch.randn(5, 3, generator=g).to(device)
    if i in (6, 11, 12):
        x[0, 0] = INF  # a bad batch: non-finite grads at any scale

    def loss_fn(model, extra):
        out = model(x) if isinstance(model, FP16_Module) else model(x.to(dtype)).float()
        return ((out * extra - y) ** 2).mean()

    return loss_fn


def megatron_iteration(model, extra, opt, sched, loss_fn, clip):
    opt.zero_grad()
    opt.backward(loss_fn(model, extra), update_master_grads=False)
    opt.update_master_grads()
    clipped = opt.clip_master_grads(clip) if clip > 0 else -1
    opt.step()
    if not opt.overflow:
        sched.step()
    return clipped


def assert_same(model, extra, opt, ref):
    for p, q in zip(model.parameters(), ref.model.parameters()):
        assert torch.equal(p, q)
    for m, r in zip(opt.fp32_from_fp16_groups[0], ref.masters):
        assert torch.equal(m, r)
    assert torch.equal(extra, ref.extra)
    assert opt.loss_scale == ref.scaler.cur_scale and type(opt.loss_scale) is type(ref.scaler.cur_scale)
    assert opt.param_groups[0]["lr"] == ref.opt.param_groups[0]["lr"]


def run_both(model, extra, opt, sched, ref, dtype, iters, clip, start=0, device="cpu"):
    overflows = []
    for i in range(start, start + iters):
        loss_fn = loss_fn_for(i, dtype, device)
        ours = megatron_iteration(model, extra, opt, sched, loss_fn, clip)
        theirs = ref.iteration(loss_fn, clip)
        assert opt.overflow == ref.overflow, i
        assert ours == theirs and type(ours) is type(theirs), i
        assert_same(model, extra, opt, ref)
        overflows.append(opt.overflow)
    return overflows


CASES = [
    {"scale_window": 3.0, "min_scale": 1.0, "delayed_shift": 2, "init_scale": 2**18},  # Megatron's arguments (but init)
    {"scale_window": 4, "min_scale": 2, "delayed_shift": 3, "consecutive_hysteresis": True, "init_scale": 2**20},
    {"scale_window": 2, "init_scale": 2**24},
]


FP16, BF16 = torch.float16, torch.bfloat16


@pytest.mark.parametrize(
    "dtype, args, clip",
    [
        (FP16, CASES[0], 0.5),
        (FP16, CASES[1], 0.5),
        (FP16, CASES[2], 0.0),
        (FP16, CASES[0], 0.0),
        (BF16, CASES[0], 0.5),
        (BF16, CASES[1], 0.0),
    ],
    ids=["megatron-clip", "consecutive-clip", "plain", "megatron", "bf16-megatron-clip", "bf16-consecutive"],
)
def test_megatron_training_sequence_matches_the_reference(dtype, args, clip):
    model, extra, opt, sched, ref = build(dtype, args)
    overflows = run_both(model, extra, opt, sched, ref, dtype, 14, clip)
    assert any(overflows) and not all(overflows)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [FP16, BF16], ids=["fp16", "bf16"])
def test_megatron_training_sequence_on_cuda(dtype):
    model, extra, opt, sched, ref = build(dtype, CASES[0], device="cuda")
    overflows = run_both(model, extra, opt, sched, ref, dtype, 14, 0.5, device="cuda")
    assert any(overflows) and not all(overflows)
    assert opt.fp32_from_fp16_groups[0][0].is_cuda


def test_static_scale_never_checks():
    model, extra, opt, sched, ref = build(torch.float16, None, static=128.0)
    run_both(model, extra, opt, sched, ref, torch.float16, 6, 0.5)
    assert isinstance(opt.loss_scaler, LossScaler) and opt.loss_scale == 128.0
    # a non-finite batch is applied, as Megatron did with a static scale
    megatron_iteration(model, extra, opt, sched, loss_fn_for(6, torch.float16), 0.0)
    assert opt.overflow is False and not torch.isfinite(opt.fp32_from_fp16_groups[0][0]).all()


def test_backward_with_update_master_grads_true_is_the_same():
    model, extra, opt, sched, ref = build(torch.float16, CASES[0])
    for i in range(8):
        loss_fn = loss_fn_for(i, torch.float16)
        opt.zero_grad()
        opt.backward(loss_fn(model, extra))
        opt.step()
        if not opt.overflow:
            sched.step()
        ref.iteration(loss_fn, 0.0)
        assert_same(model, extra, opt, ref)


def test_masters_copy_model_parallel_attributes():
    a, b = nn.Linear(3, 3).half(), nn.Linear(3, 2).half()
    a.weight.model_parallel, a.weight.partition_dim, a.weight.partition_stride = True, 0, 1
    a.bias.tensor_model_parallel = False
    opt = FP16_Optimizer(torch.optim.SGD(a.parameters(), lr=0.1))
    w, bias = opt.fp32_from_fp16_groups[0]
    assert (w.model_parallel, w.partition_dim, w.partition_stride) == (True, 0, 1)
    assert bias.tensor_model_parallel is False and not hasattr(bias, "model_parallel")
    b.weight.model_parallel = False
    opt.add_param_group({"params": [b.weight]})
    assert opt.fp32_from_fp16_groups[1][0].model_parallel is False


def test_overflow_lines(caplog):
    model, extra, opt, sched, _ = build(torch.float16, {"init_scale": 2**32, "delayed_shift": 2})
    with caplog.at_level(logging.DEBUG, logger="fp16kit.apex"):
        megatron_iteration(model, extra, opt, sched, loss_fn_for(0, torch.float16), 0.0)
    [record] = [r for r in caplog.records if "OVERFLOW" in r.getMessage()]
    # printed even though the hysteresis kept the scale; at DEBUG as verbose=False
    assert record.getMessage() == "OVERFLOW! Skipping step. Attempted loss scale: 4294967296, reducing to 4294967296"
    assert record.levelno == logging.DEBUG
    opt.verbose = True
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="fp16kit.apex"):
        megatron_iteration(model, extra, opt, sched, loss_fn_for(1, torch.float16), 0.0)
    [record] = [r for r in caplog.records if "OVERFLOW" in r.getMessage()]
    assert record.levelno == logging.WARNING and record.getMessage().endswith("reducing to 2147483648.0")


def test_closure_retries_at_lower_scales(caplog):
    torch.manual_seed(0)
    model = FP16_Module(nn.Linear(4, 2))
    opt = FP16_Optimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        static_loss_scale=None,
        dynamic_loss_scale=True,
        dynamic_loss_args={"init_scale": 2.0**40},
        verbose=True,
    )
    x = torch.randn(3, 4)

    def closure():
        opt.zero_grad()
        loss = model(x).pow(2).sum()
        opt.backward(loss)
        return loss

    before = [m.clone() for m in opt.fp32_from_fp16_groups[0]]
    with caplog.at_level(logging.WARNING, logger="fp16kit"):
        opt.step(closure)
    retries = [r.getMessage() for r in caplog.records if "within closure" in r.getMessage()]
    assert retries and retries[0].startswith("OVERFLOW within closure! Skipping step. Attempted loss scale: ")
    assert opt.loss_scale < 2.0**40 and not opt.overflow
    assert any(not torch.equal(m, b) for m, b in zip(opt.fp32_from_fp16_groups[0], before))
    for p, m in zip(model.parameters(), opt.fp32_from_fp16_groups[0]):
        assert torch.equal(p, m.half())


def test_bad_arguments_raise_before_the_optimizer_changes():
    model = nn.Linear(3, 3).half()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"unknown keys \['min_loss_scale'\].*delayed_shift"):
        FP16_Optimizer(inner, dynamic_loss_scale=True, dynamic_loss_args={"min_loss_scale": 1.0})
    with pytest.raises(ValueError, match="delayed_shift must be an int >= 1"):
        FP16_Optimizer(inner, dynamic_loss_scale=True, dynamic_loss_args={"delayed_shift": 0})
    with pytest.raises(ValueError, match="static_loss_scale=None needs dynamic_loss_scale=True"):
        FP16_Optimizer(inner, static_loss_scale=None)
    assert all(p.dtype == torch.float16 for p in inner.param_groups[0]["params"])  # untouched


def test_clip_master_grads_is_minus_one_on_overflow_and_inspect_is_none():
    model, extra, opt, sched, _ = build(torch.float16, {"init_scale": 2**32})
    opt.zero_grad()
    opt.backward(loss_fn_for(6, torch.float16)(model, extra))
    assert opt.overflow and opt.clip_master_grads(1.0) == -1
    assert opt.inspect_master_grad_data() is None
    assert math.isclose(opt.loss_scale, 2**32)  # the scale moves in step(), not before
    opt.step()
    assert opt.loss_scale == 2.0**31


@pytest.mark.parametrize("scale", [0, 0.0, INF, float("nan"), -4.0, "128", True])
def test_a_static_scale_that_cannot_train_is_refused_before_anything_changes(scale):
    """0 made Megatron divide by zero at update_master_grads; inf and nan trained the model into
    NaN without a word (a static scale never checks): refused at construction, naming the fix."""
    model = nn.Linear(3, 3).half()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"static_loss_scale must be a finite number > 0.*dynamic_loss_scale=True"):
        FP16_Optimizer(inner, static_loss_scale=scale)
    assert all(p.dtype == torch.float16 for p in inner.param_groups[0]["params"])  # untouched
    # dynamic scaling ignores static_loss_scale (Megatron passes None beside it)
    assert FP16_Optimizer(inner, static_loss_scale=scale, dynamic_loss_scale=True).loss_scale == 2**32


def test_closure_retries_allow_for_the_hysteresis():
    """With delayed_shift = 40 the first 39 overflows keep the scale: the closure must be
    retried past them (it raised 'not finite at any scale' after 32, the scale untouched)."""
    torch.manual_seed(0)
    model = FP16_Module(nn.Linear(4, 2))
    opt = FP16_Optimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        static_loss_scale=None,
        dynamic_loss_scale=True,
        dynamic_loss_args={"init_scale": 2.0**24, "delayed_shift": 40},
    )
    x = torch.randn(3, 4)

    def closure():
        opt.zero_grad()
        loss = model(x).pow(2).sum() * 8.0  # overflows fp16 grads above about 2**12
        opt.backward(loss)
        return loss

    opt.step(closure)
    assert not opt.overflow and 2.0**8 <= opt.loss_scale <= 2.0**13
    ref = MegatronScaler(init_scale=2.0**24, delayed_shift=40)
    ref.update_scale(False)  # step()'s update with the (clean) flag of before
    while ref.cur_scale > opt.loss_scale:
        ref.update_scale(True)
    assert ref.cur_scale == opt.loss_scale and ref.cur_hysteresis == opt.loss_scaler.cur_hysteresis
    assert ref.cur_iter == opt.loss_scaler.cur_iter > 40


def test_clip_grad_norm_is_a_method_and_the_scaler_is_built_once(monkeypatch):
    from fp16kit.legacy.megatron import fp16 as megatron_fp16

    built = []

    class Counting(megatron_fp16.DynamicLossScaler):
        def __init__(self, *args, **kwargs):
            built.append(kwargs)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(megatron_fp16, "DynamicLossScaler", Counting)
    calls = []

    class Recording(FP16_Optimizer):
        def clip_grad_norm(self, parameters, max_norm, norm_type=2):
            calls.append(max_norm)
            return super().clip_grad_norm(parameters, max_norm, norm_type)

    model = FP16_Module(nn.Linear(3, 2))
    opt = Recording(
        torch.optim.SGD(model.parameters(), lr=0.1),
        static_loss_scale=None,
        dynamic_loss_scale=True,
        dynamic_loss_args={"init_scale": 8.0},
    )
    assert len(built) == 1 and isinstance(opt.loss_scaler, Counting) and opt.loss_scale == 8.0
    opt.backward(model(torch.ones(2, 3)).sum())
    total = opt.clip_master_grads(0.25)
    assert calls == [0.25] and type(total) is float and total > 0.25
    assert "clip_grad_norm" not in vars(opt)
