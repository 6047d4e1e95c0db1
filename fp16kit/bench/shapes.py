"""What the rows run on: lists of parameter shapes (full and ``--quick`` sizes) and small MLPs.

A param list is only shapes: every variant of a row gets its own params with the same initial
values (:func:`initial_values`) and the same 16-bit grads (:func:`fake_grads`, shared tensors),
so their masters can be compared bit for bit. The grads stand for a backward's output under a
loss scale of 2**16 (unit normal values, finite): no step is skipped.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import torch
from torch import nn

__all__ = [
    "MLP",
    "MLP_LIST",
    "Shape",
    "async_models",
    "fake_grads",
    "initial_values",
    "master_grad_shapes",
    "scaler_model",
    "step_shapes",
]

SEED = 0


@dataclass(frozen=True)
class Shape:
    """A named list of parameter shapes."""

    name: str
    sizes: tuple[tuple[int, ...], ...]

    @property
    def params(self) -> int:
        return sum(prod(s) for s in self.sizes)

    @property
    def tensors(self) -> int:
        return len(self.sizes)


def _list(count: int, numel: int) -> tuple[tuple[int, ...], ...]:
    return ((numel,),) * count


def _k(n: int) -> str:
    return f"{n // 1_000_000}M" if n % 1_000_000 == 0 else f"{n // 1000}k"


def uniform(count: int, numel: int) -> Shape:
    return Shape(f"{count} x {_k(numel)}", _list(count, numel))


def _mlp_sizes(layers: int, width: int) -> tuple[tuple[int, ...], ...]:
    return ((width, width), (width,)) * layers


MLP_LIST = Shape("MLP 8 x 256 (16 tensors)", _mlp_sizes(8, 256))
"""The params of a small MLP: the step is Python-bound (few, small tensors)."""


def master_grad_shapes(quick: bool) -> list[Shape]:
    """Row 1: many small tensors and few large ones."""
    if quick:
        return [uniform(2000, 1000), uniform(8, 1_000_000)]
    return [uniform(8000, 1000), uniform(40, 1_000_000)]


def step_shapes(quick: bool) -> list[Shape]:
    """Row 2: a mixed list (24 x 1M + 600 x 1k = 24.6M params; --quick: 4 x 1M + 100 x 1k) and a small MLP's."""
    big, small = (4, 100) if quick else (24, 600)
    mixed = Shape(
        f"{big} x 1M + {small} x 1k ({(big * 1_000_000 + small * 1000) / 1e6:.1f}M)",
        _list(big, 1_000_000) + _list(small, 1000),
    )
    return [mixed, MLP_LIST]


def initial_values(shape: Shape, dtype: torch.dtype, device: torch.device | str) -> list[torch.Tensor]:
    """The same initial values for every variant (seeded), rounded to ``dtype``."""
    g = torch.Generator().manual_seed(SEED)
    return [(torch.randn(s, generator=g) * 0.02).to(device, dtype) for s in shape.sizes]


def fake_grads(shape: Shape, dtype: torch.dtype, device: torch.device | str) -> list[torch.Tensor]:
    """The grads every variant's "backward" attaches (seeded, finite)."""
    g = torch.Generator().manual_seed(SEED + 1)
    return [torch.randn(s, generator=g).to(device, dtype) for s in shape.sizes]


@dataclass(frozen=True)
class MLP:
    """A small MLP trained on one fixed batch: ``layers`` x Linear(width, width) + GELU, then Linear(width, 16)."""

    name: str
    layers: int
    width: int
    batch: int

    def build(self, dtype: torch.dtype, device: torch.device | str) -> nn.Module:
        torch.manual_seed(SEED)
        mods: list[nn.Module] = []
        for _ in range(self.layers):
            mods += [nn.Linear(self.width, self.width), nn.GELU()]
        return nn.Sequential(*mods, nn.Linear(self.width, 16)).to(device, dtype)

    def batch_data(self, dtype: torch.dtype, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(SEED + 2)
        x = torch.randn(self.batch, self.width, generator=g).to(device, dtype)
        y = torch.randn(self.batch, 16, generator=g).to(device)
        return x, y


def scaler_model(quick: bool) -> MLP:
    """Row 3: an fp32 MLP whose step is a fair share of the iteration (the scaler's overhead shows)."""
    return MLP("fp32 MLP 4 x 256, batch 64", 4, 256, 64)


def async_models(quick: bool) -> list[MLP]:
    """Row 4: where the optimizer step dominates, where it balances forward/backward, where matmuls do.

    (benchmarks/async_overlap.py's balanced point is 24 x 256 at batch 8.)"""
    layers, batch = (12, 256) if quick else (24, 512)
    return [
        MLP(f"step-heavy: bf16 MLP {layers} x 256, batch 1", layers, 256, 1),
        MLP(f"balanced: bf16 MLP {layers} x 256, batch 8", layers, 256, 8),
        MLP(f"matmul-heavy: bf16 MLP 4 x 512, batch {batch}", 4, 512, batch),
    ]
