"""The demo's task and model: deterministic, no download.

Task: 10-way classification of 32-dimensional Gaussian inputs, labelled by a fixed random
"teacher" network (``argmax(W2 tanh(W1 x + b1) + b2)``), so the labels follow a smooth nonlinear
rule a small MLP can learn. Model: ``Linear(32, h) - GELU - Linear(h, h) - GELU - Linear(h, 10)``.

Same seed, same everything: the teacher, the held-out set, the initial weights and each epoch's
fresh batches come from generators seeded by ``seed`` (and the epoch) alone (the global RNG is neither used nor disturbed), so every
recipe trains the same initial weights on the same batches.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from .config import DemoConfig

__all__ = ["Task", "make_task", "make_model", "loss_fn", "IN_FEATURES", "CLASSES"]

IN_FEATURES = 32
CLASSES = 10


@dataclass(frozen=True)
class Task:
    """The teacher and a fixed held-out set; training batches are drawn fresh per epoch.

    Drawn by :meth:`epoch_batches`, so the model learns the rule rather than a finite sample."""

    teacher: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # w1, b1, w2, b2 (CPU)
    x_eval: torch.Tensor
    y_eval: torch.Tensor
    batch_size: int
    seed: int
    device: torch.device

    def label(self, x: torch.Tensor) -> torch.Tensor:
        w1, b1, w2, b2 = self.teacher
        return (torch.tanh(x @ w1 + b1) @ w2 + b2).argmax(dim=1)

    def epoch_batches(self, epoch: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Epoch ``epoch``'s ``steps`` batches, on the device, the same for every recipe.

        Epoch ``epoch``'s ``steps`` batches, on the device: a function of (seed, epoch) only,
        the same for every recipe."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        x = torch.randn(steps * self.batch_size, IN_FEATURES, generator=g)
        y = self.label(x)
        x, y = x.to(self.device), y.to(self.device)
        return [
            (x[i * self.batch_size : (i + 1) * self.batch_size], y[i * self.batch_size : (i + 1) * self.batch_size])
            for i in range(steps)
        ]


def make_task(cfg: DemoConfig) -> Task:
    """The teacher network and ``eval_size`` held-out samples (seeded by ``cfg.seed``)."""
    g = torch.Generator().manual_seed(cfg.seed)
    w1 = torch.randn(IN_FEATURES, 16, generator=g) / IN_FEATURES**0.5
    b1 = torch.randn(16, generator=g) * 0.1
    w2 = torch.randn(16, CLASSES, generator=g)
    b2 = torch.randn(CLASSES, generator=g) * 0.1
    device = torch.device(cfg.device)
    task = Task((w1, b1, w2, b2), torch.empty(0), torch.empty(0), cfg.batch_size, cfg.seed, device)
    x_eval = torch.randn(cfg.eval_size, IN_FEATURES, generator=g)
    return dataclasses.replace(task, x_eval=x_eval.to(device), y_eval=task.label(x_eval).to(device))


def make_model(cfg: DemoConfig) -> nn.Sequential:
    """The fp32 model every recipe starts from (a fresh copy per call, same weights)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = nn.Sequential(
            nn.Linear(IN_FEATURES, cfg.hidden),
            nn.GELU(),
            nn.Linear(cfg.hidden, cfg.hidden),
            nn.GELU(),
            nn.Linear(cfg.hidden, CLASSES),
        )
    return model.to(cfg.device)


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy computed in fp32, whatever the model's output dtype.

    As mixed-precision code does: the softmax of fp16 logits loses too much in fp16."""
    return nn.functional.cross_entropy(logits.float(), target)
