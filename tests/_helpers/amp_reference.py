"""A hand-written reference of what apex.amp did, written from docs/apex-amp.md (§4-§8), in plain
torch with Python-float scales -- independent of fp16kit's code. Used by tests/legacy/amp.

O2: the model converted to fp16 except affine BatchNorm; fp32 masters cloned from the
fp16-ROUNDED weights; ``(loss.float() * S).backward()``; master grad = fp16 grad * (1/S) in fp32
(+ the existing master grad when accumulating); fp32 params: grad * (1/S) + stash; a
non-finite new grad -> skip (master grads None), S = max(min, S/2), unskipped = 0; else
unskipped += 1 and S = min(max, 2S) after ``window`` clean backward passes.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def tiny_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(6, 16),
        nn.BatchNorm1d(16),
        nn.ReLU(),
        nn.Linear(16, 16),
        nn.LayerNorm(16),
        nn.Tanh(),
        nn.Linear(16, 3),
    )


def batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)) for _ in range(n)]


def to_fp16_keep_bn(model: nn.Module, dtype: torch.dtype = torch.float16) -> nn.Module:
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.affine:
            continue
        for p in m.parameters(recurse=False):
            p.data = p.data.to(dtype)
        for b in m.buffers(recurse=False):
            if b.is_floating_point():
                b.data = b.data.to(dtype)
    return model


def unscale_with_stash(params, stash, inv: float) -> bool:
    """apex's post-backward for params without masters: ``grad = new * inv + stash`` (the stash
    alone without a new grad); returns whether a new grad held inf/NaN."""
    overflow = False
    for p in params:
        s = stash.get(p)
        if p.grad is None:
            p.grad = s
            continue
        overflow |= not bool(torch.isfinite(p.grad).all())
        new = p.grad * inv
        p.grad = new if s is None else new + s
    return overflow


class ApexScale:
    """apex.amp.scaler.LossScaler's rule in Python floats."""

    def __init__(self, loss_scale: Any = "dynamic", min_loss_scale=None, max_loss_scale=2.0**24, window=2000):
        self.dynamic = loss_scale == "dynamic"
        self.scale = min(max_loss_scale, 2.0**16) if self.dynamic else float(loss_scale)
        self.min, self.max, self.window, self.unskipped = min_loss_scale, max_loss_scale, window, 0
        self.history: list[float] = []

    def update(self, overflow: bool) -> bool:
        skip = overflow and self.dynamic
        if skip:
            self.scale = max(self.min, self.scale / 2.0) if self.min else self.scale / 2.0
            self.unskipped = 0
        else:
            self.unskipped += 1
        if self.unskipped == self.window and self.dynamic:
            self.scale = min(self.max, self.scale * 2.0)
            self.unskipped = 0
        self.history.append(self.scale)
        return skip


class ApexO2:
    """apex O2 on a copy of ``model`` (fp32): fp16 model, fp32 masters, ``num_losses`` scalers."""

    def __init__(
        self, model: nn.Module, make_opt: Callable[[list], torch.optim.Optimizer], *, num_losses=1, **scale_kw
    ):
        self.model = to_fp16_keep_bn(copy.deepcopy(model))
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.masters = [
            p.detach().clone().float().requires_grad_(True) if p.dtype == torch.float16 else p for p in self.params
        ]
        self.opt = make_opt(self.masters)
        self.scalers = [ApexScale(**scale_kw) for _ in range(num_losses)]
        self.skip = False
        self.scaled_grads = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x.half()).float()

    def backward(
        self, loss: torch.Tensor, loss_id: int = 0, delay_unscale: bool = False, retain_graph: bool = False
    ) -> None:
        scaler = self.scalers[loss_id]
        pairs = [(p, m) for p, m in zip(self.params, self.masters) if p is not m]
        direct = [p for p, m in zip(self.params, self.masters) if p is m]
        stash = {}
        if not delay_unscale and not self.scaled_grads:
            for p, _ in pairs:
                p.grad = None
            for p in direct:
                stash[p] = p.grad
                p.grad = None
        (loss.float() * scaler.scale).backward(retain_graph=retain_graph)
        if delay_unscale:
            self.scaled_grads = True
            return
        self.scaled_grads = False
        inv = 1.0 / scaler.scale
        overflow = False
        with torch.no_grad():
            for p, m in pairs:
                if p.grad is None:
                    continue
                overflow |= not bool(torch.isfinite(p.grad).all())
                new = p.grad.float() * inv
                m.grad = new if m.grad is None else new + m.grad
            overflow |= unscale_with_stash(direct, stash, inv)
        self.skip |= scaler.update(overflow)

    def step(self) -> None:
        if self.skip:
            self.skip = False
        else:
            self.opt.step()
            with torch.no_grad():
                for p, m in zip(self.params, self.masters):
                    if p is not m:
                        p.copy_(m)
        for p, m in zip(self.params, self.masters):
            if p is not m:
                m.grad = None

    def zero_grad(self) -> None:
        for p, m in zip(self.params, self.masters):
            if p.grad is not None:
                p.grad.zero_()
            if p is not m:
                m.grad = None


def plain_step(model: nn.Module, opt: torch.optim.Optimizer, x, y, dtype=torch.float32) -> torch.Tensor:
    """One step of plain training (the O0 / O3 reference: static scale 1.0, no masters)."""
    opt.zero_grad()
    out = model(x.to(dtype)).float()
    loss = nn.functional.mse_loss(out, y)
    loss.float().backward()
    opt.step()
    return loss


class ApexNoMasters:
    """apex without master weights (O0/O1/O3 with a dynamic or static scale != 1): every
    param's grad goes through the stash: ``grad = new * (1/S) + stash``; the optimizer steps
    the model params; a skip leaves them."""

    def __init__(self, model: nn.Module, make_opt, dtype=torch.float32, **scale_kw):
        self.model = copy.deepcopy(model).to(dtype)
        self.dtype = dtype
        self.params = list(self.model.parameters())
        self.opt = make_opt(self.params)
        self.scaler = ApexScale(**scale_kw)
        self.skip = False

    def forward(self, x):
        return self.model(x.to(self.dtype)).float()

    def backward(self, loss):
        stash = {p: p.grad for p in self.params}
        for p in self.params:
            p.grad = None
        (loss.float() * self.scaler.scale).backward()
        with torch.no_grad():
            overflow = unscale_with_stash(self.params, stash, 1.0 / self.scaler.scale)
        self.skip |= self.scaler.update(overflow)

    def step(self):
        if self.skip:
            self.skip = False
        else:
            self.opt.step()
