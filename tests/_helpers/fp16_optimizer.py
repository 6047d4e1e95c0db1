"""The model, data and hand-written reference shared by the FP16_Optimizer tests
(tests/legacy/test_fp16_optimizer.py, test_fp16_optimizer_state_dict.py,
test_fp16_optimizer_async.py).

``Reference`` is apex's era-2 FP16_Optimizer by hand (docs/apex-fp16-optimizer.md) in plain torch and Python
floats: an fp32 master per fp16/bf16 param, the same torch optimizer on the masters (and on fp32
params directly), ``(loss.float() * scale).backward()``, master grads
``float(model_grad) * float32(1/scale)``, fp32 grads unscaled in place by the same factor, one
non-finite check, apex amp's dynamic scale rule, skipped steps on overflow and masters copied
back into the model after each step. ``build`` makes an FP16_Optimizer and a Reference from
identical models; ``train_iter`` runs one iteration of both and ``assert_matches`` compares
them bit for bit.
"""

from __future__ import annotations

import copy

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
