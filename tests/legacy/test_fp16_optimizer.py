"""fp16kit.legacy.FP16_Optimizer, written from spec/apex.md (apex's era-2 FP16_Optimizer).

The core check: FP16_Optimizer produces, bit for bit, what a hand-written pure-torch reference
of apex's algorithm produces -- an fp32 master per fp16/bf16 param, the same torch optimizer on
the masters (and on fp32 params directly), ``(loss.float() * scale).backward()``, master grads
``float(model_grad) * float32(1/scale)``, fp32 grads unscaled in place by the same factor, one
non-finite check, apex amp's dynamic scale rule, skipped steps on overflow and masters copied
back into the model after each step.
"""

from __future__ import annotations

import copy
import io
import logging
import pickle
import re
import threading
import warnings

import pytest
import torch
from torch import nn

from fp16kit.legacy import FP16_Optimizer

LOW = (torch.float16, torch.bfloat16)
LOW_IDS = ("fp16", "bf16")
INF = float("inf")
NAN = float("nan")


# ---------------------------------------------------------------- model, data, groups
class Net(nn.Module):
    """Two low-precision Linear(8, 8), a frozen low-precision param and an fp32 param."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.l1 = nn.Linear(8, 8).to(dtype)
        self.l2 = nn.Linear(8, 8).to(dtype)
        self.frozen = nn.Parameter((torch.randn(8) * 0.1).to(dtype), requires_grad=False)
        self.gain = nn.Parameter(torch.randn(8) * 0.5 + 1.0)  # fp32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.l1(x)) + self.frozen
        return self.l2(h).float() * self.gain


def make_model(dtype: torch.dtype, seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net(dtype)


def batch(i: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + i)
    x = torch.randn(4, 8, generator=g)
    y = torch.randn(4, 8, generator=g)
    return x.to(dtype), y


def loss_fn(model: Net, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (model(x) - y).pow(2).mean()


def two_groups(model: Net, lr1: float, lr2: float) -> list[dict]:
    """Group 0: low-precision params only; group 1: the fp32 param, a low-precision param and
    the frozen low-precision param."""
    return [
        {"params": [model.l1.weight, model.l1.bias, model.l2.weight], "lr": lr1},
        {"params": [model.gain, model.l2.bias, model.frozen], "lr": lr2},
    ]


OPTIMIZERS = {
    "sgd_momentum": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-4}, (0.05, 0.02)),
    "adam": (torch.optim.Adam, {"lr": 1e-2}, (1e-2, 3e-3)),
}


# ---------------------------------------------------------------- the reference
class Reference:
    """apex era-2 FP16_Optimizer by hand, in plain torch and Python floats."""

    def __init__(
        self,
        model: Net,
        groups: list[dict],
        opt_cls: type,
        opt_kw: dict,
        *,
        static_loss_scale: float = 1.0,
        dynamic: bool = False,
        dynamic_args: dict | None = None,
    ) -> None:
        self.model = model
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.fp32: list[torch.Tensor] = []
        ref_groups = []
        for g in groups:
            params = []
            for p in g["params"]:
                if p.requires_grad and p.dtype in LOW:
                    m = p.detach().clone().float().requires_grad_(True)
                    self.pairs.append((p, m))
                    params.append(m)
                else:
                    if p.requires_grad:
                        self.fp32.append(p)
                    params.append(p)
            ref_groups.append({**g, "params": params})
        self.opt = opt_cls(ref_groups, **opt_kw)
        self.dynamic = dynamic
        a = {
            "init_scale": 2.0**16,
            "scale_factor": 2.0,
            "scale_window": 2000,
            "min_loss_scale": None,
            "max_loss_scale": 2.0**24,
            **(dynamic_args or {}),
        }
        self.factor = a["scale_factor"]
        self.window = a["scale_window"]
        self.min_scale = a["min_loss_scale"]
        self.max_scale = a["max_loss_scale"]
        self.scale = min(self.max_scale, a["init_scale"]) if dynamic else float(static_loss_scale)
        self.unskipped = 0
        self.overflow = False
        self.n_overflows = 0
        self.n_growths = 0

    @property
    def masters(self) -> list[torch.Tensor]:
        return [m for _, m in self.pairs]

    def zero_grad(self) -> None:
        for p in [*self.model.parameters(), *self.masters]:
            if p.grad is not None:
                p.grad.zero_()

    def backward(self, loss: torch.Tensor) -> None:
        (loss.float() * self.scale).backward()

    def update_master_grads(self) -> None:
        inv = torch.tensor(1.0 / self.scale, dtype=torch.float64).float()
        overflow = False
        for p, m in self.pairs:
            if p.grad is None:
                continue
            g = p.grad.float()
            overflow |= not bool(torch.isfinite(g).all())
            m.grad = g * inv
        for p in self.fp32:
            if p.grad is None:
                continue
            overflow |= not bool(torch.isfinite(p.grad).all())
            with torch.no_grad():
                p.grad.mul_(inv)
        if self.dynamic:
            self.overflow = overflow
            self._update_scale(overflow)
        else:
            self.overflow = False

    def _update_scale(self, overflow: bool) -> None:
        if overflow:
            self.n_overflows += 1
            self.scale = self.scale / self.factor
            if self.min_scale:
                self.scale = max(self.min_scale, self.scale)
            self.unskipped = 0
        else:
            self.unskipped += 1
        if self.unskipped == self.window:
            self.n_growths += 1
            self.scale = min(self.max_scale, self.scale * self.factor)
            self.unskipped = 0

    def copy_back(self) -> None:
        with torch.no_grad():
            for p, m in self.pairs:
                p.copy_(m)

    def step(self, closure=None):
        if self.overflow:
            return None
        ret = self.opt.step(closure) if closure is not None else self.opt.step()
        self.copy_back()
        return ret


def build(dtype, opt_name, *, static_loss_scale=1.0, dynamic=False, dynamic_args=None, seed=0):
    """(model, FP16_Optimizer, reference) from identical initial models."""
    opt_cls, kw, (lr1, lr2) = OPTIMIZERS[opt_name]
    model = make_model(dtype, seed)
    ref_model = copy.deepcopy(model)
    opt = FP16_Optimizer(
        opt_cls(two_groups(model, lr1, lr2), **kw),
        static_loss_scale=static_loss_scale,
        dynamic_loss_scale=dynamic,
        dynamic_loss_args=dynamic_args,
        verbose=False,
    )
    ref = Reference(
        ref_model,
        two_groups(ref_model, lr1, lr2),
        opt_cls,
        kw,
        static_loss_scale=static_loss_scale,
        dynamic=dynamic,
        dynamic_args=dynamic_args,
    )
    return model, opt, ref


# ---------------------------------------------------------------- comparisons
def bitwise(a: torch.Tensor, b: torch.Tensor, where: str = "") -> None:
    assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), where
    assert a.dtype == b.dtype, f"{where}: {a.dtype} != {b.dtype}"
    assert a.shape == b.shape, f"{where}: {a.shape} != {b.shape}"
    na, nb = torch.isnan(a), torch.isnan(b)
    assert torch.equal(na, nb), f"{where}: NaN positions differ"
    assert torch.equal(a.masked_fill(na, 0), b.masked_fill(nb, 0)), f"{where}: values differ"


def same_value(a, b, where: str) -> None:
    if isinstance(a, torch.Tensor):
        bitwise(a, b, where)
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            same_value(x, y, f"{where}[{i}]")
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{where}: {sorted(a)} != {sorted(b)}"
        for k in a:
            same_value(a[k], b[k], f"{where}[{k!r}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def flat_masters(opt: FP16_Optimizer) -> list[torch.Tensor]:
    return [m for g in opt.fp32_from_fp16_groups for m in g]


def assert_matches(model: Net, opt: FP16_Optimizer, ref: Reference, where: str = "") -> None:
    for (name, a), (_, b) in zip(model.named_parameters(), ref.model.named_parameters()):
        bitwise(a.detach(), b.detach(), f"{where} model.{name}")
    masters = flat_masters(opt)
    assert len(masters) == len(ref.pairs)
    for i, (m, rm) in enumerate(zip(masters, ref.masters)):
        assert m.dtype == torch.float32
        bitwise(m.detach(), rm.detach(), f"{where} master {i}")
    assert opt.loss_scale == ref.scale, where
    assert opt.overflow == ref.overflow, where
    assert len(opt.param_groups) == len(ref.opt.param_groups)
    for gi, (g, rg) in enumerate(zip(opt.param_groups, ref.opt.param_groups)):
        assert len(g["params"]) == len(rg["params"])
        assert g["lr"] == rg["lr"]
        for pi, (p, rp) in enumerate(zip(g["params"], rg["params"])):
            s = opt.state[p] if p in opt.state else {}
            rs = ref.opt.state[rp] if rp in ref.opt.state else {}
            same_value(dict(s), dict(rs), f"{where} state group {gi} param {pi}")


def inject_inf_fp16(model: Net) -> None:
    model.l1.weight.grad[0, 1] = INF


def inject_nan_fp32(model: Net) -> None:
    model.gain.grad[3] = NAN


def train_iter(model, opt, ref, i, dtype, inject=None):
    x, y = batch(i, dtype)
    opt.zero_grad()
    loss = loss_fn(model, x, y)
    if inject is None:
        opt.backward(loss)
    else:
        opt.backward(loss, update_master_grads=False)
        inject(model)
        opt.update_master_grads()
    ret = opt.step()

    ref.zero_grad()
    rloss = loss_fn(ref.model, x, y)
    bitwise(loss.detach(), rloss.detach(), f"iter {i} loss")
    ref.backward(rloss)
    if inject is not None:
        inject(ref.model)
    ref.update_master_grads()
    rret = ref.step()
    assert ret is None and rret is None
    return loss


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
    assert str(e.value) == (
        "Wrapped parameters must be either torch.cuda.FloatTensor or torch.cuda.HalfTensor. "
        "Received torch.DoubleTensor"
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
    opt = FP16_Optimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), dynamic_loss_scale=True, verbose=False
    )
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
            for p, rp in zip(
                [p for g in opt.param_groups for p in g["params"]], params
            ):
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
    model, opt, ref = build(torch.float16, "adam", dynamic=True, dynamic_args={"init_scale": 2.0**21, "scale_window": 2})
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


# ---------------------------------------------------------------- checkpoints
def _step(model, opt, i, dtype, inject=None):
    x, y = batch(i, dtype)
    opt.zero_grad()
    if inject is None:
        opt.backward(loss_fn(model, x, y))
    else:
        opt.backward(loss_fn(model, x, y), update_master_grads=False)
        inject(model)
        opt.update_master_grads()
    opt.step()


def _snapshot(model, opt):
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "masters": [m.detach().clone() for m in flat_masters(opt)],
        "scale": opt.loss_scale,
        "overflow": opt.overflow,
        "state": [
            [copy.deepcopy(dict(opt.state[p])) if p in opt.state else {} for p in g["params"]]
            for g in opt.param_groups
        ],
        "lrs": [g["lr"] for g in opt.param_groups],
    }


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("dtype", LOW, ids=LOW_IDS)
def test_state_dict_round_trip_continues_bitwise(dtype, opt_name):
    dyn = {"init_scale": 2.0**21, "scale_window": 2}
    injections = {2: inject_inf_fp16, 6: inject_nan_fp32}
    model, opt, _ = build(dtype, opt_name, dynamic=True, dynamic_args=dyn)
    for i in range(4):
        _step(model, opt, i, dtype, injections.get(i))

    sd = opt.state_dict()
    assert set(sd) == {
        "loss_scaler",
        "dynamic_loss_scale",
        "overflow",
        "first_closure_call_this_step",
        "optimizer_state_dict",
        "fp32_from_fp16",
    }
    assert isinstance(sd["loss_scaler"], dict)
    assert [len(g) for g in sd["fp32_from_fp16"]] == [3, 1]
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": sd}, buf)
    buf.seek(0)
    ck = torch.load(buf, weights_only=True)

    # a fresh model (different init) and optimizer; the model is loaded first
    model2, opt2, _ = build(dtype, opt_name, dynamic=True, dynamic_args={"init_scale": 8.0}, seed=7)
    model2.load_state_dict(ck["model"])
    opt2.load_state_dict(ck["optimizer"])
    same_value(_snapshot(model2, opt2), _snapshot(model, opt), "after load")

    for i in range(4, 9):
        _step(model, opt, i, dtype, injections.get(i))
        _step(model2, opt2, i, dtype, injections.get(i))
        same_value(_snapshot(model2, opt2), _snapshot(model, opt), f"iter {i}")


def test_state_dict_restores_masters_exactly():
    """The fp32 masters come back exactly, not through an fp16 round trip."""
    model, opt, _ = build(torch.float16, "adam", static_loss_scale=16.0)
    for i in range(3):
        _step(model, opt, i, torch.float16)
    masters = [m.detach().clone() for m in flat_masters(opt)]
    assert any(not torch.equal(m, m.half().float()) for m in masters)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buf)
    buf.seek(0)
    ck = torch.load(buf, weights_only=True)
    model2, opt2, _ = build(torch.float16, "adam", static_loss_scale=16.0, seed=3)
    model2.load_state_dict(ck["model"])
    opt2.load_state_dict(ck["optimizer"])
    for m, m2 in zip(masters, flat_masters(opt2)):
        bitwise(m2.detach(), m)
    assert opt2.loss_scale == 16.0 and opt2.dynamic_loss_scale is False


def _trained_other_layout(layout: str):
    """An optimizer over the same model with another group structure, trained a few steps."""
    model = make_model(torch.float16, seed=5)
    if layout == "fp16_count":  # group 0 has 2 fp16 params instead of 3
        groups = [
            {"params": [model.l1.weight, model.l1.bias]},
            {"params": [model.gain, model.l2.weight, model.l2.bias, model.frozen]},
        ]
    elif layout == "group_count":  # one group instead of two
        groups = [{"params": list(model.parameters())}]
    else:  # "fp32_count": same masters per group, the fp32 param moved to group 0
        groups = [
            {"params": [model.l1.weight, model.l1.bias, model.l2.weight, model.gain]},
            {"params": [model.l2.bias, model.frozen]},
        ]
    opt = FP16_Optimizer(
        torch.optim.SGD(groups, lr=0.05, momentum=0.9),
        dynamic_loss_scale=True,
        dynamic_loss_args={"init_scale": 2.0**12, "scale_window": 2},
        verbose=False,
    )
    for i in range(3):
        _step(model, opt, i, torch.float16)
    return model, opt


@pytest.mark.parametrize("layout", ["fp16_count", "group_count", "fp32_count"])
def test_mismatched_groups_raise_and_change_nothing(layout):
    model, opt, _ = build(torch.float16, "sgd_momentum", dynamic=True, dynamic_args={"init_scale": 2.0**10})
    for i in range(2):
        _step(model, opt, i, torch.float16)
    sd = copy.deepcopy(opt.state_dict())

    model2, opt2 = _trained_other_layout(layout)
    before = _snapshot(model2, opt2)
    inner_sd_before = copy.deepcopy(opt2.optimizer.state_dict())
    with pytest.raises(ValueError) as e:
        opt2.load_state_dict(sd)
    msg = str(e.value)
    # nothing changed ...
    same_value(_snapshot(model2, opt2), before, "after failed load")
    same_value(opt2.optimizer.state_dict(), inner_sd_before, "inner state dict after failed load")
    # ... and the message names the group and the counts
    if layout == "fp16_count":
        assert re.search(r"group 0", msg, re.I), msg
        assert "3" in msg and "2" in msg, msg
    elif layout == "group_count":
        assert "2" in msg and "1" in msg and "group" in msg.lower(), msg
    else:
        # group 0: the checkpoint has 3 params, this optimizer 4
        assert re.search(r"group 0", msg, re.I), msg
        assert "3" in msg and "4" in msg, msg


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


def test_static_scaler_counts_clean_updates_like_apex():
    model = make_model(torch.float16)
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), static_loss_scale=8.0, verbose=False)
    for i in range(3):
        opt.zero_grad()
        x, y = batch(i, torch.float16)
        opt.backward(loss_fn(model, x, y))
        opt.step()
    assert opt.loss_scaler._unskipped == 3 and opt.state_dict()["loss_scaler"]["unskipped"] == 3


def test_load_with_bad_scaler_settings_changes_nothing():
    model = make_model(torch.float16)
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), dynamic_loss_scale=True, verbose=False)
    x, y = batch(0, torch.float16)
    opt.backward(loss_fn(model, x, y))
    opt.step()
    sd = opt.state_dict()
    before = (copy.deepcopy(opt.optimizer.state_dict()), [m.detach().clone() for m in flat_masters(opt)], opt.loss_scale)
    bad = dict(sd, loss_scaler=dict(sd["loss_scaler"], min_loss_scale=-1.0))
    with pytest.raises(ValueError, match="invalid settings"):
        opt.load_state_dict(bad)
    after = (opt.optimizer.state_dict(), flat_masters(opt), opt.loss_scale)
    same_value(before[0], after[0], "optimizer state")
    assert all(torch.equal(a, b) for a, b in zip(before[1], after[1])) and before[2] == after[2]


# ---------------------------------------------------------------- async_step / master_device
# The asynchronous FP16_Optimizer (spec/async.md, mode 1) equals, bit for bit, a one-step-delayed
# version of the reference: every trainable param has an fp32 master, the grads of iteration k
# are applied after step k-1's masters have reached the model, and the scale follows apex amp's
# rule with no lag.


class DelayedReference(Reference):
    """apex's algorithm, one step delayed, every trainable param mastered."""

    def __init__(self, model, groups, opt_cls, opt_kw, *, dynamic_args=None, set_to_none=False):
        super().__init__(model, groups, opt_cls, opt_kw, dynamic=True, dynamic_args=dynamic_args)
        self.pairs = []
        ref_groups = []
        for g in groups:
            params = []
            for p in g["params"]:
                if p.requires_grad:
                    m = p.detach().clone().float().requires_grad_(True)
                    self.pairs.append((p, m))
                    params.append(m)
                else:
                    params.append(p)
            ref_groups.append({**g, "params": params})
        self.opt = opt_cls(ref_groups, **opt_kw)
        self.set_to_none = set_to_none
        self.pending = None

    def iteration(self, loss_of, inject=None):
        for p in self.model.parameters():
            p.grad = None
        (loss_of(self.model).float() * self.scale).backward()
        if inject is not None:
            inject(self.model)
        self._apply_pending()
        grads = [p.grad for p, _ in self.pairs]
        overflow = not all(g is None or bool(torch.isfinite(g).all()) for g in grads)
        inv = torch.tensor(1.0 / self.scale, dtype=torch.float64).float()
        self._update_scale(overflow)
        self.pending = (grads, inv, overflow)

    def _apply_pending(self):
        if self.pending is None:
            return
        grads, inv, skip = self.pending
        if not skip:
            for (_, m), g in zip(self.pairs, grads):
                if g is not None:
                    m.grad = g.float() * inv
                elif m.grad is not None:  # zero_grad() ran before this iteration's backward
                    m.grad = None if self.set_to_none else torch.zeros_like(m)
            self.opt.step()
        with torch.no_grad():
            for p, m in self.pairs:
                p.copy_(m)
        self.pending = None

    def finish(self):
        self._apply_pending()


def _build(opt_name, dtype=torch.float16, *, dynamic_args=None, set_to_none=False, **options):
    opt_cls, kw, (lr1, lr2) = OPTIMIZERS[opt_name]
    model = make_model(dtype)
    ref_model = copy.deepcopy(model)
    opt = FP16_Optimizer(
        opt_cls(two_groups(model, lr1, lr2), **kw),
        dynamic_loss_scale=True,
        dynamic_loss_args=dynamic_args,
        verbose=False,
        async_step=True,
        **options,
    )
    ref = DelayedReference(
        ref_model, two_groups(ref_model, lr1, lr2), opt_cls, kw, dynamic_args=dynamic_args, set_to_none=set_to_none
    )
    return model, opt, ref


def _iteration(opt, model, loss_of, inject=None, set_to_none=False):
    opt.zero_grad(set_grads_to_None=set_to_none)
    opt.backward(loss_of(model), update_master_grads=False)
    if inject is not None:
        inject(model)
    opt.update_master_grads()
    assert opt.step() is None


def _assert_same(model, opt, ref):
    for (_, rm), m in zip(ref.pairs, opt.all_fp32_from_fp16_params):
        assert torch.equal(m, rm)
    for p, rp in zip(model.parameters(), ref.model.parameters()):
        assert torch.equal(p, rp)
    assert opt.loss_scale == ref.scale


def _poison(i, value):
    def inject(model):
        model.l1.weight.grad.view(-1)[i] = value

    return inject


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_async_equals_the_one_step_delayed_apex_reference_bit_for_bit(dtype, opt_name, caplog):
    args = {"init_scale": 2.0**10, "scale_window": 3, "min_loss_scale": 4.0}
    model, opt, ref = _build(opt_name, dtype, dynamic_args=args)
    poisoned = {2: _poison(0, INF), 5: _poison(3, NAN), 6: _poison(1, INF)}
    with caplog.at_level(logging.WARNING, logger="fp16kit"):
        for i in range(12):
            x, y = batch(i, dtype)
            loss_of = lambda m, x=x, y=y: loss_fn(m, x, y)  # noqa: E731
            _iteration(opt, model, loss_of, poisoned.get(i))
            ref.iteration(loss_of, poisoned.get(i))
            assert opt.loss_scale == ref.scale  # no lag: updated in update_master_grads
        opt.synchronize()
    ref.finish()
    _assert_same(model, opt, ref)
    skips = [r for r in caplog.records if r.getMessage().startswith("Gradient overflow.  Skipping step")]
    assert len(skips) == 3
    assert {r.threadName for r in skips} == {opt._mpo._async.thread.name}  # logged by the worker
    assert skips[0].getMessage().endswith(f"reducing loss scale to {2.0**9}")


@pytest.mark.parametrize("set_to_none", [False, True], ids=["zeroed", "none"])
def test_a_param_without_a_grad_follows_zero_grad_like_apex(set_to_none):
    # SGD with momentum: a zeroed master grad still moves the param (momentum); a missing one
    # leaves it alone. Iteration 3 leaves l2 and gain without grads.
    model, opt, ref = _build("sgd_momentum", set_to_none=set_to_none)
    for i in range(6):
        x, y = batch(i, torch.float16)
        if i == 3:
            loss_of = lambda m, x=x: m.l1(x).float().pow(2).mean()  # noqa: E731
        else:
            loss_of = lambda m, x=x, y=y: loss_fn(m, x, y)  # noqa: E731
        _iteration(opt, model, loss_of, set_to_none=set_to_none)
        ref.iteration(loss_of)
    opt.synchronize()
    ref.finish()
    _assert_same(model, opt, ref)


def test_state_dict_during_pending_work_resumes_bit_for_bit():
    def run(n, model, opt, start=0):
        for i in range(start, start + n):
            x, y = batch(i, torch.float16)
            _iteration(opt, model, lambda m, x=x, y=y: loss_fn(m, x, y))

    model, opt, _ = _build("adam", dynamic_args={"scale_window": 2})
    run(4, model, opt)
    saved_opt = copy.deepcopy(opt.state_dict())  # waits for the step in flight
    saved_model = copy.deepcopy(model.state_dict())
    run(4, model, opt, start=4)
    opt.synchronize()

    model2, opt2, _ = _build("adam", dynamic_args={"scale_window": 2})
    model2.load_state_dict(saved_model)
    opt2.load_state_dict(saved_opt)
    run(4, model2, opt2, start=4)
    opt2.synchronize()
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(opt.all_fp32_from_fp16_params, opt2.all_fp32_from_fp16_params):
        assert torch.equal(a, b)
    assert opt.loss_scale == opt2.loss_scale


def test_wrong_use_raises_clear_errors_and_training_goes_on():
    model, opt, ref = _build("sgd_momentum")
    x, y = batch(0, torch.float16)
    opt.zero_grad()
    opt.backward(loss_fn(model, x, y), update_master_grads=False)
    with pytest.raises(RuntimeError, match=r"call optimizer.backward\(loss\)"):
        opt.step()
    opt.update_master_grads()
    with pytest.raises(RuntimeError, match="Closures are not supported with async_step=True"):
        opt.step(lambda: None)
    with pytest.raises(RuntimeError, match="async_step=False to clip"):
        opt.clip_master_grads(1.0)
    with pytest.raises(RuntimeError, match="async_step=False to clip or inspect"):
        opt.inspect_master_grad_data()
    opt.step()  # the prepared step is still there
    ref.iteration(lambda m: loss_fn(m, x, y))
    opt.synchronize()
    ref.finish()
    _assert_same(model, opt, ref)


def test_an_error_in_the_step_surfaces_on_the_main_thread_and_the_thread_keeps_working():
    class Failing(torch.optim.SGD):
        fail = True

        def step(self, closure=None):
            if Failing.fail:
                Failing.fail = False
                raise ValueError("boom in the step")
            return super().step(closure)

    model = make_model(torch.float16)
    opt = FP16_Optimizer(Failing(model.parameters(), lr=0.1), dynamic_loss_scale=True, verbose=False, async_step=True)
    x, y = batch(0, torch.float16)
    opt.zero_grad()
    opt.backward(loss_fn(model, x, y))
    opt.step()
    opt.zero_grad()
    opt.backward(loss_fn(model, x, y))
    grads = [p.grad for p in model.parameters()]
    with pytest.raises(ValueError, match="boom in the step"):
        opt.step()  # waits for the failed step before anything changes
    assert all(p.grad is g for p, g in zip(model.parameters(), grads))  # still this iteration's
    opt.step()  # the same prepared step, now submitted
    opt.synchronize()
    assert all(p.grad is None for p in model.parameters())
    assert threading.main_thread().is_alive()


def test_fp32_params_get_masters_with_async_step():
    model = make_model(torch.float16)
    opt = FP16_Optimizer(torch.optim.SGD(two_groups(model, 0.1, 0.1), lr=0.1), verbose=False, async_step=True)
    assert opt.all_fp32_from_fp32_params == []
    assert sum(m.numel() for m in opt.all_fp32_from_fp16_params) == sum(
        p.numel() for p in model.parameters() if p.requires_grad
    )


def _trained(async_step, n=3):
    model = make_model(torch.float16)
    opt = FP16_Optimizer(
        torch.optim.Adam(two_groups(model, 1e-2, 3e-3), lr=1e-2), dynamic_loss_scale=True, verbose=False,
        async_step=async_step,
    )
    for i in range(n):
        x, y = batch(i, torch.float16)
        opt.zero_grad()
        opt.backward(loss_fn(model, x, y))
        opt.step()
    return model, opt


@pytest.mark.parametrize("model_first", [True, False])
def test_a_synchronous_checkpoint_loads_into_an_asynchronous_optimizer(model_first):
    # apex's form (network_to_half keeps fp32 params): the fp32 params' masters come from the
    # loaded model, where the synchronous run stepped them -- whichever is loaded first.
    model, opt = _trained(async_step=False)
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    assert [len(g) for g in saved_opt["fp32_from_fp16"]] == [3, 1]
    model2, opt2 = _trained(async_step=True, n=0)
    if model_first:
        model2.load_state_dict(saved_model)
    opt2.load_state_dict(saved_opt)
    if not model_first:
        model2.load_state_dict(saved_model)
    opt2.state_dict()  # the next point that reads the masters
    low = iter(t for g in saved_opt["fp32_from_fp16"] for t in g)
    for m, p in zip(opt2.all_fp32_from_fp16_params, opt2.all_fp16_params):
        assert torch.equal(m, next(low) if p.dtype == torch.float16 else p)
    x, y = batch(5, torch.float16)
    opt2.zero_grad()
    opt2.backward(loss_fn(model2, x, y))
    opt2.step()
    opt2.synchronize()
    assert all(torch.isfinite(m).all() for m in opt2.all_fp32_from_fp16_params)


@pytest.mark.parametrize("model_first", [True, False])
def test_an_asynchronous_checkpoint_loads_into_a_synchronous_optimizer(model_first):
    model, opt = _trained(async_step=True)
    saved_opt = copy.deepcopy(opt.state_dict())  # masters one step ahead of the model
    saved_model = copy.deepcopy(model.state_dict())
    assert [len(g) for g in saved_opt["fp32_from_fp16"]] == [3, 2]
    model2, opt2 = _trained(async_step=False, n=0)
    if model_first:
        model2.load_state_dict(saved_model)
    opt2.load_state_dict(saved_opt)
    if not model_first:
        model2.load_state_dict(saved_model)  # the older fp32 weights, for now
    opt2.state_dict()  # the next point that reads the masters: the fp32 masters go in
    gain_master = saved_opt["fp32_from_fp16"][1][0]  # group 1: gain, l2.bias
    assert torch.equal(model2.gain, gain_master)  # the fp32 param is its own master here
    assert not torch.equal(model.gain, gain_master)
    assert torch.equal(opt2.all_fp32_from_fp16_params[-1], saved_opt["fp32_from_fp16"][1][1])


def test_a_checkpoint_of_another_model_is_refused_untouched():
    _, opt = _trained(async_step=True)
    opt.synchronize()  # the last step has landed: the masters stay as they are now
    _, other = _trained(async_step=False, n=0)
    saved = copy.deepcopy(other.state_dict())
    saved["fp32_from_fp16"][1] = saved["fp32_from_fp16"][1] * 3
    before = [m.detach().clone() for m in opt.all_fp32_from_fp16_params]
    with pytest.raises(ValueError, match="Param group 1: the checkpoint has 3 master tensors"):
        opt.load_state_dict(saved)
    assert all(torch.equal(a, b) for a, b in zip(before, opt.all_fp32_from_fp16_params))


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_master_device_alone_is_the_synchronous_apex_loop(opt_name):
    # master_device="cpu" on a CPU model: fp32 params step through masters, bit for bit the same.
    opt_cls, kw, (lr1, lr2) = OPTIMIZERS[opt_name]
    runs = []
    for options in ({}, {"master_device": "cpu"}):
        model = make_model(torch.float16)
        opt = FP16_Optimizer(
            opt_cls(two_groups(model, lr1, lr2), **kw), dynamic_loss_scale=True, verbose=False, **options
        )
        for i in range(6):
            x, y = batch(i, torch.float16)
            opt.zero_grad()
            opt.backward(loss_fn(model, x, y), update_master_grads=False)
            if i == 2:
                model.l1.weight.grad.view(-1)[0] = INF
            opt.update_master_grads()
            opt.step()
        runs.append((model, opt))
    (m1, o1), (m2, o2) = runs
    for a, b in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(a, b)
    assert o1.loss_scale == o2.loss_scale


def test_async_several_losses_through_one_graph_as_apex_documents():
    # backward(l1, retain_graph=True) then backward(l2): the weights must not change in between
    # (apex copies masters into the model only in step()).
    model, opt, _ = _build("sgd_momentum")
    for i in range(3):
        x, y = batch(i, torch.float16)
        opt.zero_grad()
        out = model(x)
        weights = [p.detach().clone() for p in model.parameters()]
        opt.backward(out.pow(2).mean(), update_master_grads=False, retain_graph=True)
        opt.backward((out - y).pow(2).mean(), update_master_grads=False)
        opt.update_master_grads()
        assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))
        opt.step()
    opt.synchronize()


def test_async_zero_grad_drops_a_prepared_step():
    # Its grads are gone: stepping now would apply grads nobody checked.
    model, opt, _ = _build("sgd_momentum")
    x, y = batch(0, torch.float16)
    opt.backward(loss_fn(model, x, y))
    opt.zero_grad()
    opt.backward(loss_fn(model, x, y), update_master_grads=False)
    with pytest.raises(RuntimeError, match="found no prepared gradients"):
        opt.step()


def test_async_lr_scheduler_changes_the_next_step_not_the_pending_one():
    model = make_model(torch.float16)
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=1.0), dynamic_loss_scale=True,
                         verbose=False, async_step=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1.0 if epoch == 0 else 0.0)
    before = [m.detach().clone() for m in opt.all_fp32_from_fp16_params]
    thread = opt._mpo._async.thread
    release = threading.Event()
    thread.submit(release.wait, 30)  # the step job runs only after sched.step()
    x, y = batch(0, torch.float16)
    opt.backward(loss_fn(model, x, y))
    opt.step()
    sched.step()
    release.set()
    opt.synchronize()
    assert all(not torch.equal(a, b) for a, b in zip(before, opt.all_fp32_from_fp16_params))


def test_copying_masters_to_the_model_after_a_cross_mode_load_keeps_the_loaded_fp32_weights():
    model, opt = _trained(async_step=False)
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    model2 = make_model(torch.float16, seed=5)
    opt2 = FP16_Optimizer(
        torch.optim.Adam(two_groups(model2, 1e-2, 3e-3), lr=1e-2), dynamic_loss_scale=True, verbose=False,
        master_device="cpu",
    )
    opt2.load_state_dict(saved_opt)
    model2.load_state_dict(saved_model)
    opt2._master_params_to_model_params()  # apex's own call after a load
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)
