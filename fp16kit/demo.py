"""The demo behind ``fp16kit demo``: one model trained twice, in fp32 and in mixed precision.

A small MLP learns a synthetic classification task (labels from a fixed random "teacher"
network, so the task is learnable and needs no download). One copy trains in float32; an
identical copy trains under CPU autocast (float16 or bfloat16) with :class:`fp16kit.GradScaler`.
Per epoch the demo reports both losses, the loss scale and the steps the scaler skipped.
This module computes; the CLI prints.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from .grad_scaler import GradScaler

__all__ = ["DemoConfig", "EpochRow", "DemoResult", "run_demo"]


@dataclass(frozen=True)
class DemoConfig:
    epochs: int = 6
    steps_per_epoch: int = 40
    batch_size: int = 128
    dtype: torch.dtype = torch.float16
    lr: float = 3e-3
    seed: int = 0
    init_scale: float = 2.0**16
    growth_interval: int = 50


@dataclass(frozen=True)
class EpochRow:
    epoch: int
    fp32_loss: float
    amp_loss: float
    scale: float
    skipped: int


@dataclass(frozen=True)
class DemoResult:
    config: DemoConfig
    rows: list[EpochRow]
    fp32_accuracy: float
    amp_accuracy: float


def _make_data(cfg: DemoConfig, n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    teacher = nn.Sequential(nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 10))
    with torch.no_grad():
        for p in teacher.parameters():
            p.copy_(torch.randn(p.shape, generator=generator))
        x = torch.randn(n, 32, generator=generator)
        y = teacher(x).argmax(dim=1)
    return x, y


def _accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return (model(x).argmax(dim=1) == y).float().mean().item()


def run_demo(cfg: DemoConfig = DemoConfig()) -> DemoResult:
    """Train the fp32 and the mixed-precision copy side by side; return per-epoch figures."""
    if cfg.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"demo dtype must be torch.float16 or torch.bfloat16, got {cfg.dtype}.")
    g = torch.Generator().manual_seed(cfg.seed)
    n_train = cfg.steps_per_epoch * cfg.batch_size
    x, y = _make_data(cfg, n_train + 2048, g)
    x_train, y_train, x_test, y_test = x[:n_train], y[:n_train], x[n_train:], y[n_train:]

    torch.manual_seed(cfg.seed)
    fp32_model = nn.Sequential(
        nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 10)
    )
    amp_model = copy.deepcopy(fp32_model)
    fp32_opt = torch.optim.AdamW(fp32_model.parameters(), lr=cfg.lr)
    amp_opt = torch.optim.AdamW(amp_model.parameters(), lr=cfg.lr)
    scaler = GradScaler("cpu", init_scale=cfg.init_scale, growth_interval=cfg.growth_interval)
    loss_fn = nn.CrossEntropyLoss()

    rows: list[EpochRow] = []
    for epoch in range(1, cfg.epochs + 1):
        perm = torch.randperm(n_train, generator=g)
        fp32_total = torch.zeros(())
        amp_total = torch.zeros(())
        skipped_before = scaler.skipped_steps()
        for step in range(cfg.steps_per_epoch):
            idx = perm[step * cfg.batch_size : (step + 1) * cfg.batch_size]
            xb, yb = x_train[idx], y_train[idx]

            fp32_opt.zero_grad(set_to_none=True)
            loss = loss_fn(fp32_model(xb), yb)
            loss.backward()
            fp32_opt.step()
            fp32_total += loss.detach()

            amp_opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=cfg.dtype):
                amp_loss = loss_fn(amp_model(xb), yb)
            scaler.scale(amp_loss).backward()
            scaler.step(amp_opt)
            scaler.update()
            amp_total += amp_loss.detach().float()
        rows.append(
            EpochRow(
                epoch=epoch,
                fp32_loss=fp32_total.item() / cfg.steps_per_epoch,
                amp_loss=amp_total.item() / cfg.steps_per_epoch,
                scale=scaler.get_scale(),
                skipped=scaler.skipped_steps() - skipped_before,
            )
        )
    with torch.autocast("cpu", dtype=cfg.dtype):
        amp_acc = _accuracy(amp_model, x_test, y_test)
    return DemoResult(cfg, rows, _accuracy(fp32_model, x_test, y_test), amp_acc)
