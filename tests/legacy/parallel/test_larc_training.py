"""LARC in the training loops apex users built around it: amp O1/O2 (apex's amp.initialize took a
LARC), an LR scheduler, a checkpoint round trip, and the modern face's MixedPrecisionOptimizer,
each against LARC's step written out here (docs/apex-others.md §4.4) on top of torch's SGD."""

from __future__ import annotations

import copy
import io
import pickle
import warnings

import pytest
import torch

import fp16kit
from fp16kit.legacy import amp
from fp16kit.legacy.amp import casts
from fp16kit.legacy.parallel.LARC import LARC

LR, MOMENTUM, WD, SCALE = 0.1, 0.9, 1e-4, 128.0


@pytest.fixture(autouse=True)
def _no_o1_leak():
    yield
    casts._disable_o1_for_tests()  # O1's autocast stays on for the thread otherwise


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2)).to(dtype)


def _batch(i):
    return torch.randn(8, 4, generator=torch.Generator().manual_seed(i))


def _larc_grad(p, g, wd, lr, tc=0.02, eps=1e-8):
    """apex's LARC, one param: host-side branches as apex wrote them."""
    pn, gn = torch.norm(p), torch.norm(g)
    if pn != 0 and gn != 0:
        a = min(tc * pn / (gn + pn * wd + eps) / lr, 1)
        return (g + wd * p) * a
    return g


class _Reference:
    """fp32 masters stepped by torch's SGD arithmetic (momentum buffers, no decay: LARC's)."""

    def __init__(self, model):
        self.model = model
        self.masters = [p.detach().float().clone() for p in model.parameters()]
        self.bufs = [None] * len(self.masters)

    def step(self, grads, lr=LR):
        with torch.no_grad():
            for j, g in enumerate(grads):
                g = _larc_grad(self.masters[j], g, WD, lr)
                self.bufs[j] = g.clone() if self.bufs[j] is None else self.bufs[j].mul_(MOMENTUM).add_(g)
                self.masters[j].add_(self.bufs[j], alpha=-lr)
            for p, m in zip(self.model.parameters(), self.masters):
                p.copy_(m.to(p.dtype))


def _sgd(params):
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM, weight_decay=WD)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_amp_with_larc_is_apexs_step_bit_for_bit(level):
    half = level == "O2"
    model = _model()
    model, larc = amp.initialize(model, LARC(_sgd(model.parameters())), opt_level=level, loss_scale=SCALE, verbosity=0)
    ref = _Reference(_model(torch.float16 if half else torch.float32))
    for i in range(3):
        x = _batch(i)
        loss = model(x.half() if half else x).float().pow(2).mean()
        with amp.scale_loss(loss, larc) as scaled:
            scaled.backward()
        larc.step()
        larc.zero_grad()
        for p in ref.model.parameters():
            p.grad = None
        if half:
            out = ref.model(x.half())
        else:
            with torch.autocast("cpu", dtype=torch.float16):
                out = ref.model(x)
        (out.float().pow(2).mean() * SCALE).backward()
        ref.step([p.grad.float() * (1.0 / SCALE) for p in ref.model.parameters()])
        stepped = [p for g in larc.param_groups for p in g["params"]]
        assert all(torch.equal(a, b) for a, b in zip(stepped, ref.masters)), i
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.model.parameters())), i
        assert larc.param_groups[0]["weight_decay"] == WD


def test_amp_o2_overflow_skips_larc_and_keeps_weight_decay():
    model = _model()
    model, larc = amp.initialize(
        model, LARC(_sgd(model.parameters())), opt_level="O2", loss_scale="dynamic", verbosity=0
    )
    before = [p.detach().clone() for p in model.parameters()]
    loss = model(_batch(0).half()).float().sum() * 1e4  # x 2**16 overflows fp16
    with amp.scale_loss(loss, larc) as scaled:
        scaled.backward()
    larc.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    assert not larc.state and larc.param_groups[0]["weight_decay"] == WD


@pytest.mark.parametrize("on_wrapper", [True, False])
def test_lr_scheduler_on_larc_or_its_optimizer(on_wrapper):
    model = _model()
    larc = LARC(_sgd(model.parameters()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()"
        sched = torch.optim.lr_scheduler.StepLR(larc if on_wrapper else larc.optim, 1, gamma=0.5)
        ref = _Reference(_model())
        for i in range(3):
            lr = LR * 0.5**i
            assert larc.param_groups[0]["lr"] == larc.optim.param_groups[0]["lr"] == lr
            larc.zero_grad()
            model(_batch(i)).pow(2).mean().backward()
            larc.step()
            sched.step()
            for p in ref.model.parameters():
                p.grad = None
            ref.model(_batch(i)).pow(2).mean().backward()
            ref.step([p.grad for p in ref.model.parameters()], lr=lr)  # the clip divides by this lr
            assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.masters)), i
    assert isinstance(larc, torch.optim.Optimizer)
    copy.deepcopy(larc)
    restored = pickle.loads(pickle.dumps(larc))
    assert restored.optim.param_groups[0]["lr"] == LR * 0.5**3 and restored.trust_coefficient == 0.02


def test_state_dict_round_trip_continues_bit_for_bit():
    model = _model()
    larc = LARC(_sgd(model.parameters()))
    for i in range(2):
        larc.zero_grad()
        model(_batch(i)).pow(2).mean().backward()
        larc.step()
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": larc.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    fresh = _model()
    fresh.load_state_dict(saved["model"])
    resumed = LARC(_sgd(fresh.parameters()))
    resumed.load_state_dict(saved["opt"])
    for m, opt in ((model, larc), (fresh, resumed)):
        opt.zero_grad()
        m(_batch(5)).pow(2).mean().backward()
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))
    assert resumed.param_groups[0]["weight_decay"] == WD


def test_mixed_precision_optimizer_around_larc_steps_the_masters():
    model = _model(torch.float16)
    opt = fp16kit.MixedPrecisionOptimizer(LARC(_sgd(model.parameters())))
    scaler = fp16kit.GradScaler("cpu", init_scale=SCALE)
    ref = _Reference(_model(torch.float16))
    for i in range(3):
        opt.zero_grad()
        scaler.scale(model(_batch(i).half()).float().pow(2).mean()).backward()
        scaler.step(opt)
        scaler.update()
        for p in ref.model.parameters():
            p.grad = None
        (ref.model(_batch(i).half()).float().pow(2).mean() * SCALE).backward()
        ref.step([p.grad.float() * (1.0 / SCALE) for p in ref.model.parameters()])
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.model.parameters())), i


def test_larc_around_mixed_precision_optimizer_is_refused_naming_the_order():
    model = _model(torch.float16)
    inner = _sgd(model.parameters())
    mixed = fp16kit.MixedPrecisionOptimizer(inner)
    with pytest.raises(TypeError, match=r"MixedPrecisionOptimizer\(LARC\(optimizer\)\)"):
        LARC(mixed)


def test_sparse_grads_are_refused_before_anything_changes():
    emb, lin = torch.nn.Embedding(10, 3, sparse=True), torch.nn.Linear(3, 1)
    larc = LARC(
        torch.optim.SGD(
            [{"params": lin.parameters(), "weight_decay": WD}, {"params": emb.parameters(), "weight_decay": WD}], lr=LR
        )
    )
    lin(emb(torch.tensor([1, 2]))).sum().backward()
    grads = [p.grad.clone() for p in lin.parameters()]
    with pytest.raises(ValueError, match="sparse=False"):
        larc.step()
    assert [g["weight_decay"] for g in larc.param_groups] == [WD, WD]
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, lin.parameters()))
